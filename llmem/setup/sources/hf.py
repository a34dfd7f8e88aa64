"""What the HF-Trainer-based configs share (TRL / TrainingArguments, LLaMA-Factory, axolotl): the optimizer names,
attention, gradient checkpointing, Liger kernels, and FSDP / DeepSpeed through TrainingArguments' `fsdp`,
`fsdp_config` and `deepspeed` (a path, resolved beside the file, above it or in the working folder, or the JSON
itself)."""

from __future__ import annotations

import json
from typing import Any

from llmem.setup.liger import AUTO, LIGER_DEFAULTS, liger_kernels
from llmem.setup.sources.deepspeed import TrainerValues, read_deepspeed
from llmem.setup.sources.files import find_reference, load
from llmem.setup.sources.fsdp import read_fsdp_config, strategy_from_options
from llmem.setup.sources.names import HF_ATTENTIONS, HF_OPTIMIZERS
from llmem.setup.sources.reading import Keys, Reading

LIGER_CE_NOTE = "Liger's fused linear cross-entropy (no full logits)"
LIGER_NOTE = "Liger's {kernels} Functions over HF's modules (llmem.setup.liger)"
AUTO_NOTE = ("apply_liger_kernel_to_<model>'s rms_norm, swiglu and rope where llmem models the family's patch "
             "(llmem.setup.liger)")


def set_liger(r: Reading, key: str, raw: Any, kernels: list[str]) -> None:
    """--liger from a config's Liger switches (each kernel once, in LIGER_DEFAULTS' order)."""
    chosen = [k for k in LIGER_DEFAULTS if k in kernels]
    if chosen:
        known = liger_kernels(r.values.get("liger") or "none")
        merged = [k for k in LIGER_DEFAULTS if k in chosen or k in known]
        if tuple(merged) == LIGER_DEFAULTS:     # what the Trainer applies: on the families whose patch llmem models
            r.set(key, raw, "liger", AUTO, AUTO_NOTE)
        else:
            r.set(key, raw, "liger", ",".join(merged), LIGER_NOTE.format(kernels=", ".join(chosen)))


def read_bnb_4bit(r: Reading, keys: Keys, double_key: str, double_default: bool, default_label: str) -> None:
    """A bitsandbytes 4-bit base's BitsAndBytesConfig options: the quant type (FP4 is stored as NF4 is) and the
    double quantisation under the framework's `double_key`, its default as the framework sets it."""
    qtype = str(keys.get("bnb_4bit_quant_type", "nf4")).lower()
    if qtype != "nf4":
        r.ignore("bnb_4bit_quant_type", qtype, "FP4 is stored as NF4 is: modelled as nf4", approximates=False)
    double = r.boolean(double_key, keys.get(double_key, double_default))
    r.set(double_key + ("" if double_key in keys else f" ({default_label})"), double, "double_quant", double)
    keys.get("bnb_4bit_quant_storage")


def read_optimizer(r: Reading, key: str, raw: Any) -> None:
    row = HF_OPTIMIZERS.get(str(raw).strip().lower())
    if row is None:
        r.ignore(key, raw, "not an optimizer llmem knows (transformers' OptimizerNames): llmem's optimizer stands in")
    elif row.llmem is None:
        r.ignore(key, raw, f"{row.note}: llmem's optimizer (adamw unless --optimizer) stands in")
    else:
        r.set(key, raw, "optimizer", row.llmem, row.note)


def read_attention(r: Reading, key: str, raw: Any) -> None:
    row = HF_ATTENTIONS.get(str(raw).strip())
    if row is None:
        r.ignore(key, raw, "an attention implementation llmem does not model: sdpa stands in")
    elif row.llmem is None:
        r.ignore(key, raw, row.note)
    else:
        r.set(key, raw, "attn", row.llmem, row.note)


