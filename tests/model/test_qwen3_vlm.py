"""Qwen3-VL's vision-language models: their parts counted by hand against the published parameter counts (the
language models against the catalog's Qwen3-8B / Qwen3-32B rows), the images as the installed transformers' processor
makes them (Qwen2-VL's, built offline from the shipped preprocessor_config.json), and the micro-batch's tensors in
bytes worked out by hand."""

from __future__ import annotations

import pytest
from llamafactory_vlm import estimate_from_yaml
from qwen_processor import processed, qwen_processor

from llmem.cli import main
from llmem.errors import LlmemError
from llmem.memory.activations.learned import LEARN_ENV
from llmem.memory.activations.profile import vision_batch_bytes
from llmem.model.anatomy import load_anatomy
from llmem.model.images import image_grid, pixel_values_shape, processor_settings
from llmem.model.vision import LANGUAGE, PROJECTOR, VISION, part_of, part_params, vision_spec
from llmem.model.vision_inputs import vision_inputs
from llmem.setup.training import TrainingSetup

np = pytest.importorskip("numpy")


def _merger(hidden: int, out: int, postshuffle: bool, merge: int = 2) -> int:
    """Qwen3VLVisionPatchMerger: a LayerNorm (weight and bias) over `hidden` (over the merged width h*m^2 for the
    deepstack mergers' post-shuffle norm), then Linear(h*m^2, h*m^2) + GELU + Linear(h*m^2, out), biased."""
    wide = hidden * merge * merge
    return 2 * (wide if postshuffle else hidden) + (wide * wide + wide) + (wide * out + out)


def _tower(hidden: int, mlp: int, depth: int, out: int, deepstack: int = 3, patch: int = 16, temporal: int = 2,
           positions: int = 2304) -> int:
    """The vision tower less the merger, by hand: a biased Conv3d patch embedding (3 x temporal x patch x patch ->
    hidden), the learned position table (positions x hidden), `depth` blocks of two biased LayerNorms, a biased qkv
    and proj and a biased fc1 / fc2 MLP, and the deepstack mergers (LLaMA-Factory's qwen3_vl row counts them with the
    tower: vision_model_keys ... visual.deepstack_merger_list)."""
    embed = 3 * temporal * patch * patch * hidden + hidden + positions * hidden
    block = 2 * 2 * hidden + (hidden * 3 * hidden + 3 * hidden) + (hidden * hidden + hidden) \
        + (hidden * mlp + mlp) + (mlp * hidden + hidden)
    return embed + depth * block + deepstack * _merger(hidden, out, postshuffle=True)


def _qwen3_language(hidden: int, mlp: int, layers: int, heads: int, kv_heads: int, tied: bool,
                    head_dim: int = 128, vocab: int = 151_936) -> int:
    """Qwen3's decoder: embeddings, layers (bias-free q/k/v/o, q and k RMSNorms over a head, a SwiGLU MLP, two
    RMSNorms), the final norm, the lm_head unless tied."""
    layer = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden + 2 * head_dim \
        + 3 * hidden * mlp + 2 * hidden
    return vocab * hidden * (1 if tied else 2) + layers * layer + hidden


@pytest.mark.parametrize(("model", "published", "vision", "projector", "language"), [
    # published counts: HF safetensors metadata (2B / 4B / 8B); the 32B's the sum of its parts (its language model
    # is Qwen3-32B's, checked below). Shapes from each published config.json's vision_config / text_config
    ("Qwen/Qwen3-VL-2B-Instruct", 2_127_532_032, _tower(1024, 4096, 24, 2048), _merger(1024, 2048, False),
     _qwen3_language(2048, 6144, 28, 16, 8, tied=True)),
    ("Qwen/Qwen3-VL-4B-Instruct", 4_437_815_808, _tower(1024, 4096, 24, 2560), _merger(1024, 2560, False),
     _qwen3_language(2560, 9728, 36, 32, 8, tied=True)),
    ("Qwen/Qwen3-VL-8B-Instruct", 8_767_123_696, _tower(1152, 4304, 27, 4096), _merger(1152, 4096, False),
     _qwen3_language(4096, 12288, 36, 32, 8, tied=False)),
    ("Qwen/Qwen3-VL-32B-Instruct", 33_357_390_064, _tower(1152, 4304, 27, 5120), _merger(1152, 5120, False),
     _qwen3_language(5120, 25600, 64, 64, 8, tied=False)),
])
def test_parts_by_hand_add_up_to_the_published_count(model, published, vision, projector, language):
    anatomy = load_anatomy(model)
    assert part_params(anatomy) == {VISION: vision, PROJECTOR: projector, LANGUAGE: language}
    assert anatomy.total_params == published
    assert anatomy.architecture == "Qwen3VLForConditionalGeneration"
    assert anatomy.decoder_layer_class == "Qwen3VLTextDecoderLayer"


