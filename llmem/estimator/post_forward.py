"""FSDP2's reshard_after_forward as an int (--reshard-after-forward N): after its forward each decoder layer keeps
the rank's 1/N of its all-gather outputs, and backward all-gathers the layer from those over N ranks.

torch's FSDPParam.to_sharded_post_forward (torch/distributed/fsdp/_fully_shard/_fsdp_param.py): per parameter, the
rank's chunk of its all-gather output (padded to the shard world, in MixedPrecisionPolicy's param_dtype) is cloned
on the default stream, then the unsharded parameter freed. In backward FSDPParam.all_gather_inputs hands that clone
to the all-gather as it is (already param_dtype: no cast on the copy-in), the output is the whole unit as always,
and FSDPParam.to_unsharded frees the clone after the copy-out. The root keeps fully_shard's default (gathered).
The events themselves are FsdpUnits' (llmem.estimator.schedule.units); here, their sizes.
"""

from __future__ import annotations

from llmem.estimator.states import fsdp_gathered_tensors
from llmem.model.resolved import ResolvedSetup


def post_forward_ranks(r: ResolvedSetup) -> int | None:
    """N of reshard_after_forward=N, or None (the method's bool; llmem.setup.support checks N)."""
    return r.setup.reshard_after_forward if r.layout.shards_model_states else None


def post_forward_param_bytes(gathered_bytes: int, ranks: int) -> int:
    """One parameter's post-forward shard: its all-gather output's bytes over N (torch asserts they divide)."""
    return gathered_bytes // ranks


def post_forward_layer_bytes(r: ResolvedSetup) -> int:
    """One decoder layer's post-forward shards (layer 0's; the layers are alike), 0 without an int."""
    ranks = post_forward_ranks(r)
    if ranks is None:
        return 0
    return sum(post_forward_param_bytes(sum(fsdp_gathered_tensors(p, r.setup, r.layout)), ranks)
               for p in r.anatomy.params if p.layer_index == 0)
