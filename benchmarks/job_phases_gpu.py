"""The loading and saving phases of one GPU (method single), measured against llmem's analytic job phases
(llmem.estimator.job_phases): from_pretrained then model.to("cuda") (--load-path cpu), from_pretrained(device_map=
"cuda") (--load-path device-map), save_pretrained of the full model (--save-kind full) and of LoRA adapters
(--save-kind adapters). The model is built from a catalog config with random weights and saved to a temporary
folder first (nothing is downloaded). Device: torch.cuda.max_memory_allocated over the phase; host: the growth of
the process's peak RSS (ru_maxrss) over it, a coarse bound (the allocator's arenas and the libraries come with it).
Multi-rank paths (FSDP2, ZeRO-3) need real process groups: not measured here.

    python benchmarks/job_phases_gpu.py --out benchmarks/results/job_phases_h100.json   # run by gpu_validation.sh
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
from pathlib import Path

MODELS = ("Qwen/Qwen2.5-0.5B", "facebook/opt-1.3b")
CONFIGS = Path(__file__).resolve().parents[1] / "llmem" / "model" / "catalog" / "configs"


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _measure(work) -> tuple[int, int]:
    """(max_memory_allocated over `work`, growth of the peak RSS over it)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    rss = _rss_bytes()
    work()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), _rss_bytes() - rss


def _row(model: str, folder: Path) -> list[dict]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmem import estimate
    from llmem.setup.training import TrainingSetup

    config = AutoConfig.from_pretrained(CONFIGS / (model.replace("/", "--") + ".json"))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder / "model")
    rows = []

    def compare(phase: str, kind: str, measured: tuple[int, int], **kw) -> None:
        est = {p.name: p for p in estimate(TrainingSetup(model=model, seq_len=64, precision="fp32", **kw)).job_phases}[phase]
        rows.append({"model": model, "phase": phase, "kind": kind, "measured_device_bytes": measured[0],
                     "estimated_device_bytes": est.device_bytes, "measured_host_growth_bytes": measured[1],
                     "estimated_host_bytes": est.host_bytes})

    held = {}
    compare("load", "cpu", _measure(lambda: held.update(m=AutoModelForCausalLM.from_pretrained(
        folder / "model", dtype=torch.float32).to("cuda"))), load_path="cpu")
    compare("save", "full", _measure(lambda: held["m"].save_pretrained(folder / "saved")), save_kind="full",
            optimizer="sgd")
    held.clear()
    torch.cuda.empty_cache()
    compare("load", "device-map", _measure(lambda: held.update(m=AutoModelForCausalLM.from_pretrained(
        folder / "model", dtype=torch.float32, device_map="cuda"))), load_path="device-map")
    peft_model = get_peft_model(held.pop("m"), LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    compare("save", "adapters", _measure(lambda: peft_model.save_pretrained(folder / "adapters")),
            save_kind="adapters", lora_rank=16, optimizer="sgd")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = []
    for model in MODELS:
        with tempfile.TemporaryDirectory() as tmp:
            rows += _row(model, Path(tmp))
    for r in rows:
        print(f"{r['model']:24} {r['phase']:5} {r['kind']:11} device {r['measured_device_bytes'] / 2**20:9.1f} MiB "
              f"(est {r['estimated_device_bytes'] / 2**20:9.1f})  host +{r['measured_host_growth_bytes'] / 2**20:9.1f}"
              f" MiB (est {r['estimated_host_bytes'] / 2**20:9.1f})")
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
