"""Llama 4 (transformers' llama4, Llama-4-Scout-17B-16E-Instruct): its parts counted by hand against the published
parameter count, the tiles and tokens as the installed transformers' Llama4ImageProcessor and Llama4Processor make
them (built offline from the shipped preprocessor_config.json; the image processor's module imports torchvision,
which only its resize and pad use: a stand-in module lets it import, and its own get_best_fit /
get_number_of_image_patches and the processor's _prompt_split_image run as written), worked examples by hand, the
batch's bytes, the precision refusal and a LLaMA-Factory config read by --from. The trace runs the real step
(tests/runtime/test_vision_measure.py); the CI rows compare the estimate with it."""

from __future__ import annotations

import importlib
import json
import sys
import types

import pytest
from llamafactory_vlm import capped_lora_sft

from llmem.cli import main
from llmem.memory.activations.profile import vision_batch_bytes
from llmem.model.anatomy import load_anatomy
from llmem.model.catalog import catalog_file
from llmem.model.images import (
    PROCESSORS,
    best_fit_grid,
    best_fit_resolutions,
    best_fit_tiles,
    image_grid,
    max_tiles,
    pixel_values_shape,
)
from llmem.model.vision import LANGUAGE, PROJECTOR, VISION, part_params
from llmem.model.vision_inputs import vision_inputs
from llmem.setup.training import TrainingSetup

SCOUT = "meta-llama/Llama-4-Scout-17B-16E-Instruct"


