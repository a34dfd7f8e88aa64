"""`--from` a `trl <command> --config` YAML: the trainer told from the keys only its config has (llmem.setup.sources.
trl_trainers), checked against the installed trl's own parsers (which command's TrlParser consumes every key), and
the objective's keys read into the TrainingSetup."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import yaml

from llmem.errors import LlmemError
from llmem.setup.sources import setup_from_file
from llmem.setup.sources.trl_trainers import TRL_CONFIGS

trl = pytest.importorskip("trl")

BASE = {"model_name_or_path": "tiny-llama", "per_device_train_batch_size": 4}
DPO = {**BASE, "max_length": 256, "beta": 0.1, "loss_type": ["sigmoid", "sft"], "precompute_ref_log_probs": True}
KTO = {**BASE, "max_length": 256, "desirable_weight": 1.0, "loss_type": "apo_zero_unpaired"}
GRPO = {**BASE, "num_generations": 4, "max_completion_length": 128, "beta": 0.04, "scale_rewards": "group"}
PREFERENCE = {**BASE, "max_length": 256, "beta": 0.1}     # DPOConfig, KTOConfig, ORPOConfig and CPOConfig's keys


def _write(tmp_path, name: str, data: dict):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _consumes(command: str, path, tmp_path) -> bool:
    """Whether `trl COMMAND --config PATH` leaves no key of the file unused (trl/scripts/utils.py)."""
    parser = importlib.import_module(f"trl.scripts.{command}").make_parser()
    try:
        *_out, from_config, _cli = parser.parse_args_and_config(
            ["--config", str(path), "--dataset_name", "x", "--output_dir", str(tmp_path / "out"), "--use_cpu", "true"],
            return_remaining_strings=True, separate_remaining_strings=True)
    except ValueError:          # the config's own checks refuse the file (GRPOConfig: the batch and num_generations)
        return False
    return not from_config


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_table_is_the_installed_trls():
    from transformers import TrainingArguments
    from trl.experimental.cpo import CPOConfig
    from trl.experimental.orpo import ORPOConfig
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    classes = {c.__name__: c for c in (trl.SFTConfig, trl.DPOConfig, trl.KTOConfig, trl.RewardConfig, trl.GRPOConfig,
                                       trl.RLOOConfig, ORPOConfig, CPOConfig, trl.DistillationConfig)}
    for row in TRL_CONFIGS:
        assert set(row.fields) == {f.name for f in dataclasses.fields(classes[row.name])} - base, row.name


@pytest.mark.parametrize(("data", "fits"), [(DPO, {"dpo"}), (KTO, {"kto"}), (GRPO, {"grpo"})])
def test_the_command_whose_parser_takes_every_key(tmp_path, data, fits):
    """The trainer llmem reads is the one trl command whose parser consumes every key of the file."""
    path = _write(tmp_path, "cfg", data)
    consumed = {c for c in ("sft", "dpo", "kto", "reward", "grpo", "rloo") if _consumes(c, path, tmp_path)}
    # loss_type's value narrows DPO from KTO / GRPO from RLOO (whose parsers take the key but not the value)
    assert consumed >= fits and "sft" not in consumed
    assert setup_from_file(path).setup.objective in fits


def test_dpo_keys(tmp_path):
    fs = setup_from_file(_write(tmp_path, "dpo", DPO))
    s = fs.setup
    # the batch counts pairs (DPOConfig's per_device_train_batch_size), not 2 x
    assert (s.objective, s.batch_size, s.seq_len, s.max_length) == ("dpo", 4, 256, 256)
    assert (s.loss_type, s.precompute_ref_log_probs) == ("sigmoid", True)
    assert any(u.key == "beta" and u.field == "" for u in fs.record.used)     # used, no memory effect


def test_kto_and_grpo_keys(tmp_path):
    s = setup_from_file(_write(tmp_path, "kto", KTO)).setup
    assert (s.objective, s.batch_size, s.loss_type, s.max_length) == ("kto", 4, "apo_zero_unpaired", 256)
    s = setup_from_file(_write(tmp_path, "grpo", GRPO)).setup
    # the prompt: trl 1.16 has no max_prompt_length, 512 assumed; + max_completion_length
    assert (s.objective, s.num_generations, s.max_completion_length, s.beta, s.seq_len) == \
        ("grpo", 4, 128, 0.04, 512 + 128)


def test_ambiguous_keys_say_so_and_objective_decides(tmp_path):
    path = _write(tmp_path, "pref", PREFERENCE)
    fs = setup_from_file(path)
    (trainer,) = [u for u in fs.record.used if u.key == "(trainer)"]
    assert fs.setup.objective == "dpo" and "ambiguous" in trainer.note and "KTOConfig" in trainer.note
    fs = setup_from_file(path, objective="kto")
    assert fs.setup.objective == "kto" and "objective" in fs.record.overridden


def test_no_trainer_key_reads_as_sft(tmp_path):
    """No key only a trainer's config has: `trl sft`'s SFTConfig, whose SFTTrainer computes the loss with TRL's fused
    head (trl-sft); its max_length is the sequence as it reaches the model (no max_length field: none to check)."""
    fs = setup_from_file(_write(tmp_path, "sft", {**BASE, "max_length": 512}))
    assert (fs.setup.objective, fs.setup.seq_len, fs.setup.max_length) == ("trl-sft", 512, None)
    (trainer,) = [u for u in fs.record.used if u.key == "(trainer)"]
    assert "SFTConfig assumed" in trainer.note and "fused LM head" in trainer.note


@pytest.mark.parametrize(("data", "message"), [
    ({**BASE, "desirable_weight": 1.0, "loss_type": "sigmoid"}, "no loss type of a TRL trainer"),
])
def test_refusals(tmp_path, data, message):
    with pytest.raises(LlmemError, match=message):
        setup_from_file(_write(tmp_path, "bad", data))
