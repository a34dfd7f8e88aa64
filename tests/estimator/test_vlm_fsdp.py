"""A vision-language step under FSDP2 (--method fsdp / zero2): the tower's units as accelerate's auto-wrap makes them
(every module whose class the model names in `_no_split_modules`: the vision blocks, Gemma 3's SigLIP patch
embedding; the rest of the tower, the projector, the embeddings and the lm_head in the root unit), checked against
accelerate's own policy, by hand and against the trace, which shards the real VLM with fully_shard on a fake
process group."""

from __future__ import annotations

import functools
import types

import pytest

from llmem import estimate
from llmem.cli import main
from llmem.estimator.engine import rank_step
from llmem.estimator.schedule.facts import step_facts
from llmem.memory.activations.learned import LEARN_ENV
from llmem.model.anatomy import load_anatomy
from llmem.model.resolved import resolve
from llmem.model.vision import VISION_LANGUAGE, tower_units
from llmem.runtime.build import meta_model_for
from llmem.runtime.distributed import vision_units
from llmem.runtime.trace import trace
from llmem.setup.training import user_setup

TINY = {"qwen2_5_vl": "tiny-qwen2_5_vl", "qwen3_vl": "tiny-qwen3_vl", "gemma3": "tiny-gemma3",
        "llava_onevision": "tiny-llava_onevision", "idefics3": "tiny-idefics3", "smolvlm": "tiny-smolvlm",
        "mllama": "tiny-mllama", "internvl": "tiny-internvl", "llama4": "tiny-llama4"}
VL = dict(method="fsdp", gpus=2, precision="bf16-mixed", batch_size=4, seq_len=64, images_per_sample=1,
          image_size="448x448")


def test_every_vision_language_row_has_a_tiny_model_here():
    assert set(TINY) == set(VISION_LANGUAGE)


