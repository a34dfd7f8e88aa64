"""--logits-dtype: the causal-LM loss on fp32 logits (transformers' upcast) or on the lm_head's output as it is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmem.cli import build_parser
from llmem.cli.options import setup_from_args
from llmem.errors import LlmemError
from llmem.estimator.engine import estimate
from llmem.memory.activations.profile import activation_profile
from llmem.model.resolved import resolve
from llmem.runtime.losses import causal_lm_loss_in_model_dtype
from llmem.runtime.trace import trace
from llmem.setup.training import TrainingSetup

# tiny-llama: vocab 32000; batch 2 x seq 256 = 512 tokens: 16,384,000 logits
TOKENS_VOCAB = 512 * 32000


def _setup(**kw) -> TrainingSetup:
    return TrainingSetup(model="tiny-llama", gpu="H100-80GB", optimizer="sgd", batch_size=2, seq_len=256, **kw)


@pytest.mark.parametrize("precision, logits_dtype, per_element", [
    ("bf16", "fp32", 3 * 4),            # log-softmax, nll_loss's gradient, log_softmax's gradient: fp32
    ("bf16", "model", 3 * 2),           # the same three in bf16
    ("bf16-mixed", "fp32", 3 * 4),
    ("bf16-mixed", "model", 2 + 4 + 4),  # bf16 log-softmax, autocast's fp32 cast for nll_loss, its fp32 gradient
    ("fp32", "model", 3 * 4),           # fp32 logits already: nothing changes
])
def test_loss_backward_peak_in_worked_bytes(precision, logits_dtype, per_element):
    act = activation_profile(resolve(_setup(precision=precision, logits_dtype=logits_dtype)))
    assert act.loss_peak == per_element * TOKENS_VOCAB


@pytest.mark.parametrize("precision, logits_dtype, per_element", [
    ("bf16", "fp32", 2 + 4 + 4),         # bf16 logits, their fp32 upcast, the fp32 log-softmax
    ("bf16", "model", 2 + 2),            # bf16 logits and log-softmax
    ("bf16-mixed", "model", 2 + 2 + 4),  # ... and autocast's fp32 cast of the log-softmax for nll_loss
])
def test_forward_loss_moment_in_worked_bytes(precision, logits_dtype, per_element):
    moments = estimate(_setup(precision=precision, logits_dtype=logits_dtype)).moments
    forward = next(m for m in moments if m["phase"] == "forward")
    assert forward["components"]["logits_and_loss"] == per_element * TOKENS_VOCAB


@pytest.mark.parametrize("precision", ["bf16", "bf16-mixed"])
def test_estimate_matches_the_trace_within_two_percent(precision):
    s = _setup(precision=precision, logits_dtype="model")
    e, t = estimate(s), trace(s)
    assert e.peak_allocated_bytes == pytest.approx(t.peak_allocated_bytes, rel=0.02)
    assert e.peak_reserved_bytes == pytest.approx(t.peak_reserved_bytes, rel=0.02)


def test_the_loss_equals_transformers_cross_entropy_and_keeps_the_dtype():
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16)
    labels = torch.randint(0, 11, (2, 5))
    got = causal_lm_loss_in_model_dtype(logits, labels, vocab_size=11)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
    assert got.dtype == torch.bfloat16
    assert got.float().item() == pytest.approx(want.float().item(), rel=1e-2)


def test_flag_reaches_the_setup_and_bad_values_are_refused():
    args = build_parser().parse_args(["estimate", "tiny-llama", "--logits-dtype", "model"])
    assert setup_from_args(args).logits_dtype == "model"
    with pytest.raises(LlmemError, match="--logits-dtype"):
        _setup(logits_dtype="fp16")
    with pytest.raises(LlmemError, match="--logits-dtype model with --fused-ce"):
        estimate(_setup(logits_dtype="model", fused_ce=True))
