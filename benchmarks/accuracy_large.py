"""Large-matrix accuracy report: estimate vs trace for 7B-70B models under every method on 8 GPUs (the matrix's
scale-out rows, SCALEOUT_MATRIX, are benchmarks/accuracy_scaleout.py's).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/accuracy_large.py     # writes benchmarks/results/large_trace.json

benchmarks/accuracy.md is written from that JSON (the numbers there come from this script's output).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from llmem.estimator.engine import estimate
from llmem.runtime.trace import trace_with_details
from llmem.validate.compare import COUNTERS
from llmem.validate.matrices import LARGE_MATRIX, SCALEOUT_MATRIX, label

OUT = Path(__file__).parent / "results" / "large_trace.json"


def main() -> int:
    rows = []
    for setup in (s for s in LARGE_MATRIX if s not in SCALEOUT_MATRIX):   # those: accuracy_scaleout.py
        t0 = time.perf_counter()
        est = estimate(setup)
        est_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        truth, details = trace_with_details(setup)
        trace_s = time.perf_counter() - t0
        row = {"config": label(setup), "setup": setup.to_dict(), "estimate_s": round(est_s, 3),
               "trace_s": round(trace_s, 1),
               "estimate": {c: getattr(est, c) for c in COUNTERS}, "trace": {c: getattr(truth, c) for c in COUNTERS},
               "error_pct": {c: 100 * (getattr(est, c) - getattr(truth, c)) / getattr(truth, c) for c in COUNTERS},
               "estimate_phase": est.peak_phase, "trace_phase": truth.peak_phase,
               "trace_step_components": details.phase_peaks.get("optimizer_step", {}).get("components", {})}
        rows.append(row)
        print(f"{row['config']:75s} alloc {row['error_pct']['peak_allocated_bytes']:+6.2f}% "
              f"resv {row['error_pct']['peak_reserved_bytes']:+6.2f}%  trace {trace_s:5.1f}s", flush=True)
        OUT.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
