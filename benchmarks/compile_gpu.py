"""--compile on a real GPU: the training step with each decoder layer compiled by inductor (its real kernels:
llmem.runtime.compile on real tensors), run through llmem's own step (llmem.runtime.step.prepared_step, no op
tracker: torch.compile refuses TorchDispatchModes), its peaks read from CUDA's counters
(max_memory_allocated / max_memory_reserved after reset_peak_memory_stats), against `llmem estimate` of the same
set-up and of the same set-up without --compile (the measured saving against the estimated one). Models are built
from catalog configs with random weights (nothing is downloaded).

    python benchmarks/compile_gpu.py --out benchmarks/results/compile_h100.json   # run by gpu_validation.sh
"""

from __future__ import annotations

import argparse
import json

ROWS = (
    dict(model="meta-llama/Llama-3.2-1B", precision="bf16", batch_size=4, seq_len=2048, compile=True),
    dict(model="meta-llama/Llama-3.2-1B", precision="bf16-mixed", batch_size=4, seq_len=2048, compile=True,
         grad_ckpt=True),
    dict(model="Qwen/Qwen2.5-0.5B", precision="bf16-mixed", batch_size=4, seq_len=2048, compile=True,
         lora_rank=16, lora_targets="all-linear"),
)


def _measured(setup) -> tuple[int, int]:
    """CUDA's peaks over two compiled steps (the first compiles and warms up; both are counted)."""
    import torch

    from llmem.runtime.step import prepared_step

    with prepared_step(setup, fake=False, device="cuda", cuda_kernels=False) as step:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        step.run(2)
        torch.cuda.synchronize()
        peaks = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        del step
    torch.cuda.empty_cache()
    return peaks


def _row(fields: dict) -> dict:
    from llmem import estimate
    from llmem.setup.training import TrainingSetup

    setup = TrainingSetup(gpu="H100-80GB", **fields)
    est = estimate(setup)
    eager = estimate(TrainingSetup(gpu="H100-80GB", **{**fields, "compile": False}))
    alloc, reserved = _measured(setup)
    return {"setup": fields, "measured_allocated_bytes": alloc, "measured_reserved_bytes": reserved,
            "estimated_allocated_bytes": est.peak_allocated_bytes, "estimated_reserved_bytes": est.peak_reserved_bytes,
            "eager_estimated_allocated_bytes": eager.peak_allocated_bytes,
            "allocated_error_pct": round(100 * (est.peak_allocated_bytes - alloc) / alloc, 2),
            "reserved_error_pct": round(100 * (est.peak_reserved_bytes - reserved) / reserved, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rows = []
    for fields in ROWS:
        try:
            rows.append(_row(fields))
        except Exception as exc:  # noqa: BLE001 - one row's failure is recorded, the others still run
            rows.append({"setup": fields, "error": f"{type(exc).__name__}: {exc}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
