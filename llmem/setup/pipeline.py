"""Pipeline parallelism on the set-up floor: the schedules' registry rows and torchtitan's split into stages.

Pipeline parallelism as torch.distributed.pipelining runs it under torchtitan: the schedules (one registry row
each), how many micro-batches a stage holds in flight under each, and torchtitan's split of the model into stages.

The schedules are torch's (torch/distributed/pipelining/schedules.py); the split is torchtitan's
(torchtitan/distributed/pipeline_parallel.py `_generate_llm_fqn_per_model_part`, `_get_pipeline_metadata`,
`_get_pp_rank_to_stage_indices_mapping`). Nothing here imports torch: tests/estimator/test_pipeline.py checks the counts and
each rank's order of stage forwards and backwards (`rank_actions`) against torch's own action lists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmem.errors import LlmemError

# torchtitan's ParallelismConfig defaults (torchtitan/config/configs.py): the embedding and the norm + lm_head each
# count as one layer in the split
FIRST_STAGE_LESS_LAYERS = 1
LAST_STAGE_LESS_LAYERS = 1
# the methods a pipeline stage runs under (others refused): pure PP, FSDP2 x PP, TP x PP and FSDP2 x TP x PP
PP_METHODS = ("single", "fsdp", "tp", "fsdp+tp")
# ... and a looped schedule (several stages per rank) under: those without FSDP2
LOOPED_METHODS = ("single", "tp")


def _all(rank: int, pp: int, microbatches: int, virtual: int) -> int:
    """ScheduleGPipe: every forward before the first backward (its _get_pipeline_order)."""
    return microbatches


def _one_f_one_b(rank: int, pp: int, microbatches: int, virtual: int) -> int:
    """Schedule1F1B: pp - 1 - rank warm-up forwards, then one forward and one backward alternately."""
    return min(microbatches, pp - rank)


def _flush_bubble(pp: int, microbatches: int, virtual: int) -> float:
    """The idle share of a flushing schedule's step (GPipe, 1F1B: one stage per rank): each rank waits pp - 1
    micro-batch slots to fill and pp - 1 to drain, around its m busy ones: (pp - 1) / (m + pp - 1). A looped row
    overrides it with its virtual stages (`bubble`)."""
    return (pp - 1) / (microbatches + pp - 1)


def _interleaved_warmup(rank: int, pp: int, microbatches: int, virtual: int) -> int:
    """torch's _get_warmup_ops (multiply_factor 2): (v - 1) x micro-batches per round on the last rank, 2 more per
    hop from it, capped at v x n (rounds: ScheduleInterleaved1F1B's max(1, n // pp))."""
    per_round = microbatches // max(1, microbatches // pp)
    return min((virtual - 1) * per_round + 2 * (pp - 1 - rank), microbatches * virtual)


def _interleaved(rank: int, pp: int, microbatches: int, virtual: int) -> int:
    """ScheduleInterleaved1F1B: the warm-up forwards, then one more before the first backward (_get_1f1b_rank_ops).
    Counted in stage-chunk forwards (each of one of the rank's v chunks)."""
    warmup = _interleaved_warmup(rank, pp, microbatches, virtual)
    return warmup + (1 if warmup < microbatches * virtual else 0)


def _interleaved_actions(rank: int, pp: int, microbatches: int, virtual: int) -> tuple[tuple[str, int, int], ...]:
    """ScheduleInterleaved1F1B._calculate_single_rank_operations with _get_1f1b_rank_ops, its no-ops dropped: op
    `step` forwards chunk (step // per_round) % v, and in the steady state and cool-down backwards chunk
    v - 1 - ((step - warmup) // per_round) % v, each chunk's micro-batches in order ("depth first")."""
    per_round = microbatches // max(1, microbatches // pp)
    warmup = _interleaved_warmup(rank, pp, microbatches, virtual)
    total = microbatches * virtual
    fwd_mb, bwd_mb = [0] * virtual, [0] * virtual
    out: list[tuple[str, int, int]] = []

    def forward(op: int) -> None:
        c = (op // per_round) % virtual
        out.append(("F", c, fwd_mb[c]))
        fwd_mb[c] += 1

    def backward(op: int) -> None:
        c = virtual - 1 - ((op - warmup) // per_round) % virtual
        out.append(("B", c, bwd_mb[c]))
        bwd_mb[c] += 1

    for op in range(total + warmup):        # warm-up + steady (total - warmup) + cool-down (warmup) ops
        if op < total:
            forward(op)
        if op >= warmup:
            backward(op)
    return tuple(out)


def _interleaved_bubble(pp: int, microbatches: int, virtual: int) -> float:
    """ScheduleInterleaved1F1B's idle share: the fill and drain are pp - 1 slots of one stage chunk (1 / v of a
    micro-batch's forward and backward) around the m micro-batches' v chunks each: (pp - 1) / (v m + pp - 1)
    (Narayanan et al. 2021, the schedule torch implements)."""
    return (pp - 1) / (virtual * microbatches + pp - 1)


def _not_modelled(rank: int, pp: int, microbatches: int, virtual: int) -> int:
    raise LlmemError("this pipeline schedule is not modelled")


# the zero-bubble schedules split each backward in two (torch's stage_backward_input, then BACKWARD_WEIGHT's
# stage_backward_weight): the graph and the weight gradients' inputs stay alive between them
_SPLIT_BACKWARD = ("splits each backward into an input-gradient and a later weight-gradient pass (the retained graph "
                   "and the weight gradients' inputs held in between), which the estimate does not model yet")


@dataclass(frozen=True, kw_only=True)
class PipelineScheduleSpec:
    """One of torch's pipeline schedules."""
    name: str                      # --pp-schedule
    torch_class: str               # torch.distributed.pipelining.schedules' class (torchtitan's schedule name)
    torchtitan_name: str           # torchtitan's pipeline_parallel_schedule value
    virtual_stages: int            # stages per rank (torchtitan's default for a looped schedule: 2)
    in_flight: Callable[[int, int, int, int], int]   # (rank, pp, microbatches, virtual): forwards held at most
    modelled: bool                 # estimate and trace handle it (else refused with one line)
    summary: str
    not_modelled_why: str = ""     # the refusal's reason where not modelled
    bubble: Callable[[int, int, int], float] = _flush_bubble   # (pp, microbatches, virtual): idle share of a step

    @property
    def looped(self) -> bool:
        """A multi-stage schedule (torch's _PipelineScheduleRuntime): several stages per rank."""
        return self.virtual_stages > 1

    def bubble_fraction(self, pp: int, microbatches: int, virtual: int | None = None) -> float:
        """The share of the step each rank idles in the pipeline's fill and drain (the time model's bubble)."""
        return self.bubble(pp, microbatches, self.virtual_stages if virtual is None else virtual) if pp > 1 else 0.0

    def microbatches_in_flight(self, rank: int, pp: int, microbatches: int, virtual: int | None = None) -> int:
        """The most micro-batch forwards (stage chunks under a looped schedule) rank `rank` holds for backward."""
        return self.in_flight(rank, pp, microbatches, self.virtual_stages if virtual is None else virtual)


PIPELINE_SCHEDULES: dict[str, PipelineScheduleSpec] = {s.name: s for s in (
    PipelineScheduleSpec(
        name="gpipe", torch_class="ScheduleGPipe", torchtitan_name="GPipe", virtual_stages=1,
        in_flight=_all, modelled=True, summary="all forwards, then all backwards"),
    PipelineScheduleSpec(
        name="1f1b", torch_class="Schedule1F1B", torchtitan_name="1F1B", virtual_stages=1,
        in_flight=_one_f_one_b, modelled=True,
        summary="warm-up forwards, then one forward and one backward (torchtitan's default)"),
    PipelineScheduleSpec(
        name="interleaved-1f1b", torch_class="ScheduleInterleaved1F1B", torchtitan_name="Interleaved1F1B",
        virtual_stages=2, in_flight=_interleaved, modelled=True, bubble=_interleaved_bubble,
        summary="1F1B over --pp-virtual-stages (default 2) stages per rank (looped: r, r + pp, ...)"),
    PipelineScheduleSpec(
        name="interleaved-zb", torch_class="ScheduleInterleavedZeroBubble", torchtitan_name="InterleavedZeroBubble",
        virtual_stages=2, in_flight=_not_modelled, modelled=False,
        summary="interleaved 1F1B with split backwards", not_modelled_why=_SPLIT_BACKWARD),
    PipelineScheduleSpec(
        name="zbv", torch_class="ScheduleZBVZeroBubble", torchtitan_name="ZBVZeroBubble",
        virtual_stages=2, in_flight=_not_modelled, modelled=False,
        summary="zero bubble over 2 stages per rank in a V (r and 2 pp - 1 - r)", not_modelled_why=_SPLIT_BACKWARD),
    PipelineScheduleSpec(
        name="dualpipev", torch_class="ScheduleDualPipeV", torchtitan_name="DualPipeV",
        virtual_stages=2, in_flight=_not_modelled, modelled=False,
        summary="DeepSeek's DualPipe in a V, overlapped forward / backward pairs",
        not_modelled_why=_SPLIT_BACKWARD + " nor its overlapped forward / backward pairs"),
)}


def pipeline_schedule(name: str) -> PipelineScheduleSpec:
    spec = PIPELINE_SCHEDULES.get(name)
    if spec is None:
        raise LlmemError(f"unknown --pp-schedule {name!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    return spec


@dataclass(frozen=True, kw_only=True)
class StageSplit:
    """One pipeline stage's modules: the embedding (first stage), decoder layers [first, stop), the final norm and
    lm_head (last stage)."""
    index: int
    first_layer: int
    stop_layer: int
    embedding: bool
    head: bool

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.stop_layer)


def stage_splits(num_layers: int, stages: int, first_less: int = FIRST_STAGE_LESS_LAYERS,
                 last_less: int = LAST_STAGE_LESS_LAYERS) -> tuple[StageSplit, ...]:
    """torchtitan's _generate_llm_fqn_per_model_part: num_layers + first_less + last_less "effective layers" split
    evenly over the stages (the first ones one more where it does not divide), the embedding counting first_less
    layers of stage 0 and norm + lm_head last_less of the last stage."""
    if stages == 1:
        return (StageSplit(index=0, first_layer=0, stop_layer=num_layers, embedding=True, head=True),)
    effective = num_layers + first_less + last_less
    per, extra = divmod(effective, stages)
    if per == 0 or first_less > per or last_less > per:
        raise LlmemError(f"{stages} pipeline stages split {num_layers} decoder layers (+ embedding and head) into "
                         f"empty stages: choose at most {max(1, (num_layers + 2) // 2)} stages in all (--pp x "
                         "--pp-virtual-stages)")
    out, layer = [], 0
    for s in range(stages):
        n = per + (1 if s < extra else 0) - (first_less if s == 0 else last_less if s == stages - 1 else 0)
        stop = min(num_layers, layer + n)
        out.append(StageSplit(index=s, first_layer=layer, stop_layer=stop, embedding=s == 0,
                              head=s == stages - 1))
        layer = stop
    return tuple(out)


def stage_actions(schedule: str, rank: int, pp: int, microbatches: int) -> tuple[tuple[str, int], ...]:
    """The forwards ("F", k) and backwards ("B", k) rank `rank` runs, in the order of its schedule's
    _step_microbatches (one stage per rank): the warm-up forwards (all of them under GPipe), then one backward and
    one forward alternately, then the remaining backwards."""
    warm = pipeline_schedule(schedule).microbatches_in_flight(rank, pp, microbatches)
    actions, fwd, bwd = [("F", k) for k in range(warm)], warm, 0
    while bwd < microbatches:
        actions.append(("B", bwd))
        bwd += 1
        if fwd < microbatches:
            actions.append(("F", fwd))
            fwd += 1
    return tuple(actions)


def rank_actions(schedule: str, rank: int, pp: int, microbatches: int,
                 virtual: int = 1) -> tuple[tuple[str, int, int], ...]:
    """The rank's compute actions (kind "F" / "B", its chunk 0..virtual-1, micro-batch) in the order torch runs
    them: a looped schedule's pipeline_order, a single-stage one's _step_microbatches."""
    if pipeline_schedule(schedule).looped:
        return _interleaved_actions(rank, pp, microbatches, virtual)
    return tuple((kind, 0, k) for kind, k in stage_actions(schedule, rank, pp, microbatches))


def stages_per_rank(schedule: str, requested: int | None) -> int:
    """--pp-virtual-stages, or torchtitan's default for the schedule (_get_pipeline_metadata: 1 for a single-stage
    schedule, 2 for a looped one)."""
    return pipeline_schedule(schedule).virtual_stages if requested is None else requested


def rank_stages(rank: int, pp: int, virtual: int) -> tuple[int, ...]:
    """The stages rank `rank` builds: torchtitan's "loop" style (rank + k x pp)."""
    return tuple(rank + k * pp for k in range(virtual))


def rank_splits(num_layers: int, pp: int, virtual: int, rank: int) -> tuple[StageSplit, ...]:
    """The rank's stages (its chunks, in stage order) of torchtitan's split into pp x virtual stages."""
    splits = stage_splits(num_layers, pp * virtual)
    return tuple(splits[s] for s in rank_stages(rank, pp, virtual))


def check_pipeline(pp: int, schedule: str, microbatches: int, batch_size: int, num_layers: int | None,
                   virtual: int | None = None) -> None:
    """The pipeline options torchtitan and torch accept (LlmemError naming the fix otherwise); num_layers None:
    the model is not known yet (checked again once it is); virtual: --pp-virtual-stages (None: the default)."""
    if pp < 1:
        raise LlmemError(f"--pp must be >= 1, got {pp}")
    spec = pipeline_schedule(schedule)
    if pp == 1:
        if virtual is not None:
            raise LlmemError("--pp-virtual-stages splits each pipeline rank into stages: add --pp N (> 1)")
        return
    if not spec.modelled:
        raise LlmemError(f"--pp-schedule {schedule} ({spec.torch_class}) {spec.not_modelled_why}: use gpipe, "
                         "1f1b or interleaved-1f1b")
    v = stages_per_rank(schedule, virtual)
    # torchtitan's _get_pipeline_metadata: a single-stage schedule 1 stage per rank, a looped one at least 2
    if not spec.looped and v != 1:
        raise LlmemError(f"{spec.torch_class} runs 1 stage per rank, got --pp-virtual-stages {v}: drop it or use "
                         "--pp-schedule interleaved-1f1b")
    if spec.looped and v < 2:
        raise LlmemError(f"{spec.torch_class} needs at least 2 stages per rank, got --pp-virtual-stages {v}: use "
                         "2 or more, or --pp-schedule 1f1b")
    if microbatches < 1:
        raise LlmemError(f"--pp-microbatches must be >= 1, got {microbatches}")
    if batch_size % microbatches:
        raise LlmemError(f"--batch-size {batch_size} is not divisible into --pp-microbatches {microbatches} "
                         "(torchtitan: local_batch_size must be divisible by the micro-batch size)")
    if not spec.looped and microbatches < pp:     # PipelineScheduleSingle.__init__
        raise LlmemError(f"{spec.torch_class} needs at least as many micro-batches as stages: --pp-microbatches "
                         f"{microbatches} < --pp {pp}")
    rounds = max(1, microbatches // pp)           # ScheduleInterleaved1F1B.__init__: number_of_rounds
    if spec.looped and microbatches % rounds:
        raise LlmemError(f"{spec.torch_class} needs --pp-microbatches a multiple of its rounds (max(1, "
                         f"micro-batches // pp) = {rounds}): got {microbatches}")
    effective = None if num_layers is None else num_layers + FIRST_STAGE_LESS_LAYERS + LAST_STAGE_LESS_LAYERS
    if effective is not None and pp * v > effective:      # torchtitan's _generate_llm_fqn_per_model_part
        raise LlmemError(f"--pp {pp} x {v} stage(s) per rank is more stages than the model's {num_layers} decoder "
                         "layers + embedding + head: choose a smaller --pp or --pp-virtual-stages")
    if num_layers is not None:
        stage_splits(num_layers, pp * v)


def check_schedule_method(schedule: str, method: str) -> None:
    """A looped schedule runs without FSDP2 only (pure PP, TP x PP): FSDP2 over several stages per rank (torch's
    UNSHARD / RESHARD / REDUCE_GRAD actions per stage, _add_unshard_reshard) is not modelled."""
    if pipeline_schedule(schedule).looped and method not in LOOPED_METHODS:
        raise LlmemError(f"--pp-schedule {schedule} under --method {method}: FSDP2 over several stages per rank "
                         "(torch's UNSHARD / RESHARD actions per stage) is not modelled yet; use --method single or tp, "
                         "or --pp-schedule 1f1b")


def torchtitan_pipeline(pp: int, schedule: str, microbatch_size: int, num_layers: int,
                        virtual: int | None = None) -> dict:
    """torchtitan's [parallelism] pipeline fields for the layout (ParallelismConfig): the schedule's name, and for a
    looped schedule off torchtitan's default of 2 stages per rank, pipeline_parallel_layers_per_stage (torchtitan
    makes ceil((layers + 2) / layers_per_stage) stages of it)."""
    spec, v = pipeline_schedule(schedule), stages_per_rank(schedule, virtual)
    out: dict = {"pipeline_parallel_degree": pp, "pipeline_parallel_schedule": spec.torchtitan_name,
                 "pipeline_parallel_microbatch_size": microbatch_size}
    if v != spec.virtual_stages:
        effective = num_layers + FIRST_STAGE_LESS_LAYERS + LAST_STAGE_LESS_LAYERS
        per = -(-effective // (pp * v))
        if -(-effective // per) != pp * v:
            raise LlmemError(f"--export torchtitan: {pp * v} stages of {num_layers} layers cannot be written as "
                             "torchtitan's pipeline_parallel_layers_per_stage: choose another --pp-virtual-stages")
        out["pipeline_parallel_layers_per_stage"] = per
    return out
