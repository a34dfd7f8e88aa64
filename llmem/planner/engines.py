"""The memory engines a plan searches with: TrainingSetup -> MemoryResult for one model and GPU, with the cheaper
answers a search may use before it confirms with the full one.

- `LlmemEngine`: the llmem estimator. Each set-up is resolved once and its model states computed once (neither
  depends on the micro-batch shape), then every batch and sequence length of it reuses them. `quick` is the tensor
  bytes at the step's largest moment (no allocator replay, about 1 ms); `draft` replays shallower depths (4 and 8
  layers): its allocated peak is exact (linear in depth), its reserved is not; `verdict` is the full estimate's
  fit at a limit without its numbers (llmem.estimator.engine.step_verdict: one replay at the capacity, none where
  the live tensors alone are over it). Every answer is kept per set-up (a plan's what-ifs meet the same set-up more
  than once), and every uncapped replay per schedule (llmem.estimator.shared_replays: set-ups that differ only in
  fields no schedule reads share it).
- `PaperEngine`: LLMem's equations; no cheaper answer than the full one.

Every answer takes the set-up and, from the planner, the `Layout` it resolved for it (the set-up's parallelism
section written from it: TrainingSetup.with_layout), which the engine hands down as it is (resolve's `layout`,
paper_estimate's) instead of resolving the layout again from the set-up's fields; None: resolved from them.
"""

from __future__ import annotations

from collections.abc import Callable

from llmem.errors import LlmemError
from llmem.estimator.engine import (
    StepVerdict,
    estimate_resolved,
    learn_if_needed,
    quick_peak_allocated,
    step_verdict,
)
from llmem.estimator.param_facts import activation_free_key
from llmem.estimator.shared_replays import SharedReplays
from llmem.estimator.states import ModelStates, model_states
from llmem.memory.capacity import Fit
from llmem.model.anatomy import ModelAnatomy
from llmem.model.resolved import ResolvedSetup, resolve
from llmem.paper.engine import paper_estimate
from llmem.result import MemoryResult
from llmem.setup.gpus import GpuSpec, outside_allocator_bytes
from llmem.setup.layout import Layout
from llmem.setup.training import TrainingSetup


def fits_within(m: MemoryResult, limit: int) -> bool:
    """The step fits in `limit` bytes of device memory: as the allocator decides it where the engine replayed the
    step at that limit (the llmem engine built with it), else device-used memory against the limit (the paper
    engine). The job's other phases do not depend on the batch: CandidatePlan.fits weighs them."""
    return m.step_fits if m.capacity_bytes else m.device_used_bytes <= limit


def out_of_memory_above(m: MemoryResult) -> bool:
    """Out of memory at this batch and every larger one: the step's allocated peak alone is over the capacity
    (llmem.memory.capacity.at_capacity's case 2, no replay at the capacity), and the allocated peak grows with the
    batch (every tensor of the step does); a draft's (extrapolated from shallower replays) only approximately."""
    return m.oom is not None and not m.by_fragmentation


def verdict_of(m: MemoryResult, limit: int) -> Fit:
    """A full estimate's verdict at `limit` (the limit its engine decided `fits` at, where it has one)."""
    if fits_within(m, limit):
        return Fit.FITS
    return Fit.OVER_CAPACITY if out_of_memory_above(m) else Fit.OUT_OF_MEMORY


class MemoryEngine:
    """The interface: `full` is the engine's answer; `draft` and `quick` are cheaper ones for searches (`quick`
    only where `has_quick`); `verdict` the full answer's fit at a limit (from the full answer unless the engine
    has a cheaper way to it)."""
    name = ""
    has_quick = False

    def __init__(self, anatomy: ModelAnatomy, gpu: GpuSpec, limit_bytes: int | None = None) -> None:
        # fits: within limit_bytes of device memory (the planner's GPU memory less its headroom; None: all of it)
        self.anatomy, self.gpu, self.limit_bytes = anatomy, gpu, limit_bytes

    def full(self, setup: TrainingSetup, layout: Layout | None = None) -> MemoryResult:
        raise NotImplementedError

    def draft(self, setup: TrainingSetup, layout: Layout | None = None) -> MemoryResult:
        return self.full(setup, layout)

    def quick(self, setup: TrainingSetup, layout: Layout | None = None) -> int:
        raise NotImplementedError(f"the {self.name} engine has no quick bound")

    def verdict(self, setup: TrainingSetup, limit: int, layout: Layout | None = None) -> Fit:
        return verdict_of(self.full(setup, layout), limit)

    def fits(self, setup: TrainingSetup, limit: int, layout: Layout | None = None) -> bool:
        return self.verdict(setup, limit, layout) is Fit.FITS

    def pipeline_floor(self, setup: TrainingSetup, layout: Layout | None = None) -> int:
        raise NotImplementedError(f"the {self.name} engine has no pipeline bound")

    def __call__(self, setup: TrainingSetup, layout: Layout | None = None) -> MemoryResult:
        return self.full(setup, layout)


