"""Search on the planner floor: one layout's largest fitting micro-batch, and the rankings of such plans.

One layout's plan: the largest micro-batch whose device-used memory fits, the memory there, its time; and the
two rankings of such plans (the time model's tokens/s, or LLMem's Algorithm 1)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from llmem.errors import LlmemError
from llmem.memory.capacity import Fit
from llmem.model.anatomy import ModelAnatomy
from llmem.model.peft import trained_anatomy
from llmem.model.resolved import assemble
from llmem.paper.algorithm1 import method_eval
from llmem.planner.engines import MemoryEngine, fits_within, out_of_memory_above
from llmem.planner.options import PlanOptions
from llmem.planner.timing import StepTime, accumulation_for, offload_step_extra_s, step_time
from llmem.result import MemoryResult
from llmem.search import BATCH_CAP, bisect_max, max_batch_size, refine_max
from llmem.setup.gpus import GpuSpec
from llmem.setup.layout import Layout
from llmem.setup.objectives import setup_batch_multiple
from llmem.setup.training import MAX_STEP_TOKENS, TrainingSetup


@dataclass
class CandidatePlan:
    layout: Layout
    max_batch_size: int                  # 0: does not fit even at batch 1
    memory: MemoryResult                 # at max_batch_size (at batch 1 when nothing fits)
    limit_bytes: int
    time: StepTime | None = None         # at the micro-batch the plan would use
    eval: float | None = None            # Algorithm 1's eval (paper ranking)
    offload_optimizer: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        """The step fits at batch 1 or more, and so do the job's loading, evaluation and saving phases (which no
        batch changes)."""
        return self.max_batch_size >= 1 and self.memory.job_over is None

    @property
    def blocked_by(self) -> str:
        """The job phase that runs out of memory where the step fits ("" otherwise)."""
        over = self.memory.job_over
        return over.name if over is not None and self.max_batch_size >= 1 else ""

    @property
    def method(self) -> str:
        return self.layout.method

    def to_dict(self) -> dict:
        t = self.time
        out = {
            "method": self.layout.method, "label": self.layout.label, "dp": self.layout.dp, "tp": self.layout.tp,
            "dp_replicate": self.layout.replicas, "pp": self.layout.pp, "cp": self.layout.cp,
            "ep": self.layout.ep,
            "pp_microbatches": t.pp_microbatches if t else None,
            "nodes": self.layout.nodes, "max_batch_size": self.max_batch_size,
            "batch_size_at_memory": max(self.max_batch_size, 1),
            "peak_reserved_bytes": self.memory.peak_reserved_bytes,
            "capped_reserved_bytes": self.memory.capped_reserved_bytes,
            "oom": self.memory.oom.to_dict() if self.memory.oom else None,
            "device_used_bytes": self.memory.device_used_bytes, "limit_bytes": self.limit_bytes,
            "micro_batch_size": t.micro_batch_size if t else None,
            "accumulation_steps": t.accumulation_steps if t else None,
            "global_batch_size": t.global_batch_size if t else None,
            "step_time_s": t.step_s if t else None, "tokens_per_s": t.tokens_per_s if t else None,
            "time": t.to_dict() if t else None, "fits": self.fits,
        }
        if self.blocked_by:
            out["blocked_by"] = self.memory.job_over.to_dict()
        if self.eval is not None:
            out["eval"] = self.eval
        if self.offload_optimizer:
            out["offload_optimizer"] = True
        return out


def limit_bytes(gpu: GpuSpec, headroom: float) -> int:
    return int(gpu.memory_bytes * (1 - headroom))


def pipeline_microbatches(base: TrainingSetup, layout: Layout) -> int:
    """The schedule's micro-batches per step a pipeline layout is planned with: --pp-microbatches where given,
    else pp (the fewest torch's GPipe and 1F1B accept; more shrink the bubble, which the time model shows); 1
    without pipeline parallelism."""
    if layout.pp <= 1:
        return 1
    return base.pp_microbatches or layout.pp


def layout_setup(base: TrainingSetup, layout: Layout, micro: int) -> TrainingSetup:
    """`base` run with `layout` at micro-batch `micro`: the layout's values written into its parallelism section
    once (TrainingSetup.with_layout); under --pp the step is the schedule's m micro-batches of `micro` samples each
    (batch_size micro x m). The engines are handed the layout itself beside it, never resolving it again."""
    m = pipeline_microbatches(base, layout)
    return base.with_layout(layout, micro * m, m)


# the share of the allocator's capacity a step's allocated peak reaches where it stops fitting is fragmentation's
# (0.88-0.97 for Llama-3.1-405B fsdp x cp at 512 GPUs): a search's first guess aims here. Fixed, not learned from a
# plan's earlier searches: where the fit is not monotone in the batch the answer depends on the guess, and a layout's
# answer must not depend on which layouts were searched before it (benchmarks/plan_scale.py --check-screening)
FIT_SHARE = 0.95


def boundary_guess(allocated: Callable[[int], int], quick: Callable[[int], int], target_bytes: int,
                   cap: int) -> int:
    """A first guess at the largest batch whose allocated peak is within `target_bytes`: the quick bound's (tensor
    bytes at the largest moment, no replay) largest batch within it, then the line through `allocated` (the
    draft's: within 0.2 % of the full estimate's) at batch 1 and there (the allocated peak grows about linearly in
    the batch)."""
    b = max_batch_size(lambda x: quick(x) <= target_bytes, cap)
    if b <= 1:
        return 1
    a1, ab = allocated(1), allocated(b)
    if ab <= a1:
        return b
    return min(cap, max(1, 1 + int((target_bytes - a1) * (b - 1) // (ab - a1))))


def smallest_draft(base: TrainingSetup, layout: Layout, engine: MemoryEngine) -> MemoryResult | None:
    """The draft at `layout`'s smallest micro-batch, whose being out of memory makes a batch search answer 0 (its
    allocated peak is exact, linear in depth, and reserved >= allocated); None for a pipeline, whose search runs full
    estimates only (the draft does not model its stages)."""
    if layout.pp > 1:
        return None
    return engine.draft(layout_setup(base, layout, setup_batch_multiple(base, layout.world_size)), layout)


def search_candidate(base: TrainingSetup, layout: Layout, engine: MemoryEngine, limit: int,
                     cap: int = BATCH_CAP) -> CandidatePlan:
    """Largest micro-batch of `layout` whose device-used memory stays within `limit`, and the memory there.

    With the engine's quick bound the search starts from `boundary_guess` (aimed at FIT_SHARE of the capacity),
    probes with the engine's verdict (the full estimate's fit, for less: one replay at the capacity, none where the
    live tensors alone exceed it) and confirms the answer with the full estimate, so the result is a batch the full estimator fits whose next one it does not: its largest
    fitting batch where the fit is monotone in the batch (fragmentation can make it not: the answer is then a
    fitting batch at or above the first failing one's predecessor).
    """
    # the search runs in units of the objective's micro-batch multiple (KTO's 2): x units = x * unit samples
    unit = setup_batch_multiple(base, layout.world_size)
    cache: dict[int, MemoryResult] = {}

    def run(x: int) -> TrainingSetup:       # the set-up at x units, the engines handed its layout beside it
        return layout_setup(base, layout, x * unit)

    def at(x: int) -> MemoryResult:
        if x not in cache:
            cache[x] = engine.full(run(x), layout)
        return cache[x]

    def fits(x: int) -> bool:
        return fits_within(at(x), limit)

    cap = max(cap // unit, 1)
    # a pipeline's estimate is one replay per stage, which the quick bound and the draft do not model: full only
    if not engine.has_quick or layout.pp > 1:
        best = max_batch_size(fits, cap)
        return CandidatePlan(layout, best * unit, at(max(best, 1)), limit)
    # out of memory for sure: the draft's allocated peak is exact (linear in depth) and reserved >= allocated; its
    # reserved is not (fragmentation extrapolated from shallow replays), so the memory shown is a full estimate
    d1 = smallest_draft(base, layout, engine)
    if not fits_within(d1, limit):      # a draft is out of memory only when its allocated peak is
        return CandidatePlan(layout, 0, at(1), limit)
    context = d1.components.get("cuda_context", 0)
    target = int((limit - context) * FIT_SHARE)
    guess = boundary_guess(lambda x: engine.draft(run(x), layout).peak_allocated_bytes,
                           lambda x: engine.quick(run(x), layout), target, cap)
    best = refine_max(lambda x: engine.fits(run(x), limit, layout), guess, cap)
    while best > 0 and not fits(best):      # the verdict is the full estimate's own: confirmed, not corrected
        best -= 1
    return CandidatePlan(layout, best * unit, at(max(best, 1)), limit)


def frozen_base_trainable_params(setup: TrainingSetup, anatomy: ModelAnatomy) -> int:
    """Trainable parameters when the set-up freezes the base (LoRA and other adapters); 0 for full fine-tuning."""
    trained = trained_anatomy(anatomy, setup)
    return trained.trainable_params if trained.trainable_params < trained.total_params else 0


@dataclass(frozen=True)
class PlanContext:
    """What every search of one plan shares: the base model, the GPU, the plan's options, the memory engine and the
    memory limit (the GPU's less the headroom)."""
    anatomy: ModelAnatomy
    gpu: GpuSpec
    options: PlanOptions
    engine: MemoryEngine
    limit: int
    prune: bool = True      # suggestions skip the layouts a quick bound proves cannot be the fastest (False: all)

    def search(self, setup: TrainingSetup, layout: Layout) -> CandidatePlan:
        return search_candidate(setup, layout, self.engine, self.limit, self.options.batch_cap)

    @property
    def heads(self) -> tuple[int, int]:
        """The (query, key/value) head counts a layout's tp must divide: none under the paper engine, whose 1D TP
        splits weights, not heads."""
        return (0, 0) if self.options.engine == "paper" else (self.anatomy.num_heads, self.anatomy.num_kv_heads)


def timed(ctx: PlanContext, setup: TrainingSetup, layout: Layout, micro: int, steps: int,
          adapter_params: int = 0) -> StepTime:
    """The time model of `setup` under `layout` at `micro` x `steps`."""
    r = assemble(layout_setup(setup, layout, micro), ctx.anatomy, ctx.gpu, layout)
    return step_time(r, micro, steps, mfu=ctx.options.mfu, inter_node_gbps=ctx.options.inter_node_gbps,
                     adapter_params=adapter_params)


def attach_time(ctx: PlanContext, c: CandidatePlan, setup: TrainingSetup, adapter_params: int = 0) -> None:
    """The candidate's step time at the micro-batch and accumulation the plan would use (`adapter_params`: the
    trained adapters, found from the set-up when 0). A --global-batch can make that micro-batch smaller than the
    largest fitting one, and where fragmentation decides the fit a smaller one can run out of memory
    (llmem.memory.capacity's known limitations): then the next larger one that fits, with its accumulation."""
    if not c.fits:
        return
    c.time = time_at_max_batch(ctx, setup, c.layout, c.max_batch_size, adapter_params, c.offload_optimizer)
    micro, unit = c.time.micro_batch_size, setup_batch_multiple(setup, c.layout.world_size)
    if micro >= c.max_batch_size or ctx.engine.fits(layout_setup(setup, c.layout, micro), ctx.limit, c.layout):
        return
    up = next(m for m in range(micro + unit, c.max_batch_size + 1, unit)
              if m == c.max_batch_size or ctx.engine.fits(layout_setup(setup, c.layout, m), ctx.limit, c.layout))
    c.time = time_at_max_batch(ctx, setup, c.layout, up, adapter_params, c.offload_optimizer, at_least=up)
    c.notes.append(f"micro-batch {micro} runs out of memory where {c.max_batch_size} fits (fragmentation: a marginal "
                   f"fit), so {up}, with {c.time.accumulation_steps} accumulation step(s)")


def time_at_max_batch(ctx: PlanContext, setup: TrainingSetup, layout: Layout, max_batch: int,
                      adapter_params: int = 0, offload_optimizer: bool = False, at_least: int = 1) -> StepTime:
    """The step time of `layout` whose largest micro-batch is `max_batch`, at the micro-batch and accumulation the
    plan would use (attach_time's; tokens/s does not fall as `max_batch` grows, so at an upper bound on the
    largest batch it bounds the plan's tokens/s); `at_least`: the smallest micro-batch it may use."""
    options = ctx.options
    adapter_params = adapter_params or frozen_base_trainable_params(setup, ctx.anatomy)
    if setup.optimizer_in_backward:
        # each gradient is consumed by its update during backward: no accumulation, one micro-batch per step
        wanted = -(-options.global_batch // layout.dp) if options.global_batch else max_batch
        micro, steps = min(max_batch, max(wanted, at_least)), 1
    else:   # under --pp each of the dp ranks runs m micro-batches per schedule step
        ranks = layout.dp * pipeline_microbatches(setup, layout)
        micro, steps = accumulation_for(options.global_batch, max_batch, ranks,
                                        setup_batch_multiple(setup, layout.world_size))
        if micro < at_least:     # the fewest steps at that micro-batch
            micro, steps = at_least, max(1, -(-options.global_batch // (at_least * ranks)))
    t = timed(ctx, setup, layout, micro, steps, adapter_params)
    if offload_optimizer:
        extra = offload_step_extra_s(assemble(layout_setup(setup, layout, micro), ctx.anatomy, ctx.gpu, layout))
        t = replace(t, step_s=t.step_s + extra, tokens_per_s=t.tokens_per_step / (t.step_s + extra))
    return t


# a fitting batch's quick bound stays within this share over the limit (it never lay above 1.16x the allocated
# peak: llmem.planner.suggestions.fitting's QUICK_SLACK, the same screen)
QUICK_BOUND_SLACK = 0.25


def screened(layout: Layout) -> bool:
    """A layout the plan searches only where a bound says it could be the fastest: HSDP's, the pipeline's, the
    context- and expert-parallel ones, and across nodes every one (10 to 24 layouts there); the plain dp x tp
    layouts of one node are always searched and shown."""
    return layout.replicas > 1 or layout.pp > 1 or layout.cp > 1 or layout.ep > 1 or layout.nodes > 1


def quick_twin(setup: TrainingSetup, layout: Layout) -> tuple[TrainingSetup, Layout]:
    """The set-up and layout whose quick bound stands for `layout`'s in the screen: under --cp its FSDP twin at
    seq_len / cp (the same shards over dp x cp, the same tokens per rank; the ring's buffers, which the layout's
    own quick bound adds, only add), else itself."""
    if layout.cp <= 1:
        return setup, layout
    return replace(setup, cp=1, seq_len=setup.seq_len // layout.cp), replace(layout, dp=layout.dp * layout.cp, cp=1)


def step_cap(setup: TrainingSetup, layout: Layout, cap: int) -> int:
    """The largest micro-batch up to `cap` whose step (m of them under --pp) stays within MAX_STEP_TOKENS, as
    every set-up must."""
    return max(1, min(cap, MAX_STEP_TOKENS // (setup.seq_len * pipeline_microbatches(setup, layout))))


def batch_upper_bound(ctx: PlanContext, setup: TrainingSetup, layout: Layout,
                      slack: float = QUICK_BOUND_SLACK) -> int:
    """An upper bound on the largest micro-batch `layout` fits, from the quick bound (no allocator replay) within
    the limit and `slack` over it: the layout's own (HSDP's: the same step, its own shards); under --cp its FSDP
    twin's at seq_len / cp (the same shards over dp x cp, the same tokens per rank; the ring's buffers only add);
    under --pp the pipeline's floor's (pipeline_batch_bound). With `slack` 0 or below not a bound but the likely
    answer (the quick bound lies a few per cent under the allocated peak): an order to search in."""
    cap = step_cap(setup, layout, ctx.options.batch_cap)
    if not ctx.engine.has_quick:
        return cap
    if layout.pp > 1:
        return pipeline_batch_bound(ctx, setup, layout, cap)
    twin_setup, twin = quick_twin(setup, layout)
    unit = setup_batch_multiple(setup, layout.world_size)
    bound = ctx.limit * (1 + slack)

    def quick(b: int) -> int:
        return ctx.engine.quick(layout_setup(twin_setup, twin, b * unit), twin)

    cap = max(cap // unit, 1)
    if quick(1) > bound:
        return 0
    # the quick bound grows about linearly in the batch: start from the line through batches 1 and 2, then the
    # exact largest batch within the bound (refine_max probes and bisects from the guess)
    slope = quick(2) - quick(1) if cap > 1 else 0
    guess = cap if slope <= 0 else 1 + int((bound - quick(1)) // slope)
    return unit * refine_max(lambda b: quick(b) <= bound, guess, cap)


def pipeline_batch_bound(ctx: PlanContext, setup: TrainingSetup, layout: Layout, cap: int) -> int:
    """Under --pp, an upper bound on the largest micro-batch (up to `cap`) the layout fits: the largest at which the
    pipeline's memory floor (the engine's pipeline_floor: the first and last stages' schedules built, not
    replayed; it grows with the micro-batch) is within the limit; 0 where batch 1's is not (that stage's allocated
    peak alone is over the capacity, out of memory as the full estimate decides it)."""
    unit = setup_batch_multiple(setup, layout.world_size)

    def within(b: int) -> bool:
        return ctx.engine.pipeline_floor(layout_setup(setup, layout, b * unit), layout) <= ctx.limit

    return unit * refine_max(within, 1, max(cap // unit, 1))


def tokens_per_s_bound(ctx: PlanContext, setup: TrainingSetup, layout: Layout, at_cap: bool = False,
                       slack: float = QUICK_BOUND_SLACK) -> float:
    """An upper bound on `layout`'s tokens/s: the time model at its batch bound (tokens/s does not fall as the
    largest micro-batch grows), or at the batch cap (`at_cap`: no memory bound, a looser and cheaper one); 0 where
    batch 1 is out of the bound, infinite where it cannot be computed. With `slack` 0 or below (batch_upper_bound's)
    the likely tokens/s, not a bound."""
    try:
        bound = (step_cap(setup, layout, ctx.options.batch_cap) if at_cap
                 else batch_upper_bound(ctx, setup, layout, slack))
        if not bound:
            return 0.0
        return time_at_max_batch(ctx, setup, layout, bound).tokens_per_s
    except LlmemError:
        return float("inf")


# verdicts a proof that a layout cannot win (out_of_memory_from) may take before the layout is searched instead
PROOF_PROBES = 3


def smallest_winning_batch(ctx: PlanContext, setup: TrainingSetup, layout: Layout, wins: Callable[[float], bool],
                           top: int) -> int:
    """The smallest micro-batch (in units of the set-up's batch multiple, up to `top` of them, where the layout's
    time model `wins`) at which the time model of `layout` would make it the answer (tokens/s does not fall as the
    largest micro-batch grows: bisection, no estimate)."""
    unit = setup_batch_multiple(setup, layout.world_size)
    return bisect_max(lambda x: not wins(time_at_max_batch(ctx, setup, layout, x * unit).tokens_per_s), 0, top) + 1


def out_of_memory_from(ctx: PlanContext, setup: TrainingSetup, layout: Layout, start: int, top: int,
                       probes: int = PROOF_PROBES) -> bool:
    """Whether no micro-batch from `start` to `top` (in units; above `top` the quick bound rules them out, as
    batch_upper_bound's) fits as the batch search decides it (the engine's verdict, the full estimate's fit): each
    from `start` is out of memory, up to one whose live tensors alone are over the capacity (then every larger one's
    are). The drafts first find where that may be (cheap); False, with no verdict, where that is more than `probes`
    batches away (the layout is then searched)."""
    unit = setup_batch_multiple(setup, layout.world_size)
    span = range(start, min(start + probes, top + 1))

    def at(x: int) -> TrainingSetup:
        return layout_setup(setup, layout, x * unit)

    if span[-1] < top and not any(out_of_memory_above(ctx.engine.draft(at(x), layout)) for x in span):
        return False
    for x in span:
        verdict = ctx.engine.verdict(at(x), ctx.limit, layout)
        if verdict is Fit.OVER_CAPACITY:
            return True
        if verdict is Fit.FITS:     # the search may answer x (or more)
            return False
    return span[-1] == top


def cannot_win(ctx: PlanContext, setup: TrainingSetup, layout: Layout, wins: Callable[[float], bool]) -> bool:
    """Whether `layout` cannot be the answer, proved with a few estimates: no micro-batch at which its time model
    `wins` fits (out_of_memory_from the smallest such, smallest_winning_batch). The batch search answers a batch it
    found to fit, so its tokens/s is then not a winning one. Not tried under --pp (its estimate is one replay per
    stage, which the draft does not model) nor without the engine's quick bound."""
    if layout.pp > 1 or not ctx.engine.has_quick:
        return False
    unit = setup_batch_multiple(setup, layout.world_size)
    try:
        top = batch_upper_bound(ctx, setup, layout) // unit
        if top < 1 or not wins(time_at_max_batch(ctx, setup, layout, top * unit).tokens_per_s):
            return True     # the quick bound's own verdict (tokens_per_s_bound)
        return out_of_memory_from(ctx, setup, layout, smallest_winning_batch(ctx, setup, layout, wins, top), top)
    except LlmemError:
        return False


def rank_by_time(candidates: list[CandidatePlan]) -> CandidatePlan | None:
    """The fitting candidate with the most tokens/s (earlier in the list on ties)."""
    best = None
    for c in candidates:
        if c.fits and c.time is not None and (best is None or c.time.tokens_per_s > best.time.tokens_per_s):
            best = c
    return best


def rank_by_paper(candidates: list[CandidatePlan]) -> CandidatePlan | None:
    """Algorithm 1: argmax eval, ties to CDP > ADP > TP > DP+TP; None (CPU offloading) when every eval is 0."""
    best = None
    for c in sorted(candidates, key=lambda c: c.layout.spec.paper_order):
        if c.eval and (best is None or c.eval > best.eval):
            best = c
    return best


def paper_eval(layout: Layout, batch: int) -> float:
    """Algorithm 1's eval for a layout at its max batch (llmem.paper.algorithm1)."""
    return method_eval(layout.spec.paper_name, batch, layout.world_size, layout.dp)
