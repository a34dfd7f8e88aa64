"""`IdentityCache`: values worked out from one object (a model's anatomy) and a hashable key, kept for the searches
that ask for them again.

A planner's search builds tens of step schedules of one set-up; what they share is worked out once (the parameters'
shape-free facts, a pipeline rank's sub-model). The object is compared by identity, not hashed (an anatomy's
parameter tuple holds thousands of rows), and held by its entry, so its id cannot be reused while the entry lives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class IdentityCache(Generic[V]):
    """A least-recently-used store of (owner, key) -> value, the owner compared by identity; `size` entries."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._kept: OrderedDict[tuple[int, Hashable], tuple[object, V]] = OrderedDict()

    def get(self, owner: object, key: Hashable, work_out: Callable[[], V]) -> V:
        """The value kept for `owner` (the same object) and `key`, else `work_out()`, kept (the oldest dropped)."""
        k = (id(owner), key)
        got = self._kept.get(k)
        if got is not None and got[0] is owner:
            self._kept.move_to_end(k)
            return got[1]
        value = work_out()
        self._kept[k] = (owner, value)
        if len(self._kept) > self.size:
            self._kept.popitem(last=False)
        return value

    def clear(self) -> None:
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)
