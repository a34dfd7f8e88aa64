"""Where every layout's step fits but a phase of the job around it (loading, evaluation, saving) does not: that
phase's own remedy, since no step-side change (adapters, activation savers, more GPUs) shrinks it and no batch
changes it."""

from __future__ import annotations

from llmem.planner.search import CandidatePlan
from llmem.planner.suggestions.record import suggestion_dict
from llmem.setup.job_phases import PHASE_FIXES
from llmem.units import format_bytes


def job_phase_suggestion(blocked: list[CandidatePlan]) -> dict:
    """The suggestion for candidates whose step fits and whose job does not (llmem.result.MemoryResult.job_over:
    a phase's tensors alone over what the allocator may use): the phase at its smallest, and its remedy
    (llmem.setup.job_phases.PHASE_FIXES)."""
    c = min(blocked, key=lambda x: x.memory.job_over.device_bytes)
    over = c.memory.job_over
    text = (f"the step fits ({', '.join(x.layout.label for x in blocked)}), but {over.name} ({over.kind}) needs "
            f"{format_bytes(over.device_bytes)} per GPU at the least ({c.layout.label}): {PHASE_FIXES[over.name]}")
    return suggestion_dict("job-phase", text, c)
