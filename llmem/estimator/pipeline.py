"""Pipeline parallelism on the estimator floor: one allocation schedule per pipeline rank.

The answer is the rank with the largest peak.

A rank's schedule is the step's own (llmem.estimator.schedule.StepSchedule) on the rank's sub-model: its stages'
decoder layers (torchtitan's split, llmem.setup.pipeline), the embedding on the first stage, the final norm, lm_head
and loss on the last, at the micro-batch's size. Each stage's forward and backward run once per micro-batch in the
order torch's schedule runs them (Schedule1F1B / ScheduleGPipe `_step_microbatches`; a looped schedule's
pipeline_order, ScheduleInterleaved1F1B's over the rank's stages r, r + pp, ...), each (stage, micro-batch)'s saved
tensors kept from its forward to its backward. What torch.distributed.pipelining adds
(torch/distributed/pipelining/stage.py):
- the recv buffers, made at the first step for every micro-batch and kept: the previous stage's activations (every
  stage but the first) and the next stage's gradients (every stage but the last), [micro-batch, seq, hidden] each;
- the stage's output is kept in `fwd_cache` until its backward (the last stage's: the logits, through its
  backward: backward_one_chunk holds the popped tuple);
- the input gradient (every stage but the first) is made at the backward's end and sent;
- the last micro-batch's output stays referenced by _step_microbatches' `output` until the step returns (a single-
  stage schedule's; _PipelineScheduleRuntime's actions keep none);
- gradients accumulate over the micro-batches: AccumulateGrad adds each later one in place (a transient of the
  gradient's size).
Under FSDP2 x PP (torchtitan: reshard_after_forward=False under PP) each unit stays gathered from its first forward
to perform_reduce_grad after the last backward; every backward runs with requires_gradient_sync False, so the
unsharded gradients accumulate (upcast to the reduce dtype, FSDPParam.to_accumulated_grad_if_needed) and are
reduce-scattered only then, one FSDP state after the other (the root's first).
Under TP x PP (torchtitan's parallelize_llama on each stage's model chunk, FSDP2 over dp on top) the stage's
parameters, activations and logits are the TP step's (StepSchedule's, on the stage's sub-model); what differs:
the stages send and receive the residual stream's local [micro-batch, seq / tp, hidden] shard under
--sequence-parallel, and the vocab-parallel embedding's gradient comes back Partial over tp at its full
[vocab, hidden] size, so it accumulates so over the micro-batches (FSDPParam.to_accumulated_grad_if_needed keeps
the placement) until _get_grad_inner_tensor redistributes it to its shard at the reduce.
"""

from __future__ import annotations

from dataclasses import replace

from llmem.estimator.deepen import alike_layers, whole_from_template
from llmem.estimator.events import REDUCE_SCATTER, Replay, Schedule, built_within, replay
from llmem.estimator.identity_cache import IdentityCache
from llmem.estimator.schedule import StepFacts, StepSchedule
from llmem.estimator.schedule.state import ForwardLive
from llmem.memory.activations.profile import ActivationProfile, activation_profile
from llmem.model.anatomy import ModelAnatomy, ParamInfo
from llmem.model.resolved import ResolvedSetup
from llmem.model.sharding import MATMUL_KINDS, is_embedding
from llmem.setup.pipeline import StageSplit, pipeline_schedule, rank_actions, rank_splits, stages_per_rank

# the pipeline ranks' sub-models of one plan's searches (one object per rank, so the schedules built for one rank
# share their parameters' facts: llmem.estimator.param_facts)
_STAGE_ANATOMIES: IdentityCache[ModelAnatomy] = IdentityCache(64)


def stage_anatomy(anatomy: ModelAnatomy, splits: tuple[StageSplit, ...]) -> ModelAnatomy:
    """The rank's sub-model: its stages' decoder layers renumbered from 0 (in stage order), the embedding if it
    holds the first stage, the final norm and lm_head if it holds the last (worked out once per model and splits)."""
    return _STAGE_ANATOMIES.get(anatomy, splits, lambda: _stage_anatomy(anatomy, splits))


