"""Idefics3 / SmolVLM vision-language models: their parts counted by hand against the published parameter counts, the
images as the installed transformers' Idefics3 / SmolVLM image processors cut them (built offline from the shipped
preprocessor_config.json, PIL backend) and the text the Idefics3 processor writes for them (a word-level tokenizer
made here knowing its special tokens), worked examples by hand, the batch's bytes and the refusals."""

from __future__ import annotations

import json
import warnings

import pytest

from llmem.cli import main
from llmem.memory.activations.profile import vision_batch_bytes
from llmem.model.anatomy import load_anatomy
from llmem.model.catalog import catalog_file
from llmem.model.images import PROCESSORS, image_grid, pixel_values_shape, resize_ratio, tiled_grid
from llmem.model.vision import LANGUAGE, PROJECTOR, VISION, part_params
from llmem.model.vision_inputs import vision_inputs
from llmem.setup.sources import setup_from_file
from llmem.setup.training import TrainingSetup

np = pytest.importorskip("numpy")

IDEFICS3, SMOL_256M, SMOL_2B, SMOL2 = ("HuggingFaceM4/Idefics3-8B-Llama3", "HuggingFaceTB/SmolVLM-256M-Instruct",
                                       "HuggingFaceTB/SmolVLM-Instruct", "HuggingFaceTB/SmolVLM2-2.2B-Instruct")


def _siglip(hidden: int, mlp: int, layers: int, patch: int, image: int) -> int:
    """Idefics3's SigLIP tower: a biased Conv2d patch embedding, a position embedding per patch of the tower's
    image_size, `layers` blocks of two biased LayerNorms, biased q/k/v/out projections and a biased fc1/fc2 MLP, the
    post_layernorm."""
    embed = 3 * patch * patch * hidden + hidden + (image // patch) ** 2 * hidden
    block = 2 * 2 * hidden + 4 * (hidden * hidden + hidden) + (hidden * mlp + mlp) + (mlp * hidden + hidden)
    return embed + layers * block + 2 * hidden


def _llama(hidden: int, mlp: int, layers: int, heads: int, kv_heads: int, vocab: int) -> int:
    """A Llama language model with its own lm_head: embeddings, layers (bias-free q/k/v/o, a gated MLP, two RMSNorms),
    the final norm, the lm_head."""
    head_dim = hidden // heads
    layer = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * mlp + 2 * hidden
    return 2 * vocab * hidden + layers * layer + hidden


@pytest.mark.parametrize(("model", "published", "vision", "scale", "language"), [
    # HF pages: 8.46B, 256M, 507M, 2.25B, 2.25B; the text_config of each published config.json (Llama-3-8B with
    # vocab 128,259; SmolLM2-135M / 360M with 49,280; SmolLM2-1.7B with 49,155 (v1) / 49,280 (SmolVLM2))
    (IDEFICS3, 8_462_086_384, (1152, 4304, 27, 14, 364), 2, (4096, 14336, 32, 32, 8, 128_259)),
    (SMOL_256M, 256_484_928, (768, 3072, 12, 16, 512), 4, (576, 1536, 30, 9, 3, 49_280)),
    ("HuggingFaceTB/SmolVLM-500M-Instruct", 507_482_304, (768, 3072, 12, 16, 512), 4, (960, 2560, 32, 15, 5, 49_280)),
    (SMOL_2B, 2_246_272_880, (1152, 4304, 27, 14, 384), 3, (2048, 8192, 24, 32, 32, 49_155)),
    (SMOL2, 2_246_784_880, (1152, 4304, 27, 14, 384), 3, (2048, 8192, 24, 32, 32, 49_280)),
    ("HuggingFaceTB/SmolVLM2-256M-Video-Instruct", 256_484_928, (768, 3072, 12, 16, 512), 4,
     (576, 1536, 30, 9, 3, 49_280)),
])
def test_parts_by_hand_add_up_to_the_published_count(model, published, vision, scale, language):
    anatomy = load_anatomy(model)
    connector = vision[0] * scale * scale * language[0]          # pixel_shuffle's scale^2 patches, one bias-free linear
    assert part_params(anatomy) == {VISION: _siglip(*vision), PROJECTOR: connector, LANGUAGE: _llama(*language)}
    assert anatomy.total_params == published
    assert round(published / 1e6) in (8462, 256, 507, 2246, 2247)


def test_tiny_parts_by_hand():
    assert part_params(load_anatomy("tiny-idefics3")) == {
        VISION: _siglip(128, 344, 4, 16, 128), PROJECTOR: 128 * 4 * 256, LANGUAGE: _llama(256, 688, 4, 4, 2, 16_000)}
    assert part_params(load_anatomy("tiny-smolvlm")) == {
        VISION: _siglip(128, 344, 4, 16, 128), PROJECTOR: 128 * 16 * 192, LANGUAGE: _llama(192, 512, 4, 3, 1, 16_000)}


def _image_processor(row: str, tile: int):
    """transformers' image processor of `row` (PIL backend) from the shipped preprocessor_config.json, its tile and
    resize target set to the model's tower (`tile`) as each checkpoint ships them (ratio 4)."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    raw = json.loads(catalog_file("processors", PROCESSORS[row].config_file))
    assert raw["image_processor_type"] == PROCESSORS[row].image_processor_type
    kwargs = {k: v for k, v in raw.items() if k not in ("image_processor_type", "processor_class")}
    kwargs.update(max_image_size={"longest_edge": tile}, size={"longest_edge": resize_ratio(row) * tile})
    cls = {"idefics3": Idefics3ImageProcessorPil, "smolvlm": SmolVLMImageProcessorPil}[row]
    return cls(**kwargs)


@pytest.fixture(scope="module")
def idefics3_processor():
    """transformers' Idefics3Processor over the shipped image processor at Idefics3-8B's 364 px tiles, image_seq_len
    169 ((364 / 14)^2 / 2^2), and a word-level tokenizer knowing its special tokens and the newline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor
    from transformers.processing_utils import ProcessorMixin

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "x": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", "\n",
        *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))]})
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda *a, **k: None
    try:
        return Idefics3Processor(image_processor=_image_processor("idefics3", 364), tokenizer=tokenizer,
                                 image_seq_len=169)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def _images(sizes: list[tuple[int, int]]):
    from PIL import Image

    return [Image.fromarray(np.full((h, w, 3), 128, dtype=np.uint8)) for h, w in sizes]


