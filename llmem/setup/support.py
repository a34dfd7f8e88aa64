"""The one support check: which options combine, as one table per feature, read by every engine once the method
is resolved (so a planner can build the set-up and skip the layouts that cannot run it, with the same message).

A feature's row (`FeatureSupport`) says when a set-up turns it on and lists, in order, what it is not modelled
with (`Refusal`: the condition and the one line a user reads). `SUPPORT` registers the rows; `check_support` walks
them in order and raises the first refusal that applies; docs/make_support.py prints them into docs/support.md. The
model's own facts (`ModelSupport`, read by llmem.model from transformers' class flags and the family table) are
one more row: tensor parallelism without a plan, an attention kernel transformers does not implement for the class,
adapters on the lm_head, a pipeline over tied embeddings. estimate, trace and measure all resolve the set-up through
it, so they accept and refuse the same set-ups with the same message.

What is checked here is a combination; a single option's range or name is checked where its field is built
(llmem.setup.training, llmem.setup.sections) and the method-only rules of a layout in llmem.setup.layout."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmem.errors import LlmemError
from llmem.setup.checkpointing import AC_POLICIES
from llmem.setup.liger import AUTO, LIGER_FAMILIES, liger_kernels
from llmem.setup.methods import METHODS, MethodSpec
from llmem.setup.pipeline import PIPELINE_SCHEDULES, pipeline_schedule
from llmem.setup.precision import regime_for
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
    tied_embeddings: bool = False    # the input and output embeddings share one weight
    # --peft-config's peft type, and whether llmem has a hand activation model of it (LoRA, DoRA, IA3) and no virtual
    # tokens ("": no --peft-config)
    peft_type: str = ""
    peft_hand_modelled: bool = False


@dataclass(frozen=True)
class Case:
    """What a rule reads: the set-up, its resolved method's row and (where known) the model's facts."""
    setup: TrainingSetup
    method: MethodSpec
    model: ModelSupport | None = None


@dataclass(frozen=True)
class Refusal:
    """One thing a feature is not modelled with: `applies` to a case, `why` is the line a user reads (a str, or
    made from the case)."""
    other: str                                   # what it is refused with, as docs/support.md names it
    applies: Callable[[Case], bool]
    why: str | Callable[[Case], str]

    def line(self, case: Case) -> str:
        return self.why if isinstance(self.why, str) else self.why(case)


@dataclass(frozen=True)
class FeatureSupport:
    """A feature's row: when a set-up turns it on, and what it is not modelled with (checked in order)."""
    feature: str                                 # as a user turns it on, e.g. "--fused-ce"
    on: Callable[[Case], bool]
    refusals: tuple[Refusal, ...]

    def refusal(self, case: Case) -> str | None:
        """The first line refusing `case` (None: the feature is off, or runs with everything else in it)."""
        if not self.on(case):
            return None
        return next((r.line(case) for r in self.refusals if r.applies(case)), None)


def _able(flag: str) -> str:
    return ", ".join(m.name for m in METHODS.values() if getattr(m, flag))


OPTIMIZER_IN_BACKWARD = FeatureSupport("--optimizer-in-backward", lambda c: c.setup.optimizer_in_backward, (
    Refusal("--offload-optimizer", lambda c: c.setup.offload_optimizer,
            "--optimizer-in-backward and --offload-optimizer cannot be combined"),
    Refusal("methods that reduce after accumulation", lambda c: not c.method.steps_in_backward,
            lambda c: f"--optimizer-in-backward is supported with method {_able('steps_in_backward')} only (got "
                      f"{c.method.name}): DDP and FSDP2 reduce gradients after accumulation (a post-accumulate-grad "
                      "hook would step on unreduced gradients, or never fire on FSDP2's sharded parameters); TP is "
                      "not modelled"),
))

# the optimizer's own row (llmem.setup.optimizers) names what it cannot step
OPTIMIZER = FeatureSupport("--optimizer", lambda c: True, (
    Refusal("DTensor / DeepSpeed parameters (optimizers on plain tensors only)",
            lambda c: bool(c.setup.optimizer_spec.plain_tensors_only) and not c.method.plain_tensors,
            lambda c: c.setup.optimizer_spec.plain_tensors_only.format(name=c.setup.optimizer_spec.name,
                                                                       method=c.method.name)),
    Refusal("tensor parallelism (per the optimizer's row)",
            lambda c: bool(c.setup.optimizer_spec.tp_refusal) and c.method.has_tp,
            lambda c: c.setup.optimizer_spec.tp_refusal.format(name=c.setup.optimizer_spec.name,
                                                               method=c.method.name)),
))


