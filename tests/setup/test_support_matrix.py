"""docs/support.md, the page that answers "does option X work with Y", is the engine's own answer: regenerated here
from `llmem estimate` (docs/make_support.py) and compared with the committed page, so a rule changed anywhere (the
set-up's validation, the support check, an estimator refusal) cannot leave the page stale."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _learning_on(monkeypatch):
    """The page is made as users run llmem: activations learned where no hand recipe exists (--ep's MoE rows)."""
    from llmem.memory.activations.learned import LEARN_ENV

    monkeypatch.setenv(LEARN_ENV, "auto")


@pytest.fixture(scope="module")
def make_support():
    spec = importlib.util.spec_from_file_location("make_support", ROOT / "docs" / "make_support.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_committed_support_page_is_the_engines_answer(make_support):
    fresh = make_support.page()
    committed = (ROOT / "docs" / "support.md").read_text()
    assert fresh == committed, ("docs/support.md is stale: regenerate it with "
                                "`HF_HUB_OFFLINE=1 .venv/bin/python docs/make_support.py > docs/support.md`")


def test_cells_follow_the_documented_layout_rules(make_support):
    """Rules stated in docs/architecture.md, checked through the page's own probe: context and expert parallelism
    run under FSDP2 only; sequence parallelism needs a tensor-parallel method; DDP's reducer is no pipeline method."""
    rows = {m.label: m for m in make_support.METHOD_ROWS}
    features = {f.label: f for f in make_support.FEATURES}
    assert make_support.answer(rows["fsdp"], features["--cp 2"]) is None
    assert "--cp runs under --method fsdp" in make_support.answer(rows["ddp"], features["--cp 2"])
    assert make_support.answer(rows["fsdp"], features["--ep 2"]) is None
    assert make_support.answer(rows["tp"], features["--sequence-parallel"]) is None
    assert "applies to tensor parallelism" in make_support.answer(rows["fsdp"], features["--sequence-parallel"])
    assert "--pp runs under" in make_support.answer(rows["ddp"], features["--pp 2"])


def test_a_refusal_is_cited_once_whatever_the_method(make_support):
    reasons = make_support.Reasons()
    first = reasons.cite(make_support._method_free("--cp runs under --method fsdp only, got ddp", "ddp"))
    second = reasons.cite(make_support._method_free("--cp runs under --method fsdp only, got tp", "tp"))
    assert first == second == "no [1]"
    assert reasons.cite(None) == "yes"
