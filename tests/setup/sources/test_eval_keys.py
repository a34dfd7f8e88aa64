"""The evaluation keys of TRL / TrainingArguments, LLaMA-Factory and axolotl configs read into --eval-batch-size,
--eval-keeps, --eval-accumulation-steps and --eval-samples (llmem.setup.sources.evaluation); the expected values
are the files' own."""

from __future__ import annotations

from pathlib import Path

import pytest
from published_configs import CONFIGS as SHARED
from published_configs import SKIP_REASON, present

from llmem.errors import LlmemError
from llmem.setup.sources import setup_from_file

needs_configs = pytest.mark.skipif(not present(), reason=SKIP_REASON)
EVAL_FIELDS = ("eval_batch_size", "eval_keeps", "eval_accumulation_steps", "eval_samples")


def _eval(got) -> tuple:
    return tuple(getattr(got.setup, f) for f in EVAL_FIELDS)


def _write(tmp_path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


TRL = """model_name_or_path: tiny-llama
per_device_train_batch_size: 2
max_length: 256
"""


def test_trl_without_a_strategy_does_not_evaluate(tmp_path):
    got = setup_from_file([_write(tmp_path, TRL + "per_device_eval_batch_size: 4\n")])
    assert _eval(got) == (None, "loss", None, None)
    assert any(i.key == "per_device_eval_batch_size" and "does not evaluate" in i.why for i in got.record.ignored)


def test_trl_eval_strategy_with_hfs_default_batch(tmp_path):
    got = setup_from_file([_write(tmp_path, TRL + "eval_strategy: steps\neval_steps: 50\n")])
    assert _eval(got) == (8, "loss", None, None)              # per_device_eval_batch_size's default
    assert any("compute_metrics in the training script" in n for n in got.record.notes)


def test_trl_old_strategy_name_batch_and_accumulation(tmp_path):
    got = setup_from_file([_write(tmp_path, TRL + "evaluation_strategy: epoch\nper_device_eval_batch_size: 16\n"
                                  "eval_accumulation_steps: 4\nprediction_loss_only: true\n")])
    assert _eval(got) == (16, "loss", 4, None)
    assert not any("compute_metrics in the training script" in n for n in got.record.notes)


def test_the_command_line_overrides_the_files_eval(tmp_path):
    got = setup_from_file([_write(tmp_path, TRL + "do_eval: true\n")], eval_batch_size=2, eval_keeps="logits")
    assert _eval(got) == (2, "logits", None, None)


LLAMAFACTORY = """model_name_or_path: tiny-llama
stage: sft
do_train: true
finetuning_type: lora
lora_target: all
cutoff_len: 256
per_device_train_batch_size: 1
bf16: true
"""


def test_llamafactory_val_size_count_and_compute_accuracy(tmp_path):
    got = setup_from_file([_write(tmp_path, LLAMAFACTORY + "val_size: 200\nper_device_eval_batch_size: 2\n"
                                  "eval_strategy: steps\ncompute_accuracy: true\n")])
    # compute_accuracy: ComputeAccuracy with eval_logit_processor's argmax -> token ids kept
    assert _eval(got) == (2, "token-ids", None, 200)


@needs_configs
def test_llamafactory_example_evaluates_a_share_of_the_data():
    got = setup_from_file([SHARED / "llamafactory/examples/train_qlora/llama3_lora_sft_bitsandbytes.yaml"],
                          model="tiny-llama")
    # val_size: 0.1 (a share), per_device_eval_batch_size: 1, eval_strategy: steps
    assert _eval(got) == (1, "loss", None, None)


@needs_configs
def test_axolotl_val_set_size_turns_the_eval_on_at_the_micro_batch():
    got = setup_from_file([SHARED / "axolotl/examples/llama-3/fft-8b.yaml"], model="tiny-llama")
    # val_set_size: 0.05, micro_batch_size: 1, no eval_batch_size
    assert _eval(got) == (1, "loss", None, None)


@needs_configs
def test_axolotl_without_a_validation_set_does_not_evaluate():
    got = setup_from_file([SHARED / "axolotl/examples/llama-3/qlora.yml"], model="tiny-llama")   # val_set_size: 0
    assert _eval(got) == (None, "loss", None, None)


def test_axolotl_count_and_eval_batch_size(tmp_path):
    text = ("base_model: tiny-llama\nmicro_batch_size: 2\nsequence_len: 256\nval_set_size: 500\n"
            "eval_batch_size: 4\neval_strategy: steps\n")
    assert _eval(setup_from_file([_write(tmp_path, text)])) == (4, "loss", None, 500)
    off = text.replace("eval_strategy: steps", "eval_strategy: 'no'")
    assert _eval(setup_from_file([_write(tmp_path, off)])) == (None, "loss", None, None)


def test_a_bad_validation_size_is_one_line(tmp_path):
    text = "base_model: tiny-llama\nmicro_batch_size: 2\nsequence_len: 256\nval_set_size: lots\n"
    with pytest.raises(LlmemError, match="val_set_size = 'lots' is not a validation size"):
        setup_from_file([_write(tmp_path, text)])
