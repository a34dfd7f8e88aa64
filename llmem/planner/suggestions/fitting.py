"""A what-if searched: the layouts that can run it (the support check), screened by the engine's quick bound, then
batch-searched with full estimates for the fastest that fits; the bounds that let a search skip a layout that
cannot change the answer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from llmem.errors import LlmemError
from llmem.model.vision_inputs import unwired_options
from llmem.planner.engines import fits_within
from llmem.planner.search import (
    CandidatePlan,
    PlanContext,
    attach_time,
    cannot_win,
    layout_setup,
    rank_by_time,
    smallest_draft,
    time_at_max_batch,
)
from llmem.search import max_batch_size
from llmem.setup.layout import Layout, candidate_layouts
from llmem.setup.methods import MethodSpec
from llmem.setup.objectives import setup_batch_multiple
from llmem.setup.support import check_support
from llmem.setup.training import TrainingSetup

# Each what-if is searched on every layout that can run it, screened by the engine's quick bound at batch 1 (tensor
# bytes at the step's largest moment, ~1 ms): a layout whose bound exceeds the limit by more than QUICK_SLACK is
# not batch-searched (the bound lay within 0.98-1.16x of the allocated peak on the sweeps, and the allocated peak
# never exceeds what the step needs); the CLOSEST_LAYOUTS with the lowest bound are always searched, so a what-if
# that fits nowhere is reported against full estimates of its nearest layouts.
QUICK_SLACK = 0.25
CLOSEST_LAYOUTS = 3


def plan_layouts(ctx: PlanContext, gpus: int, per_node: int | None) -> list[Layout]:
    """Every layout the plan may use on `gpus` GPUs (the plan's --method / --tp restrictions kept)."""
    return candidate_layouts(gpus, per_node, *ctx.heads, methods=ctx.options.methods, tp=ctx.options.tp)


def supports(setup: TrainingSetup | None, method: MethodSpec) -> bool:
    """Whether `method` may run `setup`: the set-up's own validation with that method (its objective's refusals:
    GRPO's methods, its options) and the support check (llmem.setup.support, the engines' own). None (a what-if
    the validation refused: `applied`) is never supported."""
    if setup is None:
        return False
    gpus = 1 if method.one_gpu else setup.gpus
    try:
        s = replace(setup, method=method.name, gpus=gpus, batch_size=setup_batch_multiple(setup, gpus))
        check_support(s, method)
    except LlmemError:
        return False
    return True


def applied(setup: TrainingSetup, **changes) -> TrainingSetup | None:
    """`setup` with `changes`, or None where its validation refuses them (an option its objective does not take,
    e.g. --fused-ce under GRPO) or a vision-language step does not wire them (vision_refusal): the what-if is then
    not proposed."""
    try:
        changed = replace(setup, **changes)
    except LlmemError:
        return None
    return None if vision_refusal(changed) else changed


def vision_refusal(setup: TrainingSetup | None) -> str | None:
    """Why a vision-language set-up's options are not modelled (llmem.model.vision_inputs.unwired_options, for any
    layout); None for a text set-up or one that runs."""
    if setup is None or not setup.images_per_sample:
        return None
    return unwired_options(setup, any_method=True)


def screened_layouts(ctx: PlanContext, setup: TrainingSetup, layouts: list[Layout],
                     closest: int = CLOSEST_LAYOUTS) -> list[Layout]:
    """The layouts worth a full batch search for `setup`: those whose method supports it and whose quick bound at
    batch 1 does not rule them out, and at least the `closest` nearest by that bound; in the given order."""
    runnable = [lay for lay in layouts if supports(setup, lay.spec)]
    if not ctx.engine.has_quick:
        return runnable
    scored: list[tuple[int, int, Layout]] = []
    for i, lay in enumerate(runnable):
        try:
            unit = setup_batch_multiple(setup, lay.world_size)
            scored.append((ctx.engine.quick(layout_setup(setup, lay, unit), lay), i, lay))
        except LlmemError:          # the model refuses it (e.g. no tensor-parallel plan): not a layout for it
            continue
    scored.sort(key=lambda x: (x[0], x[1]))
    bound = ctx.limit * (1 + QUICK_SLACK)
    keep = {i for k, (q, i, _) in enumerate(scored) if q <= bound or k < closest}
    return [lay for i, lay in enumerate(runnable) if i in keep]


def best_fitting(ctx: PlanContext, setup: TrainingSetup, layouts: list[Layout], adapter_params: int = 0,
                 offload: bool = False, closest: int = CLOSEST_LAYOUTS, *, closest_wanted: bool = True
                 ) -> tuple[CandidatePlan | None, list[CandidatePlan]]:
    """The fastest fitting plan of `setup` over every layout in `layouts` that can run it (screened by the quick
    bound, then batch-searched with full estimates), and the plans searched. With ctx.prune, a layout is not
    searched once a bound proves it cannot change the answer: its tokens/s at its quick batch bound is below the
    fastest found, or (nothing fitting yet) its draft is out of memory and needs more than the nearest searched;
    the answer and the closest plan are those of searching every screened layout. A layout whose draft is out of
    memory at its smallest batch (the batch search's own verdict: it fits none) is not estimated once one fits,
    nor at all where the caller reads only the answer (`closest_wanted` False): the plans then lack it."""
    screened = screened_layouts(ctx, setup, layouts, closest)
    pruning = ctx.prune and ctx.engine.has_quick
    ordered = pruning and len(screened) > 1
    uppers = {i: _tokens_per_s_bound(ctx, setup, lay, adapter_params, offload) if ordered else float("inf")
              for i, lay in enumerate(screened)}
    found: dict[int, CandidatePlan] = {}
    best: CandidatePlan | None = None
    best_at = -1                     # its place among the screened layouts
    nearest = float("inf")
    # the likely fastest first, so the rest are soon ruled out; then those out of memory, nearest first: by the
    # bound, then (each bound's layouts, drafted only when one of them may be searched) by the draft's floor
    for upper in sorted(set(uppers.values()), reverse=True):
        if best is not None and upper < best.time.tokens_per_s:
            continue                 # their tokens/s at their quick batch bound already falls short: none can win
        group = [(i, lay) for i, lay in enumerate(screened) if uppers[i] == upper]
        floors = {i: _out_of_memory_floor(ctx, setup, lay) if ordered else None for i, lay in group}
        group.sort(key=lambda x: floors[x[0]] if floors[x[0]] is not None else -1.0)
        for i, layout in group:
            if best is not None and upper < best.time.tokens_per_s:
                continue
            if best is None and floors[i] is not None and floors[i] > nearest:
                continue             # out of memory, and needs more than the nearest one searched: not the closest
            if pruning and (best is not None or not closest_wanted) and _out_at_smallest(ctx, setup, layout):
                continue             # fits no batch: neither the answer nor, with one found (or unasked), the closest
            if pruning and best is not None and not (offload or adapter_params) and cannot_win(
                    ctx, setup, layout, _beats(best, i < best_at)):
                continue             # every batch at which it would be the answer is out of memory (a few estimates)
            try:
                c = ctx.search(setup, layout)
            except LlmemError:
                continue
            c.offload_optimizer = offload
            attach_time(ctx, c, setup, adapter_params)
            found[i] = c
            nearest = min(nearest, c.memory.device_used_bytes)
            if c.fits and c.time is not None and (best is None or c.time.tokens_per_s > best.time.tokens_per_s
                                                  or c.time.tokens_per_s == best.time.tokens_per_s and i < best_at):
                best, best_at = c, i
    plans = [found[i] for i in sorted(found)]       # in the layouts' order: rank_by_time breaks ties by it
    return rank_by_time(plans), plans


def _beats(best: CandidatePlan, earlier: bool) -> Callable[[float], bool]:
    """Whether a layout at these tokens/s would be the answer instead of `best` (rank_by_time: more tokens/s, or as
    many and earlier in the layouts' order)."""
    return lambda tps: tps > best.time.tokens_per_s or (earlier and tps == best.time.tokens_per_s)


def _out_at_smallest(ctx: PlanContext, setup: TrainingSetup, layout: Layout) -> bool:
    """Whether the batch search of `layout` answers 0 from its draft alone (search_candidate: the draft at the
    smallest batch out of memory, which it is only when its exact allocated peak is); False where the search
    decides otherwise (a pipeline) or the draft cannot be made."""
    try:
        d = smallest_draft(setup, layout, ctx.engine)
    except LlmemError:
        return False
    return d is not None and not fits_within(d, ctx.limit)


def _out_of_memory_floor(ctx: PlanContext, setup: TrainingSetup, layout: Layout) -> float | None:
    """A lower bound on the full estimate's device-used memory at batch 1 where the draft proves it out of memory
    (its allocated peak is exact and over the capacity): the draft's device-used with its reserved peak replaced by
    that allocated peak (the full estimate's reserved is never below its allocated: llmem.estimator.events
    extrapolate); None where the draft does not rule batch 1 out (or cannot be made)."""
    try:
        d = ctx.engine.draft(layout_setup(setup, layout, setup_batch_multiple(setup, layout.world_size)), layout)
    except LlmemError:
        return None
    if fits_within(d, ctx.limit) or d.capped_reserved_bytes is not None:
        return None
    return d.device_used_bytes - d.peak_reserved_bytes + d.peak_allocated_bytes


def _tokens_per_s_bound(ctx: PlanContext, setup: TrainingSetup, layout: Layout, adapter_params: int,
                        offload: bool) -> float:
    """An upper bound on the tokens/s `layout` can reach for `setup`: the time model at its quick batch bound
    (tokens/s does not fall as the largest micro-batch grows); 0 where even batch 1 is out of the bound, infinite
    where the bound cannot be computed (then it is searched)."""
    try:
        bound = quick_batch_bound(ctx, setup, layout)
        if not bound:
            return 0.0
        return time_at_max_batch(ctx, setup, layout, bound, adapter_params, offload).tokens_per_s
    except LlmemError:
        return float("inf")


def quick_batch_bound(ctx: PlanContext, setup: TrainingSetup, layout: Layout) -> int:
    """An upper bound on the micro-batch `layout` fits: the largest whose quick bound stays within the screening
    slack (the bound never lay above 1.16x the allocated peak, and a batch that fits keeps that within the
    limit)."""
    bound = ctx.limit * (1 + QUICK_SLACK)
    return max_batch_size(lambda b: ctx.engine.quick(layout_setup(setup, layout, b), layout) <= bound,
                          ctx.options.batch_cap)
