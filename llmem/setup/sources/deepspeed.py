"""DeepSpeed on the set-up floor's config readers: a DeepSpeed JSON read into the set-up (--from).

A DeepSpeed JSON, alone or referenced from a trainer's config (`deepspeed:` in TrainingArguments, axolotl and
LLaMA-Factory; `deepspeed_config_file` in an accelerate config), with its "auto" values filled as the trainer fills
them, and what DeepSpeed itself would refuse.

"auto" is filled as transformers' HfTrainerDeepSpeedConfig.trainer_config_process / trainer_config_finalize do
(transformers/integrations/deepspeed.py) under HF Trainer: the micro-batch, gradient accumulation and train batch
from TrainingArguments (a value that is not "auto" must match, or the Trainer raises), fp16/bf16.enabled from
args.fp16 / args.bf16, and the three hidden-size keys from the model's hidden_size (reduce_bucket_size = h*h,
stage3_prefetch_bucket_size = int(0.9*h*h), stage3_param_persistence_threshold = 10*h). Under accelerate
(DeepSpeedPlugin.set_mixed_precision, accelerate/utils/dataclasses.py) fp16/bf16.enabled follow `mixed_precision`
and gradient_accumulation_steps the plugin's. A JSON read alone leaves "auto" to the trainer: llmem's own flags.

ZeRO stages 1-3 become llmem's ds-zero1/2/3 (DeepSpeed's engine as it runs: llmem.estimator.deepspeed) and their
buffer keys the set-up's DeepSpeed fields ("auto" kept as "auto": resolved from the model's hidden size as HF fills
it); stage 0 is modelled by ddp. Where llmem does not model DeepSpeed's engine (a quantised base, an 8-bit or
composite optimizer) the FSDP2 / DDP equivalent stands in (STANDINS), with a note."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from llmem.setup.deepspeed import HIDDEN_SIZE_RULES, ZERO_FIELDS
from llmem.setup.sources.names import NameRow
from llmem.setup.sources.reading import Keys, Reading

AUTO = "auto"
GA_NOTE = ("no memory effect in llmem's model: one micro-batch per step (the gradients held across micro-batches "
           "are not modelled)")
STAGE_METHODS = {3: "ds-zero3", 2: "ds-zero2", 1: "ds-zero1", 0: "ddp"}
STAGE_NOTES = {
    3: "DeepSpeed ZeRO-3 as DeepSpeed's engine runs it (ds-zero3)",
    2: "DeepSpeed ZeRO-2 as DeepSpeed's engine runs it (ds-zero2)",
    1: "DeepSpeed ZeRO-1 as DeepSpeed's engine runs it (ds-zero1)",
    0: "DeepSpeed ZeRO-0 (data parallel) is modelled by ddp",
}
# where llmem does not model DeepSpeed's engine (a quantised base): the FSDP2 / DDP equivalent and why
STANDINS = {"ds-zero3": "fsdp", "ds-zero2": "zero2", "ds-zero1": "ddp"}
STANDIN_NOTE = ("DeepSpeed's engine is not modelled for this set-up ({why}): its PyTorch equivalent {standin} "
                "stands in for {method}")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
HIDDEN_SIZE_KEYS = {     # trainer_config_finalize's hidden-size "auto" keys: h -> value
    "zero_optimization.reduce_bucket_size": ("hidden_size*hidden_size", lambda h: h * h),
    "zero_optimization.stage3_prefetch_bucket_size": ("int(0.9*hidden_size*hidden_size)", lambda h: int(0.9 * h * h)),
    "zero_optimization.stage3_param_persistence_threshold": ("10*hidden_size", lambda h: 10 * h),
}
# zero_optimization keys -> the set-up's DeepSpeed fields (stage3_* and their aliases, as DeepSpeedZeroConfig reads)
BUFFER_FIELDS = {
    "reduce_bucket_size": "reduce_bucket_size", "overlap_comm": "overlap_comm", "sub_group_size": "sub_group_size",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size", "prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "param_persistence_threshold": "param_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters", "max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance", "max_reuse_distance": "max_reuse_distance",
}
# read and not modelled, with why
# the BUFFER_IGNORED keys with no effect on memory as DeepSpeed runs them (the others set what llmem models at the
# default, an approximation where the file departs from it)
BUFFER_NO_EFFECT = ("allgather_bucket_size", "reduce_scatter", "allgather_partitions", "round_robin_gradients")
# ... and the value llmem models for the others (DeepSpeedZeroConfig's default): a file that gives it is read exactly
BUFFER_MODELLED_VALUE = {"contiguous_gradients": True}
BUFFER_IGNORED = {
    "allgather_bucket_size": "no buffer of its size: the post-step all-gather writes into the flat buffer "
                             "(all_gather_into_tensor, deepspeed/runtime/utils.py)",
    "contiguous_gradients": "modelled as DeepSpeed's default (true)",
    "reduce_scatter": "the reduction's collective, not its buffers",
    "allgather_partitions": "the all-gather's collective, not its buffers",
    "round_robin_gradients": "the order of the partitions' gradients, not their size",
    "stage3_model_persistence_threshold": "modelled as DeepSpeed's default (no cap on persistent parameters)",
    "model_persistence_threshold": "modelled as DeepSpeed's default (no cap on persistent parameters)",
}
# the top-level keys read and not modelled that change memory (the others listed beside them have no GPU effect)
APPROXIMATING_TOP_KEYS = ("compile", "gradient_clipping")
# DeepSpeed's optimizer block (deepspeed/runtime/engine.py _configure_basic_optimizer)
DS_OPTIMIZERS = {
    "adamw": NameRow("adamw-fused", "DeepSpeed's FusedAdam (multi-tensor CUDA kernel, no step temporaries), modelled by "
                     "torch AdamW(fused=True)"),
    "adam": NameRow("adamw-fused", "DeepSpeed's FusedAdam, modelled by torch AdamW(fused=True)"),
}


@dataclass(frozen=True)
class TrainerValues:
    """What fills a DeepSpeed JSON's "auto" values: the referencing trainer's (None: not stated there)."""
    source: str                          # "TrainingArguments" or "accelerate"
    micro_batch: int | None = None
    grad_accum: int | None = None
    world_size: int | None = None
    bf16: bool | None = None
    fp16: bool | None = None


def lookup(config: dict, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _put(config: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        node = node.get(part)
        if not isinstance(node, dict):
            return
    if last in node:
        node[last] = value


def resolve_auto(config: dict, trainer: TrainerValues | None, hidden_size: int | None = None) -> tuple[dict, dict]:
    """(the config with "auto" filled where the trainer (and the model's hidden_size) give a value, {key: (filled
    value, where from)}); a value that is not "auto" and differs from the trainer's is left as it is, and
    `mismatches` (check_mismatches) reports it as HF Trainer would."""
    out = copy.deepcopy(config)
    filled: dict[str, tuple[Any, str]] = {}

    def fill(key: str, value: Any, source: str) -> None:
        if value is not None and lookup(out, key) == AUTO:
            _put(out, key, value)
            filled[key] = (value, source)

    if trainer is not None:
        src = trainer.source
        if trainer.source == "TrainingArguments":
            fill("train_micro_batch_size_per_gpu", trainer.micro_batch, f"{src} per_device_train_batch_size")
            fill("gradient_accumulation_steps", trainer.grad_accum, f"{src} gradient_accumulation_steps")
            if None not in (trainer.micro_batch, trainer.grad_accum, trainer.world_size):
                fill("train_batch_size", trainer.world_size * trainer.micro_batch * trainer.grad_accum,
                     f"{src}: world_size x micro-batch x accumulation")
        else:
            fill("gradient_accumulation_steps", trainer.grad_accum, f"{src} gradient_accumulation_steps")
        fill("fp16.enabled", trainer.fp16, f"{src} fp16")
        fill("bf16.enabled", trainer.bf16, f"{src} bf16")
        for block, on in (("bf16", trainer.bf16), ("fp16", trainer.fp16)):
            # accelerate's DeepSpeedPlugin.set_mixed_precision adds the trainer's block when the JSON has none
            if on and block not in out and not (block == "bf16" and "bfloat16" in out):
                out[block] = {"enabled": True}
                filled[f"{block}.enabled"] = (True, f"{src} {block} (accelerate adds the block)")
    if hidden_size is not None:
        for key, (_, rule) in HIDDEN_SIZE_KEYS.items():
            fill(key, rule(hidden_size), "the model's hidden_size")
    return out, filled


def check_mismatches(r: Reading, file: str, config: dict, trainer: TrainerValues | None) -> None:
    """HF Trainer refuses a DeepSpeed value that is not "auto" and differs from TrainingArguments
    (HfTrainerDeepSpeedConfig.fill_match -> trainer_config_finalize's ValueError)."""
    if trainer is None or trainer.source != "TrainingArguments":
        return
    for key, theirs, name in (("train_micro_batch_size_per_gpu", trainer.micro_batch, "per_device_train_batch_size"),
                              ("gradient_accumulation_steps", trainer.grad_accum, "gradient_accumulation_steps")):
        ours = lookup(config, key)
        if theirs is not None and ours not in (None, AUTO) and ours != theirs:
            raise r.error(f"{file}: {key}", ours, f"differs from the trainer's {name} = {theirs} (HF Trainer "
                          "refuses the mismatch)", f'set it to "auto" or to {theirs}')


def check_rejections(r: Reading, file: str, config: dict, world_size: int | None) -> None:
    """What DeepSpeed's config refuses (deepspeed/runtime/config.py and zero/config.py): a ZeRO stage outside 0-3,
    an unknown offload device, fp16 and bf16 both enabled, a train batch that is not micro x accumulation x world."""
    zero = config.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise r.error(f"{file}: zero_optimization", zero, "is not a mapping", 'write e.g. {"stage": 2}')
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise r.error(f"{file}: zero_optimization.stage", stage, "is not a ZeRO stage (DeepSpeed takes 0, 1, 2 "
                      "or 3)", "choose 0, 1, 2 or 3")
    for part in ("offload_optimizer", "offload_param"):
        device = lookup(config, f"zero_optimization.{part}.device")
        if device is not None and str(device).lower() not in OFFLOAD_DEVICES:
            raise r.error(f"{file}: zero_optimization.{part}.device", device, "is not an offload device DeepSpeed "
                          "knows", "choose none, cpu or nvme")
    if _enabled(config, "fp16") is True and _enabled(config, "bf16") is True:
        raise r.error(f"{file}: fp16.enabled", True, "with bf16.enabled true (DeepSpeed: 'bfloat16 and fp16 modes "
                      "cannot be simultaneously enabled')", "enable one of them")
    numbers = [config.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                       "gradient_accumulation_steps")]
    if all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in numbers) and \
            numbers[0] % (numbers[1] * numbers[2]):
        raise r.error(f"{file}: train_batch_size", numbers[0], f"is not a multiple of micro-batch x accumulation "
                      f"({numbers[1]} x {numbers[2]}; DeepSpeed's _batch_assertion)", 'set it to "auto"')
    if all(isinstance(n, int) and not isinstance(n, bool) for n in numbers) and world_size:
        train, micro, accum = numbers
        if train != micro * accum * world_size:
            raise r.error(f"{file}: train_batch_size", train, f"is not micro-batch x accumulation x world size "
                          f"({micro} x {accum} x {world_size}; DeepSpeed's _batch_assertion)",
                          f'set it to {micro * accum * world_size} or "auto"')


