"""Plan a few models once each (8x A100-80GB, 2048 tokens) with either layout of llmem: the paired speed check of
the re-housing (benchmarks/plan_speed.md).

    cd /tmp && farm-bench -n 5 --timeout 900 \\
        --vs "env HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/llmem-before /work/main/.venv/bin/python \\
              /work/main/benchmarks/rehouse/plan_once.py" \\
        -- env HF_HUB_OFFLINE=1 /work/main/.venv/bin/python /work/main/benchmarks/rehouse/plan_once.py
"""

from __future__ import annotations

import sys
import time

MODELS = ("gpt2", "meta-llama/Llama-3.1-8B", "facebook/opt-2.7b", "meta-llama/Llama-2-70b-hf",
          "mistralai/Mixtral-8x7B-v0.1")


def main() -> int:
    try:                                        # after the re-housing
        from llmem.model.anatomy import load_anatomy
        from llmem.planner.plan import plan
        from llmem.setup.training import TrainingSetup
    except ImportError:                         # before
        from llmem.anatomy import load_anatomy
        from llmem.config import TrainingSetup

        from llmem.planner import plan
    for model in sys.argv[1:] or MODELS:
        setup = TrainingSetup(model=model, gpus=8, gpu="A100-80GB", seq_len=2048)
        t0 = time.perf_counter()
        plan(setup, anatomy=load_anatomy(model))
        print(f"{model:30s} {time.perf_counter() - t0:.3f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
