"""The trained anatomy: full fine-tuning trains every parameter; LoRA (`--lora-rank`) freezes the base and adds
adapters as peft's LoRA builds them; `--peft-config` has peft itself build its adapters on the meta model, and the
anatomy is read back from what peft made."""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from llmem.errors import LlmemError, first_line
from llmem.model.anatomy import (
    DTYPE_BYTES,
    ModelAnatomy,
    ParamInfo,
    PeftInfo,
    added_buffers,
    inventory,
    read_or_build,
)
from llmem.model.config import build_meta_model, resolve_config
from llmem.model.peft_data_free import (
    DATA_FREE_ATTR,
    DATA_FREE_NOTE,
    data_free_build,
    data_free_config,
    data_free_note,
)
from llmem.model.sharding import MATMUL_KINDS, is_embedding, is_lm_head
from llmem.setup.methods import method_spec
from llmem.setup.objectives import (
    CAST_EXEMPT,
    QUANTISED_ADAPTER_DTYPE,
    cast_by_trainer,
    casts_quantised_adapters,
)
from llmem.setup.training import LORA_ALL_LINEAR, TrainingSetup, lora_target_regex

PEFT_EXACT_TYPES = ("LORA", "IA3", "PROMPT_TUNING")   # activation models written for these (llmem.memory.activations)


def trained_anatomy(anatomy: ModelAnatomy, setup: TrainingSetup) -> ModelAnatomy:
    """`anatomy` (the base model's) as `setup` trains it (cached per model and adapter settings)."""
    upcast = setup.adapter_dtype == "fp32"
    if setup.peft_config:
        trained = peft_anatomy(setup.model, setup.trust_remote_code, read_peft_config(setup.peft_config)[0], upcast)
    elif setup.lora_rank:
        trained = with_lora(anatomy, setup.lora_rank, setup.lora_targets, setup.lora_dropout, upcast)
    else:
        return anatomy
    if trained.host_params and not method_spec(setup.method).plain_tensors:
        raise LlmemError(f"peft's {trained.peft.peft_type} runtime_offload_base_weight (base weights moved to the "
                         f"host by weight.data = weight.data.cpu()) is not modelled over --method {setup.method}'s "
                         "sharded or DeepSpeed parameters: use single or ddp, or set it false in the config")
    return trainer_cast(trained) if casts_quantised_adapters(setup) else trained


@lru_cache(maxsize=64)
def trainer_cast(anatomy: ModelAnatomy) -> ModelAnatomy:
    """The trained anatomy after TRL's QLoRA cast (llmem.setup.objectives.casts_quantised_adapters): every trained
    parameter bf16 but the one the trainer exempts by name (`param.data = param.data.to(torch.bfloat16)` over
    model.named_parameters() with requires_grad, e.g. trl/trainer/sft_trainer.py __init__)."""
    return replace(anatomy, params=tuple(
        replace(p, dtype=QUANTISED_ADAPTER_DTYPE) if p.trainable and CAST_EXEMPT not in p.name else p
        for p in anatomy.params))


# The dtype a trained anatomy gives each trained parameter (ParamInfo.dtype) is the one peft gives it on a bf16 base
# (fp16 alike): fp32 where peft upcasts it (get_peft_model(autocast_adapter_dtype=True), its default:
# tuners_utils.cast_adapter_dtype upcasts the fp16/bf16 parameters of every BaseTunerLayer's adapter dicts) or
# builds it in fp32 whatever the base (prompt learning's encoders, which peft never casts), else LOW_DTYPE
# (autocast_adapter_dtype=False: _move_adapter_to_device_of_base_layer casts the adapters to the base layer's
# dtype; a trained base parameter, e.g. a bias, keeps its own).
LOW_DTYPE = "bfloat16"


def element_bytes(p: ParamInfo, setup: TrainingSetup) -> int:
    """Bytes per element of a parameter as the step holds it, its gradient and optimizer states alike (they follow
    the parameter's dtype): frozen ones as TrainingSetup.stored_bytes says; trained ones in the precision's
    param_bytes, except peft's fp32 ones under pure fp16/bf16 (LOW_DTYPE's rule). Under *-mixed and fp32 every
    trained parameter is fp32: llmem builds the adapters on the fp32 model (the masters *-mixed names) before the
    frozen base is cast to the compute dtype, so --adapter-dtype base changes nothing there. TRL's QLoRA cast makes
    them bf16 whatever the precision (llmem.setup.objectives.cast_by_trainer)."""
    if not p.trainable:
        return setup.stored_bytes(False)
    if cast_by_trainer(setup, p.name):      # TRL's QLoRA cast (trainer_cast): the parameter, its gradient and states
        return DTYPE_BYTES[QUANTISED_ADAPTER_DTYPE]
    if setup.peft and setup.precision_spec.low_precision and not setup.mixed and p.dtype == "float32":
        return 4
    return setup.param_bytes


