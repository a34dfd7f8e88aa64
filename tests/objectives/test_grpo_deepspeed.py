"""GRPO / RLOO under DeepSpeed's engine (--method ds-zero2 / ds-zero3): TRL's unwrap_model_for_generation on the
engine (trl/models/utils.py): under ZeRO-3 deepspeed.zero.GatheredParameters over all the policy's parameters for the
whole generate (partition_parameters.py _allgather_params_coalesced: ceil(numel / dp) x dp elements per parameter in
bf16, the persistent ones, numel <= 1e5, already whole), nothing under ZeRO-2. Sizes by hand for tiny-llama (hidden
512, intermediate 1376, vocab 32000, 4 layers, untied); the refusals; the approximation note."""

from __future__ import annotations

import re
from math import ceil

import pytest

from llmem.errors import LlmemError
from llmem.estimator.engine import estimate
from llmem.setup.training import TrainingSetup

VOCAB, HIDDEN, FFN, LAYERS = 32000, 512, 1376, 4
LAYER_NUMELS = [HIDDEN * HIDDEN] * 4 + [HIDDEN * FFN] * 3 + [HIDDEN] * 2
NUMELS = [VOCAB * HIDDEN, VOCAB * HIDDEN, HIDDEN] + LAYER_NUMELS * LAYERS   # embed, lm_head, final norm, layers
PERSISTENCE_THRESHOLD = 100_000          # DeepSpeedZeroConfig's param_persistence_threshold default
BF16 = 2


def _grpo(method: str = "ds-zero3", gpus: int = 2, **kw) -> TrainingSetup:
    return TrainingSetup(**{"model": "tiny-llama", "gpu": "H100-80GB", "objective": "grpo", "method": method,
                            "gpus": gpus, "precision": "bf16-mixed", "optimizer": "sgd", "batch_size": 2,
                            "seq_len": 16, "num_generations": 2, "max_completion_length": 4, "beta": 0.0, **kw})


def _phase(result, name: str):
    return next(p for p in result.phases if p.name == name)


@pytest.mark.parametrize("gpus", [2, 3])
def test_zero3_generation_holds_the_whole_gathered_policy(gpus):
    """Every non-persistent parameter gathered whole (padded to a multiple of dp) in bf16 at generate's peak: on 2
    ranks (all even numels) the full model's 45,421,056 parameters less the 9 RMSNorms' 4,608, x 2 bytes."""
    gathered = sum(ceil(n / gpus) * gpus for n in NUMELS if n > PERSISTENCE_THRESHOLD) * BF16
    if gpus == 2:
        assert gathered == (45_421_056 - 9 * 512) * 2 == 90_832_896
    gen = _phase(estimate(_grpo(gpus=gpus)), "generation")
    assert gen.components["gathered_weights"] == gathered


def test_zero2_generation_gathers_nothing():
    """Under stages 1-2 unwrap_model_for_generation yields the engine's module as it is: no gathered weights; the
    reference (beta 0.04) a whole bf16 copy by its stage-0 engine: the generation phase's weights grow by it."""
    plain = _phase(estimate(_grpo("ds-zero2")), "generation")
    ref = _phase(estimate(_grpo("ds-zero2", beta=0.04)), "generation")
    assert plain.components.get("gathered_weights", 0) == 0
    assert ref.components["weights"] - plain.components["weights"] == sum(NUMELS) * BF16


@pytest.mark.parametrize(("fields", "message"), [
    ({"method": "ds-zero2", "use_vllm": True}, "weight sync to vLLM"),
    ({"objective": "rloo", "method": "ds-zero3", "use_vllm": True, "vllm_mode": "server"}, "weight sync to vLLM"),
])
def test_refusals(fields, message):
    with pytest.raises(LlmemError, match=re.escape(message)) as err:
        estimate(_grpo(**fields))
    assert "\n" not in str(err.value)


def test_notes():
    """The generation note says ZeRO-3 gathers the whole policy; the approximation note names RLOO's and KTO's
    second forward under ZeRO-3, and nothing for GRPO without one."""
    grpo = " ".join(estimate(_grpo()).notes)
    assert "unwrap_model_for_generation gathers the whole policy" in grpo and "approximate under ZeRO-3" not in grpo
    rloo = " ".join(estimate(_grpo(objective="rloo", beta=None)).notes)
    assert "approximate under ZeRO-3" in rloo and "old-policy scoring forward" in rloo
    kto = TrainingSetup("tiny-llama", gpu="H100-80GB", objective="kto", method="ds-zero3", gpus=2,
                        precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=64)
    assert "KTO's no_grad KL forward" in " ".join(estimate(kto).notes)


@pytest.mark.slow
@pytest.mark.parametrize(("setup", "within"), [
    (_grpo("ds-zero2", beta=0.04), 0.02), (_grpo(), 0.02), (_grpo("ds-zero1"), 0.02),
    # two policy forwards a step under ZeRO-3 (the note's approximation): LoRA's adapters-off reference, RLOO's
    # old-policy scoring forward
    (_grpo(beta=0.04, lora_rank=16), 0.03), (_grpo(objective="rloo", beta=None), 0.03),
], ids=["zero2-beta", "zero3", "zero1", "zero3-lora-beta", "rloo-zero3"])
def test_trace_agrees(setup, within):
    """DeepSpeed's engine on fake tensors running TRL's own unwrap_model_for_generation: within 2 % on allocated
    and reserved (3 % with two policy forwards a step); under ZeRO-3 the traced generation phase gathers the same
    bytes as by hand."""
    from llmem.runtime.deepspeed import deepspeed_step

    est = estimate(setup)
    trace, _ = deepspeed_step(setup)
    for field in ("peak_allocated_bytes", "peak_reserved_bytes"):
        assert abs(getattr(est, field) / getattr(trace, field) - 1) < within
    if setup.method == "ds-zero3":
        assert _phase(trace, "generation").components["gathered_weights"] == \
            sum(n for n in NUMELS if n > PERSISTENCE_THRESHOLD) * BF16
