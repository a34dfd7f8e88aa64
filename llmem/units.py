"""Quantities: bytes parsed from user input ("80GiB", "40GB", "512MiB") and formatted for people; fractions; counts."""

from __future__ import annotations

import math
import re

from llmem.errors import LlmemError

KIB = 1024
MIB = 1024**2
GIB = 1024**3

MAX_BYTES = 1 << 60      # 1 EiB: any memory size past this is a typo (and would overflow the allocator's int64 keys)
MAX_COUNT = 10**18       # counts (dataset tokens) past this are a typo: the largest corpora are ~1e14 tokens

_UNIT_BYTES = {
    "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": KIB, "mib": MIB, "gib": GIB, "tib": 1024**4,
    "k": KIB, "m": MIB, "g": GIB, "t": 1024**4,  # bare letters follow nvidia-smi / PyTorch habit: binary
}


def parse_bytes(text: str | int | float) -> int:
    """'80GiB' -> 85899345920; '40GB' -> 40e9; '2048MiB'; a bare number is bytes."""
    if isinstance(text, (int, float)):
        return _bounded_bytes(text, text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match:
        raise LlmemError(f"cannot read memory size {text!r}: write a number and a unit, e.g. 80GiB, 40GB, 24576MiB")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNIT_BYTES:
        raise LlmemError(f"unknown unit {match.group(2)!r} in {text!r}: use B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)")
    return _bounded_bytes(number * _UNIT_BYTES[unit], text)


def _bounded_bytes(n: float, text: object) -> int:
    if not math.isfinite(n) or n <= 0:
        raise LlmemError(f"memory size must be a positive number, got {text!r}")
    if n > MAX_BYTES:
        raise LlmemError(f"memory size {text!r} is beyond 1 EiB (2**60 bytes): give the GPU's memory, e.g. 80GiB")
    return int(n)


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
    value = text if isinstance(text, int) else _count_value(str(text))
    if not 1 <= value <= MAX_COUNT:     # False for nan too
        raise LlmemError(f"count {text!r} must lie in [1, 1e18]")
    return int(value)


def _count_value(text: str) -> float:
    s = text.strip().replace("_", "").replace(",", "")
    mult = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(s[-1:].lower(), 1)
    try:
        return float(s[:-1] if mult != 1 else s) * mult
    except ValueError:
        raise LlmemError(f"cannot read count {text!r}: write e.g. 2e9, 500M or 1.5B") from None