def _enabled(config: dict, block: str) -> bool | str | None:
    """fp16 / bf16 .enabled (DeepSpeed also reads a "bfloat16" block as bf16)."""
    node = config.get(block) or (config.get("bfloat16") if block == "bf16" else None)
    if not isinstance(node, dict):
        return None
    value = node.get("enabled", False)
    return AUTO if value == AUTO else bool(value)


def read_deepspeed(r: Reading, config: dict, file: str, trainer: TrainerValues | None) -> None:
    """Read a DeepSpeed JSON into `r` (its own file name on every entry)."""
    check_mismatches(r, file, config, trainer)
    resolved, filled = resolve_auto(config, trainer)
    world = trainer.world_size if trainer is not None else None
    check_rejections(r, file, resolved, world)
    keys = Keys(resolved)
    zero = keys.sub("zero_optimization")
    stage = zero.get("stage", 0)
    r.method, r.zero_stage = STAGE_METHODS[stage], stage
    r.note_used("zero_optimization.stage", stage, f"method {r.method}", file=file)
    r.notes.append(STAGE_NOTES[stage])
    _read_dtypes(r, keys, file, filled)
    _read_batch(r, keys, file, filled, trainer)
    _read_offload(r, zero, file)
    _read_optimizer(r, keys, file)
    _read_buffers(r, zero, file, stage)
    if "tensor_parallel" in keys:
        r.ignore("tensor_parallel", keys.get("tensor_parallel"), "DeepSpeed AutoTP is not modelled: estimated "
                 "without tensor parallelism", file=file)
    for name, why in (("compile", "DeepSpeed's compile of its engine is not modelled (nor --compile under DeepSpeed)"),
                      ("gradient_clipping", "the gradient norm's temporaries are not modelled (a few scalars)"),
                      ("zero_force_ds_cpu_optimizer", "which optimizer class runs on the CPU: no GPU memory"),
                      ("zero_allow_untested_optimizer", "a permission, no memory effect")):
        if name in keys:
            r.ignore(name, keys.get(name), why, file=file, approximates=name in APPROXIMATING_TOP_KEYS)
    for name in ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"):
        if name in zero and stage == 3 and zero.get(name) != "auto":   # the job's saving phase; a no-op below 3
            on = r.boolean(zero.name(name), zero.get(name))   # ("auto": accelerate's zero3_save_16bit_model fills it)
            r.set(zero.name(name), zero.get(name), "save_kind", "gather-16bit" if on else "sharded", file=file)
        zero.get(name)
    for name in ("scheduler", "steps_per_print", "wall_clock_breakdown", "comms_config", "monitor_config",
                 "_comment"):
        keys.get(name)
    r.not_read(keys, file=file)


