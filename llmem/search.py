"""Search on the ground floor: monotone searches, the largest value a predicate accepts with few calls of it.

Pure functions over `fits(x) -> bool` (true up to some x, false after it). The planner searches batch sizes and
sequence lengths with them; LLMem's Algorithm 1 (llmem.paper.algorithm1) its inner batch loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

BATCH_CAP = 4096                    # the batch search stops here


def max_batch_size(fits: Callable[[int], bool], cap: int = BATCH_CAP) -> int:
    """Largest b in [1, cap] with fits(b), 0 if fits(1) is false; fits must be monotone (true then false).

    Exponential probe 1, 2, 4, ... until the first failure (or the cap), then bisection between the last success
    and the first failure: about 2 log2(b) calls.
    """
    if cap < 1 or not fits(1):
        return 0
    lo = 1
    hi = 2
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    if hi > cap:
        if lo == cap or fits(cap):
            return cap
        hi = cap
    return bisect_max(fits, lo, hi)


def bisect_max(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest fitting value between lo (fits) and hi (does not fit)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def refine_max(fits: Callable[[int], bool], guess: int, cap: int = BATCH_CAP) -> int:
    """The largest b in [1, cap] with fits(b) (monotone), starting from a guess from a cheaper model: probe away
    from the guess at offsets 1, 2, 4, ... until the answer is bracketed, then bisect (O(log |error|) calls; a
    guess one short costs 3, an exact one 2)."""
    guess = min(max(guess, 1), cap)
    if fits(guess):
        lo, step = guess, 1
        while lo + step <= cap and fits(lo + step):
            lo += step
            step = lo - guess           # the next probe twice as far from the guess
        hi = min(lo + step, cap + 1)
    else:
        hi, step = guess, 1
        while hi - step >= 1 and not fits(hi - step):
            hi -= step
            step = guess - hi
        lo = hi - step
        if lo < 1:
            if not fits(1):
                return 0
            lo = 1
    return bisect_max(fits, lo, hi)


def calibrated_max(used: Callable[[int], int], quick: Callable[[int], int], limit: int, cap: int) -> int:
    """Largest x in [1, cap] with used(x) <= limit (0 if none), with few calls of the costly `used`: search the
    cheap `quick` scaled by used/quick measured at x = 1 and again near that answer, then refine on `used`."""
    used = functools.cache(used)
    if used(1) > limit:
        return 0

    def guess_at(x: int) -> int:
        ratio = used(x) / max(quick(x), 1)
        return max_batch_size(lambda b: quick(b) * ratio <= limit, cap)

    guess = guess_at(1)
    if guess > 1:
        guess = max(1, guess_at(guess))        # the ratio drifts with x: measure it near the answer
    return refine_max(lambda x: used(x) <= limit, guess, cap)
