"""The evaluation a config runs, read into --eval-batch-size, --eval-keeps, --eval-accumulation-steps and
--eval-samples (llmem.setup.eval_phase), for the HF-Trainer-based frameworks:

- TrainingArguments (TRL's configs, LLaMA-Factory's): the Trainer evaluates where eval_strategy (evaluation_strategy,
  its name before transformers 4.46) is not "no", and a script calls evaluate() where do_eval is set (LLaMA-Factory's
  workflows do) or eval_on_start; per_device_eval_batch_size (8 by default), eval_accumulation_steps;
  prediction_loss_only and batch_eval_metrics keep nothing but the losses across steps;
- LLaMA-Factory (hparams/data_args.py, train/sft/workflow.py): val_size, an integer count of eval samples or a
  fraction of the data; compute_accuracy gives the Trainer ComputeAccuracy and eval_logit_processor (an argmax:
  token ids kept); predict_with_generate generates in the eval (not modelled);
- axolotl (utils/schemas, core/builders/causal.py): an eval set where val_set_size > 0 (a count where > 1) or
  test_datasets; eval_batch_size, micro_batch_size by default (normalize_config); eval_strategy "no" turns it off.

What the Trainer keeps across eval steps depends on the script's compute_metrics, which no config states: without
one (TRL's and axolotl's trainers by default) only the losses; the reading says so in a note.
"""

from __future__ import annotations

from typing import Any

from llmem.setup.eval_phase import HF_EVAL_BATCH_SIZE
from llmem.setup.sources.reading import Keys, Reading

METRICS_NOTE = ("a compute_metrics in the training script keeps every eval step's logits on the GPU: add "
                "--eval-keeps logits (token-ids where preprocess_logits_for_metrics takes the argmax)")
WHEN_KEYS = ("eval_steps", "eval_delay", "evals_per_epoch")     # when it runs: no memory effect


def _strategy(keys: Keys) -> tuple[str, str | None]:
    """eval_strategy (or its old name), and the key it was read from (None: not given, "no")."""
    for key in ("eval_strategy", "evaluation_strategy"):
        if key in keys:
            return str(keys.get(key)).strip().lower(), key
    return "no", None


def _runs(r: Reading, keys: Keys) -> bool:
    """Whether TrainingArguments make the job evaluate: a strategy other than "no", do_eval or eval_on_start."""
    strategy, key = _strategy(keys)
    if key is not None:
        r.note_used(key, keys.get(key), "the Trainer evaluates during training" if strategy != "no" else
                    "no eval during training")
    flags = [k for k in ("do_eval", "eval_on_start") if k in keys and r.boolean(k, keys.get(k))]
    for k in flags:
        r.note_used(k, True, "the job runs evaluate()")
    return strategy != "no" or bool(flags)


def read_trainer_eval(r: Reading, keys: Keys, size_key: str | None = None, keeps: tuple[str, Any] | None = None,
                      script: bool = False) -> None:
    """TrainingArguments' evaluation keys; `size_key`: the framework's validation size key, where it has one;
    `keeps`: (key, raw) of a framework switch that keeps token ids (LLaMA-Factory's compute_accuracy); `script`: the
    framework runs its own script, whose compute_metrics the config decides (else the user's script may add one)."""
    runs = _runs(r, keys)
    batch_key = "per_device_eval_batch_size"
    raw = keys.get(batch_key, HF_EVAL_BATCH_SIZE)
    if not runs:
        _not_evaluating(r, keys, (batch_key, "eval_accumulation_steps", "prediction_loss_only", *WHEN_KEYS,
                                  *((size_key,) if size_key else ())))
        return
    r.set(batch_key if batch_key in keys else f"{batch_key} (default)", raw, "eval_batch_size",
          r.integer(batch_key, raw, what="an eval batch size"))
    _eval_details(r, keys, size_key, keeps, script)


