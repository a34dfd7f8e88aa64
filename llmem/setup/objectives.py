"""Objectives on the set-up floor: one row per `--objective`, registered by name, as TRL's trainers run them.

`sft` is one model's causal-LM step (HF's loss on full logits, or --fused-ce): transformers' Trainer, a plain loop,
torchtune, axolotl, LLaMA-Factory. `trl-sft` is that step as TRL's SFTTrainer runs it (trl/trainer/sft_trainer.py):
the same batch and layers, the loss through TRL's fused LM head (`add_fused_lm_head(..., outputs=("log_probs",
"entropy", "is_top1"))` in its __init__, `model(**inputs, fused_lm_head=True)` in compute_loss: no [tokens, vocab]
logits), whatever its settings (use_liger_kernel keeps Liger's layer kernels and turns its fused cross-entropy off;
only a compute_loss_func or label_smoothing_factor > 0 make SFTTrainer build full logits, neither a memory option
llmem offers). The preference objectives follow the installed TRL (1.16: trl/trainer/dpo_trainer.py, dpo_config.py):

- kto: KTOTrainer (kto_trainer.py, kto_config.py). DataCollatorForUnpairedPreference: --batch-size completions,
  each desirable or undesirable (llmem lays out half of each), and, for the KL term (loss_type kto), the same
  prompts with their neighbours' completions; the policy runs the KL sequences under no_grad, then its own
  forward, the reference both, under no_grad.
- dpo: DPOTrainer. DataCollatorForPreference puts the chosen sequences, then the rejected ones, in one batch
  (2 x --batch-size sequences of --seq-len tokens: --seq-len is the per-sequence length after TRL's max_length
  truncation), the policy runs it once (`_compute_loss`), and the per-token log-probabilities come from TRL's fused
  LM head (`add_fused_lm_head` / `ChunkedLogProbFunction`: tiles of [4096 tokens, 32768 vocabulary], no
  [tokens, vocab] logits) over the completion tokens only (labels -100 on the prompt). Every DPO loss type
  (`loss_type`) compares the policy with a reference, held one of three ways (`reference_mode`).

- orpo, simpo: trl.experimental's ORPOTrainer and CPOTrainer (loss_type simpo): chosen and rejected in one forward,
  no reference, the loss on the model's full logits (llmem.estimator.pairwise / llmem.runtime.pairwise).
- reward: RewardTrainer on a sequence-classification model (num_labels=1: a score head, no vocabulary logits).

- grpo, rloo: GRPOTrainer and RLOOTrainer with transformers' generate (llmem.setup.generation): generation,
  scoring, training; RLOO's scoring also runs the policy (scores_policy) and keeps per-sequence sums
  (sequence_logps).

The defaults are the installed trl's config classes' (tests/objectives/test_objectives.py, tests/objectives/test_pairwise.py,
tests/objectives/test_rloo.py check them); `NOT_YET` names the objectives still to come in the refusal, `REFUSED` those refused
with what to use instead (ppo: trl 1.16 has no PPOTrainer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmem.errors import LlmemError
from llmem.setup.generation import (
    GENERATION_DEFAULTS,
    GRPO_LOSS_TYPES,
    TRL_METHODS,
    check_generating_quantised,
    check_generation,
    check_no_generation_options,
    check_trainer_layout,
    completion_length,
    generation_notes,
    refuse_unmodelled,
    steps_misaligned,
)
from llmem.setup.generation import beta as generation_beta
from llmem.setup.methods import method_spec

OBJECTIVE_GROUP = "objective"      # TrainingSetup's --help section for these options

# How the step holds the reference model (reference_mode)
REF_NONE = "none"                  # the objective has no reference (sft)
REF_COPY = "copy"                  # a second, frozen model: DPOTrainer's create_model_from_path(dtype=model.dtype)
REF_ADAPTERS_OFF = "adapters-off"  # peft: the policy itself with its adapters disabled (use_adapter(model, None))
REF_PRECOMPUTED = "precomputed"    # precompute_ref_log_probs: the reference log-probs come with the batch

# TrainingSetup.ref_dtype
REF_DTYPES = ("policy", "compute")

# DPOConfig.loss_type's values (dpo_config.py, trl 1.16): all of them use the reference's log-probs
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")

# TRL's fused LM head (trl/trainer/utils.py, trl/kernels/chunked_logprob.py)
FUSED_TOKEN_CHUNK = 4096           # chunked_logprob.TOKEN_CHUNK_SIZE: tokens per projection tile
FUSED_VOCAB_CHUNK = 32768          # utils._CHUNKED_LOGPROB_CHUNK_SIZE: vocabulary columns per tile
# DPOTrainer asks the head for these per-token outputs (log_probs always; the rest feed its metrics)
DPO_HEAD_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")
KTO_HEAD_OUTPUTS = ("log_probs", "entropy", "mean_logits")
# SFTTrainer's (sft_trainer.py __init__): the loss from log_probs, the entropy and mean_token_accuracy metrics
SFT_HEAD_OUTPUTS = ("log_probs", "entropy", "is_top1")
SFT_LOSS_TYPES = ("nll", "dft")    # SFTConfig.loss_type's choices (dft: the loss times the detached probability)
REF_HEAD_OUTPUTS = ("log_probs",)   # a reference copy's head: add_fused_lm_head(ref_model), its default
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")   # KTOConfig.loss_type's choices; kto estimates the KL term
SIMPO_LOSS_TYPES = ("simpo",)      # CPOConfig's loss_type for SimPO (its other values are CPO's, not modelled)
CPO_SIMPO_DEFAULTS = {"simpo_gamma": 0.5, "cpo_alpha": 1.0}   # CPOConfig's (cpo_alpha 1: the chosen NLL is added)

NOT_YET: tuple[str, ...] = ()
# objectives refused with what to use instead (the installed trl 1.16 has no PPOTrainer, in trl.trainer or
# trl.experimental, so there is no trainer to model or trace)
REFUSED = {"ppo": "the installed trl 1.16 has no PPOTrainer (neither trl.trainer nor trl.experimental), so llmem has "
                  "no trainer to model: use --objective rloo or grpo (TRL's critic-free online RL, with a reference "
                  "and generation)"}


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str
    trainer: str                     # TRL's trainer class ("" for sft: transformers' Trainer / a plain loop)
    summary: str
    paired: bool = False             # chosen and rejected concatenated in one forward (2 sequences per sample)
    keeps_reference: bool = False    # the loss needs a reference model's log-probs
    loss_types: tuple[str, ...] = ()   # TRL's names; the first is its default
    loss_type_list: bool = False     # the config's loss_type is a list (DPOConfig: several losses, weighted)
    max_length: int | None = None    # TRL's default truncation of each sequence (None: none)
    beta: float | None = None        # TRL's default beta (no effect on memory; for the exports)
    fused_lm_head: bool = False      # per-token log-probs from TRL's chunked LM head
    disable_dropout: bool = False    # TRL's disable_dropout default: nn.Dropout modules set to p = 0
    head_outputs: tuple[str, ...] = ()   # the policy's fused head's per-token fields (its metrics')
    kl_loss_types: tuple[str, ...] = ()  # loss types that add mismatched KL sequences to the batch (KTO's)
    trainer_module: str = "trl"      # where the installed trl keeps the trainer and its config (orpo/simpo: experimental)
    full_logits: bool = False        # the loss on the model's full [tokens, vocab] logits (llmem.estimator.pairwise)
    scalar_head: bool = False        # a sequence-classification model, num_labels=1 (the reward model's score head)
    cli_command: str | None = None   # the `trl` CLI's command for --export trl (None: the CLI has none)
    generates: bool = False          # completions generated, then scored, before training (llmem.setup.generation)
    # the scoring phase runs the policy itself under no_grad for the old-policy log-probs every step (RLOOTrainer's
    # _generate_and_score_completions; GRPOTrainer only when num_iterations > 1 or generation steps are buffered)
    scores_policy: bool = False
    # the batch keeps per-sequence log-prob sums [B] fp32 (RLOO's old_logps; its loss is per sequence), the
    # per-token log-probs dying with the scoring phase; else the reference's per-token [B, C] and num_items_in_batch
    sequence_logps: bool = False
    # the micro-batch is a multiple of this (so at least this): KTO's 2, llmem's half desirable / half undesirable
    # layout, which also meets KTOTrainer's per_device_train_batch_size > 1 for the KL term (kto_trainer.py)
    batch_multiple: int = 1
    # the causal-LM step (sft's batch, layers and options) with the loss through TRL's fused head (SFTTrainer)
    sft_step: bool = False
    # the trainer turns the config's padding_free off with a warning and pads (DPOTrainer in trl 1.16: "temporarily
    # unavailable after a refactor", dpo_trainer.py __init__)
    padding_free_off: bool = False
    # TRL's QLoRA cast in the trainer's __init__ (sft_trainer.py, dpo_trainer.py, kto_trainer.py, grpo_trainer.py,
    # rloo_trainer.py, reward_trainer.py: `if _is_quantized_model`, model.is_loaded_in_4bit or is_loaded_in_8bit,
    # which only bitsandbytes' quantizers set): after get_peft_model every trainable parameter but DoRA's
    # lora_magnitude_vector becomes bf16 (`param.data = param.data.to(torch.bfloat16)`), whatever args.bf16 says;
    # trl.experimental's ORPO / CPO trainers do not (they run peft_module_casting_to_bf16 instead)
    casts_quantised_adapters: bool = False
    # trl.experimental's ORPO / CPO trainers given a peft_config on a bitsandbytes model (orpo_trainer.py __init__):
    # peft's prepare_model_for_kbit_training (the fp32 upcast of the unquantised frozen parameters) before
    # get_peft_model (fp32 adapters, peft's autocast_adapter_dtype), then under args.bf16 on a 4-bit model
    # peft_module_casting_to_bf16 (trl/experimental/utils.py: the embeddings and lm_head back to bf16)
    prepares_kbit: bool = False

    @property
    def runs_trainer(self) -> bool:
        """A TRL trainer runs the step (every objective but sft: transformers' Trainer / a plain loop)."""
        return bool(self.trainer)

    @property
    def step_kind(self) -> str:
        """Which step runs it (the estimator's and the trace's dispatch key): sft, fused-sft (sft's step with TRL's
        fused head for the loss: SFTTrainer), preference (a reference's log-probs, TRL's fused head), pairwise (the
        loss on full logits or a scalar head), generation (GRPO)."""
        if self.sft_step:
            return "fused-sft"
        if self.generates:
            return "generation"
        if self.full_logits or self.scalar_head:
            return "pairwise"
        return "preference" if self.runs_trainer else "sft"

    @property
    def sequences_per_sample(self) -> int:
        """Sequences the model runs per sample of --batch-size."""
        return 2 if self.paired else 1

    @property
    def default_loss_type(self) -> str | None:
        return self.loss_types[0] if self.loss_types else None


OBJECTIVES: dict[str, ObjectiveSpec] = {o.name: o for o in (
    # transformers' Trainer and the other frameworks' loops: HF's loss on full logits (--export trl refuses it: the trl
    # CLI runs SFTTrainer, whose loss is trl-sft's)
    ObjectiveSpec("sft", "", "one model's causal-LM loss"),
    # SFTTrainer (sft_trainer.py compute_loss): `model(**inputs, fused_lm_head=True)`, the loss -log_probs summed
    # over the label tokens (dft: times exp(log_probs).detach()), entropy and is_top1 for its metrics; --seq-len is
    # the sequence as it reaches the model (SFTConfig's max_length truncation, or packing's rows: no max_length row)
    ObjectiveSpec("trl-sft", "SFTTrainer", "one model's causal-LM loss through TRL's fused LM head (TRL's "
                  "SFTTrainer)", loss_types=SFT_LOSS_TYPES, fused_lm_head=True,
                  head_outputs=SFT_HEAD_OUTPUTS, cli_command="sft", sft_step=True, casts_quantised_adapters=True),
    ObjectiveSpec("dpo", "DPOTrainer", "preference pairs against a reference (TRL's DPOTrainer)", paired=True,
                  keeps_reference=True, loss_types=DPO_LOSS_TYPES, loss_type_list=True, max_length=1024, beta=0.1,
                  fused_lm_head=True, disable_dropout=True, head_outputs=DPO_HEAD_OUTPUTS, cli_command="dpo",
                  padding_free_off=True, casts_quantised_adapters=True),
    ObjectiveSpec("kto", "KTOTrainer", "unpaired completions, desirable or not, against a reference (TRL's "
                  "KTOTrainer)", keeps_reference=True, loss_types=KTO_LOSS_TYPES, max_length=1024, beta=0.1,
                  fused_lm_head=True, disable_dropout=True, head_outputs=KTO_HEAD_OUTPUTS, kl_loss_types=("kto",),
                  cli_command="kto", batch_multiple=2, casts_quantised_adapters=True),
    # trl.experimental's ORPOTrainer / CPOTrainer (loss_type simpo): chosen + rejected in one forward, the loss
    # (the chosen rows' NLL and the log-prob gathers) on the full logits, no reference (llmem.estimator.pairwise)
    ObjectiveSpec("orpo", "ORPOTrainer", "preference pairs, odds ratio plus the chosen NLL, no reference (TRL's "
                  "ORPOTrainer)", paired=True, max_length=1024, beta=0.1, disable_dropout=True,
                  trainer_module="trl.experimental.orpo", full_logits=True, prepares_kbit=True),
    ObjectiveSpec("simpo", "CPOTrainer", "preference pairs, length-normalised margin, no reference (TRL's "
                  "CPOTrainer, loss_type simpo)", paired=True, loss_types=SIMPO_LOSS_TYPES, max_length=1024,
                  beta=0.1, disable_dropout=True, trainer_module="trl.experimental.cpo", full_logits=True,
                  prepares_kbit=True),
    # RewardTrainer: a sequence-classification model (score head, num_labels=1), chosen + rejected in one forward,
    # -logsigmoid(r_chosen - r_rejected)
    ObjectiveSpec("reward", "RewardTrainer", "a reward model's pairwise loss on a scalar head (TRL's "
                  "RewardTrainer)", paired=True, max_length=1024, disable_dropout=True, scalar_head=True,
                  cli_command="reward", casts_quantised_adapters=True),
    # GRPOTrainer with transformers' generate (llmem.setup.generation): generation, scoring (the reference when
    # beta > 0), then the policy's forward over prompt + completion through TRL's fused head (log-probs, entropy)
    ObjectiveSpec("grpo", "GRPOTrainer", "completions generated per prompt, group-relative advantages, a reference "
                  "when beta > 0 (TRL's GRPOTrainer)", keeps_reference=True, loss_types=GRPO_LOSS_TYPES,
                  beta=GENERATION_DEFAULTS["grpo"].beta, fused_lm_head=True, head_outputs=("log_probs", "entropy"),
                  cli_command="grpo", generates=True, casts_quantised_adapters=True),
    # RLOOTrainer (trl 1.16, rloo_trainer.py) with transformers' generate: GRPO's phases, the scoring phase running
    # the policy (old_logps) and then the reference (beta 0.05 by default) under no_grad; no loss_type
    ObjectiveSpec("rloo", "RLOOTrainer", "completions generated per prompt, leave-one-out baselines, a reference "
                  "when beta > 0 (TRL's RLOOTrainer)", keeps_reference=True,
                  beta=GENERATION_DEFAULTS["rloo"].beta, fused_lm_head=True, head_outputs=("log_probs", "entropy"),
                  cli_command="rloo", generates=True, scores_policy=True, sequence_logps=True,
                  casts_quantised_adapters=True),
)}


# TRL's QLoRA cast (ObjectiveSpec.casts_quantised_adapters): the dtype it gives the trained parameters, and the one
# it leaves alone by name (DoRA's magnitude vector: its updates can be smaller than bf16 can represent, trl#7268)
QUANTISED_ADAPTER_DTYPE = "bfloat16"
CAST_EXEMPT = "lora_magnitude_vector"


def casts_quantised_adapters(setup) -> bool:
    """The set-up's TRL trainer casts its trained parameters to bf16: a casting trainer (its row), a bitsandbytes
    base (the is_loaded_in_4bit / is_loaded_in_8bit the trainer reads) and peft's adapters on it."""
    return objective_spec(setup.objective).casts_quantised_adapters and setup.quant_spec.bitsandbytes and setup.peft


def cast_by_trainer(setup, name: str) -> bool:
    """Whether TRL's QLoRA cast makes the trained parameter `name` bf16 (every one but CAST_EXEMPT's)."""
    return casts_quantised_adapters(setup) and CAST_EXEMPT not in name


def objective_spec(name: str) -> ObjectiveSpec:
    spec = OBJECTIVES.get(name)
    if spec is not None:
        return spec
    if name in REFUSED:
        raise LlmemError(f"--objective {name}: {REFUSED[name]}")
    later = f" ({name} is not modelled yet)" if name in NOT_YET else ""
    raise LlmemError(f"unknown objective {name!r}{later}: choose one of {', '.join(OBJECTIVES)}")


def batch_multiple(objective: str, gpus: int, generations: int | None = None, steps: int = 1) -> int:
    """The per-GPU micro-batch an objective's step takes in multiples of: its row's (KTO's 2: desirable and
    undesirable halves), and under a generation objective what makes gpus x batch x steps_per_generation (`steps`)
    a multiple of num_generations (GRPOConfig's check; `generations`: --num-generations, None its default)."""
    spec = objective_spec(objective)
    unit = spec.batch_multiple
    if spec.generates:
        g = GENERATION_DEFAULTS[objective].num_generations if generations is None else generations
        unit = math.lcm(unit, g // math.gcd(g, max(1, gpus) * max(1, steps)))
    return unit


def fixed_steps_per_generation(values) -> int:
    """The steps_per_generation a set-up's (or the flags') values fix whatever the micro-batch: the given one or
    gradient_accumulation_steps; 1 under a generation_batch_size (its steps follow the micro-batch)."""
    get = values.get if isinstance(values, dict) else lambda name: getattr(values, name)
    if get("generation_batch_size") is not None:
        return 1
    return get("steps_per_generation") or get("gradient_accumulation_steps") or 1


def setup_batch_multiple(setup, gpus: int | None = None) -> int:
    """batch_multiple of the set-up, on `gpus` GPUs (default its own)."""
    return batch_multiple(setup.objective, setup.gpus if gpus is None else gpus, setup.num_generations,
                          fixed_steps_per_generation(setup))


def scores_old_policy(setup) -> bool:
    """The scoring phase runs the policy under no_grad for old_per_token_logps: RLOOTrainer every generation,
    GRPOTrainer when its generation and optimizer steps are misaligned."""
    spec = objective_spec(setup.objective)
    return spec.scores_policy or (spec.generates and steps_misaligned(setup))


def kl_sequences(setup) -> bool:
    """KTOTrainer's calculate_KL (loss_type kto): the batch carries mismatched KL sequences, which the policy and
    the reference run under no_grad."""
    return loss_type_of(setup) in objective_spec(setup.objective).kl_loss_types


def reference_mode(setup) -> str:
    """How the step holds the reference, as DPOTrainer decides it (`ref_model is None` and peft, or
    precompute_ref_log_probs: no reference object; otherwise a copy loaded like the policy)."""
    if not objective_spec(setup.objective).keeps_reference:
        return REF_NONE
    if objective_spec(setup.objective).generates and generation_beta(setup) == 0:
        return REF_NONE            # GRPOTrainer: beta == 0.0 -> ref_model None, no reference log-probs
    if setup.precompute_ref_log_probs:
        return REF_PRECOMPUTED
    return REF_ADAPTERS_OFF if setup.peft else REF_COPY


# The options no preference objective models yet: (field, its unset value, flag, why)
_NOT_WITH_PREFERENCE = (
    ("fused_ce", False, "--fused-ce", "TRL's DPOTrainer computes the log-probs with its own chunked LM head"),
    ("packing", False, "--packing", "DPOTrainer pads each pair (padding_free is disabled in trl 1.16)"),
    ("offload_activations", False, "--offload-activations", "TRL's activation_offloading is not modelled yet"),
    ("optimizer_in_backward", False, "--optimizer-in-backward", "TRL's trainers step the optimizer after backward"),
)
PREFERENCE_METHODS = TRL_METHODS          # the layouts the preference step is modelled under (FSDP2 included)
PREFERENCE_ATTENTIONS = ("sdpa", "eager", "flash")


def check_objective(setup) -> None:
    """The objective's options against the objective (one line naming the fix; the CLI exits 2)."""
    spec = objective_spec(setup.objective)
    if spec.generates:
        check_generation(setup)
        _check_quantised_base(setup, spec)
        check_generating_quantised(setup)
        return
    check_no_generation_options(setup)
    if not spec.runs_trainer:
        _check_sft(setup)
        return
    if spec.sft_step:
        _check_trl_sft(setup, spec)
        return
    if setup.loss_type is not None and not spec.loss_types:
        raise LlmemError(f"--loss-type with --objective {spec.name}: TRL's {spec.trainer} has no loss_type; drop it")
    if spec.scalar_head and setup.peft:
        raise LlmemError(f"--objective {spec.name} with adapters is not modelled yet (peft's SEQ_CLS task, which "
                         "TRL's RewardTrainer uses, trains the score head in full): drop --lora-rank")
    if setup.prompt_len and spec.scalar_head:
        raise LlmemError(f"--prompt-len with --objective {spec.name}: TRL's {spec.trainer} scores whole sequences "
                         "(no prompt mask); drop it")
    if setup.loss_type is not None and setup.loss_type not in spec.loss_types:
        raise LlmemError(f"unknown --loss-type {setup.loss_type!r} for --objective {spec.name}: choose one of "
                         f"{', '.join(spec.loss_types)}")
    if setup.precompute_ref_log_probs and not spec.keeps_reference:
        raise LlmemError(f"--precompute-ref-log-probs: --objective {spec.name} has no reference model")
    if setup.ref_dtype not in REF_DTYPES:
        raise LlmemError(f"unknown --ref-dtype {setup.ref_dtype!r}: choose one of {', '.join(REF_DTYPES)}")
    mode = reference_mode(setup)
    if setup.ref_dtype != "policy" and mode != REF_COPY:
        raise LlmemError(f"--ref-dtype sets the reference copy's dtype, and this step has none (reference: {mode}); "
                         "drop --ref-dtype")
    _check_lengths(setup, spec)
    refuse_unmodelled(setup, _NOT_WITH_PREFERENCE)
    _check_quantised_base(setup, spec)
    check_trainer_layout(setup, PREFERENCE_METHODS, PREFERENCE_ATTENTIONS)
    if kl_sequences(setup) and setup.batch_size < 2:
        raise LlmemError(f"--objective {spec.name} with loss_type {loss_type_of(setup)} needs --batch-size >= 2 "
                         "(KTOTrainer: the KL term pairs each prompt with a neighbour's completion)")
    if not spec.paired and setup.batch_size % 2:
        raise LlmemError(f"--objective {spec.name}: llmem lays out half desirable, half undesirable completions; "
                         f"use an even --batch-size (got {setup.batch_size})")


def _check_quantised_base(setup, spec: ObjectiveSpec) -> None:
    """A quantised base under a preference objective: bitsandbytes' (TRL loads it through transformers' quantizer;
    torchao's NF4Tensor is torchtune's), and under ORPO / CPO what their own QLoRA preparation (prepares_kbit) does."""
    quant = setup.quant_spec
    if not quant.quantised:
        return
    if not quant.bitsandbytes:
        raise LlmemError(f"{quant.flag} with --objective {spec.name}: TRL's {spec.trainer} loads a quantised model "
                         "through transformers' bitsandbytes quantizer (torchao's NF4Tensor is torchtune's QLoRA); "
                         "use --qlora or --load-in-8bit")
    if not spec.prepares_kbit:
        return
    if not setup.kbit_upcast:
        raise LlmemError(f"--no-kbit-upcast with --objective {spec.name}: TRL's {spec.trainer} runs peft's "
                         "prepare_model_for_kbit_training on a quantised base given a peft_config; drop "
                         "--no-kbit-upcast")
    if quant.loaded_in_4bit and setup.compute_dtype == "bfloat16":     # args.bf16
        raise LlmemError(f"{quant.flag} with --objective {spec.name} in bf16 is not modelled: TRL's {spec.trainer} "
                         "casts a 4-bit model's embeddings and lm_head back to bf16 after the kbit upcast "
                         "(peft_module_casting_to_bf16), under fp32 norms; use --load-in-8bit, or fp16 / fp32")


def _check_lengths(setup, spec: ObjectiveSpec) -> None:
    """TRL's max_length truncation holds --seq-len; --prompt-len leaves a completion token."""
    max_length = spec.max_length if setup.max_length is None else setup.max_length
    if setup.max_length is not None and setup.max_length < 1:
        raise LlmemError(f"--max-length must be >= 1, got {setup.max_length}")
    if max_length is not None and setup.seq_len > max_length:
        raise LlmemError(f"--seq-len {setup.seq_len} is longer than TRL's max_length {max_length}, to which "
                         f"{spec.trainer} truncates each sequence: pass --max-length {setup.seq_len} or a shorter "
                         "--seq-len")
    if not 0 <= setup.prompt_len < setup.seq_len:
        raise LlmemError(f"--prompt-len must lie in [0, --seq-len) = [0, {setup.seq_len}), got {setup.prompt_len}: "
                         "a sequence needs at least one completion token")


# The options trl-sft (SFTTrainer's step) does not model: (field, its unset value, flag, why)
_NOT_WITH_TRL_SFT = (
    ("fused_ce", False, "--fused-ce", "SFTTrainer refuses Liger's fused linear cross-entropy (use_liger_kernel keeps "
                                      "only its layer kernels): its own fused LM head computes the loss"),
    ("offload_activations", False, "--offload-activations", "TRL's activation_offloading around its fused head is "
                                                            "not modelled yet"),
    ("optimizer_in_backward", False, "--optimizer-in-backward", "TRL's trainers step the optimizer after backward"),
    ("images_per_sample", 0, "--images-per-sample", "SFTTrainer's vision-language collator with its fused head is "
                                                    "not modelled yet"),
)


def _check_trl_sft(setup, spec: ObjectiveSpec) -> None:
    """trl-sft: sft's options, SFTConfig's loss_type and max_length, the completion-only prompt; no reference."""
    if setup.loss_type is not None and setup.loss_type not in spec.loss_types:
        raise LlmemError(f"unknown --loss-type {setup.loss_type!r} for --objective {spec.name}: choose one of "
                         f"{', '.join(spec.loss_types)}")
    for name, unset, flag in (("precompute_ref_log_probs", False, "--precompute-ref-log-probs"),
                              ("ref_dtype", "policy", "--ref-dtype")):
        if getattr(setup, name) != unset:
            raise LlmemError(f"{flag} with --objective {spec.name}: SFTTrainer has no reference model; drop it")
    _check_lengths(setup, spec)
    refuse_unmodelled(setup, _NOT_WITH_TRL_SFT)
    check_trainer_layout(setup, PREFERENCE_METHODS, PREFERENCE_ATTENTIONS)


def _check_sft(setup) -> None:
    """sft takes none of the preference objectives' options."""
    for name, unset, flag in (("loss_type", None, "--loss-type"),
                              ("precompute_ref_log_probs", False, "--precompute-ref-log-probs"),
                              ("ref_dtype", "policy", "--ref-dtype"), ("prompt_len", 0, "--prompt-len"),
                              ("max_length", None, "--max-length")):
        if getattr(setup, name) != unset:
            raise LlmemError(f"{flag} belongs to the preference objectives: add --objective dpo (or drop {flag})")


def check_dropout_free(objective: str, config: dict) -> None:
    """TRL's disable_dropout (DPOConfig's default) sets every nn.Dropout module to p = 0 but leaves the dropout a
    family reads from its config as a float (Llama's attention_dropout, OPT's dropout); which is which differs per
    family, so a preference objective on a model whose config has dropout is refused (llama-family configs have none)."""
    if not objective_spec(objective).disable_dropout:
        return
    on = sorted(k for k, v in config.items() if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0)
    if on:
        raise LlmemError(f"--objective {objective} on a model with dropout in its config ({', '.join(on)}) is not "
                         "modelled: TRL's disable_dropout turns off nn.Dropout modules only")


def loss_type_of(setup) -> str | None:
    """The loss type the step runs: the given one or the objective's default."""
    return setup.loss_type or objective_spec(setup.objective).default_loss_type


def completion_tokens(setup) -> int:
    """Tokens of one sequence TRL scores (labels not -100 after the shift): the completion, less one when there is
    no prompt (the first token is never a label)."""
    if objective_spec(setup.objective).generates:      # GRPO: labels[:, :-logits_to_keep] = -100
        return completion_length(setup)
    return setup.seq_len - max(setup.prompt_len, 1)


def _quantised_adapters_note(setup, spec: ObjectiveSpec) -> list[str]:
    """What TRL's trainer does to a bitsandbytes-quantised model's adapters, as the estimate and the trace model it."""
    if casts_quantised_adapters(setup):
        return [f"TRL's {spec.trainer} casts a bitsandbytes-quantised model's trained parameters to bf16 after "
                "get_peft_model (`_is_quantized_model` in its __init__, whatever the precision; DoRA's magnitude "
                "vector excepted): the adapters, their gradients and optimizer states are bf16, in the estimate as in "
                "the trace (which applies the same cast), and autocast makes no copies of them"]
    if spec.prepares_kbit and setup.peft and setup.quant_spec.bitsandbytes:
        return [f"TRL's {spec.trainer} runs peft's prepare_model_for_kbit_training on the quantised model (its "
                "embeddings, norms and lm_head upcast to fp32) and keeps peft's fp32 adapters (no bf16 cast)"]
    return []


def objective_notes(setup) -> list[str]:
    """What the estimate and the trace say about a preference objective's step (none for sft)."""
    spec = objective_spec(setup.objective)
    if not spec.runs_trainer:
        return []
    if spec.full_logits or spec.scalar_head:
        return _pairwise_notes(setup, spec) + _quantised_adapters_note(setup, spec)
    if spec.generates:
        return generation_notes(setup, reference_mode(setup), spec.scores_policy)
    if spec.sft_step:
        return [sft_head_note(setup, spec)] + _quantised_adapters_note(setup, spec)
    rows = spec.sequences_per_sample * setup.batch_size
    max_length = spec.max_length if setup.max_length is None else setup.max_length
    mode = reference_mode(setup)
    dtype = "the compute dtype" if setup.ref_dtype == "compute" else \
        f"the policy's dtype ({'fp32' if setup.param_bytes == 4 else setup.precision.removesuffix('-mixed')}, TRL's " \
        "dtype=model.dtype)"
    if method_spec(setup.method).zero_stage is not None:     # prepare_deepspeed's engine casts it (setup.deepspeed)
        dtype = "the compute dtype (loaded in the policy's, cast by its DeepSpeed engine)"
    reference = {REF_COPY: f"a frozen copy in {dtype}, in eval mode, its forward under no_grad after the policy's",
                 REF_ADAPTERS_OFF: "the policy itself with its adapters disabled (peft; no copy), under no_grad",
                 REF_PRECOMPUTED: "precomputed log-probs (precompute_ref_log_probs: the reference ran before "
                                  "training; none in the step)"}[mode]
    layout = (f"{setup.batch_size} chosen then {setup.batch_size} rejected, concatenated in one forward"
              if spec.paired else "half desirable, half undesirable" + (
                  f"; and {setup.batch_size} KL sequences (the prompts with their neighbours' completions) the "
                  "policy and the reference run under no_grad" if kl_sequences(setup) else ""))
    return [f"--objective {spec.name}: TRL's {spec.trainer}, {rows} sequences per step ({layout}); --seq-len "
            f"{setup.seq_len} is each "
            f"sequence's length after TRL's max_length {max_length} truncation, {setup.prompt_len} of them prompt; "
            f"the log-probs of the {completion_tokens(setup)} completion tokens per sequence from TRL's fused LM head "
            f"(tiles of {FUSED_TOKEN_CHUNK} tokens x {FUSED_VOCAB_CHUNK} vocabulary columns, no [tokens, vocab] "
            f"logits); loss_type {loss_type_of(setup)} (per-pair scalars); dropout off (disable_dropout)",
            f"reference: {reference}"] + _quantised_adapters_note(setup, spec)


def sft_head_note(setup, spec: ObjectiveSpec) -> str:
    """What trl-sft's step computes its loss with (SFTTrainer's compute_loss)."""
    prompt = (f", the first {setup.prompt_len} of each sequence prompt (completion_only_loss: labels -100)"
              if setup.prompt_len else "")
    dft = " times its detached probability (dft)" if loss_type_of(setup) == "dft" else ""
    return (f"--objective {spec.name}: TRL's {spec.trainer}, the causal-LM step with its loss from TRL's fused LM "
            f"head (add_fused_lm_head) over the {setup.batch_size} x {completion_tokens(setup)} label tokens{prompt} "
            f"(tiles of {FUSED_TOKEN_CHUNK} tokens x {FUSED_VOCAB_CHUNK} vocabulary columns, no [tokens, vocab] "
            f"logits): loss_type {loss_type_of(setup)}, -log_probs summed{dft}; per-token entropy and top-1 flags "
            "for its entropy and mean_token_accuracy metrics")


def _pairwise_notes(setup, spec: ObjectiveSpec) -> list[str]:
    """ORPO / SimPO (the loss on full logits) and the reward model (a scalar head): no reference."""
    rows = 2 * setup.batch_size
    max_length = spec.max_length if setup.max_length is None else setup.max_length
    head = ("a sequence-classification model (AutoModelForSequenceClassification, num_labels=1: the score Linear "
            "[1, hidden] in place of the lm_head, no vocabulary logits); its pooled [2B, 1] scores, "
            "-logsigmoid(r_chosen - r_rejected)" if spec.scalar_head else
            f"full [{rows} x {setup.seq_len}, vocab] logits (fp32 under mixed precision: accelerate casts the "
            "model's outputs), the chosen rows' NLL (nn.CrossEntropyLoss on a contiguous copy of their shifted "
            "logits) and every row's per-token log-probs (selective_log_softmax's fused kernel)" + (
                f"; loss_type simpo (simpo_gamma {CPO_SIMPO_DEFAULTS['simpo_gamma']}, cpo_alpha "
                f"{CPO_SIMPO_DEFAULTS['cpo_alpha']}: the NLL is added)" if spec.name == "simpo" else ""))
    return [f"--objective {spec.name}: TRL's {spec.trainer}, {rows} sequences per step ({setup.batch_size} chosen "
            f"then {setup.batch_size} rejected, concatenated in one forward); --seq-len {setup.seq_len} is each "
            f"sequence's length after TRL's max_length {max_length} truncation; {head}; no reference model; dropout "
            "off (disable_dropout)"]
