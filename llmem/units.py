"""Quantities: bytes parsed from user input ("80GiB", "40GB", "512MiB") and formatted for people; fractions; counts."""

from __future__ import annotations

import re

from llmem.errors import LlmemError

KIB = 1024
MIB = 1024**2
GIB = 1024**3

_UNIT_BYTES = {
    "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": KIB, "mib": MIB, "gib": GIB, "tib": 1024**4,
    "k": KIB, "m": MIB, "g": GIB, "t": 1024**4,  # bare letters follow nvidia-smi / PyTorch habit: binary
}


def parse_bytes(text: str | int | float) -> int:
    """'80GiB' -> 85899345920; '40GB' -> 40e9; '2048MiB'; a bare number is bytes."""
    if isinstance(text, (int, float)):
        if text <= 0:
            raise LlmemError(f"memory size must be positive, got {text}")
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match:
        raise LlmemError(f"cannot read memory size {text!r}: write a number and a unit, e.g. 80GiB, 40GB, 24576MiB")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNIT_BYTES:
        raise LlmemError(f"unknown unit {match.group(2)!r} in {text!r}: use B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)")
    if number <= 0:
        raise LlmemError(f"memory size must be positive, got {text!r}")
    return int(number * _UNIT_BYTES[unit])


def parse_fraction(text: str | float) -> float:
    """'5%' -> 0.05; '0.05' -> 0.05."""
    s = str(text).strip()
    try:
        value = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise LlmemError(f"cannot read fraction {text!r}: write e.g. 5% or 0.05") from None
    if not 0 <= value < 1:
        raise LlmemError(f"fraction {text!r} must lie in [0, 100%)")
    return value


def format_bytes(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.50 KiB'."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", 1024**4), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def parse_count(text: str | int | None) -> int | None:
    """'2e9', '500M', '1.5B', '3T', '1000000' -> an integer count."""
    if text is None:
        return None
    if isinstance(text, int):
        return text
    s = str(text).strip().replace("_", "").replace(",", "")
    mult = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(s[-1:].lower(), 1)
    if mult != 1:
        s = s[:-1]
    try:
        value = float(s) * mult
    except ValueError:
        raise LlmemError(f"cannot read count {text!r}: write e.g. 2e9, 500M or 1.5B") from None
    if value < 1:
        raise LlmemError(f"count {text!r} must be >= 1")
    return int(value)
