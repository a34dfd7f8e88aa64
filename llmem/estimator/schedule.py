"""The step's allocation schedule: the sequence of tensor allocations and frees one training step makes on rank 0,
written from the same model states and activation recipes the moments use, for the allocator model to replay.

`max_memory_allocated` counts whole allocator blocks and `max_memory_reserved` counts segments, so both depend on
the order and the sizes of the step's tensors, not only on their sum. `StepSchedule` writes two iterations of
forward, loss, backward, optimizer step and zero_grad: parameters, DDP's buckets, FSDP2's all-gather and
reduce-scatter buffers on their own streams, the tensors each block keeps for backward, autocast's weight copies,
bitsandbytes' dequantisation transients, gradients, optimizer states and the step's temporaries. Its methods are
the step's events; each names the PyTorch behaviour it lays out.
"""

from __future__ import annotations

from llmem.estimator.events import ALL_GATHER, REDUCE_SCATTER, Schedule
from llmem.estimator.objective_steps import objective_events
from llmem.estimator.objectives import objective_view
from llmem.estimator.param_facts import param_facts
from llmem.estimator.post_forward import (
    free_post_forward,
    from_post_forward,
    post_forward_ranks,
    reshard_to_post_forward,
)
from llmem.estimator.states import by_bytes, cpu_offload, fsdp_shards, steps_on_host
from llmem.memory.activations.blocks import Block
from llmem.memory.activations.loss import FusedCE
from llmem.memory.activations.profile import ActivationProfile, virtual_tokens
from llmem.memory.activations.quantised import fp32_behind_quant, quant_input_bytes
from llmem.memory.quant import allocated, quant_args, storage_tensors, transients
from llmem.model.anatomy import ParamInfo
from llmem.model.peft import element_bytes
from llmem.model.resolved import ResolvedSetup
from llmem.model.sharding import (
    MATMUL_KINDS,
    foreach_groups,
    is_embedding,
    is_lm_head,
)
from llmem.setup.methods import DDP_BUCKET_CAP_BYTES, DDP_FIRST_BUCKET_BYTES
from llmem.setup.optimizers import AFTER_TEMPORARIES, ALL_PARAMETERS, AT_FIRST_FREE, NO_TEMPORARIES
from llmem.setup.precision import F32

SMALL_TENSOR_BYTES = 64 * 1024
BlockOps = list[tuple[int, int, int]]


def block_plan(b: Block) -> BlockOps:
    """A block's forward as (op, bytes, temporary index): op 0 keeps a tensor, 1 allocates temporary i, 2 frees it.
    Temporaries (peft's adapters) sit at fractional positions between the kept tensors."""
    ops: BlockOps = []
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


def fused_ce_forward(sch: Schedule, f: FusedCE, batch: int, seq: int) -> tuple[int, int]:
    """llmem.runtime.losses.fused_linear_cross_entropy's forward, in its allocation order (the final hidden states
    are live around it). Returns the keys of the kept grad_input and grad_weight (-1 when not made)."""
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


