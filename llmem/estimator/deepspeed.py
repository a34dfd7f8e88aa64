"""DeepSpeed on the estimator floor: its engine's flat buffers, buckets and ZeRO-3 fetches as allocation events.

DeepSpeed ZeRO stages 1-3 as DeepSpeed's engine runs them: the step's allocation schedule of rank 0.

`DeepSpeedSchedule` extends the PyTorch step's schedule (llmem.estimator.schedule) where DeepSpeed's engine differs:
the module cast to bf16/fp16 by the engine (no autocast, no fp32 weights on the device), the ZeRO optimizer's flat
buffers and partitions, its gradient buckets and stage 3's parameter coordinator. The activations are the PyTorch
step's (the same HF model, in the engine's dtype). Every term names the DeepSpeed code it copies (the installed
deepspeed 0.19.x: deepspeed/runtime/zero/stage_1_and_2.py, stage3.py, partitioned_param_coordinator.py).

TRL's preference objectives (dpo / kto / orpo / simpo / reward: llmem.estimator.objectives' and pairwise's events in
this schedule): the reference copy is laid out first (TRL's trainer __init__ runs prepare_deepspeed before
Trainer.train initializes the policy's engine), whole in the compute dtype under stages 1-2 (its engine at stage 0)
and partitioned under stage 3 (`reference_numels`), its ZeRO-3 forward gathering per module, then prefetching the whole
copy in one coalesced all-gather from its second forward (`reference_fetch`); the fused head's lm_head gradient is
handed to the reduce hook as AccumulateGrad leaves it (`hand_over_grad`), and the head's lm_head is gathered on its
own (trl's maybe_gather_lm_head_ctx), not in the prefetch's flat buffer (`alone`).

GRPO / RLOO (llmem.estimator.generation's events in this schedule): TRL's unwrap_model_for_generation on the engine
(trl/models/utils.py, ds3_gather_for_generation True): under stage 3 GatheredParameters over every policy parameter
for the whole generate (`gather_for_generation`: one buffer of ceil(numel / dp) x dp elements each, the persistent
ones already whole; no per-module fetch while the hooks are removed), nothing under stages 1-2; add_hooks then
invalidates the coordinator's trace, so no training step runs on a complete one (`retraced`: each fetches and
releases as the first does), and TRL's fused head keeps the lm_head it gathered for its backward, as the embedding,
until the backward's last bucket is reduced (`head_to_epilogue`, in a step without a complete trace).

A vision-language model (llmem.estimator.schedule.vision's events in this schedule): its batch laid out with the
setup, its vision side's gradients handed to the reduce hook as the language model's are; under stage 3 its tower's
pieces fetched and released as DeepSpeed's per-module hooks do (llmem.estimator.deepspeed_tower), the input
embedding released as the tower starts and, when the tower runs a backward, fetched again after it.

Known Limitations: one parameter group (HF's Trainer makes two, decay and no-decay: each padded to 2 x dp elements,
a few bytes); ZeRO++ (hpZ, quantised weights / gradients), MiCS, AutoTP and the NVMe offload are not modelled; the
stage-3 coordinator is modelled per decoder layer, not per leaf module (its prefetch and reuse-distance decisions
move at layer boundaries); the all-gather of the updated partitions after the step is taken as in place. Under stage
3 a policy engine that runs two forwards in a step (KTO's no_grad KL forward, LoRA's adapters-off reference, RLOO's
old-policy scoring) has its coordinator's trace complete after the first one (reset_step at each root forward): the
schedule runs the second on it (`on_forward_trace`: the coalesced prefetch, each layer released after its use) and
records in the first and in the backward (`two_forwards`), per decoder layer, within 2-3 % of the trace (tiny-llama:
KTO +2.3 %, DPO with LoRA -2.7 %, GRPO with LoRA and beta -2.5 % allocated; RLOO +2.1 % reserved); the estimate
says so in a note for these set-ups (`two_forwards_note`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from llmem.estimator.deepspeed_tower import ZeroTower, ZeroVision, tower_units
from llmem.estimator.schedule import StepFacts, StepSchedule
from llmem.memory.activations.profile import ActivationProfile
from llmem.model.anatomy import ParamInfo
from llmem.model.resolved import ResolvedSetup
from llmem.model.sharding import is_embedding
from llmem.setup.deepspeed import (
    ZeroConfig,
    bucket_buffers,
    param_partition_numel,
    partition_gradient_numels,
    partition_norm_numels,
    partition_numel,
    sub_group_numels,
    zero_config,
)
from llmem.setup.objectives import REF_ADAPTERS_OFF, kl_sequences, objective_spec, reference_mode
from llmem.setup.optimizers import NO_TEMPORARIES
from llmem.setup.precision import F32

EMBED = "embed"     # stage 3's unit key of the input embedding (None: the rest of the root, as in the FSDP2 step)


def second_forward(setup) -> str | None:
    """What makes the policy engine run two forwards in a step (KTO's no_grad KL forward, RLOO's old-policy scoring,
    LoRA's adapters-off reference), or None."""
    spec = objective_spec(setup.objective)
    if not spec.runs_trainer:     # sft: one forward
        return None
    return ("KTO's no_grad KL forward" if kl_sequences(setup) else
            "RLOO's old-policy scoring forward" if spec.scores_policy else
            "LoRA's adapters-off reference forward" if reference_mode(setup) == REF_ADAPTERS_OFF else None)


def two_forwards_note(r: ResolvedSetup) -> str | None:
    """The ZeRO-3 set-ups whose policy engine runs two forwards in a step: DeepSpeed's coordinator resets its step
    at each root forward (parameter_offload.py _start_of_forward_hook: reset_step), so its trace is complete after
    the first forward and the second prefetches. One line, or None."""
    which = second_forward(r.setup) if r.method.zero_stage == 3 else None
    if which is None:
        return None
    return (f"approximate under ZeRO-3: the policy runs two forwards a step ({which}); DeepSpeed's coordinator "
            "completes its trace with the first (reset_step at each root forward), the second prefetches the whole "
            "model on it, the backward records again: modelled per decoder layer, not per module (against the trace "
            "on tiny-llama, 2 GPUs, allocated / reserved: KTO +2.3 / +3.0 %, DPO with LoRA -2.7 / -1.8 %, GRPO with "
            "LoRA and beta -2.5 / -0.2 %, RLOO 0 / +2.1 %)")


def model_bytes(r: ResolvedSetup) -> int:
    """Bytes per element of the engine's module: DeepSpeed casts it whole to bf16 / fp16 (engine.py
    _configure_distributed_model: self.module.bfloat16() / .half()), adapters and frozen weights included."""
    return r.setup.compute_bytes


@dataclass
class ZeroLive:
    """The engine's own live buffers and its stage-3 coordinator's state in a step (StepState's for DeepSpeed)."""
    bucket: int = -1                  # the IPG buffers of this backward
    bucket_filled: int = 0            # elements in the IPG bucket
    grad_partition: int = -1          # the gradients of this rank's partition (bf16)
    full_grads: list[tuple[int, int]] = field(default_factory=list)   # ZeRO-1: (key, elements) of whole gradients
    live_units: dict[int | str | None, int] = field(default_factory=dict)   # stage 3: gathered parameters per unit
    # stage 3: a coalesced prefetch's flat all-gather buffer and the units it gathered not yet fetched
    inflight: list[tuple[int, set]] = field(default_factory=list)
    iteration: int = 0
    root_forwards: int = 0            # the policy's root forwards in this step
    # stage 3: TRL's reference engine (reference_fetch): its forwards so far, its gathered units, its prefetch
    ref_forwards: int = 0
    ref_units: dict = field(default_factory=dict)
    ref_flat: int = -1
    generating: bool = False          # inside generate: ZeRO-3's module hooks removed (remove_hooks)
    pending: list = field(default_factory=list)   # (parameter, gradient key) made, its reduce hook not yet run


class DeepSpeedSchedule(StepSchedule):
    """Two iterations of DeepSpeed's engine step on rank 0: forward, engine.backward, engine.step."""

    def __init__(self, r: ResolvedSetup, act: ActivationProfile, layers: int | None = None) -> None:
        super().__init__(r, act, layers)
        self.zero: ZeroConfig = zero_config(r.setup, r.method.zero_stage, r.anatomy.hidden_size)
        self.stage, self.dp, self.mb = self.zero.stage, r.layout.dp, model_bytes(r)
        # a parameter of at most param_persistence_threshold elements stays gathered (stage3.py persistent params)
        self.persistent = {p.name for p in self.facts.params.kept
                           if self.stage == 3 and p.numel <= self.zero.param_persistence_threshold}
        trained = [p.numel for p in self.facts.params.trainable]
        self.partition = partition_numel(trained, self.stage, self.dp)
        self.largest_numel = max(trained, default=0)
        self.in_partition = partition_gradient_numels(trained, self.stage, self.dp)
        self.norm_numels = partition_norm_numels(trained, self.stage, self.dp)
        # stage 3 on a vision-language model: its tower's pieces fetched as its hooks fetch them
        vision = self.facts.act.vision
        self.tower = tower_units(vision, self.facts.root) if self.stage == 3 and vision is not None and \
            vision.side is not None else {}
        self.layer_numel = {u: sum(p.numel for p in self.unit_params(u))
                            for u in [*range(self.facts.layers), None, EMBED, *self.tower]}
        if self.tower:
            self.vision.units = ZeroTower(self, self.vision.pieces, self.tower)
        elif vision is not None and vision.side is not None:
            self.vision.units = ZeroVision(self, self.vision.pieces)
        self.zl = ZeroLive()              # what is live of the engine's own buffers and its coordinator
        # units whose parameters a prefetch gathers on their own: TRL's fused head reads lm_head.weight outside the
        # lm_head module (trl/trainer/utils.py maybe_gather_lm_head_ctx, GatheredParameters), as the trace shows
        self.alone = {None} if objective_spec(r.setup.objective).fused_lm_head else set()
        # GRPO / RLOO: TRL's add_hooks after each generate invalidates the coordinator's trace (trl/models/utils.py
        # add_hooks: coordinator._invalidate_trace() unless already invalid), so no training step runs on a complete
        # trace: each fetches and releases as the first one does (no prefetch, no reuse-distance keeping)
        self.retraced = objective_spec(r.setup.objective).generates
        # a policy that runs two root forwards a step: reset_step at each root forward (parameter_offload.py
        # _start_of_forward_hook) completes the trace with the first forward alone; the second runs on it (the
        # coalesced prefetch, each module released after its use: no later use in that trace), then the backward
        # finds no module in it and invalidates it (trace_prologue): every step records again
        self.two_forwards = self.stage == 3 and second_forward(r.setup) is not None
        self.retraced = self.retraced or self.two_forwards

    def step_facts(self, r: ResolvedSetup, act: ActivationProfile, layers: int | None) -> StepFacts:
        """No FSDP2 units: DeepSpeed partitions the states itself; stage 3 releases a layer's parameters after its
        forward (reshard_unit)."""
        return replace(super().step_facts(r, act, layers), fsdp=False, reshard=r.method.zero_stage == 3)

    # ------------------------------------------------------------------------------------------ model states
    def setup_phase(self) -> None:
        """deepspeed.initialize: the module in the engine's dtype, the ZeRO optimizer's buffers."""
        sch, alloc, mb = self.sch, self.sch.alloc, self.mb
        sch.phase = "setup:setup"
        if self.objective is not None:    # TRL's trainer __init__ prepares its reference before train() the policy
            self.objective.reference_weights()
        for b in self.facts.params.buffers:     # module.bfloat16() / half() casts the buffers too; ZeRO leaves them whole
            alloc(b.numel * mb, "weights")
        if self.stage == 3:
            self.partitioned_weights()
        else:
            for p in self.facts.params.kept:           # frozen ones are not in the optimizer's groups: left whole
                if not p.trainable:
                    alloc(p.numel * mb, "weights")
            # stage_1_and_2.py: the trained parameters flattened into one buffer (they become views of it). The
            # copy needs them and the buffer at once ("2x model size ... params + flat copy"), an init-time peak
            # the notes give; DeepSpeed's empty_cache calls around it leave the step only the buffer
            alloc(self.partition * self.dp * mb, "weights")
        offload = self.zero.offload_optimizer
        self.vision.batch()               # a vision-language batch (ids, pixel_values, positions), made before the step
        if self.stage == 3:
            # the partition's gradient buffer (grad_partitions_flat_buffer; pinned host memory under the optimizer's
            # offload) and the one IPG bucket (__ipg_bucket_flat_buffer), both made at init
            self.zl.grad_partition = -1 if offload else alloc(self.partition * mb, "gradients")
            self.zl.bucket = alloc(self.zero.reduce_bucket_size * mb, "communication_buffers")
        if offload:
            return                        # the fp32 partition, its gradient and the states in pinned host memory
        # the fp32 master partition (single_partition_of_fp32_groups / fp32_partitioned_groups_flat); the
        # optimizer's states over it come at its first step, as torch's optimizers make them
        alloc(self.partition * F32, "weights")

    def partitioned_weights(self) -> None:
        """Stage 3: zero.Init partitions each parameter as it is built (HF's from_pretrained under ZeRO-3), then
        stage3.py _create_fp16_partitions_with_defragmentation moves the trained partitions into one flat buffer;
        persistent parameters stay whole on every rank after their first use. Under offload_param the partitions
        live in pinned host memory."""
        alloc, mb = self.sch.alloc, self.mb
        if not self.zero.offload_param:   # (the partitions moved into the buffer are freed at init: not laid out)
            alloc(self.partition * mb, "weights")
            frozen = sum(param_partition_numel(p.numel, self.dp) for p in self.facts.params.kept
                         if not p.trainable) * mb
            if frozen:
                alloc(frozen, "weights")
        for p in self.facts.params.kept:
            if p.name in self.persistent:
                alloc(p.numel * mb, "weights")

    def reference_numels(self) -> list[int]:
        """The reference copy's parameters on this rank, as TRL's prepare_deepspeed engine holds them: whole under
        stages 1-2 (its engine runs at stage 0), each parameter's ZeRO-3 partition under stage 3, the persistent
        ones (param_persistence_threshold) whole as well once its first forward has gathered them."""
        if self.stage < 3:
            return [p.numel for p in self.facts.params.kept]
        return [param_partition_numel(p.numel, self.dp) for p in self.facts.params.kept] + \
            [p.numel for p in self.facts.params.kept if p.name in self.persistent]

    def reference_fetch(self, where) -> None:
        """TRL's ZeRO-3 reference engine (DeepSpeedZeRoOffload, its own coordinator) in its no_grad forward:
        `where` is "start", a layer i, ("done", i), "head" or "end". Its first forward fetches each module and
        releases it after use; from its second on (its trace complete) the root's fetch prefetches the whole copy
        in one coalesced all-gather (the flat buffer, and each parameter's copy out of it at the first wait),
        each module released after its forward (its next use is the next step's), the flat with the last one."""
        if self.stage != 3:
            return
        sch, mb = self.sch, self.mb
        if where == "start":
            self.zl.ref_forwards += 1
            self.zl.ref_units, self.zl.ref_flat = {}, -1
            units = [u for u in [EMBED, *range(self.facts.layers), None] if self.numel_of(u)]
            if self.zl.ref_forwards > 1:
                flat = sum(self.numel_of(u) for u in units if u not in self.alone)
                self.zl.ref_flat = sch.alloc(flat * mb, "gathered_weights")
                self.zl.ref_units = {u: sch.alloc(self.numel_of(u) * mb, "gathered_weights") for u in units}
            elif self.numel_of(EMBED):
                self.zl.ref_units[EMBED] = sch.alloc(self.numel_of(EMBED) * mb, "gathered_weights")
        elif isinstance(where, int):
            sch.free(self.zl.ref_units.pop(EMBED, -1))
            if where not in self.zl.ref_units and self.numel_of(where):
                self.zl.ref_units[where] = sch.alloc(self.numel_of(where) * mb, "gathered_weights")
        elif isinstance(where, tuple):
            sch.free(self.zl.ref_units.pop(where[1], -1))
        elif where == "head":
            if None not in self.zl.ref_units and self.numel_of(None):
                self.zl.ref_units[None] = sch.alloc(self.numel_of(None) * mb, "gathered_weights")
        else:
            sch.free_all(list(self.zl.ref_units.values()))
            self.zl.ref_units = {}
            sch.free(self.zl.ref_flat)

    def flat_shapes(self) -> list[tuple[int]]:
        """The fp32 partition as the optimizer steps it: one flat tensor per sub-group (stage 3:
        sub_group_numels), the whole partition under stages 1-2."""
        if self.stage < 3:
            return [(self.partition,)]
        return [(n,) for n in sub_group_numels(self.in_partition, self.zero.sub_group_size)]

    # ------------------------------------------------------------------------------------------ stage 3 gathering
    def unit_params(self, unit_key: int | str | None) -> list[ParamInfo]:
        """A unit's gathered parameters: a decoder layer's, the input embedding's (EMBED) or the rest of the root's
        (None: final norm, lm_head), persistent ones excepted."""
        if isinstance(unit_key, str) and unit_key in self.tower:     # a vision tower's piece (deepspeed_tower)
            return [p for p in self.tower[unit_key] if p.name not in self.persistent]
        if unit_key == EMBED or unit_key is None:
            tower = {p.name for unit in self.tower.values() for p in unit}
            root = [p for p in self.facts.root if p.name not in self.persistent and p.name not in tower]
            return [p for p in root if (is_embedding(p) and p.tied_to is None) == (unit_key == EMBED)]
        return [p for p in self.facts.unit(unit_key) if p.name not in self.persistent]

    def gather(self, unit_key: int | None) -> None:
        """stage 3 fetch_sub_module: an all-gather of the unit's parameters into one flat buffer they view."""
        if unit_key in self.zl.live_units:
            self.fetched(unit_key)
            return
        numel = sum(p.numel for p in self.unit_params(unit_key))
        if numel:
            self.zl.live_units[unit_key] = self.sch.alloc(numel * self.mb, "gathered_weights")

    def release(self, unit_key: int | None, distance_numel: int) -> None:
        """release_sub_module: freed unless it is used again within max_reuse_distance elements (only once the
        first step has recorded the module trace: partitioned_param_coordinator.__params_to_release)."""
        if unit_key in self.zl.live_units and (self.recording() or self.on_forward_trace()
                                            or distance_numel >= self.zero.max_reuse_distance):
            self.sch.free(self.zl.live_units.pop(unit_key))

    def fetched(self, unit_key: int | str | None) -> None:
        """fetch_sub_module of a prefetched unit pops its parameters from the in-flight registry; a coalesced
        all-gather's handle (AllGatherCoalescedHandle: its flat buffer, partition_parameters.py) dies with the
        last of them."""
        for entry in list(self.zl.inflight):
            key, pending = entry
            pending.discard(unit_key)
            if not pending:
                self.sch.free(key)
                self.zl.inflight.remove(entry)

    def coalesced(self, units: list[int | str | None]) -> None:
        """One all_gather_coalesced over the prefetched `units` (partition_parameters.py _all_gather_coalesced):
        the flat buffer of all their parameters, then at the first wait each parameter its own torch.cat copy out
        of it (AllGatherCoalescedHandle.wait); a single parameter goes the sequential way, without the flat one."""
        flat = [u for u in units if u not in self.alone]
        if sum(len(self.unit_params(u)) for u in flat) > 1:
            numel = sum(self.numel_of(u) for u in flat)
            self.zl.inflight.append((self.sch.alloc(numel * self.mb, "gathered_weights"), set(flat)))
        for u in units:
            self.gather(u)

    def prefetch_after(self, order: list[int | None]) -> None:
        """Prefetch of the next units in the trace, up to stage3_prefetch_bucket_size elements and while fewer
        than stage3_max_live_parameters are gathered (none in the first step: the trace is not complete)."""
        if self.recording() and not self.on_forward_trace():
            return
        budget = self.zero.prefetch_bucket_size
        live = sum(self.numel_of(u) for u in self.zl.live_units)
        batch = []
        for u in order:
            n = self.numel_of(u)
            if u in self.zl.live_units or not n:
                continue
            if n > budget or live + n > self.zero.max_live_parameters:
                break
            batch.append(u)
            budget, live = budget - n, live + n
        self.coalesced(batch)

    def recording(self) -> bool:
        """The coordinator's trace is not complete in this step (the first one; every one under GRPO / RLOO)."""
        return self.zl.iteration == 0 or self.retraced

    def on_forward_trace(self) -> bool:
        """The second root forward of a two-forward step: on the trace of the first (complete, forward only)."""
        return self.two_forwards and self.zl.root_forwards >= 2

    def gather_for_generation(self) -> list[int]:
        """TRL's unwrap_model_for_generation (trl/models/utils.py, ds3_gather_for_generation True, GRPOConfig's
        default) before generate: under ZeRO-3 deepspeed.zero.GatheredParameters over all the engine's parameters
        (partition_parameters.py _allgather_params_coalesced: one buffer of ceil(numel / dp) x dp elements per
        parameter not yet available, in the engine's dtype; the persistent ones are already whole), then
        remove_hooks (no per-module fetch in generate's forwards); nothing under stages 1-2. Returns the keys."""
        self.zl.generating = True
        if self.stage != 3:
            return []
        return [self.sch.alloc(param_partition_numel(p.numel, self.dp) * self.dp * self.mb, "gathered_weights")
                for p in self.facts.params.kept if p.name not in self.persistent]

    def release_after_generation(self, keys: list[int]) -> None:
        """add_hooks, then GatheredParameters' exit: each parameter partitioned again (its full buffer freed)."""
        self.zl.generating = False
        self.sch.free_all(keys)

    def numel_of(self, unit_key: int | str | None) -> int:
        return self.layer_numel.get(unit_key, 0)

    def forward_distance(self, i: int) -> int:
        """Elements fetched between a unit's forward and its backward: the layers above it twice and the head
        (the embedding, i = -1: all of them, and a vision tower's pieces)."""
        above = sum(self.numel_of(j) for j in range(i + 1, self.facts.layers))
        tower = sum(self.numel_of(u) for u in self.tower) * 2 if i < 0 else 0
        return 2 * above + self.numel_of(None) + tower

    # a vision tower's pieces (llmem.estimator.deepspeed_tower), between the input embedding and decoder layer 0
    def tower_order(self, backward: bool = False) -> list[str]:
        if not self.tower:
            return []
        return self.vision.units.backward_order() if backward else list(self.tower)

    def after_tower(self) -> list[int | None]:
        return [*range(self.facts.layers), None]

    def before_tower(self) -> list[str]:
        return [EMBED]

    def language_distance(self) -> int:
        """Elements fetched from the tower's end to its backward: the decoder layers twice and the head."""
        return self.forward_distance(-1) - sum(self.numel_of(u) for u in self.tower) * 2

    def release_embedding(self) -> None:
        self.release(EMBED, self.forward_distance(-1))

    def gather_embedding(self) -> None:
        self.gather(EMBED)

    # the PyTorch step's hooks, as stage 3 runs them (stages 1-2 gather nothing)
    def unshard_forward(self, unit_key: int | None, unit: list[ParamInfo]) -> None:
        if self.stage != 3 or self.zl.generating:
            return
        if unit_key is None:              # the model's forward starts with the input embedding
            self.zl.root_forwards += 1
            # the root module's fetch (no parameters of its own) prefetches from the embedding on
            self.prefetch_after([EMBED, *self.tower_order(), *range(self.facts.layers), None])
            self.gather(EMBED)
            return
        if unit_key == 0:
            self.release(EMBED, self.forward_distance(-1))
        self.gather(unit_key)
        self.prefetch_after([*range(unit_key + 1, self.facts.layers), None])

    def head_forward(self) -> None:
        if self.stage == 3:
            self.gather(None)
        super().head_forward()

    def head_backward(self, it: int) -> None:
        super().head_backward(it)
        if self.stage == 3 and not self.head_to_epilogue():     # the head's next use is the next step's forward
            self.release(None, self.zero.max_reuse_distance)

    def head_to_epilogue(self) -> bool:
        """TRL's fused head gathers the lm_head for its backward itself (maybe_gather_lm_head_ctx); in a step
        without a complete trace it stays gathered, as the embedding does, until the backward's epilogue has
        reduced the last bucket (the trace: both freed after the final reduce_scatter's flattened copy)."""
        return None in self.alone and self.recording()

    def backward_layer(self, i: int, it: int) -> None:
        super().backward_layer(i, it)
        if self.stage == 3:
            self.release(i, self.zero.max_reuse_distance)      # next used in the next step
            if i == 0 and not self.tower_order(backward=True):
                self.gather(EMBED)        # the embedding's backward follows (after a vision tower's: deepspeed_tower)

    def unshard_backward(self, unit_key: int | None, unit: list[ParamInfo]) -> None:
        if self.stage == 3 and unit_key is not None:
            self.gather(unit_key)
            self.prefetch_after([*range(unit_key - 1, -1, -1), *self.tower_order(backward=True), EMBED])

    def prefetch(self, unit_key: int | None, unit: list[ParamInfo]) -> None:
        return                            # stage 3 prefetches through its own coordinator (prefetch_after)

    def reshard_unit(self, unit_key: int | None) -> None:
        """After a layer's forward (the PyTorch step calls it where FSDP2 reshards)."""
        if self.stage == 3 and isinstance(unit_key, int) and not self.zl.generating:
            self.release(unit_key, self.forward_distance(unit_key))

    # ------------------------------------------------------------------------------------------ gradients
    def backward(self, it: int) -> None:
        """engine.backward: the autograd backward (stages 1-2 set up their IPG buffers at its first gradient,
        make_grad), then the epilogue: the last bucket reduced, stages 1-2's buffers released
        (_release_ipg_buffers; stage 3's one bucket, made at init, stays)."""
        self.zl.iteration = it
        self.zl.root_forwards = 0            # the backward invalidates a forward-only trace: the next step records
        sch = self.sch
        sch.phase = f"it{it}:backward"
        self.zl.bucket_filled = 0
        super().backward(it)
        pending, self.zl.pending = self.zl.pending, []     # (a root gradient whose hook no flush reached)
        for p, key in pending:
            self.hand_over_grad(p, key)
        # gradients handed over whole (the fused loss's lm_head gradient)
        stolen = list(self.state.grads.grads.values())
        self.state.grads.grads.clear()
        if self.stage == 3 and not self.head_to_epilogue():
            self.release(EMBED, self.zero.max_reuse_distance)
        if self.stage == 1:
            self.zl.full_grads += [(k, self.sch.size_of(k) // self.mb) for k in stolen]
            self.reduce_whole_gradients()
        else:
            self.sch.free_all(stolen)
            if self.zl.bucket_filled:
                self.reduce_bucket(self.zl.bucket_filled)
        if self.stage == 3 and self.head_to_epilogue():
            self.release(EMBED, self.zero.max_reuse_distance)
            self.release(None, self.zero.max_reuse_distance)
        if self.stage < 3:
            sch.free(self.zl.bucket)
            self.zl.bucket = -1

    def forward(self, it: int) -> None:
        self.zl.iteration = it
        super().forward(it)

    def make_grad(self, p: ParamInfo, root_unit: bool = False, low: int | None = None) -> None:
        """AccumulateGrad's whole gradient in the module's dtype. ZeRO-1 keeps it until the step; under stages 2-3
        the reduce hook copies it into the IPG bucket at once (reduce_independent_p_g_buckets_and_remove_grads) and
        it dies; a bucket that would overflow is reduced first. A root parameter's (the lm_head's, the
        embedding's) is made by its node while the node's inputs live (the loss's gradient): the hook, a
        post-accumulate-grad hook, runs once the node has released them (flush_steps)."""
        if root_unit:
            self.zl.pending.append((p, self.sch.alloc(p.numel * self.mb, "gradients")))
            return
        self.setup_buckets()
        self.hand_over_grad(p, self.sch.alloc(p.numel * self.mb, "gradients"))

    def flush_steps(self, it: int) -> None:
        """The reduce hooks of the root's gradients made so far (make_grad), then the PyTorch step's."""
        pending, self.zl.pending = self.zl.pending, []
        for p, key in pending:
            self.hand_over_grad(p, key)
        super().flush_steps(it)

    def setup_buckets(self) -> None:
        """Stages 1-2's setup_buckets at the backward's first gradient."""
        if self.stage < 3 and self.zl.bucket < 0:
            self.zl.bucket = self.sch.alloc(bucket_buffers(self.zero) * self.zero.reduce_bucket_size * self.mb,
                                         "communication_buffers")

    def hand_over_grad(self, p: ParamInfo, key: int) -> None:
        """ZeRO's reduce hook on the gradient `key` of `p` as AccumulateGrad leaves it (also the one TRL's fused
        head returns for the lm_head): ZeRO-1 keeps it, stages 2-3 copy it into the bucket and it dies."""
        self.setup_buckets()
        if self.stage == 1:
            self.zl.full_grads.append((key, p.numel))
            return
        self.sch.free(key)
        if self.zl.bucket_filled + p.numel > self.zero.reduce_bucket_size:
            self.reduce_bucket(self.zl.bucket_filled)
        self.zl.bucket_filled += p.numel

    def reduce_whole_gradients(self) -> None:
        """ZeRO-1's epilogue (reduce_gradients, no overlap_comm): the whole gradients go into the bucket a bucket's
        worth at a time (each freed as it is copied in), each full bucket reduced through a flattened copy; this
        rank's share is kept from the first one on (averaged_gradients: the parameters overlapping its partition,
        whole)."""
        filled, batch = 0, []
        for key, numel in self.zl.full_grads:
            if batch and filled + numel > self.zero.reduce_bucket_size:
                self.flush_whole(batch, filled)
                filled, batch = 0, []
            batch.append(key)
            filled += numel
        if batch:
            self.flush_whole(batch, filled)
        self.zl.full_grads.clear()

    def flush_whole(self, keys: list[int], numel: int) -> None:
        self.sch.free_all(keys)
        self.reduce_bucket(numel)
        if self.zl.grad_partition < 0:
            self.zl.grad_partition = self.sch.alloc(sum(self.in_partition) * self.mb, "gradients")

    def reduce_bucket(self, numel: int) -> None:
        """reduce_ipg_grads of `numel` bucketed elements: a flattened copy of the bucket for the collective
        (stages 1-2: allreduce_bucket's flatten; stage 3: reduce_scatter_coalesced's torch.cat), then stage 2
        copies this rank's share into grads_in_partition (allocated at the first copy: copy_grads_in_partition)
        and stage 3 into its gradient partition buffer."""
        chunk = min(numel, self.zero.reduce_bucket_size) * self.mb
        for _ in range(-(-numel // self.zero.reduce_bucket_size) if numel else 0):
            self.sch.free(self.sch.alloc(chunk, "communication_buffers"))
        if self.stage == 2 and self.zl.grad_partition < 0:
            # grads_in_partition; under the optimizer's offload the share goes to pinned host memory through
            # temp_grad_buffer_for_gpu_offload (the largest parameter's size)
            size = self.largest_numel if self.zero.offload_optimizer else sum(self.in_partition)
            self.zl.grad_partition = self.sch.alloc(size * self.mb, "gradients")
        self.zl.bucket_filled = 0

    # ------------------------------------------------------------------------------------------ the step
    def optimizer_step(self, it: int) -> None:
        """engine.step, per (sub-)group: the partition's gradients flattened and upcast to fp32 (stage_1_and_2.py
        step: flatten_dense_tensors_aligned(...).to(fp32); stage3.py _prepare_fp32_grad_for_sub_group), the optimizer
        step on the flat fp32 partition, the fp32 gradient released, the updated weights copied back into the bf16
        partition and all-gathered in place (all_gather_into_tensor: no buffer). Then zero_grad."""
        sch = self.sch
        sch.phase = f"it{it}:optimizer_step"
        sch.mark("optimizer step")
        if not self.zero.offload_optimizer:
            self.grad_norm()
            for shape in self.flat_shapes():
                flat = sch.alloc(shape[0] * self.mb, "optimizer_temporaries")
                grad = sch.alloc(shape[0] * F32, "optimizer_temporaries")
                sch.free(flat)
                if self.stage < 3:        # averaged_gradients dropped once upcast
                    sch.free(self.zl.grad_partition)
                    self.zl.grad_partition = -1
                if it == 0:               # torch's optimizer makes its states at its first step
                    self.state.states.extend(sch.alloc(b, "optimizer_states")
                                             for b in self.facts.optimizer.states(shape, F32))
                self.flat_step_temporaries(shape)
                sch.free(grad)
        if self.stage < 3:
            sch.free(self.zl.grad_partition)
            self.zl.grad_partition = -1

    def grad_norm(self) -> None:
        """compute_grad_norm (on by default): get_grad_norm_direct takes each gradient view of this rank's share to
        get_norm_dtype (fp64) for torch.linalg.vector_norm, one after the other."""
        for n in self.norm_numels:
            self.sch.free(self.sch.alloc(n * 8, "optimizer_temporaries"))

    def flat_step_temporaries(self, shape: tuple[int]) -> None:
        spec = self.facts.optimizer
        if spec.step_scope == NO_TEMPORARIES:
            return
        keys: dict[int, int] = {}
        for sign, tag, size in spec.step_events([shape], F32, 1):
            if sign > 0:
                keys[tag] = self.sch.alloc(size, "optimizer_temporaries")
            else:
                self.sch.free(keys.pop(tag))