def _read_buffers(r: Reading, zero: Keys, file: str, stage: int) -> None:
    """The ZeRO section's buffer keys into the set-up's DeepSpeed fields ("auto" stays "auto": llmem fills it from the
    model's hidden size as HF does); stage-3 keys under stages 1-2 are DeepSpeed's no-ops there."""
    for key, name in BUFFER_FIELDS.items():
        if key not in zero:
            continue
        raw = zero.get(key)
        if stage == 0 or (ZERO_FIELDS[name] == 3 and stage < 3):
            r.ignore(f"zero_optimization.{key}", raw, f"no effect at ZeRO stage {stage}", file=file,
                     approximates=False)
            continue
        if name == "overlap_comm":
            value = r.boolean(f"{file}: zero_optimization.{key}", raw)
        elif raw == AUTO:
            value = AUTO
        else:
            value = r.integer(f"{file}: zero_optimization.{key}", raw, low=0, what="a number of elements")
        rule = HIDDEN_SIZE_RULES.get(name)
        r.set(f"zero_optimization.{key}", raw, name, value,
              f"auto = {rule[0]} (as HF fills it)" if raw == AUTO and rule else "", file=file)
    for key, why in BUFFER_IGNORED.items():
        if key in zero:
            modelled = key in BUFFER_MODELLED_VALUE and zero.get(key) == BUFFER_MODELLED_VALUE[key]
            r.ignore(f"zero_optimization.{key}", zero.get(key), why, file=file,
                     approximates=key not in BUFFER_NO_EFFECT and not modelled)