def _tp_style(name: str) -> Refusal:
    return Refusal("methods without tensor parallelism", lambda c: getattr(c.setup, name) and not c.method.has_tp,
                   lambda c: f"--{name.replace('_', '-')} applies to tensor parallelism: use --method tp or "
                             f"fsdp+tp (got {c.method.name})")


TP_STYLES = FeatureSupport("--sequence-parallel / --loss-parallel",
                           lambda c: c.setup.sequence_parallel or c.setup.loss_parallel, (
    _tp_style("sequence_parallel"),
    _tp_style("loss_parallel"),
    Refusal("--fused-ce", lambda c: c.setup.loss_parallel and c.setup.fused_ce,
            "--fused-ce with --loss-parallel is not modelled: the fused loss takes the whole lm_head, "
            "loss_parallel() the vocab-sharded logits; choose one (torchtitan: --loss-parallel)"),
    Refusal("TRL's objectives", lambda c: c.setup.objective_spec.runs_trainer,
            lambda c: f"--sequence-parallel / --loss-parallel with --objective {c.setup.objective}: TRL's loss "
                      "reads full hidden states and gathers per-token log-probs; not modelled, drop them"),
    Refusal("--offload-activations", lambda c: c.setup.sequence_parallel and c.setup.offload_activations,
            "--offload-activations with --sequence-parallel is not modelled (the offloaded saved tensors of a "
            "DTensor residual stream); drop one of them"),
))

def _trl_trainer(c: Case) -> bool:
    """A preference or generating objective: TRL's trainer with a reference forward (or none) of its own."""
    spec = c.setup.objective_spec
    return spec.runs_trainer and not spec.sft_step


ADAPTERS = FeatureSupport("adapters (--lora-rank / --peft-config)", lambda c: c.setup.peft, (
    Refusal("tensor parallelism", lambda c: c.method.has_tp,
            "LoRA / peft with tensor parallelism is not modelled: use single, ddp, fsdp or zero2"),
    # checked against the trace under DPO, KTO, ORPO, GRPO and RLOO: LoRA (modules_to_save included), DoRA and IA3
    # within 1.1 %; the learned peft types' reserved peaks are not yet (LoHa under DPO +6.2 %, VeRA under KTO
    # +2.5 %, allocated within 0.7 %), and TRL's trainers cannot run prompt tuning's virtual tokens through their masks
    Refusal("--peft-config of a type without a hand model under TRL's trainers",
            lambda c: bool(c.setup.peft_config) and c.model is not None and _trl_trainer(c)
            and not c.model.peft_hand_modelled,
            lambda c: f"--peft-config of peft type {c.model.peft_type} with --objective {c.setup.objective} is not "
                      "modelled (under TRL's trainers: LoRA, DoRA and IA3 configs); give the adapters with "
                      "--lora-rank, or estimate it with --objective sft"),
    Refusal("--peft-config under TRL's trainers on DeepSpeed",
            lambda c: bool(c.setup.peft_config) and _trl_trainer(c) and c.method.zero_stage is not None,
            lambda c: f"--peft-config with --objective {c.setup.objective} on {c.method.name} is not modelled (not "
                      "checked against the trace there); give the adapters with --lora-rank, or use fsdp"),
))

FUSED_CE = FeatureSupport("--fused-ce", lambda c: c.setup.fused_ce, (
    Refusal("tensor parallelism", lambda c: c.method.has_tp,
            "--fused-ce with tensor parallelism is not modelled: the vocab-parallel lm_head needs a vocab-parallel "
            "loss"),
))

