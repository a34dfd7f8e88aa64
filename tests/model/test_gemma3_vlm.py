"""Gemma 3's vision-language models: their parts counted by hand against the published parameter counts, the images
as the installed transformers' Gemma 3 processor makes them (built offline from the shipped
preprocessor_config.json), and the micro-batch's tensors in bytes worked out by hand."""

from __future__ import annotations

import json
import warnings

import pytest

from llmem.cli import main
from llmem.memory.activations.profile import vision_batch_bytes
from llmem.model.anatomy import load_anatomy
from llmem.model.catalog import catalog_file
from llmem.model.images import PROCESSORS, fixed_grid, image_grid, pixel_values_shape
from llmem.model.vision import LANGUAGE, PROJECTOR, VISION, part_params, vision_spec
from llmem.model.vision_inputs import vision_inputs
from llmem.setup.training import TrainingSetup

np = pytest.importorskip("numpy")


def _siglip(hidden: int = 1152, mlp: int = 4304, layers: int = 27, patch: int = 14, image: int = 896) -> int:
    """SigLIP's vision tower (no head): a biased Conv2d patch embedding, a position embedding per patch, `layers`
    blocks of two biased LayerNorms, biased q/k/v/out projections and a biased fc1/fc2 MLP, a final LayerNorm."""
    embed = 3 * patch * patch * hidden + hidden + (image // patch) ** 2 * hidden
    block = 2 * 2 * hidden + 4 * (hidden * hidden + hidden) + (hidden * mlp + mlp) + (mlp * hidden + hidden)
    return embed + layers * block + 2 * hidden


def _gemma3_text(hidden: int, mlp: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                 vocab: int = 262_208) -> int:
    """Gemma 3's language model, tied: embeddings, layers (bias-free q/k/v/o, q and k norms over a head, a gated
    MLP, four RMSNorms), the final norm."""
    layer = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden + 2 * head_dim \
        + 3 * hidden * mlp + 4 * hidden
    return vocab * hidden + layers * layer + hidden


@pytest.mark.parametrize(("model", "published", "language"), [
    # HF safetensors metadata of each checkpoint; the language models' shapes from the published text_config
    ("google/gemma-3-4b-it", 4_300_079_472, _gemma3_text(2560, 10240, 34, 8, 4, 256)),
    ("google/gemma-3-12b-it", 12_187_325_040, _gemma3_text(3840, 15360, 48, 16, 8, 256)),
    ("google/gemma-3-27b-it", 27_432_406_640, _gemma3_text(5376, 21504, 62, 32, 16, 128)),
])
def test_parts_by_hand_add_up_to_the_published_count(model, published, language):
    anatomy = load_anatomy(model)
    # the projector: the RMSNorm over the vision width and the [vision, text] projection matrix
    projector = 1152 + 1152 * anatomy.hidden_size
    assert part_params(anatomy) == {VISION: _siglip(), PROJECTOR: projector, LANGUAGE: language}
    assert anatomy.total_params == published
    assert anatomy.tied_names == ("lm_head.weight",)
    assert anatomy.decoder_layer_class == "Gemma3DecoderLayer"


def test_the_27b_language_model_is_the_text_rows():
    """google/gemma-3-27b-pt's row (its text_config as Gemma3ForCausalLM) is the -it VLM's language model."""
    assert part_params(load_anatomy("google/gemma-3-27b-it"))[LANGUAGE] == load_anatomy("google/gemma-3-27b-pt") \
        .total_params
    assert vision_spec("gemma3_text") is None


def test_tiny_parts_by_hand():
    anatomy = load_anatomy("tiny-gemma3")
    assert part_params(anatomy) == {VISION: _siglip(128, 344, 4, 14, 224), PROJECTOR: 128 + 128 * 256,
                                    LANGUAGE: _gemma3_text(256, 688, 4, 4, 2, 64, vocab=16_000)}


@pytest.fixture(scope="module")
def processor():
    """transformers' Gemma 3 image processor (its PIL backend) from the shipped preprocessor_config.json."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    raw = json.loads(catalog_file("processors", PROCESSORS["gemma3"].config_file))
    assert raw["image_processor_type"] == PROCESSORS["gemma3"].image_processor_type
    return Gemma3ImageProcessorPil(**{k: v for k, v in raw.items()
                                      if k not in ("image_processor_type", "processor_class", "image_seq_length")})


@pytest.mark.parametrize(("height", "width"), [(1024, 768), (768, 1024), (896, 896), (20, 30), (1080, 1920),
                                               (10, 2010)])
def test_every_image_is_one_896_crop(processor, height, width):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = processor(images=[np.zeros((height, width, 3), dtype=np.uint8)], input_data_format="channels_last",
                        return_tensors="np")
    grid = image_grid("gemma3", height, width, config=load_anatomy("google/gemma-3-4b-it").config)
    assert out["pixel_values"].shape == pixel_values_shape("gemma3", grid, 1) == (1, 3, 896, 896)
    assert out["pixel_values"].dtype == np.float32
    assert list(out["num_crops"]) == [0]              # pan-and-scan off: no crops beside the image
    # the patches the tower embeds, the tokens the projector pools them to (the processor's image_seq_length)
    assert (grid.grid_h, grid.grid_w, grid.patches, grid.tokens) == (64, 64, 4096, 256)
    assert grid.patches * grid.patch_values == out["pixel_values"].size      # 3 x 14 x 14 values a patch


def test_processor_matches_the_models_config():
    raw = json.loads(catalog_file("processors", PROCESSORS["gemma3"].config_file))
    for model in ("google/gemma-3-4b-it", "google/gemma-3-12b-it", "google/gemma-3-27b-it"):
        config = load_anatomy(model).config
        assert raw["size"] == {"height": config["vision_config"]["image_size"],
                               "width": config["vision_config"]["image_size"]}
        assert raw["image_seq_length"] == config["mm_tokens_per_image"] == fixed_grid(config).tokens
    assert not raw["do_pan_and_scan"]


def test_batch_bytes_by_hand():
    setup = TrainingSetup("google/gemma-3-4b-it", batch_size=2, seq_len=512, images_per_sample=2,
                          image_size="1024x768")
    inputs = vision_inputs(setup, load_anatomy(setup.model))
    assert (inputs.visual_tokens, inputs.language_tokens, inputs.patches) == (512, 1024, 8192)
    # ids [2, 1024] int64; pixel_values [4, 3, 896, 896] fp32; token_type_ids [2, 1024] int64 (no position ids:
    # the model makes its own)
    assert vision_batch_bytes(load_anatomy(setup.model), setup) == (2 * 1024 * 8, 4 * 3 * 896 * 896 * 4,
                                                                    2 * 1024 * 8)


def test_a_pixel_bound_changes_nothing():
    """LLaMA-Factory's image_max_pixels (--max-pixels) scales a large image down first; Gemma 3's processor then
    resizes it to 896x896 all the same."""
    config = load_anatomy("google/gemma-3-4b-it").config
    assert image_grid("gemma3", 1024, 768, max_pixels=768 * 768, config=config) == image_grid("gemma3", 1024, 768,
                                                                                              config=config)


def test_pan_and_scan_is_refused(tmp_path, capsys):
    path = tmp_path / "gemma3.yaml"
    path.write_text("model_name_or_path: google/gemma-3-4b-it\nstage: sft\nfinetuning_type: lora\n"
                    "template: gemma3\ncutoff_len: 1024\nimage_do_pan_and_scan: true\n")
    code = main(["estimate", "--from", str(path), "--images-per-sample", "1", "--image-size", "1024x768"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "pan-and-scan" in err and "\n" not in err


@pytest.mark.parametrize(("args", "says"), [
    (["--attn", "flash"], "_supports_flash_attn is False"),
    (["--method", "tp", "--gpus", "2"], "--method tp is not wired for it yet"),
])
def test_refusals_are_one_line(capsys, args, says):
    code = main(["estimate", "tiny-gemma3", "--images-per-sample", "1", "--image-size", "896x896", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and says in err and "\n" not in err
