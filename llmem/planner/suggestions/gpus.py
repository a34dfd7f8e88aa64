"""More GPUs of the same type: the fewest (a power of two, up to MAX_SUGGESTED_GPUS) on which the set-up fits."""

from __future__ import annotations

from llmem.errors import LlmemError
from llmem.planner.search import CandidatePlan, PlanContext
from llmem.planner.suggestions.fitting import applied, best_fitting
from llmem.planner.suggestions.record import describe_fit, suggestion_dict
from llmem.setup.layout import Layout, candidate_layouts
from llmem.setup.training import TrainingSetup

MAX_SUGGESTED_GPUS = 64


def _fewest_gpus(ctx: PlanContext, setup: TrainingSetup, methods: tuple[str, ...] | None = None
                 ) -> CandidatePlan | None:
    """The fastest fitting plan on the smallest power-of-two GPU count above setup.gpus (up to 64), or None."""
    n = 1
    while n < MAX_SUGGESTED_GPUS:
        n *= 2
        per = setup.gpus_per_node
        if n <= setup.gpus or (per and n > per and n % per):
            continue
        try:
            layouts = candidate_layouts(n, per, *ctx.heads, methods=methods or ctx.options.methods)
        except LlmemError:
            continue
        more = applied(setup, gpus=n)
        best = best_fitting(ctx, more, layouts, closest_wanted=False)[0] if more is not None else None
        if best is not None:
            return best
    return None


def more_gpus_suggestions(ctx: PlanContext, setup: TrainingSetup, layouts: list[Layout]) -> list[dict]:
    """The fewest GPUs of the same type on which the methods that came closest fit ("single" has no multi-GPU
    form: from one GPU, every method is tried); where none does, the same with --grad-ckpt (not under the paper
    engine); where that neither, a note that even MAX_SUGGESTED_GPUS do not fit."""
    gpu = ctx.gpu
    out: list[dict] = []
    methods = tuple(sorted({lay.method for lay in layouts if not lay.spec.one_gpu})) or None
    found = _fewest_gpus(ctx, setup, methods)
    ckpt = applied(setup, grad_ckpt=True)
    if found is None and not setup.grad_ckpt and ctx.options.engine != "paper" and ckpt is not None:
        found = _fewest_gpus(ctx, ckpt, methods)
        if found is not None:
            out.append(suggestion_dict("gpus", f"use {found.layout.world_size} {gpu.name} GPUs with --grad-ckpt: "
                                       + describe_fit(found, [], ctx.limit), found, grad_ckpt=True))
    elif found is not None:
        out.append(suggestion_dict("gpus", f"use {found.layout.world_size} {gpu.name} GPUs: "
                                   + describe_fit(found, [], ctx.limit), found))
    if found is None:
        out.append(suggestion_dict("gpus", f"even {MAX_SUGGESTED_GPUS} {gpu.name} GPUs do not fit this set-up as "
                                   "it is: combine the suggestions above", None))
    return out
