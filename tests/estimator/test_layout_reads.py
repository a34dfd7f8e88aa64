"""The layout is resolved once (llmem.model.resolved: the set-up's parallelism section into a `Layout`) and the
estimator reads it there: no module of the estimator or memory floors reads a layout degree or the method off the
set-up (`setup.pp`, `r.setup.method`), where a pipeline stage's or a planner's derived set-up may say otherwise
than the layout it runs under."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE_FLOORS = ("llmem/estimator", "llmem/memory")
LAYOUT_FIELDS = {"method", "gpus", "gpus_per_node", "tp", "pp", "cp", "ep", "dp_replicate"}


def _setup_layout_reads(source: str) -> list[tuple[int, str]]:
    """(line, field) of every `<...>setup.<layout field>` read."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in LAYOUT_FIELDS:
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in ("setup", "s_setup", "base") or name.endswith("_setup"):
                found.append((node.lineno, node.attr))
    return found


def test_the_check_finds_a_read():
    assert _setup_layout_reads("x = r.setup.pp\ny = setup.method\nz = r.layout.pp\n") == [(1, "pp"), (2, "method")]


def test_engines_read_the_resolved_layout():
    offenders = {}
    for floor in ENGINE_FLOORS:
        for path in sorted((ROOT / floor).rglob("*.py")):
            found = _setup_layout_reads(path.read_text())
            if found:
                offenders[path.relative_to(ROOT).as_posix()] = found
    assert not offenders, f"read the layout from ResolvedSetup.layout (r.layout.pp, r.method): {offenders}"
