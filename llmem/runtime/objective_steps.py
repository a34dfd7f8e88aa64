"""Objective steps on the runtime floor: the trainer step the trace runs for each kind of objective.

The trainer step the trace (and measure) runs for an objective, one row per kind of step
(ObjectiveSpec.step_kind): TRL's preference step (llmem.runtime.objectives), the pairwise losses on full logits or
a scalar head (llmem.runtime.pairwise), GRPO's generation, scoring and training (llmem.runtime.generation),
SFTTrainer's compute_loss (llmem.runtime.fused_sft); each with the notes saying what the run emulates."""

from __future__ import annotations

from collections.abc import Callable

from llmem.runtime.fused_sft import sft_emulation_notes, sft_iteration, sft_run
from llmem.runtime.generation import generation_emulation_notes, generation_iteration, generation_run
from llmem.runtime.objectives import emulation_notes, preference_iteration, preference_run
from llmem.runtime.pairwise import pairwise_emulation_notes, pairwise_iteration, pairwise_run
from llmem.setup.objectives import objective_spec

# step_kind -> (one iteration of the step, the trace's notes)
OBJECTIVE_STEPS: dict[str, tuple[Callable, Callable[..., list[str]]]] = {
    "preference": (preference_iteration, emulation_notes),
    "pairwise": (pairwise_iteration, pairwise_emulation_notes),
    "generation": (generation_iteration, generation_emulation_notes),
    "fused-sft": (sft_iteration, sft_emulation_notes),      # SFTTrainer's compute_loss (llmem.runtime.fused_sft)
}


def objective_iteration(step, it: int) -> None:
    OBJECTIVE_STEPS[objective_spec(step.setup.objective).step_kind][0](step, it)


def objective_trace_notes(setup) -> list[str]:
    return OBJECTIVE_STEPS[objective_spec(setup.objective).step_kind][1](setup)


# step_kind -> what its trainer's __init__ makes before training (the fused heads, the reference, the batch): the
# DeepSpeed trace makes it before deepspeed.initialize, as TRL's trainers do before Trainer.train prepares the model
OBJECTIVE_RUNS: dict[str, Callable] = {"preference": preference_run, "pairwise": pairwise_run,
                                       "generation": generation_run, "fused-sft": sft_run}


def objective_run(step):
    return OBJECTIVE_RUNS[objective_spec(step.setup.objective).step_kind](step)
