"""A shorter sequence: the longest --seq-len (under a generation objective, --max-completion-length) that fits at
each layout's smallest batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from llmem.errors import LlmemError
from llmem.planner.search import PlanContext, attach_time, layout_setup
from llmem.planner.suggestions.fitting import QUICK_SLACK, screened_layouts
from llmem.planner.suggestions.record import suggestion_dict
from llmem.search import calibrated_max, max_batch_size
from llmem.setup.generation import completion_length, prompt_length
from llmem.setup.layout import Layout
from llmem.setup.objectives import objective_spec, setup_batch_multiple
from llmem.setup.training import TrainingSetup
from llmem.units import format_bytes


def _quick_seq_bound(ctx: PlanContext, setup: TrainingSetup, layout: Layout) -> int:
    """An upper bound on the longest length below the set-up's (`sequence_knob`) that `layout` fits at its smallest
    batch (as quick_batch_bound's, over the length); the set-up's length where the bound cannot be computed."""
    _, longest, at = sequence_knob(setup)
    bound = ctx.limit * (1 + QUICK_SLACK)
    unit = setup_batch_multiple(setup, layout.world_size)
    try:
        return max_batch_size(lambda n: ctx.engine.quick(layout_setup(at(n), layout, unit), layout) <= bound,
                              longest - 1)
    except LlmemError:
        return longest


def sequence_knob(setup: TrainingSetup) -> tuple[str, int, Callable[[int], TrainingSetup]]:
    """What "a shorter sequence" shortens: its flag, the set-up's value, and the set-up at a value. --seq-len, or
    under a generation objective --max-completion-length with the prompt kept (GRPO's sequence is prompt +
    completion; llmem.setup.generation)."""
    if not objective_spec(setup.objective).generates:
        return "--seq-len", setup.seq_len, lambda n: replace(setup, seq_len=n)
    prompt, completion = prompt_length(setup), completion_length(setup)
    return ("--max-completion-length", completion,
            lambda n: replace(setup, seq_len=prompt + n, max_completion_length=n))


def shorter_sequence_suggestion(ctx: PlanContext, setup: TrainingSetup, layouts: list[Layout]) -> dict:
    """The longest length (`sequence_knob`) that fits at each layout's smallest batch, searched on the layouts whose
    quick bound at length 1 does not rule them out (full estimates calibrate the quick bound; drafts without it)."""
    engine, limit = ctx.engine, ctx.limit
    flag, longest, at = sequence_knob(setup)
    best_n, best_c = 0, None
    for layout in screened_layouts(ctx, at(1), layouts):
        if best_n and ctx.prune and engine.has_quick and _quick_seq_bound(ctx, setup, layout) <= best_n:
            continue                # its quick bound rules out a longer sequence than the one found
        unit = setup_batch_multiple(setup, layout.world_size)

        def fits_n(n: int, layout=layout, unit=unit) -> bool:
            return engine.draft(layout_setup(at(n), layout, unit), layout).device_used_bytes <= limit

        def used(n: int, layout=layout, unit=unit) -> int:
            return engine.full(layout_setup(at(n), layout, unit), layout).device_used_bytes

        def quick_used(n: int, layout=layout, unit=unit) -> int:
            return engine.quick(layout_setup(at(n), layout, unit), layout)
        try:
            if longest <= 1:
                n = 0
            elif engine.has_quick:
                n = calibrated_max(used, quick_used, limit, longest - 1)
            else:
                n = max_batch_size(fits_n, longest - 1)
        except LlmemError:
            continue
        if n > best_n:
            s = at(n)
            best_n = n
            best_c = ctx.search(s, layout)
            attach_time(ctx, best_c, s)
    what = "the completion" if flag == "--max-completion-length" else "the sequence"
    if best_c is None:
        return suggestion_dict("seq_len", f"a shorter sequence does not help: even {flag} 1 does not fit at the "
                           "smallest batch", None, seq_len=0, flags=flag)
    s = at(best_n)
    return suggestion_dict("seq_len", f"shorten {what}: {flag} {best_n} is the longest that fits at the smallest batch "
                       f"({best_c.layout.label}, {format_bytes(best_c.memory.device_used_bytes)} at batch "
                       f"{best_c.max_batch_size})", best_c, seq_len=s.seq_len, flags=f"{flag} {best_n}",
                       changes={"seq_len": s.seq_len, **({"max_completion_length": best_n}
                                                         if flag != "--seq-len" else {})})