def read_checkpointing(r: Reading, keys: Keys, default: bool) -> None:
    """TrainingArguments' activation_checkpointing (gradient_checkpointing, its deprecated alias) and its kwargs:
    every_n_layers -> --grad-ckpt-every, offload -> --offload-activations (transformers 5's
    activation_checkpointing_kwargs)."""
    key = "activation_checkpointing" if "activation_checkpointing" in keys else "gradient_checkpointing"
    on = r.boolean(key, keys.get(key)) if key in keys else default
    if key in keys or on:
        r.set(key if key in keys else f"{key} (default)", keys.get(key, default), "grad_ckpt", on)
    kw_key = f"{key}_kwargs"
    kwargs = keys.get(kw_key) or {}
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError:
            raise r.error(kw_key, kwargs, "is not a JSON mapping", 'write e.g. {"use_reentrant": false}') from None
    if not isinstance(kwargs, dict):
        raise r.error(kw_key, kwargs, "is not a mapping", 'write e.g. {"use_reentrant": false}')
    for name, value in kwargs.items():
        full = f"{kw_key}.{name}"
        if name == "every_n_layers" and on:
            r.set(full, value, "ckpt_every", r.integer(full, value, what="a layer stride"))
        elif name == "offload" and on and r.boolean(full, value):
            r.set(full, value, "offload_activations", True, "saved activations held in pinned host memory")
        elif name == "use_reentrant" and on and r.boolean(full, value):
            r.set(full, value, "ckpt_reentrant", True, "torch's reentrant checkpoint: each layer's forward under no_grad")
        elif name == "use_reentrant":
            r.note_used(full, value, "the non-reentrant checkpoint (transformers 5's default)")
        else:
            r.ignore(full, value, "not modelled")


def read_liger(r: Reading, keys: Keys, fused_head: bool = False) -> None:
    """TrainingArguments' use_liger_kernel (apply_liger_kernel_to_<model>, fused_linear_cross_entropy on by default)
    and liger_kernel_config. `fused_head`: a TRL trainer that computes its log-probs with its own fused LM head
    (TRL 1.16's SFT, DPO, KTO, GRPO and RLOO trainers), which turns fused_linear_cross_entropy off and applies only
    Liger's layer kernels (refusing it when the config asks for it: e.g. dpo_trainer.py __init__)."""
    if "use_liger_kernel" not in keys or not r.boolean("use_liger_kernel", keys.get("use_liger_kernel")):
        keys.get("liger_kernel_config")
        return
    config = keys.get("liger_kernel_config") or {}
    config = config if isinstance(config, dict) else {}
    if fused_head and config.get("fused_linear_cross_entropy"):
        raise r.error("liger_kernel_config.fused_linear_cross_entropy", True, "is refused by TRL's trainer (it "
                      "replaces the forward its fused LM head patches)", "drop it: the trainer's own head computes "
                      "the loss")
    fused = bool(config.get("fused_linear_cross_entropy", True)) and not fused_head
    r.set("use_liger_kernel", True, "fused_ce", fused, LIGER_CE_NOTE if fused else
          "fused_linear_cross_entropy off: the TRL trainer's fused LM head computes the loss" if fused_head else
          "fused_linear_cross_entropy off")
    set_liger(r, "use_liger_kernel", True, [k for k in LIGER_DEFAULTS if config.get(k, True)])
    for name, on in config.items():
        if name not in (*LIGER_DEFAULTS, "fused_linear_cross_entropy") and on:
            r.ignore(f"liger_kernel_config.{name}", on, "a Liger kernel llmem does not model: HF's op stands in")


def trainer_distributed(r: Reading, keys: Keys, trainer: TrainerValues) -> None:
    """TrainingArguments' fsdp / fsdp_config / deepspeed."""
    strategy = strategy_from_options(r, "fsdp", keys.get("fsdp")) if "fsdp" in keys else None
    config = keys.get("fsdp_config")
    if isinstance(config, str) and config:
        path = find_reference(config, r.path, "fsdp_config")
        _, data = load(path)
        r.files.append((str(path), "fsdp_config"))
        config = data
    if strategy is not None or (isinstance(config, dict) and config and keys.get("fsdp")):
        read_fsdp_config(r, Keys(config if isinstance(config, dict) else {}, "fsdp_config."), strategy)
    elif isinstance(config, dict) and config:
        r.ignore("fsdp_config", "...", "fsdp is not set, so transformers does not use fsdp_config", approximates=False)
    if "deepspeed" in keys:
        read_deepspeed_ref(r, "deepspeed", keys.get("deepspeed"), trainer)


def read_deepspeed_ref(r: Reading, key: str, ref: Any, trainer: TrainerValues) -> None:
    """A `deepspeed:` value: the JSON's path (or the mapping itself), read with the trainer's values for "auto"."""
    if isinstance(ref, dict):
        read_deepspeed(r, ref, f"{key} (inline)", trainer)
        return
    if not isinstance(ref, str) or not ref.strip():
        raise r.error(key, ref, "is not a path to a DeepSpeed JSON", "give e.g. deepspeed_configs/zero3.json")
    path = find_reference(ref.strip(), r.path, key)
    _, data = load(path)
    r.files.append((str(path), "deepspeed"))
    r.note_used(key, ref, f"read {path}")
    read_deepspeed(r, data, path.name, trainer)
