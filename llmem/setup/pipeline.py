"""Pipeline parallelism as torch.distributed.pipelining runs it under torchtitan: the schedules (one registry row
each), how many micro-batches a stage holds in flight under each, and torchtitan's split of the model into stages.

The schedules are torch's (torch/distributed/pipelining/schedules.py); the split is torchtitan's
(torchtitan/distributed/pipeline_parallel.py `_generate_llm_fqn_per_model_part`, `_get_pipeline_metadata`,
`_get_pp_rank_to_stage_indices_mapping`). Nothing here imports torch: tests/test_pipeline.py checks the counts
against torch's own action lists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmem.errors import LlmemError

# torchtitan's ParallelismConfig defaults (torchtitan/config/configs.py): the embedding and the norm + lm_head each
# count as one layer in the split
FIRST_STAGE_LESS_LAYERS = 1
LAST_STAGE_LESS_LAYERS = 1
# the methods a pipeline stage runs under (others refused): pure PP and FSDP2 + PP
PP_METHODS = ("single", "fsdp")


def _all(rank: int, pp: int, microbatches: int, virtual: int) -> int:
    """ScheduleGPipe: every forward before the first backward (its _get_pipeline_order)."""
    return microbatches


def _one_f_one_b(rank: int, pp: int, microbatches: int, virtual: int) -> int:
    """Schedule1F1B: pp - 1 - rank warm-up forwards, then one forward and one backward alternately."""
    return min(microbatches, pp - rank)


def _interleaved(rank: int, pp: int, microbatches: int, virtual: int) -> int:
    """ScheduleInterleaved1F1B: _get_warmup_ops ((v - 1) x micro-batches per round + 2 per hop from the last
    rank, capped at v x n) warm-up forwards, then one more before the first backward (_get_1f1b_rank_ops). Counted
    in stage-chunk forwards (each of one of the rank's v chunks)."""
    rounds = max(1, microbatches // pp)
    per_round = microbatches // rounds
    warmup = min((virtual - 1) * per_round + 2 * (pp - 1 - rank), microbatches * virtual)
    return warmup + (1 if warmup < microbatches * virtual else 0)


@dataclass(frozen=True)
class PipelineScheduleSpec:
    """One of torch's pipeline schedules."""
    name: str                      # --pp-schedule
    torch_class: str               # torch.distributed.pipelining.schedules' class (torchtitan's schedule name)
    torchtitan_name: str           # torchtitan's pipeline_parallel_schedule value
    virtual_stages: int            # stages per rank (torchtitan's default for a looped schedule: 2)
    in_flight: Callable[[int, int, int, int], int]   # (rank, pp, microbatches, virtual): forwards held at most
    modelled: bool                 # estimate and trace handle it (else refused with one line)
    summary: str

    def microbatches_in_flight(self, rank: int, pp: int, microbatches: int) -> int:
        """The most micro-batch forwards (stage chunks under a looped schedule) rank `rank` holds for backward."""
        return self.in_flight(rank, pp, microbatches, self.virtual_stages)


PIPELINE_SCHEDULES: dict[str, PipelineScheduleSpec] = {s.name: s for s in (
    PipelineScheduleSpec("gpipe", "ScheduleGPipe", "GPipe", 1, _all, True, "all forwards, then all backwards"),
    PipelineScheduleSpec("1f1b", "Schedule1F1B", "1F1B", 1, _one_f_one_b, True,
                         "warm-up forwards, then one forward and one backward (torchtitan's default)"),
    PipelineScheduleSpec("interleaved-1f1b", "ScheduleInterleaved1F1B", "Interleaved1F1B", 2, _interleaved, False,
                         "1F1B over 2 virtual stages per rank (looped)"),
)}


def pipeline_schedule(name: str) -> PipelineScheduleSpec:
    spec = PIPELINE_SCHEDULES.get(name)
    if spec is None:
        raise LlmemError(f"unknown --pp-schedule {name!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    return spec


@dataclass(frozen=True)
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
        return (StageSplit(0, 0, num_layers, True, True),)
    effective = num_layers + first_less + last_less
    per, extra = divmod(effective, stages)
    if per == 0 or first_less > per or last_less > per:
        raise LlmemError(f"--pp {stages} splits {num_layers} decoder layers (+ embedding and head) into empty "
                         f"stages: choose a --pp of at most {max(1, (num_layers + 2) // 2)}")
    out, layer = [], 0
    for s in range(stages):
        n = per + (1 if s < extra else 0) - (first_less if s == 0 else last_less if s == stages - 1 else 0)
        stop = min(num_layers, layer + n)
        out.append(StageSplit(s, layer, stop, s == 0, s == stages - 1))
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


def rank_stages(rank: int, pp: int, virtual: int) -> tuple[int, ...]:
    """The stages rank `rank` builds: torchtitan's "loop" style (rank + k x pp)."""
    return tuple(rank + k * pp for k in range(virtual))


def check_pipeline(pp: int, schedule: str, microbatches: int, batch_size: int, num_layers: int | None) -> None:
    """The pipeline options torchtitan and torch accept (LlmemError naming the fix otherwise); num_layers None:
    the model is not known yet (checked again once it is)."""
    if pp < 1:
        raise LlmemError(f"--pp must be >= 1, got {pp}")
    spec = pipeline_schedule(schedule)
    if pp == 1:
        return
    if microbatches < 1:
        raise LlmemError(f"--pp-microbatches must be >= 1, got {microbatches}")
    if batch_size % microbatches:
        raise LlmemError(f"--batch-size {batch_size} is not divisible into --pp-microbatches {microbatches} "
                         "(torchtitan: local_batch_size must be divisible by the micro-batch size)")
    if spec.virtual_stages == 1 and microbatches < pp:
        raise LlmemError(f"{spec.torch_class} needs at least as many micro-batches as stages: --pp-microbatches "
                         f"{microbatches} < --pp {pp}")
    if spec.virtual_stages > 1 and microbatches % max(1, microbatches // pp):
        raise LlmemError(f"{spec.torch_class} needs --pp-microbatches a multiple of its rounds "
                         f"({max(1, microbatches // pp)}): got {microbatches}")
    if num_layers is not None and pp * spec.virtual_stages > num_layers:
        raise LlmemError(f"--pp {pp} x {spec.virtual_stages} stage(s) per rank is more stages than the model's "
                         f"{num_layers} decoder layers: choose a smaller --pp")
    if num_layers is not None:
        stage_splits(num_layers, pp * spec.virtual_stages)