def _accelerate_units(model) -> list[str]:
    """accelerate's fsdp2_prepare_model: the modules its transformer auto-wrap policy (over the model's
    `_no_split_modules`) shards before the root, bottom-up, by name."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from accelerate.utils.other import get_module_children_bottom_up
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = types.SimpleNamespace(auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                                      transformer_layer_cls=set()),
                                   transformer_cls_names_to_wrap=None)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    names = {m: n for n, m in model.named_modules()}
    return [names[m] for m in get_module_children_bottom_up(model)[:-1] if policy(m)]


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_the_units_are_accelerates_auto_wrap(model_type):
    name = TINY[model_type]
    model = meta_model_for(user_setup(model=name, images_per_sample=1, image_size="448x448"))
    wrapped = _accelerate_units(model)
    spec = VISION_LANGUAGE[model_type]
    tower = [n for n in wrapped if n.startswith(spec.vision + ".")]
    order = [n for n, _ in model.named_modules()]
    if spec.unit_in_block:
        # Idefics3 / SmolVLM name their blocks' attention (Idefics3VisionAttention) in _no_split_modules: accelerate
        # wraps each block's self_attn alone
        assert tower == [f"{spec.vision_blocks}.{i}.self_attn" for i in range(4)]
    # the estimate's units (from the anatomy and the row), the trace's (from the built model), accelerate's
    assert list(tower_units(load_anatomy(name))) == sorted(tower, key=order.index)
    names = {m: n for n, m in model.named_modules()}
    assert [names[m] for m in vision_units(model)] == sorted(tower, key=order.index)
    # the decoder layers are its units too; nothing of the projector is
    assert not any(n.startswith(spec.projector) for n in wrapped)
    assert sum(n.startswith(spec.language_layers + ".") for n in wrapped) == 4


@pytest.fixture(autouse=True)
def _learning(monkeypatch):
    """The vision side is learned from the trace (llmem.learn); the suite turns learning off by default."""
    monkeypatch.setenv(LEARN_ENV, "auto")


def test_each_blocks_unit_by_hand():
    # tiny-qwen2_5_vl's vision block (tests/runtime/test_vision_trace.py): two norms 2 * 128, qkv 128 * 384 + 384,
    # proj 128 * 128 + 128, gate and up 2 * (128 * 344 + 344), down 344 * 128 + 128 = 199,216 parameters, gathered
    # in bf16 (MixedPrecisionPolicy's param_dtype): 398,432 bytes, every dim 0 even (no padding on 2 ranks)
    block = 2 * 128 + 128 * 384 + 384 + 128 * 128 + 128 + 2 * (128 * 344 + 344) + 344 * 128 + 128
    assert block == 199_216
    r, act = rank_step(resolve(user_setup(model="tiny-qwen2_5_vl", **VL)))
    f = step_facts(r, act)
    assert list(f.vision_units) == [f"model.visual.blocks.{i}" for i in range(4)]
    for unit in f.vision_units.values():
        assert sum(p.numel for p in unit) == block
        assert f.gathered_bytes(unit) == 2 * block
    # the root unit keeps the patch embedding (3 * 2 * 14 * 14 * 128) and the merger, not the blocks
    root = {p.name for p in f.root_unit}
    assert "model.visual.patch_embed.proj.weight" in root and "model.visual.merger.mlp.0.weight" in root
    assert not any(".blocks." in n for n in root)
    assert sum(p.numel for p in f.root_unit) == r.anatomy.root_params - 4 * block


def test_idefics3_attention_units_by_hand():
    # tiny-idefics3's Idefics3VisionAttention: biased q, k, v and out projections, 4 * (128 * 128 + 128) = 66,048
    # parameters, gathered in bf16; the blocks' norms and MLPs (2 * 2 * 128 + 128 * 344 + 344 + 344 * 128 + 128 =
    # 89,048 each) stay in the root unit with the embeddings and the connector
    attention, rest = 4 * (128 * 128 + 128), 2 * 2 * 128 + 128 * 344 + 344 + 344 * 128 + 128
    assert (attention, rest) == (66_048, 89_048)
    r, act = rank_step(resolve(user_setup(model="tiny-idefics3", **VL)))
    f = step_facts(r, act)
    assert list(f.vision_units) == [f"model.vision_model.encoder.layers.{i}.self_attn" for i in range(4)]
    for unit in f.vision_units.values():
        assert sum(p.numel for p in unit) == attention and f.gathered_bytes(unit) == 2 * attention
    root = {p.name for p in f.root_unit}
    assert "model.vision_model.encoder.layers.0.mlp.fc1.weight" in root
    assert "model.connector.modality_projection.proj.weight" in root
    assert sum(p.numel for p in f.root_unit) == r.anatomy.root_params - 4 * attention
    assert sum(p.numel for p in f.root_unit if ".encoder.layers." in p.name) == 4 * rest


@pytest.mark.parametrize("model, flags", [
    ("tiny-idefics3", dict(lora_rank=8)),
    ("tiny-gemma3", dict(freeze_vision_tower=True)),
    ("tiny-qwen3_vl", dict(lora_rank=8)),
    ("tiny-gemma3", dict(method="zero2")),
])
def test_the_trace_agrees_within_two_percent(model, flags):
    s = user_setup(**{**VL, "model": model, **flags})
    est, real = estimate(s), trace(s, iterations=2)
    for counter in ("peak_allocated_bytes", "peak_reserved_bytes"):
        assert abs(getattr(est, counter) / getattr(real, counter) - 1) < 0.02, counter


@pytest.mark.parametrize("argv, named", [
    (["--method", "fsdp+tp", "--gpus", "4", "--tp", "2"], "--method fsdp+tp"),
    (["--gpus", "4", "--dp-replicate", "2"], "--dp-replicate 2"),
    (["--gpus", "2", "--offload-param"], "--offload-param"),
    (["--gpus", "4", "--reshard-after-forward", "2"], "--reshard-after-forward 2"),
])
def test_what_is_not_wired_is_refused_in_one_line(capsys, argv, named):
    base = ["estimate", "tiny-qwen2_5_vl", "--images-per-sample", "1", "--image-size", "448x448", "--seq-len", "64"]
    assert main(base + argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and "Traceback" not in err