@pytest.mark.parametrize(("model", "text"), [("Qwen/Qwen3-VL-8B-Instruct", "Qwen/Qwen3-8B"),
                                              ("Qwen/Qwen3-VL-32B-Instruct", "Qwen/Qwen3-32B")])
def test_the_language_model_is_the_text_rows(model, text):
    """The 8B's and 32B's language models are Qwen3-8B's and Qwen3-32B's (their published counts in the catalog)."""
    assert part_params(load_anatomy(model))[LANGUAGE] == load_anatomy(text).total_params


def test_tiny_parts_by_hand():
    anatomy = load_anatomy("tiny-qwen3_vl")
    assert part_params(anatomy) == {
        VISION: _tower(128, 344, 4, 512, positions=256), PROJECTOR: _merger(128, 512, False),
        LANGUAGE: _qwen3_language(512, 1408, 4, 8, 2, tied=False, head_dim=64, vocab=16_000)}


def test_the_deepstack_mergers_are_the_towers():
    """LLaMA-Factory's qwen3_vl row: projector_keys visual.merger; the deepstack mergers and the position table among
    vision_model_keys (freeze_vision_tower freezes them, freeze_multi_modal_projector does not)."""
    spec = vision_spec("qwen3_vl")
    assert part_of(spec, "model.visual.deepstack_merger_list.2.linear_fc2.weight") == VISION
    assert part_of(spec, "model.visual.pos_embed.weight") == VISION
    assert part_of(spec, "model.visual.merger.linear_fc1.weight") == PROJECTOR
    assert part_of(spec, "base_model.model.model.visual.merger.norm.bias") == PROJECTOR


@pytest.fixture(scope="module")
def processor():
    """transformers' Qwen2-VL image processor from the shipped config (tests/qwen_processor.py)."""
    return qwen_processor("qwen3_vl")


_SLOW = pytest.mark.slow      # the processor resizes the real pixels: seconds for the largest images


@pytest.mark.parametrize(("height", "width"), [
    (1024, 768), (768, 1024), (448, 448), (224, 224), (32, 32), (20, 30), (1, 150), (10, 1000), (1080, 1920),
    (333, 517), (64, 12800), pytest.param(4000, 3000, marks=_SLOW), pytest.param(6000, 8000, marks=_SLOW)])
def test_grid_and_tokens_equal_the_processors(processor, height, width):
    (rows, row_width), thw = processed(processor, height, width)
    grid = image_grid("qwen3_vl", height, width)
    assert (grid.grid_t, grid.grid_h, grid.grid_w) == thw
    assert pixel_values_shape("qwen3_vl", grid, 1) == (rows, row_width)
    assert grid.tokens == rows // 4          # Qwen3VLProcessor.replace_image_token: grid.prod() // merge_size**2


@pytest.mark.parametrize("max_pixels", [589_824, 262_144, 100_000])      # all under the image's 750,000 pixels
def test_max_pixels_bounds_as_the_processor(processor, max_pixels):
    (rows, _), thw = processed(processor, 1000, 750, size={"shortest_edge": 65_536, "longest_edge": max_pixels})
    grid = image_grid("qwen3_vl", 1000, 750, max_pixels)
    assert grid.height * grid.width <= max_pixels
    assert ((grid.grid_t, grid.grid_h, grid.grid_w), grid.patches) == (thw, rows)


