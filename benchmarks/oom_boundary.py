"""The OOM boundary on a real GPU against llmem's capacity-aware fit (issue 10, llmem.memory.capacity).

For each case the caching allocator is limited to ALLOWED bytes (`torch.cuda.set_per_process_memory_fraction`: its
alloc_block fails past the fraction, then malloc releases the cache and retries, as on a full device) and the
real step is run at batch 1, 2, 3, ... until it runs out of memory. llmem answers the same question with
`--gpu-memory` = ALLOWED + the CUDA context (so the allocator's capacity is ALLOWED). Also records the driver's
total (`torch.cuda.mem_get_info()[1]`), the figure the GPU catalog wants.

    python benchmarks/oom_boundary.py --out benchmarks/results/oom_boundary_<gpu>.json     # on a CUDA machine
    python benchmarks/oom_boundary.py --dry-run                                            # llmem's side only

Output: per case, llmem's largest batch, the real one, and per batch the real max_memory_reserved against the
estimate's reserved peak on the device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from llmem import estimate  # noqa: E402
from llmem.errors import LlmemError  # noqa: E402
from llmem.setup.gpus import resolve_gpu  # noqa: E402
from llmem.setup.training import user_setup  # noqa: E402
from llmem.units import GIB  # noqa: E402

# (name, set-up fields, bytes the allocator may use): boundaries a few batches in, a few seconds a step on an H200
CASES = [
    ("llama-3.2-1b full bf16-mixed", dict(model="meta-llama/Llama-3.2-1B", seq_len=2048), 40 * GIB),
    ("llama-3.2-1b full bf16-mixed ckpt", dict(model="meta-llama/Llama-3.2-1B", seq_len=4096, grad_ckpt=True),
     40 * GIB),
    ("qwen2.5-0.5b pure bf16", dict(model="Qwen/Qwen2.5-0.5B", seq_len=2048, precision="bf16"), 32 * GIB),
]
MAX_BATCH = 16


def predicted(fields: dict, allowed: int) -> tuple[int, dict[int, dict]]:
    context = resolve_gpu(fields.get("gpu", "H200")).cuda_context_bytes
    rows, largest = {}, 0
    for b in range(1, MAX_BATCH + 1):
        r = estimate(user_setup(**fields, gpu="H200", batch_size=b, gpu_memory=allowed + context))
        rows[b] = {"fits": r.fits, "peak_allocated": r.peak_allocated_bytes, "peak_reserved": r.peak_reserved_bytes,
                   "reserved_on_device": r.reserved_on_device_bytes, "oom": r.oom.to_dict() if r.oom else None}
        if not r.fits:
            break
        largest = b
    return largest, rows


def real(fields: dict, allowed: int) -> tuple[int, dict[int, dict]]:
    import torch

    from llmem.runtime.measure import measure

    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(allowed / total)
    rows, largest = {}, 0
    try:
        for b in range(1, MAX_BATCH + 1):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            try:
                m = measure(user_setup(**fields, gpu="H200", batch_size=b), device="cuda")
            except LlmemError as exc:
                rows[b] = {"oom": str(exc)[:300], "s": round(time.perf_counter() - t0, 1)}
                break
            rows[b] = {"peak_allocated": m.peak_allocated_bytes, "peak_reserved": m.peak_reserved_bytes,
                       "s": round(time.perf_counter() - t0, 1)}
            largest = b
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    return largest, rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true", help="llmem's answers only (no GPU)")
    args = ap.parse_args()
    out = {"cases": []}
    if not args.dry_run:
        import torch

        free, total = torch.cuda.mem_get_info()
        out["device"] = {"name": torch.cuda.get_device_name(0), "driver_total_bytes": total,
                         "total_memory": torch.cuda.get_device_properties(0).total_memory, "free_bytes": free}
    for name, fields, allowed in CASES:
        want, est_rows = predicted(fields, allowed)
        case = {"case": name, "allowed_bytes": allowed, "llmem_largest_batch": want, "llmem": est_rows}
        if not args.dry_run:
            got, real_rows = real(fields, allowed)
            case.update(real_largest_batch=got, real=real_rows)
        print(json.dumps({k: v for k, v in case.items() if k not in ("llmem", "real")}), flush=True)
        out["cases"].append(case)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
