"""Adapters on the set-up floor's config readers: LoRA / QLoRA / DoRA / OFT as the frameworks write it, into the
set-up.

LoRA / QLoRA as the frameworks describe it, into --lora-rank and friends, or, where only peft can express it
(modules_to_save: full trained copies of embed_tokens / lm_head; DoRA; per-layer ranks or layer subsets; OFT),
into an adapter_config.json that llmem writes to its cache folder and reads back through --peft-config, so that
peft itself builds the adapters."""

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
    # further LoraConfig fields the file sets (layers_to_transform, rank_pattern, ...): only peft expresses them
    peft_fields: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Oft:
    """peft's OFTConfig as a framework builds it: block-diagonal orthogonal adapters, `rank` blocks or blocks of
    `block_size` (exactly one of them non-zero)."""
    rank: int
    block_size: int
    dropout: float                         # module_dropout: whole blocks dropped
    targets: str
    modules_to_save: tuple[str, ...] = ()


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
    if not lora.modules_to_save and not lora.use_dora and not lora.peft_fields:
        for name, value in flags:
            key, raw = sources.get(name, (f"{name} (default)", value))
            r.set(key, raw, name, value)
        return
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "lora_dropout": lora.dropout, "use_dora": lora.use_dora, "bias": "none",
              "target_modules": lora.targets if lora.targets == LORA_ALL_LINEAR else lora.targets.split(","),
              "modules_to_save": list(lora.modules_to_save) or None} | dict(lora.peft_fields)
    path = write_peft_config(config)
    why = " and ".join(filter(None, ["modules_to_save (full trained copies of " + ", ".join(lora.modules_to_save)
                                     + ")" if lora.modules_to_save else "", "DoRA" if lora.use_dora else "",
                                     ", ".join(name for name, _ in lora.peft_fields)]))
    for name, value in flags:
        key, raw = sources.get(name, (f"{name} (default)", value))
        r.note_used(key, raw, f"{name} {value} in the peft config")
    extra = [n for n, _ in lora.peft_fields]
    key, raw = (sources.get("modules_to_save") or sources.get("use_dora") or
                next((sources[n] for n in extra if n in sources), None) or ("adapter", "lora"))
    r.set(key, raw, "peft_config", str(path), f"{why}: only peft expresses them, so llmem wrote their "
          "adapter_config.json for --peft-config")


def apply_oft(r: Reading, oft: Oft, key: str, raw: Any, sources: dict[str, tuple[str, Any]]) -> None:
    """OFT adapters into `r`: peft's OFTConfig written for peft to build (llmem has no OFT flags), the answer's
    activations learned from peft's own OFT layers. `sources`: OFTConfig's field -> (the file's key, its value)."""
    config = {"peft_type": "OFT", "task_type": "CAUSAL_LM", "r": oft.rank, "oft_block_size": oft.block_size,
              "module_dropout": oft.dropout, "bias": "none",
              "target_modules": oft.targets if oft.targets == LORA_ALL_LINEAR else oft.targets.split(","),
              "modules_to_save": list(oft.modules_to_save) or None}
    path = write_peft_config(config)
    for name in ("r", "oft_block_size", "module_dropout", "target_modules", "modules_to_save"):
        if name in sources:
            r.note_used(*sources[name], f"{name} {config[name]} in the peft config")
    r.set(key, raw, "peft_config", str(path), "OFT: peft's OFTConfig, which llmem wrote as an adapter_config.json "
          "for --peft-config")


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
