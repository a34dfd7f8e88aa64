"""Reading the layer: one point's events, with the fitted sizes, sorted by who releases them into the learned
layer's blocks (kept tensors, forward temporaries, backward transients), the head, the embedding and what is
shared."""

from __future__ import annotations

from dataclasses import dataclass

from llmem.learn.fit import ZERO, add_sizes, prune_sizes, sum_sizes
from llmem.learn.points import (
    BACKWARD,
    FORWARD,
    KEPT_CATEGORIES,
    LEARN_DEPTH,
    READ_LAYER,
    Exact,
    Reading,
    layer_of,
    unit_of,
)
from llmem.learn.selective_read import read_selective
from llmem.learn.vision_read import read_vision
from llmem.memory.activations.learned import LearnedActivations, LearnedBlock, as_floats


@dataclass
class _Tensor:
    rank: int
    size: Exact
    cat: str
    module: str                       # path within the model run
    at: int                           # event index of its allocation
    phase: int
    region: tuple
    freed_at: int | None = None       # event index of its free (iteration 0's forward and backward)
    freed_phase: int | None = None
    freed_region: tuple | None = None




def read_layer(rd: Reading, sizes: dict[int, Exact], points, seconds: float, selective: bool = False
               ) -> LearnedActivations:
    """The learned layer, head, embedding and shared tensors from one point's events and the fitted sizes (with
    `selective`, what --ac-policy op keeps of the layer: llmem.learn.selective_read)."""
    tensors, order = _lifetimes(rd, sizes)
    layer = ("layer", READ_LAYER)
    before = ("layer", READ_LAYER - 1)

    def relevant(t: _Tensor) -> bool:
        if t.cat in KEPT_CATEGORIES:
            return True
        return t.cat == "gathered_weights" and not _schedule_cast(t, rd)

    # the layer's own: freed in its forward (temporaries) or backward (kept), made by it or the layer before
    owned = [t for t in order if t.phase == FORWARD and relevant(t) and t.region in (layer, before)
             and (t.freed_region == layer or (t.freed_at is None and t.region == layer))]
    owned_ranks = {t.rank for t in owned}
    inputs = [t for t in owned if t.region == before]
    # the layer's forward in order: its inputs first, then its own events
    seq: list[tuple[bool, _Tensor]] = [(True, t) for t in inputs]
    for i, (a, key, _size, phase, _cat, _module) in enumerate(rd.events):
        if phase != FORWARD:
            continue
        t = tensors.get(key) if a else None
        if a and t is not None and t.rank in owned_ranks and t.region == layer and t.at == i:
            seq.append((True, t))
        elif not a:
            t = _freed_here(tensors, key, i)
            if t is not None and t.rank in owned_ranks and t.freed_phase == FORWARD:
                seq.append((False, t))
    blocks_seq, block_units = _cut(seq, rd)
    blocks, kept_by_block = _blocks(blocks_seq, block_units, set(rd.units))
    transients = _transients(rd, tensors, owned, kept_by_block, block_units)
    learned_blocks = tuple(LearnedBlock(b.name, b.params, tuple(map(as_floats, b.tensors)),
                                        tuple((as_floats(p), a, f) for p, a, f in b.temps),
                                        tuple(map(as_floats, transients[j])))
                           for j, b in enumerate(blocks))
    head = [t.size for t in order if t.phase == FORWARD and relevant(t) and t.cat != "gathered_weights"
            and t.region in (layer, ("post",)) and t.freed_region == ("head",) and t.module not in rd.outer]
    outside = [t for t in order if t.phase == FORWARD and t.region == ("pre",) and relevant(t)
               and t.cat != "gathered_weights" and t.freed_phase != FORWARD
               and not (rd.vision is not None and rd.vision.holds(t.module))]
    # the first layer's inputs are made by its recipe (as READ_LAYER's are): left out here
    pending = [t.size for t in inputs if t.freed_phase != FORWARD]
    embed, shared = [], []
    for t in outside:
        if t.size in pending:
            pending.remove(t.size)
            continue
        # no batch term (one point fits constants: the module says it)
        batchless = len(points) > 1 and all(c == 0 for c in (t.size[1], t.size[3], t.size[4]))
        (shared if batchless or "rotary" in t.module else embed).append(t.size)
    return LearnedActivations(learned_blocks, tuple(map(as_floats, embed)), tuple(map(as_floats, head)),
                              tuple(map(as_floats, shared)), LEARN_DEPTH,
                              tuple(points), round(seconds, 2), READ_LAYER,
                              read_selective(rd, tensors, blocks_seq) if selective else None,
                              read_vision(rd.vision) if rd.vision is not None else None)


