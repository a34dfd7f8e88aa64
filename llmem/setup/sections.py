"""The sections of a training set-up, each a plain frozen dataclass whose fields carry their command-line `Option`
(llmem.setup.flags): `llmem.setup.training.TrainingSetup` holds one of each, the CLI's flags and `--help` groups are
built from their fields, and the `--from` readers fill them. A field is documented once, here.

`SECTIONS` registers them by the name TrainingSetup holds each under."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from llmem.setup.eval_phase import EVAL_KEEPS
from llmem.setup.flags import (
    ACTIVATIONS,
    ADAPTERS,
    DEEPSPEED,
    IMAGES,
    JOB,
    LAYOUT,
    OPTIMIZER,
    STEP,
    count,
    count_or_auto,
    option,
)
from llmem.setup.float8 import FLOAT8_RECIPES
from llmem.setup.job_phases import DEFAULT, LOAD_PATHS, SAVE_KINDS
from llmem.setup.objectives import (
    DPO_LOSS_TYPES,
    KTO_LOSS_TYPES,
    OBJECTIVE_GROUP,
    OBJECTIVES,
    REF_DTYPES,
    SFT_LOSS_TYPES,
)
from llmem.setup.optimizers import OPTIMIZERS
from llmem.setup.pipeline import PIPELINE_SCHEDULES
from llmem.setup.precision import PRECISIONS
from llmem.setup.quant_bases import QUANT_SWITCHES

if TYPE_CHECKING:
    from llmem.setup.layout import Layout

# AdaptersConfig.adapter_dtype: what peft's get_peft_model(autocast_adapter_dtype=True) (its default, TRL's and
# axolotl's) does - fp16/bf16 adapter weights upcast to fp32 - or the adapters in the base model's dtype
# (autocast_adapter_dtype=False; torchtune's LoRA modules, built in the model's dtype)
ADAPTER_DTYPES = ("fp32", "base")
# ActivationsConfig.logits_dtype: the dtype the causal-LM loss reads its logits in - fp32 (transformers'
# ForCausalLMLoss upcasts them, logits.float()) or the model's (cross_entropy on the lm_head's output as it is, as a
# trainer computing its own loss on bf16 logits does)
LOGITS_DTYPES = ("fp32", "model")
LORA_ALL_LINEAR = "all-linear"
REGEX_TARGETS = "re:"   # --lora-targets "re:PATTERN": peft's target_modules as one string (a regular expression)


def lora_target_regex(targets: str) -> str | None:
    """--lora-targets "re:PATTERN" -> PATTERN, which peft re.fullmatch-es against each module's full name (a
    string target_modules: check_target_module_exists); None for module names."""
    return targets[len(REGEX_TARGETS):] if targets.startswith(REGEX_TARGETS) else None


@dataclass(frozen=True, kw_only=True)
class ParallelismConfig:
    """How the GPUs are used: the method, the mesh's degrees (tensor, pipeline, context, expert, HSDP
    replicas) and the styles of its tensor-parallel plan and FSDP2 resharding. Resolved once into a
    `llmem.setup.layout.Layout` (torchtitan's ParallelismConfig resolved into ParallelDims)."""
    method: str = option("single", "single, ddp (cdp), fsdp (zero3, adp), zero2, tp, fsdp+tp (dp+tp), DeepSpeed's "
                         "ds-zero1/2/3; default single on one GPU, fsdp on more", LAYOUT, cli_default=None)
    gpus: int = option(1, "number of GPUs (default 1)", LAYOUT, type=int)
    gpus_per_node: int | None = option(None, "GPUs per node (default: min(gpus, 8))", LAYOUT, type=int)
    tp: int | None = option(None, "tensor-parallel degree (default: all GPUs under tp, 2 under fsdp+tp)",
                            LAYOUT, type=int)
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
    # --pp-schedule interleaved-1f1b: stages per pipeline rank (llmem.setup.pipeline; torchtitan's stages_per_rank)
    pp_virtual_stages: int | None = option(None, "interleaved-1f1b: stages per pipeline rank, rank r holding stages "
                                           "r, r + pp, ... (default 2, torchtitan's)", LAYOUT, type=int)
    # context parallelism (llmem.setup.context_parallel): torch's ring attention, seq_len / cp tokens per rank
    cp: int = option(1, "context-parallel degree: each sample's tokens split over this many ranks (torch's ring "
                     "attention, FSDP2 over dp x cp; --gpus = dp x cp; fsdp only; default 1)", LAYOUT, type=int)
    # expert parallelism (llmem.setup.expert_parallel): torchtitan's EP under FSDP2, dp_shard = efsdp x ep
    ep: int = option(1, "expert-parallel degree: the routed experts split over this many ranks (torchtitan's "
                     "all-to-all dispatch; FSDP2 over dp, the experts over dp / ep; fsdp only; default 1)", LAYOUT,
                     type=int)
    ep_imbalance: float = option(1.0, "--ep: the busiest rank's routed rows over the balanced tokens x top_k "
                                 "(a stated assumption; default 1.0, balanced routing)", LAYOUT, type=float)
    # tensor parallelism as torchtitan applies it (parallelize_llama's plan; plain Megatron TP without these)
    sequence_parallel: bool = option(False, "tp / fsdp+tp: SequenceParallel on the norms, the residual stream "
                                     "sharded along the sequence between the TP regions (all-gather before "
                                     "attention / MLP, reduce-scatter after)", LAYOUT, kind="switch")
    loss_parallel: bool = option(False, "tp / fsdp+tp: vocab-sharded logits, the cross-entropy on them under "
                                 "torch's loss_parallel() (no full-vocab gather)", LAYOUT, kind="switch")
    # FSDP2's reshard_after_forward as an int (llmem.estimator.post_forward; None: the method's own bool, fsdp's
    # True, zero2's False)
    reshard_after_forward: int | None = option(None, "fsdp: FSDP2's reshard_after_forward=N, each decoder layer "
                                               "resharded after forward to N ranks (keeps 1/N of it, all-gathered "
                                               "over N in backward); N divides the shard ranks, 1 < N < dp_shard "
                                               "(default: fsdp's True)", LAYOUT, type=int, metavar="N")
    # torchtune's custom_sharded_layers ['tok_embeddings', 'output'] (shard_model): the input embedding and the
    # lm_head fully_shard units of their own, gathered around their own forward and backward only
    shard_embeddings: bool = option(False, "fsdp / zero2: the input embedding and the lm_head FSDP2 units of their "
                                    "own (torchtune's custom_sharded_layers), not kept gathered with the root "
                                    "from forward to backward; untied embeddings only", LAYOUT, kind="switch")

    @classmethod
    def from_layout(cls, layout: Layout, given: ParallelismConfig, microbatches: int = 1) -> ParallelismConfig:
        """The section a set-up runs `layout` with, the rest of `given` kept: the layout's method, world and degrees
        (tp None where the method has no tensor parallelism), --sequence-parallel / --loss-parallel on its
        tensor-parallel layouts only, under a pipeline `microbatches` per step and the given virtual stages, under
        expert parallelism the given routing imbalance. The layout is resolved once (llmem.setup.layout) and its
        values written into a set-up here only: the planner hands the layout itself down
        (llmem.model.resolved.resolve's `layout`), as torchtitan resolves its ParallelismConfig once into
        ParallelDims."""
        tp = layout.spec.has_tp
        piped = layout.pp > 1
        return replace(given, method=layout.method, gpus=layout.world_size, tp=layout.tp if tp else None,
                       dp_replicate=layout.replicas, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                       pp_microbatches=microbatches if piped else None,
                       pp_virtual_stages=given.pp_virtual_stages if piped else None,
                       ep_imbalance=given.ep_imbalance if layout.ep > 1 else 1.0,
                       sequence_parallel=given.sequence_parallel and tp, loss_parallel=given.loss_parallel and tp)

    def recorded(self, layout: Layout) -> ParallelismConfig:
        """The section as a result's record shows it (the `setup` of every --json): the layout's method and world,
        its tensor-parallel degree (1 without tensor parallelism) and the node size it runs with."""
        return replace(self, method=layout.method, gpus=layout.world_size, tp=layout.tp,
                       gpus_per_node=layout.gpus_per_node)

@dataclass(frozen=True, kw_only=True)
class HardwareConfig:
    """The GPU the step runs on and how its caching allocator is configured."""
    gpu: str = option("A100-80GB", "GPU type (see `llmem gpus`; default A100-80GB); auto: this machine's GPU, fits "
                      "decided against the memory free on it now", LAYOUT)
    gpu_memory: str | None = option(None, "GPU memory, e.g. 80GiB (overrides the catalog)", LAYOUT)
    cuda_context: str | None = option(None, "CUDA context size, e.g. 500MiB (overrides the assumption)", LAYOUT)
    expandable_segments: bool = option(False, "PYTORCH_CUDA_ALLOC_CONF=expandable_segments", LAYOUT, kind="switch")

@dataclass(frozen=True, kw_only=True)
class StepConfig:
    """One training step's micro-batch and its dtypes (sizes are per GPU: batch_size is the micro-batch)."""
    batch_size: int = option(1, "per-GPU micro-batch (default 1)", STEP, type=int)
    seq_len: int = option(2048, "tokens per sample (default 2048)", STEP, type=int)
    precision: str = option("bf16-mixed", f"{', '.join(PRECISIONS)} (default bf16-mixed)", STEP)
    # torchao's float8 training (llmem.setup.float8): convert_to_float8_training's Float8Linear, by recipe
    float8: str = option("none", f"torchao's float8 training, Float8Linear's recipe: none, "
                         f"{', '.join(FLOAT8_RECIPES)} (torchtitan's model.converters = [\"float8\"]; bf16 weights "
                         "or FSDP2's bf16 gather; default none)", STEP, metavar="RECIPE")
    float8_all_gather: bool = option(False, "--float8 tensorwise under fsdp: FSDP2 all-gathers the converted weights "
                                     "in float8 (enable_fsdp_float8_all_gather)", STEP, kind="switch")
    # a vision-language model's images (llmem.model.vision_inputs): the language model runs seq_len text tokens and
    # their visual tokens, as the model's processor resizes and patches them
    images_per_sample: int = option(0, "images in each sample (vision-language models; default 0)", IMAGES, type=int,
                                    metavar="N")
    image_size: str | None = option(None, "the images' height x width in pixels before the processor resizes them, "
                                    "e.g. 1024x768", IMAGES, metavar="HxW")
    max_pixels: int | None = option(None, "the processor's max_pixels (default: the model's shipped "
                                    "preprocessor_config.json; Qwen's smart resize: Gemma 3 resizes every image to "
                                    "896x896 whatever the bound)", IMAGES, type=int)

@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The optimizer (a row of `llmem.setup.optimizers.OPTIMIZERS`), where it steps and when."""
    optimizer: str = option("adamw", ", ".join(f"{o.name} ({o.summary})" for o in OPTIMIZERS.values())
                            + " (default adamw)", OPTIMIZER)
    offload_optimizer: bool = option(False, "optimizer states and update on the CPU", OPTIMIZER, kind="switch")
    optimizer_in_backward: bool = option(False, "step each parameter in its post-accumulate-grad hook and free its "
                                         "gradient (single GPU)", OPTIMIZER, kind="switch")

@dataclass(frozen=True, kw_only=True)
class ActivationsConfig:
    """What the forward keeps for backward: checkpointing and its policy, the attention kernel, the loss's
    logits, packing and activation offloading."""
    grad_ckpt: bool = option(False, "gradient checkpointing of every decoder layer", ACTIVATIONS, kind="switch")
    ckpt_every: int = option(1, "checkpoint every K-th decoder layer (index %% K == 0); implies --grad-ckpt",
                             ACTIVATIONS, type=int, flag="--grad-ckpt-every", metavar="K", cli_default=None,
                             implies=(("grad_ckpt", True),))
    # activation checkpointing's policy (llmem.setup.checkpointing): full, or torchtitan's op-level selective
    ac_policy: str = option("full", "what a checkpointed layer keeps: full (its input only) or op (torchtitan's "
                            "op-level selective checkpointing: every other matmul output and the SDPA outputs "
                            "saved too); implies --grad-ckpt (default full)", ACTIVATIONS, cli_default=None,
                            implies=(("grad_ckpt", True),))
    # torch.utils.checkpoint's two implementations (CheckpointFunction, _checkpoint_without_reentrant_generator)
    ckpt_reentrant: bool = option(False, "checkpoint with torch's reentrant implementation (use_reentrant=True, "
                                  "transformers 4's default; transformers 5's is non-reentrant): its forward runs "
                                  "under no_grad; implies --grad-ckpt", ACTIVATIONS, kind="switch",
                                  implies=(("grad_ckpt", True),))
    # llmem.setup.checkpointing.CKPT_OFFLOADS: a library's offloaded checkpoint (Unsloth's Functions)
    ckpt_offload: str = option("none", "checkpoint with a library's offloading autograd Function: unsloth "
                               "(use_gradient_checkpointing=\"unsloth\": inputs over 2 MiB to pinned host memory, two "
                               "device staging buffers, the last layer's input kept), unsloth-single (one staging "
                               "buffer) or unsloth-classic (LLaMA-Factory's use_unsloth_gc, axolotl's "
                               "activation_offloading: legacy); implies --grad-ckpt (default none)", ACTIVATIONS,
                               metavar="NAME")
    attn: str = option("sdpa", "sdpa, flash (flash_attention_2; fp16/bf16) or eager (default sdpa)", ACTIVATIONS)
    offload_activations: bool = option(False, "keep saved activations in pinned CPU memory between forward and "
                                       "backward", ACTIVATIONS, kind="switch")
    fused_ce: bool = option(False, "fused linear cross-entropy in chunks of tokens (no full fp32 logits)",
                            ACTIVATIONS, kind="switch")
    packing: bool = option(False, "samples packed into rows (position_ids restart)", ACTIVATIONS, kind="switch")
    # Liger-Kernel's autograd Functions over HF's modules (llmem.setup.liger)
    liger: str = option("none", "Liger-Kernel's kernels over HF's modules, comma-separated: rms_norm, swiglu, rope "
                        "(llama, mistral, qwen2), or auto (rms_norm, swiglu and rope where llmem models the family's patch, "
                        "as use_liger_kernel applies them); its fused_linear_cross_entropy is --fused-ce (default none)",
                        ACTIVATIONS,
                        metavar="KERNELS")
    compile: bool = option(False, "torch.compile of each decoder layer, as torchtune's and torchtitan's compile "
                           "flags apply it: what inductor's partitioner saves, learned from the real compile pipeline "
                           "on fake tensors", ACTIVATIONS, kind="switch")
    logits_dtype: str = option("fp32", "the loss's logits: fp32 (transformers' upcast before cross-entropy) or model "
                               "(cross-entropy on the lm_head's output in the model's dtype; under autocast its "
                               "log-softmax still runs in fp32; default fp32)", ACTIVATIONS)
    # torchtune's TransformerDecoder.chunked_output and CEWithChunkedOutputLoss (llmem.memory.activations.loss)
    output_chunks: int = option(0, "torchtune's chunked output: the lm_head runs on N chunks of the sequence "
                                "(torch.chunk) and CEWithChunkedOutputLoss upcasts and log-softmaxes one chunk at a "
                                "time; 0: one [tokens, vocab] logits and transformers' loss (default 0)", ACTIVATIONS,
                                type=int, metavar="N")

@dataclass(frozen=True, kw_only=True)
class AdaptersConfig:
    """What is trained when the base is frozen: peft's adapters (LoRA, or any --peft-config) and the quantised
    base under them (QLoRA, LLM.int8, torchao's NF4)."""
    lora_rank: int = option(0, "LoRA adapters of this rank (base frozen); 0: full fine-tuning", ADAPTERS, type=int)
    lora_alpha: int = option(16, "LoRA alpha (scaling; no effect on memory)", ADAPTERS, type=int)
    lora_targets: str = option("q_proj,v_proj", "modules to adapt (the layers' linears, lm_head, embed_tokens), "
                               "comma-separated, or all-linear, or re:PATTERN (peft's string form: the modules "
                               "whose full name the pattern matches; default q_proj,v_proj)", ADAPTERS)
    lora_dropout: float = option(0.0, "LoRA dropout on the adapters' input (default 0)", ADAPTERS, type=float)
    peft_config: str | None = option(None, "adapter_config.json (or its folder) applied with peft: LoRA, DoRA, IA3, "
                                     "prompt/prefix tuning", ADAPTERS, metavar="PATH")
    adapter_dtype: str = option("fp32", "fp32 (peft's autocast_adapter_dtype, its default: adapters in fp32 also on "
                                "a bf16/fp16 base) or base (adapters in the base's dtype, torchtune's LoRA)",
                                ADAPTERS)
    quant_base: str = option("none", "frozen base quantised (bitsandbytes or torchao)", ADAPTERS, kind="switches",
                             noun="quantised base", switches=QUANT_SWITCHES)
    kbit_upcast: bool = option(True, "quantised base without peft's prepare_model_for_kbit_training upcast of the "
                               "unquantised frozen parameters (embeddings, norms, lm_head) to fp32", ADAPTERS,
                               kind="negate", flag="--no-kbit-upcast")
    double_quant: bool = option(True, "--qlora without double quantisation (fp32 absmax per 64-block)", ADAPTERS,
                                kind="negate", flag="--no-double-quant", requires=("quant_base", "nf4"))
    # a vision-language model's parts left frozen (LLaMA-Factory's freeze_vision_tower /
    # freeze_multi_modal_projector / freeze_language_model; llmem.model.vision names the parts)
    freeze_vision_tower: bool = option(False, "vision encoder frozen (LLaMA-Factory's freeze_vision_tower)", IMAGES,
                                       kind="switch")
    freeze_projector: bool = option(False, "projector / merger frozen (LLaMA-Factory's "
                                    "freeze_multi_modal_projector)", IMAGES, kind="switch")
    freeze_language_model: bool = option(False, "language model frozen (LLaMA-Factory's freeze_language_model)",
                                         IMAGES, kind="switch")

@dataclass(frozen=True, kw_only=True)
class DeepSpeedConfig:
    """DeepSpeed's ZeRO section (methods ds-zero1/2/3; None: DeepSpeed's default, `llmem.setup.deepspeed`) and the
    parameter offload that FSDP2's CPUOffloadPolicy shares."""
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

@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The training objective (a row of `llmem.setup.objectives.OBJECTIVES`: sft, or one of TRL's trainers) and
    the preference trainers' settings, with TRL's names and defaults."""
    # The training objective (llmem.setup.objectives): TRL's trainers' names and defaults
    objective: str = option("sft", f"{', '.join(OBJECTIVES)}: sft (one model's causal-LM loss on full logits), "
                            "trl-sft (TRL's SFTTrainer: that loss through TRL's fused LM head), TRL's DPOTrainer "
                            "(chosen and rejected in one forward against a reference) or KTOTrainer (unpaired "
                            "completions against a reference; default sft)", OBJECTIVE_GROUP)
    loss_type: str | None = option(None, f"the trainer's loss_type (dpo: {', '.join(DPO_LOSS_TYPES[:4])}, ..., "
                                   f"default sigmoid; kto: {', '.join(KTO_LOSS_TYPES)}, default kto; trl-sft: "
                                   f"{', '.join(SFT_LOSS_TYPES)}, default nll)", OBJECTIVE_GROUP)
    precompute_ref_log_probs: bool = option(False, "dpo/kto: the reference's log-probs computed before training "
                                            "(precompute_ref_log_probs): no reference in the step",
                                            OBJECTIVE_GROUP, kind="switch")
    ref_dtype: str = option("policy", f"{', '.join(REF_DTYPES)}: the reference copy's dtype (policy: TRL's "
                            "dtype=model.dtype, fp32 under *-mixed; compute: the compute dtype)", OBJECTIVE_GROUP)
    prompt_len: int = option(0, "dpo/kto/trl-sft: prompt tokens at the start of each --seq-len sequence (not scored: TRL's "
                             "labels are -100 there; default 0, every token but the first scored)", OBJECTIVE_GROUP,
                             type=int)
    max_length: int | None = option(None, "dpo/kto: TRL's max_length, to which it truncates each sequence (default "
                                    "1024, the configs'); --seq-len is the length after truncation",
                                    OBJECTIVE_GROUP, type=int)

@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """The generation objectives' settings (GRPO / RLOO: GRPOConfig's names and defaults) and TRL's vLLM engine
    (`llmem.memory.vllm` models its pool; it is never run)."""
    # The generation objectives' options (llmem.setup.generation): GRPOConfig's names and defaults
    num_generations: int | None = option(None, "grpo / rloo: completions per prompt (GRPOConfig's default 8, "
                                         "RLOOConfig's 2); must divide "
                                         "--gpus x --batch-size x --steps-per-generation", OBJECTIVE_GROUP,
                                         type=int)
    max_completion_length: int | None = option(None, "grpo / rloo: completion tokens (default 512, the configs'); "
                                               "--seq-len is the prompt plus these", OBJECTIVE_GROUP, type=int)
    beta: float | None = option(None, "grpo / rloo: the KL coefficient (default 0.0, GRPOConfig's: no reference "
                                "model; RLOOConfig's 0.05; > 0 scores a reference)", OBJECTIVE_GROUP, type=float)
    use_vllm: bool = option(False, "grpo / rloo: generate with vLLM (its pool modelled from vLLM's accounting, not "
                            "run; see --vllm-mode)", OBJECTIVE_GROUP, kind="switch")
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
    # The generation batch (GRPOConfig's and RLOOConfig's steps_per_generation / generation_batch_size): the
    # completions generated and scored at once, then buffered and served one micro-batch per training step
    gradient_accumulation_steps: int | None = option(None, "grpo / rloo: TrainingArguments' "
                                                     "gradient_accumulation_steps (default 1): the default "
                                                     "--steps-per-generation, and under grpo whether the old "
                                                     "policy's log-probs are kept", OBJECTIVE_GROUP, type=int)
    steps_per_generation: int | None = option(None, "grpo / rloo: training steps one generation batch serves "
                                              "(default --gradient-accumulation-steps): each GPU generates and "
                                              "scores --batch-size x this many completions at once",
                                              OBJECTIVE_GROUP, type=int)
    generation_batch_size: int | None = option(None, "grpo / rloo: completions generated at once on all GPUs "
                                               "(a multiple of --gpus x --batch-size; instead of "
                                               "--steps-per-generation)", OBJECTIVE_GROUP, type=int)

@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """The phases of the job around the step (llmem.setup.job_phases): how the model is loaded and how a
    checkpoint is saved; their peaks are worked out beside the step's (llmem.estimator.job_phases)."""
    load_path: str = option(DEFAULT, f"how the model is loaded: {DEFAULT} (HF Trainer's path for the method), "
                            + ", ".join(f"{r.name} ({r.summary})" for r in LOAD_PATHS.values()), JOB, metavar="LOADING")
    save_kind: str = option(DEFAULT, f"how a checkpoint is saved: {DEFAULT} (HF Trainer + accelerate's for the "
                            "method), " + ", ".join(f"{r.name} ({r.summary})" for r in SAVE_KINDS.values()), JOB,
                            metavar="KIND")
    # HF Trainer's evaluation (llmem.setup.eval_phase): TrainingArguments' names
    eval_batch_size: int | None = option(None, "the job evaluates (HF Trainer's evaluate) at this many samples per "
                                         "GPU: per_device_eval_batch_size (HF's default 8); without it, no eval "
                                         "phase", JOB, type=int)
    eval_keeps: str = option("loss", "what each eval step keeps on the GPU: " + ", ".join(
        f"{k.name} ({k.summary})" for k in EVAL_KEEPS.values()), JOB, metavar="KEPT")
    eval_accumulation_steps: int | None = option(None, "eval steps whose kept tensors stay on the GPU before they "
                                                 "are moved to the host (HF's eval_accumulation_steps; default: "
                                                 "the whole eval set)", JOB, type=int)
    eval_samples: int | None = option(None, "samples in the eval set (all GPUs together): how many eval steps "
                                      "keep their tensors on the GPU when --eval-accumulation-steps is not given",
                                      JOB, type=int)


# TrainingSetup holds one of each, under these names (the order of its fields)
SECTIONS: dict[str, type] = {
    "parallelism": ParallelismConfig,
    "hardware": HardwareConfig,
    "step": StepConfig,
    "optim": OptimizerConfig,
    "activations": ActivationsConfig,
    "adapters": AdaptersConfig,
    "deepspeed": DeepSpeedConfig,
    "trainer": TrainerConfig,
    "generation": GenerationConfig,
    "job": JobConfig,
}
