"""One row of a validation matrix: a set-up on H100s (the matrices' default GPU), and peft's bundled adapter configs
the rows name."""

from __future__ import annotations

from pathlib import Path

from llmem.setup.training import TrainingSetup

CATALOG_PEFT = Path(__file__).resolve().parents[1] / "model" / "catalog" / "peft"


def row(model: str, method: str = "single", gpus: int = 1, **kw) -> TrainingSetup:
    """A matrix row: `model` under `method` on `gpus` H100-80GB, the rest as TrainingSetup's fields."""
    return TrainingSetup(model=model, method=method, gpus=gpus, gpu="H100-80GB", **kw)


def bundled_peft_config(name: str) -> str:
    """A folder with an adapter_config.json written by peft's save_pretrained (llmem/model/catalog/peft)."""
    return str(CATALOG_PEFT / name)
