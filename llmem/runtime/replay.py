"""The ledger replayed through the caching-allocator model, and the result it gives: the allocator's peaks
(max_memory_allocated counts whole blocks, so a large block that was not split counts in full), the tensor bytes per
component at the peak, per phase, each component's own maximum, and the timeline."""

from __future__ import annotations

from dataclasses import dataclass

from llmem.memory.allocator import AllocatorOOM, CachingAllocator
from llmem.memory.capacity import AtCapacity, at_capacity, capacity_notes, resident_managed_bytes
from llmem.result import ALLOCATED_COMPONENTS, MemoryResult, OutOfMemory
from llmem.runtime.ledger import PHASE_CODES, PHASE_NAMES, Ledger
from llmem.setup.gpus import outside_allocator_bytes
from llmem.setup.record import SetupRecord

MAX_TIMELINE_POINTS = 2000


def replay_ledger(ledger: Ledger, *, expandable_segments: bool = False) -> dict:
    """Run the events through the CachingAllocator model.

    Returns the allocator's peaks (CUDA's max_memory_allocated / max_memory_reserved: whole blocks, so a large
    block that was not split counts in full), the tensor bytes per category at the moment of peak allocated, the
    same per phase (at each phase's own peak of tensor bytes), each category's own maximum, and the
    (allocated, reserved, phase) series."""
    alloc = CachingAllocator(expandable_segments=expandable_segments)
    malloc, free = alloc.malloc, alloc.free
    handles: dict[int, int] = {}
    cat_of = ledger.cat
    by_cat: dict[str, int] = dict.fromkeys(ALLOCATED_COMPONENTS, 0)
    cat_max: dict[str, int] = dict.fromkeys(ALLOCATED_COMPONENTS, 0)
    phase_peak: dict[int, tuple[int, dict]] = {}
    tensors = 0
    peak = -1
    peak_idx = 0
    peak_cats: dict[str, int] = {}
    series_alloc: list[int] = []
    series_res: list[int] = []
    series_phase: list[int] = []
    for i, (is_alloc, key, size, phase, _it, _mod, stream) in enumerate(ledger.events):
        cat = cat_of.get(key, "activations")
        if is_alloc:
            handles[key] = malloc(size, stream)
            by_cat[cat] += size
            tensors += size
            if by_cat[cat] > cat_max[cat]:
                cat_max[cat] = by_cat[cat]
            best = phase_peak.get(phase)
            if best is None or tensors > best[0]:
                phase_peak[phase] = (tensors, dict(by_cat))
        else:
            h = handles.pop(key, None)
            if h is None:
                continue
            free(h)
            by_cat[cat] -= size
            tensors -= size
        allocated = alloc.allocated_bytes
        if allocated > peak:
            peak, peak_idx, peak_cats = allocated, i, dict(by_cat)
        series_alloc.append(allocated)
        series_res.append(alloc.reserved_bytes)
        series_phase.append(phase)
    final = alloc.stats()
    return {"peak_allocated": final.peak_allocated_bytes, "peak_reserved": final.peak_reserved_bytes,
            "peak_index": peak_idx, "components": peak_cats, "allocated": series_alloc, "reserved": series_res,
            "phase": series_phase, "num_segments": final.num_segments, "category_max": cat_max,
            "phase_peaks": {PHASE_NAMES[p]: {"tensor_bytes": v[0], "components": v[1]}
                            for p, v in sorted(phase_peak.items())}}


def phase_tensor_peak(ledger: Ledger, phase: str) -> int:
    """replay_ledger's phase_peaks[phase]["tensor_bytes"] without the allocator model: the bytes of the live
    allocations read after each of the phase's allocations, at their largest. Its rules: an allocation adds its
    size, a free of a live key takes off the free's own size, a free of a key not live is skipped; the first of the
    phase's allocations sets the peak, a later one only when above it. KeyError, as there, where the phase
    allocated nothing."""
    code = PHASE_CODES[phase]
    live: set[int] = set()
    tensors = 0
    peak = None
    for is_alloc, key, size, ph, _it, _mod, _stream in ledger.events:
        if is_alloc:
            live.add(key)
            tensors += size
            if ph == code and (peak is None or tensors > peak):
                peak = tensors
        elif key in live:
            live.remove(key)
            tensors -= size
    if peak is None:
        raise KeyError(phase)
    return peak


@dataclass
class TraceDetails:
    """What the MemoryResult leaves out: tensor-level peaks per phase, each category's own maximum, the biggest
    allocations live at the peak (with their module), and the raw ledger."""
    phase_peaks: dict[str, dict]          # phase -> {"tensor_bytes", "components"} at that phase's peak
    category_max: dict[str, int]
    top_at_peak: list[dict]
    ledger: Ledger
    wall_seconds: float = 0.0


def trace_details(ledger: Ledger, series: dict, wall_seconds: float) -> TraceDetails:
    """The details of a replayed step (trace or CPU measure): its phase peaks, category maxima and the largest
    allocations live at its peak."""
    return TraceDetails(series["phase_peaks"], series["category_max"],
                        top_allocations_at(ledger, series["peak_index"]), ledger, wall_seconds)