# --logits-dtype model: transformers' causal-LM loss without its fp32 upcast (llmem.runtime.losses)
LOGITS_DTYPE = FeatureSupport("--logits-dtype model", lambda c: c.setup.logits_dtype != "fp32", (
    Refusal("--fused-ce", lambda c: c.setup.fused_ce,
            "--logits-dtype model with --fused-ce: the fused loss makes no [tokens, vocab] logits (each chunk is "
            "upcast to fp32); drop one of them"),
    Refusal("--loss-parallel", lambda c: c.setup.loss_parallel,
            "--logits-dtype model with --loss-parallel is not modelled: drop one of them"),
    Refusal("TRL's objectives", lambda c: c.setup.objective_spec.runs_trainer,
            lambda c: f"--logits-dtype model with --objective {c.setup.objective} is not modelled: TRL's trainer "
                      "computes its own log-probs; drop --logits-dtype"),
    Refusal("--pp", lambda c: c.setup.pp > 1,
            "--logits-dtype model with --pp is not modelled: drop one of them"),
))

def _one_device_kernel(flag: str) -> Refusal:
    """A kernel-level option (Liger, float8, compile) modelled on a plain layer's ops: not with the layers split
    across devices (TP / PP / CP / EP) or run by DeepSpeed's engine."""
    return Refusal("tensor, pipeline, context or expert parallelism, DeepSpeed", lambda c: c.method.has_tp
                   or c.setup.pp > 1 or c.setup.cp > 1 or c.setup.ep > 1 or c.method.zero_stage is not None,
                   f"{flag} with tensor / pipeline / context / expert parallelism or DeepSpeed is not modelled: "
                   f"use single, ddp, fsdp or zero2, or drop {flag}")


# --liger: Liger-Kernel's RMSNorm and SwiGLU Functions (llmem.setup.liger), on the families Liger patches
LIGER = FeatureSupport("--liger", lambda c: bool(liger_kernels(c.setup.liger)), (
    Refusal("model families without a Liger patch", lambda c: c.model is not None and c.setup.liger != AUTO
            and c.model.model_type not in LIGER_FAMILIES,
            lambda c: f"--liger on {c.model.model_type}: llmem models Liger's patch for "
                      f"{', '.join(LIGER_FAMILIES)} only; drop --liger (--liger none with --from), or --liger "
                      "auto for Liger's patch where llmem models it"),
    _one_device_kernel("--liger"),
    # (TRL's fused-head trainers, trl-sft, dpo, kto, grpo, rloo: Liger's layer kernels applied to the model, their
    # own fused head for the log-probs, Liger's fused cross-entropy turned off: e.g. dpo_trainer.py __init__)
    Refusal("--peft-config, a quantised base, selective checkpointing, offloaded activations, TRL's objectives "
            "without TRL's fused LM head (orpo, simpo, reward)", lambda c: bool(c.setup.peft_config)
            or c.setup.quant_spec.quantised
            or c.setup.ac_policy != "full" or c.setup.offload_activations
            or (c.setup.objective_spec.runs_trainer and not c.setup.objective_spec.fused_lm_head),
            "--liger is modelled on a full fine-tune or LoRA (--lora-rank) of an unquantised base (sft, or a TRL "
            "trainer with its fused LM head: trl-sft, dpo, kto, grpo, rloo; full or no checkpointing, activations on "
            "the device): drop the --peft-config / quantised base / "
            "--ac-policy / --offload-activations / --objective"),
))


def _float8_compute(c: Case) -> bool:
    """Float8Linear's high-precision side is bf16 weights outside autocast: --precision bf16, or FSDP2's bf16 gather."""
    return c.setup.precision_spec.compute_dtype == "bfloat16" and not regime_for(c.setup, c.method).autocast


# --float8: torchao's Float8Linear (llmem.setup.float8) on a full fine-tune with bf16 weights
FLOAT8 = FeatureSupport("--float8", lambda c: c.setup.float8 != "none", (
    Refusal("fp32 / fp16 and autocast (*-mixed outside FSDP2)", lambda c: not _float8_compute(c),
            lambda c: f"--float8 with --precision {c.setup.precision} under --method {c.setup.method} is not "
                      "modelled: Float8Linear is modelled over bf16 weights; use --precision bf16 (or bf16-mixed "
                      "under fsdp)"),
    Refusal("--float8-all-gather outside FSDP2", lambda c: c.setup.float8_all_gather and not (
        c.method.shards_model_states and c.method.zero_stage is None),
            "--float8-all-gather needs FSDP2 (--method fsdp or zero2): drop it"),
    _one_device_kernel("--float8"),
    Refusal("adapters, a quantised base, Liger, selective checkpointing, offloaded activations, TRL's objectives",
            lambda c: c.setup.peft or c.setup.quant_spec.quantised or c.setup.liger != "none"
            or c.setup.ac_policy != "full" or c.setup.offload_activations or c.setup.objective_spec.runs_trainer,
            "--float8 is modelled on a full fine-tune (sft, full or no checkpointing, activations on the device, "
            "no Liger): drop the adapters / quantised base / --liger / --ac-policy / --offload-activations / "
            "--objective"),
))

