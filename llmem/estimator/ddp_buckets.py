"""DistributedDataParallel's gradient buckets as torch lays them out: which trained parameters share a bucket, and
the order the reducer allocates the buckets in.

torch/nn/parallel/distributed.py `_ddp_init_helper` takes its initial size limits from
`BucketCapacityConfig.compute_bucket_size_limits`: `[sys.maxsize]` (every parameter of a dtype in one bucket) unless
find_unused_parameters is set and static_graph is not, then `[first_bucket_bytes_cap (1 MiB), bucket_cap_mb
(25 MiB)]`. `dist._compute_bucket_assignment_by_size` (torch/csrc/distributed/c10d/reducer.cpp
`compute_bucket_assignment_by_size`) walks the parameters in their order, groups them by (dtype, device), closes a
group's bucket once its bytes reach the group's current limit (each group steps through the limits on its own) and
sorts the buckets by their smallest parameter index; the Reducer takes them reversed (`list(reversed(
bucket_indices))`) and its `initialize_buckets` allocates each bucket's flat gradient tensor in that order.

The Reducer rebuilds its buckets in the gradients' ready order after the first backward (`_rebuild_buckets`, which
frees the first layout's buckets before it allocates the new ones of the same total bytes); the trace keeps the first
layout (llmem.runtime.distributed `_ReducerProxy`), and so does the estimate.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence

# DDP(model) with its defaults (find_unused_parameters=False, static_graph=False), as the trace and torchrun's export
# build it: one bucket per dtype at first
INITIAL_LIMITS_BYTES: tuple[int, ...] = (sys.maxsize,)


def bucket_assignment(sizes_bytes: Sequence[int], dtypes: Sequence[Hashable],
                      limits_bytes: Sequence[int]) -> list[list[int]]:
    """The parameters' indices per bucket, as `compute_bucket_assignment_by_size` returns them without tensor
    indices: grouped by dtype, a group's bucket closed at its current limit, buckets sorted by smallest index."""
    open_buckets: dict[Hashable, tuple[list[int], int]] = {}
    limit_at: dict[Hashable, int] = {}
    closed: list[list[int]] = []
    for index, (size, dtype) in enumerate(zip(sizes_bytes, dtypes, strict=True)):
        indices, filled = open_buckets.get(dtype, ([], 0))
        indices.append(index)
        filled += size
        at = limit_at.setdefault(dtype, 0)
        if filled >= limits_bytes[at]:
            closed.append(indices)
            open_buckets[dtype] = ([], 0)
            limit_at[dtype] = min(at + 1, len(limits_bytes) - 1)
        else:
            open_buckets[dtype] = (indices, filled)
    closed += [indices for indices, _ in open_buckets.values() if indices]
    return sorted(closed, key=min)


def reducer_bucket_bytes(sizes_bytes: Sequence[int], dtypes: Sequence[Hashable],
                         limits_bytes: Sequence[int] = INITIAL_LIMITS_BYTES) -> list[int]:
    """Each bucket's bytes, in the order the Reducer allocates them (the assignment reversed)."""
    buckets = bucket_assignment(sizes_bytes, dtypes, limits_bytes)
    return [sum(sizes_bytes[i] for i in bucket) for bucket in reversed(buckets)]