def lora_target_names(targets: str) -> list[str]:
    """--lora-targets "q_proj, v_proj" -> ["q_proj", "v_proj"] (all-linear stays one name)."""
    return [t.strip() for t in targets.split(",") if t.strip()]


@lru_cache(maxsize=64)
def with_lora(anatomy: ModelAnatomy, rank: int, targets: str = "q_proj,v_proj", dropout: float = 0.0,
              upcast: bool = True) -> ModelAnatomy:
    """The anatomy as peft's LoRA builds it: every base parameter frozen, adapters A [r, in] and B [out, r] added
    next to each targeted linear of the decoder layers ("all-linear": every Linear/Conv1D inside the layers, as
    peft's all-linear, which leaves lm_head alone; "re:PATTERN": the modules whose full name the pattern matches,
    peft's target_modules as one string). `dropout`: peft's lora_dropout; `upcast`: peft's autocast_adapter_dtype
    (the adapters' dtype on a low-precision base: LOW_DTYPE's rule)."""
    dtype = "float32" if upcast else LOW_DTYPE
    targeted, embedded = _lora_targeted(anatomy, targets)
    params: list[ParamInfo] = []
    for p in anatomy.params:
        params.append(replace(p, trainable=False))
        if p.name in embedded:     # peft's lora.Embedding (a tied weight stays the base's, shared with lm_head)
            params += embedding_lora_params(p, rank, dtype)
        if p.name not in targeted:
            continue
        # peft wraps the output layer when named (its all-linear leaves it out): the adapters as peft makes them
        module = "lm_head" if is_lm_head(p) else p.name.rsplit(".", 1)[0]
        params.append(ParamInfo(f"{module}.lora_A.default.weight", (rank, p.in_features), dtype, "Linear",
                                p.layer_index, None))
        params.append(ParamInfo(f"{module}.lora_B.default.weight", (p.out_features, rank), dtype, "Linear",
                                p.layer_index, None))
    return replace(anatomy, params=tuple(params), peft=PeftInfo("LORA", lora_dropout=dropout))


def embedding_lora_params(p: ParamInfo, rank: int, dtype: str) -> list[ParamInfo]:
    """peft's LoRA on an nn.Embedding [num_embeddings, embedding_dim] (peft/tuners/lora/layer.py Embedding.update_layer):
    lora_embedding_A [r, num_embeddings] and lora_embedding_B [embedding_dim, r], nn.Parameters in ParameterDicts."""
    module = p.name.rsplit(".", 1)[0]
    return [ParamInfo(f"{module}.lora_embedding_A.default", (rank, p.shape[0]), dtype, "ParameterDict", None, None),
            ParamInfo(f"{module}.lora_embedding_B.default", (p.shape[1], rank), dtype, "ParameterDict", None, None)]


