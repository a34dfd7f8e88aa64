"""The configs tests/setup/sources/data holds: one per objective and adapter family each framework documents,
written in the framework's own schema (most after its own example files, named in each file's first line), and
the checks the per-framework tests run on what llmem read from them. The expected values are written in the tests
by reading the files, never taken from llmem's output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmem.setup.sources import FileSetup, setup_from_file

DATA = Path(__file__).parent / "setup" / "sources" / "data"


def read(framework: str, name: str, **overrides: Any) -> FileSetup:
    return setup_from_file(DATA / framework / name, **overrides)


def check(fs: FileSetup, expected: dict[str, Any]) -> None:
    """Every field `expected` names, as the set-up llmem used has it."""
    got = {field: getattr(fs.setup, field) for field in expected}
    assert got == expected


def peft(fs: FileSetup) -> dict[str, Any]:
    """The adapter_config.json llmem wrote for peft (the fields that shape the adapters)."""
    assert fs.setup.peft_config, "the adapters went through a peft config"
    config = json.loads(Path(fs.setup.peft_config).read_text())
    return {k: v for k, v in config.items() if v is not None and k not in ("task_type", "bias")}


def approximate(fs: FileSetup) -> set[str]:
    """The keys that make the answer approximate (empty: the file's run as read)."""
    assert fs.record.exact == (not fs.record.approximations)
    return {i.key for i in fs.record.approximations}


def check_case(fs: FileSetup, fields: dict[str, Any], peft_fields: dict[str, Any] | None,
               approx: set[str] = frozenset()) -> None:
    """One documented pair as read: the set-up's fields, the peft config written (None: no adapters through peft)
    and the keys that make the answer approximate."""
    check(fs, fields)
    if peft_fields is None:
        assert fs.setup.peft_config is None
    else:
        assert peft(fs) == peft_fields
    assert approximate(fs) == set(approx)
