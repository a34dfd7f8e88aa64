"""Training configs users already have, read into a TrainingSetup (`llmem estimate / plan / trace --from FILE`,
`llmem.setup_from_file`): axolotl, LLaMA-Factory, ms-swift, TRL / TrainingArguments and torchtune YAML, accelerate
config YAML, DeepSpeed JSON (alone or referenced) and torchtitan TOML. The format is told from the content (READERS, in order:
the first whose `detect` accepts the mapping), one module per framework; every key used or ignored is recorded
(record.SourceRecord) and command-line fields override the file's.

Several files read together (a training config and the accelerate config it is launched with) merge in order,
accelerate configs first: a later file's fields win, and the training config says what the script loads."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llmem.errors import LlmemError
from llmem.setup.checkpointing import reentrant_refusal
from llmem.setup.deepspeed import ZERO_FIELDS
from llmem.setup.gpus import resolve_gpu
from llmem.setup.job_phases import LOAD_PATHS, SAVE_KINDS, phase_family
from llmem.setup.layout import DEFAULT_GPUS_PER_NODE
from llmem.setup.local_gpus import local_gpus
from llmem.setup.methods import METHODS, canonical_method
from llmem.setup.quant_bases import quant_base_spec
from llmem.setup.sources import accelerate, axolotl, llamafactory, ms_swift, torchtitan, torchtune, trl
from llmem.setup.sources.deepspeed import STAGE_NOTES, STANDIN_NOTE, STANDINS, read_deepspeed
from llmem.setup.sources.files import load
from llmem.setup.sources.fsdp import FSDP1_NOTE
from llmem.setup.sources.reading import Dtypes, Keys, Reading, resolve_precision
from llmem.setup.sources.record import FileSetup, Ignored, SourceRecord, Used
from llmem.setup.support import (
    CKPT_OFFLOAD,
    COMPILE,
    DEEPSPEED,
    FLOAT8,
    FUSED_CE,
    LIGER,
    OUTPUT_CHUNKS,
    check_support,
    feature_refusal,
)
from llmem.setup.training import TrainingSetup, user_setup

__all__ = ["READERS", "FileSetup", "SourceRecord", "detect_format", "setup_from_file"]


@dataclass(frozen=True)
class Context:
    text: str               # the file as written (torchtune's launch line is a comment)
    bf16_capable: bool      # the GPU runs bf16 (axolotl's bf16: auto)


@dataclass(frozen=True)
class Reader:
    name: str
    title: str
    detect: Callable[[dict], bool]
    read: Callable[[Keys, Reading, Context], None]


def _deepspeed_alone(keys: Keys, r: Reading, ctx: Context) -> None:
    read_deepspeed(r, keys.data, r.file, None)


def _is_deepspeed(data: dict) -> bool:
    return "zero_optimization" in data or "train_micro_batch_size_per_gpu" in data


READERS: dict[str, Reader] = {rd.name: rd for rd in (
    Reader("torchtune", "torchtune recipe YAML", torchtune.detect, lambda k, r, c: torchtune.read(k, r, c.text)),
    Reader("torchtitan", "torchtitan TOML", torchtitan.detect, lambda k, r, c: torchtitan.read(k, r)),
    Reader("deepspeed", "DeepSpeed JSON", _is_deepspeed, _deepspeed_alone),
    Reader("accelerate", "accelerate config YAML", accelerate.detect, lambda k, r, c: accelerate.read(k, r)),
    Reader("axolotl", "axolotl YAML", axolotl.detect, lambda k, r, c: axolotl.read(k, r, c.bf16_capable)),
    Reader("llamafactory", "LLaMA-Factory YAML", llamafactory.detect, lambda k, r, c: llamafactory.read(k, r)),
    Reader("ms-swift", "ms-swift YAML", ms_swift.detect, lambda k, r, c: ms_swift.read(k, r)),
    Reader("trl", "TRL / TrainingArguments YAML or JSON", trl.detect, lambda k, r, c: trl.read(k, r)),
)}
EXPECTED = ("an axolotl, LLaMA-Factory, ms-swift, TRL / TrainingArguments, torchtune or accelerate YAML, a DeepSpeed "
            "JSON or a torchtitan TOML")


@dataclass(frozen=True)
class UnreadSchema:
    """A framework's config llmem has no reader for, told by keys only its schema has: refused by name rather
    than read with another framework's defaults (most of these also carry TrainingArguments' keys)."""
    name: str
    any_of: tuple[str, ...]          # one of these keys marks it
    all_of: tuple[str, ...] = ()     # ... together with all of these

    def matches(self, data: dict) -> bool:
        return any(k in data for k in self.any_of) and all(k in data for k in self.all_of)


UNREAD_SCHEMAS = (
    # LLaMA-Factory's v1 schema (llamafactory/v1/config): ModelArguments.model (and model_class, template), its
    # plugin configs (dist_config, peft_config, kernel_config, ...) and DataArguments.train_dataset
    UnreadSchema("a LLaMA-Factory v1 config", ("dist_config", "peft_config", "optim_config", "kernel_config",
                                               "train_dataset", "model_class"), ("model",)),
)


def detect_format(path: Path, data: dict) -> str:
    for schema in UNREAD_SCHEMAS:
        if schema.matches(data):
            raise LlmemError(f"{path}: {schema.name}, which llmem does not read (answering it with another "
                             "framework's defaults would misread it): give the set-up with flags (llmem estimate "
                             "MODEL --lora-rank ... --gpus ...)")
    for reader in READERS.values():
        if reader.detect(data):
            return reader.name
    keys = ", ".join(list(map(str, data))[:6]) + (", ..." if len(data) > 6 else "")
    raise LlmemError(f"{path}: not a training config llmem reads (its keys: {keys}); expected {EXPECTED}")


def read_file(path: str | os.PathLike, bf16_capable: bool = True) -> Reading:
    p, data = load(path)
    fmt = detect_format(p, data)
    r = Reading(p, fmt)
    READERS[fmt].read(Keys(data), r, Context(p.read_text(encoding="utf-8"), bf16_capable))
    return r


def setup_from_file(paths: str | os.PathLike | Sequence[str | os.PathLike], **overrides: Any) -> FileSetup:
    """The TrainingSetup the config(s) describe, `overrides` (TrainingSetup fields, the command line's flags) over
    the files' values, and the record of what each key became."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
        raise LlmemError("--from needs a file")
    gpu = resolve_gpu(overrides.get("gpu", "A100-80GB"), overrides.get("gpu_memory"))
    readings = [read_file(p, gpu.compute_capability >= (8, 0)) for p in paths]
    readings.sort(key=lambda r: r.format != "accelerate")
    return build(readings, overrides)


def build(readings: list[Reading], overrides: dict[str, Any]) -> FileSetup:
    values: dict[str, Any] = {}
    used: list[Used] = []
    ignored: list[Ignored] = []
    notes: list[str] = []
    files: list[tuple[str, str]] = []
    d = Dtypes()
    method, multi, gpus, per_node = None, "ddp", None, None
    for r in readings:
        values.update(r.values)
        used += r.used
        ignored += [i for i in r.ignored if i.settled_by not in overrides]
        notes += [n for n in r.notes if n not in notes]
        files += [(str(r.path), r.format)] + r.files
        d = _merge(d, r.dtypes)
        method = r.method or method
        multi = r.multi_gpu_method if r.format != "accelerate" else multi
        gpus = r.gpus or gpus
        per_node = r.gpus_per_node or per_node
    main = readings[-1]
    _precision(main, values, used, notes, d)
    if method is not None:
        values["method"] = method
    if gpus is not None:
        values["gpus"] = gpus
    if per_node is not None:
        values["gpus_per_node"] = per_node
    overridden = tuple(sorted(k for k, v in overrides.items() if k in values and values[k] != v))
    for given, other in (("steps_per_generation", "generation_batch_size"),
                         ("generation_batch_size", "steps_per_generation")):
        if overrides.get(given) is not None and other not in overrides:    # TRL's two spellings: the flag's wins
            values.pop(other, None)
    values.update(overrides)
    _check_gpus(main, values, multi, used, notes)
    _nothing_left_to_shard(main, values, used, overrides)
    _offload_not_expressed(values, used, ignored)
    _vision_without_images(values, used, ignored)
    _reentrant_not_expressed(values, used, ignored, notes)
    _phases_not_expressed(values, used, ignored, overrides)
    if "model" not in values:
        raise LlmemError(f"{main.path}: names no model llmem can read; give MODEL on the command line "
                         f"(llmem estimate MODEL --from {main.path})")
    used = _marked(used, overrides)
    try:
        setup = _stand_in(user_setup(**values), values, overrides, notes)
        setup = _kernels_not_expressed(setup, used, ignored, overrides)
        check_support(setup, METHODS[setup.method])
    except LlmemError as exc:
        why = "".join(f" ({n})" for n in notes if n.startswith("DeepSpeed"))
        raise LlmemError(f"{main.path}: llmem cannot run the set-up it describes: {exc}{why}") from None
    return FileSetup(setup, SourceRecord(tuple(files), tuple(used), tuple(ignored), tuple(notes), overridden,
                                         states_method=method is not None))


def _stand_in(setup: TrainingSetup, values: dict[str, Any], overrides: dict[str, Any],
              notes: list[str]) -> TrainingSetup:
    """The file's DeepSpeed ZeRO with what llmem does not model under DeepSpeed's engine (a quantised base, an
    8-bit or composite optimizer): its PyTorch equivalent stands in, said so; a method given on the command line
    stays as given (and is refused)."""
    why = feature_refusal(DEEPSPEED, setup, METHODS[setup.method])
    if why is None or "method" in overrides or setup.method not in STANDINS:
        return setup
    notes[:] = [n for n in notes if n not in STAGE_NOTES.values()]
    notes.append(STANDIN_NOTE.format(standin=STANDINS[setup.method], method=setup.method, why=why))
    kept = {k: v for k, v in values.items() if k not in ZERO_FIELDS}    # DeepSpeed's knobs: not the stand-in's
    return user_setup(**{**kept, "method": STANDINS[setup.method]})


def _kernels_not_expressed(setup: TrainingSetup, used: list[Used], ignored: list,
                           overrides: dict[str, Any]) -> TrainingSetup:
    """A file's Liger kernels, float8 linears, torch.compile, chunked output, fused loss or offloaded checkpoint where
    llmem does not model them with the rest of its set-up (adapters, a quantised base, DeepSpeed, tensor
    parallelism, ...): kept as ignored keys (what stands in said), not a refused set-up; one given on the command
    line stays (and is refused)."""
    for offs, row, stand_in in _KERNEL_CHOICES:
        why = feature_refusal(row, setup, METHODS[setup.method])
        if why is None or any(f in overrides for f in offs):
            continue
        for u in [u for u in used if u.field in offs]:
            used.remove(u)
            ignored.append(Ignored(u.file, u.key, u.raw, f"{why.split(':')[0]}: {stand_in}"))
        setup = replace(setup, **offs)
    return setup


PHASE_OF_FIELD = {"load_path": "loading", "save_kind": "saving"}

# (the fields and their off values, the support row saying why they are not modelled with the set-up, what stands
# in), in order
_KERNEL_CHOICES = (
    ({"liger": "none"}, LIGER, "HF's modules stand in for Liger's"),
    ({"float8": "none", "float8_all_gather": False}, FLOAT8, "bf16 linears stand in for Float8Linear"),
    ({"compile": False}, COMPILE, "the layers run eagerly in the estimate"),
    ({"output_chunks": 0}, OUTPUT_CHUNKS, "the whole logits and transformers' loss stand in (an upper bound)"),
    ({"fused_ce": False}, FUSED_CE, "the whole logits and transformers' loss stand in (an upper bound)"),
    ({"ckpt_offload": "none"}, CKPT_OFFLOAD, "torch's checkpoint, each layer's input kept on the device, stands in "
     "(an upper bound)"),
)


VISION_FIELDS = ("freeze_vision_tower", "freeze_projector", "freeze_language_model", "max_pixels", "image_size")


def _vision_without_images(values: dict, used: list[Used], ignored: list) -> None:
    """A file's vision-language switches (LLaMA-Factory's freeze_* and image_max_pixels, axolotl's image_size) apply
    to a step with images, which the data decides (--images-per-sample and --image-size on the command line): without images they
    are dropped, a default silently, a key the file writes as ignored with the fix."""
    if values.get("images_per_sample"):
        return
    for name in VISION_FIELDS:
        values.pop(name, None)
        for u in [u for u in used if u.field == name]:
            used.remove(u)
            if not u.key.endswith("(default)"):
                ignored.append(Ignored(u.file, u.key, u.raw, "a vision-language step's switch: give "
                                       "--images-per-sample N and --image-size HxW (the data's images) to apply "
                                       "it", approximates=False))


def _reentrant_not_expressed(values: dict, used: list[Used], ignored: list, notes: list[str]) -> None:
    """A file's reentrant checkpoint where llmem models only the non-reentrant one (TrainingSetup's
    _check_ckpt_reentrant), or where the framework turns it off itself (LLaMA-Factory under FSDP2, accelerate's
    fsdp_version 2: prepare_model_for_training sets use_reentrant_gc False; under FSDP1 it stays; ms-swift under plain
    DDP: _fix_gradient_checkpointing)."""
    if not values.get("ckpt_reentrant"):
        return
    if not values.get("grad_ckpt", True):      # --no-grad-ckpt over the file: no checkpoint, reentrant or not
        values.pop("ckpt_reentrant")
        used[:] = [u for u in used if u.field != "ckpt_reentrant"]
        return
    refused = reentrant_refusal(values.get)
    spec = METHODS[canonical_method(values.get("method", "single"))]
    fsdp2 = spec.shards_model_states and spec.zero_stage is None and FSDP1_NOTE not in notes
    plain_ddp = not spec.one_gpu and not spec.shards_model_states and spec.zero_stage is None
    for u in [u for u in used if u.field == "ckpt_reentrant"]:
        if u.key.startswith("use_reentrant_gc") and fsdp2:      # the run's own checkpoint: no approximation
            why, approximates = "LLaMA-Factory sets use_reentrant_gc False under FSDP2 (prepare_model_for_training)", False
        elif u.key == ms_swift.REENTRANT_DEFAULT and plain_ddp:
            why, approximates = ms_swift.DDP_NOTE, False
        elif refused is not None:
            why, approximates = (f"the reentrant checkpoint with {refused[0]} is not modelled ({refused[1]}): "
                                 "estimated as the non-reentrant one"), True
        else:
            continue
        values.pop("ckpt_reentrant", None)
        used.remove(u)
        if u.key.endswith("default)") and not approximates:    # a default the framework itself overrides
            used.append(Used(u.file, u.key, u.raw, "", None, why))
        else:
            ignored.append(Ignored(u.file, u.key, u.raw, why, approximates=approximates))


def _offload_not_expressed(values: dict, used: list[Used], ignored: list) -> None:
    """A file's FSDP parameter offload where llmem's --offload-param cannot take it: kept as an ignored key (the
    estimate then an upper bound), not a refused set-up."""
    if not values.get("offload_param"):
        return
    spec = METHODS[canonical_method(values.get("method", "single"))]
    if quant_base_spec(values.get("quant_base", "none")).host_offload_refusal(values.get("method", "")):
        why = "FSDP2's CPU offload of this quantised base is not modelled (its shard is copied through the tensor subclass)"
    elif not spec.shards_model_states and spec.zero_stage != 3:
        why = f"parameter offload belongs to FSDP2 (or ZeRO-3); {values.get('method')} keeps every parameter"
    else:
        return
    del values["offload_param"]
    for u in [u for u in used if u.field == "offload_param"]:
        used.remove(u)
        ignored.append(Ignored(u.file, u.key, u.raw, why + ": estimated with the parameters on the GPU (an upper "
                                                           "bound)"))


def _phases_not_expressed(values: dict, used: list[Used], ignored: list, overrides: dict[str, Any]) -> None:
    """A file's loading or saving choice (--load-path, --save-kind) where the set-up has no such phase (tensor
    parallelism, a quantised base, ...; llmem.setup.job_phases) or its method takes another: kept as a key with no
    effect on the step (the phase then not shown, or HF's default), not a refused set-up."""
    chosen = {f: values.pop(f) for f in ("load_path", "save_kind") if f in values and f not in overrides}
    if not chosen or "model" not in values:
        values.update(chosen)
        return
    try:
        setup = user_setup(**values)
    except LlmemError:
        values.update(chosen)      # the set-up's own refusal comes later, with them
        return
    family = phase_family(setup)
    for field, value in chosen.items():
        row = (LOAD_PATHS if field == "load_path" else SAVE_KINDS)[value]
        if family in row.families and (setup.peft or not row.peft_only):
            values[field] = value
            continue
        for u in [u for u in used if u.field == field]:
            used.remove(u)
            ignored.append(Ignored(u.file, u.key, u.raw, f"the job's {PHASE_OF_FIELD[field]} phase is not modelled "
                                   f"for this set-up ({setup.method}, its --{field.replace('_', '-')} {value}): the "
                                   "step's memory is unchanged", approximates=False))


def _merge(a: Dtypes, b: Dtypes) -> Dtypes:
    return Dtypes(b.compute or a.compute, b.weights or a.weights, b.adapters if b.adapters != "fp32" else a.adapters,
                  a.masters or b.masters, b.kbit_upcast if b.kbit_upcast is not None else a.kbit_upcast)


def _precision(r: Reading, values: dict, used: list[Used], notes: list[str], d: Dtypes) -> None:
    """--precision, --adapter-dtype and --no-kbit-upcast from the merged dtype facts."""
    peft = bool(values.get("lora_rank") or values.get("peft_config"))
    quant = values.get("quant_base", "none")
    if d.compute is None:
        used.append(Used(r.file, "(precision)", "auto", "", None, "the trainer fills fp16 / bf16: llmem's "
                         "--precision decides (default bf16-mixed)"))
        return
    precision, adapter_dtype = resolve_precision(d, peft)
    trained = "fp32 masters" if d.masters else f"{d.adapters} adapters" if peft else f"{d.weights or d.compute} weights"
    how = f"{d.compute} compute, model loaded in {d.weights or d.compute}, trained parameters: {trained}"
    values["precision"] = precision
    used.append(Used(r.file, "(precision)", how, "precision", precision))
    if peft:
        values["adapter_dtype"] = adapter_dtype
        if adapter_dtype == "base":
            used.append(Used(r.file, "(adapters)", "the base's dtype", "adapter_dtype", "base"))
        if d.weights == "fp32" and d.compute != "fp32" and not quant_base_spec(quant).quantised:
            notes.append(f"the frozen base loads in fp32 ({r.format}'s dtype) under {d.compute} autocast: llmem holds "
                         "a LoRA's frozen base in the compute dtype, so its bytes are half what this run holds; load "
                         "the model in bf16 to match")
    if quant_base_spec(quant).kbit_prep:        # torchao's NF4 base has no upcast step (kbit_upcasts)
        upcast = bool(d.kbit_upcast) or d.weights == "fp32"
        values["kbit_upcast"] = upcast
        why = ("peft's prepare_model_for_kbit_training upcasts them" if d.kbit_upcast else
               "they load in fp32" if upcast else "nothing upcasts them")
        used.append(Used(r.file, "(quantised base)", quant, "kbit_upcast", upcast, f"the unquantised frozen "
                         f"parameters: {why}"))


def _check_gpus(r: Reading, values: dict, multi: str, used: list[Used], notes: list[str]) -> None:
    """The GPU count: the file's, else (a multi-GPU method whose count the launcher decides) this machine's GPUs,
    else one node of DEFAULT_GPUS_PER_NODE, said in a note."""
    gpus = values.get("gpus")
    if "method" not in values:
        values["method"] = multi if (gpus or 1) > 1 else "single"
    spec = METHODS[canonical_method(values["method"])]
    if not spec.one_gpu and gpus is None:
        local = len(local_gpus())
        values["gpus"] = local if local > 1 else DEFAULT_GPUS_PER_NODE
        where = f"this machine's {local} GPUs" if local > 1 else f"one node of {DEFAULT_GPUS_PER_NODE} GPUs"
        used.append(Used(r.file, "(launcher)", "not in the file", "gpus", values["gpus"], where))
        notes.append(f"{r.file} runs {values['method']} on several GPUs and leaves their number to the launcher: "
                     f"estimated on {where}; give --gpus N for yours")


def _nothing_left_to_shard(r: Reading, values: dict, used: list[Used], overrides: dict) -> None:
    """torchtitan's data_parallel_shard_degree -1 takes the GPUs TP, PP and CP leave; none left (dp 1), FSDP2 is
    not applied (ParallelDims: dp_shard_enabled False) and the layout is TP alone."""
    tp, others = values.get("tp") or 1, (values.get("pp") or 1) * (values.get("cp") or 1)
    if r.shard_rest and values.get("method") == "fsdp+tp" and values["gpus"] == tp * others:
        values["method"] = "tp"
        used.append(Used(r.file, "data_parallel_shard_degree", -1, "method", "tp",
                         f"no GPU left to shard over ({values['gpus']} GPUs = tp {tp}"
                         + (f" x pp / cp {others}" if others > 1 else "") + "): TP alone"))
        if r.no_fsdp_precision and "precision" not in overrides:     # no FSDP2, no mixed precision
            values["precision"] = r.no_fsdp_precision
            used.append(Used(r.file, "training.dtype", r.no_fsdp_precision, "precision", r.no_fsdp_precision,
                             "TP without FSDP2 trains in it (maybe_enable_amp: no autocast)"))



def _marked(used: list[Used], overrides: dict[str, Any]) -> list[Used]:
    """Entries whose field a later entry or the command line set again, marked so."""
    last = {u.field: i for i, u in enumerate(used) if u.field}
    out = []
    for i, u in enumerate(used):
        if u.field in overrides and overrides[u.field] != u.value:
            u = replace(u, note=f"overridden by the command line: {overrides[u.field]}")
        elif u.field and last[u.field] != i and used[last[u.field]].value != u.value:
            later = used[last[u.field]]
            u = replace(u, note=f"superseded by {later.file}: {later.key}")
        out.append(u)
    return out
