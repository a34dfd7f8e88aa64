"""Allocation events and their replay: a schedule is the ordered allocations and frees of one step (with each
tensor's component and stream), grouped in phases; the replay runs it through the caching-allocator model and reads
`max_memory_allocated` (whole blocks) and `max_memory_reserved` (segments) per phase; deep models are replayed at two
depths and extrapolated, since identical layers add the same bytes to every phase."""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field

from llmem.memory.phase_replay import components_at, phase_peaks
from llmem.result import OutOfMemory

DEFAULT, ALL_GATHER, REDUCE_SCATTER = 0, 1, 2   # FSDP2 issues its collectives on streams of their own


class LiveBytesOver(Exception):
    """A schedule's live tensor bytes passed its stop_above_bytes: the rest of the step was not built."""

    def __init__(self, live_bytes: int) -> None:
        super().__init__(f"{live_bytes} bytes of live tensors")
        self.live_bytes = live_bytes


class EventLog:
    """The allocations and frees a schedule's builder makes, in order, and its live tensor bytes: the Python
    reference of the compiled twin in `native_events.c`, which Schedule builds on where it was built (a builder
    calls alloc and free once per tensor: ~2.7 million times in a 70B plan; tests/estimator/test_native_events.py
    holds the two to the same events, keys, bytes and errors). `LLMEM_NATIVE_EVENTS=off` uses this one."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int, int, int, str]] = []    # (±1, key, size, stream, component)
        self.min_bytes = 1                 # smaller tensors are left out (see StepSchedule)
        # built only to learn whether the live tensors pass this many bytes: alloc raises LiveBytesOver once they do
        self.stop_above_bytes: int | None = None
        self.live_bytes = 0                # the live tensors' bytes after the last event
        self.peak_live_bytes = 0           # their largest sum so far (tensor_peak_bytes)
        self._live: dict[int, tuple[int, int, int, int, str]] = {}   # key -> its alloc event
        self._next = 0

    def alloc(self, size: int, component: str, stream: int = DEFAULT) -> int:
        key = self._next
        self._next = key + 1
        if size < self.min_bytes:
            return -1
        event = (1, key, size, stream, component)
        self.events.append(event)
        self._live[key] = event
        live = self.live_bytes = self.live_bytes + size
        if live > self.peak_live_bytes:
            self.peak_live_bytes = live
            if self.stop_above_bytes is not None and live > self.stop_above_bytes:
                raise LiveBytesOver(live)
        return key

    def alloc_many(self, sizes, component: str) -> list[int]:
        """Each size allocated in order (on the default stream); their keys."""
        return [self.alloc(n, component) for n in sizes]

    def play_block(self, plan, component: str) -> list[int]:
        """A block plan's operations in order (llmem.estimator.schedule.blocks.block_plan): (0, size, _) a kept
        tensor, (1, size, tag) a temporary, (2, _, tag) that temporary freed. Returns the kept tensors' keys."""
        keys: list[int] = []
        temps: dict[int, int] = {}
        for op, n, tag in plan:
            if op == 0:
                keys.append(self.alloc(n, component))
            elif op == 1:
                temps[tag] = self.alloc(n, component)
            else:
                self.free(temps.pop(tag))
        return keys

    def size_of(self, key: int) -> int:
        """Bytes of a live tensor (0 for -1: one below min_bytes, never laid out)."""
        return self._live[key][2] if key >= 0 else 0

    def free(self, key: int) -> None:
        if key >= 0:
            _, _, size, _, component = self._live.pop(key)
            self.events.append((-1, key, size, DEFAULT, component))
            self.live_bytes -= size

    def free_all(self, keys: list[int]) -> None:
        for k in keys:
            self.free(k)
        keys.clear()


try:
    from llmem.estimator import native_events as _NATIVE
except ImportError:          # no C compiler at install time: the Python reference serves
    _NATIVE = None           # type: ignore[assignment]
