"""InternVL (transformers' internvl, the InternVL3 -hf checkpoints): its parts counted by hand against the published
parameter counts, the tiles and tokens as the installed transformers' InternVLProcessor makes them (its
GotOcr2ImageProcessor, PIL backend, built offline from the shipped preprocessor_config.json, and a word-level
tokenizer made here knowing the processor's image tokens), worked examples by hand, the batch's bytes, a
LLaMA-Factory config read by --from, and the real CPU step against its trace."""

from __future__ import annotations

import json
import warnings

import pytest
from llamafactory_vlm import capped_lora_sft, estimate_from_yaml

from llmem.cli import main
from llmem.memory.activations.learned import LEARN_ENV
from llmem.memory.activations.profile import vision_batch_bytes
from llmem.model.anatomy import load_anatomy
from llmem.model.catalog import catalog_file
from llmem.model.images import (
    PROCESSORS,
    closest_tile_grid,
    crop_grid,
    image_grid,
    pixel_values_shape,
    tile_bounds,
)
from llmem.model.vision import LANGUAGE, PROJECTOR, VISION, part_params
from llmem.model.vision_inputs import vision_inputs
from llmem.setup.training import TrainingSetup

np = pytest.importorskip("numpy")

IVL_1B, IVL_2B, IVL_8B = (f"OpenGVLab/InternVL3-{size}-hf" for size in ("1B", "2B", "8B"))