def _schedule_cast(t: _Tensor, rd: Reading) -> bool:
    """An autocast copy of an nn.Linear's weight or bias: the schedule makes those itself."""
    found = layer_of(t.module, rd.layers_path)
    rel = found[1] if found is not None else None
    return rel is not None and t.size[0] in rd.casts.get(rel, ()) and all(c == 0 for c in t.size[1:])


def _freed_here(tensors: dict[int, _Tensor], key: int, i: int) -> _Tensor | None:
    t = tensors.get(key)
    return t if t is not None and t.freed_at == i else None


def _lifetimes(rd: Reading, sizes: dict[int, Exact]) -> tuple[dict[int, _Tensor], list[_Tensor]]:
    """Every tensor made in forward or backward with its region (pre, layer k, post in forward; head, layer k,
    embed in backward) at birth and at death. A free belongs to the region of the allocation before it."""
    tensors: dict[int, _Tensor] = {}
    order: list[_Tensor] = []
    rank = -1
    region: tuple = ("pre",)
    phase_seen = None
    seen_layer = False
    stack = rd.layers_path.rpartition(".")[0]     # the decoder stack's module (its own ops between its layers)
    for i, (a, key, _size, phase, cat, module) in enumerate(rd.events):
        if a:
            rank += 1
        if phase not in (FORWARD, BACKWARD):
            continue
        if phase != phase_seen:
            phase_seen, seen_layer = phase, False
            region = ("pre",) if phase == FORWARD else ("head",)
        if a:
            found = layer_of(module, rd.layers_path)
            if found is not None:
                region, seen_layer = ("layer", found[0]), True
            elif module == stack and phase == FORWARD and region[0] == "layer":
                pass   # the stack's own ops after a layer (Qwen3-VL's deepstack: the next layer's input) are the layer's
            elif module:       # the root's own ops keep the region they are in (a loss op, a mask)
                if phase == FORWARD:
                    region = ("post",) if seen_layer else ("pre",)
                else:
                    region = ("embed",) if seen_layer else ("head",)
            t = _Tensor(rank, sizes[rank], cat, module, i, phase, region)
            tensors[key] = t
            order.append(t)
        else:
            t = tensors.get(key)
            if t is not None and t.freed_at is None:
                t.freed_at, t.freed_phase, t.freed_region = i, phase, region
    return tensors, order


def _cut(seq: list[tuple[bool, _Tensor]], rd: Reading
         ) -> tuple[list[list[tuple[bool, _Tensor]]], list[tuple[str, ...]]]:
    """The layer's forward cut at the first op of each unit (the first stretch takes the first unit it meets)."""
    blocks: list[list[tuple[bool, _Tensor]]] = [[]]
    units: list[tuple[str, ...]] = [()]
    seen: set[str] = set()
    for alloc, t in seq:
        found = layer_of(t.module, rd.layers_path) if alloc and t.region == ("layer", READ_LAYER) else None
        if found is not None:        # (the stack's own ops after the layer: in its last block)
            unit = unit_of(found[1], rd.cut_units)
            if unit is not None and unit not in seen:
                seen.add(unit)
                if units[-1]:
                    blocks.append([])
                    units.append((unit,))
                else:
                    units[-1] = (unit,)
        blocks[-1].append((alloc, t))
    return blocks, units


@dataclass
class _Block:
    name: str
    params: tuple[str, ...]
    tensors: tuple[Exact, ...]
    temps: tuple[tuple[Exact, float, float], ...]


def _blocks(blocks_seq, units, param_units: set[str]) -> tuple[list[_Block], list[Exact]]:
    """Blocks from the cut sequence: kept tensors at integer positions, temporaries between them; one live across
    a cut is freed at its block's end and made again at the start of the next."""
    out: list[_Block] = []
    kept_sums: list[Exact] = []
    live: list[_Tensor] = []                  # temporaries carried into the next block, in allocation order
    for j, (items, unit) in enumerate(zip(blocks_seq, units, strict=True)):
        events: list[tuple[str, _Tensor]] = [("carry", t) for t in live]
        for alloc, t in items:
            kept = t.freed_phase != FORWARD
            events.append(("kept" if alloc and kept else "alloc" if alloc else "free", t))
        kept_list = [t for kind, t in events if kind == "kept"]
        n = len(kept_list)
        positions = _positions([kind == "kept" for kind, _t in events])
        temps: list[tuple[Exact, float, float]] = []
        opened: dict[int, float] = {}
        for idx, (kind, t) in enumerate(events):
            if kind in ("carry", "alloc"):
                opened[t.rank] = positions[idx]
            elif kind == "free" and t.rank in opened:
                temps.append((t.size, opened.pop(t.rank), positions[idx]))
        end = n + 1.5
        live = [t for kind, t in events if kind in ("carry", "alloc") and t.rank in opened]
        temps += [(t.size, opened[t.rank], end) for t in live]
        name = "+".join(unit) or f"block{j}"
        params = tuple(f".{u}." for u in unit if u in param_units)
        out.append(_Block(name, params, tuple(t.size for t in kept_list), tuple(temps)))
        kept_sums.append(sum_sizes(t.size for t in kept_list))
    return out, kept_sums


