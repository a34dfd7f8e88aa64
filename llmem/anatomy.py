"""Model anatomy: the model's real structure, built on the meta device from its HF config.

Every parameter is inventoried (name, shape, dtype, module kind, layer index, tied, trainable) together with the
dimensions that activations depend on. Nothing is allocated: `torch.device("meta")` gives shapes only, and keeps tied
embeddings tied (`accelerate.init_empty_weights()` would untie them, see docs/trace-notes).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from llmem.catalog import find_entry, load_config_dict, tiny_config_dict
from llmem.errors import LlmemError

# Families whose decoder layers share one activation recipe (see estimator.activation_recipe).
FAMILY_BY_MODEL_TYPE = {
    "llama": "llama", "mistral": "llama", "qwen2": "llama", "mixtral": "llama", "gemma2": "llama",
    "phi3": "llama", "gpt2": "gpt2", "gpt_bigcode": "gpt2", "opt": "opt", "biogpt": "opt", "bloom": "bloom",
    "falcon": "falcon", "gpt_neo": "gpt_neo", "codegen": "codegen",
}


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str
    module_kind: str          # class name of the owning module: Linear, Embedding, LayerNorm, Conv1D, ...
    layer_index: int | None   # decoder layer, None for embeddings / final norm / lm_head
    tied_to: str | None       # name of the parameter this one shares storage with (the first name seen)
    trainable: bool = True

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class PeftInfo:
    """What peft adds that activations depend on (the trainable set itself is in the anatomy's params)."""
    peft_type: str                      # peft's PeftType: LORA, IA3, PROMPT_TUNING, PREFIX_TUNING, ...
    lora_dropout: float = 0.0           # LoRA: nn.Dropout(p) on each adapter's input
    use_dora: bool = False              # LoRA: DoRA's magnitude vectors and per-forward weight norms
    num_virtual_tokens: int = 0         # prompt tuning: prepended embeddings (the model runs seq_len + n)
    exact: bool = True                  # False: activations modelled as for the frozen base (a note says so)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelAnatomy:
    name: str
    model_type: str
    architecture: str
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    params: tuple[ParamInfo, ...]          # unique parameters only (a tied weight appears once)
    tied_names: tuple[str, ...] = ()       # names that alias an earlier parameter
    supports_sdpa: bool = True             # HF class accepts attn_implementation="sdpa" (else eager runs)
    config: dict = field(default_factory=dict, compare=False, hash=False)
    peft: PeftInfo | None = None           # set when peft adapters / prompts are part of the model

    @property
    def total_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def trainable_params(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

    def layer_params(self, index: int) -> int:
        return sum(p.numel for p in self.params if p.layer_index == index)

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, final norm, lm_head (FSDP's root unit)."""
        return sum(p.numel for p in self.params if p.layer_index is None)

    @property
    def largest_layer_params(self) -> int:
        return max((self.layer_params(i) for i in range(self.num_layers)), default=0)

    @property
    def embedding_params(self) -> int:
        return sum(p.numel for p in self.params if p.module_kind.endswith("Embedding") and p.layer_index is None)

    def params_of_kind(self, *kinds: str) -> list[ParamInfo]:
        return [p for p in self.params if p.module_kind in kinds]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise LlmemError(f"malformed config {path}: {exc.msg} at line {exc.lineno}; give a valid config.json") from None


def resolve_config(model: str, trust_remote_code: bool = False):
    """MODEL -> (display name, transformers PretrainedConfig).

    Order: the bundled catalog (hub id, short name or alias); a path to a config.json; a model folder holding one;
    otherwise `transformers.AutoConfig.from_pretrained` (local HF cache, or the network when the user has it).
    """
    from transformers import AutoConfig

    entry = find_entry(model)
    if entry is not None:
        return entry.hub_id, _config_from_dict(load_config_dict(entry), entry.hub_id)
    tiny = tiny_config_dict(model) if model.lower().startswith("tiny-") else None
    if tiny is not None:
        return model.lower(), _config_from_dict(tiny, model)
    path = Path(os.path.expanduser(model))
    if path.is_file():
        return str(path), _config_from_dict(_read_json(path), str(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LlmemError(f"folder {path} has no config.json: point MODEL at a model folder or a config file")
        return str(path), _config_from_dict(_read_json(path / "config.json"), str(path))
    if model.endswith(".json"):
        raise LlmemError(f"config file {model} does not exist")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises OSError, ValueError, HTTP errors...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LlmemError(f"unknown model {model!r}: not in the catalog (see `llmem models`), not a local config, "
                         f"and the hub lookup failed ({first[:160]})") from None
    return model, cfg


def _config_from_dict(raw: dict, where: str):
    from transformers import AutoConfig

    if not isinstance(raw, dict) or "model_type" not in raw:
        raise LlmemError(f"malformed config {where}: no 'model_type' key; give a transformers config.json")
    raw = dict(raw)
    model_type = raw.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError) as exc:
        raise LlmemError(f"config {where}: transformers does not know model_type {model_type!r} ({exc})") from None


def build_meta_model(cfg, trust_remote_code: bool = False):
    """The real HF causal-LM module tree with meta tensors (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = _training_config(cfg)
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise LlmemError(f"model_type {cfg.model_type!r} is not a causal language model: llmem estimates "
                             "decoder LLM fine-tuning (AutoModelForCausalLM)") from None
        raise LlmemError(f"cannot build {cfg.model_type!r} from its config: {exc}") from None


def _training_config(cfg):
    """Settings every training run uses: no KV cache."""
    cfg = cfg.__class__.from_dict(cfg.to_dict())
    cfg.use_cache = False
    return cfg


def inventory(model, name: str) -> ModelAnatomy:
    """Walk the built module tree and record every parameter once."""
    cfg = model.config
    layers_prefix = _layers_prefix(model)
    seen: dict[int, str] = {}
    params: list[ParamInfo] = []
    tied: list[str] = []
    for module_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            if id(p) in seen:
                tied.append(full)
                continue
            seen[id(p)] = full
            params.append(ParamInfo(full, tuple(p.shape), str(p.dtype).replace("torch.", ""),
                                    type(module).__name__, _layer_index(full, layers_prefix), None))
    # mark the first name of a tied pair as tied too, so both sides know
    tied_targets = {}
    for module_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            if seen[id(p)] != full:
                tied_targets[seen[id(p)]] = full
    params = [ParamInfo(p.name, p.shape, p.dtype, p.module_kind, p.layer_index, tied_targets.get(p.name))
              for p in params]

    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    hidden = _first(text, "hidden_size", "n_embd", "d_model")
    heads = _first(text, "num_attention_heads", "n_head", "num_heads")
    if cfg.model_type == "falcon" and not getattr(text, "new_decoder_architecture", False):
        kv_heads = 1 if getattr(text, "multi_query", True) else heads   # num_kv_heads is ignored by the model
    else:
        kv_heads = _first(text, "num_key_value_heads", "num_kv_heads", default=None)
    if kv_heads is None:
        kv_heads = 1 if getattr(text, "multi_query", False) else heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    inter = _first(text, "intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", default=None) or 4 * hidden
    num_layers = _first(text, "num_hidden_layers", "n_layer", "num_layers")
    return ModelAnatomy(
        name=name, model_type=cfg.model_type, architecture=type(model).__name__,
        family=FAMILY_BY_MODEL_TYPE.get(cfg.model_type, "llama"),
        hidden_size=hidden, num_layers=num_layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=inter, vocab_size=text.vocab_size,
        tie_word_embeddings=bool(tied), params=tuple(params), tied_names=tuple(tied),
        supports_sdpa=bool(getattr(type(model), "_supports_sdpa", False)), config=cfg.to_dict(),
    )


def _first(cfg, *names, default=...):
    for n in names:
        value = getattr(cfg, n, None)
        if value is not None:
            return value
    if default is ...:
        raise LlmemError(f"config of {cfg.model_type!r} lacks {names[0]}: llmem cannot read its dimensions")
    return default


def _layers_prefix(model) -> str:
    """The ModuleList holding the decoder layers (the longest ModuleList)."""
    import torch

    best, best_len = "", 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > best_len:
            best, best_len = name, len(module)
    return best + "."


def _layer_index(name: str, prefix: str) -> int | None:
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


LORA_ALL_LINEAR = "all-linear"


@lru_cache(maxsize=64)
def with_lora(anatomy: ModelAnatomy, rank: int, targets: str = "q_proj,v_proj", dropout: float = 0.0) -> ModelAnatomy:
    """The anatomy as peft's LoRA builds it: every base parameter frozen, adapters A [r, in] and B [out, r] added
    next to each targeted linear of the decoder layers ("all-linear": every Linear/Conv1D inside the layers, as
    peft's all-linear, which leaves lm_head alone). `dropout`: peft's lora_dropout."""
    wanted = {t.strip() for t in targets.split(",") if t.strip()}
    if not wanted:
        raise LlmemError("--lora-targets is empty: give module names (e.g. q_proj,v_proj) or all-linear")
    params: list[ParamInfo] = []
    matched: set[str] = set()
    for p in anatomy.params:
        params.append(ParamInfo(p.name, p.shape, p.dtype, p.module_kind, p.layer_index, p.tied_to, trainable=False))
        module, leaf = p.name.rsplit(".", 1)
        short = module.rsplit(".", 1)[-1]
        if (leaf != "weight" or p.layer_index is None or p.module_kind not in ("Linear", "Conv1D")
                or not (LORA_ALL_LINEAR in wanted or short in wanted)):
            continue
        matched.add(short)
        out_f, in_f = (p.shape[1], p.shape[0]) if p.module_kind == "Conv1D" else (p.shape[0], p.shape[1])
        params.append(ParamInfo(f"{module}.lora_A.default.weight", (rank, in_f), "float32", "Linear",
                                p.layer_index, None))
        params.append(ParamInfo(f"{module}.lora_B.default.weight", (out_f, rank), "float32", "Linear",
                                p.layer_index, None))
    missing = wanted - matched - {LORA_ALL_LINEAR}
    if missing:
        names = sorted({p.name.rsplit(".", 2)[-2] for p in anatomy.params
                        if p.layer_index is not None and p.module_kind in ("Linear", "Conv1D")})
        raise LlmemError(f"--lora-targets {', '.join(sorted(missing))} not found in {anatomy.name}: "
                         f"its layers' linear modules are {', '.join(names)} (or use all-linear)")
    from dataclasses import replace

    return replace(anatomy, params=tuple(params), peft=PeftInfo("LORA", lora_dropout=dropout))


@lru_cache(maxsize=64)
def load_anatomy(model: str, trust_remote_code: bool = False) -> ModelAnatomy:
    """MODEL string -> its anatomy (cached: anatomies are immutable)."""
    name, cfg = resolve_config(model, trust_remote_code)
    return inventory(build_meta_model(cfg, trust_remote_code), name)


# ---------------------------------------------------------------------------------------------------------------
# Any peft config (--peft-config): peft itself builds the adapters on the meta model, the anatomy is read back.

PEFT_EXACT_TYPES = ("LORA", "IA3", "PROMPT_TUNING")   # activation models written for these (llmem.activations)


def read_peft_config(path: str) -> tuple[str, dict]:
    """--peft-config PATH (a folder holding adapter_config.json, or the json file) -> (its text, its fields)."""
    p = Path(os.path.expanduser(path))
    if p.is_dir():
        p = p / "adapter_config.json"
        if not p.is_file():
            raise LlmemError(f"--peft-config folder {path} has no adapter_config.json")
    elif not p.is_file():
        raise LlmemError(f"--peft-config {path} does not exist (give an adapter_config.json or its folder)")
    text = p.read_text()
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LlmemError(f"malformed peft config {p}: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(fields, dict) or "peft_type" not in fields:
        raise LlmemError(f"peft config {p} has no 'peft_type': give an adapter_config.json written by peft")
    return text, fields


def peft_config_from_text(text: str):
    """The peft config object (peft's own class for its peft_type). Prompt tuning initialised from text needs a
    tokenizer; memory does not depend on the initial values, so RANDOM is used instead."""
    from peft import PeftConfig

    fields = json.loads(text)
    if fields.get("task_type") is None:
        fields["task_type"] = "CAUSAL_LM"
    if fields.get("prompt_tuning_init") == "TEXT":
        fields["prompt_tuning_init"] = "RANDOM"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return PeftConfig.from_peft_type(**fields)
    except (TypeError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LlmemError(f"peft cannot read this config ({fields.get('peft_type')}): {first[:200]}") from None


def apply_peft_config(model, text: str, autocast_adapter_dtype: bool):
    """get_peft_model(model, config) on the (meta) model: the adapters and the trainable set as peft makes them."""
    from peft import get_peft_model

    config = peft_config_from_text(text)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return get_peft_model(model, config, autocast_adapter_dtype=autocast_adapter_dtype)
    except (ValueError, TypeError, KeyError, AttributeError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LlmemError(f"peft cannot apply this {config.peft_type} config to the model: {first[:200]}") from None


def _peft_name(name: str) -> str:
    """peft's wrapper names -> the base model's names (q_proj.base_layer.weight -> q_proj.weight)."""
    return name.replace(".base_layer.", ".")


@lru_cache(maxsize=32)
def peft_anatomy(model: str, trust_remote_code: bool, config_text: str) -> ModelAnatomy:
    """The anatomy of the peft model peft builds from this config on the meta device (cached per model and config
    text: the planner estimates many set-ups of one model)."""
    from dataclasses import replace

    name, cfg = resolve_config(model, trust_remote_code)
    peft_model = apply_peft_config(build_meta_model(cfg, trust_remote_code), config_text, False)
    base = peft_model.get_base_model()
    anatomy = inventory(base, name)
    grad: dict[str, bool] = {}
    seen: set[int] = set()
    for module_name, module in base.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            grad.setdefault(f"{module_name}.{pname}" if module_name else pname, p.requires_grad)
            seen.add(id(p))
    params = [replace(p, name=_peft_name(p.name), trainable=grad[p.name],
                      tied_to=_peft_name(p.tied_to) if p.tied_to else None) for p in anatomy.params]
    for module_name, module in peft_model.named_modules():   # prompt encoders live outside the base model
        for pname, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                params.append(ParamInfo(f"{module_name}.{pname}", tuple(p.shape), str(p.dtype).replace("torch.", ""),
                                        type(module).__name__, None, None, p.requires_grad))
    config = peft_model.peft_config["default"]
    peft_type = str(getattr(config.peft_type, "value", config.peft_type))
    use_dora = bool(getattr(config, "use_dora", False))
    notes: list[str] = []
    lora_dropout = float(getattr(config, "lora_dropout", 0.0) or 0.0)
    exact = peft_type in PEFT_EXACT_TYPES and not (use_dora and lora_dropout > 0)
    per_layer = {sum(1 for p in params if p.layer_index == i and p.trainable) for i in range(anatomy.num_layers)}
    if exact and len(per_layer) > 1:
        exact = False
        notes.append("peft adapts the decoder layers unevenly (layers_to_transform / patterns): activations are "
                     "modelled from layer 0")
    if not exact and not notes:
        kind = "DoRA with lora_dropout" if use_dora else peft_type
        notes.append(f"no exact activation model for peft type {kind}: trainable set from peft itself, "
                     "activations as for the frozen base (llmem trace runs peft's real code)")
    if json.loads(config_text).get("prompt_tuning_init") == "TEXT":
        notes.append("prompt_tuning_init TEXT needs a tokenizer: RANDOM initialisation used (same memory)")
    info = PeftInfo(peft_type, lora_dropout=lora_dropout, use_dora=use_dora,
                    num_virtual_tokens=int(getattr(config, "num_virtual_tokens", 0) or 0)
                    if peft_type == "PROMPT_TUNING" else 0, exact=exact, notes=tuple(notes))
    return replace(anatomy, params=tuple(params), tied_names=tuple(_peft_name(n) for n in anatomy.tied_names),
                   peft=info)
