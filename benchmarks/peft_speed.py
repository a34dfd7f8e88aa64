"""Estimate speed of the adapter set-ups on Llama-3.1-8B (seq 4096, checkpointing): the table in benchmarks/peft.md.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/peft_speed.py
"""

from __future__ import annotations

import statistics
import time

from llmem.estimator.engine import estimate
from llmem.setup.training import TrainingSetup
from llmem.validate.matrices import bundled_peft_config

BASE = {"model": "meta-llama/Llama-3.1-8B", "seq_len": 4096, "grad_ckpt": True, "gpu": "H100-80GB"}
CASES = {
    "full fine-tuning": {},
    "LoRA r16 all-linear": {"lora_rank": 16, "lora_targets": "all-linear"},
    "QLoRA r16 all-linear": {"lora_rank": 16, "lora_targets": "all-linear", "quant_base": "nf4"},
    "DoRA r8 all-linear": {"peft_config": bundled_peft_config("dora-r8-all-linear")},
    "IA3 k,v,down": {"peft_config": bundled_peft_config("ia3-k-v-down")},
    "prompt tuning 20": {"peft_config": bundled_peft_config("prompt-tuning-20")},
}


def ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    print("| set-up | first call (ms) | full estimate (ms, median of 5) | draft (ms) |\n|---|---:|---:|---:|")
    for name, changes in CASES.items():
        s = TrainingSetup(**BASE, **changes)
        first = ms(lambda s=s: estimate(s))
        full = [ms(lambda s=s: estimate(s)) for _ in range(5)]
        draft = [ms(lambda s=s: estimate(s, draft=True)) for _ in range(5)]
        print(f"| {name} | {first:.0f} | {statistics.median(full):.0f} | {statistics.median(draft):.0f} |")


if __name__ == "__main__":
    main()
