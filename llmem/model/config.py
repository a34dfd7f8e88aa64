"""MODEL -> its transformers config, and the model built from it on the meta device (shapes only, no memory).

Order of look-up: the bundled catalog (hub id, short name or alias), the tiny shapes of real families, a path to a
config.json, a model folder holding one, otherwise `transformers.AutoConfig.from_pretrained` (the local HF cache,
or the network when the user has it). `torch.device("meta")` keeps tied embeddings tied
(`accelerate.init_empty_weights()` unties them: its parameters are made one by one).

Every way in ends in one LlmemError line naming the field, never in transformers' traceback: files are read by
transformers' own loader (its `{"__float__": "Infinity"}` encoding included), its validation errors are quoted, and
the sizes llmem reads are checked before a module is built (`check_dimensions`).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import warnings
from pathlib import Path

from llmem.errors import LlmemError, UnknownModel, first_line
from llmem.model.catalog import catalog_file, find_entry, load_config_dict, tiny_config_dict, tiny_file
from llmem.model.catalog.variants import variant_entry
from llmem.model.families import check_dimensions, check_raw_sizes
from llmem.model.vision import vision_spec

CONFIG_MAX_BYTES = 16 * 1024**2      # real config.json files are a few KiB; a bigger file is weights, not a config
HUB_PROBE_TIMEOUT_S = 3.0            # one try to reach the hub before a lookup that would retry for ~25 s
_OFFLINE_HINT = ("run offline with a catalog name (`llmem models`), a path to a config.json or a model folder, or "
                 "HF_HUB_OFFLINE=1 to read the local HF cache only")


def _shown(text: str, limit: int = 80) -> str:
    """MODEL as an error message quotes it: repr'd, cut to `limit` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _looks_like_path(model: str) -> bool:
    """A hub id is org/name; these can only be paths."""
    return model.endswith(".json") or model.startswith(("/", "./", "../", "~", ".\\")) or "\\" in model


def _local_path(model: str) -> Path | None:
    """MODEL as an existing file or folder, or None when it names none."""
    path = Path(os.path.expanduser(model))
    try:
        return path if path.is_file() or path.is_dir() else None
    except OSError as exc:    # a name longer than the file system allows (ENAMETOOLONG), a loop of links
        if _looks_like_path(model):
            raise LlmemError(f"cannot use MODEL path {_shown(model)}: {exc.strerror or first_line(exc)}") from None
        return None


def _why_unreadable(file: Path) -> str:
    """Why transformers could not read a config file, found by reading it here (its own message names no cause)."""
    try:
        text = file.read_bytes().decode("utf-8")
        value = json.loads(text)
    except OSError as exc:
        return f"cannot read config {file}: {exc.strerror or first_line(exc)}"
    except UnicodeDecodeError as exc:
        return f"config {file} is not UTF-8 text (byte {exc.start}): give a transformers config.json"
    except json.JSONDecodeError as exc:
        return f"malformed config {file}: {exc.msg} at line {exc.lineno}; give a valid config.json"
    if not isinstance(value, (dict, list)):
        return f"malformed config {file}: it holds {text.strip()[:40]}, not a JSON object; give a transformers config.json"
    return f"cannot read config {file}: give a transformers config.json"


def _read_config(path: Path) -> dict:
    """A config file's (or a model folder's config.json) dict, read by transformers' loader."""
    from transformers import PretrainedConfig

    file = _config_file(path)
    try:
        raw, _ = PretrainedConfig.get_config_dict(str(file))
    except (OSError, TypeError):      # TypeError: a JSON scalar (`null`), which its `"model_type" in` check rejects
        raise LlmemError(_why_unreadable(file)) from None
    except RecursionError:            # json's decoder recursing through a document nested thousands deep
        raise LlmemError(f"{file} is nested thousands of levels deep, which no config.json is: point MODEL at the "
                         "model's config.json") from None
    return raw


