"""The training set-up a user asks about, as one plain frozen dataclass, and its validation.

Each field carries its command-line option in its metadata (`Option`): llmem.cli builds the argument parser from
these fields, so a new field is a new flag without a second list to keep in step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from llmem.errors import LlmemError
from llmem.setup.attention import ATTENTIONS, AttentionSpec
from llmem.setup.checkpointing import ac_policy
from llmem.setup.context_parallel import check_context_parallel
from llmem.setup.deepspeed import HIDDEN_SIZE_RULES, ZERO_FIELDS
from llmem.setup.expert_parallel import check_expert_parallel
from llmem.setup.methods import canonical_method, method_spec
from llmem.setup.objectives import (
    DPO_LOSS_TYPES,
    KTO_LOSS_TYPES,
    OBJECTIVE_GROUP,
    OBJECTIVES,
    REF_DTYPES,
    ObjectiveSpec,
    check_objective,
    objective_spec,
)
from llmem.setup.optimizers import OPTIMIZERS, OptimizerSpec
from llmem.setup.pipeline import PIPELINE_SCHEDULES, PP_METHODS, check_pipeline, check_schedule_method
from llmem.setup.precision import PRECISIONS, Precision
from llmem.setup.quant_bases import QUANT_SWITCHES, QuantBaseSpec, quant_base_spec

# TrainingSetup.adapter_dtype: what peft's get_peft_model(autocast_adapter_dtype=True) (its default, TRL's and
# axolotl's) does - fp16/bf16 adapter weights upcast to fp32 - or the adapters in the base model's dtype
# (autocast_adapter_dtype=False; torchtune's LoRA modules, built in the model's dtype)
ADAPTER_DTYPES = ("fp32", "base")
LORA_ALL_LINEAR = "all-linear"
# Bounds of one micro-batch: far past any real run (the largest contexts are ~10M tokens), and small enough that a
# step's tensors stay below 2**64 bytes (CUDA's size_t) on real models; the allocator model refuses the rest
MAX_BATCH_SIZE = 1 << 20
MAX_SEQ_LEN = 1 << 24
MAX_STEP_TOKENS = 1 << 28
MAX_COUNT = 1 << 48            # a DeepSpeed size in elements: 2**48 bf16 elements are 512 TiB

# Option.group: the sections of --help
LAYOUT, STEP, OPTIMIZER, ACTIVATIONS, ADAPTERS, MODEL, DEEPSPEED = "layout", "step", "optimizer", "activations", \
    "adapters", "model", "deepspeed"


@dataclass(frozen=True)
class Option:
    """How a TrainingSetup field is asked for on the command line.

    kind: "value" (a flag taking a value of `type`), "switch" (a flag that sets True), "switches" (flags that each
    set the value they map to, at most one of them), "negate" (a flag that sets False), "positional".
    """
    help: str
    group: str
    kind: str = "value"
    flag: str | None = None                  # default: --field-name
    type: Any = str
    metavar: str | None = None
    cli_default: Any = ...                   # the parser's default when it differs from the field's (None: unset)
    switches: tuple[tuple[str, Any, str], ...] = ()   # kind "switches": (flag, value, help)
    noun: str = ""                               # kind "switches": what one chooses ("choose one <noun>")
    implies: tuple[tuple[str, Any], ...] = ()    # given: these fields take these values too
    requires: tuple[str, Any] | None = None      # kind "negate": only with field == value


def count(text: str) -> int:
    """A count of elements as DeepSpeed's configs write them: 500000000, 5e8 or 5_0000_0000."""
    if isinstance(text, int) and not isinstance(text, bool):
        return count(str(text))
    try:
        value = float(str(text).replace("_", ""))
    except ValueError:
        raise LlmemError(f"{text!r} is not a count: write e.g. 500000000 or 5e8") from None
    if not math.isfinite(value) or value != int(value) or value < 0:
        raise LlmemError(f"{text!r} is not a whole number of elements >= 0: write e.g. 500000000 or 5e8")
    if value > MAX_COUNT:
        raise LlmemError(f"{text!r} elements is more than any GPU holds (at most 2**48): write e.g. 500000000 or 5e8")
    return int(value)


