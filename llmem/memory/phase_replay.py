"""The replay loop: a step schedule's allocation events through the caching-allocator model, read per phase.

Two answers a schedule's replay needs (llmem.estimator.events.replay puts them together):
- `phase_peaks`: per run of a phase, its peak of `memory_allocated` (from the bytes live when it starts), the
  event where the peak is reached and `memory_reserved` at its end; where a cudaMalloc fails at the capacity, the
  failing event; and the allocator's statistics at the end.
- `components_at`: the tensor bytes per component (weights, activations, ...) once the step has run up to given
  events (each phase's peak).

Each runs compiled (`llmem/memory/native_replay.c`, a line-for-line twin of `CachingAllocator` and of the loops
below, built by `pip install` where a C compiler is found) or, without it, as the Python below, the reference:
tests/memory/test_native_replay.py replays random schedules through both. The compiled loop runs a replay about
ten times faster (benchmarks/native_replay.md); it hands anything it does not handle the Python's way back to the
Python (returns None), so both give the same answers and errors. `LLMEM_NATIVE_REPLAY=off` uses the Python only.

An event is `(sign, key, size_bytes, stream, component)`: sign > 0 allocates `size_bytes` under the caller's `key`,
otherwise frees the block of `key`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import islice

from llmem.memory.allocator import AllocatorOOM, AllocatorStats, CachingAllocator

try:
    from llmem.memory import native_replay as NATIVE
except ImportError:          # no C compiler at install time: the Python reference serves
    NATIVE = None            # type: ignore[assignment]

Event = tuple[int, int, int, int, str]


@dataclass(frozen=True)
class PhaseRun:
    """One run of one phase: its peak of allocated bytes, the event index of that peak (the index before the run's
    first event when nothing in it raised the bytes live at its start) and the reserved bytes at its end."""
    peak_allocated_bytes: int
    reserved_bytes: int
    peak_at: int


@dataclass(frozen=True)
class Failure:
    """The allocation a capped replay could not make (AllocatorOOM's fields) and its event index."""
    at: int
    requested_bytes: int
    allocated_bytes: int
    reserved_bytes: int


@dataclass(frozen=True)
class PhasePeaks:
    runs: list[PhaseRun]            # one per phase run, in order; the last is the failing one's after a Failure
    failure: Failure | None
    stats: AllocatorStats           # at the end (after the failure, if any)


def native_available() -> bool:
    """Whether the compiled loop is installed and not turned off (`LLMEM_NATIVE_REPLAY=off`)."""
    return NATIVE is not None and os.environ.get("LLMEM_NATIVE_REPLAY", "").lower() not in ("off", "0", "no")


def phase_peaks(events: list[Event], starts: list[int], expandable_segments: bool = False,
                capacity_bytes: int | None = None) -> PhasePeaks:
    """Replay `events` through a fresh CachingAllocator, phase run by phase run (`starts`: each run's first event
    index, then len(events)); with `capacity_bytes` stop at the first allocation that fails there."""
    if native_available():
        got = NATIVE.phase_peaks(events, starts, expandable_segments, capacity_bytes)
        if got is not None:
            runs, failure, stats = got
            return PhasePeaks([PhaseRun(*run) for run in runs], Failure(*failure) if failure else None,
                              AllocatorStats(*stats))
    return _phase_peaks_py(events, starts, expandable_segments, capacity_bytes)


def components_at(events: list[Event], at: list[int]) -> list[dict[str, int]]:
    """For each event index of `at` (ascending, >= 0): the tensor bytes per component once the events up to it
    have run (components in the order they first appear, those at zero left out)."""
    if native_available():
        got = NATIVE.components_at(events, at)
        if got is not None:
            return got
    return _components_at_py(events, at)


def _phase_peaks_py(events: list[Event], starts: list[int], expandable_segments: bool,
                    capacity_bytes: int | None) -> PhasePeaks:
    alloc = CachingAllocator(expandable_segments=expandable_segments, capacity_bytes=capacity_bytes)
    handles: dict[int, int] = {}
    malloc, free, pop = alloc.malloc, alloc.free, handles.pop   # bound once: the loop runs ~10^6 times a plan
    runs: list[PhaseRun] = []
    failure = None
    for start, end in zip(starts, starts[1:], strict=False):
        # a run that allocates nothing peaks at what it started with (event start - 1's state)
        best, best_at = alloc.allocated_bytes, start - 1
        i = start
        try:
            for i, (sign, key, size, stream, _c) in enumerate(islice(events, start, end), start):
                if sign > 0:
                    handles[key] = malloc(size, stream)
                    if alloc.allocated_bytes > best:
                        best, best_at = alloc.allocated_bytes, i
                else:
                    free(pop(key))
        except AllocatorOOM as exc:
            failure = Failure(i, exc.requested_bytes, exc.allocated_bytes, exc.reserved_bytes)
        runs.append(PhaseRun(best, alloc.reserved_bytes, best_at))
        if failure is not None:
            break
    return PhasePeaks(runs, failure, alloc.stats())


def _components_at_py(events: list[Event], at: list[int]) -> list[dict[str, int]]:
    by_comp: dict[str, int] = {}
    get = by_comp.get
    done = 0                               # events [0, done) are summed into by_comp
    out = []
    for index in at:
        for sign, _k, size, _s, comp in islice(events, done, index + 1):
            by_comp[comp] = get(comp, 0) + sign * size
        done = index + 1
        out.append({c: v for c, v in by_comp.items() if v})
    return out
