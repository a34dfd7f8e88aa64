"""LLaVA-OneVision's vision-language models: their parts counted by hand against the published parameter counts, the
images as the installed transformers' LLaVA-OneVision processor makes them (its image processor built offline from
the shipped preprocessor_config.json, its processor from the published processor_config.json's values with a
word-level tokenizer made here), worked examples by hand, and --from of LLaMA-Factory and axolotl configs."""

from __future__ import annotations

import json
import warnings

import pytest
from llamafactory_vlm import estimate_from_yaml

from llmem.cli import main
from llmem.memory.activations.learned import LEARN_ENV
from llmem.memory.activations.profile import vision_batch_bytes
from llmem.model.anatomy import load_anatomy
from llmem.model.catalog import catalog_file
from llmem.model.images import PROCESSORS, anyres_grid, image_grid, pixel_values_shape, prescaled
from llmem.model.vision import LANGUAGE, PROJECTOR, VISION, part_params
from llmem.model.vision_inputs import vision_inputs
from llmem.setup.sources import setup_from_file
from llmem.setup.training import TrainingSetup

np = pytest.importorskip("numpy")

SMALL, LARGE = "llava-hf/llava-onevision-qwen2-0.5b-ov-hf", "llava-hf/llava-onevision-qwen2-7b-ov-hf"