def test_worked_examples():
    # 1024x768: both already multiples of 32 (patch 16 x merge 2), 786,432 px within [65,536, 16,777,216]:
    # 64 x 48 patches of 16 px = 3,072, merged 2x2 into 768 tokens; a patch's values 3 x 2 x 16 x 16
    grid = image_grid("qwen3_vl", 1024, 768)
    assert (grid.height, grid.width, grid.patches, grid.tokens, grid.patch_values) == (1024, 768, 3072, 768, 1536)
    # 224x224 is under min_pixels 65,536 (256^2): beta = sqrt(65,536 / 50,176); ceil(224 * beta / 32) * 32 = 256
    grid = image_grid("qwen3_vl", 224, 224)
    assert (grid.height, grid.width, grid.tokens) == (256, 256, 64)
    # 1080x1920: round(1080 / 32) * 32 = 1088, 1920 = 60 x 32: 68 x 120 patches, 2,040 tokens
    grid = image_grid("qwen3_vl", 1080, 1920)
    assert (grid.height, grid.width, grid.tokens) == (1088, 1920, 2040)


def test_processor_matches_the_models_vision_config():
    """The patches the processor cuts are the ones the model's patch embedding takes, for every catalog size."""
    settings = processor_settings(vision_spec("qwen3_vl").processor)
    assert (settings.min_pixels, settings.max_pixels) == (65_536, 16_777_216)
    for size in ("2B", "4B", "8B", "32B"):
        vision = load_anatomy(f"Qwen/Qwen3-VL-{size}-Instruct").config["vision_config"]
        assert (settings.patch_size, settings.temporal_patch_size, settings.merge_size) == \
            (vision["patch_size"], vision["temporal_patch_size"], vision["spatial_merge_size"])


def test_batch_bytes_by_hand():
    setup = TrainingSetup("Qwen/Qwen3-VL-8B-Instruct", batch_size=2, seq_len=512, images_per_sample=2,
                          image_size="1024x768")
    inputs = vision_inputs(setup, load_anatomy(setup.model))
    assert (inputs.visual_tokens, inputs.language_tokens, inputs.patches) == (1536, 2048, 6144)
    # ids [2, 2048] int64; pixel_values [2 x 6144 patches, 1536] fp32; the 3-D rope positions [3, 2, 2048] int64
    assert vision_batch_bytes(load_anatomy(setup.model), setup) == (2 * 2048 * 8, 2 * 6144 * 1536 * 4,
                                                                    3 * 2 * 2048 * 8)


def test_an_aspect_ratio_the_processor_refuses(processor):
    with pytest.raises(ValueError, match="aspect ratio"):
        processed(processor, 10, 2010)
    with pytest.raises(LlmemError, match="aspect ratio over 200"):
        image_grid("qwen3_vl", 10, 2010)


def test_llamafactory_config_names_the_model(tmp_path, capsys, monkeypatch):
    """LLaMA-Factory's qwen3_vl template and image_max_pixels through --from: the processor's bound (--max-pixels),
    the tower and projector frozen by its defaults."""
    monkeypatch.setenv(LEARN_ENV, "auto")
    out = estimate_from_yaml(tmp_path, capsys, "qwen3vl.yaml",
                             "model_name_or_path: Qwen/Qwen3-VL-2B-Instruct\nstage: sft\nfinetuning_type: lora\n"
                             "lora_target: all\ntemplate: qwen3_vl\ncutoff_len: 1024\nimage_max_pixels: 262144\n"
                             "per_device_train_batch_size: 1\nbf16: true\n")
    assert out["setup"]["max_pixels"] == 262_144
    # 1024x768 bounded to 262,144 px: beta = sqrt(786,432 / 262,144) = sqrt(3); floor(1024 / beta / 32) * 32 = 576,
    # floor(768 / beta / 32) * 32 = 416: 36 x 26 patches, 234 tokens
    assert any("resized to 576x416" in note and "234 visual tokens" in note for note in out["notes"])


@pytest.mark.parametrize(("args", "says"), [
    (["--images-per-sample", "1", "--image-size", "10x2010"], "aspect ratio over 200"),
    (["--images-per-sample", "1", "--image-size", "448x448", "--method", "tp", "--gpus", "2"],
     "--method tp is not wired for it yet"),
    (["--seq-len", "64"], "a text-only step is not wired"),
])
def test_refusals_are_one_line(capsys, args, says):
    code = main(["estimate", "tiny-qwen3_vl", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("llmem: error: ") and err.count("\n") == 1 and says in err, err
