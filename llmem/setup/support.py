"""The one support check: what a set-up's options need of its method, raised by every engine once the method is
resolved (so a planner can build the set-up and skip the layouts that cannot run it, with the same message).

With the model's facts (`ModelSupport`, read by llmem.model from transformers' own class flags and the family
table), the same check refuses what the model cannot run: tensor parallelism without a plan, an attention kernel
transformers does not implement for the class, adapters on the lm_head. estimate, trace and measure all resolve
the set-up through it, so they accept and refuse the same set-ups with the same message."""

from __future__ import annotations

from dataclasses import dataclass

from llmem.errors import LlmemError
from llmem.setup.checkpointing import AC_POLICIES
from llmem.setup.methods import METHODS, MethodSpec
from llmem.setup.training import TrainingSetup


@dataclass(frozen=True)
class ModelSupport:
    """What a model can run, as its transformers class and llmem's family row say (built by llmem.model)."""
    architecture: str                # the transformers class, e.g. Gemma2ForCausalLM
    model_type: str
    supports_sdpa: bool              # the class's _supports_sdpa (without it transformers runs eager attention)
    supports_flash_attn: bool        # the class's _supports_flash_attn (attn_implementation="flash_attention_2")
    tp_refusal: str | None = None    # why tensor parallelism cannot run on it (None: the family has a TP plan)
    adapted_head: str | None = None  # the output layer's name when peft adapters sit on it (LoRA on lm_head)
    # why --sequence-parallel / --loss-parallel cannot run on it (field name -> the line), where it has a TP plan
    tp_style_refusals: tuple[tuple[str, str], ...] = ()
    flash_refusal: str | None = None  # why --attn flash is not modelled on it (its family row), or None


def check_support(setup: TrainingSetup, method: MethodSpec, model: ModelSupport | None = None) -> None:
    """Raise LlmemError naming the first option that `method`'s real code path (or `model`) does not support."""
    if setup.optimizer_in_backward and setup.offload_optimizer:
        raise LlmemError("--optimizer-in-backward and --offload-optimizer cannot be combined")
    if setup.optimizer_in_backward and not method.steps_in_backward:
        able = ", ".join(m.name for m in METHODS.values() if m.steps_in_backward)
        raise LlmemError(f"--optimizer-in-backward is supported with method {able} only (got {method.name}): DDP "
                         "and FSDP2 reduce gradients after accumulation (a post-accumulate-grad hook would step "
                         "on unreduced gradients, or never fire on FSDP2's sharded parameters); TP is not "
                         "modelled")
    optimizer = setup.optimizer_spec
    if optimizer.plain_tensors_only and not method.plain_tensors:
        raise LlmemError(optimizer.plain_tensors_only.format(name=optimizer.name, method=method.name))
    if optimizer.tp_refusal and method.has_tp:
        raise LlmemError(optimizer.tp_refusal.format(name=optimizer.name, method=method.name))
    check_tp_styles(setup, method)
    if setup.peft and method.has_tp:
        raise LlmemError("LoRA / peft with tensor parallelism is not modelled: use single, ddp, fsdp or zero2")
    if setup.fused_ce and method.has_tp:
        raise LlmemError("--fused-ce with tensor parallelism is not modelled: the vocab-parallel lm_head needs a "
                         "vocab-parallel loss")
    selective = selective_refusal(setup, method)     # --ac-policy op: what its estimate models
    if selective:
        raise LlmemError(selective)
    if method.zero_stage is not None:
        check_deepspeed(setup, method)
    if setup.quant_spec.quantised:
        check_quant_method(setup, method)
    check_reshard_after_forward(setup, method)
    if model is not None:
        check_model_support(setup, method, model)


