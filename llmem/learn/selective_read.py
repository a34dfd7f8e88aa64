"""What torchtitan's op-level selective checkpointing (--ac-policy op) keeps of the learned layer, read from the
same run: the ledger tags each output of an op on the policy's save list with its op (llmem.learn.one_point), and
the policy's rule (llmem.runtime.selective_ac: every op on the list saved, but only the 1st, 3rd, ... aten.mm of
the checkpointed layer's forward) is applied to layer READ_LAYER's forward in order. The learned run has no
checkpointing, so each saved output is placed where the learned layer has it: a tensor the layer keeps for backward
anyway is stored (block, kept index); one its forward frees (q_proj's output, normed and rotated on) is an extra,
held from the forward to the recompute. torch's checkpoint stops the recompute early, once the last tensor the
layer saves for backward is packed, so an extra made after the layer's last kept tensor (the last linear's output)
is never read and lives to the end of the layer's backward (llmem.memory.activations.selective)."""

from __future__ import annotations

from llmem.learn.points import FORWARD, READ_LAYER, LearnError, Reading, layer_of
from llmem.memory.activations.learned import LearnedSelective, as_floats


def read_selective(rd: Reading, tensors: dict, blocks_seq: list[list[tuple[bool, object]]]) -> LearnedSelective:
    """The policy's saved outputs of layer READ_LAYER placed on its learned blocks (`tensors`: key -> the layer
    reading's tensor record; `blocks_seq`: each block's forward events as cut)."""
    layer = ("layer", READ_LAYER)
    where: dict[int, tuple[int, int | None]] = {}     # rank -> (block, kept index; None: freed in forward)
    for j, items in enumerate(blocks_seq):
        kept = 0
        for alloc, t in items:
            if alloc and t.rank not in where:
                held = t.freed_phase != FORWARD
                where[t.rank] = (j, kept if held else None)
                kept += held
    last_kept = max((t.at for t in tensors.values() if t.region == layer and t.phase == FORWARD
                     and where.get(t.rank, (0, None))[1] is not None), default=-1)
    stored: list[tuple[int, int]] = []
    extra: list[tuple[int, tuple, bool]] = []
    saved: list[str] = []
    mm = 0
    for i, (a, key, _size, phase, _cat, module) in enumerate(rd.events):
        t = tensors.get(key) if a and phase == FORWARD else None
        op = rd.saved_ops.get(key)
        if t is None or op is None or t.at != i or t.region != layer:
            continue
        if op == "mm":
            mm += 1
            if mm % 2 == 0:      # every second aten.mm of the forward is recomputed
                continue
        found = where.get(t.rank)
        if found is None:
            raise LearnError(f"an output {op} saves under --ac-policy op ({module}) is not one of the layer's "
                             "tensors: what the policy keeps cannot be placed on the learned layer")
        j, k = found
        if k is not None:
            stored.append((j, k))
        else:
            extra.append((j, as_floats(t.size), t.at < last_kept))
        saved.append(f"{layer_of(module, rd.layers_path)[1]}: {op}")
    return LearnedSelective(tuple(stored), tuple(extra), tuple(saved))