def _eval_details(r: Reading, keys: Keys, size_key: str | None, keeps: tuple[str, Any] | None,
                  script: bool) -> None:
    """What an evaluating job keeps, and for how long."""
    if "eval_accumulation_steps" in keys:
        raw = keys.get("eval_accumulation_steps")
        r.set("eval_accumulation_steps", raw, "eval_accumulation_steps",
              r.integer("eval_accumulation_steps", raw, what="a step count"))
    if size_key is not None and size_key in keys:
        raw = keys.get(size_key)
        if _number(r, size_key, raw) > 1:
            r.set(size_key, raw, "eval_samples", r.integer(size_key, raw, what="a count of samples"))
        else:
            r.note_used(size_key, raw, "a share of the data, whose size llmem does not know")
    loss_only = [k for k in ("prediction_loss_only", "batch_eval_metrics") if k in keys and r.boolean(k, keys.get(k))]
    for k in loss_only:
        r.note_used(k, True, "nothing but the losses kept across eval steps" if k == "prediction_loss_only" else
                    "metrics computed per batch: nothing but the losses kept across eval steps")
    if keeps is not None and not loss_only:
        r.set(keeps[0], keeps[1], "eval_keeps", "token-ids", "its compute_metrics keeps the argmax of the logits")
    elif not loss_only and not script:
        r.notes.append(METRICS_NOTE)
    for key in WHEN_KEYS:
        if key in keys:
            r.note_used(key, keys.get(key), "when the eval runs: no memory effect")
    if "eval_do_concat_batches" in keys and not r.boolean("eval_do_concat_batches", keys.get("eval_do_concat_batches")):
        r.ignore("eval_do_concat_batches", False, "kept tensors appended to a list, not concatenated: the cat's "
                 "copy is counted (an upper bound)")
    include = keys.get("include_for_metrics") or []
    if "inputs" in include:
        r.ignore("include_for_metrics", include, "the inputs kept beside the predictions are not counted")


def _not_evaluating(r: Reading, keys: Keys, names: tuple[str, ...]) -> None:
    for key in names:
        if key in keys:
            r.ignore(key, keys.get(key), "the job does not evaluate", approximates=False)


def _number(r: Reading, key: str, raw: Any) -> float:
    """A validation size (LLaMA-Factory's val_size, axolotl's val_set_size): a count of samples where above 1, else
    a share of the data."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if isinstance(raw, bool) or value < 0:
        raise r.error(key, raw, "is not a validation size", "give a share of the data in [0, 1) or a count of "
                      "samples")
    return value


def read_llamafactory_eval(r: Reading, keys: Keys) -> None:
    """LLaMA-Factory's eval: TrainingArguments' keys, val_size (a count: --eval-samples), compute_accuracy (token
    ids kept), predict_with_generate (generation in the eval: not modelled)."""
    keys.get("eval_dataset")
    accuracy = keys.get("compute_accuracy")
    keeps = ("compute_accuracy", True) if accuracy and r.boolean("compute_accuracy", accuracy) else None
    read_trainer_eval(r, keys, "val_size", keeps, script=True)
    if keys.get("predict_with_generate"):
        r.ignore("predict_with_generate", True, "the eval's generate (Seq2SeqTrainer) is not modelled")


def read_axolotl_eval(r: Reading, keys: Keys, micro_batch: int) -> None:
    """axolotl's eval: an eval set (val_set_size > 0 or test_datasets) unless eval_strategy is "no"; eval_batch_size
    (micro_batch_size by default); a val_set_size above 1 is a count of samples."""
    size = keys.get("val_set_size", 0.0)
    has_set = bool(keys.get("test_datasets")) or _number(r, "val_set_size", size) > 0
    strategy, key = _strategy(keys)
    if key is not None:
        r.note_used(key, keys.get(key), "no eval during training" if strategy == "no" else "when the eval runs")
    if not has_set or (key is not None and strategy == "no"):     # (no strategy given: axolotl's own per the set)
        _not_evaluating(r, keys, ("eval_batch_size", *WHEN_KEYS, "eval_accumulation_steps"))
        return
    batch_raw = keys.get("eval_batch_size", micro_batch)
    r.set("eval_batch_size" if "eval_batch_size" in keys else "eval_batch_size (default: micro_batch_size)",
          batch_raw, "eval_batch_size", r.integer("eval_batch_size", batch_raw, what="an eval batch size"))
    _eval_details(r, keys, "val_set_size", None, script=True)
    for k, why in (("do_causal_lm_eval", "generation-based causal-LM metrics in the eval are not modelled"),
                   ("eval_table_size", "the eval's generated-samples table is not modelled")):
        if keys.get(k):
            r.ignore(k, keys.get(k), why)
    seq = keys.get("eval_sequence_len")
    if seq is not None and seq != keys.get("sequence_len"):
        r.ignore("eval_sequence_len", seq, "the eval at its own sequence length is not modelled: sequence_len "
                 "stands in")