def check_tp_styles(setup: TrainingSetup, method: MethodSpec) -> None:
    """--sequence-parallel / --loss-parallel: styles of a tensor-parallel plan (torchtitan's), and what they are
    not modelled with."""
    for name in ("sequence_parallel", "loss_parallel"):
        if getattr(setup, name) and not method.has_tp:
            raise LlmemError(f"--{name.replace('_', '-')} applies to tensor parallelism: use --method tp or "
                             f"fsdp+tp (got {method.name})")
    if setup.loss_parallel and setup.fused_ce:
        raise LlmemError("--fused-ce with --loss-parallel is not modelled: the fused loss takes the whole lm_head, "
                         "loss_parallel() the vocab-sharded logits; choose one (torchtitan: --loss-parallel)")
    if (setup.loss_parallel or setup.sequence_parallel) and setup.objective_spec.runs_trainer:
        raise LlmemError(f"--sequence-parallel / --loss-parallel with --objective {setup.objective}: TRL's loss "
                         "reads full hidden states and gathers per-token log-probs; not modelled, drop them")
    if setup.sequence_parallel and setup.offload_activations:
        raise LlmemError("--offload-activations with --sequence-parallel is not modelled (the offloaded saved "
                         "tensors of a DTensor residual stream); drop one of them")


def check_deepspeed(setup: TrainingSetup, method: MethodSpec) -> None:
    why = deepspeed_refusal(setup, method)
    if why:
        raise LlmemError(why)


def deepspeed_refusal(setup: TrainingSetup, method: MethodSpec) -> str | None:
    """Why llmem does not model `setup` under DeepSpeed's engine (None: it does). It models DeepSpeed's bf16 / fp16
    sections (fp32 master weights in the ZeRO optimizer) or fp32, a torch optimizer stepping the flat fp32
    partition, no quantised base."""
    if method.zero_stage is None:
        return None
    if setup.precision_spec.low_precision and not setup.mixed:
        return (f"--precision {setup.precision} with {method.name}: DeepSpeed's bf16 / fp16 keep fp32 master "
                f"weights in the ZeRO optimizer, which --precision {setup.precision}-mixed describes; use it")
    if setup.quant_spec.quantised:
        return (f"{setup.quant_spec.flag} with {method.name}: a quantised base under DeepSpeed's ZeRO is "
                "not modelled; use single, ddp, fsdp or zero2")
    spec = setup.optimizer_spec
    if spec.parts or spec.plain_tensors_only or spec.eight_bit:
        return (f"--optimizer {spec.name} with {method.name}: the ZeRO optimizer steps one flat fp32 partition, "
                "which llmem models for elementwise torch optimizers only (adamw, adamw-fused, adamw-forloop, sgd, "
                "sgd-momentum, lion)")
    return None


def check_quant_method(setup: TrainingSetup, method: MethodSpec) -> None:
    """A quantised base under `method`: one GPU and DDP (replicated), FSDP2 / zero2 over the quantised storage
    (FSDP-QLoRA: bitsandbytes' NF4 packed in the compute dtype, bnb_4bit_quant_storage; torchao's NF4Tensor through
    its fsdp_pre/post_all_gather), not LLM.int8 under FSDP, not tensor parallelism."""
    flag = setup.quant_spec.flag
    if method.has_tp:
        raise LlmemError(f"{flag} with {method.name}: tensor parallelism over quantised linears is not modelled "
                         "(DTensor cannot split bitsandbytes' packed weights; NF4Tensor has no TP sharding); use "
                         "single, ddp, fsdp or zero2")
    if method.shards_model_states and not setup.quant_spec.fsdp_shards:
        raise LlmemError(f"{flag} with {method.name}: FSDP cannot shard LLM.int8's int8 weights (bitsandbytes has "
                         "no float storage for them, unlike NF4's bnb_4bit_quant_storage); use --qlora, or ddp")


