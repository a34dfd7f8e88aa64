"""A check inside the user's real run: at its first steps, the run's own memory counters against llmem's estimate
of the same set-up, rebuilt from the live objects (the model and its config, the peft config, the optimizer, the
precision, the batch shape, the distributed state).

    from llmem.validate.live import LlmemCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[LlmemCallback(out="llmem-check.json")])

    # a plain loop or accelerate: count from before the first step, check after it
    watch = llmem.validate.live.MemoryWatch.start(model, device)
    ... one or two training steps ...
    result = llmem.validate.live.check(model, optimizer, batch_size=b, seq_len=s, measured=watch.stop())

The counters: on a CUDA device `torch.cuda.max_memory_allocated` / `max_memory_reserved` since the watch started;
on the CPU the bytes of live tensors counted per op by llmem.runtime.ledger's RealTracker (what `llmem measure
--device cpu` counts), reserved from its replay through the caching-allocator model. The comparison is logged
(transformers' logger; a warning when the peak allocated differs by more than `threshold_pct`), added to the
trainer's logs as `llmem/...` keys (the callback moves itself first, so that `trainer.state.log_history` and every
reporting integration see them), and written as a `llmem validate --out` record (`{"rows": [...]}`, truth engine
"live", named by the model's name_or_path) when `out` is given. A TRL trainer's config (DPOConfig, GRPOConfig, ...)
names the objective and its settings (`trl_fields`). The callback never stops the run: what it cannot estimate (an
optimizer llmem does not model, a set-up it refuses) is a warning and an `llmem/estimate_error` log key.

Known limitations: the set-up is what llmem can express of the live objects (`live_setup` raises a one-line
LlmemError for an optimizer it does not model, which the callback logs); the distributed layout is what the Trainer's arguments say
(`trainer_layout`: DeepSpeed's stage, FSDP's resharding, the world size; TP and the GPU type as `overrides`); the sequence length is the first batch's (a run with variable
lengths is compared at that length); on the CPU the kernels are the CPU's (its SDPA differs from CUDA's), so the
CPU comparison checks the bookkeeping, not CUDA's saved tensors; a multi-GPU run is compared on its rank.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmem.errors import LlmemError
from llmem.estimator.engine import estimate
from llmem.result import MemoryResult
from llmem.setup.gpus import catalog_gpu_for
from llmem.setup.optimizers import torchao_row
from llmem.setup.sources.names import HF_ATTENTIONS
from llmem.setup.training import TrainingSetup, user_setup

log = logging.getLogger("llmem")
DEFAULT_THRESHOLD_PCT = 10.0
COUNTERS = ("peak_allocated_bytes", "peak_reserved_bytes")


# ---------------------------------------------------------------------------------------------- the set-up
def _optimizer_name(optimizer: Any, on_cuda: bool) -> str:
    """llmem's optimizer registry name for a live optimizer (accelerate's AcceleratedOptimizer unwrapped). torch's
    Adam(W) with foreach=None picks foreach kernels for CUDA tensors only (torch/optim/optimizer.py
    _default_to_fused_or_foreach): on the CPU it runs the for-loop."""
    opt = getattr(optimizer, "optimizer", optimizer)
    cls = type(opt).__name__
    group = opt.defaults if hasattr(opt, "defaults") else {}
    if cls in ("AdamW", "Adam"):
        if group.get("fused"):
            return "adamw-fused"
        foreach = group.get("foreach")
        return "adamw" if foreach or (foreach is None and on_cuda) else "adamw-forloop"
    if cls == "SGD":
        return "sgd-momentum" if group.get("momentum") else "sgd"
    if type(opt).__module__.startswith("torchao."):      # torchao's AdamW8bit shares bitsandbytes' class name
        row = torchao_row(cls, getattr(opt, "block_size", 0))
        names = {cls: row} if row else {}
    else:
        names = {"Adafactor": "adafactor", "AdamW8bit": "adamw-8bit", "PagedAdamW8bit": "paged-adamw-8bit",
                 "PagedAdamW": "paged-adamw-32bit", "PagedAdamW32bit": "paged-adamw-32bit", "Lion": "lion",
                 "Muon": "muon"}
    if cls in names:
        return names[cls]
    raise LlmemError(f"optimizer {type(opt).__module__}.{cls} is not one llmem models: the check needs one of "
                     "AdamW/Adam, SGD, Adafactor, Lion, Muon, bitsandbytes AdamW8bit / PagedAdamW8bit / PagedAdamW, "
                     "torchao AdamW8bit / AdamW4bit (blocks of 128 or 256) / AdamWFp8")


def _precision(model: torch.nn.Module, autocast_dtype: torch.dtype | None) -> str:
    """fp32 weights under autocast are `*-mixed`; bf16/fp16 weights are pure low precision. Under peft the frozen
    base's dtype decides (fp32 adapters on a bf16 base are `--precision bf16` with peft's fp32 adapters)."""
    params = list(model.parameters())
    frozen = [p.dtype for p in params if not p.requires_grad and p.is_floating_point()]
    decided = frozen if getattr(model, "peft_config", None) and frozen else \
        [p.dtype for p in params if p.requires_grad] or [params[0].dtype]
    dtype = decided[0]
    if dtype == torch.float32 and autocast_dtype in (torch.bfloat16, torch.float16):
        return "bf16-mixed" if autocast_dtype == torch.bfloat16 else "fp16-mixed"
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def _gpu_name() -> str | None:
    """The catalog entry of the CUDA device, by name and memory (None: not CUDA, or not in the catalog)."""
    if not torch.cuda.is_available():
        return None
    return catalog_gpu_for(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)


def live_setup(model: torch.nn.Module, optimizer: Any, *, batch_size: int, seq_len: int,
               autocast_dtype: torch.dtype | None = None, folder: str | Path | None = None,
               **overrides: Any) -> TrainingSetup:
    """The TrainingSetup of a live model and optimizer: the model's config and peft config written to `folder`
    (a temporary one by default) and read back as llmem reads a user's files. `overrides`: TrainingSetup fields."""
    folder = Path(folder or tempfile.mkdtemp(prefix="llmem-live-"))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.save_pretrained(folder / "model")
    fields: dict[str, Any] = {"model": str(folder / "model" / "config.json"), "batch_size": batch_size,
                              "seq_len": seq_len, "optimizer": _optimizer_name(optimizer, next(model.parameters()).is_cuda),
                              "precision": _precision(model, autocast_dtype),
                              "grad_ckpt": bool(getattr(base, "is_gradient_checkpointing", False))}
    attn = getattr(base.config, "_attn_implementation", None) or "sdpa"
    row = HF_ATTENTIONS.get(attn)          # transformers' attn_implementation -> --attn (the --from readers' table)
    fields["attn"] = row.llmem if row is not None and row.llmem else "flash" if attn.startswith("flash") else "sdpa"
    peft_configs = getattr(model, "peft_config", None)
    if peft_configs:
        peft_configs["default"].save_pretrained(str(folder / "adapter"))
        fields["peft_config"] = str(folder / "adapter")
        fields["adapter_dtype"] = "fp32" if any(p.dtype == torch.float32 for p in model.parameters()
                                                if p.requires_grad) else "base"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        fields["gpus"] = torch.distributed.get_world_size()
    gpu = _gpu_name()
    if gpu is not None:
        fields["gpu"] = gpu
    fields.update(overrides)
    return user_setup(**fields)


