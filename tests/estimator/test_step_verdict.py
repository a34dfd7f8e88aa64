"""The step's verdict at a limit (llmem.estimator.engine.step_verdict, the planner's probe) against the full estimate's
own `fits` there, and the batch search built on it against a search on full estimates alone."""

from __future__ import annotations

import pytest

from llmem.memory.capacity import Fit
from llmem.model.anatomy import load_anatomy
from llmem.planner.engines import LlmemEngine, MemoryEngine, fits_within, verdict_of
from llmem.planner.search import boundary_guess, layout_setup, search_candidate
from llmem.search import max_batch_size
from llmem.setup.gpus import resolve_gpu
from llmem.setup.layout import Layout
from llmem.setup.training import TrainingSetup
from llmem.units import MIB

GPU = "A100-80GB"
# tiny-llama at 1024 tokens: these limits put batches 1-16 in each of the three verdicts, and both ways of
# deciding by fragmentation (the capped replay running out, and carrying through)
LIMITS_MIB = (2000, 3000, 4000)
BATCHES = (1, 2, 4, 6, 8, 12, 16)
SETUPS = [("single", 1, 1), ("fsdp", 2, 1), ("fsdp", 4, 2)]


def _setup(method: str, gpus: int, cp: int, batch: int) -> TrainingSetup:
    return TrainingSetup(model="tiny-llama", gpus=gpus, method=method, cp=cp, seq_len=1024, batch_size=batch,
                         gpu=GPU)


@pytest.mark.parametrize(("method", "gpus", "cp"), SETUPS)
def test_verdict_is_the_full_estimates_fit(method, gpus, cp):
    anatomy, gpu = load_anatomy("tiny-llama"), resolve_gpu(GPU)
    seen = set()
    for limit_mib in LIMITS_MIB:
        limit = limit_mib * MIB
        for batch in BATCHES:
            s = _setup(method, gpus, cp, batch)
            m = LlmemEngine(anatomy, gpu, limit).full(s)       # the full estimate, decided at the limit
            got = LlmemEngine(anatomy, gpu, limit).verdict(s, limit)    # a fresh engine: no full answer to read
            assert got == verdict_of(m, limit), (limit_mib, batch)
            assert (got is Fit.FITS) == m.fits
            if got is Fit.OVER_CAPACITY:                        # the proof's premise: live tensors over capacity
                assert m.peak_allocated_bytes > m.capacity_bytes and not m.by_fragmentation
            seen.add((got, m.by_fragmentation))
    # the grid reaches every verdict, and a fragmentation-decided one
    assert {v for v, _ in seen} == set(Fit)
    assert any(frag for _, frag in seen)


class FullOnly(MemoryEngine):
    """The llmem engine with its verdict taken from the full estimate (the interface's default)."""
    has_quick = True

    def __init__(self, engine: LlmemEngine) -> None:
        super().__init__(engine.anatomy, engine.gpu, engine.limit_bytes)
        self.inner = engine
        self.full, self.draft, self.quick = engine.full, engine.draft, engine.quick


@pytest.mark.parametrize(("method", "gpus", "cp", "limit_mib"), [
    ("single", 1, 1, 6000), ("fsdp", 2, 1, 7000), ("fsdp", 4, 2, 6000)])
