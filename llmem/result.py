"""The answer every engine gives (estimate, paper, trace, measure): three counters and a breakdown.

Counters are named as PyTorch names them:
- peak_allocated: `torch.cuda.max_memory_allocated()`, bytes held by live tensors (512-byte rounded), at the peak.
- peak_reserved:  `torch.cuda.max_memory_reserved()`, bytes the caching allocator holds in segments.
- device_used:    what nvidia-smi shows for the process: the reserved peak on the device (capped_reserved when the
                  allocator had to release its cache to go on) + the CUDA context (driver, kernels, handles)
                  + CUDA managed memory resident on the device (paged 8-bit optimizer states, evicted when full)
                  + a colocated vLLM engine's pool while it is resident (GRPO --use-vllm).
- fits:           the step's allocations complete on the device (llmem.memory.capacity), as PyTorch decides OOM.

`components` splits the counters at the moment of peak_allocated. The allocated components sum to peak_allocated;
`allocator_overhead` = the reserved peak on the device (capped_reserved, else peak_reserved) - peak_allocated;
`cuda_context` + `managed_memory` + `vllm_pool` = device_used - that reserved peak.
So all components sum to device_used.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields

from llmem.setup.record import SetupRecord
from llmem.units import format_bytes

# One name per kind of memory, in display order. Engines may leave any at 0.
COMPONENTS = (
    "weights",                 # parameters as stored (sharded under fsdp/tp), fp32 masters under mixed precision
    "gathered_weights",        # FSDP unsharded parameters of the current unit(s); autocast's low-precision copies
    "gradients",
    "optimizer_states",
    "optimizer_temporaries",   # e.g. AdamW foreach's sqrt(exp_avg_sq) copy at the step
    "activations",             # tensors saved for backward and temporaries of forward/backward
    "logits_and_loss",         # lm_head output, its fp32 upcast, log-softmax, their gradients
    "communication_buffers",   # DDP buckets, FSDP all-gather / reduce-scatter buffers, TP collectives
    "cuda_workspaces",         # cuBLAS workspace (taken from the caching allocator)
    "block_rounding",          # whole allocator blocks handed out beyond the tensors' sizes (counted as allocated)
    "allocator_overhead",      # reserved but not allocated: rounding, free blocks in cached segments
    "cuda_context",            # outside the allocator
    "managed_memory",          # outside the allocator: bitsandbytes' paged optimizer states (cudaMallocManaged)
    "vllm_pool",               # a colocated vLLM engine's pool (weights, KV cache, ...: llmem.memory.vllm)
)
ALLOCATED_COMPONENTS = COMPONENTS[:-4]


@dataclass(frozen=True)
class OutOfMemory:
    """Where a replay at a device's capacity failed: the allocation the allocator could not place even after
    releasing its cache (PyTorch's "CUDA out of memory. Tried to allocate ...")."""
    phase: str                 # "it0:backward"
    where: str                 # "layer 12", "loss", "" when unknown
    component: str             # what the failed tensor is (activations, gradients, ...)
    requested_bytes: int
    allocated_bytes: int       # live blocks at the failure
    reserved_bytes: int        # segments held at the failure (after the cache was released)
    capacity_bytes: int

    def describe(self) -> str:
        where = f", {self.where}" if self.where else ""
        if not self.requested_bytes:   # decided on the allocated peak alone: no release of cache could help
            return (f"out of memory in {self.phase}: {format_bytes(self.allocated_bytes)} of live tensors at its "
                    f"peak (the largest part {self.component}) where the allocator may use "
                    f"{format_bytes(self.capacity_bytes)}")
        return (f"out of memory in {self.phase}{where}: {format_bytes(self.requested_bytes)} of {self.component} "
                f"with {format_bytes(self.allocated_bytes)} allocated and {format_bytes(self.reserved_bytes)} "
                f"reserved of {format_bytes(self.capacity_bytes)} the allocator may use")

    def to_dict(self) -> dict:
        return {"phase": self.phase, "where": self.where, "component": self.component,
                "requested_bytes": self.requested_bytes, "allocated_bytes": self.allocated_bytes,
                "reserved_bytes": self.reserved_bytes, "capacity_bytes": self.capacity_bytes}


@dataclass(frozen=True)
class PhaseMemory:
    """One phase of a step with phases (GRPO's generation, scoring, training): its own peak of allocated bytes
    (over the iterations), the reserved bytes by then (the allocator's segments carry across phases), what fills it
    at its peak (tensor bytes per component), and whether it is the step's peak."""
    name: str
    allocated_bytes: int
    reserved_bytes: int
    components: dict[str, int]
    is_peak: bool = False

    def to_dict(self) -> dict:
        return {"name": self.name, "allocated_bytes": self.allocated_bytes, "reserved_bytes": self.reserved_bytes,
                "components": dict(self.components), "is_peak": self.is_peak}


@dataclass(frozen=True)
class JobPhase:
    """A phase of the job around its step (llmem.estimator.job_phases): loading the model or saving a checkpoint,
    the path it takes (`kind`), its peak of tensor bytes on one GPU and of CPU RAM on one node, and what it runs."""
    name: str                  # "load", "eval", "save"
    kind: str                  # the loading path / saving kind (llmem.setup.job_phases)
    device_bytes: int
    host_bytes: int
    what: str

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "device_bytes": self.device_bytes,
                "host_bytes": self.host_bytes, "what": self.what}


EVAL_PHASE = "eval"            # the job's evaluation phase (llmem.estimator.eval_phase)


