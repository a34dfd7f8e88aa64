"""A plan's independent searches side by side: each in a worker process forked from the plan's (the anatomy, the
engine and the answers it keeps come with the fork; each search's answer is pickled back), the results in the
order given. The workers never print; the caller is told as each search is done.

The answers do not depend on it: a search reads only what the plan had worked out when the workers started, and an
engine's caches keep answers, not choices (the same set-up gives the same estimate whichever process works it out
first). A search's refusal (LlmemError) or failure comes back as an exception raised here. The searches run in turn
in this process instead with `workers` 1 (one CPU; `llmem serve`, whose threads and fork do not mix), where fork is
not the platform's way to start a process (macOS, Windows), inside a worker, and where the fork fails or an answer
cannot be pickled back.

Known Limitations: a worker's caches die with it, so two searches in different workers that meet the same set-up
each work it out; the plan's CPU time grows by that (measured in benchmarks/cli_timing.md) while its wall time falls.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from multiprocessing.pool import MaybeEncodingError
from typing import TypeVar

T = TypeVar("T")

# the searches the forked workers run, by index (inherited by the fork: closures cannot be pickled to them)
_TASKS: Sequence[Callable[[], object]] = ()
_IN_WORKER = False


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:          # not Linux
        return os.cpu_count() or 1


def can_fork() -> bool:
    return sys.platform == "linux" and not _IN_WORKER


def side_by_side(tasks: Sequence[Callable[[], T]], workers: int, first: Sequence[int] | None = None,
                 done: Callable[[int, int], None] | None = None) -> list[T]:
    """Each task's result, in order, the tasks run by up to `workers` forked processes (in turn here where
    `workers` <= 1, there is one task or fork is unavailable). `first`: the order the tasks are handed out in
    (default: as given; the longest first keeps the workers busy to the end); `done(index, count)` is called here as
    each task is done (`count` done so far)."""
    order = list(first) if first is not None else list(range(len(tasks)))
    if workers > 1 and len(tasks) > 1 and can_fork():
        try:
            return _forked(tasks, min(workers, len(tasks)), order, done)
        except (OSError, MaybeEncodingError):    # no process to fork (a limit), an answer pickle cannot carry
            pass
    results: dict[int, T] = {}
    for i in order:
        results[i] = tasks[i]()
        if done:
            done(i, len(results))
    return [results[i] for i in range(len(tasks))]


def _forked(tasks: Sequence[Callable[[], T]], workers: int, order: list[int],
            done: Callable[[int, int], None] | None) -> list[T]:
    global _TASKS
    _TASKS = tasks
    results: dict[int, T] = {}
    # the plan's objects, inherited by the fork, left out of every collection (the parent's too) until the workers
    # are done: a worker's collector then neither walks nor copies them (gc.freeze, Python's advice before fork)
    gc.freeze()
    try:
        with multiprocessing.get_context("fork").Pool(workers, initializer=_enter_worker) as pool:
            for i, value in pool.imap_unordered(_run, order):
                results[i] = value
                if done:
                    done(i, len(results))
    finally:
        _TASKS = ()
        gc.unfreeze()
    return [results[i] for i in range(len(tasks))]


def _enter_worker() -> None:
    """A worker runs its searches in turn (no pool of its own) and prints nothing: stdout is the answer's, and the
    plan's streams may have been locked by another thread (a progress bar's) when the fork copied them."""
    global _IN_WORKER
    _IN_WORKER = True
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    sys.stdout = sys.stderr = open(os.devnull, "w")    # noqa: SIM115 (the worker's own, for its lifetime)


def _run(i: int) -> tuple[int, object]:
    return i, _TASKS[i]()