def _config_file(path: Path) -> Path:
    """The config file a local MODEL names: the file itself or a folder's config.json, at most CONFIG_MAX_BYTES
    (LlmemError naming the fix otherwise)."""
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise LlmemError(f"folder {path} has no config.json: point MODEL at a model folder or a config file")
    size_bytes = file.stat().st_size
    if size_bytes > CONFIG_MAX_BYTES:
        raise LlmemError(f"{file} is {size_bytes / 1024**2:.0f} MiB, not a config.json (at most "
                         f"{CONFIG_MAX_BYTES // 1024**2} MiB): point MODEL at the model's config.json")
    return file


def _checked(where: str, cfg):
    check_dimensions(cfg, where)
    return cfg


def resolve_config(model: str, trust_remote_code: bool = False):
    """MODEL -> (display name, transformers PretrainedConfig)."""
    entry = find_entry(model)
    if entry is not None:
        return entry.hub_id, _checked(entry.hub_id, config_from_dict(load_config_dict(entry), entry.hub_id))
    tiny = tiny_config_dict(model) if model.lower().startswith("tiny-") else None
    if tiny is not None:
        return model.lower(), _checked(model, config_from_dict(tiny, model))
    if not model.strip():
        raise LlmemError("MODEL is empty: give a catalog name (`llmem models`), a hub id, a path to a config.json or "
                         "a model folder")
    path = _local_path(model)
    if path is not None:
        return str(path), _checked(str(path), config_from_dict(_read_config(path), str(path)))
    if _looks_like_path(model):
        what = "is not a regular file" if os.path.exists(os.path.expanduser(model)) else "does not exist"
        raise LlmemError(f"config file {_shown(model)} {what}: give a path to a config.json, a model folder, or a "
                         "catalog name (`llmem models`)")
    try:
        return model, _checked(model, _hub_config(model, trust_remote_code))
    except UnknownModel:
        entry = variant_entry(model)
        if entry is None:
            raise
    # a mirror or chat-tuned variant of a catalog model the hub could not be asked about: its base's config
    return (f"{model} (read as {entry.hub_id}: the same shapes)",
            _checked(entry.hub_id, config_from_dict(load_config_dict(entry), entry.hub_id)))


def config_source(model: str) -> tuple[str, bytes, str | None] | None:
    """MODEL's display name, the bytes of the config file it resolves to and, for a bundled model, that file's name
    (its shipped anatomy's), found as resolve_config finds them but without transformers: what the anatomy's disk
    cache is keyed by. None when only transformers can tell (a hub id not in the local HF cache, a bad path)."""
    entry = find_entry(model)
    if entry is not None:
        return entry.hub_id, catalog_file("configs", entry.config_file), entry.config_file
    tiny = tiny_file(model) if model.lower().startswith("tiny-") else None
    if tiny is not None:
        return model.lower(), catalog_file("tiny", tiny), tiny
    try:
        path = _local_path(model) if model.strip() else None
        if path is not None:
            return str(path), _config_file(path).read_bytes(), None
        if _looks_like_path(model):
            return None
        snapshot = _hf_cache_config(model)
        return (model, snapshot.read_bytes(), None) if snapshot is not None else None
    except (LlmemError, OSError):
        return None


def _hf_cache_config(repo_id: str) -> Path | None:
    """The config.json of a hub id's main revision in the local HF cache (huggingface_hub's layout: models--org--name,
    refs/main naming the snapshot), or None."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"),
        "hub")
    repo = Path(os.path.expanduser(hub)) / f"models--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if repo_id.count("/") > 1 or ".." in repo_id or not ref.is_file():
        return None
    file = repo / "snapshots" / ref.read_text().strip() / "config.json"
    return file if file.is_file() else None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_reachable(endpoint: str | None = None, timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """One TCP connection to the hub within `timeout_s` (a thread bounds a slow DNS too). Behind a proxy the hub is
    not probed: the proxy decides."""
    from urllib.parse import urlsplit
    from urllib.request import getproxies  # 60 ms of imports: only when the hub is probed

    from huggingface_hub import constants

    if getproxies().get("https"):
        return True
    url = urlsplit(endpoint or constants.ENDPOINT)
    address = (url.hostname or "", url.port or (80 if url.scheme == "http" else 443))
    reached: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection(address, timeout=timeout_s).close()
            reached.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(reached)


def _hub_config(model: str, trust_remote_code: bool):
    """A hub id's config: from the local HF cache, or the hub when it answers (one probe first, so that no network
    fails fast instead of after transformers' retries)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    from transformers import AutoConfig

    try:
        validate_repo_id(model)
    except HFValidationError:
        raise UnknownModel(f"unknown model {_shown(model)}: not in the catalog (see `llmem models`), not a local "
                           "config file or folder, and not a hub id (org/name: letters, digits, '-', '_', '.', at most 96 "
                         "characters)") from None
    offline = _offline()
    reachable = not offline and hub_reachable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code,
                                              local_files_only=not reachable)
    except OSError as exc:  # transformers' and huggingface_hub's lookup errors (HTTP errors are OSErrors too)
        unknown = f"unknown model {_shown(model)}: not in the catalog (see `llmem models`), not a local config"
        if offline:
            raise UnknownModel(f"{unknown}, and not in the local HF cache (HF_HUB_OFFLINE is set)") from None
        if not reachable:
            raise UnknownModel(f"{unknown}, not in the HF cache, and the hub cannot be reached: {_OFFLINE_HINT}") \
                from None
        raise UnknownModel(f"{unknown}, and the hub lookup failed ({first_line(exc, 160)})") from None
    except Exception as exc:  # the config was found and transformers rejects it
        raise LlmemError(f"config of {_shown(model)}: {first_line(exc)}") from None