# the compiled event log and its helpers in use (None: not built, or LLMEM_NATIVE_EVENTS=off; the Python references
# serve: EventLog here, llmem.estimator.deepen's twins)
NATIVE_EVENTS = _NATIVE if _NATIVE is not None and os.environ.get("LLMEM_NATIVE_EVENTS", "").lower() not in (
    "off", "0", "no") else None
if NATIVE_EVENTS is not None:
    NATIVE_EVENTS.set_live_bytes_over(LiveBytesOver)
    _LogBase: type = NATIVE_EVENTS.EventLog
else:
    _LogBase = EventLog


class Schedule(_LogBase):       # type: ignore[misc, valid-type]
    """Allocation events, grouped in phases, with the component each tensor belongs to."""

    def __init__(self, min_bytes: int = 1) -> None:
        super().__init__()
        self.min_bytes = min_bytes
        self.phase_starts: list[tuple[int, str]] = []       # (first event index, phase)
        self.marks: list[tuple[int, str]] = []   # (first event index, where: "layer 3", "loss")
        # (first event index, decoder layer or None): whose events the next ones are (llmem.estimator.deepen)
        self.owners: list[tuple[int, int | None]] = []
        self.owner: int | None = None        # the latest owner

    @property
    def phase(self) -> str:
        return self.phase_starts[-1][1] if self.phase_starts else ""

    @phase.setter
    def phase(self, name: str) -> None:
        self.phase_starts.append((len(self.events), name))
        self.own(None)

    def mark(self, where: str) -> None:
        """Name the part of the step the next events belong to (a layer, the loss): where an OOM is reported."""
        self.marks.append((len(self.events), where))

    def enter_layer(self, i: int, label: str = "layer") -> None:
        """Decoder layer `i`'s part of a pass over the layers begins: marked "<label> <i>" and owned by it."""
        self.mark(f"{label} {i}")
        self.own(i)

    def own(self, layer: int | None) -> None:
        """The next events are decoder layer `layer`'s (None: the step's own). A free made outside a layer's part
        is its tensor's layer's (llmem.estimator.deepen reads it so)."""
        if self.owner != layer:
            self.owners.append((len(self.events), layer))
            self.owner = layer

    def where(self, index: int) -> str:
        """The mark in force at event `index` ("" before the first)."""
        at = bisect.bisect_right(self.marks, (index, "\uffff")) - 1
        return self.marks[at][1] if at >= 0 else ""


@dataclass(frozen=True)
class PhasePeak:
    """One phase of one iteration: its own peak of allocated bytes and the reserved bytes by its end."""
    allocated: int
    reserved: int
    components: dict[str, int]


@dataclass(frozen=True)
class Replay:
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    components: dict[str, int]        # tensor bytes per component at the moment of peak allocated
    peak_phase: str
    phases: dict[str, PhasePeak] = field(default_factory=dict)   # "it<i>:<phase>" -> its peak
    oom: OutOfMemory | None = None    # a replay at a capacity that failed (its peaks are those before the failure)
    # memory_stats "num_alloc_retries": cudaMalloc failed at the capacity and the cache was released (0: the replay
    # is the uncapped one's)
    num_alloc_retries: int = 0


