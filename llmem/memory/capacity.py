"""Out of memory as PyTorch decides it: a step fits when its allocations complete on a device of the GPU's size.

The caching allocator does not fail because of its cache. When cudaMalloc cannot place a new segment,
`CUDACachingAllocator.cpp` `malloc` frees the cached blocks it holds (`release_available_cached_blocks`, then
`release_cached_blocks`, the same as `torch.cuda.empty_cache()`) and retries (`alloc_block(params, isRetry=true)`);
only a retry that still fails raises "CUDA out of memory". So a step whose uncapped reserved peak exceeds the
device can still run, with a capped reserved peak: deciding `fits` on the uncapped peak flips back and forth as
fragmentation does between neighbouring batch sizes and sequence lengths, while the replay at capacity does not.

The capacity the allocator may fill is the device's memory (or the planner's limit) less what lies outside it
(the CUDA context, NCCL's buffers: `llmem.setup.gpus.outside_allocator_bytes`). CUDA managed memory (paged
optimizer states) is not subtracted: the driver evicts its pages to the host when the device is full.

Three cases, cheapest first (one engine's replay function is passed in):
1. the uncapped reserved peak is within the capacity: no cudaMalloc fails, the capped replay is the same;
2. the allocated peak exceeds it: no release of cache helps, out of memory where allocated first crosses it;
3. in between: replay at the capacity and see whether the retries carry it through.

Known limitations: in case 3 the answer depends on how fragmented the pool is, which the batch size and sequence
length change in ways that are not monotone (Llama-3.1-8B, one GPU, 256 tokens, 156.1 GiB of capacity: batch 1
runs out at the optimizer step while batches 2 and 4 fit, with the same tensors live at that peak). Such an answer
is marked (`MemoryResult.by_fragmentation` and a "marginal" note); answers of cases 1 and 2 are monotone. Nor is
`fits` monotone in the capacity itself: when the
cache is released changes the segments' layout, so a little more memory can leave a worse-fragmented pool at the
step's peak (tiny-llama zero2 x4 at 1024 tokens fits with 1440 MiB, runs out at 1460 MiB, fits again at 1480) - the
real allocator is deterministic in the same way. Deep models (llmem.estimator.engine.EXTRAPOLATE_FROM) are decided
on their extrapolated peaks in cases 1 and 2 and replayed at full depth in case 3. The capacity is only as good as
the GPU's memory figure (llmem.setup.gpus names each one's source) and the CUDA-context assumption.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from llmem.result import OutOfMemory
from llmem.units import format_bytes


class Fit(Enum):
    """A step's verdict on a device of some capacity, as the allocator decides it (the cases above)."""
    FITS = "fits"                      # its allocations complete (cases 1 and 3)
    OUT_OF_MEMORY = "out_of_memory"    # an allocation fails even after the cache is released (case 3)
    OVER_CAPACITY = "over_capacity"    # its live tensors alone exceed the capacity (case 2: a larger batch too)


@dataclass(frozen=True)
class AtCapacity:
    """The step on a device of `capacity_bytes`: its reserved peak there, or where it runs out of memory."""
    capacity_bytes: int
    reserved_bytes: int | None       # max_memory_reserved at that capacity (None when it runs out)
    oom: OutOfMemory | None
    by_fragmentation: bool = False   # case 3: decided by how the cached segments lie (a marginal answer)

    @property
    def completes(self) -> bool:
        return self.oom is None


def at_capacity(peak_allocated_bytes: int, peak_reserved_bytes: int, capacity_bytes: int,
                replay_capped: Callable[[int], tuple[int, OutOfMemory | None]],
                first_over: Callable[[int], OutOfMemory]) -> AtCapacity:
    """Decide the step at `capacity_bytes` from its uncapped peaks, replaying at the capacity only when the
    uncapped peaks do not decide it. `replay_capped(capacity)` -> (reserved peak, OOM or None);
    `first_over(capacity)` -> where allocated memory first exceeds the capacity."""
    if capacity_bytes <= 0:
        return AtCapacity(capacity_bytes, None, OutOfMemory("setup", "", "cuda_context", 0, 0, 0, capacity_bytes))
    if peak_reserved_bytes <= capacity_bytes:
        return AtCapacity(capacity_bytes, peak_reserved_bytes, None)
    if peak_allocated_bytes > capacity_bytes:
        return AtCapacity(capacity_bytes, None, first_over(capacity_bytes))
    reserved, oom = replay_capped(capacity_bytes)
    return AtCapacity(capacity_bytes, None if oom else reserved, oom, by_fragmentation=True)


def resident_managed_bytes(managed_bytes: int, room_bytes: int) -> int:
    """Managed (paged) memory resident on the device: the driver migrates its pages in on use and evicts them when
    the device is full, so at most the room the allocator's segments and the context leave."""
    return max(0, min(managed_bytes, room_bytes))


def capacity_notes(cap: AtCapacity, uncapped_reserved_bytes: int, managed_bytes: int, paged_bytes: int) -> list[str]:
    """What the result says about the capacity: the cache released to go on, paged states evicted."""
    notes = []     # an OOM is the result's own field (MemoryResult.oom), not a note
    if cap.by_fragmentation:
        outcome = "it runs out" if cap.oom else "it fits"
        notes.append(f"marginal: the live tensors fit in the {format_bytes(cap.capacity_bytes)} the allocator may "
                     f"use but the cached segments do not, so {outcome} by how fragmented the pool is once the "
                     "cache is released; neighbouring batch sizes and sequence lengths can answer differently "
                     "(--expandable-segments, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, fragments less)")
    if cap.completes and cap.reserved_bytes is not None and cap.reserved_bytes < uncapped_reserved_bytes:
        notes.append(f"the allocator reaches the device's capacity and releases its cached blocks to go on (as "
                     f"PyTorch does before it raises OOM): reserved peak {format_bytes(cap.reserved_bytes)} on the "
                     f"device, {format_bytes(uncapped_reserved_bytes)} where memory is unlimited")
    if cap.completes and managed_bytes < paged_bytes:
        notes.append(f"paged optimizer states: {format_bytes(paged_bytes - managed_bytes)} of "
                     f"{format_bytes(paged_bytes)} evicted to host memory (CUDA managed memory), not counted against "
                     f"fitting")
    return notes
