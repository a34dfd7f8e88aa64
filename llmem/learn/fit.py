"""The exact fit: each allocation's bytes as a polynomial in TERMS (1, b, s, b*s, b*s^2) through the POINTS, in
rational arithmetic, and the sums and dominance of such sizes."""

from __future__ import annotations

from fractions import Fraction

from llmem.learn.points import Exact, LearnError, Reading
from llmem.memory.activations.learned import TERMS


def _basis(b: int, s: int) -> tuple[int, ...]:
    return (1, b, s, b * s, b * s * s)


def _solve(rows: list[list[Fraction]], rhs: list[Fraction]) -> list[Fraction]:
    """Gauss-Jordan elimination in exact arithmetic."""
    n = len(rows)
    m = [row[:] + [v] for row, v in zip(rows, rhs, strict=True)]
    for c in range(n):
        pivot = next((r for r in range(c, n) if m[r][c] != 0), None)
        if pivot is None:
            raise LearnError("the learning points do not determine the size terms (a singular design)")
        m[c], m[pivot] = m[pivot], m[c]
        inv = 1 / m[c][c]
        m[c] = [v * inv for v in m[c]]
        for r in range(n):
            if r != c and m[r][c] != 0:
                f = m[r][c]
                m[r] = [a - f * bv for a, bv in zip(m[r], m[c], strict=True)]
    return [m[r][n] for r in range(n)]


def _signature(rd: Reading) -> list[tuple]:
    """The step's shape, sizes aside: each event's kind, phase, category and module, frees by their alloc's rank."""
    rank: dict[int, int] = {}
    out = []
    for a, key, _size, phase, cat, module in rd.events:
        if a:
            rank[key] = len(rank)
            out.append((True, phase, cat, module))
        else:
            out.append((False, phase, rank.get(key, -1)))
    return out


def check_alike(readings: list[Reading], points) -> None:
    """The points must run the same allocations in the same order (sizes aside); else LearnError says where."""
    first = _signature(readings[0])
    for rd, (b, s) in zip(readings[1:], points[1:len(readings)], strict=True):
        sig = _signature(rd)
        if sig != first:
            at = next((i for i, (x, y) in enumerate(zip(first, sig, strict=False)) if x != y), min(len(first),
                                                                                                   len(sig)))
            raise LearnError(f"the step allocates differently at batch {b} x {s} tokens than at {points[0][0]} x "
                             f"{points[0][1]} (event {at} of {len(first)}): its sizes are not polynomials in "
                             f"{', '.join(TERMS)}")


def fit_sizes(readings: list[Reading], points) -> dict[int, Exact]:
    """Each allocation's bytes (by its rank among the allocations) as a polynomial in TERMS, fitted exactly through
    the points (one point: its bytes, a constant, valid at that shape alone). The points must run the same
    allocations in the same order."""
    check_alike(readings, points)
    rows = [[Fraction(v) for v in _basis(b, s)] for b, s in points]
    per_point = [[size for a, _k, size, *_ in rd.events if a] for rd in readings]
    # one elimination for every allocation: invert the design once (columns of the identity)
    n = len(rows)
    inverse_cols = [_solve(rows, [Fraction(int(i == j)) for i in range(n)]) for j in range(n)]
    out: dict[int, Exact] = {}
    for rank, values in enumerate(zip(*per_point, strict=True)):
        if len(set(values)) == 1:
            out[rank] = (Fraction(values[0]),) + (Fraction(0),) * (len(TERMS) - 1)
            continue
        coeffs = [sum(inverse_cols[j][i] * values[j] for j in range(n)) for i in range(n)]
        out[rank] = tuple(coeffs)
    return out


def add_sizes(p: Exact, q: Exact, sign: int = 1) -> Exact:
    return tuple(a + sign * b for a, b in zip(p, q, strict=True))


ZERO: Exact = (Fraction(0),) * len(TERMS)


def sum_sizes(polys) -> Exact:
    total = ZERO
    for p in polys:
        total = add_sizes(total, p)
    return total


def _dominated(p: Exact, q: Exact) -> bool:
    """p <= q at every b, s >= 1 (every coefficient of q - p non-negative)."""
    return all(b >= a for a, b in zip(p, q, strict=True))


def prune_sizes(candidates: list[Exact]) -> tuple[Exact, ...]:
    kept: list[Exact] = []
    for c in sorted(set(candidates), key=lambda p: tuple(-x for x in reversed(p))):
        if not any(_dominated(c, k) for k in kept):
            kept = [k for k in kept if not _dominated(k, c)] + [c]
    return tuple(kept)


