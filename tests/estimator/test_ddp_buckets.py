"""DDP's bucket assignment (llmem.estimator.ddp_buckets) against torch's own `dist._compute_bucket_assignment_by_size`
(torch/csrc/distributed/c10d/reducer.cpp) on real tensors: the same buckets for mixed dtypes, for DDP's initial
limits with and without find_unused_parameters, and for limits that close a bucket on its last parameter."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from llmem.estimator.ddp_buckets import INITIAL_LIMITS_BYTES, bucket_assignment, reducer_bucket_bytes

MIB = 1024**2
# (elements, dtype): fp32 masters beside bf16 ones, sizes around 1 MiB and 25 MiB
PARAMS = [(300_000, torch.float32), (10, torch.bfloat16), (200_000, torch.float32), (5_000_000, torch.float32),
          (700_000, torch.bfloat16), (100, torch.float32), (262_144, torch.float32), (6_553_600, torch.float32),
          (524_288, torch.bfloat16), (1, torch.float32)]


def _torch_buckets(limits: list[int]) -> list[list[int]]:
    tensors = [torch.empty(n, dtype=dtype) for n, dtype in PARAMS]
    indices, _limits = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors))
    return [list(b) for b in indices]


@pytest.mark.parametrize("limits", [[sys.maxsize], [MIB, 25 * MIB], [MIB, 4 * MIB], [1_048_576 + 80_000]])
def test_the_assignment_is_torchs(limits):
    sizes = [n * torch.empty(0, dtype=dtype).element_size() for n, dtype in PARAMS]
    dtypes = [dtype for _n, dtype in PARAMS]
    assert bucket_assignment(sizes, dtypes, limits) == _torch_buckets(limits)


def test_ddp_defaults_give_one_bucket_per_dtype_allocated_last_first():
    """DDP(model): one bucket per dtype; the Reducer allocates the buckets reversed (the bf16 one, whose smallest
    index is 1, before the fp32 one from index 0)."""
    sizes = [n * torch.empty(0, dtype=dtype).element_size() for n, dtype in PARAMS]
    dtypes = [dtype for _n, dtype in PARAMS]
    assert INITIAL_LIMITS_BYTES == (sys.maxsize,)
    bf16 = 2 * (10 + 700_000 + 524_288)
    fp32 = 4 * (300_000 + 200_000 + 5_000_000 + 100 + 262_144 + 6_553_600 + 1)
    assert reducer_bucket_bytes(sizes, dtypes) == [bf16, fp32]
