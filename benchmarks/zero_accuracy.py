# (not named deepspeed.py: run as a script, its folder comes first on sys.path and would shadow the package)
"""DeepSpeed ZeRO report: llmem's ds-zero estimate against DeepSpeed's own engine traced (llmem.runtime.deepspeed),
and DeepSpeed's own model-state estimator beside them, on the CI matrix's ds-zero rows, the set-ups where the two
still differ, and 7B-8B models on 8 GPUs.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/zero_accuracy.py      # writes benchmarks/deepspeed.md
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from llmem.estimator.engine import estimate
from llmem.model.resolved import resolve
from llmem.runtime.trace import trace_with_details
from llmem.setup.training import TrainingSetup
from llmem.units import GIB
from llmem.validate.matrices import CI_MATRIX, _s, label

OUT = Path(__file__).parent / "deepspeed.md"
GAPS = [   # known differences (the report says so): stage 3's coordinator with reuse distance 0, LoRA under stage 3,
    # and a stage-3 row whose reserved differs by one 20 MiB segment
    _s("tiny-llama", "ds-zero3", 4, precision="bf16-mixed", batch_size=2, seq_len=256, reduce_bucket_size="auto",
       prefetch_bucket_size="auto", param_persistence_threshold="auto", max_reuse_distance=0),
    _s("tiny-llama", "ds-zero3", 4, precision="bf16-mixed", batch_size=2, seq_len=256, reduce_bucket_size="auto",
       prefetch_bucket_size=0, param_persistence_threshold="auto", max_reuse_distance=0),
    _s("tiny-qwen2", "ds-zero3", 2, precision="bf16-mixed", batch_size=2, seq_len=256, lora_rank=8,
       lora_targets="all-linear", reduce_bucket_size=2_000_000),
    _s("tiny-llama", "ds-zero3", 4, precision="bf16-mixed", batch_size=2, seq_len=256, reduce_bucket_size="auto",
       prefetch_bucket_size="auto", param_persistence_threshold="auto"),
]
AUTO3 = {"prefetch_bucket_size": "auto", "param_persistence_threshold": "auto"}     # stage 3's other HF auto keys
LARGE = [
    _s("meta-llama/Llama-2-7b-hf", f"ds-zero{stage}", 8, precision="bf16-mixed", batch_size=1, seq_len=1024,
       grad_ckpt=True, reduce_bucket_size="auto", **(AUTO3 if stage == 3 else {}))
    for stage in (1, 2, 3)
] + [_s("meta-llama/Llama-2-7b-hf", "ds-zero3", 8, precision="bf16-mixed", batch_size=1, seq_len=1024, grad_ckpt=True)]


def deepspeed_own(setup: TrainingSetup) -> float | None:
    """DeepSpeed's estimate_zero{2,3}_model_states_mem_needs for the set-up (GiB per GPU; model states only; no
    ZeRO-1 estimator exists), None where it has none."""
    r = resolve(setup)
    n, gpus = r.anatomy.total_params, setup.gpus
    if setup.method == "ds-zero2":
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        return estimate_zero2_model_states_mem_needs(n, num_gpus_per_node=gpus, cpu_offload=False)[1] / GIB
    if setup.method == "ds-zero3":
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        largest = max(r.anatomy.layer_params(i) for i in range(r.anatomy.num_layers))
        return estimate_zero3_model_states_mem_needs(n, largest, num_gpus_per_node=gpus, cpu_offload=False,
                                                     cpu_offload_params=False)[1] / GIB
    return None


def row(setup: TrainingSetup) -> str:
    est = estimate(setup)
    t0 = time.perf_counter()
    truth, _ = trace_with_details(setup)
    wall = time.perf_counter() - t0
    cells = []
    for counter in ("peak_allocated_bytes", "peak_reserved_bytes"):
        e, t = getattr(est, counter), getattr(truth, counter)
        cells += [f"{e / GIB:.3f}", f"{t / GIB:.3f}", f"{100 * (e - t) / t:+.2f} %"]
    own = deepspeed_own(setup)
    line = f"| {label(setup)} | " + " | ".join(cells) + f" | {'-' if own is None else f'{own:.3f}'} | {wall:.0f} s |"
    print(line, flush=True)
    return line


def main() -> int:
    head = ("| set-up | allocated est GiB | traced GiB | error | reserved est GiB | traced GiB | error | "
            "DeepSpeed's estimator GiB | trace |\n|---|---|---|---|---|---|---|---|---|")
    sections = [("CI matrix rows (tests/validate/test_validate.py: every one within 2 %)",
                 [s for s in CI_MATRIX if s.method.startswith("ds-")]),
                ("Where they still differ (not CI rows; see Known Limitations in llmem/estimator/deepspeed.py)", GAPS),
                ("7B on 8 GPUs (HF's auto buckets, and DeepSpeed's defaults)", LARGE)]
    text = [__doc__.split("\n\n")[0], "", "Command: `" + __doc__.split("\n\n")[1].strip() + "`", "",
            "The traced truth is DeepSpeed 0.19.8's engine (deepspeed.initialize, ZeRO stage N) running the step on "
            "fake tensors, rank 0 of the GPUs on a fake process group (llmem.runtime.deepspeed). DeepSpeed's "
            "estimator counts model states only (no activations, buckets, gathered parameters or step "
            "temporaries).", ""]
    for title, setups in sections:
        text += [f"## {title}", "", head] + [row(s) for s in setups] + [""]
    OUT.write_text("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
