"""A vision-language model's tower under DeepSpeed ZeRO-3 in the step schedule: its parameters fetched and released
around the vision side's learned forward and backward (llmem.estimator.schedule.vision), as stage 3's hooks run them.

DeepSpeed registers its hooks on every sub-module (deepspeed/runtime/zero/parameter_offload.py
_register_hooks_recursively): each module's pre-forward fetches its own parameters (partitioned_param_coordinator.py
fetch_sub_module: iter_params(module, recurse=False), one all-gather buffer a parameter), its post-forward releases
them (release_sub_module), and the same around its backward (pre_sub_module_backward_function /
post_sub_module_backward_function). In the first step the coordinator records its module trace and releases every
module after use; from the second (the trace complete) it prefetches the next modules' parameters up to
stage3_prefetch_bucket_size and keeps a module gathered when it is used again within stage3_max_reuse_distance
elements (__params_to_release).

Here a unit is one piece of the learned vision side (each encoder block, the patch embedding, the merger, the rest of
the tower: llmem.memory.activations.learned_vision), as the text step's unit is a decoder layer
(llmem.estimator.deepspeed): gathered at its first allocation in forward, released at the next piece's (kept when
reused within the reuse distance: a trained tower's blocks, whose backward comes); in backward gathered at its first
allocation and released at the next piece's (next used in the next step). The input embedding, run before the tower
(every VLM's forward embeds the ids, then encodes the images), is released as the tower starts. A frozen tower runs no
backward (its outputs need no gradient: no pre-backward hook fires), so its units are never reused in the step.

Known Limitations: a piece's parameters are gathered together (DeepSpeed gathers a leaf module's at a time: the
peak inside a block is its largest leaf's, here the block's); a piece's events stand for its module's ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmem.estimator.schedule.vision_units import VisionUnits
from llmem.memory.activations.learned_vision import LearnedPiece, Op, VisionStep
from llmem.model.anatomy import ParamInfo
from llmem.model.vision import PEFT_PREFIX, under


def piece_path(vision: VisionStep, piece: LearnedPiece) -> str | None:
    """The module a piece of the vision side runs in (its full path in the model), None for the encoder's own ops."""
    return ".".join(p for p in (vision.root, piece.module) if p) if piece.module else None   # (Llama 4's root: "")


def tower_units(vision: VisionStep, params: list[ParamInfo]) -> dict[str, list[ParamInfo]]:
    """The tower's ZeRO-3 units in forward order: each piece's module with the vision parameters inside it and in no
    more specific piece's module (Gemma 3's vision_tower piece: its embeddings and post-layernorm, not its blocks);
    modules holding none are left out."""
    paths = list(dict.fromkeys(p for p in (piece_path(vision, piece) for piece in vision.side.pieces) if p))
    units: dict[str, list[ParamInfo]] = {path: [] for path in paths}
    for p in params:
        name = p.name.removeprefix(PEFT_PREFIX)
        holders = [path for path in paths if under(name, path)]
        if holders:
            units[max(holders, key=len)].append(p)
    return {path: unit for path, unit in units.items() if unit}


class ZeroVision(VisionUnits):
    """The vision side under DeepSpeed's engine, stages 1-2 (no units): DeepSpeed casts no inputs (engine.forward
    leaves them as given), the model casts the fp32 pixel values to the module's dtype itself as its image features
    begin (Qwen's get_image_features `pixel_values.type(self.visual.dtype)`, SigLIP's patch embedding
    `.to(dtype=target_dtype)`), before the tower's first op. Where the step keeps that cast for the patch
    embedding's weight gradient (the learned model's own kept tensors), it is laid out there, not after the tower
    with the rest of them. `step` is the DeepSpeedSchedule."""

    def __init__(self, step, pieces: tuple[LearnedPiece, ...]) -> None:
        super().__init__(step, step.units, pieces)
        self.ds = step

    def cast_inputs(self) -> None:
        act = self.f.act
        size = act.vision.batch_tensors[1] // 4 * self.ds.mb
        if size in act.embed_tensors:
            self.cast, self.cast_taken = self.step.sch.alloc(size, "activations"), False

    def take_cast(self, size: int, kept: bool) -> int | None:
        """The cast, as the model's own kept tensor of its size (the side's temporaries are its own)."""
        return super().take_cast(size, kept) if kept else None


class ZeroTower(ZeroVision):
    """The tower's ZeRO-3 fetches and releases, called at the vision side's events (VisionUnits' interface)."""

    def __init__(self, step, pieces: tuple[LearnedPiece, ...], units: dict[str, list[ParamInfo]]) -> None:
        super().__init__(step, pieces)
        vision = self.f.act.vision
        self.tower = units
        self.of_piece = [path if path in units else None for path in (piece_path(vision, p) for p in pieces)]
        self.order = list(units)              # forward order
        self.leading = []
        # the units whose backward runs (a frozen part's outputs need no gradient: no pre-backward hook fires)
        self.backward_units = {self.of_piece[j] for op, j, *_ in vision.side.backward
                               if op in (Op.TEMP, Op.GRAD) and j >= 0} - {None}

    # ------------------------------------------------------------------------------------------ forward
    def forward_start(self) -> None:
        """The input embedding's post-forward (it ran before the tower): released unless used again soon."""
        self.ds.release_embedding()

    def forward_piece(self, j: int) -> None:
        """Piece j's forward: its unit gathered (the running one's post-forward first), the later ones prefetched."""
        self.enter_piece(j, self.leave_forward,
                         lambda u: [*self.order[self.order.index(u) + 1:], *self.ds.after_tower()])

    def enter_piece(self, j: int, leave: Callable[[], None], following: Callable[[Any], list]) -> None:
        """The unit of piece j (-1: none) fetched where it is not the running one: `leave` runs the running one's
        post-hook, then the unit is gathered and `following(unit)` (the units after it in this pass) prefetched."""
        u = self.of_piece[j] if j >= 0 else None
        if u is None or u == self.current:
            return
        leave()
        self.ds.gather(u)
        self.ds.prefetch_after(following(u))
        self.current = u

    def leave_forward(self) -> None:
        """The running unit's post-forward: release_sub_module, kept when its backward comes within the reuse
        distance (the later units' forward and backward, the language model's forward and backward, the head)."""
        u, self.current = self.current, None
        if u is None:
            return
        if u not in self.backward_units:
            self.ds.release(u, self.ds.zero.max_reuse_distance)
            return
        later = sum(self.ds.numel_of(v) for v in self.order[self.order.index(u) + 1:])
        self.ds.release(u, 2 * later + self.ds.language_distance())

    # ------------------------------------------------------------------------------------------ backward
    def backward_piece(self, j: int) -> None:
        """Piece j's backward: its unit gathered again, the earlier ones prefetched in reverse."""
        self.enter_piece(j, self.leave_backward,
                         lambda u: [*reversed(self.order[:self.order.index(u)]), *self.ds.before_tower()])

    def leave_backward(self) -> None:
        """The running unit's post-backward: released (its next use is the next step's forward)."""
        u, self.current = self.current, None
        if u is not None:
            self.ds.release(u, self.ds.zero.max_reuse_distance)

    def backward_done(self) -> None:
        """The vision side's backward is done: the input embedding's backward follows (its pre-backward fetch,
        where the tower ran a backward before it; else at decoder layer 0's: llmem.estimator.deepspeed)."""
        self.leave_backward()
        if self.backward_units:
            self.ds.gather_embedding()

    def backward_order(self) -> list[str]:
        """The tower's units in the backward's order (those whose backward runs)."""
        return [u for u in reversed(self.order) if u in self.backward_units]