def _positions(is_kept: list[bool]) -> list[float]:
    """Block positions of a block's events in order: kept tensors at 0, 1, ...; the other events spread evenly in
    the gap before the next kept tensor (before the first: in (-1, 0); after the last: in (n, n + 1))."""
    out = [0.0] * len(is_kept)
    gap: list[int] = []
    k = 0
    for idx, kept in enumerate(is_kept + [True]):
        if kept:
            at = k if idx < len(is_kept) else k + 1
            for r, g in enumerate(gap):
                out[g] = at - 1 + (r + 1) / (len(gap) + 1)
            gap = []
            if idx < len(is_kept):
                out[idx] = float(k)
                k += 1
        else:
            gap.append(idx)
    return out


def _transients(rd: Reading, tensors: dict[int, _Tensor], owned: list[_Tensor], kept_by_block: list[Exact],
                units: list[tuple[str, ...]]) -> list[tuple[Exact, ...]]:
    """Each block's backward transient candidates: over its window of layer READ_LAYER's backward, what the real
    step holds (the layer's kept tensors still live, backward's own tensors not yet freed, the layer's gradients)
    less what the schedule holds at the block's transient (kept tensors of this block and the earlier ones,
    gradients of this block and the later ones)."""
    layer = ("layer", READ_LAYER)
    block_of_unit = {u: j for j, us in enumerate(units) for u in us}
    nblocks = len(units)

    def block_of(t: _Tensor) -> int | None:
        found = layer_of(t.module, rd.layers_path)
        if found is None or found[0] != READ_LAYER:
            return None
        unit = unit_of(found[1], rd.cut_units)
        return block_of_unit.get(unit) if unit is not None else None

    kept_live = {t.rank for t in owned if t.freed_phase != FORWARD}
    sizes = {t.rank: t.size for t in owned}
    grads = [t for t in tensors.values() if t.phase == BACKWARD and t.cat == "gradients" and t.region == layer]
    grad_from = [ZERO] * (nblocks + 1)         # gradients of blocks >= j
    for t in grads:
        j = block_of(t)
        j = nblocks - 1 if j is None else j
        for k in range(j + 1):
            grad_from[k] = add_sizes(grad_from[k], t.size)
    kept_upto = []
    total = ZERO
    for p in kept_by_block:
        total = add_sizes(total, p)
        kept_upto.append(total)
    # the backward's events in layer READ_LAYER, each with its block: a unit's op its own, another op the next
    # unit's (a parameterless op runs before, in backward, the module it followed in forward), a free the previous
    # event's
    bw: list[tuple[int, bool, _Tensor]] = []
    for i, (a, key, *_rest) in enumerate(rd.events):
        t = tensors.get(key)
        if rd.events[i][3] == BACKWARD and t is not None and (a and t.at == i or not a and t.freed_at == i):
            bw.append((i, a, t))
    in_layer = [(i, a, t) for i, a, t in bw if (t.region if a else t.freed_region) == layer]
    assign: dict[int, int] = {}
    nxt = 0
    for i, a, t in reversed(in_layer):
        if a:
            j = block_of(t)
            nxt = nxt if j is None else j
            assign[i] = nxt
    last = 0
    for i, a, _t in in_layer:
        if a:
            last = assign[i]
        else:
            assign[i] = last

    def counts(t: _Tensor) -> bool:
        """Held by the real step and not by the schedule's view at the block (what the transient stands for): the
        layer's kept tensors, what its backward makes (gradients included), and what the head's backward hands on
        (the gradient flowing in). A weight-sized tensor from the head's backward is a tied weight's gradient
        waiting in its AccumulateGrad for the embedding's: the schedule holds it as that gradient already."""
        if t.rank in kept_live:
            return True
        if t.phase != BACKWARD:
            return False
        if t.region == layer:
            return t.cat in KEPT_CATEGORIES or t.cat == "gradients"
        return t.cat in KEPT_CATEGORIES and any(c != 0 for c in t.size[1:])

    held = sum_sizes(sizes[r] for r in kept_live)
    candidates: list[list[Exact]] = [[] for _ in range(nblocks)]
    for i, a, t in bw:
        if counts(t):
            held = add_sizes(held, t.size, 1 if a else -1)
        j = assign.get(i)
        if j is not None:
            candidates[j].append(add_sizes(held, add_sizes(kept_upto[j], grad_from[j]), -1))
    return [prune_sizes(c) for c in candidates]
