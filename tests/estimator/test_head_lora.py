"""LoRA on the lm_head (the adapters in the logits' dtype): the forward's and backward's [tokens, vocab] tensors,
worked out by hand for tiny-llama (hidden 512, vocab 32,000), bf16, --adapter-dtype base, rank 8, 2 x 512 tokens:
t = 1,024 tokens, a [t, vocab] bf16 tensor 65,536,000 B, lora_A's output [t, 8] bf16 16,384 B, a [t, hidden] bf16
gradient 1,048,576 B. The estimate against the trace is the CI matrix's (two rows)."""

from __future__ import annotations

import pytest

from llmem.errors import LlmemError
from llmem.estimator.engine import rank_step, step_schedule
from llmem.model.resolved import resolve
from llmem.setup.training import TrainingSetup

TV_BF16 = 1024 * 32000 * 2
A_OUT = 1024 * 8 * 2


def _events(**kw):
    s = TrainingSetup("tiny-llama", precision="bf16", adapter_dtype="base", batch_size=2, seq_len=512, lora_rank=8,
                      gpu="H100-80GB", **kw)
    r, act = rank_step(resolve(s))
    sch = step_schedule(r, act).build()
    head = next(i for i, where in sch.marks if where == "lm_head and loss")
    layer = next(i for i, where in sch.marks if i > head and where.startswith("layer"))
    return [(sign, size) for sign, _k, size, _s, _c in sch.events[head:layer]]


def test_the_forward_sums_the_adapters_output_into_new_logits():
    with_head = _events(lora_targets="all-linear,lm_head")
    without = _events(lora_targets="all-linear")
    made = [n for sign, n in with_head if sign > 0]
    # lora_A's output, lora_B's output, its scaled copy, the sum: one kept, three [t, vocab] more in the forward,
    # and in backward the scaled gradient and lora_A's output gradient
    assert made.count(TV_BF16) == [n for sign, n in without if sign > 0].count(TV_BF16) + 4
    assert made.count(A_OUT) == 2
    # [t, hidden] bf16: the lm_head's input, kept for lora_A (a frozen lm_head alone keeps none), and the input
    # gradient made twice (lora_A's, the base linear's) before their sum, where a frozen head makes it once
    assert made.count(1024 * 512 * 2) == [n for sign, n in without if sign > 0].count(1024 * 512 * 2) + 3


@pytest.mark.parametrize("kw, words", [
    ({"lora_targets": "all-linear,lm_head", "adapter_dtype": "fp32"}, "fp32 adapters on a low-precision base"),
    ({"lora_targets": "lm_head"}, "no adapter before it"),
    ({"lora_targets": "all-linear,lm_head", "lora_dropout": 0.05}, "--lora-dropout 0.05"),
    ({"lora_targets": "all-linear,lm_head", "fused_ce": True}, "--fused-ce"),
])
def test_what_is_not_modelled_is_refused_in_one_line(kw, words):
    kw = {"adapter_dtype": "base", **kw}
    with pytest.raises(LlmemError, match="LoRA on the output layer 'lm_head' with " + words.replace("(", r"\(")):
        resolve(TrainingSetup("tiny-llama", precision="bf16", batch_size=2, seq_len=64, lora_rank=8, **kw))
