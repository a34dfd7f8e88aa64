"""One layout's plan: the largest micro-batch whose device-used memory fits, the memory there, its time; and the
two rankings of such plans (the time model's tokens/s, or LLMem's Algorithm 1)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from llmem.model.anatomy import ModelAnatomy
from llmem.model.peft import trained_anatomy
from llmem.model.resolved import assemble, setup_for
from llmem.paper.algorithm1 import method_eval
from llmem.planner.engines import MemoryEngine
from llmem.planner.options import PlanOptions
from llmem.planner.timing import StepTime, accumulation_for, offload_step_extra_s, step_time
from llmem.result import MemoryResult
from llmem.search import BATCH_CAP, calibrated_max, max_batch_size
from llmem.setup.gpus import GpuSpec
from llmem.setup.layout import Layout
from llmem.setup.objectives import setup_batch_multiple
from llmem.setup.training import TrainingSetup


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
        return self.max_batch_size >= 1

    @property
    def method(self) -> str:
        return self.layout.method

    def to_dict(self) -> dict:
        t = self.time
        out = {
            "method": self.layout.method, "label": self.layout.label, "dp": self.layout.dp, "tp": self.layout.tp,
            "dp_replicate": self.layout.replicas, "nodes": self.layout.nodes, "max_batch_size": self.max_batch_size,
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
        if self.eval is not None:
            out["eval"] = self.eval
        if self.offload_optimizer:
            out["offload_optimizer"] = True
        return out


def limit_bytes(gpu: GpuSpec, headroom: float) -> int:
    return int(gpu.memory_bytes * (1 - headroom))


def fits_within(m: MemoryResult, limit: int) -> bool:
    """Fits in `limit` bytes of device memory: as the allocator decides it where the engine replayed the step at
    that limit (the llmem engine built with it), else device-used memory against the limit (the paper engine)."""
    return m.fits if m.capacity_bytes else m.device_used_bytes <= limit


def search_candidate(base: TrainingSetup, layout: Layout, engine: MemoryEngine, limit: int,
                     cap: int = BATCH_CAP) -> CandidatePlan:
    """Largest micro-batch of `layout` whose device-used memory stays within `limit`, and the memory there.

    With the engine's quick bound (tensor bytes at the largest moment, no allocator replay) the search runs on quick
    values scaled by the full estimate's device-used / quick ratio at batch 1, then the answer is checked and
    stepped with full estimates, so the result is the full estimator's own largest fitting batch.
    """
    # the search runs in units of the objective's micro-batch multiple (KTO's 2): x units = x * unit samples
    unit = setup_batch_multiple(base, layout.world_size)
    cache: dict[int, MemoryResult] = {}

    def at(x: int) -> MemoryResult:
        if x not in cache:
            cache[x] = engine.full(setup_for(base, layout, x * unit))
        return cache[x]

    def fits(x: int) -> bool:
        return fits_within(at(x), limit)

    cap = max(cap // unit, 1)
    if not engine.has_quick:
        best = max_batch_size(fits, cap)
        return CandidatePlan(layout, best * unit, at(max(best, 1)), limit)
    # out of memory for sure: the draft's allocated peak is exact (linear in depth) and reserved >= allocated; its
    # reserved is not (fragmentation extrapolated from shallow replays), so the memory shown is a full estimate
    d1 = engine.draft(setup_for(base, layout, unit))
    if not fits_within(d1, limit):      # a draft is out of memory only when its allocated peak is
        return CandidatePlan(layout, 0, at(1), limit)
    # device_used <= limit is the same decision as `fits` at this limit (llmem.memory.capacity): the numbers
    # calibrate the search, the predicate is the allocator's
    best = calibrated_max(lambda x: at(x).device_used_bytes,
                          lambda x: engine.quick(setup_for(base, layout, x * unit)), limit, cap)
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
    r = assemble(setup_for(setup, layout, micro), ctx.anatomy, ctx.gpu, layout)
    return step_time(r, micro, steps, mfu=ctx.options.mfu, inter_node_gbps=ctx.options.inter_node_gbps,
                     adapter_params=adapter_params)


def attach_time(ctx: PlanContext, c: CandidatePlan, setup: TrainingSetup, adapter_params: int = 0) -> None:
    """The candidate's step time at the micro-batch and accumulation the plan would use (`adapter_params`: the
    trained adapters, found from the set-up when 0)."""
    if c.fits:
        c.time = time_at_max_batch(ctx, setup, c.layout, c.max_batch_size, adapter_params, c.offload_optimizer)


def time_at_max_batch(ctx: PlanContext, setup: TrainingSetup, layout: Layout, max_batch: int,
                      adapter_params: int = 0, offload_optimizer: bool = False) -> StepTime:
    """The step time of `layout` whose largest micro-batch is `max_batch`, at the micro-batch and accumulation the
    plan would use (attach_time's; tokens/s does not fall as `max_batch` grows, so at an upper bound on the
    largest batch it bounds the plan's tokens/s)."""
    options = ctx.options
    adapter_params = adapter_params or frozen_base_trainable_params(setup, ctx.anatomy)
    if setup.optimizer_in_backward:
        # each gradient is consumed by its update during backward: no accumulation, one micro-batch per step
        wanted = -(-options.global_batch // layout.dp) if options.global_batch else max_batch
        micro, steps = min(max_batch, wanted), 1
    else:
        micro, steps = accumulation_for(options.global_batch, max_batch, layout.dp,
                                        setup_batch_multiple(setup, layout.world_size))
    t = timed(ctx, setup, layout, micro, steps, adapter_params)
    if offload_optimizer:
        extra = offload_step_extra_s(assemble(setup_for(setup, layout, micro), ctx.anatomy, ctx.gpu, layout))
        t = replace(t, step_s=t.step_s + extra, tokens_per_s=t.tokens_per_step / (t.step_s + extra))
    return t


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
