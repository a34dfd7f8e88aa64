"""--lora-targets "re:PATTERN": peft's target_modules given as one string, a regular expression each module's full
name must match whole (peft's check_target_module_exists), as axolotl passes a string lora_target_modules. Checked
against peft itself applying the same pattern to the real (meta) model, and against the trace."""

from __future__ import annotations

import pytest
import yaml

from llmem import estimate
from llmem.errors import LlmemError
from llmem.model.anatomy import load_anatomy
from llmem.model.config import build_meta_model, resolve_config
from llmem.model.peft import with_lora
from llmem.planner.export import unexportable_options
from llmem.runtime.trace import trace
from llmem.setup.sources import setup_from_file
from llmem.setup.training import user_setup

ATTN_AND_DOWN = r"re:model\.layers\.\d+\.(self_attn\.(q|v)|mlp\.down)_proj"


def _peft_trainable(model: str, pattern: str, rank: int) -> int:
    """peft's own count: LoRA with the string target_modules on the meta model."""
    from peft import LoraConfig, get_peft_model

    meta = build_meta_model(resolve_config(model)[1])
    peft_model = get_peft_model(meta, LoraConfig(r=rank, target_modules=pattern, task_type="CAUSAL_LM"))
    return sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def _trainable(anatomy) -> int:
    return sum(p.numel for p in anatomy.params if p.trainable)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_the_adapters_peft_makes_for_the_pattern(model):
    anatomy = load_anatomy(model)
    got = with_lora(anatomy, 8, ATTN_AND_DOWN)
    assert _trainable(got) == _peft_trainable(model, ATTN_AND_DOWN[3:], 8)
    # the same modules as the names q_proj, v_proj, down_proj
    named = with_lora(anatomy, 8, "q_proj,v_proj,down_proj")
    assert [p.name for p in got.params] == [p.name for p in named.params]


def test_every_projection_is_all_linear():
    anatomy = load_anatomy("tiny-llama")
    assert [p.name for p in with_lora(anatomy, 4, "re:.*_proj").params] == \
        [p.name for p in with_lora(anatomy, 4, "all-linear").params]


def test_a_pattern_may_name_the_input_embedding():
    """peft's lora.Embedding on model.embed_tokens: A [8, 32000] and B [512, 8] beside the frozen weight."""
    params = with_lora(load_anatomy("tiny-llama"), 8, r"re:model\.embed_tokens|model\.layers\.0\.self_attn\.q_proj").params
    assert {(p.name, p.shape) for p in params if p.trainable} == {
        ("model.embed_tokens.lora_embedding_A.default", (8, 32000)),
        ("model.embed_tokens.lora_embedding_B.default", (512, 8)),
        ("model.layers.0.self_attn.q_proj.lora_A.default.weight", (8, 512)),
        ("model.layers.0.self_attn.q_proj.lora_B.default.weight", (512, 8))}


@pytest.mark.parametrize("targets, message", [
    (r"re:model\.norm|model\.layers\.0\.self_attn\.q_proj", "matches model.norm, not a linear"),
    ("re:q_proj", "matches no linear module"),          # peft matches the whole name: nothing is just q_proj
    (r"re:model\.layers\.\d+\.input_layernorm", "not a linear of the decoder layers"),
])
def test_patterns_llmem_cannot_model_are_refused(targets, message):
    with pytest.raises(LlmemError, match=message):
        with_lora(load_anatomy("tiny-llama"), 8, targets)


def test_a_pattern_that_is_no_regular_expression_is_refused_in_one_line(capsys):
    from llmem.cli import main

    assert main(["estimate", "tiny-llama", "--lora-rank", "8", "--lora-targets", "re:(q_proj"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a regular expression" in err


def test_the_trace_runs_peft_with_the_pattern():
    s = user_setup(model="tiny-llama", lora_rank=8, lora_targets=ATTN_AND_DOWN, seq_len=256, batch_size=2,
                   precision="bf16-mixed")
    est, real = estimate(s), trace(s, iterations=2)
    for counter in ("peak_allocated_bytes", "peak_reserved_bytes"):
        assert abs(getattr(est, counter) / getattr(real, counter) - 1) < 0.02, counter


def test_axolotl_string_targets_are_peft_regular_expressions(tmp_path):
    base = {"base_model": "tiny-llama", "sequence_len": 256, "micro_batch_size": 1, "datasets": [{"path": "x"}],
            "adapter": "lora", "lora_r": 8}
    path = tmp_path / "a.yaml"
    path.write_text(yaml.safe_dump({**base, "lora_target_modules": ATTN_AND_DOWN[3:]}))
    assert setup_from_file(str(path)).setup.lora_targets == ATTN_AND_DOWN
    path.write_text(yaml.safe_dump({**base, "lora_target_modules": ["q_proj", "v_proj"]}))
    assert setup_from_file(str(path)).setup.lora_targets == "q_proj,v_proj"


def test_exports_refuse_a_pattern():
    s = user_setup(model="tiny-llama", lora_rank=8, lora_targets=ATTN_AND_DOWN)
    assert f"--lora-targets {ATTN_AND_DOWN}" in unexportable_options(s, "trl")
