"""Llama 3.2 Vision (transformers' mllama): its parts counted by hand against the published parameter counts, the
tiles as the installed transformers' MllamaImageProcessor makes them (its PIL backend built offline from the shipped
preprocessor_config.json), worked examples by hand, its -Instruct releases read with the base config, and the
estimate of its two kinds of decoder layer (each learned from a layer of its kind; the trace runs the step:
tests/runtime/test_vision_measure.py, and the CI rows compare the two).
"""

from __future__ import annotations

import json
import warnings

import pytest

from llmem.cli import main
from llmem.model.anatomy import load_anatomy
from llmem.model.catalog import catalog_file
from llmem.model.catalog.variants import variant_entry
from llmem.model.images import (
    PROCESSORS,
    canvas_grid,
    image_grid,
    optimal_canvas,
    pixel_values_shape,
    prescaled,
)
from llmem.model.vision import LANGUAGE, PROJECTOR, VISION, part_params
from llmem.model.vision_inputs import vision_inputs
from llmem.setup.training import TrainingSetup

np = pytest.importorskip("numpy")

SMALL, LARGE = "meta-llama/Llama-3.2-11B-Vision", "meta-llama/Llama-3.2-90B-Vision"


def _vision(hidden=1280, mlp=5120, patch=14, image=560, tiles=4, local=32, global_=8) -> int:
    """MllamaVisionModel: a bias-free Conv2d patch embedding, the class embedding, the gated position embedding (one
    row per patch and the class token, its gate, and a tile-position table of max_num_tiles x patches x hidden per
    aspect-ratio id, 8 ratios + padding id), the gated pre- and post-tile embeddings (a max_num_tiles x hidden row per
    id), two biased LayerNorms, then `local` layers and `global_` gated ones (two LayerNorms, bias-free q/k/v/o, a
    biased fc1/fc2 MLP; a gated layer's two gates)."""
    ids, patches = 8 + 1, (image // patch) ** 2 + 1
    embeddings = 3 * patch * patch * hidden + hidden + (1 + patches * hidden + ids * tiles * patches * hidden) \
        + 2 * (ids * tiles * hidden + 1) + 2 * 2 * hidden
    layer = 2 * 2 * hidden + 4 * hidden * hidden + (hidden * mlp + mlp) + (mlp * hidden + hidden)
    return embeddings + local * layer + global_ * (layer + 2)


def _text(hidden, mlp, layers, cross, heads, kv_heads, vocab) -> int:
    """MllamaTextModel with its lm_head: vocab + 8 embedding rows, self-attention layers (bias-free q/k/v/o, a gated
    MLP, two RMSNorms), cross-attention layers (the same with a q and a k RMSNorm of head_dim and two tanh gates), the
    final norm, an untied lm_head of vocab rows."""
    head_dim = hidden // heads
    plain = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * mlp + 2 * hidden
    crossing = plain + 2 * head_dim + 2
    return (vocab + 8) * hidden + (layers - cross) * plain + cross * crossing + hidden + vocab * hidden


@pytest.mark.parametrize(("model", "published", "text", "hidden"), [
    # the published config.json's text_config: 40 layers (8 cross-attention) of 4096; 100 (20) of 8192
    (SMALL, 10_670_220_835, _text(4096, 14336, 40, 8, 32, 8, 128_256), 4096),
    (LARGE, 88_593_355_323, _text(8192, 28672, 100, 20, 64, 8, 128_256), 8192),
])
def test_parts_by_hand_add_up_to_the_published_count(model, published, text, hidden):
    anatomy = load_anatomy(model)
    projector = 7680 * hidden + hidden      # the tower's 5 intermediate layers beside its output: 6 x 1280
    assert part_params(anatomy) == {VISION: _vision(), PROJECTOR: projector, LANGUAGE: text}
    assert anatomy.total_params == published
    assert round(published / 1e8) in (107, 886)         # 10.7B and 88.6B (HF's safetensors metadata)


def test_tiny_parts_by_hand():
    anatomy = load_anatomy("tiny-mllama")
    assert part_params(anatomy) == {VISION: _vision(128, 512, 14, 112, 4, 4, 2), PROJECTOR: 384 * 256 + 256,
                                    LANGUAGE: _text(256, 688, 4, 2, 4, 2, 16_000)}


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.2-11B-Vision-Instruct", "unsloth/Llama-3.2-11B-Vision-Instruct"])
def test_instruct_releases_read_the_base_config(name):
    assert variant_entry(name).hub_id == SMALL
    assert variant_entry("meta-llama/Llama-3.2-90B-Vision-Instruct").hub_id == LARGE


@pytest.fixture(scope="module")
def processor():
    """transformers' MllamaImageProcessorPil from the shipped preprocessor_config.json (560x560 tiles, 4 at most)."""
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    raw = json.loads(catalog_file("processors", PROCESSORS["mllama"].config_file))
    assert raw["image_processor_type"] == PROCESSORS["mllama"].image_processor_type
    return MllamaImageProcessorPil(**{k: v for k, v in raw.items()
                                      if k not in ("image_processor_type", "processor_class")})


def _processed(processor, sizes: list[tuple[int, int]]):
    """One sample holding images of `sizes`: (pixel_values' shape, its num_tiles, aspect_ratio_ids, the mask)."""
    from PIL import Image

    images = [Image.fromarray(np.zeros((h, w, 3), dtype=np.uint8)) for h, w in sizes]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = processor(images=[images], return_tensors="np")
    return (out["pixel_values"].shape, out["num_tiles"], out["aspect_ratio_ids"].tolist(),
            out["aspect_ratio_mask"].tolist())


SIZES = [(560, 560), (1120, 1120), (448, 448), (100, 100), (560, 1120), (1120, 560), (768, 1024), (1024, 768),
         (1080, 1920), (500, 333), (10, 2000), (4000, 100), (2240, 560), (3000, 3000), (600, 1700), (1700, 600)]


@pytest.mark.parametrize(("height", "width"), SIZES)
def test_tiles_equal_the_processors(processor, height, width):
    config = load_anatomy(SMALL).config
    shape, num_tiles, ids, mask = _processed(processor, [(height, width)])
    grid = image_grid("mllama", height, width, config=config)
    rows, cols = grid.canvas_tiles
    assert shape == pixel_values_shape("mllama", grid, 1) == (1, 1, 4, 3, 560, 560)
    assert num_tiles == [[rows * cols]]
    assert mask == [[[1] * (rows * cols) + [0] * (4 - rows * cols)]]
    ratios = [(a, b) for a in range(1, 5) for b in range(1, 5) if a * b <= 4]     # get_all_supported_aspect_ratios
    assert ids == [[ratios.index((rows, cols)) + 1]]
    assert (grid.tokens, grid.patches) == (1, 4 * 40 * 40)      # one <|image|> token; 4 tiles of 40 x 40 patches


def test_two_images_a_sample(processor):
    shape, num_tiles, _, _ = _processed(processor, [(1120, 560), (560, 560)])
    assert shape == (1, 2, 4, 3, 560, 560) and num_tiles == [[2, 1]]
    grid = image_grid("mllama", 1120, 560, config=load_anatomy(SMALL).config, images_per_sample=2)
    assert pixel_values_shape("mllama", grid, 4, 2) == (2, 2, 4, 3, 560, 560)


def test_worked_examples():
    # 560x560 fits one tile exactly (scale 1: the smallest upscale >= 1, the least area among 1x1, 1x2, ...)
    assert optimal_canvas(560, 560, 4, 560) == (560, 560)
    # 1000x1000: 1x1 would downscale it (0.56); 2x2 upscales by 1.12, the smallest upscale of those that do
    assert optimal_canvas(1000, 1000, 4, 560) == (1120, 1120)
    # 600x1700: 1x3 gives min(560/600, 1680/1700) = 0.933, 1x4 min(0.933, 1.318) = 0.933 too: the smaller area
    assert optimal_canvas(600, 1700, 4, 560) == (560, 1680)
    grid = canvas_grid(load_anatomy("tiny-mllama").config, 560, 840)
    # the tiny tower's 112-pixel tiles: 560x840 downscales best on 2x2 (min(224/560, 224/840) = 0.267)
    assert (grid.canvas_tiles, grid.crops, grid.grid_h, grid.patches) == ((2, 2), 4, 8, 4 * 64)


def test_llamafactory_prescale_then_the_processor(processor):
    """LLaMA-Factory's image_max_pixels scales the image first; the processor tiles what it is given."""
    height, width = prescaled(1400, 600, 560 * 560, None)
    _, num_tiles, _, _ = _processed(processor, [(height, width)])
    grid = image_grid("mllama", 1400, 600, 560 * 560, config=load_anatomy(SMALL).config)
    rows, cols = grid.canvas_tiles
    assert num_tiles == [[rows * cols]] and grid.original == (height, width)


def test_language_tokens():
    setup = TrainingSetup("tiny-mllama", batch_size=2, seq_len=64, images_per_sample=2, image_size="560x840")
    inputs = vision_inputs(setup, load_anatomy(setup.model))
    assert (inputs.visual_tokens, inputs.language_tokens, inputs.patches) == (2, 66, 2 * 4 * 64)


@pytest.mark.parametrize(("model", "fields", "graphless"), [
    ("tiny-mllama", {"freeze_language_model": True}, 1),      # cross_attention_layers [1, 3]: layer 0 below
    (SMALL, {"freeze_language_model": True}, 3),              # [3, 8, ..., 38]: layers 0, 1 and 2 below
    ("tiny-mllama", {"freeze_language_model": True, "grad_ckpt": True}, 0),   # enable_input_require_grads
    ("tiny-mllama", {"lora_rank": 8}, 0),                     # adapters in layer 0: its graph starts there
    ("tiny-mllama", {"freeze_vision_tower": True}, 0),        # the embedding trains
])
def test_layers_below_the_first_cross_attention_layer_without_a_graph(model, fields, graphless):
    """With nothing below the first cross-attention layer trained, MllamaTextModel's stream needs no gradient until
    that layer reads the trained image features: the layers below keep nothing (the trace's freeze_language_model
    row checks the step)."""
    from llmem.memory.activations.profile import graphless_layers
    from llmem.model.resolved import resolve

    setup = TrainingSetup(model, images_per_sample=1, image_size="560x560", **fields)
    assert graphless_layers(resolve(setup).anatomy, setup) == graphless


@pytest.fixture(scope="module")
def learned_tiny(tmp_path_factory):
    """tiny-mllama's activations learned from its real step (bf16-mixed, 4 x 60 text tokens, one 448x448 image)."""
    from llmem.learn.shallow_copy import learn
    from llmem.model.resolved import resolve

    setup = TrainingSetup("tiny-mllama", gpu="H100-80GB", precision="bf16-mixed", batch_size=4, seq_len=60,
                          images_per_sample=1, image_size="448x448")
    return learn(resolve(setup))


def test_each_layer_kind_is_read_from_a_layer_of_its_own(learned_tiny):
    """The cross-attention layers keep their keys and values over the image tiles' tokens, the self-attention layers
    none of that size: 4 samples x 4 tiles of (112 / 14)^2 + 1 = 65 tokens, the 2 key-value heads repeated to the 4
    query heads of 256 / 4 = 64 (transformers' sdpa_attention_forward: repeat_kv before SDPA, which keeps them), bf16."""
    kv_bytes = 4 * 4 * 65 * 4 * 64 * 2
    crossing, plain = learned_tiny.cross_recipe_blocks(4, 60), learned_tiny.recipe(4, 60).blocks
    assert sum(n == kv_bytes for b in crossing for n in b.tensors) >= 2          # k_proj's and v_proj's outputs
    assert not any(n == kv_bytes for b in plain for n in b.tensors)
    assert any(".cross_attn." in p for b in crossing for p in b.params)
    assert not any(".cross_attn." in p for b in plain for p in b.params)
    assert "read twice" in learned_tiny.note


def test_the_vision_side_is_read_after_the_embeddings_backward(learned_tiny):
    """Full fine-tuning trains the tower: its backward (after the token embedding's) makes a gradient for each of its
    parameters and the projector's, as many as the model has."""
    grads = {op[4] for op in learned_tiny.vision.backward if op[0] == "grad"}
    anatomy = load_anatomy("tiny-mllama")
    vision = {p.name for p in anatomy.params if p.name.startswith(("model.vision_model.", "model.multi_modal_"))}
    assert grads == vision


def test_llamafactory_config_reads_the_instruct_model(tmp_path):
    """LLaMA-Factory's mllama template with its freeze and image switches: the model read with the base config, the
    pixel bound and the frozen tower kept, the tiles sized from the bound-scaled image."""
    from llmem.setup.sources import setup_from_file

    path = tmp_path / "mllama.yaml"
    path.write_text("model_name_or_path: meta-llama/Llama-3.2-11B-Vision-Instruct\nstage: sft\nfinetuning_type: lora\n"
                    "lora_target: all\ntemplate: mllama\ncutoff_len: 2048\nfreeze_vision_tower: true\n"
                    "image_max_pixels: 262144\nper_device_train_batch_size: 1\nbf16: true\n")
    setup = setup_from_file(path, images_per_sample=1, image_size="1120x1120").setup
    assert (setup.freeze_vision_tower, setup.max_pixels, setup.lora_rank > 0) == (True, 512 * 512, True)
    inputs = vision_inputs(setup, load_anatomy(setup.model))
    # 1120x1120 scaled to 512x512 first: one 560x560 tile upscales it (560 / 512 >= 1), the rest padding
    assert inputs.image.original == (512, 512) and inputs.image.canvas_tiles == (1, 1)


def test_both_kinds_come_back_from_the_disk_cache(learned_tiny):
    from llmem.memory.activations.learned import LearnedActivations

    again = LearnedActivations.from_json(json.loads(json.dumps(learned_tiny.to_json())))
    assert again.cross_blocks == learned_tiny.cross_blocks and again.blocks == learned_tiny.blocks
    assert again.cross_recipe_blocks(4, 60) == learned_tiny.cross_recipe_blocks(4, 60)


def test_plan_answers_with_its_layouts(monkeypatch, capsys):
    """`llmem plan` searches the layouts a vision-language step is wired for; its answer at the batch it found is the
    full estimate's of that set-up (the planner confirms with one)."""
    from llmem.estimator.engine import estimate
    from llmem.memory.activations.learned import LEARN_ENV
    from llmem.validate.rows import row

    monkeypatch.setenv(LEARN_ENV, "auto")          # (the suite turns learning off; the vision side is learned)
    images = {"images_per_sample": 1, "image_size": "448x448", "seq_len": 64}
    assert main(["plan", "tiny-mllama", "--gpu", "H100-80GB", "--gpus", "2", "--max-batch", "2", "--json",
                 "--images-per-sample", "1", "--image-size", "448x448", "--seq-len", "64"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert {m["method"] for m in answer["methods"]} == {"ddp", "fsdp", "zero2"}
    best = answer["recommended"]
    setup = row("tiny-mllama", best["method"], 2, batch_size=best["micro_batch_size"], **images)
    assert best["fits"] and best["peak_reserved_bytes"] == estimate(setup).peak_reserved_bytes