def config_from_dict(raw: dict, where: str):
    from transformers import CONFIG_MAPPING, AutoConfig

    if not isinstance(raw, dict) or "model_type" not in raw:
        raise LlmemError(f"malformed config {where}: no 'model_type' key; give a transformers config.json")
    raw = dict(raw)
    model_type = raw.pop("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise LlmemError(f"config {where}: transformers does not know model_type {model_type!r}: check its spelling, "
                         "or upgrade transformers")
    check_raw_sizes(raw, where)
    _check_dtype(raw, where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoConfig.for_model(model_type, **raw)
    except Exception as exc:   # transformers' validation: strict dataclass fields, its validators, torch's dtypes
        raise LlmemError(f"config {where}: {first_line(exc)}") from None


def _check_dtype(raw: dict, where: str) -> None:
    """torch_dtype (transformers 5: dtype) names a torch floating dtype, or "auto" (transformers' getattr(torch, name)
    names no field when it fails)."""
    import torch

    for key in ("torch_dtype", "dtype"):
        value = raw.get(key)
        if value is None or value == "auto":
            continue
        name = value.removeprefix("torch.") if isinstance(value, str) else None
        if name is None or not isinstance(getattr(torch, name, None), torch.dtype):
            raise LlmemError(f"config {where}: {key} is {value!r}; give a torch dtype such as \"bfloat16\", "
                             "\"float16\" or \"float32\"")


def training_config(cfg):
    """A copy of the config with the settings every training run uses: no KV cache."""
    cfg = cfg.__class__.from_dict(cfg.to_dict())
    cfg.use_cache = False
    return cfg


def build_meta_model(cfg, trust_remote_code: bool = False, scalar_head: bool = False):
    """The real HF causal-LM module tree with meta tensors (no memory). scalar_head: the sequence-classification
    model TRL's RewardTrainer loads (AutoModelForSequenceClassification, num_labels=1: the score Linear [1, hidden]
    in place of the lm_head)."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSequenceClassification,
    )

    cfg = training_config(cfg)
    # a vision-language model (llmem.model.vision) is built whole: its vision encoder, projector and language model
    auto = AutoModelForImageTextToText if vision_spec(cfg.model_type) is not None else AutoModelForCausalLM
    if scalar_head:
        cfg.num_labels = 1
        auto = AutoModelForSequenceClassification
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return auto.from_config(cfg, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise LlmemError(f"model_type {cfg.model_type!r} is not a causal language model: llmem estimates "
                             "decoder LLM fine-tuning (AutoModelForCausalLM)") from None
        raise LlmemError(f"cannot build {cfg.model_type!r} from its config: {first_line(exc)}") from None
    except (ImportError, KeyError, TypeError, RuntimeError, AttributeError, IndexError) as exc:
        # transformers builds what its config validation let through (an unknown rope type, a missing extra)
        raise LlmemError(f"cannot build {cfg.model_type!r} from its config: {first_line(exc)}") from None
