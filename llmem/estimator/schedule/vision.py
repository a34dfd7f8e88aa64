"""A vision-language model's vision side in the step schedule: the micro-batch's tensors (token ids, pixel_values,
the 3-D positions), the vision encoder's and merger's forward, and their backward after the language model's
(transformers' Qwen2.5-VL: the image features are scattered into the token embeddings, so autograd reaches the merger
and the encoder blocks once every decoder layer's backward is done, and the token embedding's gradient last).

The forward and backward are the learned ones (llmem.memory.activations.learned_vision: the real code's, read per
module): each piece's kept tensors with the temporaries between them, and under --grad-ckpt the encoder's blocks as
checkpointing runs them (learned checkpointed: each keeps its input, its backward recomputes it first).

Under FSDP2 the tower's units are gathered and reduced around these events (llmem.estimator.schedule.vision_units).

Known Limitations: learned on one GPU (FSDP2's casts of each unit's inputs to param_dtype are not laid out); learned at the set-up's own shape (a new
batch size or image size learns again).
"""

from __future__ import annotations

from llmem.estimator.schedule.hooks import StepHooks
from llmem.estimator.schedule.units import FsdpUnits
from llmem.estimator.schedule.vision_units import VisionUnits
from llmem.memory.activations.learned_vision import LearnedPiece, Op
from llmem.model.anatomy import ParamInfo
from llmem.model.vision import PEFT_PREFIX


class VisionEvents:
    """The batch's tensors, and the vision side's forward and backward."""

    def __init__(self, step: StepHooks, units: FsdpUnits) -> None:
        self.step, self.f, self.sch = step, step.facts, step.sch
        self.vision = self.f.act.vision
        self.side = self.vision.side if self.vision is not None else None
        self.pieces: tuple[LearnedPiece, ...] = self.side.pieces if self.side is not None else ()
        self.kept: list[list[int]] = []       # each piece's kept tensors' keys (by index)
        self.held: list[int] = []             # the forward's temporaries held until the model's forward returns
        # the parameters the backward makes gradients for, by their name in the model (peft's prefix dropped)
        self.params: dict[str, ParamInfo] = {p.name.removeprefix(PEFT_PREFIX): p for p in self.f.root
                                             if p.name in self.f.vision_params}
        self.units = VisionUnits(step, units, self.pieces)     # FSDP2's tower units (none without FSDP2)

    @property
    def after_embedding(self) -> bool:
        """Its backward runs after the token embedding's (Llama 3.2 Vision's cross-attention: VisionStep)."""
        return self.vision is not None and self.vision.after_embedding

    @property
    def has_backward(self) -> bool:
        """The vision side runs a backward: its script holds the scatter's (the embeddings' gradient included)."""
        return self.side is not None and bool(self.side.backward)

    def batch(self) -> None:
        """The collated micro-batch on the device, before the step: ids, pixel_values, positions (kept by the
        training loop until the next batch replaces them)."""
        for n in self.vision.batch_tensors if self.vision is not None else ():
            self.sch.alloc(n, "activations")

    def forward(self) -> None:
        """The learned forward: each piece's kept tensors with the temporaries between them."""
        if self.side is None:
            return
        sch = self.sch
        sch.mark("vision encoder")
        self.kept = [[] for _ in self.pieces]
        temps: dict[int, int] = {}
        self.units.forward_start()
        for op, j, k, size, label in self.side.forward:
            if op in (Op.KEEP, Op.TEMP):
                self.units.forward_piece(j)
            if op == Op.KEEP:
                piece = self.pieces[j]
                cast = self.units.take_cast(piece.tensors[k], kept=True)
                self.kept[j].append(cast if cast is not None else sch.alloc(piece.tensors[k], piece.categories[k]))
            elif op == Op.TEMP:
                cast = self.units.take_cast(size, kept=False)      # (the root's cast lives on: nothing to free here)
                temps[k] = -1 if cast is not None else sch.alloc(size, label)
            elif op == Op.WORKSPACE:
                self.step.ensure_workspace()
            elif op == Op.HELD:
                self.held.append(temps.pop(k))
            else:
                sch.free(temps.pop(k))
        sch.free_all(list(temps.values()))
        self.units.leave_forward()

    def forward_returned(self) -> None:
        """The model's forward has returned and its output is dropped: the temporaries held past the decoder layers
        (the image features its output keeps, the scatter's source) go."""
        self.sch.free_all(self.held)

    def backward(self, it: int) -> list[int]:
        """The learned backward after the last decoder layer's: the scatter's, the merger's and the blocks' (with a
        checkpointed block's recompute among them), each parameter's gradient as it comes. Returns what is freed
        after the token embedding's gradient."""
        if not self.has_backward:
            return []
        sch = self.sch
        sch.mark("vision encoder")
        temps: dict[int, int] = {}
        late: list[int] = []
        made: set[str] = set()
        for op, j, k, size, label in self.side.backward:
            if op in (Op.TEMP, Op.GRAD):
                self.units.backward_piece(j)
            if op == Op.TEMP:
                temps[k] = sch.alloc(size, label)
            elif op == Op.FREE:
                sch.free(temps.pop(k))
            elif op == Op.FREE_KEPT:
                sch.free(self.kept[j][k])
                self.kept[j][k] = -1
            elif op == Op.GRAD:
                self.step.flush_steps(it)
                self.step.hand_over_grad(self.params[label], sch.alloc(size, "gradients"))
                made.add(label)
            elif op == Op.LATE:
                late.append(temps.pop(k))
        self.units.leave_backward()
        self.units.backward_done()
        self._unread_grads(made, it)
        for keys in self.kept:               # what the backward never read (the encoder's own index tensors)
            sch.free_all(keys)
        sch.free_all(list(temps.values()))
        self.kept = []
        self.step.flush_steps(it)
        return late

    def _unread_grads(self, made: set[str], it: int) -> None:
        """The trained vision parameters whose gradient the copy's backward never made, made at its end: Qwen3-VL's
        deepstack mergers past the copy's decoder layers (each feeds layer k; the copy has LEARN_DEPTH, so the rest
        of its features reach no loss there), as the optimizer will step them. Their kept activations the copy
        frees in its forward (a few [visual tokens, 4 x vision width] tensors each) are not laid out."""
        f = self.f
        for name, p in self.params.items():
            if p.trainable and name not in made:
                self.step.flush_steps(it)
                # FSDP2: the unsharded gradient in param_dtype, for the root's reduce-scatter (Gradients.make_unsharded)
                size = f.params.unsharded[p.name] * f.gather_bytes if f.fsdp else \
                    f.params.shard_numel[p.name] * f.params.element_bytes[p.name]
                self.step.hand_over_grad(p, self.sch.alloc(size, "gradients"))