def _lora_targeted(anatomy: ModelAnatomy, targets: str) -> tuple[set[str], set[str]]:
    """The weights --lora-targets adapts: the decoder layers' linears so named (or every one: all-linear), the
    lm_head and the input embeddings when named (by their module's own name: embed_tokens, peft's suffix match);
    under "re:PATTERN" those whose module's full name re.fullmatch-es it (peft's check_target_module_exists on a
    string target_modules), which must lie in the decoder layers or be the lm_head or an input embedding. Returns
    the linears' weights and the embeddings' weights adapted."""
    pattern = lora_target_regex(targets)
    layers = {p.name: p for p in anatomy.params if p.name.endswith(".weight") and p.layer_index is not None
              and p.module_kind in MATMUL_KINDS}
    heads = {p.name: p for p in anatomy.params if is_lm_head(p) and len(p.shape) == 2}
    embeds = {p.name: p for p in anatomy.params if p.layer_index is None and is_embedding(p) and len(p.shape) == 2
              and p.name.endswith(".weight")}
    if pattern is not None:
        modules = {p.name.rsplit(".", 1)[0] for p in anatomy.params if re.fullmatch(pattern, p.name.rsplit(".", 1)[0])}
        weight_of = {n.rsplit(".", 1)[0]: n for n in (*layers, *(h for h in heads if h.startswith("lm_head")),
                                                       *embeds)}
        outside = sorted(modules - set(weight_of))
        if outside:      # a norm, a vision block: peft adapts or refuses it, llmem models neither
            raise LlmemError(f"--lora-targets {targets} matches {outside[0]}, not a linear of the decoder layers, "
                             "the lm_head nor an input embedding (which llmem adapts); narrow the pattern")
        found = {weight_of[m] for m in modules}
        if not found:
            raise LlmemError(f"--lora-targets {targets} matches no linear module of {anatomy.name} (peft "
                             "re.fullmatch-es the whole name, e.g. model.layers.0.self_attn.q_proj)")
        return found - set(embeds), found & set(embeds)
    wanted = set(lora_target_names(targets))
    if not wanted:
        raise LlmemError("--lora-targets is empty: give module names (e.g. q_proj,v_proj) or all-linear")
    short = {n: n.rsplit(".", 2)[-2] for n in (*layers, *embeds)}
    found = {n for n in layers if LORA_ALL_LINEAR in wanted or short[n] in wanted}
    found |= set(heads) if "lm_head" in wanted else set()
    embedded = {n for n in embeds if short[n] in wanted}      # peft's all-linear leaves the embeddings alone
    missing = wanted - {short[n] for n in found | embedded if n in short} - ({"lm_head"} if heads else set()) \
        - {LORA_ALL_LINEAR}
    if missing:
        names = sorted({short[n] for n in layers})
        embedding = f"; its input embedding {', '.join(sorted(short[n] for n in embeds))}" if embeds else ""
        raise LlmemError(f"--lora-targets {', '.join(sorted(missing))} not found in {anatomy.name}: "
                         f"its layers' linear modules are {', '.join(names)} (or use all-linear){embedding}")
    return found, embedded


PEFT_CONFIG_MAX_BYTES = 1 << 20     # adapter_config.json files are a few KiB


def read_peft_config(path: str) -> tuple[str, dict]:
    """--peft-config PATH (a folder holding adapter_config.json, or the json file) -> (its text, its fields)."""
    p = Path(os.path.expanduser(path))
    try:
        if p.is_dir():
            p = p / "adapter_config.json"
            if not p.is_file():
                raise LlmemError(f"--peft-config folder {path} has no adapter_config.json")
        elif not p.is_file():
            raise LlmemError(f"--peft-config {path} does not exist (give an adapter_config.json or its folder)")
        if p.stat().st_size > PEFT_CONFIG_MAX_BYTES:
            raise LlmemError(f"--peft-config {p} is {p.stat().st_size:,} bytes: not an adapter_config.json (those "
                             f"are a few KiB)")
        text = p.read_text(encoding="utf-8")
    except OSError as exc:      # a name too long for the file system, a file that cannot be read
        raise LlmemError(f"--peft-config {path[:120]}: {exc.strerror or first_line(exc)}; give an "
                         "adapter_config.json or its folder") from None
    except UnicodeDecodeError as exc:
        raise LlmemError(f"--peft-config {p} is not UTF-8 text (byte {exc.start}): give an adapter_config.json "
                         "written by peft") from None
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
    if fields.get("progressbar"):         # FRoD's tqdm over its projections: a display setting
        fields["progressbar"] = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return PeftConfig.from_peft_type(**fields)
    except ImportError as exc:      # AdaMSS's config: "scikit-learn is required for AdaMSS. Please install it ..."
        raise LlmemError(f"peft's {fields.get('peft_type')} needs a package that is not installed: "
                         f"{first_line(exc, 200)}") from None
    except (TypeError, ValueError, KeyError) as exc:
        first = first_line(exc)
        raise LlmemError(f"peft cannot read this config ({fields.get('peft_type')}): {first[:200]}") from None


def apply_peft_config(model, text: str, autocast_adapter_dtype: bool):
    """get_peft_model(model, config) on the (meta) model: the adapters and the trainable set as peft makes them.
    A config whose initialisation reads the base weights' values is built data-free (llmem.model.peft_data_free;
    the model's DATA_FREE_ATTR says so)."""
    config = peft_config_from_text(text)
    try:
        return _get_peft_model(model, config, autocast_adapter_dtype, data_free=False)
    except ReadsWeightValues:
        pass
    # peft's own empty-weights build (its value-reading inits skip on meta adapters), SHiRA's mask on the host
    data_free_config(config)
    with data_free_build(_kind(config)):
        peft_model = _get_peft_model(model, config, autocast_adapter_dtype, data_free=True)
    setattr(peft_model, DATA_FREE_ATTR, f"peft type {_kind(config)}: {DATA_FREE_NOTE}")
    return peft_model


