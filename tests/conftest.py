"""Every test runs with its own empty cache of learned activations (CI machines start empty; a developer's
~/.cache/llmem is never read or written). Learning (LLMEM_LEARN) is as users get it (auto) in the validation of the
CI matrix, whose rows include set-ups without a hand recipe, and off (never) elsewhere unless a test sets it: there
set-ups without a hand recipe keep their fallback activations (learning one takes seconds). tests/test_learned.py
turns learning on where it checks it."""

from __future__ import annotations

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
