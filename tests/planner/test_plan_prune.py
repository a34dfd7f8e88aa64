"""The what-if searches' pruning (llmem.planner.suggestions.fitting.best_fitting): a layout whose draft is out of
memory at its smallest batch fits no batch (the batch search's own verdict), so it is not fully estimated where
only the answer is read (`closest_wanted` False: the more-GPUs suggestion) or once a layout fits; the answer, and
the closest plan where it is wanted, are those of searching every layout.

tiny-llama on 4 GPUs of a shrunk A100 (1100 to 2000 MiB): at 1340 MiB with checkpointing FSDP2 fits batch 1 and
DDP (every rank holding the whole model's states) does not fit even batch 1; at 1100 MiB nothing fits."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmem.model.anatomy import load_anatomy
from llmem.planner.engines import LlmemEngine, fits_within
from llmem.planner.options import PlanOptions
from llmem.planner.search import PlanContext, limit_bytes
from llmem.planner.suggestions import best_fitting
from llmem.setup.gpus import resolve_gpu
from llmem.setup.layout import candidate_layouts
from llmem.setup.training import TrainingSetup


def _context(setup: TrainingSetup, prune: bool = True) -> PlanContext:
    anatomy = load_anatomy(setup.model)
    gpu = resolve_gpu(setup.gpu, setup.gpu_memory, setup.cuda_context)
    limit = limit_bytes(gpu, 0.0)
    return PlanContext(anatomy, gpu, PlanOptions(batch_cap=64), LlmemEngine(anatomy, gpu, limit), limit, prune)


def _setup(mem: str, grad_ckpt: bool) -> TrainingSetup:
    return TrainingSetup(model="tiny-llama", gpus=4, seq_len=1024, gpu="A100-80GB", gpu_memory=mem,
                         grad_ckpt=grad_ckpt)


LAYOUTS = candidate_layouts(4, None, 8, 8)


def _answer(c) -> tuple | None:
    return None if c is None else (c.layout.label, c.max_batch_size, c.time.tokens_per_s,
                                   c.memory.device_used_bytes)


@pytest.mark.parametrize("mem", ["1100MiB", "1340MiB", "1600MiB", "2000MiB", "3000MiB"])
@pytest.mark.parametrize("grad_ckpt", [False, True])
def test_pruned_search_answers_as_the_exhaustive_one(mem, grad_ckpt):
    setup = _setup(mem, grad_ckpt)
    every_best, every_plans = best_fitting(_context(setup, prune=False), setup, LAYOUTS)
    best, plans = best_fitting(_context(setup), setup, LAYOUTS)
    answer_only, _ = best_fitting(_context(setup), setup, LAYOUTS, closest_wanted=False)
    assert _answer(best) == _answer(every_best) == _answer(answer_only)
    if every_best is None:      # nothing fits: the closest plan is the exhaustive one's
        closest = min(every_plans, key=lambda c: c.memory.device_used_bytes)
        assert min(c.memory.device_used_bytes for c in plans) == closest.memory.device_used_bytes


def test_a_layout_that_fits_no_batch_is_not_estimated_when_only_the_answer_is_read(monkeypatch):
    """At 1340 MiB with checkpointing DDP's draft is out of memory at batch 1: searched for the closest plan, not
    for the answer alone (no full estimate of it), which stays FSDP2's batch 1."""
    setup = _setup("1340MiB", True)
    ctx = _context(setup)
    ddp = next(lay for lay in LAYOUTS if lay.method == "ddp")
    assert not fits_within(ctx.engine.draft(setup.with_layout(ddp, 1)), ctx.limit)
    full = []
    real = LlmemEngine.full
    monkeypatch.setattr(LlmemEngine, "full", lambda self, s, lay=None: full.append(s.method) or real(self, s, lay))
    best, plans = best_fitting(ctx, setup, LAYOUTS, closest_wanted=False)
    assert (best.layout.label, best.max_batch_size) == ("fsdp (4)", 1)
    assert "ddp" not in full and all(c.layout.method != "ddp" for c in plans)
    full.clear()
    _, wanted = best_fitting(_context(setup), setup, LAYOUTS)       # the closest wanted: DDP is searched
    assert "ddp" in full and any(c.layout.method == "ddp" for c in wanted)


def test_more_gpus_suggestion_unchanged_by_the_pruning():
    """The more-GPUs what-if reads only the answer: pruned and exhaustive runs suggest the same."""
    from llmem.planner.suggestions import more_gpus_suggestions

    setup = replace(_setup("1100MiB", False), gpus=2)
    layouts = candidate_layouts(2, None, 8, 8)
    assert more_gpus_suggestions(_context(setup), setup, layouts) == \
        more_gpus_suggestions(_context(setup, prune=False), setup, layouts)


def test_a_layout_that_cannot_win_is_not_batch_searched(monkeypatch):
    """At 1600 MiB FSDP2 fits first; zero2, whose quick batch bound would let it beat FSDP2, would do so only at
    batches proved out of memory: it is not batch-searched (the exhaustive run searches it), the answer the same."""
    import llmem.planner.search as search

    setup = _setup("1600MiB", False)
    searched: list[str] = []
    real = search.search_candidate
    monkeypatch.setattr(search, "search_candidate", lambda s, lay, *a, **k: searched.append(lay.label)
                        or real(s, lay, *a, **k))
    best, _ = best_fitting(_context(setup), setup, LAYOUTS)
    pruned = list(searched)
    searched.clear()
    every, _ = best_fitting(_context(setup, prune=False), setup, LAYOUTS)
    assert _answer(best) == _answer(every)
    assert best.layout.label == "fsdp (4)"
    assert "zero2 (4)" in searched and "zero2 (4)" not in pruned, (pruned, searched)