# --ckpt-offload: Unsloth's offloaded checkpoints (llmem.setup.checkpointing.CKPT_OFFLOADS) around whole decoder
# layers on one device: its per-device buffers make it run under DDP too, the rest is not checked against the trace
CKPT_OFFLOAD = FeatureSupport("--ckpt-offload", lambda c: c.setup.ckpt_offload_spec.active, (
    Refusal("FSDP2, tensor, pipeline, context or expert parallelism, DeepSpeed", lambda c: not c.method.plain_tensors
            or c.setup.pp > 1 or c.setup.cp > 1 or c.setup.ep > 1,
            lambda c: f"--ckpt-offload {c.setup.ckpt_offload} is modelled under --method single or ddp only (got "
                      f"{c.setup.method}): Unsloth trains on one GPU, LLaMA-Factory's and axolotl's copies were not "
                      "checked under sharded or split layers; drop --ckpt-offload"),
    Refusal("TRL's objectives, Liger, float8", lambda c: c.setup.objective_spec.runs_trainer
            or c.setup.liger != "none" or c.setup.float8 != "none",
            lambda c: f"--ckpt-offload {c.setup.ckpt_offload} is modelled for the sft objective over HF's modules "
                      "(no --liger, no --float8): drop the other option or --ckpt-offload"),
))

# --compile: each decoder layer compiled (llmem.runtime.compile), its activations learned with the real compile
# pipeline on a copy run on one GPU (llmem.learn): what that copy and the compiled layer cannot stand for is refused.
# Offloaded activations are not: torchtune's OffloadActivations hooks pack what the compiled layer's autograd
# Function saves at run time (torch/_functorch/aot_autograd.py: saved-tensor hooks deferred until runtime); nor is
# torchao's NF4 base, whose dequantisation dynamo traces into the layer's graph (QuantBaseSpec.compiled)
COMPILE = FeatureSupport("--compile", lambda c: c.setup.compile, (
    _one_device_kernel("--compile"),
    Refusal("a bitsandbytes base, selective checkpointing, Liger, TRL's objectives",
            lambda c: (c.setup.quant_spec.quantised and not c.setup.quant_spec.compiled)
            or AC_POLICIES[c.setup.ac_policy].selective or c.setup.liger != "none"
            or c.setup.objective_spec.runs_trainer,
            "--compile is modelled on a full fine-tune or peft adapters of an unquantised or torchao NF4 base (sft, "
            "full or no checkpointing, HF's modules): drop the bitsandbytes base (or use --qlora-torchao) / "
            "--ac-policy op / --liger / --objective, or drop --compile"),
    Refusal("--float8", lambda c: c.setup.float8 != "none",
            "--compile with --float8 is not modelled (inductor fuses Float8Linear's casts, which the estimate lays "
            "out one by one): drop one of them"),
))


def _chunked_with(other: str, applies: Callable[[Case], bool], advice: str = "drop one of them") -> Refusal:
    return Refusal(other, applies, lambda c: f"--output-chunks with {other} is not modelled: {advice}")