def _read_dtypes(r: Reading, keys: Keys, file: str, filled: dict) -> None:
    """DeepSpeed's fp16 / bf16: the module cast to that dtype and fp32 master partitions (engine.py
    _configure_distributed_model, the ZeRO / BF16 optimizers): llmem's *-mixed."""
    for block in ("bf16", "fp16"):
        keys.sub(block)
    keys.get("bfloat16")
    bf16, fp16 = _enabled(keys.data, "bf16"), _enabled(keys.data, "fp16")
    for block, value in (("bf16", bf16), ("fp16", fp16)):
        if value is None:
            continue
        source = filled.get(f"{block}.enabled")
        note = f"'auto' filled from {source[1]}" if source else ""
        if value == AUTO:
            r.note_used(f"{block}.enabled", AUTO, "filled by the trainer: llmem's --precision decides", file=file)
        else:
            r.note_used(f"{block}.enabled", value, ("; ".join(filter(None, [note, "fp32 master partitions"]))
                                                     if value else note) or "off", file=file)
    if bf16 is True or fp16 is True:
        r.dtype(compute="bf16" if bf16 is True else "fp16", masters=True)
    elif bf16 is not AUTO and fp16 is not AUTO:
        r.dtype(compute="fp32", weights="fp32")


def _read_batch(r: Reading, keys: Keys, file: str, filled: dict, trainer: TrainerValues | None) -> None:
    micro = keys.get("train_micro_batch_size_per_gpu")
    accum = keys.get("gradient_accumulation_steps")
    train = keys.get("train_batch_size")
    if micro is not None and micro != AUTO:
        value = r.integer(f"{file}: train_micro_batch_size_per_gpu", micro, what="a micro-batch")
        if "train_micro_batch_size_per_gpu" in filled:
            r.note_used("train_micro_batch_size_per_gpu", micro, "'auto' filled from the trainer's micro-batch",
                        file=file)
        else:
            r.set("train_micro_batch_size_per_gpu", micro, "batch_size", value, file=file)
    elif micro == AUTO:
        r.note_used("train_micro_batch_size_per_gpu", AUTO, "filled by the trainer: llmem's --batch-size", file=file)
    if accum is not None:
        r.note_used("gradient_accumulation_steps", accum, GA_NOTE, file=file)
    numbers = (train, micro, accum)
    if all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in numbers) and \
            train % (micro * accum) == 0 and (trainer is None or trainer.world_size is None):
        world = train // (micro * accum)
        r.gpus = world
        r.note_used("train_batch_size", train, f"gpus = {world} (train_batch_size / (micro-batch x accumulation))",
                    file=file)


