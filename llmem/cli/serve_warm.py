"""Imported once by the fork server that `llmem serve`'s workers fork from (multiprocessing's forkserver preload,
serve_pool.py): torch, transformers and what a first estimate imports and caches (seconds), so that every worker,
the first ones and those replacing a worker killed at its time limit, starts warm."""

from __future__ import annotations

import logging

import llmem
import llmem.cli.serve_pool  # noqa: F401  (the workers' code)
import llmem.cli.tables  # noqa: F401  (the answers' JSON)
import llmem.planner  # noqa: F401  (a plan's search)

try:
    llmem.estimate("tiny-llama", seq_len=128)
except Exception:                          # only a head start: a request reports what fails
    logging.getLogger("llmem.serve").debug("warm-up failed", exc_info=True)
