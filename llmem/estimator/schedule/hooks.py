"""The operations a step schedule offers to the events written into it: its parts (FSDP2 units, gradients, the
optimizer, layers, head) call them, and so do the objectives' events (llmem.estimator.objectives, .pairwise,
.generation). An engine that runs a step its own way (DeepSpeed's: llmem.estimator.deepspeed; a pipeline stage's:
llmem.estimator.pipeline) overrides them on its StepSchedule subclass, so each part reaches them through here.

Known Limitations: the facts (`StepFacts`) are read whole; only what is live is behind operations.
"""

from __future__ import annotations

from typing import Protocol

from llmem.estimator.events import Schedule
from llmem.estimator.schedule.blocks import BlockEvents
from llmem.estimator.schedule.facts import StepFacts
from llmem.estimator.schedule.state import UnitKey
from llmem.model.anatomy import ParamInfo


class StepHooks(Protocol):
    facts: StepFacts
    sch: Schedule           # the events written so far: alloc, free, mark, phase
    blocks: BlockEvents     # a block's tensors and a quantised base's dequantisation (the no-grad forwards')

    # ------------------------------------------------------------------------------- FSDP2 units (ZeRO-3's)
    def unshard_forward(self, unit_key: UnitKey, unit: list[ParamInfo]) -> None: ...

    def unshard_backward(self, unit_key: UnitKey, unit: list[ParamInfo]) -> None: ...

    def prefetch(self, unit_key: UnitKey, unit: list[ParamInfo]) -> None: ...

    def reshard_unit(self, unit_key: UnitKey) -> None: ...

    def release_forward_gathers(self) -> None:
        """The root's post-forward: the forward's last all-gather output freed."""

    def own_forward(self, key: str) -> None:
        """--shard-embeddings: the embedding's or the lm_head's unit gathered at its pre-forward."""

    def own_post_forward(self, key: str) -> None: ...

    def own_post_backward(self, key: str) -> None: ...

    def reduce_scatter_layer(self, i: int) -> None: ...

    # ------------------------------------------------------------------------------- gradients and the step
    def ensure_workspace(self) -> None:
        """cuBLAS's workspace, at the step's first matmul."""

    def make_grad(self, p: ParamInfo, root_unit: bool = False, low: int | None = None) -> None: ...

    def hand_over_grad(self, p: ParamInfo, key: int) -> None: ...

    def head_backward_params(self) -> list[ParamInfo]: ...

    def flush_steps(self, it: int) -> None: ...

    # ------------------------------------------------------------------------------- TRL's trainers
    def reference_numels(self) -> list[int]: ...

    def reference_fetch(self, where) -> None: ...

    def gather_for_generation(self) -> list[int]: ...

    def release_after_generation(self, keys: list[int]) -> None: ...