def _read_offload(r: Reading, zero: Keys, file: str) -> None:
    opt = zero.sub("offload_optimizer")
    device = str(opt.get("device", "none")).lower()
    if device in ("cpu", "nvme"):
        note = "NVMe offload modelled as CPU offload (nothing of it on the GPU either way)" if device == "nvme" else ""
        r.set("zero_optimization.offload_optimizer.device", device, "offload_optimizer", True, note, file=file)
        for name in ("pin_memory", "nvme_path", "buffer_count", "fast_init", "ratio"):
            opt.get(name)
    param = zero.sub("offload_param")
    device = str(param.get("device", "none")).lower()
    if device in ("cpu", "nvme"):
        note = "NVMe offload modelled as CPU offload (nothing of it on the GPU either way)" if device == "nvme" else ""
        r.set("zero_optimization.offload_param.device", device, "offload_param", True, note, file=file)
        for name in ("pin_memory", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu"):
            param.get(name)
    for legacy in ("cpu_offload", "cpu_offload_params"):
        if legacy in zero:
            r.ignore(f"zero_optimization.{legacy}", zero.get(legacy), "DeepSpeed's deprecated offload switch: use "
                     "offload_optimizer / offload_param", file=file)


def _read_optimizer(r: Reading, keys: Keys, file: str) -> None:
    block = keys.sub("optimizer")
    if not block.data:
        return
    kind = str(block.get("type", "")).lower()
    params = block.sub("params")
    torch_adam = bool(params.get("torch_adam", False))
    for name in ("lr", "betas", "eps", "weight_decay", "adam_w_mode"):
        params.get(name)
    if kind in DS_OPTIMIZERS and torch_adam:
        r.set("optimizer.type", block.get("type"), "optimizer", "adamw", "torch_adam: torch.optim.AdamW, foreach",
              file=file)
    elif kind in DS_OPTIMIZERS:
        row = DS_OPTIMIZERS[kind]
        r.set("optimizer.type", block.get("type"), "optimizer", row.llmem, row.note, file=file)
    else:
        r.ignore("optimizer.type", block.get("type"), "DeepSpeed optimizer not in llmem's registry: llmem's "
                 "optimizer stands in", file=file)
