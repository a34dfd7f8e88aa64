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
    s = TrainingSetup("tiny-llama", **{"precision": "bf16", "adapter_dtype": "base", "batch_size": 2, "seq_len": 512,
                                       "lora_rank": 8, "gpu": "H100-80GB", **kw})
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
    ({"lora_targets": "all-linear,lm_head", "method": "ds-zero2", "gpus": 2, "precision": "bf16-mixed"},
     "--method ds-zero2"),
    ({"lora_targets": "lm_head"}, "no adapter before it"),
    ({"lora_targets": "all-linear,lm_head", "objective": "dpo", "seq_len": 128}, "--objective dpo"),
    ({"lora_targets": "all-linear,lm_head", "fused_ce": True}, "--fused-ce"),
])
def test_what_is_not_modelled_is_refused_in_one_line(kw, words):
    kw = {"adapter_dtype": "base", **kw}
    with pytest.raises(LlmemError, match="LoRA on the output layer 'lm_head' with " + words.replace("(", r"\(")):
        resolve(TrainingSetup("tiny-llama", **{"precision": "bf16", "batch_size": 2, "seq_len": 64, "lora_rank": 8,
                                               **kw}))


def test_peft_fp32_adapters_compute_in_fp32_and_cast_back():
    """peft's default on a bf16 base: the input copied to fp32 (kept by lora_A, 1,024 x 512 x 4 = 2,097,152 B;
    the lm_head's own bf16 input no longer kept), lora_A's fp32 output (32,768 B), lora_B's output, its scaled copy
    and the sum in fp32 (131,072,000 B each), the sum cast back to bf16; in backward the logits' gradient cast up,
    a bf16 copy for the base branch and the fp32 scaled gradient."""
    made = [n for sign, n in _events(lora_targets="all-linear,lm_head", adapter_dtype="fp32") if sign > 0]
    base = [n for sign, n in _events(lora_targets="all-linear,lm_head") if sign > 0]
    assert made.count(2 * TV_BF16) - base.count(2 * TV_BF16) == 3 + 2     # forward 3, backward 2 (fp32 [t, vocab])
    assert made.count(1024 * 512 * 4) == base.count(1024 * 512 * 4) + 2    # the input's copy, lora_A's input gradient
    assert made.count(2 * A_OUT) - base.count(2 * A_OUT) == 2                # lora_A's output and its gradient, fp32
    # the bf16 adapters' two [t, r] bf16 (16,384 B) gone; lora_A's weight gradient [8, 512] is fp32 now: 16,384 B
    assert made.count(A_OUT) - base.count(A_OUT) == -2 + 1


def test_under_autocast_lora_a_keeps_autocasts_cast_of_peft_copy():
    """bf16-mixed: peft copies the bf16 input to fp32 (2,097,152 B, freed when the module returns), autocast casts
    that copy back to bf16 for lora_A, which keeps it (1,048,576 B), and the adapter runs in bf16: lora_B's output,
    its scaled copy and the sum are bf16 [t, vocab] (65,536,000 B each)."""
    made = [n for sign, n in _events(lora_targets="all-linear,lm_head", precision="bf16-mixed", adapter_dtype="fp32")
            if sign > 0]
    base = [n for sign, n in _events(lora_targets="all-linear", precision="bf16-mixed", adapter_dtype="fp32")
            if sign > 0]
    assert made.count(TV_BF16) - base.count(TV_BF16) == 3 + 1     # forward 3, backward the scaled gradient
    assert made.count(1024 * 512 * 4) - base.count(1024 * 512 * 4) == 2   # the fp32 copy; the cast-up gradient


def test_dropout_keeps_its_output_and_mask_for_lora_a():
    """--lora-dropout: lora_A reads the dropout's output (bf16 [t, hidden], 1,048,576 B) and the dropout keeps its
    bool mask (524,288 B) instead of lora_A reading the lm_head's input; its backward multiplies by the mask."""
    made = [n for sign, n in _events(lora_targets="all-linear,lm_head", lora_dropout=0.1) if sign > 0]
    base = [n for sign, n in _events(lora_targets="all-linear", lora_dropout=0.1) if sign > 0]
    assert made.count(1024 * 512) - base.count(1024 * 512) == 1
