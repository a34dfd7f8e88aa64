"""A vision-language model's tower under FSDP2 in the step schedule: its units (the encoder's blocks, and the modules
its row names before them, Gemma 3's patch embedding: llmem.model.vision.tower_units, as accelerate's auto-wrap
makes them from the model's `_no_split_modules`) gathered and resharded around the vision side's learned forward
and backward (llmem.estimator.schedule.vision), in the order torch's FSDP2 runs their hooks
(torch/distributed/fsdp/_fully_shard/_fsdp_state.py, _fsdp_param_group.py):
- forward: each unit's pre-forward all-gathers it (FSDPParamGroup.pre_forward: unshard, wait_for_unshard) at its
  first allocation, its post-forward reshards it (reshard_after_forward; zero2 keeps it) once another piece runs;
  a leading unit (Gemma 3's SiglipVisionEmbeddings, no piece of its own) is gathered as the tower starts and
  resharded at the first block's pre-forward;
- backward: the post-forward order is [leading units, blocks, decoder layers, root], so decoder layer 0's
  pre-backward prefetches the last block (llmem.estimator.schedule.layers) and each block's pre-backward the one
  before it (FSDPParamGroup._backward_prefetch); a block's post-backward (RegisterPostBackwardFunction on its
  input) reshards it and reduce-scatters its gradients once its backward is done; a unit whose input needs no
  gradient (a leading unit: the pixel values), or that ran no backward (a frozen tower), has its post-backward in
  the root's final callback after the root's (FSDPState._root_post_backward_final_callback, states in module
  order), where a prefetch never waited on dies (finalize_backward).

Known Limitations: a piece's events stand for its module's ops (a block's pre-backward is laid out at its first
allocation in backward, its post-backward at the next piece's); more than one leading unit is entered together; a
unit inside a block (Idefics3 / SmolVLM's attention, VisionStep.unit_of) is gathered for the whole block's forward
and backward, not its attention's alone (its bf16 weights live through the block's MLP too).
"""

from __future__ import annotations

from llmem.estimator.schedule.hooks import StepHooks
from llmem.estimator.schedule.units import FsdpUnits
from llmem.memory.activations.learned_vision import LearnedPiece


class VisionUnits:
    """The tower units' unshard, prefetch, reshard and reduce-scatter events, called at the vision side's events."""

    def __init__(self, step: StepHooks, units: FsdpUnits, pieces: tuple[LearnedPiece, ...]) -> None:
        self.step, self.units, self.f = step, units, step.facts
        vision = self.f.act.vision
        self.order: list[str] = list(self.f.vision_units)          # the post-forward order
        self.of_piece = [vision.unit_of(p) for p in pieces] if self.order else [None] * len(pieces)
        self.leading = [u for u in self.order if u not in self.of_piece]
        self.current: str | None = None      # the unit whose forward or backward runs
        self.reduced: set[str] = set()       # units whose post-backward ran in the backward
        self.cast, self.cast_taken = -1, False     # the root's cast of the pixel values (cast_inputs)

    def params(self, unit: str) -> list:
        return self.f.vision_units[unit]

    # ------------------------------------------------------------------------------------------ forward
    def forward_start(self) -> None:
        """The tower's forward begins: its leading units' pre-forward."""
        for u in self.leading:
            self.enter_forward(u)

    def forward_piece(self, j: int) -> None:
        """An allocation of piece j in the forward: a new unit's pre-forward, after the running one's
        post-forward (a leading unit stays gathered until the next unit's pre-forward)."""
        if not self.order or j < 0:
            return
        u = self.of_piece[j]
        if u == self.current or u is None and self.current in self.leading:
            return
        self.leave_forward()
        if u is not None:
            self.enter_forward(u)

    def enter_forward(self, u: str) -> None:
        self.leave_forward()
        self.step.unshard_forward(u, self.params(u))
        self.current = u

    def leave_forward(self) -> None:
        """The running unit's post-forward: resharded (zero2: kept gathered until its backward)."""
        if self.current is not None and self.f.reshard:
            self.step.reshard_unit(self.current)
        self.current = None

    # ------------------------------------------------------------------------------------------ backward
    def backward_piece(self, j: int) -> None:
        """An allocation of piece j in the backward: the running block's post-backward where another piece runs,
        a new unit's pre-backward (and its prefetch of the unit before it); a leading unit's once the first
        block's backward is done."""
        if not self.order or j < 0:      # (the model's own ops: the scatter's backward)
            return
        u = self.of_piece[j]
        if u == self.current or u in self.reduced or u is None and self.current in self.leading:
            return
        self.leave_backward()
        if u is not None:
            self.enter_backward(u)
        elif self.leading and self.order[len(self.leading)] in self.reduced:
            for lead in reversed(self.leading):
                self.enter_backward(lead)

    def enter_backward(self, u: str) -> None:
        self.step.unshard_backward(u, self.params(u))
        i = self.order.index(u)
        if i > 0:
            prev = self.order[i - 1]
            self.step.prefetch(prev, self.params(prev))
        self.current = u

    def leave_backward(self) -> None:
        """A block's post-backward: reshard and reduce-scatter (a leading unit's waits for the final callback)."""
        u, self.current = self.current, None
        if u is not None and u not in self.leading:
            self.units.unit_post_backward(u, self.params(u))
            self.reduced.add(u)

    def backward_done(self) -> None:
        """The vision side's backward is done (FSDP2: its units' post-backward waits for the root's callback)."""

    def final_callback(self) -> None:
        """After the root's post-backward: each unit whose post-backward did not run (a leading unit, a unit
        without backward), in module order: resharded, a never-waited prefetch freed, its gradients reduced."""
        self.leave_backward()
        for u in self.order:
            if u not in self.reduced:
                self.units.unit_post_backward(u, self.params(u))
        self.step.sch.free_all(self.units.live.pending_rs)
        self.reduced = set()

    # ------------------------------------------------------------------------------------------ the root's cast
    def cast_inputs(self) -> None:
        """MixedPrecisionPolicy's cast_forward_inputs at the root's pre-forward, before its all-gather
        (FSDPState._pre_forward: _cast_forward_inputs, then FSDPParamGroup.pre_forward): the batch's fp32
        pixel_values cast to param_dtype. The model's own cast of them (Qwen's get_image_features
        `pixel_values.type(self.visual.dtype)`, SigLIP's patch embedding `.to(dtype=target_dtype)`) then makes
        nothing: where the learned step has it (the side's forward, or the model's own kept tensors when the patch
        embedding saves it for its weight's gradient), it is this tensor (take_cast)."""
        f, vision = self.f, self.f.act.vision
        if f.fsdp and f.setup.mixed and vision is not None:
            self.cast = self.step.sch.alloc(vision.batch_tensors[1] // 4 * f.gather_bytes, "activations")
            self.cast_taken = False

    def take_cast(self, size: int, kept: bool) -> int | None:
        """The root's cast when the learned step's allocation of `size` bytes is the model's own cast of the
        pixel values (its first of that size), else None; `kept`: the step keeps it for backward (and frees it)."""
        if self.cast < 0 or self.cast_taken or size != self.step.sch.size_of(self.cast):
            return None
        self.cast_taken = True
        cast = self.cast
        if kept:
            self.cast = -1                   # a kept tensor of the step from now on
        return cast

    def release_cast(self) -> None:
        """The cast dies as the model's forward returns (unless the step keeps it)."""
        self.step.sch.free(self.cast)
        self.cast = -1
