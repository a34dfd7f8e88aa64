"""`llmem trace` of the eval phase (llmem.runtime.evaluation: the real model under no_grad, transformers'
EvalLoopContainer) against the estimate's analytic phase (llmem.estimator.eval_phase): two independent readings of
the same code paths, which must agree to within the trace's 512-byte rounding and the loss's few scalars."""

from __future__ import annotations

import pytest

from llmem import estimate, trace
from llmem.setup.training import TrainingSetup

SETUPS = [
    {},                                                                            # loss only, one GPU
    {"eval_keeps": "logits", "eval_samples": 32},                                  # 4 steps' fp32 logits kept
    {"method": "ddp", "gpus": 2, "eval_keeps": "logits", "eval_samples": 48, "eval_accumulation_steps": 2},
    {"method": "fsdp", "gpus": 2, "eval_keeps": "logits", "eval_samples": 16},     # gathered from both ranks
    {"method": "zero2", "gpus": 2},                                                # every layer kept gathered
    {"quant_base": "nf4", "lora_rank": 8, "eval_keeps": "token-ids", "eval_samples": 24},
]


def eval_bytes(result) -> int:
    return next(p.device_bytes for p in result.job_phases if p.name == "eval")


@pytest.mark.parametrize("kw", SETUPS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "loss")
def test_the_traced_eval_agrees_with_the_estimate(kw):
    setup = TrainingSetup(model="tiny-llama", seq_len=256, eval_batch_size=8, **kw)
    traced, estimated = eval_bytes(trace(setup)), eval_bytes(estimate(setup))
    assert abs(estimated - traced) <= 0.0005 * traced, (estimated, traced)


def test_the_eval_leaves_the_traced_step_as_it_was():
    plain = trace(TrainingSetup(model="tiny-llama", seq_len=256))
    evaluating = trace(TrainingSetup(model="tiny-llama", seq_len=256, eval_batch_size=8, eval_keeps="logits",
                                     eval_samples=16))
    assert (evaluating.peak_allocated_bytes, evaluating.peak_reserved_bytes, evaluating.components) == \
        (plain.peak_allocated_bytes, plain.peak_reserved_bytes, plain.components)
    assert eval_bytes(evaluating) > evaluating.peak_allocated_bytes      # 8 x 256 tokens of fp32 logits, twice
    assert evaluating.to_dict()["job_peak"]["phase"] == "eval"
    assert [p.name for p in plain.job_phases] == ["load", "save"]          # (llmem.runtime.loading, saving)
    assert [p.name for p in evaluating.job_phases] == ["load", "eval", "save"]
    assert evaluating.job_notes[0].startswith("eval traced after the step")


def test_a_set_up_the_trace_cannot_evaluate_says_so():
    result = trace(TrainingSetup(model="tiny-llama", seq_len=128, method="tp", gpus=2, eval_batch_size=4))
    assert not result.job_phases
    assert result.job_notes == ["the eval (--eval-batch-size 4) is not traced under tensor parallelism"]
