"""A vision-language model's vision side, learned from the real code with its decoder layers (llmem.learn reads it
from the same run of the shallow copy, whose vision encoder keeps its full depth): its forward as the allocator saw
it, cut into pieces by module (the patch embedding, the rotary table, each encoder block, the merger, the encoder's
own ops), each piece with the tensors it keeps for backward, and the forward's temporaries between them.

The schedule (llmem.estimator.schedule.vision) plays the forward, then each piece's backward after the language
model's. A vision-language step is learned at its micro-batch's own shape (its encoder attends image by image, so
its tensors' number changes with the batch): every size is in bytes at that shape, kept as plain integers (a large
step's vision side has hundreds of thousands of events, read from the cache at every estimate).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Op(StrEnum):
    """What one event of the vision side does."""
    KEEP = "keep"              # a piece's kept tensor made (forward)
    TEMP = "temp"              # a temporary made
    FREE = "free"              # a temporary freed
    FREE_KEPT = "free_kept"    # a piece's kept tensor freed (backward)
    GRAD = "grad"              # a parameter's gradient made (backward)
    LATE = "late"              # a temporary freed after the token embedding's gradient (backward)
    WORKSPACE = "workspace"    # cuBLAS's workspace made at the step's first matmul (the encoder's first linear)
    HELD = "held"              # a temporary held until the model's forward returns (freed after the decoder layers)


@dataclass(frozen=True)
class LearnedPiece:
    """A stretch of the vision side: the tensors its forward keeps for backward, in allocation order, each with its
    category (an autocast copy of a trained weight is "gathered_weights", the rest "activations"). `module` is its
    path within the vision module ("blocks.3", "merger"; "" for the encoder's own ops)."""
    name: str
    module: str
    tensors: tuple[int, ...]       # bytes, at the learned shape
    categories: tuple[str, ...]

    def to_json(self) -> dict:
        return {"name": self.name, "module": self.module, "tensors": list(self.tensors),
                "categories": list(self.categories)}

    @staticmethod
    def from_json(d: dict) -> LearnedPiece:
        return LearnedPiece(d["name"], d["module"], tuple(int(n) for n in d["tensors"]), tuple(d["categories"]))


# an event: (Op, piece or -1, kept tensor index or temporary's tag, bytes or None, category or parameter name):
# (KEEP, j, k, None, "") | (FREE_KEPT, j, k, None, "") | (TEMP, j, tag, size, category) | (FREE, -1, tag, None, "")
# | (GRAD, j, 0, size, parameter name within the model) | (LATE, -1, tag, None, "") | (WORKSPACE, -1, 0, None, "")
# | (HELD, -1, tag, None, "")
Event = tuple


def _ops_json(ops: tuple[Event, ...]) -> list:
    return [[str(op), j, k, size, label] for op, j, k, size, label in ops]


def _ops_from(rows: list) -> tuple[Event, ...]:
    """The events as JSON holds them (an Op is its string: they compare equal)."""
    return tuple(map(tuple, rows))


@dataclass(frozen=True)
class LearnedVision:
    pieces: tuple[LearnedPiece, ...]
    forward: tuple[Event, ...]
    backward: tuple[Event, ...] = ()      # after the last decoder layer's backward (none: the encoder runs no graph)

    @property
    def forward_peak(self) -> int:
        """The most bytes its forward holds at once (kept tensors, temporaries: those held past it stay), played as
        the schedule plays it."""
        live = peak = 0
        temps: dict[int, int] = {}
        for op, j, k, size, _label in self.forward:
            if op == Op.KEEP:
                live += self.pieces[j].tensors[k]
            elif op == Op.TEMP:
                temps[k] = size
                live += size
            elif op == Op.FREE:
                live -= temps.pop(k)
            peak = max(peak, live)
        return peak

    @property
    def described(self) -> str:
        """Its pieces and backward in words: "patch_embed, 32 encoder blocks, merger and its own ops; its backward
        after the decoder layers'"."""
        names = [p.module.split(".")[0] or "its own ops" for p in self.pieces]
        blocks = sum(1 for p in self.pieces if "." in p.module)
        parts = list(dict.fromkeys(f"{blocks} encoder blocks" if "." in p.module else n
                                   for p, n in zip(self.pieces, names, strict=True)))
        back = ("its backward after the decoder layers'" if self.backward else
                "no backward: nothing in it needs a gradient")
        return f"{', '.join(parts)}; {back}"

    def to_json(self) -> dict:
        return {"sizes": "bytes", "pieces": [p.to_json() for p in self.pieces], "forward": _ops_json(self.forward),
                "backward": _ops_json(self.backward)}

    @staticmethod
    def from_json(d: dict) -> LearnedVision:
        if d.get("sizes") != "bytes":        # an earlier form (fitted polynomials): not read, learned again
            raise ValueError("a vision side cached in an earlier form")
        return LearnedVision(tuple(LearnedPiece.from_json(p) for p in d["pieces"]), _ops_from(d["forward"]),
                             _ops_from(d.get("backward", [])))


@dataclass(frozen=True)
class VisionStep:
    """A vision-language step as the schedule lays it out: the micro-batch's tensors on the device (ids,
    pixel_values, positions: llmem.model.vision_inputs), the vision modules (their parameters' name prefixes: the
    encoder's, the projector's), the vision side learned from the real code (None: not learned) and the tower's
    FSDP2 units."""
    batch_tensors: tuple[int, ...]
    modules: tuple[str, ...]
    side: LearnedVision | None
    root: str = ""                   # the module the side's pieces are named from (llmem.model.vision.vision_root)
    units: tuple[str, ...] = ()      # the tower's FSDP2 units (llmem.model.vision.tower_units), in forward order
    # the module inside each block that is the block's unit (the row's unit_in_block: Idefics3's "self_attn"; "": the
    # block itself)
    unit_in_block: str = ""
    # its backward runs after the token embedding's (the features reach the decoder layers through cross-attention:
    # Llama 3.2 Vision; llmem.learn.points.VisionReading.after_embedding), not before it (a scatter into the
    # embeddings, whose backward runs the vision side's first)
    after_embedding: bool = False

    def unit_of(self, piece: LearnedPiece) -> str | None:
        """The FSDP2 unit a piece runs in (its module is one, or holds one: Idefics3's blocks, whose attention is
        the unit), or None (the root unit's). A unit inside a piece is taken as gathered for the whole piece's
        forward and backward (its pre-forward at the piece's first allocation)."""
        path = ".".join(p for p in (self.root, piece.module) if p)     # (Llama 4's root: the model itself, "")
        if path in self.units:
            return path
        inner = f"{path}.{self.unit_in_block}" if self.unit_in_block and piece.module else ""
        return inner if inner in self.units else None
