"""Scale-out accuracy report: estimate vs trace for the large matrix's 70B-405B rows (issue 11's pieces: TP with
sequence and loss parallel, FSDP2 CPU offload, HSDP, pipeline schedules, context parallel, selective AC, MoE).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/accuracy_scaleout.py [INDEX ...]
        # -> benchmarks/results/scaleout_trace.json (rows merged by configuration; no INDEX: every row)
    .venv/bin/python benchmarks/accuracy_table.py benchmarks/results/scaleout_trace.json
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/accuracy_scaleout.py --estimates [--write]
        # today's estimator against the committed traces (seconds; no trace run); --write: into the JSON

Rows are traced one at a time (INDEX = position in SCALEOUT_MATRIX); a pipeline row traces the stages in
TRACED_STAGES (the estimate's largest stage; each costs a whole-model trace) against the estimate of the same
stage, and keeps every stage's estimated peaks. benchmarks/accuracy_scaleout.md is written from that JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from llmem.estimator.engine import estimate
from llmem.runtime.trace import trace, trace_with_details
from llmem.setup.training import TrainingSetup
from llmem.validate.compare import COUNTERS
from llmem.validate.matrices import SCALEOUT_MATRIX, label

OUT = Path(__file__).parent / "results" / "scaleout_trace.json"


# pipeline rows: the stages traced (each costs a whole-model trace: layers / pp x micro-batches); the rest of the
# stages are the estimator's only. 1F1B: the first stage (pp micro-batches in flight); GPipe: the last (all of them in
# flight, and the lm_head and loss); interleaved 1F1B: the first (its warm-up holds the most micro-batch chunks): the
# largest of each by the estimate.
TRACED_STAGES = {"1f1b": (0,), "gpipe": (-1,), "interleaved-1f1b": (0,)}


def traced(setup) -> tuple:
    """The trace's result (under --pp: the largest traced stage) and the traced stages' peaks."""
    if setup.pp == 1:
        truth = trace(setup)
        return truth, truth.stages
    stages = {}
    for k in TRACED_STAGES[setup.pp_schedule]:
        stages[k % setup.pp] = trace_with_details(setup, pp_rank=k % setup.pp)[0]
    rows = [{"stage": k, "peak_allocated_bytes": r.peak_allocated_bytes, "peak_reserved_bytes": r.peak_reserved_bytes}
            for k, r in sorted(stages.items())]
    top = max(stages, key=lambda k: (stages[k].peak_reserved_bytes, stages[k].peak_allocated_bytes))
    return stages[top], rows


def compare_row(setup) -> dict:
    """One row: both engines' counters, their error, the peak phase and (under --pp) the stages' peaks."""
    t0 = time.perf_counter()
    est = estimate(setup)
    est_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    truth, trace_stages = traced(setup)
    trace_s = time.perf_counter() - t0
    if setup.pp > 1:     # the estimate of the stage the trace's answer is (the same rank)
        k = max(range(len(trace_stages)), key=lambda j: trace_stages[j]["peak_reserved_bytes"])
        ours = est.stages[trace_stages[k]["stage"]]
        est_top = {c: ours.get(c, getattr(est, c)) for c in COUNTERS}
    else:
        est_top = {c: getattr(est, c) for c in COUNTERS}
    return {"config": label(setup), "setup": setup.to_dict(), "estimate_s": round(est_s, 2),
            "trace_s": round(trace_s, 1),
            "estimate": est_top, "trace": {c: getattr(truth, c) for c in COUNTERS},
            "error_pct": {c: 100 * (est_top[c] - getattr(truth, c)) / getattr(truth, c) for c in COUNTERS},
            "estimate_phase": est.peak_phase, "trace_phase": truth.peak_phase,
            "estimate_stages": est.stages, "trace_stages": trace_stages,
            "estimate_components": est.components, "trace_components": truth.components}


def estimate_of(setup, stage: int | None) -> tuple[dict, object]:
    """The estimate's counters (under --pp: of `stage`) and the estimate."""
    est = estimate(setup)
    if stage is None:
        return {c: getattr(est, c) for c in COUNTERS}, est
    return {c: est.stages[stage].get(c, getattr(est, c)) for c in COUNTERS}, est


def reestimate(rows: dict, write: bool) -> None:
    """--estimates: today's estimator against the committed traces (no trace run), one line a row; --write puts
    the new estimates (counters, errors, peak phase, seconds) in the JSON, for accuracy_table.py."""
    for r in list(rows.values())[:1]:    # imports and caches outside the timed calls
        estimate(TrainingSetup(**r["setup"]))
    for r in rows.values():
        setup = TrainingSetup(**r["setup"])
        stage = None
        if setup.pp > 1:
            stage = max(r["trace_stages"], key=lambda x: x["peak_reserved_bytes"])["stage"]
        t0 = time.perf_counter()
        top, est = estimate_of(setup, stage)
        est_s = time.perf_counter() - t0
        err = {c: 100 * (top[c] - r["trace"][c]) / r["trace"][c] for c in COUNTERS}
        print(f"{r['config']:110s} alloc {err['peak_allocated_bytes']:+6.2f}% resv {err['peak_reserved_bytes']:+6.2f}%"
              f"  estimate {est_s:5.2f}s", flush=True)
        if write:
            r.update(estimate=top, error_pct=err, estimate_s=round(est_s, 2), estimate_phase=est.peak_phase,
                     estimate_stages=est.stages, estimate_components=est.components)
    if write:
        save(rows)


def save(rows: dict) -> None:
    """The rows to the JSON, in SCALEOUT_MATRIX's order."""
    order = [label(s) for s in SCALEOUT_MATRIX]
    OUT.write_text(json.dumps(sorted(rows.values(), key=lambda r: order.index(r["config"])
                                     if r["config"] in order else len(order)), indent=1))


def main(argv: list[str]) -> int:
    rows = {r["config"]: r for r in json.loads(OUT.read_text())} if OUT.exists() else {}
    if argv[:1] == ["--estimates"]:
        reestimate(rows, write=argv[1:] == ["--write"])
        return 0
    picks = [int(a) for a in argv] or list(range(len(SCALEOUT_MATRIX)))
    for i in picks:
        row = compare_row(SCALEOUT_MATRIX[i])
        rows[row["config"]] = row
        print(f"[{i}] {row['config']:100s} alloc {row['error_pct']['peak_allocated_bytes']:+6.2f}% "
              f"resv {row['error_pct']['peak_reserved_bytes']:+6.2f}%  trace {row['trace_s']:6.1f}s", flush=True)
        save(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