def _internvit(hidden: int, mlp: int, layers: int, patch: int, image: int) -> int:
    """InternViT (InternVLVisionModel, attention_bias true, no qk norm, mean pooling: no final norm): a class token,
    a biased Conv2d patch embedding, a position embedding per patch and the class token, `layers` blocks of biased
    q/k/v and projection, two LayerNorms, the two layer-scale vectors lambda_1 / lambda_2 and a biased fc1/fc2 MLP."""
    embed = hidden + 3 * patch * patch * hidden + hidden + ((image // patch) ** 2 + 1) * hidden
    block = 4 * (hidden * hidden + hidden) + 2 * 2 * hidden + 2 * hidden + (hidden * mlp + mlp) + (mlp * hidden + hidden)
    return embed + layers * block


def _projector(vision: int, text: int) -> int:
    """InternVLMultiModalProjector at downsample_ratio 0.5: a LayerNorm over 4 x vision (pixel_shuffle's 2x2
    patches), a biased linear to the text width, GELU, a biased text x text linear."""
    return 2 * 4 * vision + (4 * vision * text + text) + (text * text + text)


def _qwen2(hidden: int, mlp: int, layers: int, heads: int, kv_heads: int, vocab: int) -> int:
    """A Qwen2 language model with its own lm_head: embeddings, layers (biased q/k/v, bias-free o, a gated MLP, two
    RMSNorms), the final norm, the lm_head."""
    kv = kv_heads * (hidden // heads)
    layer = (hidden * hidden + hidden) + 2 * (hidden * kv + kv) + hidden * hidden + 3 * hidden * mlp + 2 * hidden
    return 2 * vocab * hidden + layers * layer + hidden


@pytest.mark.parametrize(("model", "published", "text"), [
    # HF pages of OpenGVLab/InternVL3-1B / -2B / -8B: 938M, 2.09B, 7.94B params; InternViT-300M-448px-V2.5 and
    # Qwen2.5-0.5B / 1.5B / 7B with the vocabulary 151,674 and lm_head untied, as their config.json give them
    (IVL_1B, 938_193_024, (896, 4864, 24, 14, 2, 151_674)),
    (IVL_2B, 2_088_957_440, (1536, 8960, 28, 12, 2, 151_674)),
    (IVL_8B, 7_944_373_760, (3584, 18944, 28, 28, 4, 151_674)),
])
def test_parts_by_hand_add_up_to_the_published_count(model, published, text):
    anatomy = load_anatomy(model)
    assert part_params(anatomy) == {VISION: _internvit(1024, 4096, 24, 14, 448), PROJECTOR: _projector(1024, text[0]),
                                    LANGUAGE: _qwen2(*text)}
    assert anatomy.total_params == published
    assert round(published / 1e7) in (94, 209, 794)


def test_tiny_parts_by_hand():
    assert part_params(load_anatomy("tiny-internvl")) == {
        VISION: _internvit(128, 344, 4, 14, 112), PROJECTOR: _projector(128, 192),
        LANGUAGE: _qwen2(192, 512, 4, 3, 1, 16_000)}


def _image_processor(tile: int):
    """transformers' GotOcr2ImageProcessor (PIL backend) from the shipped preprocessor_config.json at `tile` px."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    raw = json.loads(catalog_file("processors", PROCESSORS["internvl"].config_file))
    assert raw["image_processor_type"] == PROCESSORS["internvl"].image_processor_type
    kwargs = {k: v for k, v in raw.items() if k not in ("image_processor_type", "processor_class") and v is not None}
    return GotOcr2ImageProcessorPil(**{**kwargs, "size": {"height": tile, "width": tile}})


def _processor(tile: int, image_seq_length: int):
    """transformers' InternVLProcessor over that image processor and a word-level tokenizer knowing <img>, </img>,
    <IMG_CONTEXT> and <video> as InternVL3-hf's tokenizer_config.json names them (extra_special_tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.internvl.processing_internvl import InternVLProcessor
    from transformers.processing_utils import ProcessorMixin

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "x": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", extra_special_tokens={
        "start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>"})
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda *a, **k: None
    try:
        return InternVLProcessor(image_processor=_image_processor(tile), tokenizer=tokenizer,
                                 image_seq_length=image_seq_length)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


@pytest.fixture(scope="module")
def processor():
    """InternVL3's: 448 px tiles, image_seq_length 256 (its processor_config.json)."""
    return _processor(448, 256)


def _run(proc, sizes: list[tuple[int, int]]):
    from PIL import Image

    images = [Image.fromarray(np.full((h, w, 3), 128, dtype=np.uint8)) for h, w in sizes]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = proc(text=["x " + " ".join(["<IMG_CONTEXT>"] * len(sizes)) + " x"], images=images, return_tensors="np")
    return out["pixel_values"], out["input_ids"][0].tolist()


SIZES = [(1024, 768), (768, 1024), (448, 448), (224, 224), (633, 633), (634, 634), (950, 950), (951, 951), (2000, 3000), (1080, 1920),
         (500, 333), (10, 2000), (4000, 100), (300, 500), (895, 448), (896, 449), (5000, 5000), (100, 7000),
         (1, 1), (600, 800)]


@pytest.mark.parametrize(("height", "width"), SIZES)
def test_tiles_and_tokens_equal_the_processors(processor, height, width):
    """pixel_values' shape and the <IMG_CONTEXT> tokens of one sample, and the <img> / </img> around them."""
    grid = image_grid("internvl", height, width, config=load_anatomy(IVL_1B).config)
    pixels, ids = _run(processor, [(height, width)])
    context = processor.tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")
    assert pixels.shape == pixel_values_shape("internvl", grid, 1)                    # [tiles, 3, 448, 448]
    assert ids.count(context) == grid.tokens == grid.crops * 256
    assert len(ids) - 2 == grid.tokens + grid.marker_tokens                          # less the two "x" text tokens


def test_two_images_a_sample_stack_their_tiles(processor):
    sizes = [(1024, 768), (300, 500)]
    pixels, ids = _run(processor, sizes)
    grids = [image_grid("internvl", h, w, config=load_anatomy(IVL_1B).config) for h, w in sizes]
    assert pixels.shape[0] == sum(g.crops for g in grids) == 13 + 7
    assert len(ids) - 2 == sum(g.tokens + g.marker_tokens for g in grids)


@pytest.mark.parametrize(("height", "width"), SIZES[:12])
def test_tiny_tiles_equal_the_processors(height, width):
    """tiny-internvl's 112 px tiles of 8 x 8 patches, 16 tokens a tile, as the processor set to them makes them."""
    config = load_anatomy("tiny-internvl").config
    pixels, ids = _run(_processor(112, 16), [(height, width)])
    grid = image_grid("internvl", height, width, config=config)
    assert pixels.shape == (grid.crops, 3, 112, 112) and grid.tokens == grid.crops * 16
    assert len(ids) - 2 == grid.tokens + grid.marker_tokens


@pytest.mark.parametrize("model", [IVL_1B, IVL_2B, IVL_8B, "tiny-internvl"])
def test_the_tile_and_its_tokens_are_the_models(model):
    """The processor's tile is the tower's image_size, and its image_seq_length the tower's patches a side squared,
    pixel-shuffled by downsample_ratio (transformers' InternVLProcessor docstring), as the config states it."""
    config = load_anatomy(model).config
    grid = crop_grid(config, 448, 448, (1, 1))
    assert grid.crops == 1 and grid.tokens == config["image_seq_length"]
    raw = json.loads(catalog_file("processors", PROCESSORS["internvl"].config_file))
    if model != "tiny-internvl":
        assert raw["size"] == {"height": grid.height, "width": grid.width} == {"height": 448, "width": 448}


def test_worked_examples():
    config = load_anatomy(IVL_1B).config          # 448 px tiles, 32 x 32 patches, 2x2 pixel-shuffled: 256 tokens
    assert tile_bounds("internvl") == (1, 12)
    # 1024x768 (height x width): width / height 0.75, exactly 3 columns / 4 rows: 12 tiles and the thumbnail
    assert closest_tile_grid(1024, 768, 448, 1, 12) == (3, 4)
    grid = crop_grid(config, 1024, 768, (1, 12))
    assert (grid.crops, grid.tokens, grid.marker_tokens, grid.patches) == (13, 13 * 256, 2, 13 * 1024)
    # a square: 1x1, 2x2, 3x3 equally close; a larger grid is taken while the image's area is over half the grid's
    # (448^2 = 200,704 is not over half of 2x2's 802,816: one tile, no thumbnail; 634^2 = 401,956 is: 2x2 and the
    # thumbnail; 951^2 = 904,401 is over half of 3x3's 1,806,336 too: 9 tiles and the thumbnail; 4x4 is 16 > 12)
    assert crop_grid(config, 448, 448, (1, 12)).crops == 1
    assert crop_grid(config, 633, 633, (1, 12)).crops == 1      # 400,689: not over 401,408
    assert crop_grid(config, 634, 634, (1, 12)).crops == 5
    assert crop_grid(config, 950, 950, (1, 12)).crops == 5      # 902,500: not over 903,168
    assert crop_grid(config, 951, 951, (1, 12)).crops == 10
    assert crop_grid(config, 5000, 5000, (1, 12)).crops == 10
    # 300x500: 5 / 3 = 1.667 lies nearest 3 / 2 (5 x 3 is 15 tiles, over 12): 6 tiles and the thumbnail
    assert crop_grid(config, 300, 500, (1, 12)).crops == 7
    # max_patches 1: one resized tile
    assert crop_grid(config, 1024, 768, (1, 1)).crops == 1


def test_batch_bytes_by_hand():
    setup = TrainingSetup("tiny-internvl", batch_size=2, seq_len=64, images_per_sample=1, image_size="448x448")
    inputs = vision_inputs(setup, load_anatomy(setup.model))
    # 112 px tiles: 448x448 is 3x3 of them (200,704 > half of 9 x 12,544) and the thumbnail, 16 tokens a tile
    assert (inputs.visual_tokens, inputs.language_tokens, inputs.patches) == (160, 64 + 160, 10 * 64)
    # ids [2, 224] int64, pixel_values [20, 3, 112, 112] fp32
    assert vision_batch_bytes(load_anatomy(setup.model), setup) == (2 * 224 * 8, 20 * 3 * 112 * 112 * 4)


def test_llamafactory_config_prescales_then_tiles(tmp_path):
    """A LLaMA-Factory InternVL3 config: image_max_pixels 768 x 768 scales a 1024x1024 image to 768x768 first
    (mm_plugin._preprocess_image), which takes 2x2 tiles and the thumbnail (589,824 is over half of 2x2's 802,816,
    not of 3x3's); unscaled it takes 3x3 and the thumbnail."""
    setup = capped_lora_sft(tmp_path, IVL_2B, "intern_vl")
    assert (setup.model, setup.lora_rank, setup.max_pixels) == (IVL_2B, 8, 589_824)
    assert vision_inputs(setup, load_anatomy(IVL_2B)).image.crops == 5
    assert image_grid("internvl", 1024, 1024, config=load_anatomy(IVL_2B).config).crops == 10



def test_a_sequence_too_short_for_the_image_markers_is_one_line(capsys):
    """<img> and </img> are text tokens around each image's <IMG_CONTEXT> run: --seq-len must hold them and a text
    token (two images: 2 x 2 + 1)."""
    code = main(["estimate", "tiny-internvl", "--images-per-sample", "2", "--image-size", "448x448", "--seq-len", "4"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("llmem: error: ") and err.count("\n") == 1 and "give --seq-len >= 5" in err, err


def test_llamafactory_full_finetune_through_estimate(tmp_path, capsys, monkeypatch):
    """`llmem estimate --from` a LLaMA-Factory full fine-tune of InternVL3-1B: its defaults freeze the tower and the
    projector; 1024x768 scaled to 262,144 px first is 591x443 (int(side x sqrt(1 / 3))), whose 0.7496 lies nearest
    3 / 4: 12 tiles and the thumbnail, 13 x 256 = 3,328 tokens."""
    monkeypatch.setenv(LEARN_ENV, "auto")          # (the suite turns learning off; the vision side is learned)
    out = estimate_from_yaml(tmp_path, capsys, "internvl3_full_sft.yaml",
                             f"model_name_or_path: {IVL_1B}\nstage: sft\nfinetuning_type: full\ntemplate: intern_vl\n"
                             "cutoff_len: 1024\nimage_max_pixels: 262144\nper_device_train_batch_size: 1\nbf16: true\n")
    assert out["setup"]["freeze_vision_tower"] and out["setup"]["freeze_projector"]
    assert not out["setup"]["freeze_language_model"]
    assert any("in 13 crops" in note and "3,328 visual tokens" in note for note in out["notes"])