def phase_over(phases: list[JobPhase], allocator_bytes: int) -> JobPhase | None:
    """The phase whose tensor bytes per GPU pass what the allocator may use (the largest such; None: every phase
    fits). Its tensors alone are over, so no allocator layout can hold them: the job runs out of memory there
    (MemoryResult.job_over, from the estimate's phases and the trace's alike)."""
    over = [p for p in phases if p.device_bytes > allocator_bytes]
    return max(over, key=lambda p: p.device_bytes) if over else None


# The phases of a step with phases as the report groups them: GRPO's weight sync to vLLM (under FSDP2), generation
# and scoring, then its training (forward, backward, optimizer step)
PHASE_GROUPS = {"weight_sync": "weight_sync", "generation": "generation", "scoring": "scoring",
                "forward": "training", "backward": "training", "optimizer_step": "training"}


def grouped_phases(peaks: list[tuple[str, int, int, dict[str, int]]]) -> list[PhaseMemory]:
    """Each phase group's peak over the iterations, from (phase, allocated peak, reserved by then, components at the
    peak) rows (phase: "forward" or "it1:forward"); the largest is marked the step's peak."""
    best: dict[str, tuple[int, int, dict[str, int]]] = {}
    for phase, allocated, reserved, comps in peaks:
        group = PHASE_GROUPS.get(phase.split(":")[-1])
        if group is None:
            continue
        old = best.get(group)
        if old is None or allocated > old[0]:
            best[group] = (allocated, max(reserved, old[1] if old else 0), {k: v for k, v in comps.items() if v})
        else:
            best[group] = (old[0], max(old[1], reserved), old[2])
    if not best:
        return []
    top = max(best, key=lambda g: best[g][0])
    order = [g for g in dict.fromkeys(PHASE_GROUPS.values()) if g in best]
    return [PhaseMemory(g, best[g][0], best[g][1], best[g][2], g == top) for g in order]


@dataclass
class MemoryResult:
    engine: str                          # "llmem", "paper", "trace", "measure"
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_used_bytes: int
    gpu_memory_bytes: int
    components: dict[str, int]
    setup: SetupRecord | None = None     # the set-up as resolved (the same record from every engine)
    peak_phase: str = ""                 # forward / backward / optimizer_step
    notes: list[str] = field(default_factory=list)
    timeline: list[dict] | None = None   # trace only: [{t, allocated, reserved, phase}]
    moments: list[dict] = field(default_factory=list)  # estimate: allocated bytes at each candidate peak moment
    # Out of memory as the allocator decides it (llmem.memory.capacity): the step replayed on a device whose
    # allocator may fill `capacity_bytes` (the GPU's memory, or the planner's limit, less what lies outside the
    # allocator). 0: not checked (the paper engine, a real measurement), so `fits` compares device_used instead.
    capacity_bytes: int = 0
    capped_reserved_bytes: int | None = None  # max_memory_reserved at that capacity (the cache released and retried)
    oom: OutOfMemory | None = None            # where the step runs out of memory at that capacity
    by_fragmentation: bool = False            # fits / OOM decided by the cached segments' layout: marginal
    phases: list[PhaseMemory] = field(default_factory=list)   # a step with phases (GRPO): each phase's peak
    stages: list[dict] = field(default_factory=list)   # --pp: each pipeline stage's peaks ({stage, ..._bytes})
    # the job's loading, evaluation and saving phases (estimate only; in the JSON only when there are some)
    job_phases: list[JobPhase] = field(default_factory=list)
    job_notes: list[str] = field(default_factory=list)
    # the job phase whose tensor bytes per GPU pass what the allocator may use (the largest such): the job runs out
    # of memory there whatever the step's fit (in the JSON only when there is one)
    job_over: JobPhase | None = None

    @property
    def reserved_on_device_bytes(self) -> int:
        """The reserved peak on the device: capped where the allocator released its cache to go on."""
        return self.peak_reserved_bytes if self.capped_reserved_bytes is None else self.capped_reserved_bytes

    @property
    def job_peak(self) -> tuple[str, int]:
        """The job's peak of tensor bytes per GPU and the phase it lies in: the step's (its peak_allocated) or a
        job phase's."""
        return max([("step", self.peak_allocated_bytes)] + [(p.name, p.device_bytes) for p in self.job_phases],
                   key=lambda kv: kv[1])

    @property
    def step_fits(self) -> bool:
        """The training step completes on the device (its allocations, as the allocator decides OOM)."""
        if self.capacity_bytes:
            return self.oom is None
        return self.device_used_bytes <= self.gpu_memory_bytes

    @property
    def fits(self) -> bool:
        """The whole job fits: its step, and its loading, evaluation and saving phases."""
        return self.step_fits and self.job_over is None

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "setup":
                out["setup"] = value.to_dict() if value is not None else {}
            elif f.name == "oom":
                out["oom"] = value.to_dict() if value is not None else None
            elif f.name == "phases":
                out["phases"] = [p.to_dict() for p in value]
            elif f.name in ("job_phases", "job_notes"):
                if value:
                    out[f.name] = [p.to_dict() for p in value] if f.name == "job_phases" else list(value)
            elif f.name == "job_over":
                if value is not None:
                    out["job_over"], out["step_fits"] = value.to_dict(), self.step_fits
            elif not (f.name == "timeline" and value is None):
                out[f.name] = copy.deepcopy(value)      # as dataclasses.asdict copies dicts and lists
        if any(p.name == EVAL_PHASE for p in self.job_phases):   # (added with the eval: earlier answers unchanged)
            name, peak = self.job_peak
            out["job_peak"] = {"phase": name, "device_bytes": peak}
        out["fits"] = self.fits
        return out
