"""Vision-language anatomies: Qwen2.5-VL built from its real class on the meta device, its three parts counted."""

from __future__ import annotations

import pytest

from llmem.model.anatomy import load_anatomy
from llmem.model.vision import LANGUAGE, PROJECTOR, VISION, part_params, vision_spec


def _vision_encoder(hidden: int, mlp: int, depth: int, patch: int = 14, temporal: int = 2) -> int:
    """Qwen2.5-VL's vision encoder by hand: a bias-free Conv3d patch embedding (3 x temporal x patch x patch -> hidden)
    and `depth` blocks of two RMSNorm weights, a biased qkv and proj, and a biased SwiGLU MLP."""
    embed = 3 * temporal * patch * patch * hidden
    block = 2 * hidden + (hidden * 3 * hidden + 3 * hidden) + (hidden * hidden + hidden) \
        + 2 * (hidden * mlp + mlp) + (mlp * hidden + hidden)
    return embed + depth * block


def _merger(hidden: int, out: int, merge: int = 2) -> int:
    """The patch merger: an RMSNorm over `hidden`, then Linear(h*m^2, h*m^2) + GELU + Linear(h*m^2, out), biased."""
    wide = hidden * merge * merge
    return hidden + (wide * wide + wide) + (wide * out + out)


def _qwen2_language(vocab: int, hidden: int, mlp: int, layers: int, heads: int, kv_heads: int, tied: bool) -> int:
    """Qwen2's decoder: embeddings, layers (biased q/k/v, bias-free o and SwiGLU, two RMSNorms), final norm, head."""
    kv = hidden // heads * kv_heads
    layer = (hidden * hidden + hidden) + 2 * (hidden * kv + kv) + hidden * hidden + 3 * hidden * mlp + 2 * hidden
    return vocab * hidden * (1 if tied else 2) + layers * layer + hidden


@pytest.mark.parametrize(("model", "vision", "projector", "language"), [
    # vision_config: hidden 1280, intermediate 3420, depth 32; out_hidden_size = the language model's width
    ("Qwen/Qwen2.5-VL-7B-Instruct", _vision_encoder(1280, 3420, 32), _merger(1280, 3584),
     _qwen2_language(152064, 3584, 18944, 28, 28, 4, tied=False)),
    ("Qwen/Qwen2.5-VL-3B-Instruct", _vision_encoder(1280, 3420, 32), _merger(1280, 2048),
     _qwen2_language(151936, 2048, 11008, 36, 16, 2, tied=True)),
    ("tiny-qwen2_5_vl", _vision_encoder(128, 344, 4), _merger(128, 512),
     _qwen2_language(16000, 512, 1408, 4, 8, 2, tied=False)),
])
def test_parts_are_counted_as_built(model, vision, projector, language):
    anatomy = load_anatomy(model)
    assert part_params(anatomy) == {VISION: vision, PROJECTOR: projector, LANGUAGE: language}
    assert anatomy.total_params == vision + projector + language


def test_published_count_of_the_7b():
    # Qwen2.5-VL-7B-Instruct's model card / safetensors index: 8,292,166,656 parameters; its language model is
    # Qwen2.5-7B's 7,615,616,512
    counts = part_params(load_anatomy("Qwen/Qwen2.5-VL-7B-Instruct"))
    assert sum(counts.values()) == 8_292_166_656
    assert counts[LANGUAGE] == 7_615_616_512


def test_decoder_layers_are_the_language_models():
    """The 7B's vision encoder holds 32 blocks, its language model 28 layers: the layers are the language model's."""
    anatomy = load_anatomy("Qwen/Qwen2.5-VL-7B-Instruct")
    assert anatomy.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert anatomy.decoder_layer_class == "Qwen2_5_VLDecoderLayer"
    assert (anatomy.num_layers, anatomy.hidden_size, anatomy.num_heads, anatomy.num_kv_heads) == (28, 3584, 28, 4)
    by_name = {p.name: p for p in anatomy.params}
    assert by_name["model.language_model.layers.27.mlp.down_proj.weight"].layer_index == 27
    assert by_name["model.visual.blocks.31.mlp.down_proj.weight"].layer_index is None
    assert by_name["model.visual.merger.mlp.0.weight"].shape == (5120, 5120)


def test_text_models_have_no_parts():
    assert vision_spec("qwen2") is None
    assert part_params(load_anatomy("tiny-qwen2")) == {}
