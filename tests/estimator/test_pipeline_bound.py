"""The pipeline's memory floor (llmem.estimator.pipeline.pipeline_allocated_floor): the first and last ranks'
schedules built, not replayed, their live tensor bytes summed; it must stay at or below the allocator replay's
allocated peak (the allocator rounds blocks up), so that over the capacity it proves OOM, and the planner's batch
bound from it (search.pipeline_batch_bound) must never fall below the full estimate's largest fitting batch.

tiny-llama: hidden 512, 4 layers, vocab 32000 (llmem/model/catalog/tiny/tiny-llama.json).
"""

from __future__ import annotations

import pytest

from llmem.estimator.events import Schedule, replay
from llmem.setup.training import TrainingSetup

ROWS = (
    dict(model="tiny-llama", method="fsdp", gpus=4, pp=2, precision="bf16", optimizer="adamw", batch_size=4,
         seq_len=128),
    dict(model="tiny-llama", method="fsdp+tp", gpus=8, tp=2, pp=2, precision="bf16", optimizer="sgd", batch_size=4,
         seq_len=128, sequence_parallel=True, loss_parallel=True),
    dict(model="tiny-llama", method="single", gpus=2, pp=2, pp_schedule="interleaved-1f1b", precision="bf16",
         optimizer="sgd", batch_size=4, seq_len=64),
)


def test_tensor_peak_by_hand():
    s = Schedule()
    s.phase = "it0:forward"
    a = s.alloc(1000, "activations")
    b = s.alloc(600, "activations")
    s.free(a)
    s.alloc(900, "gradients")        # 600 + 900 = 1500 < 1000 + 600 = 1600
    s.free(b)
    from llmem.estimator.events import tensor_peak_bytes

    assert tensor_peak_bytes(s) == 1600
    # the allocator's blocks are 512-byte multiples: 1024 + 1024 = 2048 allocated at the same moment
    assert replay(s).peak_allocated_bytes == 2048
    assert tensor_peak_bytes(Schedule()) == 0


class _TwoTensors:
    """A builder (StepSchedule's interface: `sch`, `build()`) of the by-hand schedule above."""

    def __init__(self) -> None:
        self.sch, self.built = Schedule(), []

    def build(self) -> Schedule:
        a = self.sch.alloc(1000, "activations")
        self.built.append("a")
        self.sch.alloc(600, "activations")
        self.built.append("b")
        self.sch.free(a)
        return self.sch


def test_build_stops_once_the_live_tensors_pass_the_threshold():
    from llmem.estimator.events import built_within, tensor_peak_bytes

    whole = built_within(_TwoTensors(), 1600)           # 1600 live at most: within
    assert whole is not None and tensor_peak_bytes(whole) == 1600 and whole.live_bytes == 600
    over = _TwoTensors()
    assert built_within(over, 1599) is None             # the second tensor takes it to 1600: stopped there
    assert over.built == ["a"] and over.sch.peak_live_bytes == 1600


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['method']}-{r.get('pp_schedule', '1f1b')}")
def test_floor_with_a_threshold_decides_as_the_whole_floor(row):
    from llmem.estimator.pipeline import pipeline_allocated_floor
    from llmem.model.resolved import resolve

    r = resolve(TrainingSetup(**row))
    whole = pipeline_allocated_floor(r)
    assert pipeline_allocated_floor(r, whole) == whole            # never over: both ranks built whole
    stopped = pipeline_allocated_floor(r, whole // 2)             # over: the build stopped past half of it
    assert whole // 2 < stopped <= whole


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['method']}-{r.get('pp_schedule', '1f1b')}")
def test_floor_is_below_every_replayed_stage_peak(row):
    from llmem.estimator.pipeline import pipeline_allocated_floor, stage_replays
    from llmem.model.resolved import resolve

    r = resolve(TrainingSetup(**row))
    peaks = [rep.peak_allocated_bytes for rep in stage_replays(r)]
    floor = pipeline_allocated_floor(r)
    assert floor <= max(peaks)                      # a lower bound on the largest stage's
    assert floor >= 0.9 * max(peaks)                # and a tight one (only the blocks' rounding is missing)


def test_batch_bound_is_never_below_the_search():
    """The planner's bound on a pipeline layout's largest micro-batch from the floor, against the full estimate's
    batch search, at limits where the answer is 0, a few and the cap."""
    from llmem.model.anatomy import load_anatomy
    from llmem.planner.engines import memory_engine
    from llmem.planner.options import PlanOptions
    from llmem.planner.search import PlanContext, layout_setup, pipeline_batch_bound, search_candidate
    from llmem.setup.gpus import resolve_gpu
    from llmem.setup.layout import resolve_layout

    base = TrainingSetup(model="tiny-llama", gpus=4, gpu="A100-80GB", precision="bf16", optimizer="adamw",
                         seq_len=128)
    anatomy, gpu = load_anatomy("tiny-llama"), resolve_gpu("A100-80GB")
    layout = resolve_layout("fsdp", 4, None, None, 8, 8, pp=2)
    probe = memory_engine("llmem", anatomy, gpu)
    at1, at4 = (probe.pipeline_floor(layout_setup(base, layout, b)) for b in (1, 4))
    assert at4 > at1                                  # grows with the micro-batch
    for limit in (at1 - 1, (at1 + at4) // 2, gpu.memory_bytes):
        engine = memory_engine("llmem", anatomy, gpu, None, limit)
        ctx = PlanContext(anatomy, gpu, PlanOptions(), engine, limit)
        bound = pipeline_batch_bound(ctx, base, layout, 8)
        searched = search_candidate(base, layout, engine, limit, 8).max_batch_size
        assert searched <= bound
    assert pipeline_batch_bound(PlanContext(anatomy, gpu, PlanOptions(), probe, at1 - 1), base, layout, 8) == 0


def test_a_stage_with_more_live_tensors_than_the_device_fails_the_step():
    """Under --pp the answer is the stage with the largest reserved peak; a stage whose allocated peak is over the
    capacity still runs out of memory (hand-made stage peaks: 70 / 78 GiB allocated under an 75 GiB capacity)."""
    from llmem.estimator.engine import every_stage_fits
    from llmem.memory.capacity import AtCapacity

    gib = 2**30
    stages = [{"stage": 0, "peak_allocated_bytes": 70 * gib, "peak_reserved_bytes": 80 * gib},
              {"stage": 1, "peak_allocated_bytes": 78 * gib, "peak_reserved_bytes": 79 * gib}]
    fits = AtCapacity(75 * gib, 74 * gib, None, by_fragmentation=True)
    got = every_stage_fits(fits, stages)
    assert not got.completes and got.oom.where == "pipeline stage 1" and got.oom.allocated_bytes == 78 * gib
    assert every_stage_fits(AtCapacity(79 * gib, 79 * gib, None), stages).completes     # every stage within
