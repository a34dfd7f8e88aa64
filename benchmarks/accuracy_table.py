"""Render benchmarks/results/*.json (from accuracy_large.py or `llmem validate --out`) as markdown tables.

    .venv/bin/python benchmarks/accuracy_table.py benchmarks/results/large_trace.json
"""

from __future__ import annotations

import json
import sys

GIB = 1024**3
# set-up fields worth naming in a row when they differ from TrainingSetup's defaults
_DEFAULTS = {"optimizer": "adamw", "grad_ckpt": False, "ckpt_every": 1, "attn": "sdpa", "lora_rank": 0,
             "lora_dropout": 0.0, "peft_config": None, "quant_base": "none", "double_quant": True,
             "optimizer_in_backward": False, "fused_ce": False, "offload_activations": False, "packing": False,
             "offload_optimizer": False}


def describe(setup: dict) -> str:
    """'tiny-llama fsdp(4) bf16-mixed 2x256 lora_rank=16 ...': the row's set-up in one line."""
    method = setup.get("method", "single")
    where = method if method == "single" else f"{method}({setup.get('gpus')}{', tp ' + str(setup['tp']) if setup.get('tp') else ''})"
    extra = []
    for k, default in _DEFAULTS.items():
        v = setup.get(k, default)
        if v != default:
            if k == "lora_rank":
                extra.append(f"lora r{v} {setup.get('lora_targets')}")
            elif k == "peft_config":
                extra.append(f"peft {str(v).rstrip('/').split('/')[-1]}")
            else:
                extra.append(k if v is True else f"{k}={v}")
    return " ".join([setup["model"], where, setup.get("precision", ""),
                     f"{setup.get('batch_size')}x{setup.get('seq_len')}", *extra])


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
        print(f"| {r.get('config') or describe(r['setup'])} | {est['peak_allocated_bytes'] / GIB:.2f} | "
              f"{truth['peak_allocated_bytes'] / GIB:.2f} | {a:+.2f} | {est['peak_reserved_bytes'] / GIB:.2f} | "
              f"{truth['peak_reserved_bytes'] / GIB:.2f} | {res:+.2f} | {r.get('trace_s', r.get('seconds', ''))} | "
              f"{r.get('estimate_phase', '')} / {r.get('trace_phase', '')} |")
    n = len(rows)
    print(f"\n{n} configurations. Peak allocated: mean |error| {sum(errs_a) / n:.2f} %, max {max(errs_a):.2f} %. "
          f"Peak reserved: mean |error| {sum(errs_r) / n:.2f} %, max {max(errs_r):.2f} %.")


if __name__ == "__main__":
    main(sys.argv[1])
