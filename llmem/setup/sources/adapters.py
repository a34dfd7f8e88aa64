"""Adapters on the set-up floor's config readers: LoRA / QLoRA as the frameworks write it, into the set-up.

LoRA / QLoRA as the frameworks describe it, into --lora-rank and friends, or, where only peft can express it
(modules_to_save: full trained copies of embed_tokens / lm_head; DoRA), into an adapter_config.json that llmem
writes to its cache folder and reads back through --peft-config, so that peft itself builds the adapters."""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmem.cache import cache_root
from llmem.errors import LlmemError
from llmem.setup.sources.reading import Reading
from llmem.setup.training import LORA_ALL_LINEAR


@dataclass(frozen=True)
class Lora:
    rank: int
    alpha: float
    dropout: float
    targets: str                           # "q_proj,v_proj" or all-linear
    modules_to_save: tuple[str, ...] = ()
    use_dora: bool = False


def targets_text(raw) -> str:
    """A framework's target list ("all-linear", "all", a list, a comma string) -> llmem's --lora-targets."""
    if isinstance(raw, (list, tuple)):
        names = [str(t).strip() for t in raw]
    else:
        names = [t.strip() for t in str(raw).split(",")]
    if any(n.lower() in ("all", "all-linear", "all_linear") for n in names):
        return LORA_ALL_LINEAR
    return ",".join(n for n in names if n)


def apply_lora(r: Reading, lora: Lora, sources: dict[str, tuple[str, Any]]) -> None:
    """The adapters into `r`: flags where they suffice, else a peft config written for peft to apply. `sources`:
    llmem's name (lora_rank, lora_alpha, lora_dropout, lora_targets, modules_to_save, use_dora) -> (the file's key,
    its value); a name without one is the framework's default."""
    flags = (("lora_rank", lora.rank), ("lora_alpha", int(lora.alpha)), ("lora_targets", lora.targets),
             ("lora_dropout", lora.dropout))
    if not lora.modules_to_save and not lora.use_dora:
        for name, value in flags:
            key, raw = sources.get(name, (f"{name} (default)", value))
            r.set(key, raw, name, value)
        return
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "lora_dropout": lora.dropout, "use_dora": lora.use_dora, "bias": "none",
              "target_modules": lora.targets if lora.targets == LORA_ALL_LINEAR else lora.targets.split(","),
              "modules_to_save": list(lora.modules_to_save) or None}
    path = write_peft_config(config)
    why = " and ".join(filter(None, ["modules_to_save (full trained copies of " + ", ".join(lora.modules_to_save)
                                     + ")" if lora.modules_to_save else "", "DoRA" if lora.use_dora else ""]))
    for name, value in flags:
        key, raw = sources.get(name, (f"{name} (default)", value))
        r.note_used(key, raw, f"{name} {value} in the peft config")
    key, raw = sources.get("modules_to_save") or sources.get("use_dora") or ("adapter", "lora")
    r.set(key, raw, "peft_config", str(path), f"{why}: only peft expresses them, so llmem wrote their "
          "adapter_config.json for --peft-config")


def cache_folder() -> Path:
    return cache_root() / "peft-from-file"


def write_peft_config(config: dict) -> Path:
    """adapter_config.json under llmem's cache, named by its content (the same config, the same path), in the
    system's temporary folder where the cache cannot be written."""
    text = json.dumps(config, indent=2, sort_keys=True)
    name = hashlib.sha256(text.encode()).hexdigest()[:16]
    for root in (cache_folder(), Path(tempfile.gettempdir()) / "llmem-peft-from-file"):
        path = root / name / "adapter_config.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                path.write_text(text, encoding="utf-8")
            return path
        except OSError:
            continue
    raise LlmemError(f"cannot write the adapter_config.json the file's adapters need under {cache_folder()} or the "
                     "temporary folder; set LLMEM_CACHE_DIR to a writable folder")