# --output-chunks N: torchtune's chunked output and CEWithChunkedOutputLoss (llmem.estimator.schedule.chunked_head),
# as torchtune's single-device and FSDP2 recipes run them: in the model's dtype, the lm_head whole on each rank
OUTPUT_CHUNKS = FeatureSupport("--output-chunks N", lambda c: c.setup.output_chunks > 0, (
    _chunked_with("--fused-ce", lambda c: c.setup.fused_ce),
    _chunked_with("--logits-dtype model", lambda c: c.setup.logits_dtype != "fp32",
                  "torchtune's loss upcasts each chunk; drop --logits-dtype"),
    _chunked_with("tensor, pipeline, context or expert parallelism",
                  lambda c: c.method.has_tp or max(c.setup.pp, c.setup.cp, c.setup.ep) > 1,
                  "torchtune's chunked recipes run single-device, DDP or FSDP2"),
    _chunked_with("DeepSpeed", lambda c: c.method.zero_stage is not None, "use --method fsdp"),
    _chunked_with("autocast (*-mixed)", lambda c: regime_for(c.setup, c.method).autocast,
                  "torchtune trains in the model's dtype; use --precision bf16 or fp32"),
    _chunked_with("TRL's objectives", lambda c: c.setup.objective_spec.runs_trainer,
                  "TRL's trainers compute their own loss; drop --output-chunks"),
    _chunked_with("--shard-embeddings", lambda c: c.setup.shard_embeddings,
                  "the lm_head's own FSDP2 unit re-gathered per chunk is not laid out; drop --shard-embeddings"),
    _chunked_with("LoRA on the lm_head", lambda c: c.model is not None and c.model.adapted_head is not None),
    _chunked_with("a vision-language model's images", lambda c: c.setup.images_per_sample > 0),
    _chunked_with("--compile in fp32", lambda c: c.setup.compile and not regime_for(c.setup, c.method).mm < 4,
                  "torchtune's compiled chunked loss is modelled in bf16 / fp16 (--precision bf16)"),
))


def _selective_line(c: Case) -> str:
    return (f"--ac-policy {c.setup.ac_policy} with {{}} is not modelled: use it on a full fine-tune under single, "
            "ddp, fsdp or zero2 with SDPA or flash attention, or use --grad-ckpt")


def _selective(other: str, applies: Callable[[Case], bool]) -> Refusal:
    return Refusal(other, applies, lambda c: _selective_line(c).format(other))


# the estimate's selective policy models a plain decoder layer under SDPA / flash attention, trained whole, on
# plain tensors (llmem.memory.activations.selective)
SELECTIVE_AC = FeatureSupport("--ac-policy op", lambda c: AC_POLICIES[c.setup.ac_policy].selective, (
    _selective("tensor parallelism (DTensor matmuls)", lambda c: c.method.has_tp),
    _selective("DeepSpeed's engine", lambda c: c.method.zero_stage is not None),
    _selective("peft adapters", lambda c: c.setup.peft),
    _selective("a quantised base", lambda c: c.setup.quant_spec.quantised),
    _selective("--offload-activations", lambda c: c.setup.offload_activations),
    _selective("--packing", lambda c: c.setup.packing),
    Refusal("--attn eager", lambda c: c.setup.attention_spec.keeps_scores,
            lambda c: _selective_line(c).format(f"--attn {c.setup.attn}")),
    Refusal("TRL's objectives", lambda c: c.setup.objective_spec.runs_trainer,
            lambda c: _selective_line(c).format(f"--objective {c.setup.objective}")),
))

# DeepSpeed's bf16 / fp16 sections (fp32 master weights in the ZeRO optimizer) or fp32, a torch optimizer stepping
# the flat fp32 partition, no quantised base
DEEPSPEED = FeatureSupport("DeepSpeed (ds-zero1/2/3)", lambda c: c.method.zero_stage is not None, (
    Refusal("pure bf16 / fp16", lambda c: c.setup.precision_spec.low_precision and not c.setup.mixed,
            lambda c: f"--precision {c.setup.precision} with {c.method.name}: DeepSpeed's bf16 / fp16 keep fp32 "
                      f"master weights in the ZeRO optimizer, which --precision {c.setup.precision}-mixed describes; "
                      "use it"),
    Refusal("a quantised base", lambda c: c.setup.quant_spec.quantised,
            lambda c: f"{c.setup.quant_spec.flag} with {c.method.name}: a quantised base under DeepSpeed's ZeRO is "
                      "not modelled; use single, ddp, fsdp or zero2"),
    Refusal("optimizers other than elementwise torch ones",
            lambda c: bool(c.setup.optimizer_spec.parts or c.setup.optimizer_spec.plain_tensors_only
                           or c.setup.optimizer_spec.low_bit),
            lambda c: f"--optimizer {c.setup.optimizer_spec.name} with {c.method.name}: the ZeRO optimizer steps one "
                      "flat fp32 partition, which llmem models for elementwise torch optimizers only (adamw, "
                      "adamw-fused, adamw-forloop, sgd, sgd-momentum, lion)"),
))