def check_reshard_after_forward(setup: TrainingSetup, method: MethodSpec) -> None:
    """--reshard-after-forward N: FSDP2's reshard_after_forward as an int, a non-trivial factor of the shard mesh
    (torch's _fsdp_init._get_post_forward_mesh_info: 1 means False, the shard size itself True), on plain FSDP2 /
    HSDP as llmem models it (FSDPParam.to_sharded_post_forward refuses DTensor parameters and tensor subclasses)."""
    n = setup.reshard_after_forward
    if n is None:
        return
    if method.name != "fsdp":
        raise LlmemError(f"--reshard-after-forward {n} is FSDP2's reshard_after_forward={n}, modelled under --method "
                         f"fsdp only, got {method.name} (zero2 is its False, fsdp's default its True)")
    others = (("--pp (torchtitan keeps units gathered under PP)", setup.pp > 1), ("--cp", setup.cp > 1),
              ("--ep", setup.ep > 1), ("--offload-param", setup.offload_param),
              (setup.quant_spec.flag, setup.quant_spec.quantised),
              (f"--objective {setup.objective}", setup.objective_spec.runs_trainer))
    for flag, given in others:
        if given:
            raise LlmemError(f"--reshard-after-forward with {flag} is not modelled: drop one of them")
    shards = setup.gpus // setup.dp_replicate
    if not (1 < n < shards and shards % n == 0):
        divisors = [str(d) for d in range(2, shards) if shards % d == 0]
        fix = f"choose {' or '.join(divisors)}" if divisors else f"{shards} shard ranks have none, drop it"
        raise LlmemError(f"--reshard-after-forward {n} must divide FSDP2's {shards} shard ranks with 1 < N < "
                         f"{shards} (1 is zero2's False, {shards} fsdp's default True): {fix}")


def check_model_support(setup: TrainingSetup, method: MethodSpec, model: ModelSupport) -> None:
    """What the model itself cannot run under `setup` and `method` (the same refusal in every engine)."""
    if method.has_tp and model.tp_refusal:
        raise LlmemError(model.tp_refusal)
    for name, why in model.tp_style_refusals:
        if getattr(setup, name):
            raise LlmemError(why)
    if setup.attention_spec.flash_kernel and model.flash_refusal:
        raise LlmemError(model.flash_refusal)
    if setup.attention_spec.flash_kernel and not model.supports_flash_attn:
        able = "sdpa or eager" if model.supports_sdpa else "eager"
        raise LlmemError(f"--attn flash: transformers has no flash attention for {model.architecture} "
                         f"(_supports_flash_attn is False); use --attn {able}")
    if model.adapted_head:
        raise LlmemError(f"adapters on the output layer {model.adapted_head!r} are not modelled: peft can wrap it "
                         "(a lora.Linear adding a [tokens, vocab] output to the logits, which --fused-ce would skip), "
                         "but llmem's logits and loss model has no adapter there; target the decoder layers' modules "
                         "(peft's all-linear leaves the output layer out too)")


def selective_refusal(setup: TrainingSetup, method: MethodSpec) -> str | None:
    """Why llmem cannot model `setup`'s selective policy under `method` (None: it can, or the policy is full). The
    estimate models a plain decoder layer under SDPA / flash attention, trained whole, on plain tensors."""
    if not AC_POLICIES[setup.ac_policy].selective:
        return None
    flag = f"--ac-policy {setup.ac_policy}"
    why = (("tensor parallelism (DTensor matmuls)", method.has_tp),
           ("DeepSpeed's engine", method.zero_stage is not None),
           ("peft adapters", setup.peft), ("a quantised base", setup.quant_spec.quantised),
           ("--offload-activations", setup.offload_activations), ("--packing", setup.packing),
           (f"--attn {setup.attn}", setup.attention_spec.keeps_scores),
           (f"--objective {setup.objective}", setup.objective_spec.runs_trainer))
    named = [what for what, applies in why if applies]
    if named:
        return (f"{flag} with {named[0]} is not modelled: use it on a full fine-tune under single, ddp, fsdp or "
                "zero2 with SDPA or flash attention, or use --grad-ckpt")
    return None
