"""Every test runs with its own empty cache of learned activations (CI machines start empty; a developer's
~/.cache/llmem is never read or written). Learning (LLMEM_LEARN) is as users get it (auto) in the validation of the
CI matrix, whose rows include set-ups without a hand recipe, and off (never) elsewhere unless a test sets it: there
set-ups without a hand recipe keep their fallback activations (learning one takes seconds). tests/learn/test_learned.py
turns learning on where it checks it."""

from __future__ import annotations

import json

import pytest

LEARNING_MODULES = ("test_validate",)     # test modules that run with LLMEM_LEARN=auto


@pytest.fixture(autouse=True)
def _learned_activations_isolated(request, tmp_path_factory, monkeypatch):
    from llmem.memory.activations.learned import CACHE_ENV, LEARN_ENV, forget_in_memory

    monkeypatch.setenv(CACHE_ENV, str(tmp_path_factory.getbasetemp() / "llmem-cache"))
    module = request.node.module.__name__.rsplit(".", 1)[-1] if request.node.module else ""
    monkeypatch.setenv(LEARN_ENV, "auto" if module in LEARNING_MODULES else "never")
    yield
    forget_in_memory()


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    """A 2-layer Llama config.json (hidden 256, MLP 512, vocab 2000): real CPU steps of it take seconds."""
    path = tmp_path_factory.mktemp("cfg") / "small_llama.json"
    path.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2000, "max_position_embeddings": 512,
        "tie_word_embeddings": False}))
    return str(path)


def pytest_collection_modifyitems(items) -> None:
    """Tests marked `first` (the CI matrix's sample, a minute or two each) run before the rest: the test workers
    (pytest -n, --dist worksteal) then end on short tests instead of one of them waiting on a long one."""
    items.sort(key=lambda item: item.get_closest_marker("first") is None)


def pytest_report_header(config) -> str:
    from published_configs import CONFIGS, SKIP_REASON, present

    return f"published configs: {CONFIGS}" if present() else f"published configs: MISSING: {SKIP_REASON}"


def pytest_terminal_summary(terminalreporter) -> None:
    """Every skip counted by its reason at the end of the run, in yellow: a plain clone (no ../shared) or a missing
    optional package skips tests, and the run says which and how to run them instead of a bare "N skipped"."""
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if not reasons:
        return
    terminalreporter.section(f"{sum(reasons.values())} tests skipped", sep="=", yellow=True, bold=True)
    for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{count:4d} x {reason}", yellow=True)