# ---------------------------------------------------------------------------------------------- the counters
@dataclass
class MemoryWatch:
    """The run's counters from `start` to `stop`: CUDA's peak stats, or on the CPU the ledger's live tensors."""
    device: torch.device
    ledger: Any = None
    tracker: Any = None

    @classmethod
    def start(cls, model: torch.nn.Module, device: torch.device | str | None = None,
              optimizer: Any = None) -> MemoryWatch:
        device = torch.device(device) if device is not None else next(model.parameters()).device
        watch = cls(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            return watch
        from llmem.runtime.ledger import Ledger, RealTracker  # the CPU's counter: llmem measure's ledger

        watch.ledger = Ledger(workspace_bytes=0)
        states = [t for s in getattr(getattr(optimizer, "optimizer", optimizer), "state", {}).values()
                  for t in s.values() if isinstance(t, torch.Tensor)] if optimizer is not None else []
        initial = list(model.parameters()) + list(model.buffers()) + states
        watch.ledger.start_step(initial, {p: "weights" for p in model.parameters()})
        watch.tracker = RealTracker(watch.ledger)
        watch.tracker.__enter__()
        return watch

    def stop(self) -> dict[str, int]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return {"peak_allocated_bytes": int(torch.cuda.max_memory_allocated(self.device)),
                    "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(self.device))}
        from llmem.runtime.replay import replay_ledger

        self.tracker.__exit__(None, None, None)
        self.ledger.enabled = False
        series = replay_ledger(self.ledger)
        return {"peak_allocated_bytes": int(series["peak_allocated"]),
                "peak_reserved_bytes": int(series["peak_reserved"])}


# ---------------------------------------------------------------------------------------------- the comparison
@dataclass(frozen=True)
class LiveCheck:
    setup: TrainingSetup
    measured: dict[str, int]          # the run's counters
    estimate: MemoryResult
    device: str
    threshold_pct: float = DEFAULT_THRESHOLD_PCT
    model_name: str = ""              # the model as the run loaded it (its config's name_or_path), for the record

    def error_pct(self, counter: str) -> float:
        truth = self.measured[counter]
        return 100.0 * (getattr(self.estimate, counter) - truth) / truth if truth else 0.0

    @property
    def agrees(self) -> bool:
        return abs(self.error_pct("peak_allocated_bytes")) <= self.threshold_pct

    def message(self) -> str:
        gib = 2**30
        parts = [f"{c.removeprefix('peak_').removesuffix('_bytes')} {self.measured[c] / gib:.2f} GiB measured, "
                 f"{getattr(self.estimate, c) / gib:.2f} estimated ({self.error_pct(c):+.1f} %)" for c in COUNTERS]
        verdict = "agrees" if self.agrees else f"differs by more than {self.threshold_pct:g} %"
        return f"llmem check on {self.device}: " + "; ".join(parts) + f" - {verdict}"

    def log_values(self) -> dict[str, float]:
        out = {}
        for c in COUNTERS:
            short = c.removeprefix("peak_").removesuffix("_bytes")
            out[f"llmem/{short}_measured_gib"] = round(self.measured[c] / 2**30, 4)
            out[f"llmem/{short}_estimate_gib"] = round(getattr(self.estimate, c) / 2**30, 4)
            out[f"llmem/{short}_error_pct"] = round(self.error_pct(c), 2)
        return out

    def to_row(self) -> dict:
        """One row of `llmem validate --out`'s JSON (truth engine "live")."""
        setup = self.setup.to_dict() | ({"model": self.model_name} if self.model_name else {})
        return {"setup": setup, "seconds": 0.0, "error": "", "skipped": "",
                "estimate": {c: getattr(self.estimate, c) for c in COUNTERS},
                "truth": dict(self.measured), "truth_engine": f"live ({self.device})",
                "error_pct": {c: self.error_pct(c) for c in COUNTERS},
                "estimate_components": self.estimate.components}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"rows": [self.to_row()]}, indent=1))


