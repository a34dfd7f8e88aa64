"""How a set-up field is asked for on the command line: each field of the set-up's sections carries an `Option` in
its metadata, and llmem.cli builds the argument parser from them, so a new field is a new flag without a second list
to keep in step. Also the value parsers the flags share (`count`, `count_or_auto`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from llmem.errors import LlmemError

MAX_COUNT = 1 << 48            # a DeepSpeed size in elements: 2**48 bf16 elements are 512 TiB

# Option.group: the sections of --help
LAYOUT, STEP, OPTIMIZER, ACTIVATIONS, ADAPTERS, MODEL, DEEPSPEED = "layout", "step", "optimizer", "activations", \
    "adapters", "model", "deepspeed"
JOB = "job"
IMAGES = "images"


@dataclass(frozen=True)
class Option:
    """How a set-up field is asked for on the command line.

    kind: "value" (a flag taking a value of `type`), "switch" (a flag that sets True), "switches" (flags that each
    set the value they map to, at most one of them), "negate" (a flag that sets False), "positional".
    """
    help: str
    group: str
    kind: str = "value"
    flag: str | None = None                  # default: --field-name
    type: Any = str
    metavar: str | None = None
    cli_default: Any = ...                   # the parser's default when it differs from the field's (None: unset)
    switches: tuple[tuple[str, Any, str], ...] = ()   # kind "switches": (flag, value, help)
    noun: str = ""                               # kind "switches": what one chooses ("choose one <noun>")
    implies: tuple[tuple[str, Any], ...] = ()    # given: these fields take these values too
    requires: tuple[str, Any] | None = None      # kind "negate": only with field == value


def option(default: Any, help: str, group: str, **kw: Any) -> Any:
    """A dataclass field with its command-line `Option`."""
    return field(default=default, metadata={"option": Option(help, group, **kw)})


def count(text: str) -> int:
    """A count of elements as DeepSpeed's configs write them: 500000000, 5e8 or 5_0000_0000."""
    if isinstance(text, int) and not isinstance(text, bool):
        return count(str(text))
    try:
        value = float(str(text).replace("_", ""))
    except ValueError:
        raise LlmemError(f"{text!r} is not a count: write e.g. 500000000 or 5e8") from None
    if not math.isfinite(value) or value != int(value) or value < 0:
        raise LlmemError(f"{text!r} is not a whole number of elements >= 0: write e.g. 500000000 or 5e8")
    if value > MAX_COUNT:
        raise LlmemError(f"{text!r} elements is more than any GPU holds (at most 2**48): write e.g. 500000000 or 5e8")
    return int(value)


def count_or_auto(text: str) -> int | str:
    """A count, or "auto": the value HF's Trainer and accelerate fill from the model's hidden size."""
    return "auto" if str(text).strip().lower() == "auto" else count(text)
