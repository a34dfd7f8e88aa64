"""A progress bar for anything slower than a second."""

from __future__ import annotations

import time


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
                                console=Console(stderr=True))
            self.bar.start()
            self.task = self.bar.add_task(description, total=total)
        self.bar.update(self.task, description=description, completed=done, total=total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()

