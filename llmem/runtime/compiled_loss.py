"""torchtune's compiled chunk loss (`training.compile_loss`: CEWithChunkedOutputLoss.compute_cross_entropy under
torch.compile) as inductor's generated code allocates it, for the trace on fake tensors.

`cross_entropy(logits.float(), labels, reduction="sum")` is one fused reduction kernel forward and one fused pointwise
kernel backward once inductor has compiled it. Its generated code (torch 2.13, `call` of each partitioned graph):
- forward: the row maxima and the log-sum-exp, [n, 1] fp32 each (the second reusing a buffer), and the loss
  scalar; it returns the loss and saves the logits chunk itself, the labels, the maxima and the log-sum-exp. No
  [n, vocab] tensor: the upcast, the shifted logits, their exponentials and the log-softmax live in registers.
- backward: an [n, 1] fp32 temporary and the gradient, [n, vocab] in the logits' dtype (the upcast's backward
  fused in); the saved tensors are released once the kernel has run.
Run op by op (llmem.runtime.compile's partitioned graphs) the same graphs make two to three fp32 [n, vocab]
tensors at a time, about 1.2 GiB more at 1024 tokens x 128,256 (benchmarks/published_runs.md, TT-17).

On fake tensors no kernel runs, so `InductorChunkCrossEntropy` allocates what that code allocates, in its order;
tests/runtime/test_compiled_loss.py compiles the loss with inductor here and reads the buffers from its code.

Known Limitations: the code read is inductor's C++ backend's (this machine has no GPU and no Triton). CUDA's Triton
backend fuses the same way but may split a long row reduction across blocks, adding [n, splits] fp32 partial sums
(a few KiB at these shapes; not laid out).
"""

from __future__ import annotations

import torch


class InductorChunkCrossEntropy(torch.autograd.Function):
    """One chunk's `cross_entropy(logits.float(), labels, ignore_index=..., reduction="sum")`, with the tensors
    inductor's generated forward and backward allocate and save (the values are not computed: fake tensors only)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        rows = logits.shape[0]
        maxima = logits.new_empty((rows, 1), dtype=torch.float32)     # buf0: amax
        log_sum_exp = logits.new_empty((rows, 1), dtype=torch.float32)  # buf1, reinterpreted as buf2: log
        loss = logits.new_empty((), dtype=torch.float32)               # buf3
        ctx.save_for_backward(logits, labels, maxima, log_sum_exp)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, _labels, _maxima, _log_sum_exp = ctx.saved_tensors
        rows = logits.shape[0]
        temporary = logits.new_empty((rows, 1), dtype=torch.float32)  # buf0
        grad = torch.empty_like(logits)                                 # buf1: the logits' dtype
        del temporary
        return grad, None, None


def compiled_chunk_loss(loss_fn):
    """`loss_fn.compute_cross_entropy` as its compiled code allocates (a CEWithChunkedOutputLoss)."""
    def compute_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return InductorChunkCrossEntropy.apply(logits, labels, loss_fn.ignore_index)

    return compute_cross_entropy
