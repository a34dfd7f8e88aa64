"""JSON that gives back the very Python values it was written from: a tuple, or a dict with keys other than
strings (transformers' id2label {0: "LABEL_0"}), is written tagged, and `same` compares values and their types all
the way down (1 == 1.0 == True would hide a change). What the anatomy files (llmem.model.anatomy) hold their config
dicts in."""

from __future__ import annotations

from typing import Any

_TUPLE, _ITEMS = "__tuple__", "__items__"


def tagged(value: Any) -> Any:
    """A value as plain JSON, tuples and dicts with non-string keys tagged."""
    if isinstance(value, tuple):
        return {_TUPLE: [tagged(v) for v in value]}
    if isinstance(value, list):
        return [tagged(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TUPLE not in value and _ITEMS not in value:
            return {k: tagged(v) for k, v in value.items()}
        return {_ITEMS: [[tagged(k), tagged(v)] for k, v in value.items()]}
    return value


def untagged(value: Any) -> Any:
    """The value `tagged` wrote, as it was."""
    if isinstance(value, list):
        return [untagged(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(untagged(v) for v in value[_TUPLE])
        if set(value) == {_ITEMS}:
            return {untagged(k): untagged(v) for k, v in value[_ITEMS]}
        return {k: untagged(v) for k, v in value.items()}
    return value


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(k1, k2) and same(a[k1], b[k2]) for k1, k2 in zip(a, b, strict=True))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b or (a != a and b != b)       # NaN reads back as NaN