def _stage_anatomy(anatomy: ModelAnatomy, splits: tuple[StageSplit, ...]) -> ModelAnatomy:
    index = {layer: k for k, layer in enumerate(i for s in splits for i in s.layers)}
    embedding, head = any(s.embedding for s in splits), any(s.head for s in splits)

    def keep(p: ParamInfo) -> bool:
        if p.layer_index is not None:
            return p.layer_index in index
        return embedding if is_embedding(p) else head

    params = tuple(p if p.layer_index is None else replace(p, layer_index=index[p.layer_index])
                   for p in anatomy.params if keep(p))
    return replace(anatomy, params=params, num_layers=len(index))


def chunk_layers(splits: tuple[StageSplit, ...]) -> tuple[range, ...]:
    """Each of the rank's stages' layers in the rank's numbering (stage_anatomy's)."""
    out, start = [], 0
    for s in splits:
        out.append(range(start, start + len(s.layers)))
        start += len(s.layers)
    return tuple(out)


class StageSchedule(StepSchedule):
    """One pipeline rank's step: its stages' micro-batch forwards and backwards in the schedule's order (under a
    looped schedule each action runs one of the rank's stages, `chunk`)."""

    def __init__(self, r: ResolvedSetup, splits: tuple[StageSplit, ...], rank: int) -> None:
        setup = r.setup
        self.n = setup.microbatches
        mb = replace(setup, batch_size=setup.batch_size // self.n, pp=1, pp_microbatches=None,
                     pp_virtual_stages=None)
        staged = replace(r, setup=mb, anatomy=stage_anatomy(r.anatomy, splits))
        super().__init__(staged, activation_profile(staged))
        self.splits, self.chunk_layers = splits, chunk_layers(splits)
        self.split = splits[0]
        spec = pipeline_schedule(setup.pp_schedule)
        # _PipelineScheduleRuntime's actions keep no forward's output past its action (PipelineScheduleSingle's
        # _step_microbatches holds the last one in its `output` local until step() returns)
        self.holds_last_output = not spec.looped
        self.actions = rank_actions(setup.pp_schedule, rank, r.layout.pp, self.n, len(splits))
        # one micro-batch's hidden states (under --sequence-parallel their local [mb, seq / tp, hidden] shard: the
        # stage's output is the last block's Shard(1) residual stream, torchtitan's use_local_output)
        f = self.facts
        self.boundary_bytes = f.t * f.hidden_size * f.regime.res // (r.layout.tp if setup.sequence_parallel else 1)
        self.saved: dict[tuple[int, int], ForwardLive] = {}   # what each forward leaves for its backward
        self.recv: list[int] = []
        self.accumulating = False
        self.fresh: list[tuple[ParamInfo, int]] = []        # a unit's unsharded gradients of this backward
        self.root_fresh: list[tuple[ParamInfo, int]] = []
        self.accumulated: dict[str, int] = {}               # across micro-batches, until perform_reduce_grad
        self.last_output: list[int] = []
        self.latest: tuple[int, int] | None = None          # the (stage, micro-batch) of the latest forward

    def step_facts(self, r: ResolvedSetup, act: ActivationProfile, layers: int | None) -> StepFacts:
        """FSDP2 x PP: torchtitan's reshard_after_forward=False under PP (fsdp.py); the stage sets
        requires_gradient_sync / reshard_after_backward False for every backward (backward_maybe_with_nosync)."""
        return replace(super().step_facts(r, act, layers), reshard=False)

    def lay_out(self, iterations: int) -> None:
        self.setup_phase()
        for it in range(iterations):
            if it == 0:
                self.recv_buffers()
            self.accumulating = False
            for kind, c, k in self.actions:
                if kind == "F":
                    self.forward_microbatch(it, c, k)
                else:
                    self.backward_microbatch(it, c, k)
            if self.facts.fsdp:
                self.reduce_grads()
            self.sch.free_all(self.last_output)
            self.last_output = []
            self.optimizer_step(it)

    def recv_buffers(self) -> None:
        """_initialize_pp_stages: each stage's forward recv buffers of every micro-batch (stages in order), then the
        backward ones (stages in reverse), kept from then on."""
        self.sch.phase = "it0:forward"
        alloc = self.sch.alloc
        for split in self.splits:
            if not split.embedding:
                self.recv += [alloc(self.boundary_bytes, "communication_buffers") for _ in range(self.n)]
        for split in reversed(self.splits):
            if not split.head:
                self.recv += [alloc(self.boundary_bytes, "communication_buffers") for _ in range(self.n)]

    # ------------------------------------------------------------------------------------------ one micro-batch
    def forward_microbatch(self, it: int, c: int, k: int) -> None:
        sch, alloc, act = self.sch, self.sch.alloc, self.facts.act
        split = self.split = self.splits[c]
        sch.phase = f"it{it}:forward"
        sch.mark(f"stage {split.index} micro-batch {k} forward")
        fwd = self.state.forward = ForwardLive()
        fwd.embed_keys = sch.alloc_many(act.embed_tensors, "activations") if split.embedding else []
        fwd.shared_keys = sch.alloc_many(act.shared_tensors, "activations")   # each stage's rotary cos/sin
        self.ensure_workspace()
        if self.facts.root:
            self.unshard_forward(None, self.facts.root)
        for i in self.chunk_layers[c]:
            self.forward_layer(i)
        sch.own(None)
        self.release_forward_gathers()
        if split.head:
            self.head_forward()            # the logits stay: the stage's output, in fwd_cache until backward
        else:                              # the last layer's output: sent, and kept in fwd_cache
            fwd.output = alloc(self.boundary_bytes, "activations")
        self.saved[c, k] = fwd
        if self.holds_last_output:   # _step_microbatches' `output = forward_one_chunk(...)` drops the previous one
            sch.free_all(self.last_output)
            self.last_output, self.latest = [], (c, k)

    def backward_microbatch(self, it: int, c: int, k: int) -> None:
        sch, alloc, f = self.sch, self.sch.alloc, self.facts
        fwd = self.state.forward = self.saved.pop((c, k))
        split = self.split = self.splits[c]
        sch.phase = f"it{it}:backward"
        sch.mark(f"stage {split.index} micro-batch {k} backward")
        if split.head:
            self.head_backward(it)
        for i in reversed(self.chunk_layers[c]):
            self.backward_layer(i, it)
        sch.own(None)
        if split.embedding:
            embeds = [p for p in f.root if p.trainable and is_embedding(p)]
            stream_grad = alloc(f.t * f.hidden_size * f.regime.res, "activations") if embeds else -1
            for p in embeds:
                self.make_grad(p, root_unit=True)
            sch.free(stream_grad)
        else:                               # the input's gradient, sent to the previous stage
            sch.free(alloc(self.boundary_bytes, "activations"))
        sch.free_all(fwd.embed_keys)
        sch.free_all(fwd.shared_keys)
        # `output` holds the latest forward's until the next forward returns (or step() does: the last one's)
        if self.holds_last_output and (c, k) == self.latest:
            self.last_output = [fwd.output, fwd.logits]
        else:
            sch.free(fwd.output)
            sch.free(fwd.logits)
        if f.fsdp:       # the root's post_backward, in the final callback
            self.accumulate_unsharded(self.root_fresh)
        self.accumulating = True

    # ------------------------------------------------------------------------------------------ FSDP2 x PP
    def reduce_scatter_layer(self, i: int) -> None:
        """FSDPParamGroup.post_backward with reduce_grads False: no reduce-scatter, no reshard; the gradients
        accumulate unsharded."""
        self.accumulate_unsharded(self.fresh)

    def accumulate_unsharded(self, fresh: list[tuple[ParamInfo, int]]) -> None:
        """FSDPParam.to_accumulated_grad_if_needed (first micro-batch: the gradient upcast to the reduce dtype,
        unsharded_accumulated_grad, where that differs) and accumulate_unsharded_grad_if_needed (later ones: added
        in place, the new gradient freed)."""
        sch = self.sch
        for p, key in fresh:
            if p.name in self.accumulated:
                sch.free(key)
            elif self.facts.reduce_bytes != self.facts.gather_bytes:
                self.accumulated[p.name] = sch.alloc(self.grad_numel(p) * self.facts.reduce_bytes, "gradients")
                sch.free(key)
            else:
                self.accumulated[p.name] = key
        fresh.clear()

    def grad_numel(self, p: ParamInfo) -> int:
        """The elements of an unsharded gradient: FSDP2's unsharded parameter (its TP-local shard), or under TP a
        vocab-parallel embedding's whole [vocab, hidden] (its gradient comes back Partial over tp, full size, and
        accumulates so: FSDPParam.to_accumulated_grad_if_needed's .to(reduce_dtype) keeps the placement)."""
        return p.numel if p.name in self.facts.params.vocab_parallel else self.facts.params.unsharded[p.name]

    def redistribute_partial(self, params: list[ParamInfo]) -> None:
        """FSDPParam.unsharded_accumulated_grad_data (_get_grad_inner_tensor): a Partial gradient redistributed to
        the parameter's TP placement (a reduce-scatter over tp to its local shard), the full one then dropped."""
        sch, facts = self.sch, self.facts.params
        for p in params:
            if p.name in facts.vocab_parallel and p.name in self.accumulated:
                local = sch.alloc(facts.tp_local[p.name] * self.facts.reduce_bytes, "gradients")
                sch.free(self.accumulated[p.name])
                self.accumulated[p.name] = local

    def reduce_grads(self) -> None:
        """perform_reduce_grad after the last backward: each FSDP state's post_backward (the root's first, then the
        layers'), each resharding, then foreach_reduce's input (the accumulated gradients copied in) and its
        sharded output."""
        sch, alloc, f = self.sch, self.sch.alloc, self.facts
        units = ([None] if any(p.trainable for p in f.root) else []) + list(range(f.layers))
        pending: list[int] = []
        for u in units:
            sch.own(u)
            params = f.unit(u)
            self.reshard_unit(u)
            sch.free_all(pending)
            self.redistribute_partial(params)
            rs_bytes = f.unit_bytes(params, f.reduce_bytes, True)
            rs_in = alloc(rs_bytes, "communication_buffers")
            self.units.sharded_grads(alloc(rs_bytes // f.shards, "gradients", REDUCE_SCATTER))
            sch.free_all([self.accumulated.pop(p.name) for p in params if p.name in self.accumulated])
            pending = [rs_in]
        sch.own(None)
        sch.free_all(pending)
        for u in list(self.state.units.gathered):
            self.reshard_unit(u)

    def make_grad(self, p: ParamInfo, root_unit: bool = False, low: int | None = None) -> None:
        """Later micro-batches: AccumulateGrad adds the new gradient into .grad in place (the new one, and under
        autocast its low-precision matmul output, freed after). FSDP2: the unsharded gradient, in the gathered
        dtype, for its unit's post_backward."""
        f = self.facts
        if f.fsdp:
            key = self.sch.alloc(self.grad_numel(p) * f.gather_bytes, "gradients")
            (self.root_fresh if root_unit else self.fresh).append((p, key))
            return
        if p.name not in self.state.grads.grads:
            return super().make_grad(p, root_unit, low)
        # a vocab-parallel embedding's gradient: full size, Partial over tp (Gradients.make's)
        numel = p.numel if p.name in f.params.vocab_parallel else f.params.shard_numel[p.name]
        sch, size = self.sch, numel * f.params.element_bytes[p.name]
        low = sch.alloc(f.params.tp_local[p.name] * f.regime.mm, "gradients") \
            if f.regime.autocast and p.module_kind in MATMUL_KINDS else -1
        new = sch.alloc(size, "gradients")
        sch.free(low)
        sch.free(new)


def splits_of(r: ResolvedSetup, rank: int) -> tuple[StageSplit, ...]:
    """The stages pipeline rank `rank` holds (one, or its chunks under a looped schedule)."""
    return rank_splits(r.anatomy.num_layers, r.layout.pp, stages_per_rank(r.setup.pp_schedule,
                                                                         r.setup.pp_virtual_stages), rank)


def stage_replays(r: ResolvedSetup) -> list[Replay]:
    """Each pipeline rank's stage schedule through the allocator model."""
    return [replay(stage_whole(r, rank), expandable_segments=r.setup.expandable_segments) for rank in range(r.layout.pp)]


def pipeline_step(r: ResolvedSetup) -> tuple[Replay, int, list[dict]]:
    """The answer stage's replay (the largest reserved peak, as the trace picks it), its index, and every stage's
    peaks."""
    reps = stage_replays(r)
    top = max(range(len(reps)), key=lambda k: (reps[k].peak_reserved_bytes, reps[k].peak_allocated_bytes))
    return reps[top], top, [{"stage": k, "peak_allocated_bytes": rep.peak_allocated_bytes,
                             "peak_reserved_bytes": rep.peak_reserved_bytes} for k, rep in enumerate(reps)]


def stage_builder(r: ResolvedSetup, rank: int) -> StageSchedule:
    """Rank `rank`'s stage schedule, not yet built."""
    return StageSchedule(r, splits_of(r, rank), rank)


def stage_whole(r: ResolvedSetup, rank: int) -> Schedule:
    """Stage `rank`'s schedule (for the replay at a device's capacity): deepened from its template layer where the
    rank holds one stage of alike layers (llmem.estimator.deepen), else built."""
    splits = splits_of(r, rank)
    got = stage_from_template(r, splits[0], rank) if len(splits) == 1 else None
    return got if got is not None else stage_builder(r, rank).build()


def stage_from_template(r: ResolvedSetup, split: StageSplit, rank: int) -> Schedule | None:
    """Rank `rank`'s one stage `split` deepened from its template layer, or None where it is built instead."""
    if r.method.gradient_buckets or not alike_layers(stage_anatomy(r.anatomy, (split,)), activation_profile(r)):
        return None

    def build(layers: int) -> Schedule:
        return StageSchedule(r, (replace(split, stop_layer=split.first_layer + layers),), rank).build()

    return whole_from_template(build, len(split.layers))


def pipeline_note(r: ResolvedSetup, top: int) -> str:
    splits = splits_of(r, top)
    spec = pipeline_schedule(r.setup.pp_schedule)
    held = spec.microbatches_in_flight(top, r.layout.pp, r.setup.microbatches, len(splits))
    parts = (["embedding"] if splits[0].embedding else []) \
        + [f"layers {s.first_layer}-{s.stop_layer - 1}" for s in splits if len(s.layers)] \
        + (["norm, lm_head and loss"] if splits[-1].head else [])
    chunks = f"; stages {', '.join(str(s.index) for s in splits)} of {r.layout.pp * len(splits)}" \
        if len(splits) > 1 else ""
    unit = "stage forward(s)" if len(splits) > 1 else "micro-batch(es)"
    return (f"pipeline ({spec.torch_class}, {r.setup.microbatches} micro-batches of "
            f"{r.setup.batch_size // r.setup.microbatches}): the answer is {'rank' if chunks else 'stage'} {top} of "
            f"{r.layout.pp} "
            f"({', '.join(parts)}{chunks}; {held} {unit} in flight){_tp_note(r)}; each stage's peaks are in "
            "`stages`")


def _tp_note(r: ResolvedSetup) -> str:
    """TP x PP: each stage's modules under the TP plan, the residual stream sent between them."""
    if r.layout.tp == 1:
        return ""
    seq = f"seq / {r.layout.tp}" if r.setup.sequence_parallel else "seq"
    return f"; each stage tensor-parallel over tp {r.layout.tp}, sending [micro-batch, {seq}, hidden]"


# the ranks whose schedules bound the pipeline's memory from below: the first (the embedding and, under 1F1B, the
# most micro-batches in flight) and the last (lm_head, the logits)
FLOOR_RANKS = (0, -1)


def pipeline_allocated_floor(r: ResolvedSetup, over_bytes: int | None = None) -> int:
    """A lower bound on the pipeline's largest stage allocated peak, with no allocator replay: the tensor peak of the
    first and the last rank's schedules (built, not replayed; built only until their live tensors pass
    `over_bytes`: a floor over it is then the live bytes where the build stopped, itself over).
    Over the device's capacity, that rank's step runs out of memory at this micro-batch (its allocated peak alone
    is over: llmem.memory.capacity's case 2)."""
    floor = 0
    for rank in FLOOR_RANKS:
        builder = stage_builder(r, rank % r.layout.pp)
        if over_bytes is None:
            builder.build()
        elif built_within(builder, over_bytes) is None:     # over: its build stopped there
            return builder.sch.peak_live_bytes
        floor = max(floor, builder.sch.peak_live_bytes)
    return floor
