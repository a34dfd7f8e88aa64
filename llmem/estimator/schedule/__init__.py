"""The step's allocation schedule (`StepSchedule`, step_schedule.py) and its parts: what it reads (facts.py), what is
live (state.py), the operations its parts and the objectives' events reach it by (hooks.py), FSDP2's units
(units.py), the gradients (gradients.py), the optimizer (optimizer.py), the activation blocks (blocks.py), the
decoder layers (layers.py), the head and the loss (head.py)."""

from llmem.estimator.schedule.blocks import BlockOps, block_plan
from llmem.estimator.schedule.facts import SMALL_TENSOR_BYTES, StepFacts, step_facts
from llmem.estimator.schedule.head import fused_ce_forward
from llmem.estimator.schedule.hooks import StepHooks
from llmem.estimator.schedule.state import StepState
from llmem.estimator.schedule.step_schedule import StepSchedule

__all__ = ["SMALL_TENSOR_BYTES", "BlockOps", "StepFacts", "StepHooks", "StepSchedule", "StepState", "block_plan",
           "fused_ce_forward", "step_facts"]
