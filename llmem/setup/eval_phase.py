"""The evaluation phase of the job (HF Trainer's `evaluate`, transformers 5.25): whether the set-up runs one, what
each eval step keeps on the GPU (`EVAL_KEEPS`), and where the phase is not modelled (`eval_unmodelled`). The bytes
are worked out on the estimator floor (llmem.estimator.eval_phase).

What `Trainer.evaluation_loop` keeps across eval steps (trainer.py; trainer_pt_utils.EvalLoopContainer):
- `evaluate` passes prediction_loss_only=True when the Trainer has no compute_metrics, and otherwise
  TrainingArguments.prediction_loss_only (False by default): only then does prediction_step return the logits;
- the logits (after preprocess_logits_for_metrics, where the Trainer has one: commonly an argmax to token ids) and
  the labels are gathered from every rank (accelerate's gather_for_metrics: all_gather_into_tensor) and
  concatenated on the GPU, step after step, until eval_accumulation_steps steps have passed (then numpified to
  the host) or the eval set ends;
- the losses (one per sample, gathered) are kept the same way whatever the Trainer keeps besides.

An eval runs when eval_strategy is not "no" (or do_eval, or eval_on_start); llmem runs the phase when
--eval-batch-size is given (TrainingArguments' per_device_eval_batch_size, 8 by default; `--from` sets it where
the config evaluates).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from llmem.errors import LlmemError
from llmem.setup.methods import method_spec
from llmem.setup.objectives import objective_spec

HF_EVAL_BATCH_SIZE = 8      # TrainingArguments.per_device_eval_batch_size's default


@dataclass(frozen=True)
class EvalKeep:
    """What one eval step leaves in the Trainer's containers on the GPU, beside the gathered losses."""
    name: str
    summary: str                  # --help and the phase's `what`
    token_bytes: int | None       # bytes per token of the kept predictions: None: the logits (vocab x their dtype)
    labels: bool                  # the labels are kept beside them (int64 per token)


EVAL_KEEPS: dict[str, EvalKeep] = {k.name: k for k in (
    EvalKeep("loss", "the losses only: no compute_metrics, or prediction_loss_only (HF Trainer's default)", 0, False),
    EvalKeep("logits", "every step's logits and labels, gathered from all ranks: compute_metrics without "
             "preprocess_logits_for_metrics", None, True),
    EvalKeep("token-ids", "token ids and labels, int64: preprocess_logits_for_metrics returning logits.argmax(-1)",
             8, True),
)}


def eval_steps(samples: int, world: int, batch: int) -> int:
    """Eval steps per rank: the sampler gives each rank ceil(samples / world) samples (the last batch padded with
    repeats, which gather_for_metrics drops), in batches of `batch`."""
    return ceil(samples / (world * batch))


def kept_steps(setup, world: int) -> int:
    """The eval steps whose kept tensors are on the GPU at once: eval_accumulation_steps (at most the eval's steps),
    or every step of the eval set (--eval-samples); else one step, a floor."""
    n, samples, batch = setup.eval_accumulation_steps, setup.eval_samples, setup.eval_batch_size
    steps = eval_steps(samples, world, batch) if samples is not None else None
    if n is not None:
        return n if steps is None else min(n, steps)
    return 1 if steps is None else steps


def native_amp(setup) -> bool:
    """accelerate's native AMP wraps the model's forward (autocast and convert_outputs_to_fp32: fp32 logits out)
    under every precision but DeepSpeed's, whose engine runs the model in its own dtype."""
    return method_spec(setup.method).zero_stage is None


def eval_runs(setup) -> bool:
    """Whether the job evaluates (--eval-batch-size given)."""
    return setup.eval_batch_size is not None


def eval_unmodelled(setup) -> str | None:
    """Why the eval phase of a set-up that evaluates is not modelled (None: it is, or it does not evaluate)."""
    if not eval_runs(setup):
        return None
    objective, spec = objective_spec(setup.objective), method_spec(setup.method)
    reasons = (
        (objective.runs_trainer, f"TRL's {objective.trainer} for --objective {setup.objective}, which evaluates its "
                                 "own way (its prediction_step)"),
        (spec.has_tp, "tensor parallelism"),
        (setup.pp > 1, "pipeline parallelism"),
        (setup.cp > 1, "context parallelism"),
        (setup.ep > 1, "expert parallelism"),
        (spec.zero_stage == 3, "ZeRO-3 (its module gathering in an inference forward)"),
        (setup.fused_ce, "--fused-ce (Liger computes full logits in eval mode unless the Trainer asks it not to)"),
        (setup.images_per_sample > 0, "a vision-language batch"),
    )
    return next((why for cond, why in reasons if cond), None)


def check_eval(setup) -> None:
    """--eval-batch-size, --eval-accumulation-steps, --eval-samples, --eval-keeps: counts >= 1, a known row, and
    only with an eval."""
    if setup.eval_keeps not in EVAL_KEEPS:
        raise LlmemError(f"unknown --eval-keeps {setup.eval_keeps!r}: choose one of {', '.join(EVAL_KEEPS)}")
    for flag, value in (("--eval-batch-size", setup.eval_batch_size),
                        ("--eval-accumulation-steps", setup.eval_accumulation_steps),
                        ("--eval-samples", setup.eval_samples)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise LlmemError(f"{flag} must be a whole number >= 1, got {value!r}")
    if not eval_runs(setup):
        given = [flag for flag, on in (("--eval-accumulation-steps", setup.eval_accumulation_steps is not None),
                                       ("--eval-samples", setup.eval_samples is not None),
                                       ("--eval-keeps", setup.eval_keeps != "loss")) if on]
        if given:
            raise LlmemError(f"{given[0]} describes an evaluation: add --eval-batch-size N (HF's "
                             f"per_device_eval_batch_size, default {HF_EVAL_BATCH_SIZE})")