class LlmemEngine(MemoryEngine):
    name = "llmem"
    has_quick = True

    def __init__(self, anatomy: ModelAnatomy, gpu: GpuSpec, limit_bytes: int | None = None) -> None:
        super().__init__(anatomy, gpu, limit_bytes)
        self._prepared: dict[tuple, tuple[ResolvedSetup, ModelStates]] = {}
        self._states: dict[tuple, ModelStates] = {}
        self._resolved: dict[tuple, ResolvedSetup] = {}
        # a plan's what-ifs meet the same set-up more than once (one saver's search, another's screen): kept
        self._answers: dict[tuple, MemoryResult | int | Fit] = {}
        # the last fitting verdict's schedule and replay, which the full estimate a search confirms it with reuses
        self._last_fit: tuple[TrainingSetup, StepVerdict] | None = None
        # set-ups that differ only in fields no schedule reads (a GRPO plan's vLLM utilizations): replayed once
        self._replays = SharedReplays()

    def _kept(self, kind: str, setup: TrainingSetup, layout: Layout | None,
              work: Callable[[ResolvedSetup, ModelStates], object]):
        key = (kind, setup)     # the set-up holds its layout's values: the layout adds nothing to the key
        if key not in self._answers:
            self._answers[key] = work(*self.prepared(setup, layout))
        return self._answers[key]

    def prepared(self, setup: TrainingSetup, layout: Layout | None = None) -> tuple[ResolvedSetup, ModelStates]:
        """The set-up resolved at its shape, and its model states (resolved and computed once per set-up)."""
        key = setup.shape_free
        got = self._prepared.get(key)
        if got is None:
            r = self.resolved(setup, layout)
            # the states do not read the activation-only fields (an adapter menu's variants share them)
            states_key = activation_free_key(r.setup)
            states = self._states.get(states_key)
            if states is None:
                states = self._states[states_key] = model_states(r)
            got = self._prepared[key] = (r, states)
        r, states = got
        return r.with_shape(setup.batch_size, setup.seq_len), states

    def resolved(self, setup: TrainingSetup, layout: Layout | None = None) -> ResolvedSetup:
        """The set-up resolved at its shape (resolved once per set-up, under `layout` where the planner gives it;
        no model states: the pipeline floor's)."""
        key = setup.shape_free
        if key not in self._resolved:
            self._resolved[key] = resolve(setup, self.anatomy, self.gpu, layout)
        return self._resolved[key].with_shape(setup.batch_size, setup.seq_len)

    def full(self, setup: TrainingSetup, layout: Layout | None = None) -> MemoryResult:
        last = self._last_fit
        known = last[1] if last is not None and last[0] == setup else None
        if known is not None:
            self._last_fit = None       # its schedule and replay are the step's size: held only until used
        return self._kept("full", setup, layout, lambda r, states: estimate_resolved(
            r, states=states, verdict=known, limit_bytes=self.limit_bytes, shared=self._replays))

    def draft(self, setup: TrainingSetup, layout: Layout | None = None) -> MemoryResult:
        return self._kept("draft", setup, layout, lambda r, states: estimate_resolved(
            r, draft=True, states=states, limit_bytes=self.limit_bytes, shared=self._replays))

    def quick(self, setup: TrainingSetup, layout: Layout | None = None) -> int:
        return self._kept("quick", setup, layout, quick_peak_allocated)

    def verdict(self, setup: TrainingSetup, limit: int, layout: Layout | None = None) -> Fit:
        """The full estimate's fit at `limit`: read off the full answer where it is kept and was decided at this
        limit, else step_verdict (no numbers, one replay at most), else the full estimate."""
        if ("full", setup) in self._answers and limit == self.limit_bytes:
            return verdict_of(self._answers[("full", setup)], limit)
        key = ("verdict", setup, limit)
        if key not in self._answers:
            got = step_verdict(self.resolved(setup, layout), limit)
            if got is None:
                self._answers[key] = verdict_of(self.full(setup, layout), limit)
            else:
                self._answers[key] = got.fit
                if got.fit is Fit.FITS and limit == self.limit_bytes:
                    self._last_fit = (setup, got)
        return self._answers[key]

    def pipeline_floor(self, setup: TrainingSetup, layout: Layout | None = None) -> int:
        """Under --pp, a lower bound on the device-used memory of the pipeline's largest stage (no allocator
        replay: llmem.estimator.pipeline.pipeline_allocated_floor, and the CUDA context): over the limit, a stage
        runs out of memory."""
        # imported here, as estimate_resolved imports it
        from llmem.estimator.pipeline import pipeline_allocated_floor

        key = ("pipeline_floor", setup)
        if key not in self._answers:
            r = self.resolved(setup, layout)
            learn_if_needed(r)
            context = outside_allocator_bytes(r.gpu, r.layout.world_size)
            over = None if self.limit_bytes is None else self.limit_bytes - context    # decided there: stop
            self._answers[key] = pipeline_allocated_floor(r, over) + context
        return self._answers[key]


class PaperEngine(MemoryEngine):
    name = "paper"

    def __init__(self, anatomy: ModelAnatomy, gpu: GpuSpec, m_base_bytes: int | None = None,
                 limit_bytes: int | None = None) -> None:
        super().__init__(anatomy, gpu, limit_bytes)
        self.m_base_bytes = m_base_bytes

    def full(self, setup: TrainingSetup, layout: Layout | None = None) -> MemoryResult:
        return paper_estimate(setup, self.anatomy, self.gpu, m_base_bytes=self.m_base_bytes, layout=layout)


def memory_engine(name: str, anatomy: ModelAnatomy, gpu: GpuSpec, m_base_bytes: int | None = None,
                  limit_bytes: int | None = None) -> MemoryEngine:
    """The engine by name; `limit_bytes`: the device memory a step may use to fit (default: the GPU's)."""
    if name == "llmem":
        return LlmemEngine(anatomy, gpu, limit_bytes)
    if name == "paper":
        return PaperEngine(anatomy, gpu, m_base_bytes, limit_bytes)
    raise LlmemError(f"unknown engine {name!r}: choose llmem or paper")
