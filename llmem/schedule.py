"""The step's allocation schedule, built from the estimator's model and replayed through the allocator model.

`max_memory_allocated` counts whole allocator blocks and `max_memory_reserved` counts segments, so both depend on
the order and the sizes of the step's tensors, not only on their sum. This module writes the sequence of tensor
allocations and frees that one training step makes on rank 0 — parameters, FSDP's all-gather and reduce-scatter
buffers on their own streams, the tensors each block keeps for backward, gradients, optimizer states and
temporaries — from the same recipes the analytic moments use, and runs it through `llmem.allocator`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmem.activations import (
    F32,
    ActivationProfile,
    FusedCE,
    Regime,
    block_owner,
    quant_input_bytes,
    virtual_tokens,
)
from llmem.allocator import CachingAllocator
from llmem.anatomy import ModelAnatomy, ParamInfo
from llmem.config import TrainingSetup
from llmem.methods import Layout
from llmem.quant import is_quantised, storage_tensors, transients

DEFAULT, ALL_GATHER, REDUCE_SCATTER = 0, 1, 2   # FSDP2 issues its collectives on streams of their own
DDP_FIRST_BUCKET_BYTES = 1024**2                 # torch.distributed: dist._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_CAP_BYTES = 25 * 1024**2              # DistributedDataParallel(bucket_cap_mb=25)
SMALL_TENSOR_BYTES = 64 * 1024


@dataclass
class Schedule:
    """Allocation events, grouped in phases, with the component each tensor belongs to."""
    events: list[tuple[int, int, int, int, str]] = field(default_factory=list)  # (±1, key, size, stream, component)
    phase_starts: list[tuple[int, str]] = field(default_factory=list)          # (first event index, phase)
    min_bytes: int = 1                 # smaller tensors are left out (see build_schedule)
    _live: dict[int, tuple[int, str]] = field(default_factory=dict)
    _next: int = 0

    @property
    def phase(self) -> str:
        return self.phase_starts[-1][1] if self.phase_starts else ""

    @phase.setter
    def phase(self, name: str) -> None:
        self.phase_starts.append((len(self.events), name))

    def alloc(self, size: int, component: str, stream: int = DEFAULT) -> int:
        key = self._next
        self._next += 1
        if size < self.min_bytes:
            return -1
        self.events.append((1, key, size, stream, component))
        self._live[key] = (size, component)
        return key

    def free(self, key: int) -> None:
        if key >= 0:
            size, component = self._live.pop(key)
            self.events.append((-1, key, size, DEFAULT, component))

    def free_all(self, keys: list[int]) -> None:
        for k in keys:
            self.free(k)
        keys.clear()


@dataclass(frozen=True)
class PhasePeak:
    """One phase of one iteration: its own peak of allocated bytes and the reserved bytes by its end."""
    allocated: int
    reserved: int
    components: dict[str, int]


@dataclass(frozen=True)
class Replay:
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    components: dict[str, int]        # tensor bytes per component at the moment of peak allocated
    peak_phase: str
    phases: dict[str, PhasePeak] = field(default_factory=dict)   # "it<i>:<phase>" -> its peak


def replay(schedule: Schedule, expandable_segments: bool = False) -> Replay:
    """Run the events through the allocator; per phase, its peak of allocated bytes (and the tensor bytes per
    component at that moment, found in a second pass) and the reserved bytes at its end."""
    alloc = CachingAllocator(expandable_segments=expandable_segments)
    handles: dict[int, int] = {}
    malloc, free = alloc.malloc, alloc.free
    events = schedule.events
    bounds = [*schedule.phase_starts, (len(events), "")]
    peaks: dict[str, list[int]] = {}       # phase -> [peak allocated, reserved at end, event index of the peak]
    for (start, phase), (end, _) in zip(bounds, bounds[1:], strict=False):
        best, best_at = -1, start
        for i in range(start, end):
            sign, key, size, stream, _c = events[i]
            if sign > 0:
                handles[key] = malloc(size, stream)
                if alloc.allocated_bytes > best:
                    best, best_at = alloc.allocated_bytes, i
            else:
                free(handles.pop(key))
        peaks[phase] = [best, alloc.reserved_bytes, best_at]
    # second pass: tensor bytes per component at each phase's peak
    wanted = {v[2]: name for name, v in peaks.items() if v[0] >= 0}
    components: dict[str, dict[str, int]] = {}
    by_comp: dict[str, int] = {}
    for i, (sign, _k, size, _s, comp) in enumerate(events):
        by_comp[comp] = by_comp.get(comp, 0) + sign * size
        if i in wanted:
            components[wanted[i]] = {c: v for c, v in by_comp.items() if v}
    stats = alloc.stats()
    phases = {name: PhasePeak(v[0], v[1], components.get(name, {})) for name, v in peaks.items()}
    name, top = max(phases.items(), key=lambda kv: kv[1].allocated)
    return Replay(stats.peak_allocated_bytes, stats.peak_reserved_bytes, top.components, name.split(":")[-1],
                  phases)


def extrapolate(small: Replay, large: Replay, small_layers: int, large_layers: int, layers: int) -> Replay:
    """Per phase, allocated, reserved and each component grow linearly with the number of identical layers:
    extend the two replays to `layers` and take the largest phase."""
    f = (layers - large_layers) / (large_layers - small_layers)

    def lin(a: int, b: int) -> int:
        return round(b + (b - a) * f)

    phases = {}
    for name, big in large.phases.items():
        lit = small.phases.get(name, big)
        comps = {c: lin(lit.components.get(c, 0), v) for c, v in big.components.items()}
        phases[name] = PhasePeak(lin(lit.allocated, big.allocated), lin(lit.reserved, big.reserved), comps)
    name, top = max(phases.items(), key=lambda kv: kv[1].allocated)
    reserved = max(p.reserved for p in phases.values())
    return Replay(top.allocated, max(reserved, top.allocated), top.components, name.split(":")[-1], phases)


def optimizer_groups(trainable: list[ParamInfo], layout: Layout) -> list[list[ParamInfo]]:
    """Parameter groups as a tensor-parallel run must form them for foreach kernels (one kind of tensor each)."""
    if layout.tp == 1:
        return [trainable]
    from llmem.estimator import tp_split_dim

    split = [p for p in trainable if tp_split_dim(p) is not None]
    replicated = [p for p in trainable if tp_split_dim(p) is None]
    return [g for g in (split, replicated) if g]


def fused_ce_forward(sch: Schedule, f: FusedCE, batch: int, seq: int) -> tuple[int, int]:
    """llmem.losses.fused_linear_cross_entropy's forward, in its allocation order (the final hidden states are
    live around it). Returns the keys of the kept grad_input and grad_weight (-1 when not made)."""
    alloc, free = sch.alloc, sch.free
    t = f.tokens
    hidden = alloc(t * f.hidden * f.hidden_bytes, "activations")        # the final norm's output
    padded = alloc(batch * (seq + 1) * 8, "logits_and_loss")           # shifted labels: pad, then a copy
    labels = alloc(t * 8, "logits_and_loss")
    free(padded)
    cast = alloc(f.weight_cast_bytes, "gathered_weights") if f.weight_cast_bytes else -1
    grad_input = alloc(f.grad_input_bytes, "activations")
    grad_weight = alloc(f.grad_weight_bytes, "gradients") if f.weight_trainable else -1
    mask = alloc(t, "logits_and_loss")
    valid = alloc(t * F32, "logits_and_loss")
    free(mask)
    scale = alloc(t * F32, "logits_and_loss")
    safe = alloc(t * 8, "logits_and_loss")
    loss_1d = alloc(t * F32, "logits_and_loss")
    for c in f.chunk_sizes:
        x = alloc(c * f.hidden * f.mm, "logits_and_loss") if f.hidden_bytes != f.mm else -1
        logits = alloc(c * f.vocab * f.mm, "logits_and_loss")
        p = logits
        if f.mm != F32:
            p = alloc(c * f.vocab * F32, "logits_and_loss")
            free(logits)
        if f.weight_trainable and f.weight_bytes != f.mm and f.hidden_bytes != F32:
            free(alloc(c * f.hidden * F32, "logits_and_loss"))        # grad_weight's fp32 chunk of hidden
        g = p
        if f.mm != F32:
            g = alloc(c * f.vocab * f.mm, "logits_and_loss")
            free(p)
        if f.hidden_bytes != f.mm:
            free(alloc(c * f.hidden * f.mm, "logits_and_loss"))       # grad_input's matmul output, copied in
        free(g)
        free(x)
    free(cast)
    for k in (valid, scale, safe, loss_1d, labels, hidden):
        free(k)
    return grad_input, grad_weight


def build_schedule(anatomy: ModelAnatomy, setup: TrainingSetup, layout: Layout, act: ActivationProfile,
                   regime: Regime, workspace_bytes: int, iterations: int = 2, layers: int | None = None) -> Schedule:
    """Two iterations of forward, loss, backward, optimizer step and zero_grad, as rank 0 runs them.

    `layers` keeps only the first decoder layers (the others are identical), for extrapolation.
    """
    from llmem.estimator import MATMUL_KINDS, _fsdp_unit_numel, _is_embedding, local_numel, tp_local_numel

    # Above a billion parameters, tensors under 64 KiB (biases, norm weights and their states, per-token
    # statistics) are < 0.01 % of the step; leaving them out halves the events to replay.
    sch = Schedule(min_bytes=SMALL_TENSOR_BYTES if anatomy.total_params >= 1e9 else 1)
    alloc = sch.alloc

    pb = setup.param_bytes
    fsdp = layout.shards_model_states
    reshard = layout.method != "zero2"
    gather_bytes, reduce_bytes = setup.gather_bytes, setup.reduce_bytes
    t = setup.batch_size * (setup.seq_len + virtual_tokens(anatomy))
    tv = t * anatomy.vocab_size
    layers = anatomy.num_layers if layers is None else layers
    kept = [p for p in anatomy.params if p.layer_index is None or p.layer_index < layers]
    trainable = [p for p in kept if p.trainable]
    by_layer: dict[int | None, list[ParamInfo]] = {}
    for p in kept:
        by_layer.setdefault(p.layer_index, []).append(p)
    root = by_layer.get(None, [])

    # element counts per parameter, computed once: this-rank shard, TP-local, FSDP-unsharded (padded)
    shard_numel = {p.name: local_numel(p, layout) for p in kept}
    tp_local = {p.name: tp_local_numel(p, layout) for p in kept}
    unsharded = {p.name: _fsdp_unit_numel([p], layout) for p in kept} if fsdp else {}

    def unit_bytes(unit: list[ParamInfo], per: int, only_trainable: bool = False) -> int:
        return sum(unsharded[p.name] for p in unit if p.trainable or not only_trainable) * per

    def unsharded_param_bytes(p: ParamInfo, per: int) -> int:
        return unsharded[p.name] * per

    def owner(p: ParamInfo) -> int:
        return block_owner(act.blocks, p.name)

    def casts(p: ParamInfo) -> bool:
        """Autocast makes a low-precision copy of this weight (a frozen one stored in that dtype needs none, nor
        does a quantised one: bitsandbytes dequantises it itself)."""
        return p.trainable or (setup.stored_bytes(False) != regime.mm and not quantised[p.name])

    # bitsandbytes' dequantisation transients per quantised linear (llmem.quant), and per block the largest one
    quantised = {p.name: is_quantised(p, setup.quant_base) for p in kept}
    quant_tmp = {p.name: transients(p.shape, setup.quant_base, setup.double_quant, t, regime.mm,
                                    setup.precision.startswith("fp16"), p.module_kind == "Conv1D")
                 for p in kept if quantised[p.name]}

    adapted = {p.name.split(".lora_A.")[0] + ".weight" for p in kept if ".lora_A." in p.name}
    fp32_behind_quant = setup.quant_base != "none" and regime.autocast and regime.res == F32

    def dequantise(params: list[ParamInfo], backward: bool, block=None) -> None:
        """Forward: each quantised linear's transients, one after the other, then (nf4) its output in the compute
        dtype, its cast back to the input dtype (Linear4bit returns the input's dtype) and, in peft's 4-bit LoRA
        layer, the clone of it that the adapter's output is added into. Backward: the largest one's, live while
        the block's input gradients are made (the caller frees them)."""
        if backward:
            sets = [quant_tmp[p.name].backward for p in params if p.name in quant_tmp]
            if sets:
                quant_live.extend(alloc(n, "activations") for n in max(sets, key=sum))
            return
        for p in params:
            if p.name not in quant_tmp:
                continue
            keys = [alloc(n, "activations") for n in quant_tmp[p.name].forward]
            if setup.quant_base != "nf4" or block is None:
                sch.free_all(keys)
                continue
            rows = t * (p.shape[1] if p.module_kind == "Conv1D" else p.shape[0])
            out = alloc(rows * regime.mm, "activations")
            sch.free_all(keys)                             # the dequantised weight dies with gemm_4bit
            in_bytes = quant_input_bytes(block, regime, fp32_behind_quant)
            if in_bytes != regime.mm:
                cast = alloc(rows * in_bytes, "activations")   # .to(inp_dtype)
                sch.free(out)
                out = cast
            if p.name in adapted:
                clone = alloc(rows * in_bytes, "activations")  # result.clone()
                sch.free(out)
                total = alloc(rows * in_bytes, "activations")  # result + lora_B(lora_A(x)) * scaling
                sch.free(clone)
                out = total
            sch.free(out)                                  # the recipe's tensors hold the output kept

    quant_live: list[int] = []

    def cast_bytes(params: list[ParamInfo]) -> list[int]:
        """The autocast weight copies a block's linears keep for backward."""
        if not regime.autocast:
            return []
        return [tp_local[p.name] * regime.mm for p in params
                if p.module_kind in MATMUL_KINDS and not p.name.endswith("bias") and casts(p)]

    def offloaded(i: int) -> bool:
        """Layer i's saved tensors live on the host between forward and backward (a checkpointed layer's input
        is held by the checkpoint itself, on the device)."""
        return act.offload and not act.checkpointed(i)

    plans: dict[int, list[tuple[int, int, int]]] = {}

    def block_plan(b) -> list[tuple[int, int, int]]:
        """The block's forward as (op, bytes, temporary index): op 0 keeps a tensor, 1 allocates temporary i, 2
        frees it. Temporaries (peft's adapters) sit at fractional positions between the kept tensors."""
        ops: list[tuple[int, int, int]] = []
        live: list[tuple[int, float]] = []
        positions = sorted({*range(len(b.tensors) + 1), *(a for _, a, _ in b.temps), *(f for _, _, f in b.temps)})
        for pos in positions:
            for k, (n, a, f) in enumerate(b.temps):
                if a == pos and f == pos:
                    ops.append((1, n, k))
                    live.append((k, f))
            ops += [(2, 0, k) for k, f in live if f <= pos]
            live = [x for x in live if x[1] > pos]
            for k, (n, a, f) in enumerate(b.temps):
                if a == pos and f != pos:
                    ops.append((1, n, k))
                    live.append((k, f))
            if pos == int(pos) and pos < len(b.tensors):
                ops.append((0, b.tensors[int(pos)], -1))
        return ops + [(2, 0, k) for k, _ in live]

    def forward_block(b) -> list[int]:
        """The block's kept tensors, with its forward temporaries allocated and freed among them."""
        if not b.temps:
            return [alloc(n, "activations") for n in b.tensors]
        plan = plans.get(id(b))
        if plan is None:
            plan = plans[id(b)] = block_plan(b)
        keys: list[int] = []
        temps: dict[int, int] = {}
        for op, n, k in plan:
            if op == 0:
                keys.append(alloc(n, "activations"))
            elif op == 1:
                temps[k] = alloc(n, "activations")
            else:
                sch.free(temps.pop(k))
        return keys

    layer_blocks_params: dict[int, list[list[ParamInfo]]] = {}
    for i in range(layers):
        groups: list[list[ParamInfo]] = [[] for _ in act.blocks]
        for p in by_layer.get(i, []):
            groups[owner(p)].append(p)
        layer_blocks_params[i] = groups

    # ---- set-up: parameters, DDP buckets
    sch.phase = "setup:setup"
    for p in kept:
        if quantised[p.name]:       # bitsandbytes' storage: packed weight and quantisation constants
            for n in storage_tensors(p.shape, setup.quant_base, setup.double_quant, p.module_kind == "Conv1D"):
                alloc(n, "weights")
        else:
            alloc(shard_numel[p.name] * setup.stored_bytes(p.trainable), "weights")
    if layout.method == "ddp":
        cap, filled = DDP_FIRST_BUCKET_BYTES, 0
        for p in reversed(trainable):
            filled += shard_numel[p.name] * pb
            if filled >= cap:
                alloc(filled, "communication_buffers")
                cap, filled = DDP_BUCKET_CAP_BYTES, 0
        alloc(filled, "communication_buffers")

    grads: dict[str, int] = {}          # param name -> key of its final gradient (non-FSDP) or sharded (FSDP)
    rs_outputs: list[int] = []
    vocab_parallel = {p.name for p in root if layout.tp > 1 and _is_embedding(p) and p.shape
                      and p.shape[0] == anatomy.vocab_size}
    states: list[int] = []
    workspace = -1

    gathered: dict[int | None, list[int]] = {}
    root_unsharded_grads: dict[str, int] = {}
    layer_unsharded: list[int] = []

    ag_out: dict[int | None, int] = {}     # prefetched all-gather outputs, not yet copied out (backward)
    last_forward_ag: list[int] = []

    def all_gather(unit: list[ParamInfo]) -> int:
        """FSDP2 foreach_all_gather: a copy-in of the local shards and the gathered output, on its stream."""
        inp = alloc(unit_bytes(unit, gather_bytes) // layout.dp, "communication_buffers", ALL_GATHER)
        out = alloc(unit_bytes(unit, gather_bytes), "communication_buffers", ALL_GATHER)
        sch.free(inp)
        return out

    def copy_out(unit_key: int | None, unit: list[ParamInfo]) -> None:
        gathered[unit_key] = [alloc(unsharded_param_bytes(p, gather_bytes), "gathered_weights") for p in unit]

    def unshard_forward(unit_key: int | None, unit: list[ParamInfo]) -> None:
        if not fsdp or unit_key in gathered:
            return
        out = all_gather(unit)
        copy_out(unit_key, unit)
        sch.free_all(last_forward_ag)   # the previous unit's output is released once this one is gathered
        last_forward_ag.append(out)

    def unshard_backward(unit_key: int | None, unit: list[ParamInfo]) -> None:
        if not fsdp or unit_key in gathered:
            return
        out = ag_out.pop(unit_key, None)
        if out is None:
            out = all_gather(unit)
        copy_out(unit_key, unit)
        sch.free(out)

    def prefetch(unit_key: int | None, unit: list[ParamInfo]) -> None:
        if fsdp and unit_key not in gathered and unit_key not in ag_out:
            ag_out[unit_key] = all_gather(unit)

    def reshard_unit(unit_key: int | None) -> None:
        for k in gathered.pop(unit_key, []):
            sch.free(k)

    def make_grad(p: ParamInfo, root_unit: bool = False, low: int | None = None) -> None:
        if fsdp:
            size = unsharded_param_bytes(p, gather_bytes)
            if root_unit and p.name in root_unsharded_grads:   # tied: accumulate out of place
                new, total = alloc(size, "gradients"), alloc(size, "gradients")
                sch.free(new)
                sch.free(root_unsharded_grads[p.name])
                root_unsharded_grads[p.name] = total
            elif root_unit:
                root_unsharded_grads[p.name] = alloc(size, "gradients")
            else:
                layer_unsharded.append(alloc(size, "gradients"))
            return
        # DTensor: a vocab-parallel embedding's gradient comes back replicated (full size)
        size = (p.numel if p.name in vocab_parallel else shard_numel[p.name]) * pb
        if p.name in grads:       # accumulation into an existing gradient (tied weights): out of place
            new, total = alloc(size, "gradients"), alloc(size, "gradients")
            sch.free(new)
            sch.free(grads[p.name])
            grads[p.name] = total
            if in_backward:
                pending_steps.append(p)
            return
        if low is not None or regime.autocast and p.module_kind in MATMUL_KINDS:
            if low is None:
                low = alloc(tp_local[p.name] * regime.mm, "gradients")
            grads[p.name] = alloc(size, "gradients")
            sch.free(low)
        else:
            grads[p.name] = alloc(size, "gradients")
        # a tied embedding's hook fires once, after its second (embedding) gradient is accumulated
        if in_backward and not (p.tied_to is not None and _is_embedding(p)):
            pending_steps.append(p)

    from llmem.estimator import (
        local_shape,
        optimizer_shared_state_bytes,
        optimizer_state_bytes,
        optimizer_step_events,
    )

    in_backward = setup.optimizer_in_backward and not setup.offload_optimizer
    shapes = {p.name: local_shape(p, layout) for p in trainable}

    def create_states(params: list[ParamInfo]) -> None:
        """The optimizer's state tensors, created at its first step (per parameter, in order); bitsandbytes makes
        its shared quantisation maps at the first 8-bit parameter."""
        shared = optimizer_shared_state_bytes([shapes[p.name] for p in params], setup)
        for p in params:
            if shared and optimizer_shared_state_bytes([shapes[p.name]], setup):
                states.extend(alloc(shared // 2, "optimizer_states") for _ in range(2))
                shared = 0
            states.extend(alloc(b, "optimizer_states") for b in optimizer_state_bytes(shapes[p.name], setup))

    def redistribute_vocab_grads(params: list[ParamInfo]) -> None:
        """DTensor: the replicated vocab-parallel embedding gradient is redistributed to the parameter's shards
        where the optimizer first combines it with a sharded tensor (a temporary of the shard's size)."""
        redistributed = [alloc(shard_numel[p.name] * pb, "optimizer_temporaries")
                         for p in params if p.name in vocab_parallel]
        sch.free_all(redistributed)

    def step_temporaries(params: list[ParamInfo]) -> None:
        keys: dict[int, int] = {}
        redistribute = setup.optimizer == "lion"   # Lion: in _foreach_add_(updates, grads), updates all live
        for sign, tag, size in optimizer_step_events([shapes[p.name] for p in params], setup):
            if sign > 0:
                keys[tag] = alloc(size, "optimizer_temporaries")
            else:
                if redistribute:
                    redistribute_vocab_grads(params)
                    redistribute = False
                sch.free(keys.pop(tag))

    pending_steps: list[ParamInfo] = []

    def flush_steps(it: int) -> None:
        """The hooks fire once the gradient's node has run and released what it saved (the engine runs
        AccumulateGrad first: it has the highest priority)."""
        for p in pending_steps:
            step_in_backward(p, it)
        pending_steps.clear()

    def step_in_backward(p: ParamInfo, it: int) -> None:
        """--optimizer-in-backward: the post-accumulate-grad hook steps this parameter's own optimizer (states
        created lazily at its first step, temporaries of a one-parameter group) and frees its gradient."""
        if it == 0:
            create_states([p])
        step_temporaries([p])
        sch.free(grads.pop(p.name))

    for it in range(iterations):
        # ---- forward
        sch.phase = f"it{it}:forward"
        unshard_forward(None, root)          # the root is not resharded after forward (FSDP2 default)
        cache: list[int] = []           # autocast's cached low-precision weight copies
        bias_cache: list[int] = []
        copies_by_layer: dict[int | None, list[list[int]]] = {}
        embed_keys = [alloc(n, "activations") for n in act.embed_tensors]
        if act.offload:
            sch.free_all(embed_keys)
        shared_keys = [alloc(n, "activations") for n in act.shared_tensors]
        mask_key = alloc(act.mask_bytes, "activations") if act.mask_bytes else -1
        if workspace < 0:
            workspace = alloc(workspace_bytes, "cuda_workspaces")
        layer_keys: dict[int, list[list[int]]] = {}
        ckpt_keys: dict[int, int] = {}
        int8_keys: dict[int, list[int]] = {}   # LLM.int8's inputs a checkpointed layer keeps (ctx attributes)
        for i in range(layers):
            unshard_forward(i, by_layer.get(i, []))
            if act.checkpointed(i):
                # a checkpointed layer's forward keeps nothing: its dequantised weights reuse the memory its
                # intermediate tensors free, so they are laid out before them
                for b, params in zip(act.blocks, layer_blocks_params[i], strict=True):
                    dequantise(params, backward=False, block=b)
            per_block: list[list[int]] = []
            copies: list[list[int]] = []
            pending = None
            for j, (b, params) in enumerate(zip(act.blocks, layer_blocks_params[i], strict=True)):
                block_copies = []
                if regime.autocast:
                    for p in params:
                        if p.module_kind in MATMUL_KINDS and casts(p):
                            k = alloc(tp_local[p.name] * regime.mm, "gathered_weights")
                            if not p.name.endswith("bias"):
                                block_copies.append(k)      # linear keeps it for the input gradient
                            elif p.trainable:
                                bias_cache.append(k)        # cached until autocast exits
                            else:
                                sch.free(k)                 # frozen: cast for this use only
                copies.append(block_copies)
                if i == 0 and j < act.first_layer_skip:    # computed without a graph: nothing kept
                    sch.free_all(forward_block(b))
                    per_block.append([])
                else:
                    per_block.append(forward_block(b))
                if offloaded(i) and len(per_block) > 1:
                    sch.free_all(per_block[-2])   # the previous block's tensors are on the host by now
                if not act.checkpointed(i) and pending is not None:
                    dequantise(*pending)    # a block's linears run while what their outputs feed is made
                pending = (params, False, b)
            if pending is not None and not act.checkpointed(i):
                dequantise(*pending)
            if act.checkpointed(i) or offloaded(i):
                # a checkpointed layer keeps only its input (the rest is recomputed); an offloaded one keeps
                # nothing on the device (its saved tensors, autocast's casts included, are on the host)
                if act.checkpointed(i):
                    # (the layer's output, the next layer's kept input, exists before its intermediates die)
                    ckpt_keys[i] = alloc(act.checkpoint_saved - sum(act.int8_kept), "activations")
                    int8_keys[i] = [alloc(n, "activations") for n in act.int8_kept]
                for keys in per_block:
                    sch.free_all(keys)
                for params, keys in zip(layer_blocks_params[i], copies, strict=True):
                    weights = [p for p in params if regime.autocast and p.module_kind in MATMUL_KINDS
                               and not p.name.endswith("bias") and casts(p)]
                    for p, k in zip(weights, keys, strict=True):
                        if p.trainable:
                            cache.append(k)     # autocast caches casts of leaf weights that require grad
                        else:
                            sch.free(k)         # a frozen weight's cast dies with the discarded graph
                copies = [[] for _ in copies]
            layer_keys[i] = per_block
            copies_by_layer[i] = copies
            if reshard:
                reshard_unit(i)
        sch.free_all(last_forward_ag)
        sch.free(mask_key)              # the packed mask dies with the model's forward
        head_keys = [alloc(n, "activations") for n in act.head_tensors]
        head_offloaded: list[int] = []
        if act.offload:   # the final norm's tensors go to the host; the lm_head's input stays (not offloaded)
            head_offloaded = list(act.head_tensors if act.fused_ce is not None else act.head_tensors[:-1])
            sch.free_all(head_keys[:len(head_offloaded)])
            head_keys = head_keys[len(head_offloaded):]
        head_copy = []
        fused_grads: tuple[int, int] = (-1, -1)
        if act.fused_ce is not None:    # chunked: no [tokens, vocab] logits, the gradients kept instead
            fused_grads = fused_ce_forward(sch, act.fused_ce, setup.batch_size, setup.seq_len)
            logits = log_softmax = -1
        else:
            if regime.autocast:
                head_copy = [alloc(tp_local[p.name] * regime.mm, "gathered_weights") for p in root
                             if (p.module_kind in MATMUL_KINDS or p.name.startswith("lm_head")
                                 or (p.tied_to or "").startswith("lm_head"))
                             and casts(p)]
            if layout.tp > 1:   # ColwiseParallel(output_layouts=Replicate()): all-gather the vocab shards, rearrange
                local = alloc(-(-tv // layout.tp) * regime.mm, "logits_and_loss")
                gathered_out = alloc(tv * regime.mm, "logits_and_loss")
                rearranged = alloc(tv * regime.mm, "logits_and_loss")
                logits = alloc(tv * regime.mm, "logits_and_loss")
                sch.free(rearranged)
                sch.free(gathered_out)
                sch.free(local)
            else:
                logits = alloc(tv * regime.mm, "logits_and_loss")
            upcast = alloc(tv * F32, "logits_and_loss") if regime.mm != F32 else -1
            log_softmax = alloc(tv * F32, "logits_and_loss")
            sch.free(upcast)
        sch.free_all(bias_cache)        # autocast exit clears its cache; saved weight copies stay referenced
        if act.offload:                 # the model's forward drops its rotary cos/sin; the layers' copies are on host
            sch.free_all(shared_keys)
        sch.free_all(cache)
        sch.free(logits)                # the model output is dropped before backward

        # ---- backward
        sch.phase = f"it{it}:backward"
        prefetch(layers - 1, by_layer.get(layers - 1, []))   # the root's pre-backward hook gathers the last unit
        if act.fused_ce is not None:   # the loss's backward hands over the gradients it kept
            cast_grad = -1
        else:
            nll_grad = alloc(tv * F32, "logits_and_loss")
            ls_grad = alloc(tv * F32, "logits_and_loss")
            sch.free(log_softmax)
            sch.free(nll_grad)
            if regime.mm != F32:
                cast_grad = alloc(tv * regime.mm, "logits_and_loss")
                sch.free(ls_grad)
            else:
                cast_grad = ls_grad
        if layout.tp > 1:   # the replicated gradient is sliced back to this rank's vocab shard
            shard_grad = alloc(-(-tv // layout.tp) * regime.mm, "logits_and_loss")
            sch.free(cast_grad)
            cast_grad = shard_grad
        root_unsharded_grads.clear()

        layer_unsharded.clear()
        head_params = [p for p in root if p.trainable and (not _is_embedding(p) or p.tied_to is not None)]
        head_keys += [alloc(n, "activations") for n in head_offloaded]   # offloaded: the final norm's, unpacked
        if act.fused_ce is not None:
            grad_in, stolen = fused_grads
            for p in head_params:
                if stolen >= 0 and (p.name.startswith("lm_head") or (p.tied_to or "").startswith("lm_head")):
                    # AccumulateGrad takes the loss's grad_weight as the gradient (no copy)
                    (root_unsharded_grads if fsdp else grads)[p.name] = stolen
                    stolen = -1
                    if in_backward and not fsdp and not (p.tied_to is not None and _is_embedding(p)):
                        pending_steps.append(p)
                else:
                    make_grad(p, root_unit=True)
            sch.free(cast_grad)
            sch.free_all(head_copy)
            sch.free_all(head_keys)
            flush_steps(it)
        else:
            grad_in = alloc(t * anatomy.hidden_size * regime.mm, "activations")
            if in_backward and not fsdp:
                # the matmul's node releases what it saved and its input gradient before ToCopyBackward casts the
                # weight gradient up and AccumulateGrad runs the hook
                # (the final norm's backward runs after the lm_head's hook)
                head_mm = [p for p in head_params if p.name.startswith("lm_head") or (p.tied_to or "").startswith(
                    "lm_head")]
                lows = {p.name: alloc(tp_local[p.name] * regime.mm, "gradients") for p in head_mm
                        if regime.autocast and casts(p) and p.name not in grads}
                for p in head_mm:          # gradients the node produces directly (no cast): while its inputs live
                    if p.name not in lows:
                        make_grad(p, root_unit=True)
                sch.free(cast_grad)
                sch.free_all(head_copy)
                sch.free_all(head_keys)
                for p in head_mm:
                    if p.name in lows:
                        make_grad(p, root_unit=True, low=lows[p.name])
                    flush_steps(it)
                for p in head_params:
                    if p not in head_mm:
                        make_grad(p, root_unit=True)
                        flush_steps(it)
            else:
                for p in head_params:
                    make_grad(p, root_unit=True)
                sch.free(cast_grad)
                sch.free_all(head_copy)
                sch.free_all(head_keys)
            flush_steps(it)
        sch.free(grad_in)
        pending_rs: list[int] = []
        for i in reversed(range(layers)):
            unshard_backward(i, by_layer.get(i, []))
            if i > 0:
                prefetch(i - 1, by_layer.get(i - 1, []))     # backward prefetch of the next unit
            per_block = layer_keys[i]
            copies = copies_by_layer[i]
            if act.checkpointed(i):       # recompute the layer's forward
                copies = [[alloc(n, "gathered_weights") for n in cast_bytes(params)]
                          for params in layer_blocks_params[i]]
                per_block = []
                for b, params in zip(act.blocks, layer_blocks_params[i], strict=True):
                    per_block.append(forward_block(b))
                    dequantise(params, backward=False, block=b)
            layer_unsharded.clear()
            for j in reversed(range(len(act.blocks))):
                if offloaded(i) and (i > 0 or j >= act.first_layer_skip):   # back from the host for backward
                    per_block[j] = [alloc(n, "activations") for n in act.blocks[j].tensors]
                    copies[j] = [alloc(n, "gathered_weights") for n in cast_bytes(layer_blocks_params[i][j])]
                for p in layer_blocks_params[i][j]:
                    if p.trainable:
                        flush_steps(it)     # in backward: the previous weight's hook has run (one node each)
                        make_grad(p)
                if i > 0 or j >= act.first_layer_skip or act.checkpointed(i):   # layer 0: no gradient before
                    dequantise(layer_blocks_params[i][j], backward=True)      # its first adapter
                    tmp = alloc(act.blocks[j].transient, "activations")
                    sch.free_all(quant_live)
                    sch.free(tmp)
                sch.free_all(per_block[j])
                sch.free_all(copies[j])
                flush_steps(it)
            if act.checkpointed(i):
                sch.free(ckpt_keys.pop(i))
                sch.free_all(int8_keys.pop(i))
            if fsdp:
                unit = by_layer.get(i, [])
                reshard_unit(i)                               # post-backward reshard (also for zero2)
                sch.free_all(pending_rs)                      # the previous reduce-scatter has finished
                rs_in = alloc(unit_bytes(unit, reduce_bytes, True), "communication_buffers")  # on the current stream
                sch.free_all(layer_unsharded)
                rs_outputs.append(alloc(unit_bytes(unit, reduce_bytes, True) // layout.dp, "gradients",
                                        REDUCE_SCATTER))
                pending_rs.append(rs_in)
        # embedding backward: the gradient of the embedding output (the residual stream's dtype) is live
        embeds = [p for p in root if p.trainable and _is_embedding(p)]
        stream_grad = alloc(t * anatomy.hidden_size * regime.res, "activations") if embeds else -1
        for p in embeds:
            make_grad(p, root_unit=True)
        flush_steps(it)
        sch.free(stream_grad)
        sch.free_all(embed_keys)
        sch.free_all(shared_keys)
        if fsdp:
            sch.free_all(pending_rs)
            reshard_unit(None)     # FSDPParamGroup.post_backward reshards before foreach_reduce
            rs_in = alloc(unit_bytes(root, reduce_bytes, True), "communication_buffers")
            # the copy-in loop's variable still holds the last parameter's gradient (lm_head's, in module order)
            # while the reduce-scatter output is allocated
            ordered = [root_unsharded_grads[p.name] for p in root if p.name in root_unsharded_grads]
            for k in ordered[:-1]:
                sch.free(k)
            rs_outputs.append(alloc(unit_bytes(root, reduce_bytes, True) // layout.dp, "gradients", REDUCE_SCATTER))
            sch.free_all(ordered[-1:])
            sch.free(rs_in)
            for u in list(gathered):
                reshard_unit(u)

        # ---- optimizer step
        sch.phase = f"it{it}:optimizer_step"
        if setup.offload_optimizer:
            pass
        else:
            if it == 0 and not in_backward:
                create_states(trainable)
            if setup.optimizer == "adamw" and not in_backward:
                # foreach runs per parameter group; with tensor parallelism the TP-sharded DTensors and the
                # TP-replicated tensors (norms, row-parallel biases) need groups of their own
                for group in optimizer_groups(trainable, layout):
                    step_temporaries(group)
            if vocab_parallel and setup.optimizer != "lion":
                redistribute_vocab_grads(root)
            if setup.optimizer in ("adafactor", "lion") and not in_backward:
                for group in optimizer_groups(trainable, layout):
                    step_temporaries(group)
            if setup.optimizer == "adamw-forloop" and not in_backward:
                step_temporaries(trainable)     # parameter by parameter
        # zero_grad(set_to_none=True)
        for k in list(grads.values()):
            sch.free(k)
        grads.clear()
        if fsdp:
            sch.free_all(rs_outputs)
    return sch

