"""QLoRA under GRPO / RLOO (TRL 1.16's GRPOTrainer / RLOOTrainer on a bitsandbytes base, transformers' generate):
the KV cache in the dtype bitsandbytes' linears return, generate's and the scoring's dequantisation against the
trace phase by phase, the planner's QLoRA menu, and what stays refused (tiny-llama: hidden 512, intermediate 1376,
4 layers of 8 KV heads of 64)."""

from __future__ import annotations

import re

import pytest

from llmem import estimate, trace
from llmem.cli import main
from llmem.errors import LlmemError
from llmem.estimator.generation import generation_kv_bytes
from llmem.model.resolved import resolve
from llmem.setup.objectives import REF_ADAPTERS_OFF, reference_mode
from llmem.setup.training import TrainingSetup


def qlora_grpo(**kw) -> TrainingSetup:
    return TrainingSetup(**{"model": "tiny-llama", "gpu": "H100-80GB", "objective": "grpo", "batch_size": 4,
                            "seq_len": 16, "num_generations": 4, "max_completion_length": 4,
                            "precision": "bf16-mixed", "lora_rank": 8, "lora_targets": "all-linear",
                            "quant_base": "nf4", **kw})


@pytest.mark.parametrize(("fields", "element_bytes"), [
    ({}, 4),                                   # behind the kbit upcast's fp32 norms: Linear4bit returns fp32
    ({"kbit_upcast": False, "precision": "bf16"}, 2),    # a bf16 stream: bf16 k_proj / v_proj outputs
    ({"quant_base": "none"}, 2),               # autocast's bf16 projections
])
def test_kv_cache_in_the_dtype_the_projections_return(fields, element_bytes):
    """The DynamicCache holds k_proj's and v_proj's outputs: 2 x 4 layers x 4 rows x 8 heads x 64 x (16 - 1) tokens;
    bitsandbytes' Linear4bit casts its output back to its input's dtype (`.to(inp_dtype)`)."""
    assert generation_kv_bytes(resolve(qlora_grpo(**fields))) == 2 * 4 * 4 * 8 * 64 * 15 * element_bytes


@pytest.mark.parametrize("fields", [
    {"batch_size": 1, "seq_len": 64, "steps_per_generation": 8, "optimizer": "sgd"},   # 8 rows, a 60-token prefill
    {"objective": "rloo", "num_generations": None},      # beta 0.05: the reference with its adapters disabled
])
def test_each_phase_against_the_trace(fields):
    """generate's forwards and the scoring's run the 4-bit linears (a dequantised weight each, Linear4bit's cast
    back, peft's clone unless the adapters are disabled): each phase's peak allocated within 0.5 % of the trace."""
    setup = qlora_grpo(**fields)
    est, tr = estimate(setup), trace(setup, job_phases=False)
    want = {p.name: p.allocated_bytes for p in tr.phases}
    assert {p.name for p in est.phases} == set(want) == {"generation", "scoring", "training"}
    for p in est.phases:
        assert abs(p.allocated_bytes - want[p.name]) <= 0.005 * want[p.name], p.name


def test_rloo_scores_the_base_with_its_adapters_disabled():
    assert reference_mode(qlora_grpo(objective="rloo", num_generations=None)) == REF_ADAPTERS_OFF


@pytest.mark.parametrize(("fields", "message"), [
    ({"quant_base": "torchao-nf4", "precision": "bf16", "adapter_dtype": "base"}, "use --qlora or --load-in-8bit"),
    ({"use_vllm": True}, "--qlora with --use-vllm under --objective grpo is not modelled"),
    ({"method": "ddp", "gpus": 2, "batch_size": 1, "num_generations": 2}, "gemv_4bit decode kernel"),
])
def test_what_is_still_refused(fields, message):
    with pytest.raises(LlmemError, match=re.escape(message)):
        qlora_grpo(**fields)


def test_refusal_is_one_line_exit_2(capsys):
    assert main(["estimate", "tiny-llama", "--objective", "grpo", "--qlora", "--lora-rank", "8", "--use-vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--use-vllm" in err


def test_the_planner_proposes_qlora_under_grpo():
    """The adapter menus ask the set-up whether the objective takes the menu: QLoRA under GRPO now does."""
    from llmem.planner.suggestions.fitting import applied

    plain = qlora_grpo(quant_base="none", lora_rank=0, lora_targets="q_proj,v_proj")
    assert applied(plain, quant_base="nf4", lora_rank=8) is not None
    assert applied(plain, quant_base="torchao-nf4", lora_rank=8, precision="bf16") is None
