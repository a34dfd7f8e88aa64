"""`llmem validate`: the estimator against the trace (every CI run) or a real measurement (wherever a GPU is).

For each set-up of a matrix, the estimate and the truth give the three counters; the error is
(estimate - truth) / truth. `validate` builds the rows and the summary; llmem.cli prints them and plots them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from llmem.errors import LlmemError
from llmem.estimator.engine import estimate
from llmem.result import MemoryResult
from llmem.setup.training import TrainingSetup
from llmem.validate.matrices import MATRICES

COUNTERS = ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes")


@dataclass
class Row:
    setup: TrainingSetup
    estimate: MemoryResult
    truth: MemoryResult | None
    seconds: float
    error: str = ""
    skipped: str = ""      # why the truth engine cannot run this set-up here (not a failure)

    def error_pct(self, counter: str) -> float | None:
        """The error on `counter`; under --pp the largest of the answer's and each pipeline stage's."""
        if self.truth is None:
            return None
        pairs = [(getattr(self.estimate, counter), getattr(self.truth, counter))]
        if len(self.estimate.stages) == len(self.truth.stages):
            pairs += [(e[counter], t[counter]) for e, t in zip(self.estimate.stages, self.truth.stages, strict=True)
                      if counter in e and counter in t]
        errors = [100.0 * (est - truth) / truth for est, truth in pairs if truth]
        return max(errors, key=abs) if errors else None

    def to_dict(self) -> dict:
        out = {"setup": self.setup.to_dict(), "seconds": round(self.seconds, 2), "error": self.error,
               "skipped": self.skipped,
               "estimate": {c: getattr(self.estimate, c) for c in COUNTERS}}
        if self.truth is not None:
            out["truth"] = {c: getattr(self.truth, c) for c in COUNTERS}
            out["truth_engine"] = self.truth.engine
            out["error_pct"] = {c: self.error_pct(c) for c in COUNTERS}
            out["truth_components"] = self.truth.components
        out["estimate_components"] = self.estimate.components
        return out


def compared_counters(against: str) -> tuple[str, ...]:
    """The trace has no real CUDA context, so its device_used repeats our assumption: compare what it knows."""
    return COUNTERS[:2] if against == "trace" else COUNTERS


def run_matrix(setups: list[TrainingSetup], against: str, device: str | None = None,
               on_row: Callable[[Row], None] | None = None) -> list[Row]:
    rows = []
    for setup in setups:
        row = compare_one(setup, against, device)
        rows.append(row)
        if on_row:
            on_row(row)
    return rows


def compare_one(setup: TrainingSetup, against: str, device: str | None = None) -> Row:
    """The estimate of one set-up and its truth (skipped where this device cannot reproduce it)."""
    est = estimate(setup)
    if against == "measure" and (why := measure_skip_reason(setup, device)):
        return Row(setup, est, None, 0.0, skipped=why)
    start = time.perf_counter()
    truth, error = None, ""
    try:
        if against == "trace":
            from llmem.runtime.trace import trace  # the real step: torch's runtime, imported when it runs

            truth = trace(setup, job_phases=False)       # the rows compare the step
        else:
            from llmem.runtime.measure import measure

            truth = measure(setup, device=device)
    except LlmemError as exc:
        error = str(exc)
    return Row(setup, est, truth, time.perf_counter() - start, error)


def measure_skip_reason(setup: TrainingSetup, device: str | None) -> str:
    """Set-ups a measurement on this device cannot reproduce: activation offload on the CPU (no host to offload to)."""
    import torch

    on_cpu = torch.device(device).type == "cpu" if device is not None else not torch.cuda.is_available()
    if on_cpu and setup.offload_activations:
        return "--offload-activations needs a GPU (the host is the device)"
    if on_cpu and setup.ckpt_offload_spec.active:
        return "--ckpt-offload needs a GPU (the host is the device)"
    return ""


def worst_error(rows: list[Row], counters: tuple[str, ...]) -> float:
    errors = [abs(e) for r in rows for c in counters if (e := r.error_pct(c)) is not None]
    return max(errors, default=0.0)


def failed_rows(rows: list[Row], counters: tuple[str, ...], max_error_pct: float) -> list[Row]:
    """The rows that fail: an engine error, or an error beyond `max_error_pct` on a compared counter (skipped rows
    never fail)."""
    return [r for r in rows if not r.skipped and (r.error or any(abs(e) > max_error_pct for c in counters
                                                                 if (e := r.error_pct(c)) is not None))]


def shard_of(setups: list, shard: tuple[int, int] | None) -> list:
    """The `shard` = (i, n) part of a matrix: every n-th row from the i-th (1-based), for splitting a validation
    over machines or test workers; None: all of it."""
    if shard is None:
        return list(setups)
    i, n = shard
    if not 1 <= i <= n:
        raise LlmemError(f"--shard {i}/{n}: write I/N with 1 <= I <= N, e.g. --shard 1/4")
    return list(setups)[i - 1::n]


def validate(against: str, matrix: str, max_error_pct: float, device: str | None = None,
             on_row: Callable[[Row], None] | None = None,
             shard: tuple[int, int] | None = None) -> tuple[list[Row], dict]:
    """Run a matrix (or one `shard` of it) against the trace or a measurement: the rows and the summary `--json`
    prints (`passed`: no row fails and no error exceeds `max_error_pct` on the compared counters)."""
    if matrix not in MATRICES:
        raise LlmemError(f"unknown matrix {matrix!r}: choose one of {', '.join(MATRICES)}")
    counters = compared_counters(against)
    rows = run_matrix(shard_of(MATRICES[matrix], shard), against, device, on_row=on_row)
    failed = failed_rows(rows, counters, max_error_pct)
    summary = {"against": against, "matrix": matrix, "shard": None if shard is None else f"{shard[0]}/{shard[1]}",
               "max_error_pct": max_error_pct,
               "worst_error_pct": worst_error(rows, counters), "passed": not failed,
               "rows": [r.to_dict() for r in rows]}
    return rows, summary
