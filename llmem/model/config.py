"""MODEL -> its transformers config, and the model built from it on the meta device (shapes only, no memory).

Order of look-up: the bundled catalog (hub id, short name or alias), the tiny shapes of real families, a path to a
config.json, a model folder holding one, otherwise `transformers.AutoConfig.from_pretrained` (the local HF cache,
or the network when the user has it). `torch.device("meta")` keeps tied embeddings tied
(`accelerate.init_empty_weights()` unties them: its parameters are made one by one).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from llmem.errors import LlmemError, first_line
from llmem.model.catalog import find_entry, load_config_dict, tiny_config_dict


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise LlmemError(f"malformed config {path}: {exc.msg} at line {exc.lineno}; give a valid config.json") from None


def resolve_config(model: str, trust_remote_code: bool = False):
    """MODEL -> (display name, transformers PretrainedConfig)."""
    from transformers import AutoConfig

    entry = find_entry(model)
    if entry is not None:
        return entry.hub_id, config_from_dict(load_config_dict(entry), entry.hub_id)
    tiny = tiny_config_dict(model) if model.lower().startswith("tiny-") else None
    if tiny is not None:
        return model.lower(), config_from_dict(tiny, model)
    path = Path(os.path.expanduser(model))
    if path.is_file():
        return str(path), config_from_dict(_read_json(path), str(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LlmemError(f"folder {path} has no config.json: point MODEL at a model folder or a config file")
        return str(path), config_from_dict(_read_json(path / "config.json"), str(path))
    if model.endswith(".json"):
        raise LlmemError(f"config file {model} does not exist")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises OSError, ValueError, HTTP errors...
        first = first_line(exc)
        raise LlmemError(f"unknown model {model!r}: not in the catalog (see `llmem models`), not a local config, "
                         f"and the hub lookup failed ({first[:160]})") from None
    return model, cfg


def config_from_dict(raw: dict, where: str):
    from transformers import AutoConfig

    if not isinstance(raw, dict) or "model_type" not in raw:
        raise LlmemError(f"malformed config {where}: no 'model_type' key; give a transformers config.json")
    raw = dict(raw)
    model_type = raw.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError) as exc:
        raise LlmemError(f"config {where}: transformers does not know model_type {model_type!r} ({exc})") from None


def training_config(cfg):
    """A copy of the config with the settings every training run uses: no KV cache."""
    cfg = cfg.__class__.from_dict(cfg.to_dict())
    cfg.use_cache = False
    return cfg


def build_meta_model(cfg, trust_remote_code: bool = False):
    """The real HF causal-LM module tree with meta tensors (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = training_config(cfg)
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise LlmemError(f"model_type {cfg.model_type!r} is not a causal language model: llmem estimates "
                             "decoder LLM fine-tuning (AutoModelForCausalLM)") from None
        raise LlmemError(f"cannot build {cfg.model_type!r} from its config: {exc}") from None
