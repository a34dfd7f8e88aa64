"""The replay loop compiled (llmem/memory/native_replay.c) against the Python reference (llmem.memory.phase_replay), on
whole-step schedules of the plans' set-ups: CPU milliseconds per replay (the best of --runs), events per second, and
whether the two Replays are equal (they must be: the compiled loop is a twin of CachingAllocator).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/native_replay.py [--runs 7] [--json benchmarks/results/native_replay.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from llmem.estimator.engine import rank_step, step_schedule
from llmem.estimator.events import replay
from llmem.memory.phase_replay import native_available
from llmem.model.resolved import resolve
from llmem.setup.training import user_setup

SET_UPS = {
    "Llama-3.1-70B fsdp x8, 4096": dict(model="meta-llama/Llama-3.1-70B", gpus=8, method="fsdp", seq_len=4096),
    "Llama-3.1-70B fsdp x8, FSDP-QLoRA": dict(model="meta-llama/Llama-3.1-70B", gpus=8, method="fsdp", seq_len=4096,
                                              lora_rank=16, quant_base="nf4", kbit_upcast=False),
    "Llama-3.1-70B fsdp x8, --grad-ckpt b4": dict(model="meta-llama/Llama-3.1-70B", gpus=8, method="fsdp",
                                                  seq_len=4096, grad_ckpt=True, batch_size=4),
    "Llama-3.1-8B fsdp x4, 4096": dict(model="meta-llama/Llama-3.1-8B", gpus=4, method="fsdp", seq_len=4096),
    "Qwen2.5-7B ddp x2, expandable segments": dict(model="Qwen/Qwen2.5-7B", gpus=2, method="ddp", seq_len=2048,
                                                   expandable_segments=True),
}


def _best_ms(work, runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.process_time()
        work()
        best = min(best, time.process_time() - start)
    return best * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if not native_available():
        raise SystemExit("the compiled loop is not built: pip install -e . (with a C compiler)")
    rows = []
    print("| set-up | events | Python ms | compiled ms | ratio | Python Mevents/s | compiled Mevents/s | equal |")
    print("|---|---|---|---|---|---|---|---|")
    for label, flags in SET_UPS.items():
        s = user_setup(precision="bf16-mixed", **flags)
        r, act = rank_step(resolve(s))
        sched = step_schedule(r, act).build()
        os.environ["LLMEM_NATIVE_REPLAY"] = "off"
        ref = replay(sched, s.expandable_segments)
        py_ms = _best_ms(lambda: replay(sched, s.expandable_segments), args.runs)  # noqa: B023
        del os.environ["LLMEM_NATIVE_REPLAY"]
        got = replay(sched, s.expandable_segments)
        c_ms = _best_ms(lambda: replay(sched, s.expandable_segments), args.runs)  # noqa: B023
        n = len(sched.events)
        row = dict(set_up=label, events=n, python_ms=round(py_ms, 1), compiled_ms=round(c_ms, 2),
                   ratio=round(py_ms / c_ms, 1), equal=got == ref)
        rows.append(row)
        print(f"| {label} | {n:,} | {py_ms:.1f} | {c_ms:.2f} | {py_ms / c_ms:.1f}x | {n / py_ms / 1000:.2f} | "
              f"{n / c_ms / 1000:.2f} | {'yes' if got == ref else 'NO'} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