class StepSchedule:
    """Two iterations of forward, loss, backward, optimizer step and zero_grad, as rank 0 runs them.

    `layers` keeps only the first decoder layers (the others are identical), for extrapolation. The attributes are
    the step's facts (fixed at construction) and what is live (the keys of allocated tensors, by role).
    """

    def __init__(self, r: ResolvedSetup, act: ActivationProfile, layers: int | None = None) -> None:
        preference = r.setup.objective != "sft"   # TRL's preference step (llmem.estimator.objectives)
        if preference:
            r, act = objective_view(r, act)       # chosen and rejected: twice the sequences
        anatomy, setup, layout, regime = r.anatomy, r.setup, r.layout, r.regime
        self.setup, self.layout, self.act, self.regime = setup, layout, act, regime
        self.hidden_size, self.vocab_size = anatomy.hidden_size, anatomy.vocab_size
        self.workspace_bytes = r.gpu.cublas_workspace_bytes
        # Above a billion parameters, tensors under 64 KiB (biases, norm weights and their states, per-token
        # statistics) are < 0.01 % of the step; leaving them out halves the events to replay.
        self.sch = Schedule(min_bytes=SMALL_TENSOR_BYTES if anatomy.total_params >= 1e9 else 1)
        self.layers = anatomy.num_layers if layers is None else layers
        # the parameters' shape-free facts, worked out once per set-up (llmem.estimator.param_facts; read-only)
        facts = param_facts(r, act.blocks, self.layers)
        self.kept, self.trainable, self.by_layer = facts.kept, facts.trainable, facts.by_layer
        self.root = self.by_layer.get(None, [])
        # bytes per element of each trained parameter, its gradient and states (peft's fp32 adapters: 4)
        self.pb = facts.element_bytes
        # element counts per parameter: this-rank shard, TP-local, FSDP-unsharded (padded)
        self.shard_numel, self.tp_local, self.unsharded = facts.shard_numel, facts.tp_local, facts.unsharded
        # FSDP2's all-gather outputs per parameter (a quantised weight's sharded tensors in their storage dtypes)
        # and whether MixedPrecisionPolicy casts it on the way (its stored dtype is not param_dtype)
        self.gather_sizes, self.cast_in = facts.gather_sizes, facts.cast_in
        self.fsdp = layout.shards_model_states
        # FSDP2's CPUOffloadPolicy: sharded parameters, gradients and the optimizer on the host
        self.cpu_offload = cpu_offload(r)
        self.host_step = steps_on_host(r)
        self.reshard = r.method.reshard_after_forward
        self.post_forward_ranks = post_forward_ranks(r)   # --reshard-after-forward N (llmem.estimator.post_forward)
        self.post_forward_shards: dict[int | None, list[int]] = {}
        self.gather_bytes, self.reduce_bytes = setup.gather_bytes, setup.reduce_bytes
        self.t = setup.batch_size * (setup.seq_len + virtual_tokens(anatomy))
        self.tv = self.t * anatomy.vocab_size
        # the quantised base's storage and dequantisation transients per quantised linear (llmem.memory.quant)
        self.quantised = facts.quantised
        self.quant_args = quant_args(setup, self.fsdp)
        self.quant_tmp = {p.name: transients(p.shape, setup.quant_base, self.quant_args, self.t,
                                             setup.compute_dtype == "float16", p.module_kind == "Conv1D")
                          for p in self.kept if self.quantised[p.name]}
        self.adapted = facts.adapted
        self.fp32_behind_quant = fp32_behind_quant(setup.quant_base, regime)
        self.layer_blocks_params = facts.layer_blocks
        self.vocab_parallel = facts.vocab_parallel
        self.optimizer = r.optimizer
        self.in_backward = setup.optimizer_in_backward and not self.host_step
        self.shapes = facts.shapes
        self.shards = layout.shard_degree                    # FSDP2's DTensor shards of dim 0
        # ... per parameter: under --ep a routed expert's over efsdp (llmem.setup.expert_parallel)
        self.shard_of = facts.shard_of
        self.gathered_by: dict[int | None, list[list[int]]] = {}   # --ep: a unit's gathered keys per FSDP2 group
        self.unsharded_grad_of: dict[str, int] = {}                # --ep: a layer's unsharded gradients by name
        self.ag_forward: dict[int, list[int]] = {}                # --ep: explicitly prefetched forward all-gathers
        self.plans: dict[int, BlockOps] = {}
        # what is live, by role
        self.quant_live: list[int] = []
        self.grads: dict[str, int] = {}     # param name -> key of its final gradient (non-FSDP) or sharded (FSDP)
        self.rs_outputs: list[int] = []
        self.states: list[int] = []
        self.workspace = -1
        self.gathered: dict[int | None, list[int]] = {}
        self.root_unsharded_grads: dict[str, int] = {}
        self.layer_unsharded: list[int] = []
        self.ag_out: dict[int | None, int] = {}     # prefetched all-gather outputs, not yet copied out (backward)
        self.last_forward_ag: list[int] = []
        self.pending_steps: list[ParamInfo] = []
        self.objective = objective_events(self, r) if preference else None   # TRL's trainers' steps

    def build(self, iterations: int = 2) -> Schedule:
        self.setup_phase()
        for it in range(iterations):
            self.forward(it)
            self.backward(it)
            self.optimizer_step(it)
        return self.sch

    # ------------------------------------------------------------------------------------------ sizes and rules
    def unit_bytes(self, unit: list[ParamInfo], per: int, only_trainable: bool = False) -> int:
        return sum(self.unsharded[p.name] for p in unit if p.trainable or not only_trainable) * per

    def gathered_bytes(self, unit: list[ParamInfo]) -> int:
        """A unit's all-gather output (FSDP2 gathers mixed dtypes as one uint8 buffer of the same bytes)."""
        return sum(sum(self.gather_sizes[p.name]) for p in unit)

    def casts(self, p: ParamInfo) -> bool:
        """Autocast makes a low-precision copy of this weight (a frozen one stored in that dtype needs none, nor
        does a quantised one: bitsandbytes dequantises it itself)."""
        return p.trainable or (self.setup.stored_bytes(False) != self.regime.mm and not self.quantised[p.name])

    def cast_weights(self, params: list[ParamInfo]) -> list[ParamInfo]:
        """The weights whose autocast copies a block's linears keep for backward (none outside autocast)."""
        if not self.regime.autocast:
            return []
        return [p for p in params if p.module_kind in MATMUL_KINDS and not p.name.endswith("bias") and self.casts(p)]

    def cast_bytes(self, params: list[ParamInfo]) -> list[int]:
        """The autocast weight copies a block's linears keep for backward."""
        return [self.tp_local[p.name] * self.regime.mm for p in self.cast_weights(params)]

    def offloaded(self, i: int) -> bool:
        """Layer i's saved tensors live on the host between forward and backward (a checkpointed layer's input
        is held by the checkpoint itself, on the device)."""
        return self.act.offload and not self.act.checkpointed(i)

    # ------------------------------------------------------------------------------------------ blocks
    def forward_block(self, b: Block) -> list[int]:
        """The block's kept tensors, with its forward temporaries allocated and freed among them."""
        alloc = self.sch.alloc
        if not b.temps:
            return [alloc(n, "activations") for n in b.tensors]
        plan = self.plans.get(id(b))
        if plan is None:
            plan = self.plans[id(b)] = block_plan(b)
        keys: list[int] = []
        temps: dict[int, int] = {}
        for op, n, k in plan:
            if op == 0:
                keys.append(alloc(n, "activations"))
            elif op == 1:
                temps[k] = alloc(n, "activations")
            else:
                self.sch.free(temps.pop(k))
        return keys

    def play(self, events) -> list[int]:
        """A quantised linear's transient events (llmem.memory.quant); returns the keys they leave allocated."""
        keys: dict[int, int] = {}
        for sign, tag, n in events:
            if sign > 0:
                keys[tag] = self.sch.alloc(n, "activations")
            else:
                self.sch.free(keys.pop(tag))
        return list(keys.values())

    def dequantise(self, params: list[ParamInfo], backward: bool, block: Block | None = None) -> None:
        """Forward: each quantised linear's transients, one after the other, then (bitsandbytes nf4) its output in
        the compute dtype, its cast back to the input dtype (Linear4bit returns the input's dtype) and, in peft's
        4-bit LoRA layer, the clone of it that the adapter's output is added into (torchao's LinearNF4 returns
        F.linear's output itself: the recipe's tensor). Backward: the largest one's, what it leaves live while the
        block's input gradients are made (the caller frees them)."""
        sch, alloc, mm = self.sch, self.sch.alloc, self.quant_args.dtype_bytes
        if backward:
            sets = [self.quant_tmp[p.name].backward for p in params if p.name in self.quant_tmp]
            if sets:
                self.quant_live.extend(self.play(max(sets, key=lambda e: sum(allocated(e)))))
            return
        for p in params:
            if p.name not in self.quant_tmp:
                continue
            keys = self.play(self.quant_tmp[p.name].forward)
            if self.setup.quant_base != "nf4" or block is None:
                sch.free_all(keys)
                continue
            rows = self.t * p.out_features                 # elements of the linear's output
            out = alloc(rows * mm, "activations")
            sch.free_all(keys)                             # the dequantised weight dies with gemm_4bit
            in_bytes = quant_input_bytes(block, self.regime, self.fp32_behind_quant)
            if in_bytes != mm:
                cast = alloc(rows * in_bytes, "activations")   # .to(inp_dtype)
                sch.free(out)
                out = cast
            if p.name in self.adapted:
                clone = alloc(rows * in_bytes, "activations")  # result.clone()
                sch.free(out)
                total = alloc(rows * in_bytes, "activations")  # result + lora_B(lora_A(x)) * scaling
                sch.free(clone)
                out = total
            sch.free(out)                                  # the recipe's tensors hold the output kept

    # ------------------------------------------------------------------------------------------ FSDP2 units
    def all_gather(self, unit: list[ParamInfo]) -> int:
        """FSDP2 foreach_all_gather: the copy-in of the local shards that MixedPrecisionPolicy casts (a parameter
        already in param_dtype, or without a policy, is copied straight into the output: _get_param_all_gather_inputs)
        and the gathered output, on its stream."""
        alloc = self.sch.alloc
        if self.cpu_offload:
            inputs = self.copies_from_host(unit)
        else:
            shards = self.shard_of[unit[0].name] if unit else self.shards      # one FSDP2 group's mesh
            cast = sum(sum(self.gather_sizes[p.name]) for p in unit if self.cast_in[p.name]) // shards
            cast = 0 if from_post_forward(self, unit) else cast
            inputs = [alloc(cast, "communication_buffers", ALL_GATHER)] if cast else []
        out = alloc(self.gathered_bytes(unit), "communication_buffers", ALL_GATHER)
        self.sch.free_all(inputs)
        return out

    def copies_from_host(self, unit: list[ParamInfo]) -> list[int]:
        """CPUOffloadPolicy's all-gather inputs (FSDPParam.all_gather_inputs, no foreach copy): each parameter's
        padded shard copied from the host in its stored dtype (`.to(device)`), then cast to MixedPrecisionPolicy's
        param_dtype where that differs (the copy dies with the cast); they live until the copy-in is done."""
        alloc, dp = self.sch.alloc, self.shards
        keys = []
        for p in unit:
            copy = alloc(self.unsharded[p.name] // dp * element_bytes(p, self.setup), "communication_buffers",
                         ALL_GATHER)
            if self.cast_in[p.name]:
                keys.append(alloc(sum(self.gather_sizes[p.name]) // dp, "communication_buffers", ALL_GATHER))
                self.sch.free(copy)
            else:
                keys.append(copy)
        return keys

    def fsdp_groups(self, unit: list[ParamInfo]) -> list[list[ParamInfo]]:
        """A unit's FSDPParamGroups in order of their first parameter: one, or under --ep the dense parameters and
        the routed experts on their own mesh (torch's _init_param_group groups by process group)."""
        if self.layout.ep == 1:
            return [unit]
        groups: dict[int, list[ParamInfo]] = {}
        for p in unit:
            groups.setdefault(self.shard_of[p.name], []).append(p)
        return list(groups.values())

    def copy_out(self, unit_key: int | None, unit: list[ParamInfo]) -> None:
        alloc = self.sch.alloc
        keys = [alloc(n, "gathered_weights") for p in unit for n in self.gather_sizes[p.name]]
        self.gathered.setdefault(unit_key, []).extend(keys)
        self.gathered_by.setdefault(unit_key, []).append(keys)

    def gather_unsharded(self, unit_key: int | None, group: list[ParamInfo]) -> None:
        """FSDP2 on a one-rank mesh (--ep with efsdp 1: the experts' group), wait_for_unshard's world_size == 1 path
        without a collective: per parameter its shard cast to param_dtype (all_gather_inputs), the unsharded output
        allocated (alloc_storage) and copied into, the cast released once the next one exists."""
        sch, alloc = self.sch, self.sch.alloc
        keys, prev = [], -1
        for p in group:
            cast = alloc(sum(self.gather_sizes[p.name]), "communication_buffers") if self.cast_in[p.name] else -1
            sch.free(prev)
            prev = cast
            keys += [alloc(n, "gathered_weights") for n in self.gather_sizes[p.name]]
        sch.free(prev)
        self.gathered.setdefault(unit_key, []).extend(keys)
        self.gathered_by.setdefault(unit_key, []).append(keys)

    def unshard_forward(self, unit_key: int | None, unit: list[ParamInfo]) -> None:
        if not self.fsdp or unit_key in self.gathered:
            return
        prefetched = self.ag_forward.pop(unit_key, None)
        for g, group in enumerate(self.fsdp_groups(unit)):      # each group's pre_forward: all-gather, copy-out
            if self.shard_of[group[0].name] == 1:
                self.sch.free_all(self.last_forward_ag)   # wait_for_unshard frees the previous state first
                self.gather_unsharded(unit_key, group)
                continue
            out = prefetched[g] if prefetched is not None else self.all_gather(group)
            self.copy_out(unit_key, group)
            self.sch.free_all(self.last_forward_ag)   # the previous output is released once this one is gathered
            self.last_forward_ag.append(out)

    def unshard_backward(self, unit_key: int | None, unit: list[ParamInfo]) -> None:
        if not self.fsdp or unit_key in self.gathered:
            return
        outs = self.ag_out.pop(unit_key, None)
        for g, group in enumerate(self.fsdp_groups(unit)):
            if self.shard_of[group[0].name] == 1:    # no collective: its unshard (and prefetch) allocates nothing
                self.gather_unsharded(unit_key, group)
                continue
            out = outs[g] if outs is not None else self.all_gather(group)
            self.copy_out(unit_key, group)
            free_post_forward(self, unit_key)
            self.sch.free(out)

    def prefetch_forward(self, i: int) -> None:
        """--ep: torchtitan's explicit forward prefetch (apply_fsdp_to_decoder's set_modules_to_forward_prefetch):
        layer i's groups all-gathered once the root / layer i - 1 is unsharded (a one-rank group allocates
        nothing until its copy-out)."""
        if self.layout.ep == 1 or not self.fsdp or i >= self.layers or i in self.gathered:
            return
        self.ag_forward[i] = [self.all_gather(group) if self.shard_of[group[0].name] > 1 else -1
                              for group in self.fsdp_groups(self.by_layer.get(i, []))]

    def prefetch(self, unit_key: int | None, unit: list[ParamInfo]) -> None:
        if self.fsdp and unit_key not in self.gathered and unit_key not in self.ag_out:
            self.ag_out[unit_key] = [self.all_gather(group) if self.shard_of[group[0].name] > 1 else -1
                                     for group in self.fsdp_groups(unit)]

    def reshard_unit(self, unit_key: int | None) -> None:
        self.gathered_by.pop(unit_key, None)
        for k in self.gathered.pop(unit_key, []):
            self.sch.free(k)

    # ---------------------------------------------- TRL's trainers: what an engine does its own way (DeepSpeed's)
    def reference_numels(self) -> list[int]:
        """The reference copy's parameters on this rank: FSDP2's shards (trl's prepare_fsdp), whole without it."""
        return [self.shard_numel[p.name] for p in self.kept]

    def reference_fetch(self, where) -> None:
        """The reference's own engine gathering its modules in its no-grad forward: none in PyTorch's step (FSDP2's
        reference is its own unit, gathered by the objective's events)."""

    def hand_over_grad(self, p: ParamInfo, key: int) -> None:
        """The lm_head gradient `key` TRL's fused head hands to AccumulateGrad: held for the root's reduce-scatter
        (FSDP2) or the optimizer step."""
        (self.root_unsharded_grads if self.fsdp else self.grads)[p.name] = key

    def gather_for_generation(self) -> list[int]:
        """What the engine gathers around generate (TRL's unwrap_model_for_generation): nothing in PyTorch's step."""
        return []

    def release_after_generation(self, keys: list[int]) -> None:
        self.sch.free_all(keys)

    # ------------------------------------------------------------------------------------------ gradients
    def accumulate(self, old: int, size: int) -> int:
        """AccumulateGrad into an existing gradient (tied weights): out of place, the new gradient and the sum
        exist before both addends are freed. Returns the sum's key."""
        new, total = self.sch.alloc(size, "gradients"), self.sch.alloc(size, "gradients")
        self.sch.free(new)
        self.sch.free(old)
        return total

    def make_grad(self, p: ParamInfo, root_unit: bool = False, low: int | None = None) -> None:
        sch, alloc = self.sch, self.sch.alloc
        if self.fsdp:
            size = self.unsharded[p.name] * self.gather_bytes
            if root_unit and self.replicated_grad(p):   # DTensor: the whole [vocab, h] (root_post_backward)
                size = p.numel * self.gather_bytes
            if root_unit and p.name in self.root_unsharded_grads:   # tied: accumulate out of place
                self.root_unsharded_grads[p.name] = self.accumulate(self.root_unsharded_grads[p.name], size)
            elif root_unit:
                self.root_unsharded_grads[p.name] = alloc(size, "gradients")
            else:
                self.layer_unsharded.append(alloc(size, "gradients"))
                self.unsharded_grad_of[p.name] = self.layer_unsharded[-1]
            return
        # DTensor: a vocab-parallel embedding's gradient comes back replicated (full size)
        size = (p.numel if p.name in self.vocab_parallel else self.shard_numel[p.name]) * self.pb[p.name]
        grads = self.grads
        if p.name in grads:       # accumulation into an existing gradient (tied weights): out of place
            grads[p.name] = self.accumulate(grads[p.name], size)
            if self.in_backward:
                self.pending_steps.append(p)
            return
        if low is not None or self.regime.autocast and p.module_kind in MATMUL_KINDS:
            if low is None:
                low = alloc(self.tp_local[p.name] * self.regime.mm, "gradients")
            grads[p.name] = alloc(size, "gradients")
            sch.free(low)
        else:
            grads[p.name] = alloc(size, "gradients")
        # a tied embedding's hook fires once, after its second (embedding) gradient is accumulated
        if self.in_backward and not (p.tied_to is not None and is_embedding(p)):
            self.pending_steps.append(p)

    # ------------------------------------------------------------------------------------------ the optimizer
    def create_states(self, params: list[ParamInfo]) -> None:
        """The optimizer's state tensors, created at its first step (per parameter, in order); bitsandbytes makes
        its shared quantisation maps at the first 8-bit parameter."""
        alloc, spec, shapes, pb = self.sch.alloc, self.optimizer, self.shapes, self.pb
        per_parameter = self.setup.optimizer_in_backward
        shared = spec.shared_state_bytes([shapes[p.name] for p in params], per_parameter)
        for p in params:
            if shared and spec.shared_state_bytes([shapes[p.name]], per_parameter):
                self.states.extend(alloc(shared // 2, "optimizer_states") for _ in range(2))
                shared = 0
            self.states.extend(alloc(b, "optimizer_states") for b in spec.part(p).states(shapes[p.name], pb[p.name]))

    def redistribute_vocab_grads(self, params: list[ParamInfo]) -> None:
        """DTensor: the replicated vocab-parallel embedding gradient is redistributed to the parameter's shards
        where the optimizer first combines it with a sharded tensor (a temporary of the shard's size)."""
        alloc = self.sch.alloc
        redistributed = [alloc(self.shard_numel[p.name] * self.pb[p.name], "optimizer_temporaries")
                         for p in params if p.name in self.vocab_parallel]
        self.sch.free_all(redistributed)

    def step_temporaries(self, params: list[ParamInfo]) -> None:
        """One step's temporaries over `params` (a composite optimizer: each part over its own, in order)."""
        sch = self.sch
        redistribute = self.optimizer.redistribute == AT_FIRST_FREE   # e.g. Lion: in _foreach_add_(updates, grads)
        # per dtype (foreach kernels group their tensors by dtype), then per part of a composite optimizer
        runs = [(part, ps, n) for n, same in by_bytes(params, self.pb) for part, ps in self.optimizer.split(same)]
        for part, ps, n in runs:
            keys: dict[int, int] = {}
            for sign, tag, size in part.step_events([self.shapes[p.name] for p in ps], n, self.shards):
                if sign > 0:
                    keys[tag] = sch.alloc(size, "optimizer_temporaries")
                else:
                    if redistribute:
                        self.redistribute_vocab_grads(params)
                        redistribute = False
                    sch.free(keys.pop(tag))

    def flush_steps(self, it: int) -> None:
        """The hooks fire once the gradient's node has run and released what it saved (the engine runs
        AccumulateGrad first: it has the highest priority)."""
        for p in self.pending_steps:
            self.step_in_backward(p, it)
        self.pending_steps.clear()

    def step_in_backward(self, p: ParamInfo, it: int) -> None:
        """--optimizer-in-backward: the post-accumulate-grad hook steps this parameter's own optimizer (states
        created lazily at its first step, temporaries of a one-parameter group) and frees its gradient."""
        if it == 0:
            self.create_states([p])
        self.step_temporaries([p])
        self.sch.free(self.grads.pop(p.name))

    # ------------------------------------------------------------------------------------------ phases
    def setup_phase(self) -> None:
        """Parameters (bitsandbytes' storage for a quantised base) and DDP's gradient buckets."""
        sch, setup = self.sch, self.setup
        sch.phase = "setup:setup"
        for p in self.kept:
            if self.quantised[p.name]:       # the quantised storage: packed weight and quantisation constants
                for n in storage_tensors(p.shape, setup.quant_base, self.quant_args, p.module_kind == "Conv1D",
                                         fsdp_shards(self.layout)):
                    sch.alloc(n, "weights")
            elif not self.cpu_offload:       # CPUOffloadPolicy: every sharded parameter is on the host
                sch.alloc(self.shard_numel[p.name] * element_bytes(p, setup), "weights")
        if self.layout.spec.gradient_buckets:
            # the reducer's buckets, filled in reverse parameter order: the first one capped at 1 MiB
            cap, filled = DDP_FIRST_BUCKET_BYTES, 0
            for p in reversed(self.trainable):
                filled += self.shard_numel[p.name] * self.pb[p.name]
                if filled >= cap:
                    sch.alloc(filled, "communication_buffers")
                    cap, filled = DDP_BUCKET_CAP_BYTES, 0
            sch.alloc(filled, "communication_buffers")

    def forward(self, it: int) -> None:
        sch, alloc, act = self.sch, self.sch.alloc, self.act
        if self.objective is not None and it == 0:    # the reference copy's weights and the batch, before the step
            self.objective.reference_weights()
            self.objective.batch()
        sch.phase = f"it{it}:forward"
        if self.objective is not None:    # forwards before the policy's own (KTO's KL sequences)
            self.objective.before_forward()
        self.unshard_forward(None, self.root)          # the root is not resharded after forward (FSDP2 default)
        self.prefetch_forward(0)
        self.cache: list[int] = []           # autocast's cached low-precision weight copies
        self.bias_cache: list[int] = []
        self.copies_by_layer: dict[int | None, list[list[int]]] = {}
        self.embed_keys = [alloc(n, "activations") for n in act.embed_tensors]
        if act.offload:
            sch.free_all(self.embed_keys)
            # a frozen embedding's output under checkpointing: a leaf its AccumulateGrad node holds on the device
            # (without offloading it is layer 0's checkpointed input, counted there)
            self.embed_keys.append(alloc(act.embed_leaf_bytes, "activations") if act.embed_leaf_bytes else -1)
        self.shared_keys = [alloc(n, "activations") for n in act.shared_tensors]
        mask_key = alloc(act.mask_bytes, "activations") if act.mask_bytes else -1
        if self.workspace < 0:
            self.workspace = alloc(self.workspace_bytes, "cuda_workspaces")
        self.layer_keys: dict[int, list[list[int]]] = {}
        self.ckpt_keys: dict[int, int] = {}
        self.sac_keys: dict[int, dict[tuple[int, int], int]] = {}   # --ac-policy op: stored recipe tensors
        self.sac_extra: dict[int, list[tuple[int, int, bool]]] = {}  # ... and other stored outputs (block, key, read)
        self.passed = -1    # offloaded checkpointing: the last checkpointed layer's output, the next layer's input
        self.int8_keys: dict[int, list[int]] = {}   # LLM.int8's inputs a checkpointed layer keeps (ctx attributes)
        for i in range(self.layers):
            self.forward_layer(i)
        sch.free_all(self.last_forward_ag)
        sch.free(mask_key)              # the packed mask dies with the model's forward
        self.head_forward()
        sch.free(self.passed)           # the final norm has read the last layer's output
        sch.free_all(self.bias_cache)   # autocast exit clears its cache; saved weight copies stay referenced
        if act.offload and not act.grad_ckpt:
            # the model's forward drops its rotary cos/sin and the layers' copies are on the host; checkpointed
            # layers' recompute partials (HF passes them as keywords) hold them on the device until their backward
            sch.free_all(self.shared_keys)
        sch.free_all(self.cache)
        sch.free(self.logits)           # the model output is dropped before backward

    def forward_layer(self, i: int) -> None:
        sch, alloc, act, regime = self.sch, self.sch.alloc, self.act, self.regime
        sch.mark(f"layer {i}")
        self.unshard_forward(i, self.by_layer.get(i, []))
        self.prefetch_forward(i + 1)
        blocks_params = self.layer_blocks_params[i]
        checkpointed = act.checkpointed(i)
        if checkpointed:
            # a checkpointed layer's forward keeps nothing: its dequantised weights reuse the memory its
            # intermediate tensors free, so they are laid out before them
            for b, params in zip(act.blocks, blocks_params, strict=True):
                self.dequantise(params, backward=False, block=b)
        per_block: list[list[int]] = []
        copies: list[list[int]] = []
        pending = None
        for j, (b, params) in enumerate(zip(act.blocks, blocks_params, strict=True)):
            block_copies = []
            if regime.autocast:
                for p in params:
                    if p.module_kind in MATMUL_KINDS and self.casts(p):
                        k = alloc(self.tp_local[p.name] * regime.mm, "gathered_weights")
                        if not p.name.endswith("bias"):
                            block_copies.append(k)      # linear keeps it for the input gradient
                        elif p.trainable:
                            self.bias_cache.append(k)   # cached until autocast exits
                        else:
                            sch.free(k)                 # frozen: cast for this use only
            copies.append(block_copies)
            if i == 0 and j < act.first_layer_skip:    # computed without a graph: nothing kept
                sch.free_all(self.forward_block(b))
                per_block.append([])
            else:
                per_block.append(self.forward_block(b))
                if checkpointed and act.selective is not None:
                    self.selective_forward(i, j, per_block)
            if len(per_block) > 1 and (self.offloaded(i) or checkpointed and self.gathered_input(act.blocks[j - 1])):
                sch.free_all(per_block[-2])   # on the host by now / read (see gathered_input)
            if not checkpointed and pending is not None:
                self.dequantise(*pending)    # a block's linears run while what their outputs feed is made
            pending = (params, False, b)
        if pending is not None and not checkpointed:
            self.dequantise(*pending)
        out = -1
        if checkpointed or self.offloaded(i):
            # a checkpointed layer keeps only its input (the rest is recomputed); an offloaded one keeps
            # nothing on the device (its saved tensors, autocast's casts included, are on the host)
            if checkpointed:
                # (the layer's output, the next layer's kept input, exists before its intermediates die)
                out = alloc(act.ckpt_input_bytes, "activations")
                self.int8_keys[i] = [alloc(n, "activations") for n in act.int8_kept]
                if not act.offload:
                    self.ckpt_keys[i] = out
            for keys in per_block:
                sch.free_all(keys)
            for params, keys in zip(blocks_params, copies, strict=True):
                for p, k in zip(self.cast_weights(params), keys, strict=True):
                    if p.trainable:
                        self.cache.append(k)    # autocast caches casts of leaf weights that require grad
                    else:
                        sch.free(k)             # a frozen weight's cast dies with the discarded graph
            copies = [[] for _ in copies]
        if act.offload:
            # offloaded checkpointing: the checkpoint packed its input (the previous layer's output) to the host, so
            # the device tensor dies once this layer has used it; this layer's output lives on for the next one
            sch.free(self.passed)
            self.passed = out
        self.layer_keys[i] = per_block
        self.copies_by_layer[i] = copies
        if self.post_forward_ranks:
            reshard_to_post_forward(self, i)
        elif self.reshard:
            self.reshard_unit(i)

    def gathered_input(self, b: Block) -> bool:
        """--sequence-parallel: whether block b keeps the all-gathered norm output its linears read (the block
        whose forward temporaries are the gather buffers, llmem.memory.activations.blocks gathered_input). In a
        checkpointed layer's first forward (under no_grad: torch/utils/checkpoint.py
        _checkpoint_without_reentrant_generator keeps nothing) the [t, h] tensor dies once its linears have read it
        (laid out as the next block's tensors are made), not at the layer's end with the block's other tensors."""
        return self.setup.sequence_parallel and bool(b.temps) and bool(b.tensors)

    def selective_forward(self, i: int, j: int, per_block: list[list[int]]) -> None:
        """--ac-policy op, block j of layer i's forward (llmem.memory.activations.selective): the checkpoint's
        storage takes the block's stored recipe tensors (out of what the layer frees: their keys become -1 there)
        and its other stored op outputs are made; the previous block's other tensors die now (the forward frees its
        intermediates as it goes, so the stored outputs sit where the allocator placed them among them)."""
        sel, alloc = self.act.selective, self.sch.alloc
        if j == 0:
            self.sac_keys[i], self.sac_extra[i] = {}, []
        keys = per_block[j]
        for jj, k in sel.stored:
            if jj == j:
                self.sac_keys[i][(j, k)] = keys[k]
                keys[k] = -1
        self.sac_extra[i] += [(j, alloc(n, "activations"), read) for jj, n, read in sel.extra if jj == j]
        if j > 0:
            self.sch.free_all(per_block[j - 1])

    def selective_recompute(self, i: int, j: int) -> list[int]:
        """--ac-policy op, block j of layer i's recompute: the stored tensors are handed back (not made again); the
        stored outputs the recompute reads die once read (the rest at the layer's backward end)."""
        b = self.act.blocks[j]
        stored = self.sac_keys[i]
        keys = [stored.pop((j, k)) if (j, k) in stored else self.sch.alloc(n, "activations")
                for k, n in enumerate(b.tensors)]
        read = [e for e in self.sac_extra[i] if e[0] == j and e[2]]
        self.sch.free_all([k for _, k, _ in read])
        self.sac_extra[i] = [e for e in self.sac_extra[i] if e not in read]
        return keys

    def head_forward(self) -> None:
        """The final norm, the lm_head and the loss: full logits, their fp32 upcast and log-softmax (HF's
        ForCausalLMLoss), or the fused linear cross-entropy; with TP the vocab-split logits are all-gathered (under
        --loss-parallel they stay sharded: loss_parallel_forward)."""
        if self.objective is not None:    # TRL's fused head and the reference forward
            return self.objective.head_forward()
        sch, alloc, act, regime, tv, tp = self.sch, self.sch.alloc, self.act, self.regime, self.tv, self.layout.tp
        sch.mark("lm_head and loss")
        self.head_keys = [alloc(n, "activations") for n in act.head_tensors]
        self.head_offloaded: list[int] = []
        if act.offload:   # the final norm's tensors go to the host; the lm_head's input stays (not offloaded)
            self.head_offloaded = list(act.head_tensors[:-1] if act.lm_head_input else act.head_tensors)
            sch.free_all(self.head_keys[:len(self.head_offloaded)])
            self.head_keys = self.head_keys[len(self.head_offloaded):]
        self.head_copy: list[int] = []
        self.fused_grads: tuple[int, int] = (-1, -1)
        self.logits = self.log_softmax = -1
        if act.fused_ce is not None:    # chunked: no [tokens, vocab] logits, the gradients kept instead
            self.fused_grads = fused_ce_forward(sch, act.fused_ce, self.setup.batch_size, self.setup.seq_len)
            return
        if regime.autocast:
            self.head_copy = [alloc(self.tp_local[p.name] * regime.mm, "gathered_weights") for p in self.root
                              if (p.module_kind in MATMUL_KINDS or is_lm_head(p)) and self.casts(p)]
        if self.setup.loss_parallel:   # ColwiseParallel(output_layouts=Shard(-1)): the logits stay vocab-sharded
            self.loss_parallel_forward()
            return
        if tp > 1:   # ColwiseParallel(output_layouts=Replicate()): all-gather the vocab shards, rearrange
            local = alloc(-(-tv // tp) * regime.mm, "logits_and_loss")
            gathered_out = alloc(tv * regime.mm, "logits_and_loss")
            rearranged = alloc(tv * regime.mm, "logits_and_loss")
            self.logits = alloc(tv * regime.mm, "logits_and_loss")
            sch.free(rearranged)
            sch.free(gathered_out)
            sch.free(local)
        else:
            self.logits = alloc(tv * regime.mm, "logits_and_loss")
        upcast = alloc(tv * F32, "logits_and_loss") if regime.mm != F32 else -1
        self.log_softmax = alloc(tv * F32, "logits_and_loss")
        sch.free(upcast)

    def loss_parallel_forward(self) -> None:
        """--loss-parallel: HF's logits.float() of the [tokens, vocab/tp] shard, then loss_parallel()'s _log_softmax
        (torch/distributed/tensor/parallel/loss.py): x - max (all-reduced), its exp (summed and all-reduced, then
        freed), the log-softmax (kept for backward); the upcast dies with the loss function."""
        sch, alloc, mm = self.sch, self.sch.alloc, self.regime.mm
        n = self.t * -(-self.vocab_size // self.layout.tp)
        self.logits = alloc(n * mm, "logits_and_loss")
        upcast = alloc(n * F32, "logits_and_loss") if mm != F32 else -1
        shifted = alloc(n * F32, "logits_and_loss")
        sch.free(alloc(n * F32, "logits_and_loss"))          # exp(shifted), summed
        self.log_softmax = alloc(n * F32, "logits_and_loss")
        sch.free(shifted)
        sch.free(upcast)

    def loss_parallel_backward(self) -> int:
        """--loss-parallel: _nll_loss_and_log_softmax_backward on the shard: zeros_like (the one-hot), exp of the
        log-softmax, their sum, times grad_output; then the cast back to the logits' dtype. Returns its key."""
        sch, alloc, mm = self.sch, self.sch.alloc, self.regime.mm
        n = self.t * -(-self.vocab_size // self.layout.tp)
        zeros = alloc(n * F32, "logits_and_loss")
        e = alloc(n * F32, "logits_and_loss")
        total = alloc(n * F32, "logits_and_loss")
        sch.free(e)
        grad = alloc(n * F32, "logits_and_loss")
        sch.free(total)
        sch.free(zeros)
        sch.free(self.log_softmax)
        if mm == F32:
            return grad
        cast = alloc(n * mm, "logits_and_loss")
        sch.free(grad)
        return cast

    def backward(self, it: int) -> None:
        sch = self.sch
        sch.phase = f"it{it}:backward"
        layers = self.layers
        if not getattr(self.objective, "loss_outside_model", False):   # TRL's ORPO / CPO: at the logits' gradient
            self.prefetch(layers - 1, self.by_layer.get(layers - 1, []))   # the root's pre-backward hook gathers it
        sch.mark("lm_head and loss")
        self.head_backward(it)
        self.pending_rs: list[int] = []
        for i in reversed(range(layers)):
            self.backward_layer(i, it)
        if self.act.offload and self.act.embed_leaf_bytes:   # AccumulateGrad gives the leaf its .grad
            self.embed_keys.append(sch.alloc(self.act.embed_leaf_bytes, "activations"))
        # embedding backward: the gradient of the embedding output (the residual stream's dtype) is live
        embeds = [p for p in self.root if p.trainable and is_embedding(p)]
        stream_grad = sch.alloc(self.t * self.hidden_size * self.regime.res, "activations") if embeds else -1
        for p in embeds:
            self.make_grad(p, root_unit=True)
        self.flush_steps(it)
        sch.free(stream_grad)
        sch.free_all(self.embed_keys)
        sch.free_all(self.shared_keys)
        if self.fsdp:
            self.root_post_backward()

    def head_backward(self, it: int) -> None:
        """The loss's backward (three fp32 [tokens, vocab] tensors; with TP the gradient sliced back to the vocab
        shard) or the fused loss's hand-over, then the lm_head's and the final norm's gradients."""
        if self.objective is not None:    # TRL's fused head
            return self.objective.head_backward(it)
        sch, alloc, act, regime, tv = self.sch, self.sch.alloc, self.act, self.regime, self.tv
        if act.fused_ce is not None:   # the loss's backward hands over the gradients it kept
            cast_grad = -1
        elif self.setup.loss_parallel:   # the gradient of the local vocab shard (no slicing)
            cast_grad = self.loss_parallel_backward()
        else:
            nll_grad = alloc(tv * F32, "logits_and_loss")
            ls_grad = alloc(tv * F32, "logits_and_loss")
            sch.free(self.log_softmax)
            sch.free(nll_grad)
            if regime.mm != F32:
                cast_grad = alloc(tv * regime.mm, "logits_and_loss")
                sch.free(ls_grad)
            else:
                cast_grad = ls_grad
        if self.layout.tp > 1 and not self.setup.loss_parallel:   # the replicated gradient sliced to the shard
            shard_grad = alloc(-(-tv // self.layout.tp) * regime.mm, "logits_and_loss")
            sch.free(cast_grad)
            cast_grad = shard_grad
        head_params = self.head_backward_params()
        self.head_keys += [alloc(n, "activations") for n in self.head_offloaded]   # offloaded: unpacked
        if act.fused_ce is not None:
            grad_in, stolen = self.fused_grads
            for p in head_params:
                if stolen >= 0 and is_lm_head(p):
                    # AccumulateGrad takes the loss's grad_weight as the gradient (no copy)
                    (self.root_unsharded_grads if self.fsdp else self.grads)[p.name] = stolen
                    stolen = -1
                    if self.in_backward and not self.fsdp and not (p.tied_to is not None and is_embedding(p)):
                        self.pending_steps.append(p)
                else:
                    self.make_grad(p, root_unit=True)
            sch.free(cast_grad)
            sch.free_all(self.head_copy)
            sch.free_all(self.head_keys)
            self.flush_steps(it)
        else:
            grad_in = alloc(self.t * self.hidden_size * regime.mm, "activations")
            if self.in_backward and not self.fsdp:
                self.head_hooks_in_backward(head_params, cast_grad, it)
            else:
                for p in head_params:
                    self.make_grad(p, root_unit=True)
                sch.free(cast_grad)
                sch.free_all(self.head_copy)
                sch.free_all(self.head_keys)
            self.flush_steps(it)
        sch.free(grad_in)

    def head_backward_params(self) -> list[ParamInfo]:
        """The root unit's parameters the head's backward makes gradients for (the lm_head or score and the final
        norm; the embedding only when tied), the per-unit gradient lists started afresh for the root."""
        self.root_unsharded_grads.clear()
        self.layer_unsharded.clear()
        return [p for p in self.root if p.trainable and (not is_embedding(p) or p.tied_to is not None)]

    def head_hooks_in_backward(self, head_params: list[ParamInfo], cast_grad: int, it: int) -> None:
        """--optimizer-in-backward at the lm_head: the matmul's node releases what it saved and its input gradient
        before ToCopyBackward casts the weight gradient up and AccumulateGrad runs the hook (the final norm's
        backward runs after the lm_head's hook)."""
        sch, regime = self.sch, self.regime
        head_mm = [p for p in head_params if is_lm_head(p)]
        lows = {p.name: sch.alloc(self.tp_local[p.name] * regime.mm, "gradients") for p in head_mm
                if regime.autocast and self.casts(p) and p.name not in self.grads}
        for p in head_mm:          # gradients the node produces directly (no cast): while its inputs live
            if p.name not in lows:
                self.make_grad(p, root_unit=True)
        sch.free(cast_grad)
        sch.free_all(self.head_copy)
        sch.free_all(self.head_keys)
        for p in head_mm:
            if p.name in lows:
                self.make_grad(p, root_unit=True, low=lows[p.name])
            self.flush_steps(it)
        for p in head_params:
            if p not in head_mm:
                self.make_grad(p, root_unit=True)
                self.flush_steps(it)

    def backward_layer(self, i: int, it: int) -> None:
        sch, alloc, act = self.sch, self.sch.alloc, self.act
        sch.mark(f"layer {i}")
        blocks_params = self.layer_blocks_params[i]
        self.unshard_backward(i, self.by_layer.get(i, []))
        if i > 0:
            self.prefetch(i - 1, self.by_layer.get(i - 1, []))     # backward prefetch of the next unit
        per_block = self.layer_keys[i]
        copies = self.copies_by_layer[i]
        checkpointed = act.checkpointed(i)
        stream_grad = -1
        if checkpointed:       # recompute the layer's forward
            # the gradient of the layer's output (the residual stream's, in its dtype) is live through the layer's
            # backward: the residual adds' backward passes it on and sums into a new one
            stream_grad = alloc(act.ckpt_input_bytes, "activations")
            # offloaded: the unpack hook copies the input back first (when the recompute keeps it as it is, it is
            # the first block's first tensor)
            unpacked = alloc(act.recompute_input_bytes, "activations") if act.recompute_input_bytes else -1
            copies = [[alloc(n, "gathered_weights") for n in self.cast_bytes(params)] for params in blocks_params]
            per_block = []
            for j, (b, params) in enumerate(zip(act.blocks, blocks_params, strict=True)):
                per_block.append(self.forward_block(b) if act.selective is None else self.selective_recompute(i, j))
                self.dequantise(params, backward=False, block=b)
            sch.free(unpacked)     # the unpack hook's arguments die when the recompute returns
        self.layer_unsharded.clear()
        for j in reversed(range(len(act.blocks))):
            if self.offloaded(i) and (i > 0 or j >= act.first_layer_skip):   # back from the host for backward
                per_block[j] = [alloc(n, "activations") for n in act.blocks[j].tensors]
                copies[j] = [alloc(n, "gathered_weights") for n in self.cast_bytes(blocks_params[j])]
            for p in blocks_params[j]:
                if p.trainable:
                    self.flush_steps(it)     # in backward: the previous weight's hook has run (one node each)
                    self.make_grad(p)
            if i > 0 or j >= act.first_layer_skip or checkpointed:   # layer 0: no gradient before its first adapter
                self.dequantise(blocks_params[j], backward=True)
                tmp = self.backward_transient(act.blocks[j])
                sch.free_all(self.quant_live)
                sch.free_all(tmp)
            sch.free_all(per_block[j])
            sch.free_all(copies[j])
            self.flush_steps(it)
        if checkpointed:
            sch.free(self.ckpt_keys.pop(i, -1))
            sch.free_all(self.int8_keys.pop(i))
            sch.free_all([k for _, k, _ in self.sac_extra.pop(i, [])])   # stored, never read by the recompute
            sch.free(stream_grad)
        if self.fsdp:
            self.reduce_scatter_layer(i)

    def backward_transient(self, b: Block) -> list[int]:
        """A block's backward transient. Under --sequence-parallel it is made of full-sequence [t, h] tensors (each
        linear's input gradient of the all-gathered input, and the norm's gradient before its reduce-scatter and the
        rearranged copy: DTensor's redistribute Replicate/Partial -> Shard(1)), each its own allocation, so it is laid
        out as pieces of at most [t, h] in the compute dtype (allocated together: the same bytes at once)."""
        alloc, n = self.sch.alloc, b.transient
        piece = self.t * self.hidden_size * self.regime.mm if self.setup.sequence_parallel else n
        if piece <= 0 or n <= piece:
            return [alloc(n, "activations")]
        return [alloc(min(piece, n - k), "activations") for k in range(0, n, piece)]

    def reduce_scatter_layer(self, i: int) -> None:
        """FSDP2's post-backward for a decoder layer: reshard (also for zero2), the reduce-scatter input on the
        current stream (the previous one has finished by now), its sharded output on the reduce-scatter stream."""
        sch, alloc = self.sch, self.sch.alloc
        unit = self.by_layer.get(i, [])
        if self.layout.ep > 1:
            self.reduce_scatter_groups(i, unit)
            return
        self.reshard_unit(i)
        sch.free_all(self.pending_rs)
        rs_in = alloc(self.unit_bytes(unit, self.reduce_bytes, True), "communication_buffers")
        sch.free_all(self.layer_unsharded)
        self.sharded_grads(alloc(self.unit_bytes(unit, self.reduce_bytes, True) // self.shards, "gradients",
                                 REDUCE_SCATTER))
        self.pending_rs.append(rs_in)

    def reduce_scatter_groups(self, i: int, unit: list[ParamInfo]) -> None:
        """--ep: each FSDPParamGroup's post_backward in turn (reshard, reduce-scatter input, the group's unsharded
        gradients freed, its output sharded over the group's mesh: efsdp for the routed experts)."""
        sch, alloc = self.sch, self.sch.alloc
        gathered = self.gathered_by.pop(i, [])
        self.gathered.pop(i, None)
        for g, group in enumerate(self.fsdp_groups(unit)):
            sch.free_all(gathered[g] if g < len(gathered) else [])
            sch.free_all(self.pending_rs)
            rs_bytes = self.unit_bytes(group, self.reduce_bytes, True)
            rs_in = alloc(rs_bytes, "communication_buffers")
            sch.free_all([self.unsharded_grad_of.pop(p.name) for p in group if p.name in self.unsharded_grad_of])
            self.sharded_grads(alloc(rs_bytes // self.shard_of[group[0].name], "gradients", REDUCE_SCATTER))
            self.pending_rs.append(rs_in)
        self.layer_unsharded.clear()

    def sharded_grads(self, key: int) -> None:
        """foreach_reduce's output: the sharded gradients until the optimizer step, or under CPUOffloadPolicy
        copied to the host as it returns (`new_sharded_grad.to("cpu")`), so the device output dies then."""
        if self.cpu_offload:
            self.sch.free(key)
        else:
            self.rs_outputs.append(key)

    def replicated_grad(self, p: ParamInfo) -> bool:
        """--tp: an untied vocab-parallel embedding's gradient comes out of embedding_dense_backward whole, [vocab, h]
        (torch/distributed/tensor/_ops/_embedding_ops.py embedding_dense_backward_strategy: Shard(1), Partial or
        Replicate, never the weight's Shard(0))."""
        return p.name in self.vocab_parallel and p.tied_to is None

    def redistribute_root_grads(self) -> None:
        """FSDPParamGroup.post_backward's unsharded_grad_data (FSDPParam._get_grad_inner_tensor): a replicated
        gradient redistributed to the parameter's TP placement (its vocab shard, a new tensor); the whole one dies
        with `unsharded_param.grad = None`, before the reshard and the reduce-scatter input."""
        grads = self.root_unsharded_grads
        for p in self.root:
            if p.name in grads and self.replicated_grad(p):
                shard = self.sch.alloc(self.unsharded[p.name] * self.gather_bytes, "gradients")
                self.sch.free(grads[p.name])
                grads[p.name] = shard

    def root_post_backward(self) -> None:
        """FSDPParamGroup.post_backward of the root: it reshards before foreach_reduce; the copy-in loop's variable
        still holds the last parameter's gradient (lm_head's, in module order) while the output is allocated."""
        sch, alloc, root = self.sch, self.sch.alloc, self.root
        self.redistribute_root_grads()
        sch.free_all(self.pending_rs)
        self.reshard_unit(None)
        rs_in = alloc(self.unit_bytes(root, self.reduce_bytes, True), "communication_buffers")
        ordered = [self.root_unsharded_grads[p.name] for p in root if p.name in self.root_unsharded_grads]
        for k in ordered[:-1]:
            sch.free(k)
        out = alloc(self.unit_bytes(root, self.reduce_bytes, True) // self.shards, "gradients", REDUCE_SCATTER)
        sch.free_all(ordered[-1:])
        self.sharded_grads(out)
        sch.free(rs_in)
        for u in list(self.gathered):
            self.reshard_unit(u)

    def optimizer_step(self, it: int) -> None:
        """optimizer.step() (its states at the first step, its temporaries as its row describes them), then
        zero_grad(set_to_none=True)."""
        sch, spec = self.sch, self.optimizer
        sch.phase = f"it{it}:optimizer_step"
        sch.mark("optimizer step")
        if not self.host_step:
            groups = foreach_groups(self.trainable, self.layout)
            if it == 0 and not self.in_backward:
                self.create_states(self.trainable)
            if not self.in_backward and spec.redistribute == AFTER_TEMPORARIES:
                self.step_over(groups)
            if self.vocab_parallel and spec.redistribute != AT_FIRST_FREE:
                self.redistribute_vocab_grads(self.root)
            if not self.in_backward and spec.redistribute != AFTER_TEMPORARIES:
                self.step_over(groups)
        for k in list(self.grads.values()):
            sch.free(k)
        self.grads.clear()
        if self.fsdp:
            sch.free_all(self.rs_outputs)

    def step_over(self, groups: list[list[ParamInfo]]) -> None:
        """The step's temporaries: per parameter group (foreach kernels, one kind of tensor each under TP), or
        over all parameters in order (a for-loop implementation)."""
        if self.optimizer.step_scope == NO_TEMPORARIES:
            return
        for group in (groups if self.optimizer.step_scope != ALL_PARAMETERS else [self.trainable]):
            self.step_temporaries(group)
