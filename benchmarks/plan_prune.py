"""In-process seconds of the plans the speed target names (anatomy loaded first, not timed), with the estimator
calls each makes and a digest of its JSON, for pairing two checkouts (benchmarks/plan_prune.md):

    cd /tmp && for i in 1 2 3; do for v in /tmp/plan-base /work/wt-plan; do
        HF_HUB_OFFLINE=1 PYTHONPATH=$v /work/main/.venv/bin/python /work/wt-plan/benchmarks/plan_prune.py; done; done

Per plan: `cpu_s` is this process's CPU seconds for the plan (the planner is one thread: on a shared machine the
wall time a quiet one would give), `wall_s` the wall seconds, the best of --repeat runs (each plan builds its own
engine; the anatomy and the estimator's per-model caches are warm after the first); `estimates` counts full and
draft estimates, `verdicts` the fit verdicts; `json` is the first 12 hex digits of the SHA-1 of the plan's JSON
(equal digits: the same plan).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

PLANS = {
    "8B x4 A100": dict(model="meta-llama/Llama-3.1-8B", gpu="A100-80GB", gpus=4, seq_len=4096),
    "70B x8 H100": dict(model="meta-llama/Llama-3.1-70B", gpu="H100-80GB", gpus=8, seq_len=4096),
    "72B x16 H100": dict(model="Qwen/Qwen2.5-72B", gpu="H100-80GB", gpus=16, gpus_per_node=8, seq_len=4096),
    "405B x512 H100": dict(model="meta-llama/Llama-3.1-405B", gpu="H100-80GB", gpus=512, seq_len=4096),
    "7B grpo x8 H100": dict(model="Qwen/Qwen2.5-7B", objective="grpo", gpu="H100-80GB", gpus=8),
    "70B x512 ckpt": dict(model="meta-llama/Llama-3.1-70B", gpu="H100-80GB", gpus=512, seq_len=4096,
                          grad_ckpt=True),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--plans", default=",".join(PLANS), help="comma-separated names of PLANS")
    args = ap.parse_args(argv)

    import llmem.estimator.engine as estimator
    import llmem.planner.engines as engines
    from llmem.model.anatomy import load_anatomy
    from llmem.planner.plan import plan
    from llmem.setup.training import TrainingSetup

    calls = {"estimates": 0, "verdicts": 0}

    def counted(fn, key):
        def run(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return run

    engines.estimate_resolved = counted(estimator.estimate_resolved, "estimates")
    engines.step_verdict = counted(estimator.step_verdict, "verdicts")
    for name in args.plans.split(","):
        kw = PLANS[name]
        anatomy = load_anatomy(kw["model"])
        cpu, wall = [], []
        for _ in range(args.repeat):
            calls.update(estimates=0, verdicts=0)
            t, c = time.perf_counter(), time.process_time()
            p = plan(TrainingSetup(**kw), anatomy=anatomy)
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        digest = hashlib.sha1(json.dumps(p.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:12]
        print(f"{name:16s} cpu {min(cpu):6.2f} s  wall {min(wall):6.2f} s  estimates {calls['estimates']:4d}  "
              f"verdicts {calls['verdicts']:3d}  -> {p.recommendation or 'nothing fits':24s} json {digest}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
