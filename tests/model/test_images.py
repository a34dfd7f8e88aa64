"""Images as Qwen2.5-VL's processor makes them: llmem's patch grid and visual tokens equal the installed transformers'
processor's own output, the processor built offline from the shipped preprocessor_config.json."""

from __future__ import annotations

import pytest
from qwen_processor import processed, qwen_processor

from llmem.cli import main
from llmem.errors import LlmemError
from llmem.model.anatomy import load_anatomy
from llmem.model.images import image_grid, processor_settings
from llmem.model.vision import vision_spec
from llmem.model.vision_inputs import vision_inputs
from llmem.setup.training import TrainingSetup

np = pytest.importorskip("numpy")

_SLOW = pytest.mark.slow      # the processor resizes the real pixels: seconds each for the largest images
SIZES = [(1024, 768), (768, 1024), (224, 224), (28, 28), (20, 30), (1, 150), (10, 1000), (1080, 1920), (333, 517),
         (56, 11200), pytest.param(4000, 3000, marks=_SLOW), pytest.param(8000, 6000, marks=_SLOW),
         pytest.param(3584, 3584, marks=_SLOW)]


@pytest.fixture(scope="module")
def processor():
    """transformers' Qwen2-VL image processor from the shipped config (tests/qwen_processor.py)."""
    return qwen_processor("qwen2_vl")


@pytest.mark.parametrize(("height", "width"), SIZES)
def test_grid_and_tokens_equal_the_processors(processor, height, width):
    (rows, row_width), thw = processed(processor, height, width)
    grid = image_grid("qwen2_vl", height, width)
    assert (grid.grid_t, grid.grid_h, grid.grid_w) == thw
    assert (grid.patches, grid.patch_values) == (rows, row_width)
    assert grid.tokens == rows // 4          # Qwen2_5_VLProcessor: image_grid_thw.prod() // merge_size**2


@pytest.mark.parametrize("max_pixels", [200_704, 100_352, 50_000])       # all under the image's 750,000 pixels
def test_max_pixels_bounds_as_the_processor(processor, max_pixels):
    (rows, _), thw = processed(processor, 1000, 750, size={"shortest_edge": 3136, "longest_edge": max_pixels})
    grid = image_grid("qwen2_vl", 1000, 750, max_pixels)
    assert grid.height * grid.width <= max_pixels
    assert ((grid.grid_t, grid.grid_h, grid.grid_w), grid.patches) == (thw, rows)


def test_worked_examples():
    # 1024x768: round(1024/28)*28 = 1036, round(768/28)*28 = 756 (783,216 px, under max_pixels 12,845,056):
    # 74 x 54 patches of 14 px = 3,996, merged 2x2 into 999 tokens
    grid = image_grid("qwen2_vl", 1024, 768)
    assert (grid.height, grid.width, grid.patches, grid.tokens) == (1036, 756, 3996, 999)
    assert grid.patch_values == 3 * 2 * 14 * 14
    # 8000x6000 is over max_pixels: beta = sqrt(48e6 / 12,845,056); floor(8000 / beta / 28) * 28 = 4116,
    # floor(6000 / beta / 28) * 28 = 3080: 294 x 220 patches, 16,170 tokens (the "~16k per image" default bound)
    grid = image_grid("qwen2_vl", 8000, 6000)
    assert (grid.height, grid.width, grid.tokens) == (4116, 3080, 16170)


def test_processor_matches_the_models_vision_config():
    """The patches the processor cuts are the ones the model's patch embedding takes."""
    settings = processor_settings(vision_spec("qwen2_5_vl").processor)
    vision = load_anatomy("Qwen/Qwen2.5-VL-7B-Instruct").config["vision_config"]
    assert (settings.patch_size, settings.temporal_patch_size, settings.merge_size) == \
        (vision["patch_size"], vision["temporal_patch_size"], vision["spatial_merge_size"])


def test_language_model_sequence_is_text_plus_visual_tokens():
    setup = TrainingSetup("Qwen/Qwen2.5-VL-7B-Instruct", seq_len=512, images_per_sample=2, image_size="1024x768")
    inputs = vision_inputs(setup, load_anatomy(setup.model))
    assert (inputs.visual_tokens, inputs.language_tokens, inputs.patches) == (1998, 2510, 7992)


def test_an_aspect_ratio_the_processor_refuses(processor):
    with pytest.raises(ValueError, match="aspect ratio"):
        processed(processor, 10, 2010)
    with pytest.raises(LlmemError, match="aspect ratio over 200"):
        image_grid("qwen2_vl", 10, 2010)
    image_grid("qwen2_vl", 10, 2000)         # exactly 200: taken, as the processor takes it


@pytest.mark.parametrize(("args", "says"), [
    (["tiny-qwen2_5_vl", "--images-per-sample", "1", "--image-size", "10x2010"], "aspect ratio over 200"),
    (["tiny-qwen2_5_vl", "--images-per-sample", "1", "--image-size", "1024by768"], "as HxW"),
    (["tiny-qwen2_5_vl", "--images-per-sample", "1", "--image-size", "0x768"], "as HxW"),
    (["tiny-qwen2_5_vl", "--images-per-sample", "2"], "needs --image-size"),
    (["tiny-qwen2_5_vl", "--image-size", "1024x768"], "give --images-per-sample"),
    (["tiny-qwen2_5_vl", "--images-per-sample", "1", "--image-size", "64x64", "--max-pixels", "0"], "--max-pixels"),
    (["tiny-llama", "--images-per-sample", "1", "--image-size", "64x64"], "takes text only"),
    (["tiny-llama", "--freeze-vision-tower"], "--freeze-vision-tower is for vision-language models"),
    (["tiny-qwen2_5_vl", "--images-per-sample", "1", "--image-size", "64x64", "--method", "tp", "--gpus", "2"],
     "--method tp is not wired for it yet"),
    (["tiny-qwen2_5_vl", "--images-per-sample", "1", "--image-size", "64x64", "--fused-ce"],
     "--fused-ce is not wired for it yet"),
    (["tiny-qwen2_5_vl", "--images-per-sample", "1", "--image-size", "64x64", "--grad-ckpt", "--grad-ckpt-every",
      "2"], "--grad-ckpt-every 2 is not wired"),
    (["tiny-qwen2_5_vl", "--seq-len", "64"], "a text-only step is not wired"),
])
def test_bad_input_is_one_line(args, says, capsys):
    assert main(["estimate", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmem: error: ") and err.count("\n") == 1 and says in err, err
