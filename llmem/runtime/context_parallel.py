"""Context parallelism on the runtime floor: torch's ring attention applied to SDPA in the traced step.

Context parallelism in the real step: torch's ring attention on the cp dimension of the mesh, applied as
torchtitan 0.3.0 applies it to SDPA (torchtitan/distributed/context_parallel/api.py apply_cp_to_forward:
`_enable_context_parallel_dispatcher()`, then q, k, v wrapped as DTensors sharded on the sequence dimension, so
the SDPA kernel's aten op - flash, efficient or cuDNN - dispatches to torch's `_templated_ring_attention`
(torch/distributed/tensor/experimental/_context_parallel/_attention.py) and its backward).

On the fake process group the ring runs for real on fake tensors: the all-gather of K/V (the default
_RotateMethod.ALL_GATHER, one `all_gather_single` per call), the fp32 out / logsumexp merge (_SDPAMerger), the
backward's fp32 dq / dk / dv accumulators and the all-to-all rotation of the K/V gradients are all allocated by
torch's own code; nothing is emulated. One fake-mode artifact is removed: the functional collectives' wait_tensor,
which returns its input on CUDA, gets a new storage under the fake mode (`collectives_waited_in_place`, llmem.runtime.patches). The rank's tokens are its seq_len / cp (the head-tail load balancer's two
chunks, which the data loader selects before the step: the trace feeds rank 0's local ids directly).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn.functional as F

from llmem.errors import LlmemError
from llmem.runtime.patches import collectives_waited_in_place


@contextlib.contextmanager
def ring_attention(cp_mesh, fake: bool) -> Iterator[None]:
    """F.scaled_dot_product_attention through torch's ring attention over `cp_mesh` (head-tail load balancing on,
    K/V rotated by all-gather: torch's defaults under torchtitan); restored on exit."""
    if not fake:
        raise LlmemError("--cp is traced on fake tensors only (llmem trace / estimate): measure does not run "
                         "the ring attention")
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental import _attention as cp_attention

    options = cp_attention._cp_options
    saved_sdpa, saved_balance, saved_rotate = F.scaled_dot_product_attention, options.enable_load_balance, \
        options.rotate_method
    seq_shard = [Shard(2)]      # SDPA's [batch, heads, seq, head_dim]

    def sdpa(query, key, value, *args, **kwargs):
        q, k, v = (DTensor.from_local(t, cp_mesh, seq_shard, run_check=False) for t in (query, key, value))
        out = saved_sdpa(q, k, v, *args, **kwargs)
        return out.to_local() if isinstance(out, DTensor) else out

    options.enable_load_balance = True       # torchtitan's default load balancer "headtail"
    options.rotate_method = cp_attention._RotateMethod.ALL_GATHER
    cp_attention._enable_context_parallel_dispatcher()
    F.scaled_dot_product_attention = sdpa
    try:
        with collectives_waited_in_place():
            yield
    finally:
        F.scaled_dot_product_attention = saved_sdpa
        cp_attention._disable_context_parallel_dispatcher()
        options.enable_load_balance, options.rotate_method = saved_balance, saved_rotate