def top_allocations_at(ledger: Ledger, index: int, n: int = 15) -> list[dict]:
    live: dict[int, tuple] = {}
    for is_alloc, key, size, phase, it, mod, _s in ledger.events[: index + 1]:
        if is_alloc:
            live[key] = (size, phase, it, mod)
        else:
            live.pop(key, None)
    groups: dict[tuple, list[int]] = {}
    for key, (size, _phase, _it, mod) in live.items():
        g = groups.setdefault((ledger.cat.get(key, "activations"), ledger.module_names[mod]), [0, 0])
        g[0] += size
        g[1] += 1
    rows = [{"category": c, "module": m, "bytes": b, "count": k} for (c, m), (b, k) in groups.items()]
    rows.sort(key=lambda r: -r["bytes"])
    return rows[:n]


def downsample(series: dict, max_points: int = MAX_TIMELINE_POINTS) -> list[dict]:
    alloc, res, phase = series["allocated"], series["reserved"], series["phase"]
    n = len(alloc)
    if n == 0:
        return []
    if n <= max_points:
        picks = range(n)
    else:
        per = -(-n // (max_points - 1))
        picks = []
        for start in range(0, n, per):
            stop = min(n, start + per)
            best = max(range(start, stop), key=alloc.__getitem__)
            picks.append(best)
        if series["peak_index"] not in picks:
            picks.append(series["peak_index"])
            picks.sort()
        picks = picks[:max_points]
    return [{"t": i, "allocated": alloc[i], "reserved": res[i], "phase": PHASE_NAMES[phase[i]]} for i in picks]


def ledger_at_capacity(ledger: Ledger, series: dict, capacity_bytes: int, expandable_segments: bool) -> AtCapacity:
    """The traced step on a device whose allocator may fill `capacity_bytes` (llmem.memory.capacity): decided on
    the uncapped peaks where they decide it, else by replaying the ledger at that capacity."""

    def capped(capacity: int) -> tuple[int, OutOfMemory | None]:
        alloc = CachingAllocator(expandable_segments=expandable_segments, capacity_bytes=capacity)
        handles: dict[int, int] = {}
        for is_alloc, key, size, phase, it, mod, stream in ledger.events:
            if not is_alloc:
                h = handles.pop(key, None)
                if h is not None:
                    alloc.free(h)
                continue
            try:
                handles[key] = alloc.malloc(size, stream)
            except AllocatorOOM as exc:
                return 0, OutOfMemory(f"it{it}:{PHASE_NAMES[phase]}", ledger.module_names[mod],
                                      ledger.cat.get(key, "activations"), size, exc.allocated_bytes,
                                      exc.reserved_bytes, capacity)
        return alloc.stats().peak_reserved_bytes, None

    def first_over(capacity: int) -> OutOfMemory:
        # the ledger is at hand: the replay at capacity names the very allocation that fails
        oom = capped(capacity)[1]
        assert oom is not None, "a step whose allocated peak exceeds the capacity completed at it"
        return oom

    return at_capacity(series["peak_allocated"], series["peak_reserved"], capacity_bytes, capped, first_over)


def build_result(engine: str, ledger: Ledger, record: SetupRecord, gpu, notes: list[str],
                 series: dict | None = None, managed_bytes: int = 0) -> MemoryResult:
    """The result of a traced (or CPU-measured) step: the counters from the replay, the breakdown at its peak;
    device_used adds what lies outside the allocator (the CUDA context, the catalog's assumption, and NCCL's
    buffers) and the managed memory resident on the device. `fits`: the ledger completes on the GPU's memory."""
    series = series or replay_ledger(ledger, expandable_segments=record.expandable_segments)
    peak_alloc = series["peak_allocated"]
    outside = outside_allocator_bytes(gpu, record.gpus)
    cap = ledger_at_capacity(ledger, series, gpu.memory_bytes - outside, record.expandable_segments)
    peak_res = series["peak_reserved"] if cap.reserved_bytes is None else cap.reserved_bytes
    paged = managed_bytes
    if cap.completes:      # paged optimizer states: resident while there is room, evicted when there is not
        managed_bytes = resident_managed_bytes(managed_bytes, cap.capacity_bytes - peak_res)
    comps = {name: int(series["components"].get(name, 0)) for name in ALLOCATED_COMPONENTS}
    # The categories hold tensor bytes (512-B rounded). CUDA's memory_allocated also counts the unsplit tail of a
    # large block (a 21.5 MiB tensor cut from a 22 MiB segment holds all 22 MiB): that is block_rounding.
    comps["block_rounding"] = peak_alloc - sum(comps.values())
    comps["allocator_overhead"] = peak_res - peak_alloc
    comps["cuda_context"] = outside
    comps["managed_memory"] = managed_bytes      # paged optimizer states: device memory outside the allocator
    comps["vllm_pool"] = 0                       # the trace runs no vLLM (GRPO --use-vllm is estimated only)
    phase = PHASE_NAMES[series["phase"][series["peak_index"]]] if series["phase"] else ""
    notes = notes + capacity_notes(cap, series["peak_reserved"], managed_bytes, paged)
    return MemoryResult(engine=engine, peak_allocated_bytes=peak_alloc, peak_reserved_bytes=series["peak_reserved"],
                        device_used_bytes=peak_res + outside + managed_bytes,
                        gpu_memory_bytes=gpu.memory_bytes,
                        components=comps, setup=record, peak_phase=phase, notes=notes,
                        timeline=downsample(series), capacity_bytes=cap.capacity_bytes,
                        capped_reserved_bytes=cap.reserved_bytes, oom=cap.oom,
                        by_fragmentation=cap.by_fragmentation)