# one GPU and DDP (replicated), FSDP2 / zero2 over the quantised storage (FSDP-QLoRA: bitsandbytes' NF4 packed in
# the compute dtype, bnb_4bit_quant_storage; torchao's NF4Tensor through its fsdp_pre/post_all_gather)
QUANTISED_BASE = FeatureSupport("a quantised base (--qlora, --load-in-8bit, --qlora-torchao)",
                                lambda c: c.setup.quant_spec.quantised, (
    Refusal("tensor parallelism", lambda c: c.method.has_tp,
            lambda c: f"{c.setup.quant_spec.flag} with {c.method.name}: tensor parallelism over quantised linears is "
                      "not modelled (DTensor cannot split bitsandbytes' packed weights; NF4Tensor has no TP "
                      "sharding); use single, ddp, fsdp or zero2"),
    Refusal("FSDP without a float storage (LLM.int8)",
            lambda c: c.method.shards_model_states and not c.setup.quant_spec.fsdp_shards,
            lambda c: f"{c.setup.quant_spec.flag} with {c.method.name}: FSDP cannot shard LLM.int8's int8 weights "
                      "(bitsandbytes has no float storage for them, unlike NF4's bnb_4bit_quant_storage); use "
                      "--qlora, or ddp"),
))


def _shard_ranks(c: Case) -> int:
    return c.setup.gpus // c.setup.dp_replicate


def _reshard_range_line(c: Case) -> str:
    n, shards = c.setup.reshard_after_forward, _shard_ranks(c)
    divisors = [str(d) for d in range(2, shards) if shards % d == 0]
    fix = f"choose {' or '.join(divisors)}" if divisors else f"{shards} shard ranks have none, drop it"
    return (f"--reshard-after-forward {n} must divide FSDP2's {shards} shard ranks with 1 < N < {shards} (1 is "
            f"zero2's False, {shards} fsdp's default True): {fix}")


def _reshard_with(other: str, applies: Callable[[Case], bool]) -> Refusal:
    return Refusal(other, applies, f"--reshard-after-forward with {other} is not modelled: drop one of them")


def _not_a_divisor(c: Case) -> bool:
    n, shards = c.setup.reshard_after_forward, _shard_ranks(c)
    return not (1 < n < shards and shards % n == 0)


# FSDP2's reshard_after_forward as an int, a non-trivial factor of the shard mesh (torch's
# _fsdp_init._get_post_forward_mesh_info: 1 means False, the shard size itself True), on plain FSDP2 / HSDP as llmem
# models it (FSDPParam.to_sharded_post_forward refuses DTensor parameters and tensor subclasses)
RESHARD_AFTER_FORWARD = FeatureSupport("--reshard-after-forward N", lambda c: c.setup.reshard_after_forward is not None, (
    Refusal("methods other than fsdp", lambda c: c.method.name != "fsdp",
            lambda c: f"--reshard-after-forward {c.setup.reshard_after_forward} is FSDP2's "
                      f"reshard_after_forward={c.setup.reshard_after_forward}, modelled under --method fsdp only, "
                      f"got {c.method.name} (zero2 is its False, fsdp's default its True)"),
    _reshard_with("--pp (torchtitan keeps units gathered under PP)", lambda c: c.setup.pp > 1),
    _reshard_with("--cp", lambda c: c.setup.cp > 1),
    _reshard_with("--ep", lambda c: c.setup.ep > 1),
    _reshard_with("--offload-param", lambda c: c.setup.offload_param),
    Refusal("a quantised base", lambda c: c.setup.quant_spec.quantised,
            lambda c: f"--reshard-after-forward with {c.setup.quant_spec.flag} is not modelled: drop one of them"),
    Refusal("TRL's objectives", lambda c: c.setup.objective_spec.runs_trainer,
            lambda c: f"--reshard-after-forward with --objective {c.setup.objective} is not modelled: drop one of "
                      "them"),
    Refusal("N not a factor of the shard ranks", _not_a_divisor, _reshard_range_line),
))


def _shard_embeddings_with(other: str, applies: Callable[[Case], bool]) -> Refusal:
    return Refusal(other, applies, f"--shard-embeddings with {other} is not modelled: drop one of them")