def _siglip(hidden: int = 1152, mlp: int = 4304, layers: int = 26, patch: int = 14, image: int = 384) -> int:
    """SigLIP's vision tower (no head): a biased Conv2d patch embedding, a position embedding per patch, `layers`
    blocks of two biased LayerNorms, biased q/k/v/out projections and a biased fc1/fc2 MLP, a final LayerNorm."""
    embed = 3 * patch * patch * hidden + hidden + (image // patch) ** 2 * hidden
    block = 2 * 2 * hidden + 4 * (hidden * hidden + hidden) + (hidden * mlp + mlp) + (mlp * hidden + hidden)
    return embed + layers * block + 2 * hidden


def _qwen2(hidden: int, mlp: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool) -> int:
    """Qwen2's language model: embeddings, layers (biased q/k/v, bias-free o, a gated MLP, two RMSNorms), the final
    norm, an lm_head of its own when untied."""
    head_dim = hidden // heads
    layer = (hidden * hidden + hidden) + 2 * (hidden * kv_heads * head_dim + kv_heads * head_dim) \
        + hidden * hidden + 3 * hidden * mlp + 2 * hidden
    return vocab * hidden * (1 if tied else 2) + layers * layer + hidden


@pytest.mark.parametrize(("model", "published", "language"), [
    # published counts (HF safetensors metadata: 894M, 8.03B); the language models' shapes from the published
    # text_config (Qwen2-0.5B / Qwen2-7B with vocabularies of 152,000 / 152,128), the image_newline vector with it
    (SMALL, 893_675_552, _qwen2(896, 4864, 24, 14, 2, 152_000, tied=True) + 896),
    (LARGE, 8_030_807_584, _qwen2(3584, 18944, 28, 28, 4, 152_128, tied=False) + 3584),
])
def test_parts_by_hand_add_up_to_the_published_count(model, published, language):
    anatomy = load_anatomy(model)
    hidden = anatomy.hidden_size
    projector = (1152 * hidden + hidden) + (hidden * hidden + hidden)     # linear_1, GELU, linear_2, biased
    assert part_params(anatomy) == {VISION: _siglip(), PROJECTOR: projector, LANGUAGE: language}
    assert anatomy.total_params == published
    assert round(published / 1e6) in (894, 8031)


def test_tiny_parts_by_hand():
    anatomy = load_anatomy("tiny-llava_onevision")
    assert part_params(anatomy) == {VISION: _siglip(128, 344, 4, 48, 384),
                                    PROJECTOR: (128 * 256 + 256) + (256 * 256 + 256),
                                    LANGUAGE: _qwen2(256, 688, 4, 4, 2, 16_000, tied=True) + 256}


@pytest.fixture(scope="module")
def processor():
    """transformers' LLaVA-OneVision processor: its image processor (PIL backend) from the shipped
    preprocessor_config.json, num_image_tokens 729, vision_feature_select_strategy "full" and vision_aspect_ratio
    "anyres_max_9" as the published processor_config.json gives them, a word-level tokenizer knowing <image>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor
    from transformers.processing_utils import ProcessorMixin

    raw = json.loads(catalog_file("processors", PROCESSORS["llava_onevision"].config_file))
    assert raw["image_processor_type"] == PROCESSORS["llava_onevision"].image_processor_type
    images = LlavaOnevisionImageProcessorPil(**{k: v for k, v in raw.items()
                                                if k not in ("image_processor_type", "processor_class")})
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "x": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]})
    # (its video processor, which this transformers cannot check offline without torchvision's, is not wanted here)
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda *a, **k: None
    try:
        return LlavaOnevisionProcessor(image_processor=images, tokenizer=tokenizer, num_image_tokens=729,
                                       vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9")
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def _processed(processor, sizes: list[tuple[int, int]]):
    """One sample holding images of `sizes`: (pixel_values' shape, image_sizes, its <image> tokens)."""
    from PIL import Image

    images = [Image.fromarray(np.zeros((h, w, 3), dtype=np.uint8)) for h, w in sizes]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = processor(text=["x " + "<image>" * len(sizes) + " x"], images=[images], return_tensors="np")
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    return out["pixel_values"].shape, out["image_sizes"].tolist(), int((out["input_ids"] == image_id).sum())


SIZES = [(1024, 768), (768, 1024), (384, 384), (224, 224), (448, 448), (768, 1152), (1536, 1536), (2000, 3000),
         (1080, 1920), (500, 333), (10, 2000), (4000, 100), (2304, 2304), (3000, 3000)]


@pytest.mark.parametrize(("height", "width"), SIZES)
def test_one_image_tiles_and_tokens_equal_the_processors(processor, height, width):
    config = load_anatomy(SMALL).config
    shape, image_sizes, tokens = _processed(processor, [(height, width)])
    grid = image_grid("llava_onevision", height, width, config=config)
    assert shape == pixel_values_shape("llava_onevision", grid, 1)        # [1, base crop + tiles, 3, 384, 384]
    assert image_sizes == [list(grid.original)] == [[height, width]]
    assert grid.tokens == tokens


@pytest.mark.parametrize(("height", "width"), [(1024, 768), (224, 224), (3000, 3000)])
def test_two_images_a_sample_take_one_crop_each(processor, height, width):
    grid = image_grid("llava_onevision", height, width, config=load_anatomy(SMALL).config, images_per_sample=2)
    shape, _, tokens = _processed(processor, [(height, width)] * 2)
    assert shape == pixel_values_shape("llava_onevision", grid, 2) == (2, 1, 3, 384, 384)
    assert 2 * grid.tokens == tokens == 2 * (729 + 1)                    # the crop's patches and one newline


@pytest.mark.parametrize("max_pixels", [768 * 768, 512 * 512])
def test_llamafactory_prescale_then_the_processor(processor, max_pixels):
    """LLaMA-Factory's image_max_pixels scales the image first (int(side * sqrt(bound / area)) a side); the processor
    tiles what it is given."""
    config = load_anatomy(SMALL).config
    height, width = prescaled(1024, 768, max_pixels, None)
    _, image_sizes, tokens = _processed(processor, [(height, width)])
    grid = image_grid("llava_onevision", 1024, 768, max_pixels, config=config)
    assert [list(grid.original)] == image_sizes and grid.tokens == tokens
    assert height * width <= max_pixels


def test_worked_examples():
    config = load_anatomy(SMALL).config                 # 384x384 crops, 27 x 27 patches of 14 px (729 tokens a crop)
    # 768x1152: pinpoint 768x1152 exactly, 2 x 3 tiles: the tiles' features 54 x 81, nothing to unpad,
    # sqrt(54 * 81 / (9 * 729)) = 0.82: not pooled; 729 + 54 * 81 + 54 newlines
    grid = anyres_grid(config, 768, 1152)
    assert (grid.crops, grid.tokens, grid.patches) == (7, 729 + 54 * 81 + 54, 7 * 729)
    # 1536x1536: 4 x 4 tiles, 108 x 108, ratio sqrt(108^2 / (9 * 729)) = 4/3 > 1.1: pooled to int(108 // (4/3)) = 81
    grid = anyres_grid(config, 1536, 1536)
    assert (grid.crops, grid.tokens) == (17, 729 + 81 * 81 + 81)
    # 768x1024 on pinpoint 768x1152 (all its pixels kept, the least padding): 54 x 81 features, the image 1024 * 54
    # / 768 = 72 columns wide, (81 - 72) // 2 = 4 padding columns each side unpadded: 54 x 73 and 54 newlines
    assert anyres_grid(config, 768, 1024).tokens == 729 + 54 * 73 + 54
    assert anyres_grid(config, 768, 1024, images_per_sample=3).tokens == 730


def test_processor_matches_the_models_config():
    raw = json.loads(catalog_file("processors", PROCESSORS["llava_onevision"].config_file))
    for model in (SMALL, LARGE, "tiny-llava_onevision"):
        config = load_anatomy(model).config
        assert raw["image_grid_pinpoints"] == config["image_grid_pinpoints"]
        assert raw["size"] == {"height": config["vision_config"]["image_size"],
                               "width": config["vision_config"]["image_size"]}
        assert config["vision_feature_select_strategy"] == "full" and config["vision_feature_layer"] == -1


def test_batch_bytes_by_hand():
    setup = TrainingSetup("tiny-llava_onevision", batch_size=2, seq_len=64, images_per_sample=1, image_size="768x1152")
    inputs = vision_inputs(setup, load_anatomy(setup.model))
    # the tiny tower's 384x384 crops of 48 px patches: 8 x 8 a crop, 2 x 3 tiles: 16 x 24 and 16 newlines
    assert (inputs.visual_tokens, inputs.language_tokens, inputs.patches) == (64 + 16 * 24 + 16, 528, 7 * 64)
    # ids [2, 528] int64, pixel_values [2, 7, 3, 384, 384] fp32 (image_sizes and batch_num_images, a few bytes,
    # are read on the host by the trace); no position ids, no token types
    assert vision_batch_bytes(load_anatomy(setup.model), setup) == (2 * 528 * 8, 2 * 7 * 3 * 384 * 384 * 4)


def test_llamafactory_config_names_the_model(tmp_path, capsys, monkeypatch, processor):
    """LLaMA-Factory's image_max_pixels (768 x 768, its default) scales a 1024x768 image to 886x665 first."""
    monkeypatch.setenv(LEARN_ENV, "auto")
    out = estimate_from_yaml(tmp_path, capsys, "llava.yaml",
                             f"model_name_or_path: {SMALL}\nstage: sft\nfinetuning_type: lora\nlora_target: all\n"
                             "template: llava_next\ncutoff_len: 8192\nfreeze_vision_tower: true\n"
                             "image_max_pixels: 589824\nper_device_train_batch_size: 1\nbf16: true\n")
    assert out["setup"]["max_pixels"] == 768 * 768
    _, sizes, tokens = _processed(processor, [(886, 665)])
    assert sizes == [[886, 665]]
    assert any(f"{tokens:,} visual tokens" in note for note in out["notes"]), out["notes"]


def test_axolotl_config_names_the_model(tmp_path):
    path = tmp_path / "axolotl.yaml"
    path.write_text(f"base_model: {LARGE}\nprocessor_type: AutoProcessor\nskip_prepare_dataset: true\n"
                    "remove_unused_columns: false\nsample_packing: false\nchat_template: llava\n"
                    "datasets:\n  - path: HuggingFaceH4/llava-instruct-mix-vsft\n    type: chat_template\n"
                    "sequence_len: 4096\nadapter: lora\nlora_r: 16\nlora_alpha: 32\n"
                    "lora_target_modules: 'model.language_model.layers.[\\d]+.(mlp|self_attn).(up|down|gate|q|k|v|o)_proj'\n"
                    "micro_batch_size: 1\nbf16: true\nimage_size: [768, 1152]\n")
    setup = setup_from_file(path, images_per_sample=1).setup
    assert (setup.model, setup.image_size) == (LARGE, "768x1152")
    inputs = vision_inputs(setup, load_anatomy(LARGE))
    assert inputs.image.tokens == 729 + 54 * 81 + 54


@pytest.mark.parametrize(("args", "says"), [
    (["--images-per-sample", "1", "--image-size", "448x448", "--method", "tp", "--gpus", "2"],
     "--method tp is not wired for it yet"),
    (["--seq-len", "64"], "a text-only step is not wired"),
    (["--images-per-sample", "1", "--image-size", "448"], "give the height and width in pixels as HxW"),
])
def test_refusals_are_one_line(capsys, args, says):
    code = main(["estimate", "tiny-llava_onevision", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("llmem: error: ") and err.count("\n") == 1 and says in err, err