class ReadsWeightValues(LlmemError):
    """peft's initialisation of this config read the base weights' values (which the meta device has not)."""


def _get_peft_model(model, config, autocast_adapter_dtype: bool, data_free: bool):
    """peft's get_peft_model, its failures as one line (`data_free`: low_cpu_mem_usage, the adapters on meta)."""
    from peft import get_peft_model

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return get_peft_model(model, config, autocast_adapter_dtype=autocast_adapter_dtype,
                                  low_cpu_mem_usage=data_free)
    except ImportError as exc:      # e.g. AdaMSS: "scikit-learn is required for AdaMSS. Please install it with: ..."
        raise LlmemError(f"peft's {_kind(config)} needs a package that is not installed: {first_line(exc, 200)}") \
            from None
    except (ValueError, TypeError, KeyError, AttributeError, NotImplementedError, RuntimeError) as exc:
        first = first_line(exc)
        if "meta" in first or "incompatible tensor type" in first:
            # FRoD's projections, SHiRA's mask, LoRA's MiCA read the weights' values at get_peft_model
            raise ReadsWeightValues(f"peft's {_kind(config)} initialises its adapters from the base weights' values "
                             f"({first[:120]}); llmem builds models from shapes alone (the meta device) and "
                             "peft's data-free build (low_cpu_mem_usage) reads them too: no estimate or trace for "
                             "this config") from None
        raise LlmemError(f"peft cannot apply this {_kind(config)} config to the model: {first[:200]}") from None


def _kind(config) -> str:
    """A peft config's type as peft names it (PeftType.LORA -> LORA)."""
    return str(getattr(config.peft_type, "value", config.peft_type))


def host_index_tensors(model) -> list[tuple[str, object, str]]:
    """(name, tensor, the module's class name) of the real tensors peft's tuner layers hold in the plain dicts named in their
    `other_param_names`: FourierFT's `indices`, WaveFT's `waveft_indices`, SHiRA's `shira_indices` (made on the host
    at get_peft_model; peft/tuners/tuners_utils.py `_move_adapter_to_device_of_base_layer` moves only ModuleDict /
    ParameterDict / BufferDict). On the GPU each forward copies them to the base's device (FourierFT, WaveFT: the
    copies kept by index_put's backward, all layers' alive at the peak) or keeps the copy (SHiRA's
    `get_delta_weight`): the estimate counts them as buffers of their module, the trace allocates their copies
    (llmem.runtime.adapter_host_tensors)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    out: list[tuple[str, object, str]] = []
    for module_name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        for attr in getattr(module, "other_param_names", ()):
            held = module.__dict__.get(attr)
            for key, t in (held.items() if isinstance(held, dict) else ()):
                if getattr(t, "device", None) is not None and t.device.type != "meta" \
                        and type(t).__name__ != "FakeTensor" and hasattr(t, "untyped_storage"):
                    out.append((f"{module_name}.{attr}.{key}", t, type(module).__name__))
    return out


def tuner_buffers(peft_model, seen: set[int]) -> tuple[ParamInfo, ...]:
    """The buffers peft's tuner registers on itself, outside the base model (FRoD's projections shared per target
    category: FrodModel's frod_V [in, in], frod_s_indices [2, nnz], frod_s_size [2], peft/tuners/frod/model.py
    `_init_frod_projections`; model.to(device) moves them with the model), as frozen rows named from the tuner
    (base_model.frod_V...) outside the decoder layers; `seen`: ids of the buffers already listed (updated)."""
    tuner = peft_model.base_model
    out: list[ParamInfo] = []
    for module_name, module in tuner.named_modules(prefix="base_model"):
        for bname, b in module.named_buffers(recurse=False):
            if b is None or id(b) in seen:
                continue
            seen.add(id(b))
            out.append(ParamInfo(f"{module_name}.{bname}", tuple(b.shape), str(b.dtype).replace("torch.", ""),
                                 type(module).__name__, None, None, False))
    return tuple(out)


# the BufferDicts of peft's tuners whose values the forward reads on the host: FRoD's frod_s_size (`.tolist()` of
# the sparse S's size every forward, peft/tuners/frod/layer.py `_get_frod_tensors`); kept real in the fake step
HOST_READ_BUFFERS = ("frod_s_size",)
# the BufferDicts whose values peft's forward depends on: FRoD's sparse S, its size and its positions (frod/model.py:
# a seeded randperm of the off-diagonal ones); a model materialised for a real step keeps peft's values
VALUED_BUFFERS = (*HOST_READ_BUFFERS, "frod_s_indices")
# the BufferDicts of peft's tuners made in the base layer's dtype: FRoD's U per module and V per target category
# (peft/tuners/frod/layer.py update_layer `U.to(dtype)`, dtype the base weight's; frod/model.py
# `v_matrix.to(dtype=example_weight.dtype)`): stored as the frozen base is (TrainingSetup.stored_bytes)
BASE_DTYPE_BUFFERS = ("frod_U", "frod_V")


# per peft type, the adapter parts one decoder layer holds for every layer that each layer's tuner layer reads through
# a view of the weight: Lily's lily_B (peft/tuners/lily/layer.py forward: `lily_B.weight.reshape(num_B, -1, ...)`),
# which autocast casts at every use (its cast cache keeps the casts of leaf tensors only, aten/src/ATen/
# autocast_mode.cpp cached_cast), so every layer makes its own copy, read with the learned layer; Lily's lily_A is
# called as a module: its leaf weight's copy is cached from the first layer on, as the schedule lays it out
VIEW_READ_PARTS = {"LILY": ("lily_B",)}


def view_read_part(anatomy: ModelAnatomy, p: ParamInfo) -> bool:
    """Whether `p` is one of the VIEW_READ_PARTS of the anatomy's peft type."""
    parts = VIEW_READ_PARTS.get(anatomy.peft.peft_type, ()) if anatomy.peft is not None else ()
    return any(f".{part}." in p.name for part in parts)