# torchtune's custom_sharded_layers ['tok_embeddings', 'output'] (training.shard_model): the embedding and the lm_head
# fully_shard units of their own beside the decoder layers, on plain FSDP2 (llmem.estimator.schedule.units); a tied
# lm_head is no module of its own in torchtune (TiedLinear), so only the embedding could be its unit
SHARD_EMBEDDINGS = FeatureSupport("--shard-embeddings", lambda c: c.setup.shard_embeddings, (
    Refusal("methods other than fsdp / zero2", lambda c: c.method.name not in ("fsdp", "zero2"),
            lambda c: f"--shard-embeddings makes FSDP2 units of the embedding and the lm_head, modelled under "
                      f"--method fsdp or zero2 only, got {c.method.name}: drop --shard-embeddings"),
    Refusal("tied input and output embeddings", lambda c: c.model is not None and c.model.tied_embeddings,
            "--shard-embeddings with tied input and output embeddings is not modelled (torchtune's TiedLinear "
            "lm_head is no module of its own): drop --shard-embeddings"),
    _shard_embeddings_with("--pp, --cp or --ep", lambda c: max(c.setup.pp, c.setup.cp, c.setup.ep) > 1),
    _shard_embeddings_with("--reshard-after-forward N", lambda c: c.setup.reshard_after_forward is not None),
    _shard_embeddings_with("--fused-ce", lambda c: c.setup.fused_ce),
    _shard_embeddings_with("a quantised base", lambda c: c.setup.quant_spec.quantised),
    _shard_embeddings_with("TRL's objectives", lambda c: c.setup.objective_spec.runs_trainer),
    _shard_embeddings_with("LoRA on the lm_head", lambda c: c.setup.peft and "lm_head" in c.setup.lora_targets),
    _shard_embeddings_with("a vision-language model's images", lambda c: c.setup.images_per_sample > 0),
))


def _head_lora_gap(c: Case) -> str | None:
    """What a set-up with LoRA on the lm_head has that its modelled form (llmem.estimator.schedule.head's
    lora_forward / lora_backward) does not; None: it is that form."""
    s = c.setup
    gaps = (
        (s.peft_config is not None, "--peft-config (give it as --lora-rank and --lora-targets)"),
        ({t.strip() for t in s.lora_targets.split(",") if t.strip()} == {"lm_head"},
         "no adapter before it (the decoder then keeps no activations, which is not modelled: add the layers' modules)"),
        (c.method.zero_stage is not None or c.method.has_tp, f"--method {s.method}"),
        (s.fused_ce, "--fused-ce (the fused loss reads the base weight alone)"),
        (s.objective_spec.runs_trainer, f"--objective {s.objective} (TRL's own head)"),
        (s.quant_spec.quantised, "a quantised base"),
        (s.offload_activations or s.optimizer_in_backward or s.pp > 1 or s.cp > 1 or s.ep > 1
         or s.liger != "none" or s.logits_dtype != "fp32",
         "offloaded activations, the optimizer in backward, pp / cp / ep, Liger or --logits-dtype"),
    )
    return next((why for gap, why in gaps if gap), None)


def _no_flash(c: Case) -> bool:
    return c.setup.attention_spec.flash_kernel and not c.model.supports_flash_attn


def _style_refusal(c: Case) -> str | None:
    return next((why for name, why in c.model.tp_style_refusals if getattr(c.setup, name)), None)


# what the model itself cannot run (the same refusal in every engine); read only where the model is known
MODEL = FeatureSupport("a model (its family row, its transformers class)", lambda c: c.model is not None, (
    Refusal("tensor parallelism (no TP plan for the family)", lambda c: c.method.has_tp and bool(c.model.tp_refusal),
            lambda c: c.model.tp_refusal),
    Refusal("--sequence-parallel / --loss-parallel (the family's plan)", lambda c: _style_refusal(c) is not None,
            _style_refusal),
    Refusal("--attn flash (the family's row)",
            lambda c: c.setup.attention_spec.flash_kernel and bool(c.model.flash_refusal),
            lambda c: c.model.flash_refusal),
    Refusal("--attn flash (transformers' class flag)", _no_flash,
            lambda c: f"--attn flash: transformers has no flash attention for {c.model.architecture} "
                      "(_supports_flash_attn is False); use --attn "
                      f"{'sdpa or eager' if c.model.supports_sdpa else 'eager'}"),
    Refusal("adapters on the output layer", lambda c: bool(c.model.adapted_head) and _head_lora_gap(c) is not None,
            lambda c: f"LoRA on the output layer {c.model.adapted_head!r} with {_head_lora_gap(c)} is not modelled "
                      "(it is in every precision, peft's fp32 adapters or the base's dtype as torchtune's "
                      "LoRALinear, with or without dropout, on the causal LM's own loss under single, ddp, fsdp or "
                      "zero2): change that, or target the decoder layers' modules only"),
))

