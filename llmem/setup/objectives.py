"""Training objectives: one row per `--objective`, registered by name, as TRL's trainers name and run them.

`sft` is one model's causal-LM step (HF's loss on full logits, or --fused-ce). The preference objectives follow the
installed TRL (1.16: trl/trainer/dpo_trainer.py, dpo_config.py):

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

The defaults are DPOConfig's and KTOConfig's (tests/test_objectives.py checks them against the installed trl).
Rows for ORPO, SimPO (trl.experimental's CPO / ORPO trainers, which keep full logits), the reward model and the
generation objectives follow (issue 12); `NOT_YET` names them in the refusal.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.errors import LlmemError

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
REF_HEAD_OUTPUTS = ("log_probs",)   # a reference copy's head: add_fused_lm_head(ref_model), its default
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")   # KTOConfig.loss_type's choices; kto estimates the KL term

NOT_YET = ("orpo", "simpo", "reward", "grpo", "rloo", "ppo")


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str
    trainer: str                     # TRL's trainer class ("" for sft: transformers' Trainer / a plain loop)
    summary: str
    paired: bool = False             # chosen and rejected concatenated in one forward (2 sequences per sample)
    keeps_reference: bool = False    # the loss needs a reference model's log-probs
    loss_types: tuple[str, ...] = ()   # TRL's names; the first is its default
    max_length: int | None = None    # TRL's default truncation of each sequence (None: none)
    beta: float | None = None        # TRL's default beta (no effect on memory; for the exports)
    fused_lm_head: bool = False      # per-token log-probs from TRL's chunked LM head
    disable_dropout: bool = False    # TRL's disable_dropout default: nn.Dropout modules set to p = 0
    head_outputs: tuple[str, ...] = ()   # the policy's fused head's per-token fields (its metrics')
    kl_loss_types: tuple[str, ...] = ()  # loss types that add mismatched KL sequences to the batch (KTO's)

    @property
    def sequences_per_sample(self) -> int:
        """Sequences the model runs per sample of --batch-size."""
        return 2 if self.paired else 1

    @property
    def default_loss_type(self) -> str | None:
        return self.loss_types[0] if self.loss_types else None


OBJECTIVES: dict[str, ObjectiveSpec] = {o.name: o for o in (
    ObjectiveSpec("sft", "", "one model's causal-LM loss"),
    ObjectiveSpec("dpo", "DPOTrainer", "preference pairs against a reference (TRL's DPOTrainer)", paired=True,
                  keeps_reference=True, loss_types=DPO_LOSS_TYPES, max_length=1024, beta=0.1, fused_lm_head=True,
                  disable_dropout=True, head_outputs=DPO_HEAD_OUTPUTS),
    ObjectiveSpec("kto", "KTOTrainer", "unpaired completions, desirable or not, against a reference (TRL's "
                  "KTOTrainer)", keeps_reference=True, loss_types=KTO_LOSS_TYPES, max_length=1024, beta=0.1,
                  fused_lm_head=True, disable_dropout=True, head_outputs=KTO_HEAD_OUTPUTS, kl_loss_types=("kto",)),
)}


def objective_spec(name: str) -> ObjectiveSpec:
    spec = OBJECTIVES.get(name)
    if spec is not None:
        return spec
    later = f" ({name} is not modelled yet)" if name in NOT_YET else ""
    raise LlmemError(f"unknown objective {name!r}{later}: choose one of {', '.join(OBJECTIVES)}")


def kl_sequences(setup) -> bool:
    """KTOTrainer's calculate_KL (loss_type kto): the batch carries mismatched KL sequences, which the policy and
    the reference run under no_grad."""
    return loss_type_of(setup) in objective_spec(setup.objective).kl_loss_types


def reference_mode(setup) -> str:
    """How the step holds the reference, as DPOTrainer decides it (`ref_model is None` and peft, or
    precompute_ref_log_probs: no reference object; otherwise a copy loaded like the policy)."""
    if not objective_spec(setup.objective).keeps_reference:
        return REF_NONE
    if setup.precompute_ref_log_probs:
        return REF_PRECOMPUTED
    return REF_ADAPTERS_OFF if setup.peft else REF_COPY


# The options no preference objective models yet: (field, its unset value, flag, why)
_NOT_WITH_PREFERENCE = (
    ("fused_ce", False, "--fused-ce", "TRL's DPOTrainer computes the log-probs with its own chunked LM head"),
    ("packing", False, "--packing", "DPOTrainer pads each pair (padding_free is disabled in trl 1.16)"),
    ("offload_activations", False, "--offload-activations", "TRL's activation_offloading is not modelled yet"),
    ("optimizer_in_backward", False, "--optimizer-in-backward", "TRL's trainers step the optimizer after backward"),
    ("peft_config", None, "--peft-config", "give the adapters with --lora-rank"),
    ("quant_base", "none", "a quantised base", "QLoRA under DPO is not modelled yet"),
)
PREFERENCE_METHODS = ("single", "ddp")     # the layouts the preference step is modelled under
PREFERENCE_ATTENTIONS = ("sdpa", "eager")


def check_objective(setup) -> None:
    """The objective's options against the objective (one line naming the fix; the CLI exits 2)."""
    spec = objective_spec(setup.objective)
    if spec.name == "sft":
        _check_sft(setup)
        return
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
    for name, unset, flag, why in _NOT_WITH_PREFERENCE:
        if getattr(setup, name) != unset:
            raise LlmemError(f"{flag} with --objective {spec.name}: {why}")
    if setup.method not in PREFERENCE_METHODS:
        raise LlmemError(f"--objective {spec.name} is modelled under --method {' or '.join(PREFERENCE_METHODS)} "
                         f"(got {setup.method})")
    if setup.attn not in PREFERENCE_ATTENTIONS:
        raise LlmemError(f"--objective {spec.name} with --attn {setup.attn} is not modelled: use --attn "
                         f"{' or '.join(PREFERENCE_ATTENTIONS)}")
    if kl_sequences(setup) and setup.batch_size < 2:
        raise LlmemError(f"--objective {spec.name} with loss_type {loss_type_of(setup)} needs --batch-size >= 2 "
                         "(KTOTrainer: the KL term pairs each prompt with a neighbour's completion)")
    if not spec.paired and setup.batch_size % 2:
        raise LlmemError(f"--objective {spec.name}: llmem lays out half desirable, half undesirable completions; "
                         f"use an even --batch-size (got {setup.batch_size})")


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
    return setup.seq_len - max(setup.prompt_len, 1)


def objective_notes(setup) -> list[str]:
    """What the estimate and the trace say about a preference objective's step (none for sft)."""
    spec = objective_spec(setup.objective)
    if spec.name == "sft":
        return []
    rows = spec.sequences_per_sample * setup.batch_size
    max_length = spec.max_length if setup.max_length is None else setup.max_length
    mode = reference_mode(setup)
    dtype = "the compute dtype" if setup.ref_dtype == "compute" else \
        f"the policy's dtype ({'fp32' if setup.param_bytes == 4 else setup.precision.removesuffix('-mixed')}, TRL's " \
        "dtype=model.dtype)"
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
            f"reference: {reference}"]