def host_offloaded_weights(model) -> list[str]:
    """The base weights (names in `model`, a peft model or its base) peft keeps on the host while training: FRoD's
    runtime_offload_base_weight (peft/tuners/frod/layer.py Linear: `_apply` moves the adapted module's base weight
    back to the host after every model.to(), `forward` before it rebuilds the adapted weight from U, S, V) where the
    forward skips the base layer (one adapter, no dropout: `skip_base_layer`; with frod_dropout the forward moves
    the weight to the device, where it stays)."""
    from torch import nn

    out = []
    for name, module in model.named_modules():
        offload = getattr(module, "runtime_offload_base_weight", None)
        dropouts = getattr(module, "frod_dropout", None)
        if isinstance(offload, dict) and any(offload.values()) and isinstance(dropouts, nn.ModuleDict) \
                and all(isinstance(d, nn.Identity) for d in dropouts.values()):
            out.append(f"{name}.base_layer.weight")
    return out


def buffer_dicts(model, names: tuple[str, ...]) -> list[tuple[object, str, object]]:
    """(module, key, tensor) of the buffers held by the modules of `model` (a peft model) named `names` or under
    one (FrodModel.frod_s_size is a ModuleDict of a BufferDict per target category)."""
    return [(module, key, b) for name, module in model.named_modules() if any(n in names for n in name.split("."))
            for key, b in module._buffers.items() if b is not None]


def valued_buffers(model) -> list[tuple[object, str, object]]:
    """buffer_dicts of VALUED_BUFFERS."""
    return buffer_dicts(model, VALUED_BUFFERS)


def host_read_buffers(model) -> list[tuple[object, str, object]]:
    """buffer_dicts of HOST_READ_BUFFERS."""
    return buffer_dicts(model, HOST_READ_BUFFERS)


def buffer_bytes(b: ParamInfo, setup: TrainingSetup) -> int:
    """Bytes of an adapter's buffer (ModelAnatomy.buffers) on the device: its own dtype's (the anatomy is built
    on a bf16 base), or the frozen base's where peft makes it in the base layer's dtype (BASE_DTYPE_BUFFERS)."""
    if any(part in BASE_DTYPE_BUFFERS for part in b.name.split(".")):
        return b.numel * setup.stored_bytes(False)
    return b.own_bytes


def _peft_name(name: str) -> str:
    """peft's wrapper names -> the base model's names (q_proj.base_layer.weight -> q_proj.weight)."""
    return name.replace(".base_layer.", ".")


