"""--output-chunks: torchtune's chunked output and CEWithChunkedOutputLoss. The chunk sizes against torch.chunk, the
loss's peaks worked out by hand, the backward order the schedule lays out against a real CPU backward, the option's
refusals. Estimate against trace: the CI rows (llmem.validate.matrices)."""

from __future__ import annotations

import subprocess
import sys
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmem.errors import LlmemError
from llmem.memory.activations.blocks import Dims
from llmem.memory.activations.loss import ChunkedOutput, chunked_output_for
from llmem.runtime.losses import CEWithChunkedOutputLoss, torchtune_shifted_labels
from llmem.setup.precision import Regime
from llmem.setup.training import TrainingSetup

V, H = 50, 16


def _dims(b: int, s: int) -> Dims:
    return Dims(b=b, s=s, h=H, i=4 * H, qd=H, kvd=H, heads=2, vocab=V, layers=1, tp=1)


@pytest.mark.parametrize("seq, chunks", [(10, 3), (256, 8), (7, 7), (9, 4), (5, 1)])
def test_chunk_sizes_are_torch_chunks(seq, chunks):
    setup = TrainingSetup(model="tiny-llama", precision="bf16", seq_len=seq, output_chunks=chunks)
    regime = Regime("lowp", res=2, mm=2)
    got = chunked_output_for(setup, _dims(1, seq), regime).seq_chunks
    assert got == tuple(c.shape[1] for c in torch.zeros(1, seq, 1).chunk(chunks, dim=1))


def test_peaks_by_hand():
    # batch 2, seq 10 in 3 chunks: torch.chunk gives 4, 4, 2 positions, so 8, 8, 4 tokens; vocab 50, bf16 logits
    c = ChunkedOutput(batch=2, seq_chunks=(4, 4, 2), hidden=H, vocab=V, mm=2)
    assert c.token_chunks == (8, 8, 4)
    # the last chunk's cross-entropy: 20 tokens of bf16 logits (2,000 B) and fp32 log-softmax (4,000 B), and the
    # last chunk's fp32 upcast (4 x 50 x 4 = 800 B)
    assert c.forward_peak_bytes == 2_000 + 4_000 + 800
    # backward: at the middle chunk's log_softmax backward, the last chunk's bf16 gradient (4 x 50 x 2 = 400 B),
    # the first two chunks' log-softmax (16 x 50 x 4 = 3,200 B) and that chunk's two fp32 gradients (3,200 B)
    assert c.backward_peak_bytes == 400 + 3_200 + 3_200
    # fp32 logits: .float() returns them, no upcast
    assert ChunkedOutput(batch=1, seq_chunks=(4,), hidden=H, vocab=V, mm=4).forward_peak_bytes == 4 * V * (4 + 4)


def test_compiled_peaks_by_hand():
    """The loss compiled (inductor's fused kernels): forward, only the 20 tokens' bf16 logits (2,000 B); backward,
    at a first-size chunk's kernel, every chunk's logits or gradient (2,000 B) and its own gradient (8 x 50 x 2 =
    800 B)."""
    c = ChunkedOutput(batch=2, seq_chunks=(4, 4, 2), hidden=H, vocab=V, mm=2, compiled=True)
    assert c.forward_peak_bytes == 2_000
    assert c.backward_peak_bytes == 2_000 + 800


class _Order(TorchDispatchMode):
    """The backward's order: each matmul, and each logits gradient (the cast back to bf16) made and freed."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default:
            name = f"grad{sum(1 for e in self.log if e.startswith('grad'))}"
            self.log.append(name)
            weakref.finalize(out.untyped_storage(), self.log.append, f"free {name}")
        elif func is torch.ops.aten.mm.default:
            self.log.append("mm weight" if out.shape[0] == V else "mm input")
        return out


def test_backward_order_of_a_real_cpu_step():
    """What chunked_head lays out: every chunk's loss backward (newest first) before any matmul, the weight's
    gradient before the input's, each chunk's logits gradient freed by its matmul's node."""
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False, dtype=torch.bfloat16)
    hidden = torch.randn(1, 8, H, dtype=torch.bfloat16, requires_grad=True)
    logits = [head(chunk) for chunk in hidden.chunk(4, dim=1)]
    loss = CEWithChunkedOutputLoss(4)(logits, torchtune_shifted_labels(torch.randint(0, V, (1, 8))))
    del logits
    order = _Order()
    with order:
        loss.backward()
    assert order.log == ["grad0", "grad1", "grad2", "grad3",
                         "mm weight", "mm input", "free grad0", "mm weight", "mm input", "free grad1",
                         "mm weight", "mm input", "free grad2", "mm weight", "mm input", "free grad3"]


