"""Render benchmarks/results/*.json (from accuracy_large.py or `llmem validate --out`) as markdown tables.

    .venv/bin/python benchmarks/accuracy_table.py benchmarks/results/large_trace.json
"""

from __future__ import annotations

import json
import sys

GIB = 1024**3


def main(path: str) -> None:
    data = json.load(open(path))
    rows = data["rows"] if isinstance(data, dict) else data
    print("| configuration | alloc est (GiB) | alloc trace (GiB) | err % | reserved est | reserved trace | err % "
          "| trace s | peak (est / trace) |")
    print("|---|---|---|---|---|---|---|---|---|")
    errs_a, errs_r = [], []
    for r in rows:
        est, truth, err = r["estimate"], r.get("trace") or r.get("truth"), r["error_pct"]
        a, res = err["peak_allocated_bytes"], err["peak_reserved_bytes"]
        errs_a.append(abs(a))
        errs_r.append(abs(res))
        print(f"| {r.get('config') or r['setup']['model']} | {est['peak_allocated_bytes'] / GIB:.2f} | "
              f"{truth['peak_allocated_bytes'] / GIB:.2f} | {a:+.2f} | {est['peak_reserved_bytes'] / GIB:.2f} | "
              f"{truth['peak_reserved_bytes'] / GIB:.2f} | {res:+.2f} | {r.get('trace_s', r.get('seconds', ''))} | "
              f"{r.get('estimate_phase', '')} / {r.get('trace_phase', '')} |")
    n = len(rows)
    print(f"\n{n} configurations. Peak allocated: mean |error| {sum(errs_a) / n:.2f} %, max {max(errs_a):.2f} %. "
          f"Peak reserved: mean |error| {sum(errs_r) / n:.2f} %, max {max(errs_r):.2f} %.")


if __name__ == "__main__":
    main(sys.argv[1])
