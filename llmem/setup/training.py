"""The training set-up a user asks about: one plain frozen dataclass of sections, and its validation.

`TrainingSetup` holds the model's name and one section of each kind (llmem.setup.sections: parallelism, hardware,
step, optim, activations, adapters, deepspeed, trainer, generation), as torchtitan's Trainer config holds its section
configs. Each section field carries its command-line `Option` (llmem.setup.flags), so llmem.cli builds the argument
parser from them and a new field is a new flag without a second list to keep in step.

A set-up is built from its fields' flat names, as the command line and the API give them
(`TrainingSetup(model="gpt2", gpus=8, lora_rank=16)`, `dataclasses.replace(setup, batch_size=4)`), or from
sections; each field also reads by its flat name (`setup.pp` is `setup.parallelism.pp`), and `to_dict()` (the
`setup` of every `--json`) keeps the flat keys in the order they have always had.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from llmem.errors import LlmemError
from llmem.setup.attention import ATTENTIONS, AttentionSpec
from llmem.setup.checkpointing import CkptOffload, ac_policy, ckpt_offload, reentrant_refusal
from llmem.setup.context_parallel import check_context_parallel
from llmem.setup.deepspeed import HIDDEN_SIZE_RULES, ZERO_FIELDS
from llmem.setup.eval_phase import check_eval
from llmem.setup.expert_parallel import check_expert_parallel
from llmem.setup.flags import (  # noqa: F401 - re-exported: the flags' names as llmem has always offered them
    ACTIVATIONS,
    ADAPTERS,
    DEEPSPEED,
    LAYOUT,
    MAX_COUNT,
    MODEL,
    OPTIMIZER,
    STEP,
    Option,
    count,
    count_or_auto,
    option,
)
from llmem.setup.float8 import check_float8
from llmem.setup.images import check_images
from llmem.setup.job_phases import check_job_phases
from llmem.setup.liger import liger_kernels
from llmem.setup.methods import canonical_method, method_spec
from llmem.setup.objectives import ObjectiveSpec, check_objective, objective_spec
from llmem.setup.optimizers import OPTIMIZERS, OptimizerSpec
from llmem.setup.pipeline import PP_METHODS, check_pipeline, check_schedule_method
from llmem.setup.precision import PRECISIONS, Precision
from llmem.setup.quant_bases import QuantBaseSpec, quant_base_spec
from llmem.setup.sections import (  # noqa: F401 - re-exported
    ADAPTER_DTYPES,
    LOGITS_DTYPES,
    LORA_ALL_LINEAR,
    SECTIONS,
    ActivationsConfig,
    AdaptersConfig,
    DeepSpeedConfig,
    GenerationConfig,
    HardwareConfig,
    JobConfig,
    OptimizerConfig,
    ParallelismConfig,
    StepConfig,
    TrainerConfig,
    lora_target_regex,
)

if TYPE_CHECKING:
    from llmem.setup.layout import Layout

# Bounds of one micro-batch: far past any real run (the largest contexts are ~10M tokens), and small enough that a
# step's tensors stay below 2**64 bytes (CUDA's size_t) on real models; the allocator model refuses the rest
MAX_BATCH_SIZE = 1 << 20
MAX_SEQ_LEN = 1 << 24
MAX_STEP_TOKENS = 1 << 28


def default_method(gpus: int, objective: str = "sft") -> str:
    """The method when none is given: one GPU runs single, more run FSDP2 (DDP for TRL's objectives, preference and
    generation alike: accelerate's launch without an FSDP config; --method fsdp / zero2 model its FSDP2 plugin)."""
    if gpus == 1:
        return "single"
    return "ddp" if objective_spec(objective).runs_trainer else "fsdp"


def user_setup(**fields: Any) -> TrainingSetup:
    """The TrainingSetup a user's fields describe (the API's keywords, the CLI's flags): the method's alias
    resolved, or, when none is given, the default for the GPU count."""
    fields["method"] = canonical_method(fields["method"]) if "method" in fields \
        else default_method(fields.get("gpus", 1) // max(1, fields.get("pp") or 1),   # --pp N on N GPUs: single
                            fields.get("objective", "sft"))
    return TrainingSetup(**fields)


# Fields added after the `setup` JSON's keys were fixed: last in FLAT_ORDER, and after the set-up record's own keys in
# the JSON (llmem.setup.record), so that every key an earlier llmem printed keeps its place
LATER_FIELDS = ("load_path", "save_kind", "logits_dtype", "liger", "float8", "float8_all_gather",
                "gradient_accumulation_steps", "steps_per_generation", "generation_batch_size", "compile",
                "images_per_sample", "image_size", "max_pixels", "freeze_vision_tower", "freeze_projector",
                "freeze_language_model", "shard_embeddings", "ckpt_reentrant", "eval_batch_size", "eval_keeps",
                "eval_accumulation_steps", "eval_samples", "output_chunks", "ckpt_offload")
SHAPE_FIELDS = ("batch_size", "seq_len")     # a micro-batch's shape (TrainingSetup.shape_free: the rest)
# Every field by its flat name, in the order the set-up's JSON and --help have always listed them
FLAT_ORDER = ('model', 'method', 'gpus', 'gpus_per_node', 'tp', 'batch_size', 'seq_len', 'precision', 'optimizer', 'grad_ckpt', 'attn', 'gpu', 'gpu_memory', 'cuda_context', 'expandable_segments', 'offload_optimizer', 'lora_rank', 'lora_alpha', 'lora_targets', 'lora_dropout', 'peft_config', 'trust_remote_code', 'optimizer_in_backward', 'quant_base', 'kbit_upcast', 'adapter_dtype', 'double_quant', 'ckpt_every', 'offload_activations', 'fused_ce', 'packing', 'reduce_bucket_size', 'overlap_comm', 'prefetch_bucket_size', 'param_persistence_threshold', 'max_live_parameters', 'max_reuse_distance', 'sub_group_size', 'offload_param', 'objective', 'loss_type', 'precompute_ref_log_probs', 'ref_dtype', 'prompt_len', 'max_length', 'sequence_parallel', 'loss_parallel', 'ac_policy', 'num_generations', 'max_completion_length', 'beta', 'use_vllm', 'dp_replicate', 'pp', 'pp_schedule', 'pp_microbatches', 'cp', 'vllm_mode', 'vllm_gpu_memory_utilization', 'vllm_enable_sleep_mode', 'vllm_max_model_length', 'pp_virtual_stages', 'ep', 'ep_imbalance', 'reshard_after_forward') + LATER_FIELDS
# Fields a set-up's JSON record shows only where they are set (an eval's, the reentrant checkpoint): a set-up without
# them records what it recorded before they existed
SHOWN_WHEN_SET = ("eval_batch_size", "eval_keeps", "eval_accumulation_steps", "eval_samples", "ckpt_reentrant",
                  "output_chunks", "ckpt_offload")
# flat name -> the section holding it (the model's name and trust_remote_code are TrainingSetup's own)
SECTION_OF: dict[str, str] = {f.name: name for name, section in SECTIONS.items() for f in fields(section)}
# the defaults of LATER_FIELDS: a set-up prints them only where it differs (TrainingSetup.__repr__)
LATER_DEFAULTS: dict[str, Any] = {f.name: f.default for section in SECTIONS.values() for f in fields(section)
                                  if f.name in LATER_FIELDS}


@dataclass(frozen=True, init=False, repr=False)
class TrainingSetup:
    """One fine-tuning step as the user describes it: the model and one section of each kind. Sizes are per GPU
    (batch_size is the micro-batch)."""
    model: str = field(metadata={"option": Option(
        "catalog name, hub id, path to config.json, or a model folder", MODEL, kind="positional",
        metavar="MODEL")})
    trust_remote_code: bool = option(False, "let transformers run the model's own code", MODEL, kind="switch")
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    step: StepConfig = field(default_factory=StepConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    activations: ActivationsConfig = field(default_factory=ActivationsConfig)
    adapters: AdaptersConfig = field(default_factory=AdaptersConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    job: JobConfig = field(default_factory=JobConfig)

    def __init__(self, model: str, *positional: Any, **given: Any) -> None:
        """Sections given whole (`parallelism=ParallelismConfig(...)`), fields by their flat names (`gpus=8`), or
        both: a flat field overrides its section's value (what dataclasses.replace passes). Values given by position
        follow FLAT_ORDER, as the flat dataclass's did (`TrainingSetup("gpt2", "ddp", 2)`)."""
        for name, value in zip(FLAT_ORDER[1:], positional, strict=False):
            if name in given:
                raise TypeError(f"TrainingSetup got multiple values for argument {name!r}")
            given[name] = value
        if len(positional) >= len(FLAT_ORDER):
            raise TypeError(f"TrainingSetup takes at most {len(FLAT_ORDER)} values by position")
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "trust_remote_code", given.pop("trust_remote_code", False))
        flat: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in given.items():
            if key in SECTIONS:
                continue
            if key not in SECTION_OF:
                raise TypeError(f"TrainingSetup got an unexpected keyword argument {key!r}")
            flat[SECTION_OF[key]][key] = value
        for name, section in SECTIONS.items():
            value = given.get(name) or section()
            object.__setattr__(self, name, replace(value, **flat[name]) if flat[name] else value)
        self.__post_init__()

    def __repr__(self) -> str:
        """The flat form, as the set-up has always printed (its fields by their flat names; one of LATER_FIELDS only
        where it is not at its default, so that a set-up without it prints as it did before it existed)."""
        shown = [n for n in FLAT_ORDER if n not in LATER_DEFAULTS or getattr(self, n) != LATER_DEFAULTS[n]]
        return f"TrainingSetup({', '.join(f'{name}={getattr(self, name)!r}' for name in shown)})"

    def _set(self, name: str, value: Any) -> None:
        """Validation's own normalisation of a field (a count parsed, a flag implied), in its section."""
        section = SECTION_OF[name]
        object.__setattr__(self, section, replace(getattr(self, section), **{name: value}))

    def __post_init__(self) -> None:
        self._check_step_size()
        if self.precision not in PRECISIONS:
            raise LlmemError(f"unknown precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if self.optimizer not in OPTIMIZERS:
            raise LlmemError(f"unknown optimizer {self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
        if self.lora_rank < 0:
            raise LlmemError(f"--lora-rank must be >= 0, got {self.lora_rank}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise LlmemError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.peft_config and (self.lora_rank or self.lora_dropout):
            raise LlmemError("--peft-config sets the adapters itself: drop --lora-rank / --lora-dropout "
                             "(or drop --peft-config)")
        pattern = lora_target_regex(self.lora_targets)
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise LlmemError(f"--lora-targets {self.lora_targets}: not a regular expression ({exc}); write "
                                 "re:PATTERN, e.g. re:model\\.layers\\.\\d+\\.self_attn\\.(q|v)_proj") from None
        if self.lora_dropout and not self.lora_rank:
            raise LlmemError("--lora-dropout needs --lora-rank (a --peft-config brings its own lora_dropout)")
        if self.attn not in ATTENTIONS:
            raise LlmemError(f"unknown attention {self.attn!r}: choose one of {', '.join(ATTENTIONS)}")
        if self.attention_spec.low_precision_only and not self.precision_spec.low_precision:
            raise LlmemError(f"--attn {self.attn} needs fp16 or bf16 compute (flash attention has no fp32 kernel)")
        if self.ckpt_every < 1:
            raise LlmemError(f"--grad-ckpt-every must be >= 1, got {self.ckpt_every}")
        self._check_ac_policy()
        self._check_ckpt_offload()
        self._check_ckpt_reentrant()
        if self.adapter_dtype not in ADAPTER_DTYPES:
            raise LlmemError(f"unknown --adapter-dtype {self.adapter_dtype!r}: choose one of {', '.join(ADAPTER_DTYPES)}")
        liger_kernels(self.liger)
        check_float8(self.float8, self.float8_all_gather)
        if self.logits_dtype not in LOGITS_DTYPES:
            raise LlmemError(f"unknown --logits-dtype {self.logits_dtype!r}: choose one of {', '.join(LOGITS_DTYPES)}")
        if not 0 <= self.output_chunks <= self.seq_len:
            raise LlmemError(f"--output-chunks must be between 0 (off) and --seq-len {self.seq_len}, got "
                             f"{self.output_chunks}: torchtune's default is 8")
        self._check_quant_base()
        self._check_deepspeed()
        check_objective(self)
        self._check_replicate()
        self._check_pipeline()
        check_context_parallel(self)
        check_expert_parallel(self)
        check_job_phases(self)
        check_eval(self)
        check_images(self)

    def _check_pipeline(self) -> None:
        """--pp: the schedule and micro-batches torch accepts, on the methods a stage runs under (the layer count is
        checked once the model is known, llmem.model.resolved)."""
        check_pipeline(self.pp, self.pp_schedule, self.microbatches, self.batch_size, None,
                       self.pp_virtual_stages)
        if self.pp > 1 and canonical_method(self.method) not in PP_METHODS:
            raise LlmemError(f"--pp runs under --method single (pure pipeline), fsdp (FSDP2 x PP), tp or fsdp+tp "
                             f"(TP x PP) only, got {self.method}")
        if self.pp > 1:
            check_schedule_method(self.pp_schedule, canonical_method(self.method))
        if self.pp == 1 and self.pp_microbatches is not None:
            raise LlmemError("--pp-microbatches splits the batch over pipeline stages: add --pp N (> 1)")

    def with_layout(self, layout: Layout, batch_size: int, microbatches: int = 1) -> TrainingSetup:
        """This set-up run under `layout` (resolved once, llmem.setup.layout) at `batch_size` samples per step and,
        under a pipeline, `microbatches` per step: its parallelism section the layout's own
        (ParallelismConfig.from_layout), the rest as given."""
        return replace(self, parallelism=ParallelismConfig.from_layout(layout, self.parallelism, microbatches),
                       batch_size=batch_size)

    @property
    def shape_free(self) -> tuple:
        """The set-up less its micro-batch shape (SHAPE_FIELDS): the key of what does not depend on it."""
        return tuple(getattr(self, name) for name in FLAT_ORDER if name not in SHAPE_FIELDS)

    @property
    def microbatches(self) -> int:
        """The pipeline's micro-batches per step (1 without --pp)."""
        if self.pp == 1:
            return 1
        return self.batch_size if self.pp_microbatches is None else self.pp_microbatches

    def _check_replicate(self) -> None:
        """HSDP replicates FSDP2's shards: a sharding method of PyTorch's (DeepSpeed's engine has its own hpZ)."""
        if self.dp_replicate < 1:
            raise LlmemError(f"--dp-replicate must be >= 1, got {self.dp_replicate}")
        spec = method_spec(self.method)
        if self.dp_replicate > 1 and not spec.shards_model_states:
            raise LlmemError(f"--dp-replicate (HSDP) replicates FSDP2's shards: use --method fsdp, zero2 or fsdp+tp "
                             f"(got {self.method})")

    def _check_ac_policy(self) -> None:
        """--ac-policy: a row of AC_POLICIES; a selective one checkpoints every layer (torchtitan wraps each block)."""
        if ac_policy(self.ac_policy).selective:
            if self.ckpt_every > 1:
                raise LlmemError(f"--ac-policy {self.ac_policy} checkpoints every layer (torchtitan's op-level "
                                 "selective checkpointing wraps each block): drop --grad-ckpt-every")
            self._set("grad_ckpt", True)   # implied, as the flag implies it

    def _check_ckpt_offload(self) -> None:
        """--ckpt-offload: a library's reentrant-style Function around every decoder layer (it implies --grad-ckpt and
        --ckpt-reentrant: Unsloth's forces use_reentrant=True, each layer's forward runs under no_grad). Refused with
        every-k checkpointing, activation offloading and what the reentrant checkpoint is refused with."""
        if not ckpt_offload(self.ckpt_offload).active:
            return
        flag = f"--ckpt-offload {self.ckpt_offload}"
        if self.ckpt_every > 1:
            raise LlmemError(f"{flag} checkpoints every decoder layer (Unsloth's Function wraps each one): drop "
                             "--grad-ckpt-every")
        if self.offload_activations:
            raise LlmemError(f"{flag} with --offload-activations: the checkpoint already offloads each layer's "
                             "input, save_on_cpu around it is not modelled; drop one of them")
        refused = reentrant_refusal(lambda name: getattr(self, name))
        if refused is not None:
            raise LlmemError(f"{flag} with {refused[0]}: {refused[1]}; drop one of them")
        self._set("grad_ckpt", True)        # implied, as Unsloth's get_peft_model / LLaMA-Factory's flag imply it
        self._set("ckpt_reentrant", True)

    def _check_ckpt_reentrant(self) -> None:
        """--ckpt-reentrant: torch's CheckpointFunction, a whole layer at a time (it implies --grad-ckpt). The options
        llmem models only over the non-reentrant checkpoint are refused with it."""
        if not self.ckpt_reentrant:
            return
        refused = reentrant_refusal(lambda name: getattr(self, name))
        if refused is not None:
            flag, why = refused
            raise LlmemError(f"--ckpt-reentrant with {flag}: {why}; drop one of them")
        self._set("grad_ckpt", True)   # implied, as the flag implies it

    def _check_deepspeed(self) -> None:
        """DeepSpeed's options belong to its methods, stage 3's to stage 3 (DeepSpeed refuses offload_param below
        it: DeepSpeedZeroConfig's offload_param "valid only with stage 3")."""
        spec = method_spec(self.method)
        stage = spec.zero_stage
        for name, needs in ZERO_FIELDS.items():
            value = getattr(self, name)
            if value is None or value is False and name == "offload_param":   # not set (offload_param: a switch)
                continue
            if name == "offload_param" and spec.shards_model_states:
                continue                  # FSDP2's CPUOffloadPolicy
            flag = "--" + name.replace("_", "-")
            if stage is None and name == "offload_param":
                raise LlmemError(f"{flag} offloads sharded parameters: use --method fsdp, zero2, fsdp+tp (FSDP2's "
                                 f"CPUOffloadPolicy) or ds-zero3 (got {self.method})")
            if stage is None:
                raise LlmemError(f"{flag} is a DeepSpeed ZeRO setting: use --method ds-zero1, ds-zero2 or ds-zero3 "
                                 f"(got {self.method})")
            if needs is not None and stage < needs:
                raise LlmemError(f"{flag} applies to ZeRO stage {needs} only: use --method ds-zero{needs} "
                                 f"(got {self.method})")
        for name in ZERO_FIELDS:     # the API takes the same values as the flags
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                self._set(name, count_or_auto(value) if name in HIDDEN_SIZE_RULES else count(value))
        if stage is not None and self.reduce_bucket_size == 0:
            raise LlmemError("--reduce-bucket-size must be > 0 (DeepSpeed's reduce_bucket_size is gt=0)")

    def _check_step_size(self) -> None:
        """Sizes a GPU step can have: beyond the bounds no device holds them, and the allocator model's sizes would
        overflow (sizes are 64-bit, as in CUDA's allocator)."""
        for flag, value, bound in (("--batch-size", self.batch_size, MAX_BATCH_SIZE),
                                   ("--seq-len", self.seq_len, MAX_SEQ_LEN)):
            if not 1 <= value <= bound:
                raise LlmemError(f"{flag} must lie in [1, {bound:,}], got {value:,}")
        if self.batch_size * self.seq_len > MAX_STEP_TOKENS:
            raise LlmemError(f"--batch-size x --seq-len is {self.batch_size * self.seq_len:,} tokens per micro-batch; "
                             f"llmem takes at most {MAX_STEP_TOKENS:,} (2**28)")

    def _check_quant_base(self) -> None:
        """The combinations llmem models for a quantised base: bitsandbytes' under peft (HF, TRL, axolotl), torchao's
        NF4Tensor under torchtune's LoRA recipes (the row's own precision rules: QuantBaseSpec.check)."""
        spec = quant_base_spec(self.quant_base)
        if not spec.quantised:
            if not self.kbit_upcast:
                raise LlmemError("--no-kbit-upcast applies to a quantised base only (--qlora, --qlora-torchao, "
                                 "--load-in-8bit)")
            return
        flag = spec.flag
        if not self.peft:
            raise LlmemError(f"{flag} quantises the frozen base: its weights cannot be trained, so give adapters to "
                             "train (--lora-rank R, or --peft-config PATH)")
        pure_low = self.precision_spec.low_precision and not self.mixed
        if pure_low and self.kbit_upcasts and self.attention_spec.flash_kernel:
            raise LlmemError(f"{flag} under --precision {self.precision} with the kbit upcast gives attention fp32 "
                             "inputs (an fp32 residual stream), which flash attention does not take (transformers' "
                             "cast back to the compute dtype is not modelled): add --no-kbit-upcast or use --attn sdpa")
        if spec.check is not None:
            spec.check(self, flag)

    # ------------------------------------------------------------------ the registry rows it names
    @property
    def precision_spec(self) -> Precision:
        return PRECISIONS[self.precision]

    @property
    def optimizer_spec(self) -> OptimizerSpec:
        return OPTIMIZERS[self.optimizer]

    @property
    def ckpt_offload_spec(self) -> CkptOffload:
        """--ckpt-offload's row (llmem.setup.checkpointing): a library's offloaded checkpoint, or none."""
        return ckpt_offload(self.ckpt_offload)

    @property
    def quant_spec(self) -> QuantBaseSpec:
        """The frozen base's row (llmem.setup.quant_bases): what it is; llmem.memory.quant how it is stored."""
        return quant_base_spec(self.quant_base)

    @property
    def attention_spec(self) -> AttentionSpec:
        """The attention kernel asked for (llmem.setup.attention); the model may run another (no SDPA class)."""
        return ATTENTIONS[self.attn]

    @property
    def objective_spec(self) -> ObjectiveSpec:
        return objective_spec(self.objective)

    # ------------------------------------------------------------------ bytes per element
    @property
    def mixed(self) -> bool:
        """fp32 master weights with low-precision compute (autocast / FSDP MixedPrecisionPolicy)."""
        return self.precision_spec.mixed

    @property
    def peft(self) -> bool:
        """The base is frozen and peft adds trainable adapters / prompts (--lora-rank or --peft-config)."""
        return bool(self.lora_rank or self.peft_config)

    @property
    def param_bytes(self) -> int:
        """Bytes per element of the stored parameters, their gradients and optimizer states."""
        return self.precision_spec.param_bytes

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of activations (matmul outputs)."""
        return self.precision_spec.compute_bytes

    @property
    def compute_dtype(self) -> str:
        return self.precision_spec.compute_dtype

    @property
    def gather_bytes(self) -> int:
        """Bytes per element FSDP2 all-gathers (MixedPrecisionPolicy.param_dtype under *-mixed)."""
        return self.compute_bytes if self.mixed else self.param_bytes

    @property
    def reduce_bytes(self) -> int:
        """Bytes per element FSDP2 reduce-scatters (reduce_dtype fp32 under *-mixed)."""
        return 4 if self.mixed else self.param_bytes

    def stored_bytes(self, trainable: bool) -> int:
        """Bytes per element of a stored parameter: trained ones in param_bytes; frozen ones (LoRA's base) in the
        compute dtype, as fine-tuning scripts load them (no fp32 master copy of weights that never change). Under a
        quantised base, the unquantised frozen ones (embeddings, norms, lm_head) are fp32: peft's
        prepare_model_for_kbit_training, which the QLoRA recipe runs, upcasts them."""
        if trainable:
            return self.param_bytes
        return 4 if self.kbit_upcasts else self.compute_bytes

    @property
    def kbit_upcasts(self) -> bool:
        """peft's prepare_model_for_kbit_training runs: a bitsandbytes base with the upcast (--no-kbit-upcast: not).
        torchtune, which runs torchao's NF4 base, has no such step: its frozen parameters stay in the model dtype."""
        return self.quant_spec.kbit_prep and self.kbit_upcast

    @property
    def fsdp_cpu_offload(self) -> bool:
        """FSDP2's CPUOffloadPolicy (--offload-param under fsdp / zero2 / fsdp+tp): the sharded parameters, their
        gradients and the optimizer live in pinned host memory; the device holds only what the step gathers."""
        return self.offload_param and method_spec(self.method).shards_model_states

    @property
    def steps_on_host(self) -> bool:
        """The optimizer's states and update are on the host: --offload-optimizer, or implied by CPUOffloadPolicy
        (FSDP2 has no optimizer-only offload: its sharded parameters and gradients are host tensors already)."""
        return self.offload_optimizer or self.fsdp_cpu_offload

    def to_dict(self) -> dict:
        """Every field by its flat name, in FLAT_ORDER: the `setup` of every --json (SHOWN_WHEN_SET's only where
        set)."""
        return {name: getattr(self, name) for name in FLAT_ORDER
                if name not in SHOWN_WHEN_SET or getattr(self, name) != LATER_DEFAULTS[name]}


def option_fields() -> list:
    """The dataclass fields that carry a command-line Option, in FLAT_ORDER: what the CLI and the web page build
    their flags and form from."""
    own = {f.name: f for f in fields(TrainingSetup) if f.name not in SECTIONS}
    nested = {f.name: f for section in SECTIONS.values() for f in fields(section)}
    return [own.get(name) or nested[name] for name in FLAT_ORDER]


def _flat_alias(name: str) -> property:
    """`setup.<name>` reads `setup.<section>.<name>`."""
    return property(attrgetter(f"{SECTION_OF[name]}.{name}"), doc=f"{SECTION_OF[name]}.{name}")


for _name in SECTION_OF:
    setattr(TrainingSetup, _name, _flat_alias(_name))