# the set-up options a pipeline stage's estimate does not model (one line each)
_PP_UNMODELLED = (
    ("peft", "adapters (--lora-rank / --peft-config)"),
    ("fsdp_cpu_offload", "--offload-param"),
    ("offload_optimizer", "--offload-optimizer"),
    ("optimizer_in_backward", "--optimizer-in-backward"),
    ("offload_activations", "--offload-activations"),
    ("fused_ce", "--fused-ce"),
    ("packing", "--packing"),
)


def _pp_with(name: str, flag: str) -> Refusal:
    return Refusal(flag, lambda c: bool(getattr(c.setup, name)), f"--pp with {flag} is not modelled: drop one of them")


# the pipeline set-ups the estimate models (llmem.estimator.pipeline): pure PP (without autocast), FSDP2 (HSDP) x
# PP, TP x PP or FSDP2 x TP x PP of a full fine-tune; checked after the model's row, as the estimate did
PIPELINE = FeatureSupport("--pp N", lambda c: c.setup.pp > 1 and c.model is not None, (
    Refusal(f"--pp-schedule {' / '.join(n for n, row in PIPELINE_SCHEDULES.items() if not row.modelled)}",
            lambda c: not pipeline_schedule(c.setup.pp_schedule).modelled,
            lambda c: f"--pp-schedule {c.setup.pp_schedule} is not modelled yet: use gpipe, 1f1b or "
                      "interleaved-1f1b"),
    *(_pp_with(name, flag) for name, flag in _PP_UNMODELLED),
    Refusal("TRL's objectives, a quantised base, partial or selective checkpointing",
            lambda c: c.setup.objective_spec.runs_trainer or c.setup.quant_spec.quantised
            or c.setup.ckpt_every > 1 or c.setup.ac_policy != "full",
            "--pp is modelled for the sft objective, an unquantised base and full checkpointing of every layer "
            "only: drop the other options"),
    Refusal("autocast (*-mixed under single / tp)", lambda c: regime_for(c.setup, c.method).autocast,
            lambda c: f"--pp with --method {c.setup.method} under --precision {c.setup.precision}: autocast over "
                      "the whole schedule step is not modelled; use --precision bf16 or fp32"),
    Refusal("tied input and output embeddings", lambda c: c.model.tied_embeddings,
            "--pp with tied input and output embeddings (on the first and last stage) is not modelled"),
))

# the features in the order they are checked: the first refusal that applies is the one a user reads
SUPPORT: dict[str, FeatureSupport] = {row.feature: row for row in (
    OPTIMIZER_IN_BACKWARD, OPTIMIZER, TP_STYLES, ADAPTERS, FUSED_CE, LOGITS_DTYPE, OUTPUT_CHUNKS, LIGER, FLOAT8,
    CKPT_OFFLOAD, COMPILE,
    SELECTIVE_AC, DEEPSPEED, QUANTISED_BASE, RESHARD_AFTER_FORWARD, SHARD_EMBEDDINGS, MODEL, PIPELINE)}


def support_refusal(setup: TrainingSetup, method: MethodSpec, model: ModelSupport | None = None) -> str | None:
    """The line refusing `setup` under `method` (and `model`), from the first feature row that refuses it; None:
    every engine models it."""
    case = Case(setup, method, model)
    return next((why for row in SUPPORT.values() if (why := row.refusal(case)) is not None), None)


def check_support(setup: TrainingSetup, method: MethodSpec, model: ModelSupport | None = None) -> None:
    """Raise LlmemError naming the first option that `method`'s real code path (or `model`) does not support."""
    why = support_refusal(setup, method, model)
    if why is not None:
        raise LlmemError(why)


def feature_refusal(row: FeatureSupport, setup: TrainingSetup, method: MethodSpec) -> str | None:
    """Why llmem does not model `setup`'s feature `row` (LIGER, FLOAT8, COMPILE, DEEPSPEED, ...) with the rest of it
    under `method`, the model aside (None: it does, or the feature is off)."""
    return row.refusal(Case(setup, method))