def test_loss_is_torchtunes():
    """The same value as transformers' mean cross-entropy over the shifted labels (the recipe's ignore index)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 9, V)
    labels = torch.randint(0, V, (2, 9))
    chunked = CEWithChunkedOutputLoss(4)(list(logits.chunk(4, dim=1)), torchtune_shifted_labels(labels))
    plain = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
    assert torch.allclose(chunked, plain)


@pytest.mark.parametrize("flags, words", [
    (["--output-chunks", "8", "--fused-ce"], "--output-chunks with --fused-ce is not modelled"),
    (["--output-chunks", "8", "--precision", "bf16-mixed"], "use --precision bf16 or fp32"),
    (["--output-chunks", "-1"], "--output-chunks must be between 0 (off) and --seq-len"),
    (["--output-chunks", "8", "--method", "ds-zero2", "--gpus", "2"], "use --method fsdp"),
])
def test_refused_in_one_line(flags, words):
    run = subprocess.run([sys.executable, "-m", "llmem.cli", "estimate", "tiny-llama", "--precision", "bf16",
                          "--seq-len", "64", *flags], capture_output=True, text=True,
                         env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    assert run.returncode == 2
    assert words in run.stderr and "Traceback" not in run.stderr


def test_more_chunks_than_tokens_refused():
    with pytest.raises(LlmemError, match="between 0"):
        TrainingSetup(model="tiny-llama", seq_len=4, output_chunks=8)


def test_compiled_loss_partition_saves_what_is_laid_out():
    """torchtune's compile_loss (--compile --output-chunks) through the installed torch's inductor decompositions and
    min-cut partitioner, on fake tensors: the forward saves the chunk's bf16 logits, its labels and two [chunk, 1]
    fp32 tensors (row maxima, log-sum-exp), what chunked_head's compiled_forward keeps. Run op by op its graphs would
    make four [chunk, vocab] fp32 tensors forward and a bool and eight fp32 ones backward; inductor's fused kernels
    make none of them (tests/runtime/test_compiled_loss.py reads its code), as compiled_backward lays it out."""
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llmem.runtime.compile import _graphs_op_by_op

    graphs = []

    def inner(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return _graphs_op_by_op(gm, example_inputs, **kwargs)

    torch._dynamo.reset()
    loss_fn = CEWithChunkedOutputLoss(2)
    loss_fn.compute_cross_entropy = torch.compile(loss_fn.compute_cross_entropy,
                                                  backend=lambda gm, ex: compile_fx(gm, ex, inner_compile=inner))
    n, vocab = 16, 1000
    with FakeTensorMode():
        logits = [torch.randn(1, n, vocab, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
        loss_fn(logits, torch.randint(0, vocab, (1, 2 * n))).backward()
    torch._dynamo.reset()
    forward, backward = graphs[0], graphs[1]

    def made(gm, dtype):
        return sum(1 for node in gm.graph.nodes if node.op == "call_function" and isinstance(
            node.meta.get("val"), torch.Tensor) and tuple(node.meta["val"].shape) == (n, vocab)
                   and node.meta["val"].dtype == dtype and node.target is not torch.ops.aten.expand.default)

    outputs = next(node for node in forward.graph.nodes if node.op == "output").args[0]
    saved = [(tuple(o.meta["val"].shape), o.meta["val"].dtype) for o in outputs[1:]]
    assert saved == [((n, vocab), torch.bfloat16), ((n,), torch.int64), ((n, 1), torch.float32),
                     ((n, 1), torch.float32)]
    assert made(forward, torch.float32) == 4
    assert (made(backward, torch.float32), made(backward, torch.bool), made(backward, torch.bfloat16)) == (8, 1, 1)
