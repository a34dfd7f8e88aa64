"""The training set-up a user asks about, as one plain dataclass, and its validation."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from llmem.errors import LlmemError

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp16")
OPTIMIZERS = ("adamw", "adamw-fused", "adamw-forloop", "sgd", "sgd-momentum", "adafactor", "lion", "adamw-8bit",
              "paged-adamw-8bit")
EIGHT_BIT_OPTIMIZERS = ("adamw-8bit", "paged-adamw-8bit")     # bitsandbytes' AdamW8bit / PagedAdamW8bit
TP_METHODS = ("tp", "fsdp+tp")         # the resolved methods with tensor parallelism
IN_BACKWARD_METHODS = ("single",)   # --optimizer-in-backward: per-parameter steps in post-accumulate-grad hooks
ATTENTIONS = ("sdpa", "eager", "flash")


@dataclass(frozen=True)
class TrainingSetup:
    """One fine-tuning step as the user describes it. Sizes are per GPU (batch_size is the micro-batch)."""
    model: str
    method: str = "single"
    gpus: int = 1
    gpus_per_node: int | None = None
    tp: int | None = None
    batch_size: int = 1
    seq_len: int = 2048
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    grad_ckpt: bool = False
    attn: str = "sdpa"
    gpu: str = "A100-80GB"
    gpu_memory: str | None = None       # overrides the catalog's capacity, e.g. "80GiB"
    cuda_context: str | None = None     # overrides the CUDA-context assumption, e.g. "500MiB"
    expandable_segments: bool = False   # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    offload_optimizer: bool = False     # optimizer states and the update on the CPU (ZeRO-Offload style)
    lora_rank: int = 0                  # 0: full fine-tuning; > 0: LoRA adapters of this rank, base frozen
    lora_alpha: int = 16
    lora_targets: str = "q_proj,v_proj" # comma-separated module names, or "all-linear"
    lora_dropout: float = 0.0           # peft's nn.Dropout on each LoRA adapter's input (--lora-rank only)
    peft_config: str | None = None      # an adapter_config.json (or its folder), applied with peft itself
    trust_remote_code: bool = False
    optimizer_in_backward: bool = False # per-parameter optimizer steps in post-accumulate-grad hooks
    quant_base: str = "none"            # frozen base quantised by bitsandbytes: "nf4" (--qlora), "int8" (--load-in-8bit)
    double_quant: bool = True           # nf4: quantise the absmax constants too (QLoRA's double quantisation)
    # activations (issue 5, item 3)
    ckpt_every: int = 1                 # with grad_ckpt (ignored without): checkpoint layers with index % k == 0
    offload_activations: bool = False   # saved activations in pinned host memory between forward and backward
    fused_ce: bool = False              # fused linear cross-entropy (chunks of tokens; no [tokens, vocab] logits)
    packing: bool = False               # samples packed into rows (position_ids restart per sample)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise LlmemError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.seq_len < 1:
            raise LlmemError(f"--seq-len must be >= 1, got {self.seq_len}")
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
        if self.attn == "flash" and self.precision == "fp32":
            raise LlmemError("--attn flash needs fp16 or bf16 compute (flash attention has no fp32 kernel)")
        if self.ckpt_every < 1:
            raise LlmemError(f"--grad-ckpt-every must be >= 1, got {self.ckpt_every}")
        from llmem.quant import check_setup

        check_setup(self)

    @property
    def mixed(self) -> bool:
        """fp32 master weights with low-precision compute (autocast / FSDP MixedPrecisionPolicy)."""
        return self.precision.endswith("-mixed")

    @property
    def peft(self) -> bool:
        """The base is frozen and peft adds trainable adapters / prompts (--lora-rank or --peft-config)."""
        return bool(self.lora_rank or self.peft_config)

    @property
    def param_bytes(self) -> int:
        """Bytes per element of the stored parameters, their gradients and optimizer states."""
        return 2 if self.precision in ("bf16", "fp16") else 4

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of activations (matmul outputs)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def compute_dtype(self) -> str:
        return {"fp32": "float32", "bf16-mixed": "bfloat16", "bf16": "bfloat16",
                "fp16-mixed": "float16", "fp16": "float16"}[self.precision]

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
        return 4 if self.quant_base != "none" else self.compute_bytes

    def to_dict(self) -> dict:
        return asdict(self)


def check_optimizer_method(setup: TrainingSetup, method: str) -> None:
    """The optimizer options the method's real code path supports (raised by estimate and trace once the method
    is resolved, so a planner can build the set-up and skip the methods that cannot run it)."""
    if setup.optimizer_in_backward and setup.offload_optimizer:
        raise LlmemError("--optimizer-in-backward and --offload-optimizer cannot be combined")
    if setup.optimizer_in_backward and method not in IN_BACKWARD_METHODS:
        raise LlmemError(f"--optimizer-in-backward is supported with method single only (got {method}): DDP "
                         "and FSDP2 reduce gradients after accumulation (a post-accumulate-grad hook would step "
                         "on unreduced gradients, or never fire on FSDP2's sharded parameters); TP is not "
                         "modelled")
    if setup.optimizer == "adafactor" and method not in ("single", "ddp"):
        raise LlmemError(f"adafactor with {method}: torch.optim.Adafactor fails on DTensor parameters "
                         "(torch.norm(grad, dim=-2).square_() cannot keep the _NormPartial placement in place); "
                         "use single or ddp")
    if setup.peft and method in TP_METHODS:
        raise LlmemError("LoRA / peft with tensor parallelism is not modelled: use single, ddp, fsdp or zero2")
    if setup.fused_ce and method in TP_METHODS:
        raise LlmemError("--fused-ce with tensor parallelism is not modelled: the vocab-parallel lm_head needs a "
                         "vocab-parallel loss")
    from llmem.quant import check_quant_method

    check_quant_method(setup, method)
    if setup.optimizer in EIGHT_BIT_OPTIMIZERS and method not in ("single", "ddp"):
        raise LlmemError(f"{setup.optimizer} is modelled with single and ddp only (bitsandbytes' kernels take "
                         f"plain CUDA tensors, not FSDP2/TP DTensor shards); got {method}")
