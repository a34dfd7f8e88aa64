"""The engine on the estimator floor: per-GPU peak memory of one PyTorch-native fine-tuning step, in milliseconds.

LLMem's equations (paper §3-4) generalised to modern PyTorch: the model states follow the method's real sharding
(llmem.estimator.states), the activations its family's recipe (llmem.memory.activations), and the step is laid out
as an allocation schedule (llmem.estimator.schedule) replayed through the caching-allocator model
(llmem.memory.allocator), which gives max_memory_allocated (whole blocks) and max_memory_reserved (segments, per
stream); device_used adds what is outside the allocator: the CUDA context, NCCL's buffers and the managed memory of
paged 8-bit optimizer states (cudaMallocManaged). The moments (llmem.estimator.moments) explain the peak
(`--json` "moments"); the replay gives the numbers.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from llmem.errors import LlmemError
from llmem.estimator.deepen import alike_layers, whole_from_template
from llmem.estimator.deepspeed import DeepSpeedSchedule
from llmem.estimator.eval_phase import eval_notes, eval_phase
from llmem.estimator.events import Replay, Schedule, built_within, extrapolate, replay, same_peak_phase
from llmem.estimator.generation import check_vllm_starts, colocated_pool, vllm_note
from llmem.estimator.identity_cache import IdentityCache
from llmem.estimator.job_phases import job_notes, job_phases
from llmem.estimator.moments import step_moments
from llmem.estimator.notes import estimate_notes
from llmem.estimator.schedule import StepSchedule
from llmem.estimator.shared_replays import SharedReplays, schedule_key
from llmem.estimator.states import ModelStates, model_states, offloaded_optimizer_host_bytes
from llmem.memory.activations.context_parallel import rank_tokens
from llmem.memory.activations.learned import (
    learned_for,
    learning_failure,
    learning_key,
    learning_need,
    remember_failure,
)
from llmem.memory.activations.profile import ActivationProfile, activation_profile
from llmem.memory.capacity import AtCapacity, Fit, at_capacity, capacity_notes, resident_managed_bytes
from llmem.model.anatomy import ModelAnatomy
from llmem.model.resolved import ResolvedSetup, resolve
from llmem.result import COMPONENTS, MemoryResult, OutOfMemory, PhaseMemory, grouped_phases, phase_over
from llmem.setup.gpus import GpuSpec, outside_allocator_bytes
from llmem.setup.objectives import objective_spec
from llmem.setup.training import TrainingSetup

T = TypeVar("T")
EXACT_LAYERS = 128                # models up to this depth (every catalog model) are replayed whole
EXTRAPOLATE_FROM = (16, 24)       # deeper ones from these two depths, extrapolated (benchmarks/estimate_speed.md)
DRAFT_FROM = (4, 8)               # the planner's search estimates


def estimate(setup: TrainingSetup, anatomy: ModelAnatomy | None = None, gpu: GpuSpec | None = None,
             *, draft: bool = False) -> MemoryResult:
    """Per-GPU peak memory of one training step: the three PyTorch counters and their breakdown.

    `anatomy`: the base model's (loaded from setup.model when None); `gpu`: the GPU (from setup.gpu). `draft`
    extrapolates from shallower replays (4 and 8 layers): a few times faster, reserved less exact, with no notes nor
    moments (a search reads its bytes only, and confirms with the full one).
    """
    return estimate_resolved(resolve(setup, anatomy, gpu), draft=draft)


def estimate_resolved(r: ResolvedSetup, *, draft: bool = False, states: ModelStates | None = None,
                      limit_bytes: int | None = None, verdict: StepVerdict | None = None,
                      shared: SharedReplays | None = None) -> MemoryResult:
    """The estimate of a resolved set-up; `states`: its model states when the caller has them (they do not depend
    on the micro-batch shape). `fits` is decided on a device of `limit_bytes` (default: the GPU's memory) as the
    allocator decides it (llmem.memory.capacity); a draft decides it on its extrapolated peaks only. `verdict`:
    step_verdict's at this limit, whose schedule and replay at the capacity are reused; `shared`: the replays a
    planner's searches share (set-ups with the same schedule replayed once)."""
    record = r.record()
    r, act = rank_step(r)
    ms = states or model_states(r)
    stages: list[dict] = []
    if r.layout.pp > 1:    # one schedule per pipeline stage, the answer the largest (llmem.estimator.pipeline)
        from llmem.estimator.pipeline import pipeline_note, pipeline_step, stage_whole

        rep, top, stages = pipeline_step(r)
        moments = []       # the moments explain a whole-model step: not written for a stage
        whole = functools.cache(lambda: stage_whole(r, top))
    else:
        moments = [] if draft else step_moments(r, act, ms)    # a search's drafts are read for their bytes only
        rep, whole = step_replay(r, act, draft, verdict, shared)
    context = outside_allocator_bytes(r.gpu, r.layout.world_size)
    limit = r.gpu.memory_bytes if limit_bytes is None else limit_bytes
    pool = colocated_pool(r)           # GRPO --use-vllm colocate: vLLM's own pool beside the trainer
    if pool is not None:
        check_vllm_starts(r, pool, ms.weights, context)
    vllm_resident = pool.resident_in_training_bytes if pool is not None else 0
    capacity = limit - context - vllm_resident
    known = verdict.capped if verdict is not None and verdict.capacity_bytes == capacity else None
    cap = step_at_capacity(r, rep, capacity, whole, draft=draft, capped_replay=known)
    if stages and cap.completes:       # the answer stage fits: so must every other stage's live tensors
        cap = every_stage_fits(cap, stages)
    if pool is not None and pool.sleeps:
        cap = vllm_wake_up(rep, pool, cap, limit - context)
    reserved = rep.peak_reserved_bytes if cap.reserved_bytes is None else cap.reserved_bytes
    managed = ms.optimizer_states_outside_allocator
    if cap.completes:      # paged states: resident while there is room, evicted to the host when there is not
        managed = resident_managed_bytes(managed, limit - context - reserved - vllm_resident)
    if pool is not None and pool.sleeps:   # at the wake-up: the trainer's live tensors (cache emptied) + the pool
        vllm_resident = max(0, generation_allocated(rep) + pool.pool_bytes - reserved)
    components = dict.fromkeys(COMPONENTS, 0)
    components.update(rep.components)
    components["block_rounding"] = rep.peak_allocated_bytes - sum(rep.components.values())
    components["allocator_overhead"] = reserved - rep.peak_allocated_bytes
    components["cuda_context"] = context
    components["managed_memory"] = managed
    components["vllm_pool"] = vllm_resident
    host = offloaded_optimizer_host_bytes(r) if r.setup.offload_optimizer or r.setup.offload_param else 0
    result = MemoryResult(
        engine="llmem",
        peak_allocated_bytes=rep.peak_allocated_bytes,
        peak_reserved_bytes=rep.peak_reserved_bytes,
        device_used_bytes=reserved + context + managed + vllm_resident,
        gpu_memory_bytes=r.gpu.memory_bytes,
        components=components,
        setup=record,
        peak_phase=rep.peak_phase,
        notes=[] if draft else estimate_notes(r, act, host) + capacity_notes(
            cap, rep.peak_reserved_bytes, managed, ms.optimizer_states_outside_allocator),
        moments=[{"phase": m.phase, "allocated_bytes": m.total, "components": dict(m.components)} for m in moments],
        capacity_bytes=cap.capacity_bytes,
        capped_reserved_bytes=cap.reserved_bytes,
        oom=cap.oom,
        by_fragmentation=cap.by_fragmentation,
        phases=step_phases(r, rep),
        stages=stages,
    )
    if stages:
        result.notes.append(pipeline_note(r, top))
    if pool is not None:
        result.notes.append(vllm_note(r, pool))
    if not draft:                     # a search's drafts: the step only
        add_job_phases(result, r, ms, act, limit - context)
    return result


def add_job_phases(result: MemoryResult, r: ResolvedSetup, ms: ModelStates, act: ActivationProfile,
                   allocator_bytes: int) -> None:
    """The job's phases beside the step (loading, evaluation, saving) and what the answer says of them."""
    phases = job_phases(r, ms)
    evaluation = eval_phase(r, ms, act)
    if evaluation is not None:        # between loading and saving, as the table lists them
        phases.insert(min(1, len(phases)), evaluation)
    result.job_phases = phases
    result.job_over = phase_over(phases, allocator_bytes)
    if phases:
        result.job_notes = job_notes(phases, result.peak_allocated_bytes, allocator_bytes)
    result.job_notes += eval_notes(r)


@dataclass(frozen=True)
class StepVerdict:
    """step_verdict's answer: the fit at `capacity_bytes` (the allocator's share of the limit), and what deciding it
    built, which the full estimate at the same capacity reuses (estimate_resolved's `verdict`)."""
    fit: Fit
    capacity_bytes: int
    schedule: Schedule | None = field(default=None, repr=False)   # the whole-depth schedule (None: over capacity)
    capped: Replay | None = field(default=None, repr=False)       # its replay at the capacity (None: over it)


def step_verdict(r: ResolvedSetup, limit_bytes: int) -> StepVerdict | None:
    """Whether the step fits within `limit_bytes` of device memory, decided as estimate_resolved decides `fits`
    there, for less: the whole-depth schedule built once, and only as far as its live tensor bytes stay within the
    capacity (past it the allocated peak is over too: the allocator rounds blocks up, never down), with no replay;
    else one replay at the capacity, which stops at the first allocation that fails (the full estimate replays
    uncapped, then at the capacity where that does not decide it: the same verdict, llmem.memory.capacity). None
    where the full estimate decides otherwise: a pipeline (one replay per stage), a colocated vLLM pool, a model
    deeper than EXACT_LAYERS (decided on extrapolated peaks)."""
    if r.layout.pp > 1 or r.anatomy.num_layers > EXACT_LAYERS or colocated_pool(r) is not None:
        return None
    r, act = rank_step(r)
    capacity = limit_bytes - outside_allocator_bytes(r.gpu, r.layout.world_size)
    if capacity <= 0:
        return StepVerdict(Fit.OVER_CAPACITY, capacity)

    def decide() -> StepVerdict:
        schedule = whole_schedule_within(r, act, capacity)
        if schedule is None:
            return StepVerdict(Fit.OVER_CAPACITY, capacity)
        got = replay(schedule, r.setup.expandable_segments, capacity_bytes=capacity)
        return StepVerdict(Fit.FITS if got.oom is None else Fit.OUT_OF_MEMORY, capacity, schedule, got)

    return _without_gc(decide)


def step_replay(r: ResolvedSetup, act: ActivationProfile, draft: bool, verdict: StepVerdict | None,
                shared: SharedReplays | None = None) -> tuple[Replay, Callable[[], Schedule]]:
    """The step's replay (extrapolated in depth for deep models, from shallower depths for a draft) and the builder
    of its whole-depth schedule (built once: replayed, maybe at the capacity). With a fitting `verdict` its
    schedule is that one, and its replay at the capacity is the replay where no cudaMalloc failed there (the
    allocator then never differed from an unlimited one)."""
    built = verdict.schedule if verdict is not None else None
    whole = functools.cache(lambda: built if built is not None else whole_schedule(r, act))
    capped = verdict.capped if verdict is not None and not draft else None
    if capped is not None and capped.num_alloc_retries == 0 and capped.oom is None:
        return capped, whole
    return replayed_step(r, act, DRAFT_FROM if draft else EXTRAPOLATE_FROM, whole=whole, shared=shared), whole


def generation_allocated(rep: Replay) -> int:
    """The trainer's live tensor bytes at its generation phases' peak (what stays on the device while vLLM runs),
    FSDP2's weight sync included (vLLM's weights woken before it; the full tensors' blocks stay cached by then)."""
    return max((p.allocated for name, p in rep.phases.items()
                if name.endswith((":generation", ":weight_sync"))), default=0)


def vllm_wake_up(rep: Replay, pool, cap: AtCapacity, capacity_bytes: int) -> AtCapacity:
    """Sleep mode: TRL empties torch's cache and wakes vLLM before each generation; its pool must fit beside the
    trainer's live tensors then (else CUDA runs out of memory at the wake-up)."""
    held = generation_allocated(rep)
    if not cap.completes or held + pool.pool_bytes <= capacity_bytes:
        return cap
    oom = OutOfMemory("generation", "vLLM wake-up", "vllm_pool", pool.pool_bytes, held, held, capacity_bytes)
    return replace(cap, reserved_bytes=None, oom=oom)


def step_phases(r: ResolvedSetup, rep: Replay) -> list[PhaseMemory]:
    """A step with phases (GRPO: generation, scoring, training): each phase's peak from the replay."""
    if not objective_spec(r.setup.objective).generates:
        return []
    return grouped_phases([(name, p.allocated, p.reserved, p.components) for name, p in rep.phases.items()])


def step_at_capacity(r: ResolvedSetup, rep: Replay, capacity_bytes: int, whole: Callable[[], Schedule],
                     *, draft: bool = False, capped_replay: Replay | None = None) -> AtCapacity:
    """The step on a device whose allocator may fill `capacity_bytes`: decided on the (extrapolated) peaks where
    they decide it, else by replaying the whole-depth schedule at that capacity (fragmentation does not
    extrapolate; `whole` gives that schedule; `capped_replay`: that replay where the caller has it). A draft never
    replays: it takes an undecided step as fitting, at the capacity."""

    def capped(capacity: int) -> tuple[int, OutOfMemory | None]:
        if draft:          # undecided: taken as fitting, with the most the allocator may hold there
            return min(rep.peak_reserved_bytes, capacity), None
        got = capped_replay or _without_gc(lambda: replay(whole(), r.setup.expandable_segments,
                                                          capacity_bytes=capacity))
        return got.peak_reserved_bytes, got.oom

    return at_capacity(rep.peak_allocated_bytes, rep.peak_reserved_bytes, capacity_bytes, capped,
                       lambda capacity: first_over(rep, capacity))


def every_stage_fits(cap: AtCapacity, stages: list[dict]) -> AtCapacity:
    """Under --pp the answer stage (the largest reserved peak) fitting does not make a stage with more live tensors
    fit: one whose allocated peak exceeds the capacity runs out of memory whatever its cache does."""
    over = next((st for st in stages if st["peak_allocated_bytes"] > cap.capacity_bytes), None)
    if over is None:
        return cap
    oom = OutOfMemory("step", f"pipeline stage {over['stage']}", "", 0, over["peak_allocated_bytes"],
                      over["peak_reserved_bytes"], cap.capacity_bytes)
    return AtCapacity(cap.capacity_bytes, None, oom)


def first_over(rep: Replay, capacity_bytes: int) -> OutOfMemory:
    """Where allocated memory first exceeds the capacity: the first phase whose peak does, and its largest part."""
    for name, p in rep.phases.items():
        if p.allocated > capacity_bytes:
            top = max(p.components, key=p.components.get, default="")
            return OutOfMemory(name, "", top, 0, p.allocated, max(p.reserved, p.allocated), capacity_bytes)
    # (the step's allocated peak is some phase's: a phase run more than once keeps its largest run, events.replay)
    raise AssertionError("first_over called with the allocated peak within the capacity")


def quick_peak_allocated(r: ResolvedSetup, states: ModelStates | None = None) -> int:
    """Tensor bytes at the step's largest moment, without the allocator replay (about 1 ms): for searches. Under
    --cp the rank's step, as the full estimate runs it: seq_len / cp tokens and the ring's K/V buffers (rank_step:
    --ep refused as the full estimate refuses it)."""
    r, act = rank_step(r)
    return max(m.total for m in step_moments(r, act, states or model_states(r)))


def rank_step(r: ResolvedSetup) -> tuple[ResolvedSetup, ActivationProfile]:
    """The step one rank runs, and its activations: under --cp its seq_len / cp tokens
    (llmem.memory.activations.context_parallel), the activations learned where no recipe has them, --ep's
    refused without them."""
    r = rank_tokens(r)
    learn_if_needed(r)
    check_learned_required(r)
    return r, activation_profile(r)


# the options whose activations only learning has: (flag, what the learned run is), checked in order
_LEARNED_ONLY = (
    (lambda r: r.layout.ep > 1, "--ep", "the real expert-parallel forward"),
    (lambda r: r.setup.compile, "--compile", "the real compile pipeline"),
    (lambda r: r.setup.images_per_sample, "--images-per-sample", "the real vision-language step"),
)


def check_learned_required(r: ResolvedSetup) -> None:
    """--ep (the all-to-all buffers and the received rows of the real EP forward, llmem.runtime.expert_parallel),
    --compile (what inductor's partitioner saves, llmem.runtime.compile) and a vision-language step's images (its
    vision side: llmem.memory.activations.learned_vision) are in learned activations only;
    without them the estimate is refused rather than read off a recipe that has neither."""
    for on, flag, run in _LEARNED_ONLY:
        if on(r) and learned_for(r) is None:
            why = learning_failure(r) or "learning is off (LLMEM_LEARN=never)"
            raise LlmemError(f"{flag} needs the activations learned from {run}, which are not available here "
                             f"({why}): use LLMEM_LEARN=auto (the default) or drop {flag}")


def learn_if_needed(r: ResolvedSetup) -> None:
    """Set-ups without a hand recipe (a family with none, a peft type without an exact model) get their activations
    learned from the real code (llmem.learn: a shallow copy run on fake tensors, once per model and set-up,
    cached); imported only then, so hand-recipe estimates import no runtime. A refusal is kept as the reason the
    notes give, and the hand recipes stand."""
    need, _ = learning_need(r)
    if not need or learned_for(r) is not None or learning_failure(r) is not None:
        return
    from llmem.learn.points import LearnError
    from llmem.learn.shallow_copy import learned_activations

    try:
        learned_activations(r)
    except LearnError as exc:
        remember_failure(learning_key(r), str(exc))


def replayed_step(r: ResolvedSetup, act: ActivationProfile, depths: tuple[int, int] = EXTRAPOLATE_FROM,
                  *, whole: Callable[[], Schedule] | None = None, shared: SharedReplays | None = None) -> Replay:
    """The step's allocation schedule through the allocator model (extrapolated in depth for deep models);
    `whole`: the whole-depth schedule's builder when the caller keeps it; `shared`: replays made for set-ups with
    the same schedule, read instead of building and replaying it again."""
    expandable = r.setup.expandable_segments

    def made(layers: int | None) -> Replay:
        if layers is None:
            sched = whole() if whole is not None else whole_schedule(r, act)
        else:
            sched = shallow_schedule(r, act, layers)
        return replay(sched, expandable_segments=expandable)

    def run(layers: int | None) -> Replay:
        return made(layers) if shared is None else shared.replay(r, layers, lambda: made(layers))

    small, large = depths
    num_layers = r.anatomy.num_layers
    if act.grad_ckpt and act.ckpt_every > 1:
        # every k-th layer checkpointed: replay depths congruent to the model's depth mod k, so the number of
        # checkpointed layers (ceil(depth / k)) and the top layer's kind grow linearly between them
        k = act.ckpt_every
        small, large = small + (num_layers - small) % k, large + (num_layers - large) % k
        large = large if large > small else small + k
    full = depths == EXTRAPOLATE_FROM
    if num_layers <= max(large, EXACT_LAYERS if full else large):
        return _without_gc(lambda: run(None))

    def extrapolated() -> Replay:
        at_small, at_large = run(small), run(large)
        deep = extrapolate(at_small, at_large, small, large, num_layers)
        # a peak phase that switches with depth: replayed whole (a draft keeps the extrapolation, the search's
        # confirming estimate is a full one)
        return deep if not full or same_peak_phase(at_small, at_large, deep) else run(None)

    return _without_gc(extrapolated)


def step_schedule(r: ResolvedSetup, act: ActivationProfile, layers: int | None = None) -> StepSchedule:
    """The step's schedule: PyTorch's, or DeepSpeed's engine under a ds-zero method."""
    cls = DeepSpeedSchedule if r.method.zero_stage is not None else StepSchedule
    return cls(r, act, layers=layers)


def whole_schedule(r: ResolvedSetup, act: ActivationProfile) -> Schedule:
    """The step's whole-depth schedule: deepened from a shallow one's template layer where the model's layers are
    alike and the rule reproduces a deeper build (llmem.estimator.deepen: the same events, about twice as fast at
    80 layers), else built."""
    got = from_template(r, act)
    return got if got is not None else step_schedule(r, act).build()


def whole_schedule_within(r: ResolvedSetup, act: ActivationProfile, stop_above_bytes: int) -> Schedule | None:
    """whole_schedule, or None where its live tensor bytes pass `stop_above_bytes` (events.built_within: built
    only that far)."""
    got = from_template(r, act)
    if got is None:
        return built_within(step_schedule(r, act), stop_above_bytes)
    return got if got.peak_live_bytes <= stop_above_bytes else None


def from_template(r: ResolvedSetup, act: ActivationProfile) -> Schedule | None:
    """The whole-depth schedule deepened from its template layer (llmem.estimator.deepen), or None where it is
    built instead (layers unlike each other, DDP's buckets, too shallow to gain, the check failed)."""
    if r.method.gradient_buckets or not alike_layers(r.anatomy, act):     # (DDP's buckets span the layers)
        return None
    # checked against the draft's deeper schedule: a search has often built it for this set-up already
    return whole_from_template(lambda layers: shallow_schedule(r, act, layers), r.anatomy.num_layers,
                               check_layers=DRAFT_FROM[1])


def shallow_schedule(r: ResolvedSetup, act: ActivationProfile, layers: int) -> Schedule:
    """The step's schedule over its first `layers` decoder layers, kept for the set-ups with the same schedule
    (a draft's depths, a deepening's template and check: llmem.estimator.deepen)."""
    key = (schedule_key(r.setup), r.layout, r.gpu, id(r.base), layers)
    return _SHALLOW.get(r.anatomy, key, lambda: (r.base, step_schedule(r, act, layers).build()))[1]


_SHALLOW: IdentityCache[tuple[object, Schedule]] = IdentityCache(16)


def forget_shallow_schedules() -> None:
    """Drop the kept shallow schedules (a timing of whole_schedule from nothing kept)."""
    _SHALLOW.clear()


def _without_gc(work: Callable[[], T]) -> T:
    """Tens of thousands of short-lived tuples: the cyclic garbage collector only adds pauses to a replay."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return work()
    finally:
        if was_enabled:
            gc.enable()
