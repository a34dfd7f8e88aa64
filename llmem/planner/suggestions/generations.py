"""Fewer generations: under a generation objective, the largest --num-generations below the set-up's whose
smallest per-GPU batch fits."""

from __future__ import annotations

from llmem.planner.search import CandidatePlan, PlanContext
from llmem.planner.suggestions.fitting import applied, best_fitting
from llmem.planner.suggestions.record import closest_plan, describe_fit, suggestion_dict
from llmem.setup.generation import num_generations
from llmem.setup.layout import Layout
from llmem.setup.objectives import batch_multiple, fixed_steps_per_generation, setup_batch_multiple
from llmem.setup.training import TrainingSetup


def generations_suggestion(ctx: PlanContext, setup: TrainingSetup, layouts: list[Layout]) -> dict | None:
    """The largest --num-generations below the set-up's whose smallest per-GPU batch fits: GRPOConfig needs the
    global batch a multiple of num_generations, so each GPU runs at least num_generations / gcd(num_generations,
    GPUs) completions (llmem.setup.objectives.batch_multiple); a count whose smallest batch is no smaller than one
    already found not to fit is not searched. None when the set-up's own smallest batch is 1 on every layout
    (fewer generations cannot make the step smaller)."""
    g = num_generations(setup)
    units = {lay.label: setup_batch_multiple(setup, lay.world_size) for lay in layouts}
    if max(units.values(), default=1) == 1:
        return None
    failed_unit = min(units.values())           # the set-up's own smallest batch does not fit (nothing does)
    closest: list[CandidatePlan] = []
    for fewer in range(g - 1, 1, -1):
        steps = fixed_steps_per_generation(setup)
        s = applied(setup, num_generations=fewer, batch_size=batch_multiple(setup.objective, setup.gpus, fewer, steps))
        if s is None:
            continue
        unit = min(setup_batch_multiple(s, lay.world_size) for lay in layouts)
        if unit >= failed_unit:
            continue
        best, plans = best_fitting(ctx, s, layouts)
        if best is not None:
            return suggestion_dict("num_generations", f"--num-generations {fewer} (the largest below {g} whose "
                               f"smallest batch fits; each GPU runs at least {unit} completion(s)): "
                               + describe_fit(best, plans, ctx.limit), best, flags=f"--num-generations {fewer}",
                               changes={"num_generations": fewer, "batch_size": s.batch_size})
        failed_unit, closest = unit, plans or closest
    return suggestion_dict("num_generations", "fewer --num-generations do not help: no smaller count fits at its smallest "
                       "batch — " + describe_fit(None, closest, ctx.limit), closest_plan(closest),
                       flags="--num-generations")