def test_search_with_verdicts_answers_as_full_estimates_do(method, gpus, cp, limit_mib):
    anatomy, gpu = load_anatomy("tiny-llama"), resolve_gpu(GPU)
    limit = limit_mib * MIB
    base = _setup(method, gpus, cp, 1)
    layout = Layout(method, gpus // cp, 1, 8, cp=cp)
    fast = search_candidate(base, layout, LlmemEngine(anatomy, gpu, limit), limit, 64)
    full = LlmemEngine(anatomy, gpu, limit)
    # the plain exponential-then-bisect search on full estimates only
    plain = max_batch_size(lambda b: fits_within(full.full(layout_setup(base, layout, b)), limit), 64)
    slow = search_candidate(base, layout, FullOnly(full), limit, 64)
    assert fast.max_batch_size == slow.max_batch_size == plain > 1
    assert fast.memory.device_used_bytes == slow.memory.device_used_bytes <= limit


def test_boundary_guess_is_the_line_through_the_drafts():
    # quick(x) = 100 + 12 x is within 400 up to x = 25; allocated(x) = 90 + 10 x at 1 (100) and 25 (340):
    # slope 10 a sample, so the target 400 is reached at 1 + (400 - 100) / 10 = 31
    assert boundary_guess(lambda x: 90 + 10 * x, lambda x: 100 + 12 * x, 400, 64) == 31
    assert boundary_guess(lambda x: 90 + 10 * x, lambda x: 100 + 12 * x, 400, 20) == 20     # the cap
    assert boundary_guess(lambda x: 90 + 10 * x, lambda x: 500 + x, 400, 64) == 1            # nothing within


@pytest.mark.parametrize(("method", "gpus", "cp", "batch", "limit_mib"), [
    ("single", 1, 1, 4, 4000),      # fits, uncapped reserved within the capacity
    ("fsdp", 4, 2, 4, 2000),        # fits by fragmentation: the replay at the capacity is the one reused
])
def test_the_full_estimate_reusing_a_verdict_is_the_full_estimate(method, gpus, cp, batch, limit_mib):
    from llmem.estimator.engine import estimate_resolved, step_verdict
    from llmem.model.resolved import resolve

    limit = limit_mib * MIB
    r = resolve(_setup(method, gpus, cp, batch), load_anatomy("tiny-llama"), resolve_gpu(GPU))
    v = step_verdict(r, limit)
    assert v is not None and v.fit is Fit.FITS and v.schedule is not None
    alone, reused = estimate_resolved(r, limit_bytes=limit), estimate_resolved(r, limit_bytes=limit, verdict=v)
    assert alone.to_dict() == reused.to_dict()


class HoleEngine(MemoryEngine):
    """Device-used 100 MiB a sample, fitting up to 11 samples except at `holes` (fragmentation's)."""
    has_quick = False

    def __init__(self, holes: set[int]) -> None:
        super().__init__(load_anatomy("tiny-llama"), resolve_gpu(GPU), 2000 * MIB)
        self.holes = holes

    def full(self, setup, layout=None):
        from llmem.result import MemoryResult, OutOfMemory

        b, used = setup.batch_size, setup.batch_size * 100 * MIB
        oom = None if b <= 11 and b not in self.holes else OutOfMemory("it1:backward", "", "activations", 1, used,
                                                                        used, self.limit_bytes)
        return MemoryResult("llmem", used, used, used, self.gpu.memory_bytes, {}, capacity_bytes=self.limit_bytes,
                            oom=oom, by_fragmentation=oom is not None and b <= 11)


@pytest.mark.parametrize(("holes", "micro", "steps"), [
    (set(), 10, 1),         # a global batch of 10: one step of 10
    ({10}, 11, 1),          # 10 runs out of memory where 11 fits: one step of 11
    ({10, 11}, 5, 2),       # 10 and 11 do not fit, 9 is the largest: two steps of 5
])
def test_the_plans_micro_batch_is_one_that_fits(holes, micro, steps):
    from llmem.planner.options import PlanOptions
    from llmem.planner.search import CandidatePlan, PlanContext, attach_time

    engine = HoleEngine(holes)
    ctx = PlanContext(engine.anatomy, engine.gpu, PlanOptions(global_batch=10), engine, engine.limit_bytes)
    base, layout = TrainingSetup(model="tiny-llama", seq_len=128, gpu=GPU), Layout("single", 1, 1, 8)
    top = 9 if 11 in holes else 11          # the largest fitting batch a search may answer (9: below both holes)
    c = CandidatePlan(layout, top, engine.full(layout_setup(base, layout, top)), engine.limit_bytes)
    attach_time(ctx, c, base)
    assert (c.time.micro_batch_size, c.time.accumulation_steps) == (micro, steps)
    assert engine.fits(layout_setup(base, layout, c.time.micro_batch_size), engine.limit_bytes)
    assert any("runs out of memory" in n for n in c.notes) == (holes == {10})


def test_a_phase_run_twice_peaks_at_its_larger_run():
    # 1F1B's forwards between backwards: the first run of it0:forward holds two 1000-byte tensors (two 1024-byte
    # blocks: 2048 bytes), the second one 200-byte tensor (512); the phase peaks at 2048 with the first run's tensors,
    # whichever run comes last, and over a 1500-byte capacity the step is out of memory there
    from llmem.estimator.engine import first_over
    from llmem.estimator.events import Schedule, replay

    s = Schedule()
    s.phase = "it0:forward"
    a, b = s.alloc(1000, "activations"), s.alloc(1000, "activations")
    s.free(a)
    s.free(b)
    s.phase = "it0:backward"
    s.free(s.alloc(100, "gradients"))
    s.phase = "it0:forward"
    s.alloc(200, "optimizer")
    rep = replay(s)
    forward = rep.phases["it0:forward"]
    assert rep.peak_allocated_bytes == 2048 and forward.allocated == 2048
    assert forward.components == {"activations": 2000}        # the tensors at the first run's peak, not the last's
    assert forward.reserved == 2 * 2**20                       # one 2 MiB small-pool segment at the last run's end
    oom = first_over(rep, 1500)
    assert (oom.phase, oom.allocated_bytes, oom.capacity_bytes, oom.component) == ("it0:forward", 2048, 1500,
                                                                                    "activations")
