"""Objective steps on the estimator floor: each kind of objective step's events and moments.

The events and moments of an objective's step, one row per kind of step (ObjectiveSpec.step_kind): TRL's
preference step with a reference (llmem.estimator.objectives), the pairwise losses on full logits or a scalar head
(llmem.estimator.pairwise), GRPO's generation, scoring and training (llmem.estimator.generation), SFTTrainer's causal-LM
step with TRL's fused head (llmem.estimator.fused_sft)."""

from __future__ import annotations

from collections.abc import Callable

from llmem.estimator.fused_sft import FusedSftEvents
from llmem.estimator.generation import GenerationEvents, generation_moments
from llmem.estimator.objectives import PreferenceEvents, preference_moments
from llmem.estimator.pairwise import PairwiseEvents, pairwise_moments
from llmem.setup.objectives import objective_spec

# step_kind -> (its events in a StepSchedule, its moments from sft's: (r, act, ms, sft_moments) -> moments)
OBJECTIVE_STEPS: dict[str, tuple[type, Callable]] = {
    "preference": (PreferenceEvents, preference_moments),
    "pairwise": (PairwiseEvents, pairwise_moments),
    "generation": (GenerationEvents, generation_moments),
    # SFTTrainer: sft's step, TRL's fused head for the loss (the preference moments' head, no reference)
    "fused-sft": (FusedSftEvents, preference_moments),
}


def objective_events(s, r):
    """The objective's events for the StepSchedule `s` (None: sft, the schedule's own)."""
    kind = objective_spec(r.setup.objective).step_kind
    return OBJECTIVE_STEPS[kind][0](s, r) if kind in OBJECTIVE_STEPS else None


def objective_moments(r, act, ms, sft_moments) -> list:
    return OBJECTIVE_STEPS[objective_spec(r.setup.objective).step_kind][1](r, act, ms, sft_moments)
