"""A covering sample of a matrix: the fewest rows (greedily) that still show every setting the matrix holds.

A row's settings are its model, its method and each field of its sections that differs from the field's default
(`TrainingSetup`'s sections: parallelism, step, optim, activations, adapters, ...), as (field, value) pairs. The sample
takes, in turn, the row that shows the most settings no row taken so far shows (the earlier row on a tie: the
greedy set cover, within a factor ln(n) of the smallest cover), until every setting of the matrix is shown once.

The test suite checks this sample of the CI matrix against the trace on every run (`--matrix ci-sample`); the whole
matrix, each setting in every combination it was added with, is `llmem validate --matrix ci` and `make test-slow`.

Known limitations: a setting is shown once, in one combination; a combination of two settings that each appear
elsewhere (LoRA under ZeRO-3, say) is checked only if the one row that shows a third setting happens to hold it.
"""

from __future__ import annotations

from dataclasses import MISSING, fields, is_dataclass
from typing import Any

from llmem.setup.training import TrainingSetup

# shown even at their default: each model is its own code path (its family, its anatomy), and so is each method
_ALWAYS = ("model", "method")


def _default(f) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else MISSING


def settings(setup: TrainingSetup) -> frozenset[tuple[str, str]]:
    """The (field, value) pairs this set-up shows: its model, and every section field away from its default."""
    out = set()
    for f in fields(setup):
        value = getattr(setup, f.name)
        if not is_dataclass(value):
            if f.name in _ALWAYS or value != _default(f):
                out.add((f.name, repr(value)))
            continue
        for g in fields(value):
            v = getattr(value, g.name)
            if g.name in _ALWAYS or v != _default(g):
                out.add((f"{f.name}.{g.name}", repr(v)))
    return frozenset(out)


def covering_sample(matrix: list[TrainingSetup]) -> list[TrainingSetup]:
    """The rows of `matrix` (in their order there) that together show every setting any row shows."""
    shown = [settings(s) for s in matrix]
    left = set().union(*shown) if shown else set()
    taken: list[int] = []
    while left:
        best = max(range(len(matrix)), key=lambda i: (len(shown[i] & left), -i))
        taken.append(best)
        left -= shown[best]
    return [matrix[i] for i in sorted(taken)]
