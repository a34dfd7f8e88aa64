"""Sizes fitted from the real code (llmem.learn): polynomials in the micro-batch b and the tokens per sample s,
fitted exactly in rational arithmetic and kept as floats, and their JSON form (the disk cache's)."""

from __future__ import annotations

from fractions import Fraction

# bytes = c[0] + c[1] b + c[2] s + c[3] b s + c[4] b s^2: constants for weight-sized tensors, s for tensors shared by
# the batch (rotary cos/sin), b s per token, b s^2 for eager attention's scores and packed masks
TERMS = ("1", "b", "s", "b*s", "b*s^2")
Poly = tuple[float, ...]           # fitted exactly (fractions), kept as floats: evaluated at every estimate


def poly_at(p: Poly, b: int, s: int) -> int:
    """A fitted size at micro-batch b and s tokens per sample, in bytes (never negative)."""
    value = p[0] + p[1] * b + p[2] * s + p[3] * b * s + p[4] * b * s * s
    return max(int(round(value)), 0)


def encode(p: Poly) -> list[str]:
    return [str(c) for c in p]


def decode(p: list) -> Poly:
    return as_floats(tuple(Fraction(c) for c in p))


def as_floats(p) -> Poly:
    """A fitted polynomial's coefficients as floats (exact for the byte sizes of any real step: below 2^53)."""
    return tuple(float(c) for c in p)
