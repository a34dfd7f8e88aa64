"""The estimator's step schedule of a set-up, built, for the tests that read its events."""

from __future__ import annotations

from llmem.estimator.schedule import StepSchedule
from llmem.memory.activations.profile import activation_profile
from llmem.model.resolved import resolve
from llmem.setup.training import TrainingSetup


def built_schedule(setup: TrainingSetup) -> StepSchedule:
    """`setup` resolved and its whole step laid out (the builder: its `sch` holds the events)."""
    r = resolve(setup)
    s = StepSchedule(r, activation_profile(r))
    s.build()
    return s


def phase_events(setup: TrainingSetup, phase: str) -> list[tuple[int, int, int, int, str]]:
    """The schedule's events (sign, key, bytes, stream, component) in `phase` ("it1:weight_sync", ...)."""
    sch = built_schedule(setup).sch
    starts = [*sch.phase_starts, (len(sch.events), "")]
    a, b = next((a, b) for (a, p), (b, _) in zip(starts, starts[1:], strict=False) if p == phase)
    return sch.events[a:b]