def replay(schedule: Schedule, expandable_segments: bool = False, capacity_bytes: int | None = None) -> Replay:
    """Run the events through the allocator; per phase, its peak of allocated bytes (and the tensor bytes per
    component at that moment) and the reserved bytes by its end (a phase run more than once: its largest run's
    peak, its last run's end).

    With `capacity_bytes` the allocator behaves as on a device of that size: a segment that does not fit makes it
    release its cached blocks and retry, as PyTorch does, and the replay stops at an allocation that still fails
    (`Replay.oom`)."""
    events = schedule.events
    names = [phase for _, phase in schedule.phase_starts]
    got = phase_peaks(events, [start for start, _ in schedule.phase_starts] + [len(events)], expandable_segments,
                      capacity_bytes)
    # a phase the step runs more than once (a pipeline's forwards and backwards between micro-batches, a
    # preference objective's two passes) peaks at its largest run, and has reserved what its last run ends with
    peaks: dict[str, list[int]] = {}       # phase -> [peak allocated, reserved at end, event index of the peak]
    for phase, run in zip(names, got.runs, strict=False):
        seen = peaks.get(phase)
        if seen is None or run.peak_allocated_bytes > seen[0]:
            peaks[phase] = [run.peak_allocated_bytes, run.reserved_bytes, run.peak_at]
        else:
            seen[1] = run.reserved_bytes
    oom = None
    if got.failure is not None:
        f = got.failure
        oom = OutOfMemory(names[len(got.runs) - 1], schedule.where(f.at), events[f.at][4], f.requested_bytes,
                          f.allocated_bytes, f.reserved_bytes, int(capacity_bytes or 0))
    # tensor bytes per component at each phase's peak (none live before the first event)
    wanted: dict[int, list[str]] = {}
    for name, v in peaks.items():
        wanted.setdefault(v[2], []).append(name)
    at = sorted(i for i in wanted if i >= 0)
    components = {name: comps for i, comps in zip(at, components_at(events, at), strict=True) for name in wanted[i]}
    stats = got.stats
    phases = {name: PhasePeak(v[0], v[1], components.get(name, {})) for name, v in peaks.items()}
    name, top = max(phases.items(), key=lambda kv: kv[1].allocated)
    return Replay(stats.peak_allocated_bytes, stats.peak_reserved_bytes, top.components, name.split(":")[-1],
                  phases, oom, stats.num_alloc_retries)


def extrapolate(small: Replay, large: Replay, small_layers: int, large_layers: int, layers: int) -> Replay:
    """Per phase, allocated, reserved and each component grow linearly with the number of identical layers:
    extend the two replays to `layers` and take the largest phase."""
    f = (layers - large_layers) / (large_layers - small_layers)

    def lin(a: int, b: int) -> int:
        return round(b + (b - a) * f)

    phases = {}
    for name, big in large.phases.items():
        lit = small.phases.get(name, big)
        comps = {c: lin(lit.components.get(c, 0), v) for c, v in big.components.items()}
        phases[name] = PhasePeak(lin(lit.allocated, big.allocated), lin(lit.reserved, big.reserved), comps)
    name, top = max(phases.items(), key=lambda kv: kv[1].allocated)
    reserved = max(p.reserved for p in phases.values())
    return Replay(top.allocated, max(reserved, top.allocated), top.components, name.split(":")[-1], phases)


def same_peak_phase(small: Replay, large: Replay, deep: Replay) -> bool:
    """Whether the extrapolated step peaks in the phase both replays peak in. Allocated extrapolates exactly, so a
    different peak phase at depth (the optimizer step's states and foreach temporaries, which grow faster a layer
    than backward's activations, overtaking it) is a step the replays did not see: its reserved bytes (new segments
    where the cached blocks no longer serve) do not grow linearly and the extrapolation misses them."""
    return small.peak_phase == large.peak_phase == deep.peak_phase


def tensor_peak_bytes(schedule: Schedule) -> int:
    """The largest sum of live tensor bytes over the schedule's events, without the allocator: a lower bound on its
    replay's allocated peak (CachingAllocator rounds every block up, never down)."""
    return schedule.peak_live_bytes


def built_within(builder, stop_above_bytes: int) -> Schedule | None:
    """`builder.build()` (a StepSchedule's, its schedule in `builder.sch`) only as far as the live tensor bytes stay
    within `stop_above_bytes`: None where they pass it (the step's allocated peak is then over it too; the rest
    of the step is not built), else the whole schedule."""
    builder.sch.stop_above_bytes = stop_above_bytes
    try:
        schedule = builder.build()
    except LiveBytesOver:
        return None
    schedule.stop_above_bytes = None
    return schedule
