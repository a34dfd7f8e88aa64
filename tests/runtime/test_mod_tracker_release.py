"""The trace's module tracker lets go of its grad hooks once the backward is over (llmem.runtime.ledger
`_eager_mod_tracker`): torch's ModTracker registers register_multi_grad_hook on each module's inputs, whose "all"
mode keeps the inputs' autograd nodes alive through a cycle Python's collector cannot see. Under an adapter with
checkpointing the embedding's output (a leaf by enable_input_require_grads) and its .grad were kept, one more each
iteration: tiny-llama LoRA r8 ckpt 2 x 256 peaked at 327,633,920 / 328,682,496 B after 2 / 3 iterations."""

from __future__ import annotations

from llmem.runtime.trace import trace
from llmem.setup.training import TrainingSetup


def test_an_adapter_step_under_checkpointing_holds_nothing_more_each_iteration():
    s = TrainingSetup(model="tiny-llama", gpu="H100-80GB", precision="bf16-mixed", lora_rank=8, grad_ckpt=True,
                      batch_size=2, seq_len=256)
    second, third = trace(s, iterations=2), trace(s, iterations=3)
    # the steady state: the third iteration's step holds what the second's held (the leak added 1 MiB a step,
    # 2 x 256 tokens x 512 hidden x 4 B: the fp32 embedding output of each earlier step)
    assert third.peak_allocated_bytes == second.peak_allocated_bytes
    assert third.peak_reserved_bytes == second.peak_reserved_bytes


def test_a_no_grad_forward_leaves_nothing_behind_in_the_tracker():
    """TRL's reference and KL forwards run under no_grad, where enable_input_require_grads still makes the
    embedding's output a leaf that requires grad; the tracker registered its grad hook on it as the next module's
    input, which kept it alive until the backward's release. Without the tracker it dies with the forward: here on
    real CPU tensors under the ledger, nothing the forward made is live once its output is dropped."""
    import gc

    import torch

    from llmem.runtime.ledger import Ledger, tracking

    emb, lin = torch.nn.Embedding(10, 128).requires_grad_(False), torch.nn.Linear(128, 128).requires_grad_(False)
    emb.register_forward_hook(lambda mod, inp, out: out.requires_grad_(True))   # enable_input_require_grads'
    model = torch.nn.Sequential(emb, lin)
    ledger = Ledger()
    with tracking(ledger, None, real=True):
        born = ledger.next_key
        with torch.no_grad():
            out = model(torch.tensor([1, 2, 3, 4]))
        outputs = [key for is_alloc, key, size, *_ in ledger.events if is_alloc and key >= born and size == 4 * 128 * 4]
        assert len(outputs) == 2           # the embedding's output and the linear's, [4, 128] fp32 each
        del out
        gc.collect()
        assert not set(outputs) & set(ledger.live)