@lru_cache(maxsize=32)
def peft_anatomy(model: str, trust_remote_code: bool, config_text: str, upcast: bool = True) -> ModelAnatomy:
    """The anatomy of the peft model peft builds from this config on the meta device (cached per model, config
    text and `upcast`, peft's autocast_adapter_dtype: the planner estimates many set-ups of one model; kept on disk
    too, llmem.model.anatomy_cache, so that another process reads it without torch)."""

    def build() -> ModelAnatomy:
        return _built_peft_anatomy(model, trust_remote_code, config_text, upcast)

    # (buffers: cached anatomies from before the adapters' buffers were read are not taken for these)
    # (peft_read 2: peft's host index tensors among the buffers, LoRA variants and data-free builds told apart;
    # 3, 4: the buffers a tuner registers on itself, the host parameters and their note, FRoD's)
    return read_or_build(model, trust_remote_code, build, shipped=False, upcast=upcast, buffers=True, peft_read=4,
                         peft_config_sha256=hashlib.sha256(config_text.encode()).hexdigest())


def _built_peft_anatomy(model: str, trust_remote_code: bool, config_text: str, upcast: bool) -> ModelAnatomy:
    """peft_anatomy built: the base is cast to bf16 first, so the dtypes peft gives the trained parameters are those
    of a low-precision base (LOW_DTYPE's rule)."""
    import torch

    name, cfg = resolve_config(model, trust_remote_code)
    base_model = build_meta_model(cfg, trust_remote_code).to(torch.bfloat16)
    own_buffers = {id(b) for b in base_model.buffers()}
    peft_model = apply_peft_config(base_model, config_text, upcast)
    base = peft_model.get_base_model()
    anatomy = inventory(base, name)
    buffers = tuple(replace(b, name=_peft_name(b.name))
                    for b in added_buffers(base, own_buffers, extra=host_index_tensors(base))) \
        + tuner_buffers(peft_model, own_buffers)
    grad: dict[str, bool] = {}
    seen: set[int] = set()
    for module_name, module in base.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            grad.setdefault(f"{module_name}.{pname}" if module_name else pname, p.requires_grad)
            seen.add(id(p))
    host = {_peft_name(n) for n in host_offloaded_weights(base)}
    params = [replace(p, name=_peft_name(p.name), trainable=grad[p.name],
                      tied_to=_peft_name(p.tied_to) if p.tied_to else None) for p in anatomy.params]
    host_params = tuple(p for p in params if p.name in host)
    params = [p for p in params if p.name not in host]
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
    data_free = data_free_note(peft_model)
    # a data-free build (LoRA's MiCA freezes lora_B) is learned from the real code, not the hand recipe
    # LoRA's variants other than DoRA (BD-LoRA's block-diagonal factors, aLoRA, ...: peft's LoraLayer.lora_variant
    # per adapter, DoRA's among them when use_dora) have no hand model either
    variants = {type(v) for m in base.modules() for v in (getattr(m, "lora_variant", None) or {}).values()}
    exact = (peft_type in PEFT_EXACT_TYPES and not (use_dora and lora_dropout > 0) and data_free is None
             and len(variants) <= int(use_dora))
    per_layer = {sum(1 for p in params if p.layer_index == i and p.trainable) for i in range(anatomy.num_layers)}
    if exact and len(per_layer) > 1:
        exact = False
        notes.append("peft adapts the decoder layers unevenly (layers_to_transform / patterns): activations are "
                     "modelled from layer 0")
    if not exact and not notes:
        kind = "DoRA with lora_dropout" if use_dora else peft_type
        notes.append(f"peft type {kind}: trainable set from peft itself; no hand-written activation model (the "
                     "estimate learns them from peft's real code, llmem.runtime.learn)")
    if data_free is not None:
        notes.append(data_free)
    if host_params:      # FRoD's runtime_offload_base_weight (host_offloaded_weights)
        notes.append(f"peft type {peft_type}: runtime_offload_base_weight keeps the base weights of the "
                     f"{len(host_params)} adapted modules ({sum(p.numel for p in host_params):,} parameters) on the "
                     "host while training: not counted on the GPU")
    if json.loads(config_text).get("prompt_tuning_init") == "TEXT":
        notes.append("prompt_tuning_init TEXT needs a tokenizer: RANDOM initialisation used (same memory)")
    info = PeftInfo(peft_type, lora_dropout=lora_dropout, use_dora=use_dora,
                    num_virtual_tokens=int(getattr(config, "num_virtual_tokens", 0) or 0)
                    if peft_type == "PROMPT_TUNING" else 0, exact=exact, notes=tuple(notes))
    return replace(anatomy, params=tuple(params), tied_names=tuple(_peft_name(n) for n in anatomy.tied_names),
                   peft=info, buffers=buffers, host_params=host_params)
