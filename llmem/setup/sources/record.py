"""A config file's record on the set-up floor's readers: what it said and what llmem made of it.

What a training config said and what llmem made of it: each field it used (file key -> llmem field = value),
each one it ignored and why, the notes on what stands in for what, and the flags that overrode the file.
`--json` prints it under "from_file"; the tables print it under the estimate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmem.setup.training import TrainingSetup


@dataclass(frozen=True)
class Used:
    """A key of the file that decided a TrainingSetup field (`field` "": read, but no effect in llmem's model)."""
    file: str           # the file's name (a referenced DeepSpeed JSON has its own)
    key: str            # as written, dotted when nested: zero_optimization.stage
    raw: Any            # the file's value
    field: str          # the TrainingSetup field it sets ("": none)
    value: Any          # what it sets
    note: str = ""

    def text(self) -> str:
        if not self.field:
            return f"{self.key} = {_short(self.raw)}: {self.note or 'read'}"
        return f"{self.key} = {_short(self.raw)} -> {self.field} = {self.value}" + (f" ({self.note})" if self.note
                                                                                     else "")

    def to_dict(self) -> dict:
        return {"file": self.file, "key": self.key, "raw": _plain(self.raw), "field": self.field or None,
                "value": _plain(self.value), "note": self.note or None}


@dataclass(frozen=True)
class Ignored:
    """A key of the file llmem cannot express (or that has no effect on memory), and why."""
    file: str
    key: str
    raw: Any
    why: str
    approximates: bool = True     # it changes memory and is not modelled: the answer is not the file's run
    settled_by: str = ""          # the TrainingSetup field that, given on the command line, settles it

    def text(self) -> str:
        return f"{self.key} = {_short(self.raw)}: {self.why}"

    def to_dict(self) -> dict:
        return {"file": self.file, "key": self.key, "raw": _plain(self.raw), "why": self.why,
                "approximates": self.approximates}


@dataclass(frozen=True)
class SourceRecord:
    files: tuple[tuple[str, str], ...]      # (path, format) in reading order, referenced files after their referrer
    used: tuple[Used, ...]
    ignored: tuple[Ignored, ...]
    notes: tuple[str, ...] = ()
    overridden: tuple[str, ...] = ()        # the fields the command line set over the file's
    states_method: bool = False             # the file names the distributed method (not left to the launcher)

    @property
    def approximations(self) -> tuple[Ignored, ...]:
        """The ignored keys that change memory: the answer is the file's run without them."""
        return tuple(i for i in self.ignored if i.approximates)

    @property
    def exact(self) -> bool:
        return not self.approximations

    def to_dict(self) -> dict:
        return {"exact": self.exact, "approximate_because": [f"{i.key}: {i.why}" for i in self.approximations],
                "files": [{"path": p, "format": f} for p, f in self.files],
                "used": [u.to_dict() for u in self.used], "ignored": [i.to_dict() for i in self.ignored],
                "notes": list(self.notes), "overridden_by_command_line": list(self.overridden),
                "states_method": self.states_method}


@dataclass(frozen=True)
class FileSetup:
    """The set-up a training config describes (with the command line's overrides) and how it was read."""
    setup: TrainingSetup
    record: SourceRecord


def _plain(value: Any) -> Any:
    """A value JSON can hold as it is (tuples as lists, anything else odd as its text)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


def _short(value: Any, limit: int = 100) -> str:
    text = str(_plain(value))
    return text if len(text) <= limit else text[:limit - 3] + "..."
