"""Progress for anything slower than a second, on stderr (stdout holds the answer: llmem.cli.streams).

The rich bars leave sys.stdout and sys.stderr alone (redirect_stdout / redirect_stderr off): a bar started inside
llmem.cli.streams' redirect and stopped after it would otherwise restore the redirected stream as sys.stdout."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class LazyProgress:
    """A rich progress bar on stderr (stdout keeps only the answer) that appears only once the plan has taken more
    than `delay_s`."""

    def __init__(self, enabled: bool, delay_s: float = 1.0) -> None:
        self.enabled, self.delay_s, self.start = enabled, delay_s, time.monotonic()
        self.bar = self.task = None

    def __call__(self, description: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            if time.monotonic() - self.start < self.delay_s:
                return
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), transient=True,
                                console=Console(stderr=True), redirect_stdout=False, redirect_stderr=False)
            self.bar.start()
            self.task = self.bar.add_task(description, total=total)
        self.bar.update(self.task, description=description, completed=done, total=total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def remaining_s(elapsed_s: float, done: int, total: int) -> float | None:
    """The time the rows left take at the mean pace of those done (None before the first)."""
    if done <= 0:
        return None
    return elapsed_s / done * (total - done)


def duration_text(seconds: float) -> str:
    """A coarse duration: 45 s, 12 min, 1 h 05 min."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


class RowProgress:
    """Rows of a long run (validate's matrix): on a terminal, a rich bar with the elapsed time and the time left; in
    a log (stderr not a terminal), one line per row done: `validate: 3/34 rows, 2 min elapsed, ~21 min left (LABEL)`.
    The time left is the mean row's time times the rows left."""

    def __init__(self, title: str, total: int, stream: TextIO | None = None) -> None:
        self.title, self.total, self.done = title, total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.monotonic()
        self.bar = self.task = None
        if self.stream.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(), transient=True,
                                console=Console(file=self.stream), redirect_stdout=False, redirect_stderr=False)
            self.task = self.bar.add_task(title, total=total)

    def __enter__(self) -> RowProgress:
        if self.bar is not None:
            self.bar.start()
        else:
            print(f"{self.title}: {self.total} rows", file=self.stream, flush=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def advance(self, label: str = "") -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.advance(self.task)
            return
        elapsed = time.monotonic() - self.start
        left = remaining_s(elapsed, self.done, self.total)
        ahead = f", ~{duration_text(left)} left" if left and self.done < self.total else ""
        print(f"{self.title}: {self.done}/{self.total} rows, {duration_text(elapsed)} elapsed{ahead}"
              + (f" ({label})" if label else ""), file=self.stream, flush=True)
