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


class _TwoDtypes(torch.nn.Module):
    """A frozen embedding, fp32 linears and one bf16 linear among them (a second bucket dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 300).requires_grad_(False)
        self.up, self.down, self.out = torch.nn.Linear(300, 3000), torch.nn.Linear(3000, 300), torch.nn.Linear(300, 1000)
        self.down.to(torch.bfloat16)

    def forward(self, x):
        return self.out(self.down(torch.relu(self.up(self.embed(x))).bfloat16()).float())


def test_the_buckets_are_the_real_reducers(tmp_path):
    """DDP(model) on a one-rank gloo group: the Reducer's buckets as it allocates them (fp32 up and out, 4,816,000 B;
    bf16 down, 1,800,600 B; the frozen embedding in none), and the rebuilt ones after the first backward (1 MiB first
    bucket, in the gradients' ready order), which the estimate, like the trace, does not lay out."""
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = _TwoDtypes()
        ddp = DistributedDataParallel(model)

        def buckets() -> list[int]:
            return [b.buffer().numel() * b.buffer().element_size() for b in ddp.reducer._get_zeros_like_grad_buckets()]

        trained = [p for p in model.parameters() if p.requires_grad]
        ours = reducer_bucket_bytes([p.numel() * p.element_size() for p in trained], [p.dtype for p in trained])
        assert buckets() == ours == [2 * (300 * 3000 + 300), 4 * (3000 * 300 + 3000 + 1000 * 300 + 1000)]
        for _ in range(2):      # the rebuild runs in the second forward
            ddp(torch.randint(0, 1000, (4, 8))).sum().backward()
        assert sorted(buckets()) != sorted(ours) and sum(buckets()) == sum(ours)
    finally:
        dist.destroy_process_group()
