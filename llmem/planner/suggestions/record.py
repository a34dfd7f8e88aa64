"""A suggestion as the plan reports it: its dict (the plan's JSON), its words, and its time per token against the
set-up as given."""

from __future__ import annotations

from llmem.errors import LlmemError
from llmem.planner.search import CandidatePlan, PlanContext, frozen_base_trainable_params, layout_setup, timed
from llmem.setup.training import TrainingSetup
from llmem.units import format_bytes


def suggestion_dict(kind: str, text: str, c: CandidatePlan | None, **extra) -> dict:
    """One suggestion as the plan's JSON has it: its kind and words, whether it fits, the plan it points at (layout,
    largest batch, memory, time) where there is one, and `extra` fields."""
    out = {"kind": kind, "text": text, "fits": bool(c and c.fits)}
    if c is not None:
        out.update({"method": c.layout.method, "label": c.layout.label, "dp": c.layout.dp, "tp": c.layout.tp,
                    "replicas": c.layout.replicas, "gpus": c.layout.world_size, "max_batch_size": c.max_batch_size,
                    "peak_reserved_bytes": c.memory.peak_reserved_bytes,
                    "device_used_bytes": c.memory.device_used_bytes,
                    "step_time_s": c.time.step_s if c.time else None,
                    "tokens_per_s": c.time.tokens_per_s if c.time else None})
    out.update(extra)
    return out


def closest_plan(plans: list[CandidatePlan]) -> CandidatePlan | None:
    """The plan that needs the least device memory (the nearest to fitting); None for none."""
    return min(plans, key=lambda c: c.memory.device_used_bytes, default=None)


def describe_fit(c: CandidatePlan | None, plans: list[CandidatePlan], limit: int) -> str:
    """`c`'s largest batch, memory and tokens/s in words; without one, how far the closest of `plans` is from
    `limit`."""
    if c is not None:
        t = f", {c.time.tokens_per_s:,.0f} tokens/s" if c.time else ""
        return (f"{c.layout.label} fits up to batch {c.max_batch_size} "
                f"({format_bytes(c.memory.device_used_bytes)} at that batch{t})")
    closest = closest_plan(plans)
    if closest is None:
        return "no layout could be estimated"
    return (f"still does not fit: best {closest.layout.label} needs "
            f"{format_bytes(closest.memory.device_used_bytes)} at batch {_smallest_batch(closest)} (limit "
            f"{format_bytes(limit)})")


def _smallest_batch(c: CandidatePlan) -> int:
    """The batch a plan that does not fit shows its memory at: its smallest (GRPO's num_generations multiple)."""
    setup = c.memory.setup.setup if c.memory.setup is not None else None
    return setup.batch_size if setup is not None else 1


def time_cost_pct(ctx: PlanContext, c: CandidatePlan | None, base: TrainingSetup) -> float | None:
    """Time per token of a suggestion against the set-up as given, at the same layout and micro-batch (the
    given set-up's time is modelled even though it does not fit): + is slower, - faster."""
    if c is None or not c.fits or c.time is None:
        return None
    micro = c.time.micro_batch_size
    try:
        ref = timed(ctx, base, c.layout, micro, c.time.accumulation_steps,
                    frozen_base_trainable_params(layout_setup(base, c.layout, micro), ctx.anatomy))
    except LlmemError:      # the set-up as given cannot run that micro-batch (GRPO's num_generations multiple)
        return None
    return 100.0 * (ref.tokens_per_s / c.time.tokens_per_s - 1.0)
