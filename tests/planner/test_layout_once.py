"""The layout resolved once: the planner resolves each candidate layout (llmem.setup.layout.candidate_layouts) and
hands that `Layout` to the engines, which take it as it is (llmem.model.resolved.resolve's `layout`, the paper
engine's) instead of resolving it again from the set-up's fields; the support checks run on the layout given."""

from __future__ import annotations

from dataclasses import replace

import pytest

import llmem.model.resolved as resolved
import llmem.paper.engine as paper
import llmem.setup.layout as layouts
from llmem.errors import LlmemError
from llmem.model.anatomy import load_anatomy
from llmem.planner.engines import LlmemEngine
from llmem.planner.options import PlanOptions
from llmem.planner.plan import plan
from llmem.setup.gpus import resolve_gpu
from llmem.setup.layout import Layout, candidate_layouts
from llmem.setup.training import TrainingSetup


@pytest.fixture
def calls(monkeypatch):
    """resolve_layout's calls, by who made them: the planner's layout search, or an engine's resolve."""
    made = {"planner": 0, "engines": 0}

    def counted(who, real):
        def wrapper(*args, **kwargs):
            made[who] += 1
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(layouts, "resolve_layout", counted("planner", layouts.resolve_layout))
    monkeypatch.setattr(resolved, "resolve_layout", counted("engines", resolved.resolve_layout))
    monkeypatch.setattr(paper, "resolve_layout", counted("engines", paper.resolve_layout))
    return made


@pytest.mark.parametrize("engine", ["llmem", "paper"])
def test_a_plan_resolves_each_layout_once(calls, engine):
    # tiny-llama on 4 GPUs: ddp, fsdp, zero2, tp, fsdp+tp; under the llmem engine the pp and cp layouts too
    setup = TrainingSetup(model="tiny-llama", gpus=4, seq_len=256)
    p = plan(setup, PlanOptions(engine=engine, ranking="paper" if engine == "paper" else "time", batch_cap=8))
    assert len(p.candidates) >= 4 and all(c.memory.setup.layout == c.layout.label for c in p.candidates)
    assert calls["planner"] >= 5
    assert calls["engines"] == 0


def test_an_engine_keeps_the_layout_it_is_given(calls):
    anatomy, gpu = load_anatomy("tiny-llama"), resolve_gpu("A100-80GB")
    base = TrainingSetup(model="tiny-llama", gpus=4, seq_len=256)
    lay = next(x for x in candidate_layouts(4, None, 8, 8) if x.method == "fsdp+tp")
    engine = LlmemEngine(anatomy, gpu)
    assert engine.resolved(base.with_layout(lay, 2), lay).layout is lay
    engine.full(base.with_layout(lay, 2), lay)
    assert calls["engines"] == 0
    engine.full(replace(base.with_layout(lay, 2), grad_ckpt=True))     # no layout given: from the set-up's fields
    assert calls["engines"] == 1


def test_the_support_checks_run_on_the_layout_given():
    # --loss-parallel with --fused-ce is refused on a tensor-parallel layout, whichever way it comes
    anatomy, gpu = load_anatomy("tiny-llama"), resolve_gpu("A100-80GB")
    lay = Layout("fsdp+tp", 2, 2, 4)
    setup = TrainingSetup(model="tiny-llama", method="fsdp+tp", gpus=4, tp=2, loss_parallel=True, fused_ce=True)
    with pytest.raises(LlmemError, match="--fused-ce"):
        resolved.resolve(setup.with_layout(lay, 1), anatomy, gpu, lay)
    with pytest.raises(LlmemError, match="--fused-ce"):
        resolved.resolve(setup, anatomy, gpu)


def test_a_layout_resolved_without_the_heads_is_checked_against_them():
    # the paper engine's layouts skip the head check (its 1D TP splits weights); the llmem engine's what-ifs under
    # a paper plan get them: tp 3 divides neither of tiny-llama's 8 query and 8 key/value heads
    anatomy, gpu = load_anatomy("tiny-llama"), resolve_gpu("A100-80GB")
    lay = Layout("tp", 1, 3, 3)
    setup = TrainingSetup(model="tiny-llama", gpus=3).with_layout(lay, 1)
    with pytest.raises(LlmemError, match=r"--tp 3 does not divide the model's attention heads \(8 query, 8 key"):
        resolved.resolve(setup, anatomy, gpu, lay)
