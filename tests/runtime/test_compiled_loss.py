"""torchtune's compiled chunk loss: the trace's InductorChunkCrossEntropy allocates what inductor's generated code for
CEWithChunkedOutputLoss.compute_cross_entropy allocates. The loss is compiled here with inductor (its C++ backend:
no GPU) and each partitioned graph's `call` is read for its buffers and what it returns."""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmem.runtime.compiled_loss import InductorChunkCrossEntropy
from llmem.runtime.losses import CEWithChunkedOutputLoss

ROWS, VOCAB = 48, 320
_BUFFER = re.compile(r"(buf\d+) = empty_strided_cpu\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)")


def _calls(codes: list[str]) -> list[tuple[list[tuple[tuple[int, ...], str]], str]]:
    """Each generated graph's buffers ((shape, dtype) in order) and its return statement."""
    out = []
    for code in codes:
        body = code[code.index("def call(self, args):"):]
        body = body[:body.index("\n\n")]
        buffers = [(tuple(int(x) for x in shape.replace(" ", "").split(",") if x), dtype)
                   for _, shape, dtype in _BUFFER.findall(body)]
        out.append((buffers, re.search(r"return \((.*)\)", body).group(1)))
    return out


@pytest.fixture(scope="module")
def inductor_calls():
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    loss_fn = CEWithChunkedOutputLoss(num_output_chunks=1)
    compiled = torch.compile(loss_fn.compute_cross_entropy, backend="inductor", dynamic=False)
    logits = torch.randn(ROWS, VOCAB, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, VOCAB, (ROWS,))
    labels[:5] = loss_fn.ignore_index

    def step():
        compiled(logits, labels).backward()

    _, codes = run_and_get_code(step)
    torch._dynamo.reset()
    return _calls(codes)


class _Allocations(TorchDispatchMode):
    """The (shape, dtype) of every tensor a factory op makes."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[tuple[int, ...], str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.new_empty, torch.ops.aten.empty_like,
                                   torch.ops.aten.empty_strided, torch.ops.aten.new_empty_strided):
            self.made.append((tuple(out.shape), str(out.dtype).removeprefix("torch.")))
        return out


def test_inductor_fuses_the_chunk_loss_into_one_kernel_each_way(inductor_calls):
    """What the trace models, read from inductor's code: forward, [rows, 1] fp32 row maxima and log-sum-exp (the
    second in a reused buffer) and the loss scalar, the logits chunk saved as it is; backward, an [rows, 1] fp32
    temporary and the gradient in the logits' dtype. No [rows, vocab] fp32 tensor either way."""
    (fwd, fwd_returns), (bwd, bwd_returns) = inductor_calls
    assert fwd == [((ROWS, 1), "float32"), ((ROWS, 1), "float32"), ((), "float32")]
    assert fwd_returns.replace(" ", "").rstrip(",").split(",") == ["buf3", "primals_1", "primals_2", "buf0", "buf2"]
    assert bwd == [((ROWS, 1), "float32"), ((ROWS, VOCAB), "bfloat16")]
    assert bwd_returns.replace(" ", "") == "buf1,None,"


def test_the_traced_function_allocates_what_inductor_allocates(inductor_calls):
    (fwd, _), (bwd, _) = inductor_calls
    logits = torch.empty(ROWS, VOCAB, dtype=torch.bfloat16, device="meta", requires_grad=True)
    labels = torch.empty(ROWS, dtype=torch.long, device="meta")
    with _Allocations() as forward:
        loss = InductorChunkCrossEntropy.apply(logits, labels, -100)
    with _Allocations() as backward:
        loss.backward()
    assert forward.made == fwd and backward.made == bwd
    assert logits.grad.shape == logits.shape and logits.grad.dtype == torch.bfloat16