def check(model: torch.nn.Module, optimizer: Any, *, batch_size: int, seq_len: int, measured: dict[str, int],
          autocast_dtype: torch.dtype | None = None, threshold_pct: float = DEFAULT_THRESHOLD_PCT,
          device: str = "", **overrides: Any) -> LiveCheck:
    """The live run's counters against llmem's estimate of its set-up; logged, a warning when they differ."""
    setup = live_setup(model, optimizer, batch_size=batch_size, seq_len=seq_len, autocast_dtype=autocast_dtype,
                       **overrides)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    result = LiveCheck(setup, measured, estimate(setup), device or str(next(model.parameters()).device),
                       threshold_pct, str(getattr(base.config, "name_or_path", "") or ""))
    (log.info if result.agrees else log.warning)(result.message())
    return result


# ---------------------------------------------------------------------------------------------- the Trainer
def _trainer_callback_base() -> type:
    from transformers import TrainerCallback

    return TrainerCallback


class LlmemCallback(_trainer_callback_base()):
    """transformers.Trainer callback: counts from the start of training, checks after `after_steps` optimizer steps
    (the first steps create the optimizer states), then logs, warns and writes the record. `overrides`: TrainingSetup
    fields the live objects cannot tell (e.g. `method="fsdp"`, `gpu="H100-80GB"`)."""

    def __init__(self, after_steps: int = 2, threshold_pct: float = DEFAULT_THRESHOLD_PCT,
                 out: str | Path | None = None, **overrides: Any) -> None:
        if after_steps < 1:
            raise LlmemError(f"LlmemCallback(after_steps=...) must be >= 1, got {after_steps}")
        self.after_steps, self.threshold_pct, self.out, self.overrides = after_steps, threshold_pct, out, overrides
        self.watch: MemoryWatch | None = None
        self.shape: tuple[int, int] | None = None
        self.result: LiveCheck | None = None
        self._hook = None
        self._pending: dict[str, float] = {}

    def _record_shape(self, _module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.shape is None and isinstance(ids, torch.Tensor) and ids.dim() == 2:
            self.shape = (int(ids.shape[0]), int(ids.shape[1]))

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.result is not None or self.watch is None or state.global_step < self.after_steps:
            return
        measured = self.watch.stop()
        self.watch = None
        self._hook.remove()
        if self.shape is None:
            log.warning("llmem check: no input_ids seen in the model's forward; nothing compared")
            return
        try:                   # the user's training goes on whatever the check meets
            self.result = self._check(args, model, optimizer, measured)
        except Exception as exc:   # noqa: BLE001 - an estimate that cannot be made is logged, never raised
            log.warning(f"llmem check: no estimate of this run ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                        "training continues")
            self._pending = {"llmem/estimate_error": 1.0}
            return
        self._pending = self.result.log_values()
        if self.out is not None:
            self.result.write(self.out)

    def _check(self, args, model, optimizer, measured: dict[str, int]) -> LiveCheck:
        """The comparison at the recorded shape: a TRL trainer's objective and its settings read off its config
        (`args`, e.g. a DPOConfig), the micro-batch its per-device batch size."""
        autocast = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        fields = {**trainer_layout(args), **trl_fields(args), **self.overrides}
        batch = getattr(args, "per_device_train_batch_size", None) if fields.get("objective") else None
        return check(model, optimizer, batch_size=batch or self.shape[0], seq_len=self.shape[1], measured=measured,
                     autocast_dtype=autocast, threshold_pct=self.threshold_pct, device=str(args.device), **fields)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        _run_first(self)        # so that the reporters (W&B, TensorBoard, MLflow, the console) see its keys
        self._hook = model.register_forward_pre_hook(self._record_shape, with_kwargs=True)
        self.watch = MemoryWatch.start(model, args.device, optimizer)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self._pending:
            logs.update(self._pending)     # the reporters after this callback (it runs first) see them
            if state.log_history:          # Trainer.log appended its copy of `logs` before on_log
                state.log_history[-1].update(self._pending)
            self._pending = {}


def _run_first(callback: Any) -> None:
    """Move `callback` to the front of its Trainer's CallbackHandler list: transformers registers the reporting
    integrations before user callbacks, and each reads `logs` in turn (CallbackHandler.call_event), so keys added
    later reach none of them. The handler is found as the list that holds the callback (callbacks get no handle on
    it); nothing happens if none is found."""
    import gc

    for holder in gc.get_referrers(callback):
        if isinstance(holder, list) and holder and holder[0] is not callback and callback in holder:
            holder.remove(callback)
            holder.insert(0, callback)
            return


def trainer_layout(args: Any) -> dict[str, Any]:
    """The method and GPU count a Trainer runs, read off its TrainingArguments after their __post_init__: DeepSpeed's
    ZeRO stage from the config the Trainer holds (hf_deepspeed_config), FSDP from fsdp / fsdp_config (resharding
    after forward: fsdp; not: zero2), DDP over several processes; {} for one process alone."""
    world = int(getattr(args, "world_size", 1) or 1)
    deepspeed = getattr(args, "hf_deepspeed_config", None) if getattr(args, "deepspeed", None) else None
    if deepspeed is not None:
        stage = int(deepspeed.config.get("zero_optimization", {}).get("stage", 0) or 0)
        return {"method": f"ds-zero{stage}" if stage in (1, 2, 3) else "ddp", "gpus": world}
    if getattr(args, "fsdp", None):
        resharded = (getattr(args, "fsdp_config", None) or {}).get("reshard_after_forward", True)
        return {"method": "fsdp" if resharded else "zero2", "gpus": world}
    return {"method": "ddp", "gpus": world} if world > 1 else {}


def trl_fields(args: Any) -> dict[str, Any]:
    """The TrainingSetup fields a TRL trainer's config states (its class names the trainer: DPOConfig -> dpo): the
    objective, and the trainer's and generation's settings TRL spells as llmem does (beta, loss_type,
    num_generations, max_completion_length, use_vllm, ...). {} for transformers' own TrainingArguments."""
    from dataclasses import fields as dataclass_fields

    from llmem.setup.generation import GENERATION_BATCH_FIELDS
    from llmem.setup.objectives import OBJECTIVES
    from llmem.setup.sections import GenerationConfig, TrainerConfig

    trainer = type(args).__name__.removesuffix("Config") + "Trainer"
    spec = next((o for o in OBJECTIVES.values() if o.trainer == trainer), None)
    if spec is None:
        return {}
    # the generation batch: TrainingArguments' accumulation on every config, GRPOConfig's two derived fields both
    # set after __post_init__: a generating trainer's accumulation and steps_per_generation only
    skipped = {name for name, _ in GENERATION_BATCH_FIELDS} if not spec.generates else {"generation_batch_size"}
    out: dict[str, Any] = {"objective": spec.name}
    for f in (*dataclass_fields(TrainerConfig), *dataclass_fields(GenerationConfig)):
        value = getattr(args, f.name, None)
        if f.name not in skipped | {"objective"} and value is not None and not isinstance(value, (list, dict)):
            out[f.name] = value
    return out
