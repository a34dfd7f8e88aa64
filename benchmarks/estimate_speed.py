"""Time one `llmem.estimate` per catalog model (after import and after the model's anatomy is built once).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/estimate_speed.py [--methods single,fsdp,fsdp+tp] [--repeat 5]

Prints a markdown table (median of --repeat calls per model and method) and the slowest case.
"""

from __future__ import annotations

import argparse
import statistics
import time

from llmem.errors import LlmemError
from llmem.estimator.engine import estimate
from llmem.model.anatomy import load_anatomy
from llmem.model.catalog import catalog
from llmem.setup.training import TrainingSetup


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="single,fsdp,fsdp+tp")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=4096)
    args = ap.parse_args()
    methods = args.methods.split(",")
    print(f"| model | layers | {' | '.join(f'{m} (ms)' for m in methods)} |")
    print(f"|---|---|{'---|' * len(methods)}")
    worst = (0.0, "")
    for model in catalog():
        anatomy = load_anatomy(model)
        cells = []
        for method in methods:
            gpus = 1 if method == "single" else 8
            tp = next((t for t in (2, 4) if anatomy.num_heads % t == 0 and anatomy.num_kv_heads % t == 0), None)
            setup = TrainingSetup(model, method=method, gpus=gpus, tp=tp if method == "fsdp+tp" else None,
                                  seq_len=args.seq_len, grad_ckpt=True, gpu="H100-80GB")
            try:
                estimate(setup, anatomy)          # warm: imports, caches
            except LlmemError:
                cells.append("n/a")
                continue
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                estimate(setup, anatomy)
                times.append(time.perf_counter() - t0)
            ms = 1000 * statistics.median(times)
            worst = max(worst, (ms, f"{model} {method}"))
            cells.append(f"{ms:.1f}")
        print(f"| {model} | {anatomy.num_layers} | {' | '.join(cells)} |", flush=True)
    print(f"\nslowest: {worst[1]} {worst[0]:.1f} ms")


if __name__ == "__main__":
    main()
