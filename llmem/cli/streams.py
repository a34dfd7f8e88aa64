"""stdout holds the answer only: the table, or the one JSON document of --json.

What the engines' libraries print while they run goes to stderr instead: DeepSpeed's accelerator warning (its
logger's StreamHandler is bound to sys.stdout when deepspeed is imported), its engine's `see_memory_usage` lines
(print()), and anything written to file descriptor 1 from C. Both levels are redirected: Python's sys.stdout, and
fd 1 itself (os.dup2), so that a handler holding the original sys.stdout object writes to stderr too.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Within the block, whatever is written to stdout (Python's or the process's fd 1) lands on stderr."""
    sys.stdout.flush()
    with contextlib.redirect_stdout(sys.stderr), _fd_to_stderr():
        try:
            yield
        finally:
            sys.stdout.flush()


@contextlib.contextmanager
def _fd_to_stderr() -> Iterator[None]:
    """fd 1 pointed at stderr's file, restored on exit (a stdout without a file descriptor, e.g. a captured
    io.StringIO, needs only the Python-level redirect)."""
    try:
        out_fd, err_fd = sys.__stdout__.fileno(), sys.__stderr__.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        yield
        return
    sys.__stdout__.flush()
    saved = os.dup(out_fd)
    try:
        os.dup2(err_fd, out_fd)
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.__stdout__.flush()     # what was buffered in the block belongs to stderr too
        os.dup2(saved, out_fd)
        os.close(saved)
