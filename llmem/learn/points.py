"""Where the copy is read: its depth and the layer read, the batch x sequence POINTS, one point's Reading of the
step, and a size's exact coefficients (Exact)."""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from llmem.errors import LlmemError
from llmem.model.vision import under
from llmem.runtime.ledger import PHASE_CODES

LEARN_DEPTH = 2          # decoder layers of the copy: layer 1 has a layer before it (its input) and the head after
READ_LAYER = 1
S0 = 64                  # tokens per sample at the first point (fake tensors: the cost does not depend on it)
# batch >= 2: at one sample some models take other paths (Mamba's mixer: a transpose that needs no copy)
POINTS = ((2, S0), (3, S0), (2, 2 * S0), (3, 2 * S0), (4, 3 * S0))
FORWARD, BACKWARD = PHASE_CODES["forward"], PHASE_CODES["backward"]
KEPT_CATEGORIES = ("activations", "logits_and_loss")


Exact = tuple[Fraction, ...]     # a size's coefficients in TERMS, exact while the layer is read


class LearnError(LlmemError):
    """The real code could not be run or read on the copy: the message says why."""


@dataclass
class Reading:
    """One point's step as the ledger saw it (iteration 0), and the copy's layer structure."""
    events: list[tuple[bool, int, int, int, str, str]]  # (is_alloc, key, bytes, phase, category, module path)
    layers_path: str                                     # e.g. "base_model.model.model.layers"
    units: tuple[str, ...]                               # parameter-owning modules of a layer, relative to it
    casts: dict[str, tuple[int, ...]]                    # nn.Linear module (relative) -> its autocast copies' bytes
    outer: tuple[str, ...]                               # the causal LM's path and its ancestors (loss ops)
    leaves: tuple[str, ...] = ()                         # parameterless leaf modules of a layer (activations)
    saved_ops: dict[int, str] = field(default_factory=dict)   # key -> the op on torchtitan's SAC save list made it
    vision: VisionReading | None = None                  # a vision-language model's whole step

    @property
    def cut_units(self) -> tuple[str, ...]:
        """Where the layer is cut into blocks: its parameter-owning modules and its parameterless leaves."""
        return self.units + self.leaves


@dataclass
class VisionReading:
    """A vision-language model's step, read whole (the vision side's backward runs after every decoder layer's)."""
    module: str                                          # the vision side's root: its pieces are named from it
    layers_path: str                                     # the decoder layers' (the language model's)
    events: list[tuple[bool, int, int, int, str, str]]   # the step's events, forward and the whole backward
    grads: dict[int, str]                                # key -> the name of the parameter whose .grad it is
    # the modules the vision side runs (the vision encoder, the projector when it is not inside it: Gemma 3's)
    modules: tuple[str, ...] = ()
    blocks: str = ""                                     # the encoder's list of blocks (a piece each)
    # the image features reach the decoder layers through cross-attention, not the token embeddings (Llama 3.2
    # Vision): autograd runs the embedding's backward (later in forward, a higher sequence number) before the
    # projector's, so the vision side's backward is read after it
    after_embedding: bool = False

    def holds(self, module: str) -> bool:
        """A module path inside the vision side."""
        return any(under(module, m) for m in self.modules or (self.module,))

    def encloses(self, module: str) -> bool:
        """A module holding the vision side (the model's own ops: the image features' scatter), or the root ("")."""
        return not module or any(under(m, module) for m in self.modules or (self.module,))


def layer_of(module: str, layers_path: str) -> tuple[int, str] | None:
    """(layer index, path within the layer) of a module path inside a decoder layer, else None."""
    prefix = layers_path + "."
    if not module.startswith(prefix):
        return None
    head, _, rest = module[len(prefix):].partition(".")
    return (int(head), rest) if head.isdigit() else None


def unit_of(rel: str, units: tuple[str, ...]) -> str | None:
    """The innermost of `units` that holds module path `rel` (both relative to the layer), else None."""
    best = None
    for u in units:
        if (rel == u or rel.startswith(u + ".")) and (best is None or len(u) > len(best)):
            best = u
    return best
