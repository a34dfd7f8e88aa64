"""The decoder layers in the step schedule: each layer's forward (its FSDP2 unit gathered, its blocks' tensors
kept, autocast's weight copies, a quantised base's dequantisation), what activation checkpointing, selective AC
(--ac-policy op) and offloading keep of it, and its backward (the recompute, the blocks' gradients and backward
transients, the unit's reduce-scatter).

Each layer is laid out with its kind's blocks (ActivationProfile.blocks_of: Llama 3.2 Vision's cross-attention
layers have blocks of their own).

Known Limitations: the layers of a kind are alike (the first `layers` of them are laid out, llmem.estimator.engine
extrapolates); layer 0's first blocks (before its first adapter) run without a graph.
"""

from __future__ import annotations

from llmem.estimator.schedule.blocks import BlockEvents
from llmem.estimator.schedule.ckpt_offload import CkptOffloadEvents
from llmem.estimator.schedule.hooks import StepHooks
from llmem.estimator.schedule.state import StepState
from llmem.estimator.schedule.units import FsdpUnits
from llmem.model.anatomy import ParamInfo


class LayerEvents:
    """A decoder layer's forward and backward."""

    def __init__(self, step: StepHooks, state: StepState, blocks: BlockEvents, units: FsdpUnits) -> None:
        self.step, self.f, self.sch = step, step.facts, step.sch
        self.state, self.blocks, self.units = state, blocks, units
        # --ckpt-offload: Unsloth's Functions around each checkpointed layer (None: torch's checkpoint)
        self.offload = CkptOffloadEvents(self.f, self.sch, state) if self.f.ckpt_offload is not None else None

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, i: int) -> None:
        sch, act, fwd = self.sch, self.f.act, self.state.forward
        sch.enter_layer(i)
        self.step.unshard_forward(i, self.f.unit(i))
        self.units.prefetch_forward(i + 1)
        if self.f.own_units:       # cuBLAS's workspace at the first matmul: layer 0's, the embedding's unit freed
            self.step.ensure_workspace()
        blocks_params = self.f.params.layer_blocks[i]
        checkpointed = act.checkpointed(i)
        if checkpointed and self.offload is not None:
            self.offload.before_layer(i)
        if checkpointed:
            # a checkpointed layer's forward keeps nothing: its dequantised weights reuse the memory its
            # intermediate tensors free, so they are laid out before them
            for b, params in zip(act.blocks_of(i), blocks_params, strict=True):
                self.blocks.dequantise(params, backward=False, block=b)
        per_block, copies = self.forward_blocks(i, blocks_params, checkpointed)
        out = -1
        if checkpointed or self.f.offloaded(i):
            out = self.drop_saved(i, blocks_params, per_block, copies, checkpointed)
            copies = [[] for _ in copies]
        if act.offload:
            # offloaded checkpointing: the checkpoint packed its input (the previous layer's output) to the host, so
            # the device tensor dies once this layer has used it; this layer's output lives on for the next one
            sch.free(fwd.passed)
            fwd.passed = out
        elif checkpointed and self.offload is not None:
            self.offload.after_layer(i, out)
        fwd.layer_keys[i] = per_block
        fwd.copies_by_layer[i] = copies
        if self.f.post_forward_ranks:
            self.units.reshard_to_post_forward(i)
        elif self.f.reshard:
            self.step.reshard_unit(i)

    def forward_blocks(self, i: int, blocks_params: list[list[ParamInfo]], checkpointed: bool
                       ) -> tuple[list[list[int]], list[list[int]]]:
        """The layer's blocks in order: autocast's weight copies, the kept tensors, the dequantisation of a block's
        linears while what their outputs feed is made. Returns the kept tensors' and the copies' keys per block."""
        sch, act = self.sch, self.f.act
        per_block: list[list[int]] = []
        copies: list[list[int]] = []
        pending = None
        for j, (b, params) in enumerate(zip(act.blocks_of(i), blocks_params, strict=True)):
            copies.append(self.weight_copies(params))
            if j < act.skipped(i):    # computed without a graph: nothing kept
                sch.free_all(self.blocks.forward(b))
                per_block.append([])
            else:
                per_block.append(self.blocks.forward(b))
                if checkpointed and act.selective is not None:
                    self.selective_forward(i, j, per_block)
            if len(per_block) > 1 and (self.f.offloaded(i) or checkpointed
                                       and self.f.gathered_input(act.blocks_of(i)[j - 1])):
                sch.free_all(per_block[-2])   # on the host by now / read (see gathered_input)
            if not checkpointed and pending is not None:
                self.blocks.dequantise(*pending)    # a block's linears run while what their outputs feed is made
            pending = (params, False, b)
        if pending is not None and not checkpointed:
            self.blocks.dequantise(*pending)
        return per_block, copies

    def weight_copies(self, params: list[ParamInfo]) -> list[int]:
        """Autocast's low-precision copies of a block's matmul weights: kept by the linear for the input gradient,
        a trained bias's cached until autocast exits, a frozen bias's cast for its one use (none in a compiled
        layer: its graph's casts are learned with it)."""
        sch, regime, fwd = self.sch, self.f.regime, self.state.forward
        kept = []
        if not regime.autocast or self.f.act.compiled:
            return kept
        for p in params:
            if self.f.autocast_copied(p):
                k = sch.alloc(self.f.params.tp_local[p.name] * regime.mm, "gathered_weights")
                if not p.name.endswith("bias"):
                    kept.append(k)              # linear keeps it for the input gradient
                elif p.trainable:
                    fwd.bias_cache.append(k)    # cached until autocast exits
                else:
                    sch.free(k)                 # frozen: cast for this use only
        return kept

    def drop_saved(self, i: int, blocks_params: list[list[ParamInfo]], per_block: list[list[int]],
                   copies: list[list[int]], checkpointed: bool) -> int:
        """A checkpointed layer keeps only its input (the rest is recomputed); an offloaded one keeps nothing on the
        device (its saved tensors, autocast's casts included, are on the host). Returns the key of the layer's
        output (-1 unless checkpointed)."""
        sch, act, fwd = self.sch, self.f.act, self.state.forward
        out = -1
        if checkpointed:
            # (the layer's output, the next layer's kept input, exists before its intermediates die)
            out = sch.alloc(act.ckpt_input_bytes, "activations")
            fwd.int8_keys[i] = sch.alloc_many(act.int8_kept, "activations")
            if not act.offload and self.offload is None:
                fwd.ckpt_keys[i] = out
        for keys in per_block:
            sch.free_all(keys)
        for params, keys in zip(blocks_params, copies, strict=True):
            for p, k in zip(self.f.cast_weights(params), keys, strict=True):
                if p.trainable:
                    fwd.cache.append(k)     # autocast caches casts of leaf weights that require grad
                else:
                    sch.free(k)             # a frozen weight's cast dies with the discarded graph
        return out

    def selective_forward(self, i: int, j: int, per_block: list[list[int]]) -> None:
        """--ac-policy op, block j of layer i's forward (llmem.memory.activations.selective): the checkpoint's
        storage takes the block's stored recipe tensors (out of what the layer frees: their keys become -1 there)
        and its other stored op outputs are made; the previous block's other tensors die now (the forward frees its
        intermediates as it goes, so the stored outputs sit where the allocator placed them among them)."""
        sel, alloc, fwd = self.f.act.selective, self.sch.alloc, self.state.forward
        if j == 0:
            fwd.sac_keys[i], fwd.sac_extra[i] = {}, []
        keys = per_block[j]
        for jj, k in sel.stored:
            if jj == j:
                fwd.sac_keys[i][(j, k)] = keys[k]
                keys[k] = -1
        fwd.sac_extra[i] += [(j, alloc(n, "activations"), read) for jj, n, read in sel.extra if jj == j]
        if j > 0:
            self.sch.free_all(per_block[j - 1])

    def selective_recompute(self, i: int, j: int) -> list[int]:
        """--ac-policy op, block j of layer i's recompute: the stored tensors are handed back (not made again), the
        others made with the block's temporaries among them; the stored outputs the recompute reads die once read
        (the rest at the layer's backward end)."""
        b, fwd = self.f.act.blocks_of(i)[j], self.state.forward
        stored = fwd.sac_keys[i]
        keys = self.blocks.forward(b, {k: stored.pop((jj, k)) for jj, k in list(stored) if jj == j})
        read = [e for e in fwd.sac_extra[i] if e[0] == j and e[2]]
        self.sch.free_all([k for _, k, _ in read])
        fwd.sac_extra[i] = [e for e in fwd.sac_extra[i] if e not in read]
        return keys

    # ------------------------------------------------------------------------------------------ backward
    def backward(self, i: int, it: int) -> None:
        sch, act, fwd, step = self.sch, self.f.act, self.state.forward, self.step
        sch.enter_layer(i)
        blocks_params = self.f.params.layer_blocks[i]
        step.unshard_backward(i, self.f.unit(i))
        if i > 0:
            step.prefetch(i - 1, self.f.unit(i - 1))     # backward prefetch of the next unit
        elif "embed" in self.f.own_units:                # --shard-embeddings: the embedding's unit (frozen too)
            step.prefetch("embed", self.f.own_units["embed"])
        elif self.f.vision_units:     # a vision tower's last unit: before layer 0 in the post-forward order
            last = list(self.f.vision_units)[-1]
            step.prefetch(last, self.f.vision_units[last])
        per_block = fwd.layer_keys[i]
        copies = fwd.copies_by_layer[i]
        checkpointed = act.checkpointed(i)
        stream_grad = -1
        if checkpointed:       # recompute the layer's forward
            # the gradient of the layer's output (the residual stream's, in its dtype) is live through the layer's
            # backward: the residual adds' backward passes it on and sums into a new one
            stream_grad = sch.alloc(act.ckpt_input_bytes, "activations")
            if self.offload is not None:
                self.offload.reload(i)
            per_block, copies = self.recompute(i, blocks_params)
        self.state.grads.layer_unsharded.clear()
        for j in reversed(range(len(act.blocks_of(i)))):
            self.backward_block(i, j, it, per_block, copies, checkpointed)
        if checkpointed:
            sch.free(fwd.ckpt_keys.pop(i, -1))
            sch.free_all(fwd.int8_keys.pop(i))
            sch.free_all([k for _, k, _ in fwd.sac_extra.pop(i, [])])   # stored, never read by the recompute
            sch.free(stream_grad)
        if self.f.fsdp:
            step.reduce_scatter_layer(i)

    def recompute(self, i: int, blocks_params: list[list[ParamInfo]]) -> tuple[list[list[int]], list[list[int]]]:
        """A checkpointed layer's recompute: its blocks' tensors and weight copies made again."""
        sch, act = self.sch, self.f.act
        # offloaded: the unpack hook copies the input back first (when the recompute keeps it as it is, it is
        # the first block's first tensor)
        unpacked = sch.alloc(act.recompute_input_bytes, "activations") if act.recompute_input_bytes else -1
        copies = [sch.alloc_many(self.f.cast_bytes(params), "gathered_weights") for params in blocks_params]
        per_block = []
        for j, (b, params) in enumerate(zip(act.blocks_of(i), blocks_params, strict=True)):
            per_block.append(self.blocks.forward(b) if act.selective is None else self.selective_recompute(i, j))
            self.blocks.dequantise(params, backward=False, block=b)
        sch.free(unpacked)     # the unpack hook's arguments die when the recompute returns
        return per_block, copies

    def backward_block(self, i: int, j: int, it: int, per_block: list[list[int]], copies: list[list[int]],
                       checkpointed: bool) -> None:
        """Block j's backward: its weights' gradients, the dequantisation and backward transients, what it kept
        freed."""
        sch, act, step = self.sch, self.f.act, self.step
        blocks_params = self.f.params.layer_blocks[i]
        if self.f.offloaded(i) and j >= act.skipped(i):   # back from the host for backward
            per_block[j] = sch.alloc_many(act.blocks_of(i)[j].tensors, "activations")
            copies[j] = sch.alloc_many(self.f.cast_bytes(blocks_params[j]), "gathered_weights")
        for p in blocks_params[j]:
            if p.trainable:
                step.flush_steps(it)     # in backward: the previous weight's hook has run (one node each)
                step.make_grad(p)
        if j >= act.skipped(i) or checkpointed:   # no gradient before layer 0's first adapter, in a graphless layer
            self.blocks.dequantise(blocks_params[j], backward=True)
            tmp = self.blocks.backward_transient(act.blocks_of(i)[j])
            sch.free_all(self.state.quant_live)
            sch.free_all(tmp)
        sch.free_all(per_block[j])
        sch.free_all(copies[j])
        step.flush_steps(it)