def count_or_auto(text: str) -> int | str:
    """A count, or "auto": the value HF's Trainer and accelerate fill from the model's hidden size."""
    return "auto" if str(text).strip().lower() == "auto" else count(text)


def option(default: Any, help: str, group: str, **kw: Any) -> Any:
    return field(default=default, metadata={"option": Option(help, group, **kw)})


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


SHAPE_FIELDS = ("batch_size", "seq_len")     # a micro-batch's shape (TrainingSetup.shape_free: the rest)


@dataclass(frozen=True)
class TrainingSetup:
    """One fine-tuning step as the user describes it. Sizes are per GPU (batch_size is the micro-batch)."""
    model: str = field(metadata={"option": Option(
        "catalog name, hub id, path to config.json, or a model folder", MODEL, kind="positional",
        metavar="MODEL")})
    method: str = option("single", "single, ddp (cdp), fsdp (zero3, adp), zero2, tp, fsdp+tp (dp+tp), DeepSpeed's "
                         "ds-zero1/2/3; default single on one GPU, fsdp on more", LAYOUT, cli_default=None)
    gpus: int = option(1, "number of GPUs (default 1)", LAYOUT, type=int)
    gpus_per_node: int | None = option(None, "GPUs per node (default: min(gpus, 8))", LAYOUT, type=int)
    tp: int | None = option(None, "tensor-parallel degree (default: all GPUs under tp, 2 under fsdp+tp)",
                            LAYOUT, type=int)
    batch_size: int = option(1, "per-GPU micro-batch (default 1)", STEP, type=int)
    seq_len: int = option(2048, "tokens per sample (default 2048)", STEP, type=int)
    precision: str = option("bf16-mixed", f"{', '.join(PRECISIONS)} (default bf16-mixed)", STEP)
    optimizer: str = option("adamw", ", ".join(f"{o.name} ({o.summary})" for o in OPTIMIZERS.values())
                            + " (default adamw)", OPTIMIZER)
    grad_ckpt: bool = option(False, "gradient checkpointing of every decoder layer", ACTIVATIONS, kind="switch")
    attn: str = option("sdpa", "sdpa, flash (flash_attention_2; fp16/bf16) or eager (default sdpa)", ACTIVATIONS)
    gpu: str = option("A100-80GB", "GPU type (see `llmem gpus`; default A100-80GB)", LAYOUT)
    gpu_memory: str | None = option(None, "GPU memory, e.g. 80GiB (overrides the catalog)", LAYOUT)
    cuda_context: str | None = option(None, "CUDA context size, e.g. 500MiB (overrides the assumption)", LAYOUT)
    expandable_segments: bool = option(False, "PYTORCH_CUDA_ALLOC_CONF=expandable_segments", LAYOUT, kind="switch")
    offload_optimizer: bool = option(False, "optimizer states and update on the CPU", OPTIMIZER, kind="switch")
    lora_rank: int = option(0, "LoRA adapters of this rank (base frozen); 0: full fine-tuning", ADAPTERS, type=int)
    lora_alpha: int = option(16, "LoRA alpha (scaling; no effect on memory)", ADAPTERS, type=int)
    lora_targets: str = option("q_proj,v_proj", "modules to adapt, comma-separated, or all-linear "
                               "(default q_proj,v_proj)", ADAPTERS)
    lora_dropout: float = option(0.0, "LoRA dropout on the adapters' input (default 0)", ADAPTERS, type=float)
    peft_config: str | None = option(None, "adapter_config.json (or its folder) applied with peft: LoRA, DoRA, IA3, "
                                     "prompt/prefix tuning", ADAPTERS, metavar="PATH")
    trust_remote_code: bool = option(False, "let transformers run the model's own code", MODEL, kind="switch")
    optimizer_in_backward: bool = option(False, "step each parameter in its post-accumulate-grad hook and free its "
                                         "gradient (single GPU)", OPTIMIZER, kind="switch")
    quant_base: str = option("none", "frozen base quantised (bitsandbytes or torchao)", ADAPTERS, kind="switches",
                             noun="quantised base", switches=QUANT_SWITCHES)
    kbit_upcast: bool = option(True, "quantised base without peft's prepare_model_for_kbit_training upcast of the "
                               "unquantised frozen parameters (embeddings, norms, lm_head) to fp32", ADAPTERS,
                               kind="negate", flag="--no-kbit-upcast")
    adapter_dtype: str = option("fp32", "fp32 (peft's autocast_adapter_dtype, its default: adapters in fp32 also on "
                                "a bf16/fp16 base) or base (adapters in the base's dtype, torchtune's LoRA)",
                                ADAPTERS)
    double_quant: bool = option(True, "--qlora without double quantisation (fp32 absmax per 64-block)", ADAPTERS,
                                kind="negate", flag="--no-double-quant", requires=("quant_base", "nf4"))
    ckpt_every: int = option(1, "checkpoint every K-th decoder layer (index %% K == 0); implies --grad-ckpt",
                             ACTIVATIONS, type=int, flag="--grad-ckpt-every", metavar="K", cli_default=None,
                             implies=(("grad_ckpt", True),))
    offload_activations: bool = option(False, "keep saved activations in pinned CPU memory between forward and "
                                       "backward", ACTIVATIONS, kind="switch")
    fused_ce: bool = option(False, "fused linear cross-entropy in chunks of tokens (no full fp32 logits)",
                            ACTIVATIONS, kind="switch")
    packing: bool = option(False, "samples packed into rows (position_ids restart)", ACTIVATIONS, kind="switch")
    # DeepSpeed's ZeRO section (methods ds-zero1/2/3; None: DeepSpeed's default, llmem.setup.deepspeed)
    reduce_bucket_size: int | str | None = option(None, "elements per gradient bucket (IPG buffer; DeepSpeed's "
                                                  "default 5e8; auto: HF's hidden_size^2)", DEEPSPEED,
                                                  type=count_or_auto)
    overlap_comm: bool | None = option(None, "reduce gradients while backward runs (DeepSpeed's default: on for "
                                       "stage 3 only); stages 1-2 then keep two IPG buffers", DEEPSPEED,
                                       kind="switches", noun="overlap setting", switches=(
                                           ("--overlap-comm", True, "overlap_comm: true (ds-zero*)"),
                                           ("--no-overlap-comm", False, "overlap_comm: false (ds-zero*)")))
    prefetch_bucket_size: int | str | None = option(None, "ds-zero3: elements prefetched ahead (stage3_prefetch_"
                                                    "bucket_size; default 5e7; auto: HF's 0.9 x hidden_size^2)",
                                                    DEEPSPEED, type=count_or_auto)
    param_persistence_threshold: int | str | None = option(None, "ds-zero3: parameters of at most this many "
                                                           "elements stay gathered (default 1e5; auto: HF's 10 x "
                                                           "hidden_size)", DEEPSPEED, type=count_or_auto)
    max_live_parameters: int | None = option(None, "ds-zero3: most gathered elements before prefetching stops "
                                             "(default 1e9)", DEEPSPEED, type=count)
    max_reuse_distance: int | None = option(None, "ds-zero3: a parameter used again within this many elements "
                                            "stays gathered (default 1e9)", DEEPSPEED, type=count)
    sub_group_size: int | None = option(None, "elements per optimizer sub-group (the step's fp32 gradient "
                                        "transient under ds-zero3; default 1e9)", DEEPSPEED, type=count)
    offload_param: bool = option(False, "parameters sharded in pinned CPU memory: ds-zero3's offload_param; under "
                                 "fsdp / zero2 / fsdp+tp FSDP2's CPUOffloadPolicy (gradients and the optimizer "
                                 "step on the host too)", DEEPSPEED, kind="switch")
    # The training objective (llmem.setup.objectives): TRL's trainers' names and defaults
    objective: str = option("sft", f"{', '.join(OBJECTIVES)}: sft (one model's causal-LM loss), TRL's DPOTrainer "
                            "(chosen and rejected in one forward against a reference) or KTOTrainer (unpaired "
                            "completions against a reference; default sft)", OBJECTIVE_GROUP)
    loss_type: str | None = option(None, f"the trainer's loss_type (dpo: {', '.join(DPO_LOSS_TYPES[:4])}, ..., "
                                   f"default sigmoid; kto: {', '.join(KTO_LOSS_TYPES)}, default kto)",
                                   OBJECTIVE_GROUP)
    precompute_ref_log_probs: bool = option(False, "dpo/kto: the reference's log-probs computed before training "
                                            "(precompute_ref_log_probs): no reference in the step",
                                            OBJECTIVE_GROUP, kind="switch")
    ref_dtype: str = option("policy", f"{', '.join(REF_DTYPES)}: the reference copy's dtype (policy: TRL's "
                            "dtype=model.dtype, fp32 under *-mixed; compute: the compute dtype)", OBJECTIVE_GROUP)
    prompt_len: int = option(0, "dpo/kto: prompt tokens at the start of each --seq-len sequence (not scored: TRL's "
                             "labels are -100 there; default 0, every token but the first scored)", OBJECTIVE_GROUP,
                             type=int)
    max_length: int | None = option(None, "dpo/kto: TRL's max_length, to which it truncates each sequence (default "
                                    "1024, the configs'); --seq-len is the length after truncation",
                                    OBJECTIVE_GROUP, type=int)
    # tensor parallelism as torchtitan applies it (parallelize_llama's plan; plain Megatron TP without these)
    sequence_parallel: bool = option(False, "tp / fsdp+tp: SequenceParallel on the norms, the residual stream "
                                     "sharded along the sequence between the TP regions (all-gather before "
                                     "attention / MLP, reduce-scatter after)", LAYOUT, kind="switch")
    loss_parallel: bool = option(False, "tp / fsdp+tp: vocab-sharded logits, the cross-entropy on them under "
                                 "torch's loss_parallel() (no full-vocab gather)", LAYOUT, kind="switch")
    # activation checkpointing's policy (llmem.setup.checkpointing): full, or torchtitan's op-level selective
    ac_policy: str = option("full", "what a checkpointed layer keeps: full (its input only) or op (torchtitan's "
                            "op-level selective checkpointing: every other matmul output and the SDPA outputs "
                            "saved too); implies --grad-ckpt (default full)", ACTIVATIONS, cli_default=None,
                            implies=(("grad_ckpt", True),))
    # The generation objectives' options (llmem.setup.generation): GRPOConfig's names and defaults
    num_generations: int | None = option(None, "grpo / rloo: completions per prompt (GRPOConfig's default 8, "
                                         "RLOOConfig's 2); must divide "
                                         "--gpus x --batch-size", OBJECTIVE_GROUP, type=int)
    max_completion_length: int | None = option(None, "grpo / rloo: completion tokens (default 512, the configs'); "
                                               "--seq-len is the prompt plus these", OBJECTIVE_GROUP, type=int)
    beta: float | None = option(None, "grpo / rloo: the KL coefficient (default 0.0, GRPOConfig's: no reference "
                                "model; RLOOConfig's 0.05; > 0 scores a reference)", OBJECTIVE_GROUP, type=float)
    use_vllm: bool = option(False, "grpo / rloo: generate with vLLM (its pool modelled from vLLM's accounting, not "
                            "run; see --vllm-mode)", OBJECTIVE_GROUP, kind="switch")
    # FSDP2's HSDP: replicate across groups x shard within each (torchtitan's data_parallel_replicate_degree)
    dp_replicate: int = option(1, "fsdp / zero2 / fsdp+tp: HSDP, the data-parallel ranks as this many replicas, "
                               "each FSDP-sharded over dp / N ranks (a 2-D mesh; default 1: shard over all dp "
                               "ranks)", LAYOUT, type=int)
    # pipeline parallelism (llmem.setup.pipeline): torch.distributed.pipelining's stages as torchtitan splits them
    pp: int = option(1, "pipeline-parallel degree: the decoder split into this many stages, one per rank "
                     "(single: --gpus = --pp; fsdp: dp x pp; default 1)", LAYOUT, type=int)
    pp_schedule: str = option("1f1b", f"{', '.join(PIPELINE_SCHEDULES)}: torch's pipeline schedule (default 1f1b, "
                              "torchtitan's)", LAYOUT)
    pp_microbatches: int | None = option(None, "micro-batches --batch-size is split into under --pp (default: "
                                         "--batch-size, torchtitan's micro-batch size 1)", LAYOUT, type=int)
    # context parallelism (llmem.setup.context_parallel): torch's ring attention, seq_len / cp tokens per rank
    cp: int = option(1, "context-parallel degree: each sample's tokens split over this many ranks (torch's ring "
                     "attention, FSDP2 over dp x cp; --gpus = dp x cp; fsdp only; default 1)", LAYOUT, type=int)
    # TRL's colocated vLLM (--use-vllm: GRPOConfig's vllm_* fields; llmem.memory.vllm models its pool)
    vllm_mode: str | None = option(None, "grpo --use-vllm: colocate (vLLM in each training process, TRL 1.16's "
                                   "default) or server (vLLM on other GPUs: nothing of it on these)", OBJECTIVE_GROUP)
    vllm_gpu_memory_utilization: float | None = option(None, "grpo --use-vllm colocate: the share of device memory "
                                                       "vLLM takes (GRPOConfig's default 0.3)", OBJECTIVE_GROUP,
                                                       type=float)
    vllm_enable_sleep_mode: bool = option(False, "grpo --use-vllm colocate: vLLM released between generations "
                                          "(TRL's sleep(level=2): weights and KV cache)", OBJECTIVE_GROUP,
                                          kind="switch")
    vllm_max_model_length: int | None = option(None, "grpo --use-vllm colocate: vLLM's max_model_len (default: "
                                               "the model's max_position_embeddings, as vLLM infers it)",
                                               OBJECTIVE_GROUP, type=int)
    # --pp-schedule interleaved-1f1b: stages per pipeline rank (llmem.setup.pipeline; torchtitan's stages_per_rank)
    pp_virtual_stages: int | None = option(None, "interleaved-1f1b: stages per pipeline rank, rank r holding stages "
                                           "r, r + pp, ... (default 2, torchtitan's)", LAYOUT, type=int)
    # expert parallelism (llmem.setup.expert_parallel): torchtitan's EP under FSDP2, dp_shard = efsdp x ep
    ep: int = option(1, "expert-parallel degree: the routed experts split over this many ranks (torchtitan's "
                     "all-to-all dispatch; FSDP2 over dp, the experts over dp / ep; fsdp only; default 1)", LAYOUT,
                     type=int)
    ep_imbalance: float = option(1.0, "--ep: the busiest rank's routed rows over the balanced tokens x top_k "
                                 "(a stated assumption; default 1.0, balanced routing)", LAYOUT, type=float)
    # FSDP2's reshard_after_forward as an int (llmem.estimator.post_forward; None: the method's own bool, fsdp's
    # True, zero2's False)
    reshard_after_forward: int | None = option(None, "fsdp: FSDP2's reshard_after_forward=N, each decoder layer "
                                               "resharded after forward to N ranks (keeps 1/N of it, all-gathered "
                                               "over N in backward); N divides the shard ranks, 1 < N < dp_shard "
                                               "(default: fsdp's True)", LAYOUT, type=int, metavar="N")

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
        if self.lora_dropout and not self.lora_rank:
            raise LlmemError("--lora-dropout needs --lora-rank (a --peft-config brings its own lora_dropout)")
        if self.attn not in ATTENTIONS:
            raise LlmemError(f"unknown attention {self.attn!r}: choose one of {', '.join(ATTENTIONS)}")
        if self.attention_spec.low_precision_only and not self.precision_spec.low_precision:
            raise LlmemError(f"--attn {self.attn} needs fp16 or bf16 compute (flash attention has no fp32 kernel)")
        if self.ckpt_every < 1:
            raise LlmemError(f"--grad-ckpt-every must be >= 1, got {self.ckpt_every}")
        self._check_ac_policy()
        if self.adapter_dtype not in ADAPTER_DTYPES:
            raise LlmemError(f"unknown --adapter-dtype {self.adapter_dtype!r}: choose one of {', '.join(ADAPTER_DTYPES)}")
        self._check_quant_base()
        self._check_deepspeed()
        check_objective(self)
        self._check_replicate()
        self._check_pipeline()
        check_context_parallel(self)
        check_expert_parallel(self)

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

    @property
    def shape_free(self) -> tuple:
        """The set-up less its micro-batch shape (SHAPE_FIELDS): the key of what does not depend on it."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.name not in SHAPE_FIELDS)

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
            object.__setattr__(self, "grad_ckpt", True)   # implied, as the flag implies it

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
                object.__setattr__(self, name, count_or_auto(value) if name in HIDDEN_SIZE_RULES else count(value))
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
        return asdict(self)