SIZES = [(1024, 768), (768, 1024), (364, 364), (224, 224), (448, 448), (768, 1152), (1456, 1456), (2000, 3000),
         (1080, 1920), (500, 333), (10, 2000), (4000, 100), (728, 1092), (1093, 729), (5000, 5000), (100, 7000)]


@pytest.mark.parametrize(("height", "width"), SIZES)
def test_frames_and_tokens_equal_the_processors(idefics3_processor, height, width):
    """pixel_values' shape and the <image> tokens of one sample, and the processor's other tokens around them."""
    grid = image_grid("idefics3", height, width, config=load_anatomy(IDEFICS3).config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = idefics3_processor(text=["x <image> x"], images=[_images([(height, width)])], return_tensors="np")
    ids = out["input_ids"][0].tolist()
    image_id = idefics3_processor.tokenizer.convert_tokens_to_ids("<image>")
    assert out["pixel_values"].shape == (1, *pixel_values_shape("idefics3", grid, 1)[1:])   # [1, frames, 3, 364, 364]
    assert out["pixel_attention_mask"].shape == (1, grid.crops, 364, 364) and out["pixel_attention_mask"].all()
    assert ids.count(image_id) == grid.tokens == grid.crops * 169
    assert len(ids) - 2 == grid.tokens + grid.marker_tokens                  # less the two "x" text tokens


@pytest.mark.parametrize("model", [SMOL_256M, SMOL_2B, SMOL2, "tiny-smolvlm"])
@pytest.mark.parametrize(("height", "width"), SIZES[:10])
def test_smolvlm_frames_equal_the_image_processors(model, height, width):
    """SmolVLM's image processor (SmolVLM2's class; SmolVLM v1 ships Idefics3's, whose arithmetic it copies) at each
    model's tile: the frames and the rows x cols its processor writes tokens for."""
    config = load_anatomy(model).config
    tile = config["vision_config"]["image_size"]
    row = "smolvlm" if config["model_type"] == "smolvlm" else "idefics3"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _image_processor(row, tile)(images=[_images([(height, width)])], return_tensors="np",
                                          return_row_col_info=True)
    grid = image_grid(row, height, width, config=config)
    rows, cols = out["rows"][0][0], out["cols"][0][0]
    assert out["pixel_values"].shape == (1, grid.crops, 3, tile, tile) and grid.crops == rows * cols + 1
    assert grid.marker_tokens == 2 * rows * cols + rows + 4
    side = tile // config["vision_config"]["patch_size"]
    assert grid.tokens == grid.crops * side * side // config["scale_factor"] ** 2


def test_worked_examples():
    config = load_anatomy(IDEFICS3).config         # 364 px tiles of 26 x 26 patches, pixel-shuffled 2x2: 169 tokens
    # 1024x768 (height x width): the height to 4 x 364 = 1456, the width int(1456 * 768 / 1024) = 1092 (even): 4 rows
    # x 3 columns of tiles exactly and the global frame; markers 12 fake + 12 <row_r_col_c> + 4 newlines, then a
    # newline, fake, global, fake
    grid = tiled_grid(config, 1024, 768, 4)
    assert (grid.crops, grid.tokens, grid.marker_tokens, grid.patches) == (13, 13 * 169, 24 + 4 + 4, 13 * 676)
    # 500x333: height the longest, to 1456; width int(1456 * 333 / 500) = 969, made even 970, rounded up to 3 tiles
    assert tiled_grid(config, 500, 333, 4).crops == 4 * 3 + 1
    # a square image of any size: 4 x 4 tiles and the global frame
    assert tiled_grid(config, 100, 100, 4).crops == tiled_grid(config, 5000, 5000, 4).crops == 17


def test_batch_bytes_by_hand():
    setup = TrainingSetup("tiny-idefics3", batch_size=2, seq_len=64, images_per_sample=1, image_size="256x384")
    inputs = vision_inputs(setup, load_anatomy(setup.model))
    # 128 px tiles: 384x256 -> 512x342 -> 4 x 3 tiles and the global frame, 8 x 8 patches a frame, 16 tokens a frame
    assert (inputs.visual_tokens, inputs.language_tokens, inputs.patches) == (13 * 16, 64 + 208, 13 * 64)
    # ids [2, 272] int64, pixel_values [2, 13, 3, 128, 128] fp32, pixel_attention_mask [2, 13, 128, 128] int64
    assert vision_batch_bytes(load_anatomy(setup.model), setup) == (
        2 * 272 * 8, 2 * 13 * 3 * 128 * 128 * 4, 2 * 13 * 128 * 128 * 8)


def test_axolotl_config_names_the_model(tmp_path):
    """An axolotl SmolVLM2 config: its base_model and image_size read (the reader is the families' own)."""
    path = tmp_path / "axolotl.yaml"
    path.write_text(f"base_model: {SMOL2}\nprocessor_type: AutoProcessor\nskip_prepare_dataset: true\n"
                    "remove_unused_columns: false\nsample_packing: false\n"
                    "datasets:\n  - path: HuggingFaceH4/llava-instruct-mix-vsft\n    type: chat_template\n"
                    "sequence_len: 2048\nadapter: lora\nlora_r: 16\nlora_alpha: 32\n"
                    "micro_batch_size: 1\nbf16: true\nimage_size: [768, 1024]\n")
    setup = setup_from_file(path, images_per_sample=1).setup
    assert (setup.model, setup.image_size, setup.lora_rank) == (SMOL2, "768x1024", 16)
    # 384 px tiles: the width to 1536, the height int(1536 * 768 / 1024) = 1152: 3 x 4 tiles and the global frame,
    # 81 tokens a frame ((384 / 14)^2 // 3^2 = 27^2 / 9)
    assert vision_inputs(setup, load_anatomy(SMOL2)).image.tokens == 13 * 81


@pytest.mark.parametrize(("model", "args", "says"), [
    ("tiny-idefics3", ["--method", "ds-zero2", "--gpus", "2"], "--method ds-zero2 is not wired for it yet"),
    ("tiny-smolvlm", ["--freeze-vision-tower"], "casts the image features to the tower's dtype"),
    ("tiny-smolvlm", ["--freeze-language-model"], "casts the image features to the tower's dtype"),
    # 1024x768 takes 3 x 4 tiles: 31 marker tokens, which --seq-len 16 cannot hold
    ("tiny-idefics3", ["--image-size", "768x1024", "--seq-len", "16"], "give --seq-len >= 32"),
])
def test_refusals_are_one_line(capsys, model, args, says):
    code = main(["estimate", model, "--images-per-sample", "1", "--image-size", "448x448", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("llmem: error: ") and err.count("\n") == 1 and says in err, err
