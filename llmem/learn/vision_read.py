"""Reading a vision-language model's vision side from its whole step (llmem.learn.one_point runs the copy's whole
backward when the model has one): the vision module's forward, cut into pieces by module (the patch embedding, the
rotary table, each encoder block, the merger, the encoder's own ops ""), each piece's kept tensors (freed in
backward: activations, the autocast copies of its trained weights) and the temporaries between them, the model's
own temporaries around it (before the decoder layers) among them; and the
backward after the last decoder layer's (the image features' gradient out of the scatter into the embeddings, the
merger's and the blocks' backward), each allocation and free in order, each parameter's gradient named.

A vision-language step is learned at its own shape (llmem.memory.activations.learned.own_shape): every size here is
the one point's, in bytes.
"""

from __future__ import annotations

from llmem.learn.points import BACKWARD, FORWARD, KEPT_CATEGORIES, VisionReading
from llmem.memory.activations.learned_vision import LearnedPiece, LearnedVision, Op
from llmem.model.vision import PEFT_PREFIX, under

_SIDE = (*KEPT_CATEGORIES, "gathered_weights")


def read_vision(rd: VisionReading) -> LearnedVision | None:
    """The vision side of the step `rd`: its pieces, its forward's ops and its backward's (None when its forward
    makes nothing: a frozen encoder whose input needs no gradient runs without a graph, its temporaries aside)."""
    vision = rd.module
    freed: dict[int, tuple[int, int]] = {}            # key -> (event index, phase) of its free
    for i, (a, key, _size, phase, _cat, _module) in enumerate(rd.events):
        if not a:
            freed.setdefault(key, (i, phase))
    keys: list[str] = []                              # the pieces' modules, in forward order
    kept: dict[str, list[tuple[int, str]]] = {}       # piece -> its kept tensors (bytes, category)
    where: dict[int, tuple[int, int]] = {}            # key -> (piece, index) of a kept tensor
    forward: list[tuple] = []
    temps: set[int] = set()

    def piece_of(module: str) -> int:
        inside = len(vision) + 1 if vision else 0                 # (Llama 4's root: the model itself, "")
        if under(module, rd.blocks) and module != rd.blocks:      # an encoder block: "blocks.3"
            index = module[len(rd.blocks) + 1:].split(".")[0]
            key = f"{rd.blocks}.{index}"[inside:]
        else:                                                     # the root's child holding it: "merger"
            key = module[inside:].split(".")[0] if module != vision else ""
        if key not in kept:
            keys.append(key)
            kept[key] = []
        return keys.index(key)

    first_layer = next((i for i, (a, _k, _n, phase, _c, module) in enumerate(rd.events)
                        if a and phase == FORWARD and under(module, rd.layers_path)), len(rd.events))
    for i, (a, key, size, phase, cat, module) in enumerate(rd.events):
        if phase != FORWARD:
            continue
        if a and i < first_layer and _own_temporary(rd, module, cat, freed.get(key, (0, BACKWARD))[1]):
            forward.append((Op.TEMP, -1, key, size, cat))
            temps.add(key)
        elif a and rd.holds(module) and cat == "cuda_workspaces":
            forward.append((Op.WORKSPACE, -1, 0, None, ""))
        elif a and rd.holds(module) and cat in _SIDE:
            j = piece_of(module)
            if freed.get(key, (0, BACKWARD))[1] != FORWARD:
                where[key] = (j, len(kept[keys[j]]))
                forward.append((Op.KEEP, j, len(kept[keys[j]]), None, ""))
                kept[keys[j]].append((size, cat))
            else:
                forward.append((Op.TEMP, j, key, size, cat))
                temps.add(key)
        elif not a and key in temps:       # (one freed once the layers have begun: held until the forward returns)
            forward.append((Op.FREE if i < first_layer else Op.HELD, -1, key, None, ""))
    if not any(op != Op.WORKSPACE for op, *_ in forward):
        return None
    pieces = tuple(LearnedPiece(k or "encoder", k, tuple(n for n, _ in kept[k]),
                                tuple(c for _, c in kept[k])) for k in keys)
    return LearnedVision(pieces, tuple(forward), _backward(rd, where, piece_of))


def _own_temporary(rd: VisionReading, module: str, cat: str, freed_phase: int) -> bool:
    """A tensor made before the decoder layers outside the vision modules and freed in forward: the model's own code
    around the vision side (LLaVA-OneVision's get_image_features: the crops' pixel_values concatenated,
    pack_image_features' unpadded and newline-joined tiles, which the model's output holds till it is dropped; the
    features' concatenation and cast, the scatter's source, a local of the model's forward) and the token embeddings
    the scatter replaces (made before the images' features): a temporary of the vision side's forward. What the
    scatter keeps for backward is the embedding's (llmem.learn.layer_blocks)."""
    return bool(module) and not rd.holds(module) and cat in _SIDE and freed_phase == FORWARD


def _backward(rd: VisionReading, where: dict[int, tuple[int, int]], piece_of) -> tuple:
    """The backward from the end of the last decoder layer's (the scatter's backward, then the vision module's) to
    the first gradient of a parameter outside the vision module or the first allocation of a module outside it and
    the model's own ops (the token embedding's backward, which the schedule makes itself): each allocation (TEMP, or GRAD naming the parameter), each free of a kept tensor (FREE_KEPT) or
    of a temporary (FREE); the temporaries still live at the end are freed after the embedding's gradient (LATE)."""
    events = rd.events
    backward = [i for i, (a, _k, _n, phase, _c, _m) in enumerate(events) if phase == BACKWARD]
    if not any(events[i][0] and rd.holds(events[i][5]) for i in backward):
        return ()
    # after the last decoder layer's backward: the scatter's (the model's own ops), then the vision module's; with
    # cross-attention after the token embedding's too (the schedule's), from the vision side's first allocation
    start = max((i for i in backward if events[i][0] and under(events[i][5], rd.layers_path)), default=backward[0]) + 1
    if rd.after_embedding:
        start = next((i for i in backward if i >= start and events[i][0] and rd.holds(events[i][5])), start)
    ops: list[tuple] = []
    temps: set[int] = set()
    for a, key, size, phase, cat, module in events[start:]:
        if phase != BACKWARD:
            break
        name = rd.grads.get(key)
        if a and name is not None and not rd.holds(name):
            break                                        # the token embedding's gradient: the schedule's
        if a and module and not rd.holds(module) and not rd.encloses(module):
            break            # the token embedding's backward (Gemma's scale, a tied weight's new gradient): the schedule's
        if a and name is not None:
            ops.append((Op.GRAD, piece_of(module) if rd.holds(module) else -1, 0, size,
                        name.removeprefix(PEFT_PREFIX)))
        elif a:
            ops.append((Op.TEMP, piece_of(module) if rd.holds(module) else -1, key, size, cat))
            temps.add(key)
        elif key in where:
            j, k = where[key]
            ops.append((Op.FREE_KEPT, j, k, None, ""))
        elif key in temps:
            temps.discard(key)
            ops.append((Op.FREE, -1, key, None, ""))
    ops += [(Op.LATE, -1, key, None, "") for key in sorted(temps)]
    return tuple(ops)