def _vision(hidden: int, mlp: int, layers: int, image: int, patch: int, adapter: int) -> int:
    """Llama4VisionModel: a bias-free linear over each unfolded patch, the class token, a learned position per patch
    and the class token, biased LayerNorms before and after the encoder, `layers` blocks (biased q/k/v/o, a biased
    fc1/fc2 MLP, two biased LayerNorms), then the vision adapter's bias-free MLP over the pixel-shuffled patches:
    mlp (4 x hidden at ratio 0.5) -> adapter -> adapter."""
    embed = 3 * patch * patch * hidden + hidden + ((image // patch) ** 2 + 1) * hidden + 2 * 2 * hidden
    block = 4 * (hidden * hidden + hidden) + (hidden * mlp + mlp) + (mlp * hidden + hidden) + 2 * 2 * hidden
    return embed + layers * block + mlp * adapter + adapter * adapter


def _text(hidden: int, heads: int, kv_heads: int, head_dim: int, experts: int, expert: int, layers: int,
          vocab: int) -> int:
    """Llama4ForCausalLM, every layer MoE: bias-free q/k/v/o (the qk norm has no weight), `experts` routed experts
    (gate_up_proj [experts, hidden, 2 x expert], down_proj [experts, expert, hidden]), the router [experts, hidden], a
    shared gated expert of the same width, two RMSNorms; embeddings, the final norm and an untied lm_head."""
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    moe = experts * 3 * hidden * expert + experts * hidden + 3 * hidden * expert
    return 2 * vocab * hidden + layers * (attention + moe + 2 * hidden) + hidden


def test_parts_by_hand_add_up_to_the_published_count():
    """The model card: 109B total parameters, 17B active; the text config: 48 layers of 5120, 40 / 8 heads of 128,
    16 experts of 8192 and a shared one; the vision config: 34 layers of 1408 (5632 MLP) at 336 px, patch 14, a
    4096-wide adapter; the projector 4096 -> 5120."""
    anatomy = load_anatomy(SCOUT)
    parts = part_params(anatomy)
    assert parts == {VISION: _vision(1408, 5632, 34, 336, 14, 4096), PROJECTOR: 4096 * 5120,
                     LANGUAGE: _text(5120, 40, 8, 128, 16, 8192, 48, 202_048)}
    assert parts == {VISION: 850_960_896, PROJECTOR: 20_971_520, LANGUAGE: 107_769_861_120}
    assert anatomy.total_params == 108_641_793_536 and round(anatomy.total_params / 1e9) == 109
    # active per token: one routed expert of 16 (top-1) beside the shared one
    active = parts[LANGUAGE] - 48 * 15 * 3 * 5120 * 8192
    assert round(active / 1e9) == 17


def test_tiny_parts_by_hand():
    assert part_params(load_anatomy("tiny-llama4")) == {
        VISION: _vision(128, 512, 4, 112, 14, 256), PROJECTOR: 256 * 256,
        LANGUAGE: _text(256, 4, 2, 64, 4, 256, 4, 16_000)}


def _llama4_image_module():
    """transformers' image_processing_llama4, imported with a stand-in torchvision (its resize and pad, never called
    here, are torchvision's; the tile arithmetic is torch's)."""
    stubs = {name: types.ModuleType(name) for name in ("torchvision", "torchvision.transforms",
                                                       "torchvision.transforms.v2",
                                                       "torchvision.transforms.v2.functional")}
    stubs["torchvision.transforms.v2"].functional = stubs["torchvision.transforms.v2.functional"]
    name = "transformers.models.llama4.image_processing_llama4"
    saved = {k: sys.modules.get(k) for k in (*stubs, name)}
    sys.modules.update(stubs)
    sys.modules.pop(name, None)
    try:
        return importlib.import_module(name)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


@pytest.fixture(scope="module")
def processor():
    """transformers' Llama4Processor over Llama4ImageProcessor (the shipped preprocessor_config.json: 336 px,
    max_patches 16) and a word-level tokenizer knowing the processor's image tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.llama4.processing_llama4 import Llama4Processor
    from transformers.processing_utils import ProcessorMixin

    raw = json.loads(catalog_file("processors", PROCESSORS["llama4"].config_file))
    assert raw["image_processor_type"] == PROCESSORS["llama4"].image_processor_type
    module = _llama4_image_module()
    image_processor = module.Llama4ImageProcessor(**{k: v for k, v in raw.items() if v is not None and k not in (
        "image_processor_type", "processor_class")})
    special = ["<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
               "<|tile_y_separator|>"]
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "x": 1, **{t: 2 + i for i, t in enumerate(special)}},
                                       unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", additional_special_tokens=special)
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda *a, **k: None
    try:
        proc = Llama4Processor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                               pixel_shuffle_ratio=0.5)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check
    return proc, module


def _processed(proc_and_module, height: int, width: int, tile: int = 336) -> tuple[int, list[int]]:
    """(the image's tiles, its token ids) as the processor makes them: Llama4ImageProcessor._preprocess's
    get_best_fit canvas (its aspect_ratios), get_number_of_image_patches' tiles, _prompt_split_image's text."""
    import torch
    from transformers.image_utils import SizeDict

    proc, module = proc_and_module
    size = SizeDict(height=tile, width=tile)
    resolutions = torch.tensor(module.find_supported_resolutions(max_num_chunks=16, patch_size=size))
    target = module.get_best_fit((height, width), resolutions, resize_to_max_canvas=False)
    aspect = (int(target[0]) // tile, int(target[1]) // tile)
    tiles = proc.image_processor.get_number_of_image_patches(height, width, {"size": {"height": tile, "width": tile}})
    per_tile = (tile // proc.patch_size) ** 2 // proc.downsample_ratio
    text = proc._prompt_split_image(aspect, per_tile)
    return tiles, proc.tokenizer(text.replace("><", "> <"))["input_ids"]


SIZES = [(336, 336), (337, 337), (672, 672), (1024, 768), (768, 1024), (100, 100), (1, 1), (224, 224), (448, 448),
         (1080, 1920), (1920, 1080), (500, 333), (10, 2000), (4000, 100), (300, 500), (5000, 5000), (1344, 1344),
         (1345, 1345), (336, 5376), (700, 2100)]


@pytest.mark.parametrize(("height", "width"), SIZES)
def test_tiles_and_tokens_equal_the_processors(processor, height, width):
    """pixel_values' tiles, the <|patch|> tokens (the config's image_token_index, which take the features) and the
    marker tokens around them, and the processor's own token count (_get_num_multimodal_tokens)."""
    grid = image_grid("llama4", height, width, config=load_anatomy(SCOUT).config)
    tiles, ids = _processed(processor, height, width)
    proc = processor[0]
    patch = proc.tokenizer.convert_tokens_to_ids("<|patch|>")
    assert pixel_values_shape("llama4", grid, 1) == (tiles, 3, 336, 336)
    assert ids.count(patch) == grid.tokens == tiles * 144
    assert proc._get_num_multimodal_tokens(image_sizes=[(height, width)])["num_image_tokens"] == [grid.tokens]
    assert len(ids) == grid.tokens + grid.marker_tokens


@pytest.mark.parametrize(("height", "width"), SIZES[:10])
def test_tiny_tiles_equal_the_processors(processor, height, width):
    """tiny-llama4's 112 px tiles of 8 x 8 patches, 16 tokens a tile, as the processor set to them makes them."""
    grid = image_grid("llama4", height, width, config=load_anatomy("tiny-llama4").config)
    tiles, ids = _processed(processor, height, width, tile=112)
    assert grid.crops == tiles and grid.tokens == tiles * 16 and len(ids) == grid.tokens + grid.marker_tokens


def test_worked_examples():
    config = load_anatomy(SCOUT).config
    assert max_tiles("llama4") == 16
    # find_supported_resolutions(4): ratios in the order first met from 4 tiles down (1/4, 1, 4, 1/3, 3, 1/2, 2)
    assert best_fit_resolutions(4) == [(1, 4), (2, 2), (1, 1), (4, 1), (1, 3), (3, 1), (1, 2), (2, 1)]
    # 1024x768: 4 x 3 tiles scale it by min(1344 / 1024, 1008 / 768) = 1.3125, the smallest upscale: 12 tiles, the
    # global one, 13 x (24 x 24 / 4) = 1,872 <|patch|> tokens; 3 markers and a separator after each of the 12 tiles
    grid = best_fit_grid(config, 1024, 768, 16)
    assert (grid.crops, grid.tokens, grid.marker_tokens, grid.patches) == (13, 1872, 15, 13 * 576)
    # 336x336 fits one tile (scale 1): no global tile, no separators
    assert (best_fit_grid(config, 336, 336, 16).crops, best_fit_grid(config, 336, 336, 16).marker_tokens) == (1, 3)
    # 337x337: one tile would shrink it; 2x2 is the smallest upscale (1.994), 1x2 / 2x1 still shrink it
    assert best_fit_tiles(337, 337, 336, 16) == (2, 2)
    # 5000x5000: no canvas upscales; 4x4 shrinks it least (1344 / 5000)
    assert best_fit_tiles(5000, 5000, 336, 16) == (4, 4)
    # 10x2000: 1x16 scales by min(33.6, 2.688) = 2.688 ... every canvas upscales; the smallest upscale is 1x6's
    # min(33.6, 1.008) = 1.008
    assert best_fit_tiles(10, 2000, 336, 16) == (1, 6)


def test_batch_bytes_by_hand():
    """ids [2, 64 + 80] int64; pixel_values [2 x 5, 3, 112, 112] bf16 (Llama4ImageProcessor's rescale_and_normalize
    casts them): 224x224 on tiny-llama4's 112 px tiles is 2 x 2 tiles and the global one, 16 tokens each."""
    setup = TrainingSetup("tiny-llama4", batch_size=2, seq_len=64, images_per_sample=1, image_size="224x224")
    inputs = vision_inputs(setup, load_anatomy(setup.model))
    assert (inputs.visual_tokens, inputs.language_tokens, inputs.image.marker_tokens) == (80, 144, 7)
    assert vision_batch_bytes(load_anatomy(setup.model), setup) == (2 * 144 * 8, 10 * 3 * 112 * 112 * 2)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_precision_without_autocast_or_bf16_weights_is_one_line(precision, capsys):
    """The processor's bf16 pixel values meet the patch linear's fp32 / fp16 weight with no autocast to cast them:
    transformers' own forward fails there, so the estimate refuses it in one line."""
    code = main(["estimate", "tiny-llama4", "--images-per-sample", "1", "--image-size", "224x224", "--precision",
                 precision])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("llmem: error: ") and err.count("\n") == 1
    assert "bfloat16 pixel values" in err and "bf16-mixed" in err, err


def test_a_sequence_too_short_for_the_image_markers_is_one_line(capsys):
    """224x224 on tiny-llama4 writes 7 marker tokens (start, end, <|image|> and a separator after each of 4 tiles):
    --seq-len must hold them and a text token."""
    code = main(["estimate", "tiny-llama4", "--images-per-sample", "1", "--image-size", "224x224", "--seq-len", "4"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "give --seq-len >= 8" in err, err


def test_llamafactory_config_prescales_then_tiles(tmp_path):
    """A LLaMA-Factory Scout LoRA config: image_max_pixels 768 x 768 scales a 1024x1024 image to 768x768 first
    (mm_plugin._preprocess_image), which takes 3 x 3 tiles (1008 / 768 = 1.3125, the smallest upscale) and the global
    one; unscaled it takes 4 x 4 (1344 / 1024) and the global one."""
    setup = capped_lora_sft(tmp_path, SCOUT, "llama4")
    assert (setup.model, setup.lora_rank, setup.max_pixels) == (SCOUT, 8, 589_824)
    assert vision_inputs(setup, load_anatomy(SCOUT)).image.crops == 10
    assert image_grid("llama4", 1024, 1024, config=load_anatomy(SCOUT).config).crops == 17


def test_all_linear_lora_leaves_the_router_alone():
    """--lora-targets all-linear adapts each layer's q/k/v/o and shared expert's gate/up/down (nn.Linear), not its
    Llama4Router (an nn.Linear subclass returning scores and logits, which LLaMA-Factory's find_all_linear_modules
    skips: "Linear" is not in its class name; peft's LoRA layer would fail on its tuple) nor the experts' stacked
    parameters. r8 on tiny-llama4, by hand: 8 x (256 + 256) for q, o, gate, up, down and 8 x (256 + 128) for k, v,
    in 4 layers."""
    from llmem.model.peft import with_lora
    from llmem.runtime.build import meta_model_for
    from llmem.runtime.vision import language_lora_targets
    from llmem.setup.training import LORA_ALL_LINEAR, user_setup

    setup = user_setup(model="tiny-llama4", images_per_sample=1, image_size="224x224", lora_rank=8,
                       lora_targets=LORA_ALL_LINEAR)
    targets = language_lora_targets(meta_model_for(setup), [LORA_ALL_LINEAR], LORA_ALL_LINEAR)
    assert len(targets) == 4 * 7 and not any("router" in t or "experts" in t for t in targets)
    assert with_lora(load_anatomy("tiny-llama4"), 8, LORA_ALL_LINEAR).trainable_params == \
        4 * (5 * 8 * 512 + 2 * 8 * 384)


def test_all_linear_lora_on_the_text_model_leaves_the_router_alone_too(tmp_path):
    """The text-only Llama 4 (llama4_text, tiny-llama4's language model as a local config): peft's own all-linear
    would wrap each Llama4Router too and fail on its tuple, so the trace takes the Linear modules proper, as the
    anatomy counts them; the traced adapters are those 106,496 parameters (the test above, by hand) and the trace
    runs (it raised AttributeError before)."""
    from llmem.runtime.trace import trace

    text = json.loads(catalog_file("tiny", "tiny-llama4.json"))["text_config"]
    (tmp_path / "config.json").write_text(json.dumps({**text, "model_type": "llama4_text",
                                                      "architectures": ["Llama4ForCausalLM"]}))
    result = trace(TrainingSetup(model=str(tmp_path), lora_rank=8, lora_targets="all-linear", seq_len=64))
    assert result.setup.trainable_params == 4 * (5 * 8 * 512 + 2 * 8 * 384) == 106_496


def test_a_config_whose_layers_alternate_dense_and_moe_says_how_it_is_read(tmp_path):
    """Maverick's interleave_moe_layer_step 2: transformers makes layers 1, 3 MoE and 0, 2 dense of a 4-layer copy
    (Llama4TextConfig.moe_layers: range(step - 1, layers, step)); the estimate's learned activations read layer 1 as
    every layer's and say so. Scout (every layer MoE) has no such note."""
    from llmem.model.moe import routing_notes

    config = json.loads(catalog_file("tiny", "tiny-llama4.json"))
    config["text_config"]["interleave_moe_layer_step"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    anatomy = load_anatomy(str(tmp_path))
    dense = [p.name for p in anatomy.layer0_params if "feed_forward" in p.name]
    assert dense and not any("experts" in n for n in dense)          # layer 0 dense, as transformers builds it
    notes = routing_notes(anatomy, learned=True)
    assert any("interleave_moe_layer_step 2: 2 of 4 layers MoE" in n for n in notes), notes
    assert not any("interleave" in n for n in routing_notes(anatomy, learned=False))
    assert not any("interleave" in n for n in routing_notes(load_anatomy("tiny-llama4"), learned=True))
