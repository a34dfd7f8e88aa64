"""`llmem plan --export trl`: the config the trl CLI reads (its own TrlParser over the command's dataclasses accepts
every key), the accelerate config beside it on more than one GPU, the values back through llmem's `--from` reader,
and the refusals."""

from __future__ import annotations

import importlib
import json
import types
from pathlib import Path

import pytest

from llmem.errors import LlmemError
from llmem.planner.export import ExportPlan, check_exportable, write_export
from llmem.planner.export_trl import export_trl
from llmem.planner.options import PlanOptions
from llmem.planner.plan import plan
from llmem.setup.layout import Layout
from llmem.setup.sources import setup_from_file
from llmem.setup.training import TrainingSetup

pytest.importorskip("trl")

MICRO = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-05, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("micro") / "config.json"
    path.write_text(json.dumps(MICRO))
    return str(path)


def _export(micro: str, path, gpus: int = 1, **kw):
    setup = TrainingSetup(model=micro, gpus=gpus, seq_len=32, **kw)
    p = plan(setup, PlanOptions(batch_cap=2, global_batch=4 * gpus, methods=("single",) if gpus == 1 else ("ddp",)))
    return write_export(p, "trl", str(path))


def _parsed(command: str, path) -> tuple:
    """The trl CLI's own parse of `trl COMMAND --config PATH` (trl/scripts/COMMAND.py make_parser): the
    dataclasses and the strings it passes on to accelerate launch."""
    parser = importlib.import_module(f"trl.scripts.{command}").make_parser()
    # use_cpu: TrainingArguments refuses bf16 on a host without a GPU otherwise (not a key of the file)
    *out, to_launch, _cli = parser.parse_args_and_config(
        ["--config", str(path), "--dataset_name", "x", "--output_dir", str(path.parent / "out"), "--use_cpu", "true"],
        return_remaining_strings=True, separate_remaining_strings=True)
    return out, to_launch


def test_dpo_lora_on_two_gpus(micro, tmp_path):
    path = tmp_path / "dpo.yaml"
    e = _export(micro, path, gpus=2, objective="dpo", lora_rank=8, lora_targets="q_proj,k_proj",
                precompute_ref_log_probs=True)
    (_script, config, model, _mix), to_launch = _parsed("dpo", path)
    beside = tmp_path / "dpo.accelerate.yaml"
    assert to_launch == ["--accelerate_config", str(beside)] and beside.exists()
    assert type(config).__name__ == "DPOConfig"
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps) == \
        (e.micro_batch_size, e.accumulation_steps)
    assert e.micro_batch_size * e.accumulation_steps * 2 == 8         # the planned global batch, 4 per GPU
    assert (config.max_length, config.beta, config.loss_type, config.precompute_ref_log_probs) == \
        (32, 0.1, ["sigmoid"], True)
    assert (config.gradient_checkpointing, config.bf16) == (False, True)      # TRL's defaults are True / True
    assert (model.use_peft, model.lora_r, model.lora_target_modules) == (True, 8, ["q_proj", "k_proj"])
    assert model.model_name_or_path == micro and e.notes and str(beside) in e.notes[0]
    # llmem's --from reader of both files: the same layout, sizes and objective (the batch counts pairs, as
    # DPOConfig's per_device_train_batch_size does)
    back = setup_from_file([path, beside]).setup
    assert (back.gpus, back.method, back.seq_len, back.batch_size, back.precision, back.grad_ckpt) == \
        (2, "ddp", 32, e.micro_batch_size, "bf16-mixed", False)
    assert (back.objective, back.loss_type, back.precompute_ref_log_probs, back.max_length) == \
        ("dpo", "sigmoid", True, 32)
    assert (back.lora_rank, back.lora_targets) == (8, "q_proj,k_proj")


@pytest.mark.parametrize(("objective", "command", "config_class"), [
    ("trl-sft", "sft", "SFTConfig"), ("reward", "reward", "RewardConfig")])
def test_each_cli_command_accepts_its_config(micro, tmp_path, objective, command, config_class):
    path = tmp_path / f"{objective}.yaml"
    _export(micro, path, objective=objective, precision="bf16", grad_ckpt=True)
    (_script, config, model, _mix), to_launch = _parsed(command, path)
    assert type(config).__name__ == config_class and to_launch == []       # one GPU: no accelerate config
    assert (config.max_length, config.gradient_checkpointing, model.dtype) == (32, True, "bfloat16")
    assert not (tmp_path / f"{objective}.accelerate.yaml").exists()
    back = setup_from_file(path).setup        # the trainer told from the keys only its config has
    assert (back.objective, back.seq_len, back.grad_ckpt, back.precision) == (objective, 32, True, "bf16")


def test_trl_sft_round_trip(micro, tmp_path):
    """--objective trl-sft, loss_type dft: `trl sft`'s own parser reads an SFTConfig with it, and llmem's --from
    reads the file back as the same objective and loss; --objective sft is refused (trl sft runs SFTTrainer)."""
    path = tmp_path / "sft.yaml"
    e = _export(micro, path, objective="trl-sft", loss_type="dft", precision="bf16", grad_ckpt=True)
    (_script, config, model, _mix), to_launch = _parsed("sft", path)
    assert type(config).__name__ == "SFTConfig" and to_launch == []
    assert (config.loss_type, config.max_length, config.per_device_train_batch_size) == ("dft", 32, e.micro_batch_size)
    back = setup_from_file(path).setup
    assert (back.objective, back.loss_type, back.seq_len, back.batch_size, back.precision) == \
        ("trl-sft", "dft", 32, e.micro_batch_size, "bf16")
    with pytest.raises(LlmemError, match="plan with --objective trl-sft"):
        _export(micro, tmp_path / "plain.yaml", objective="sft")


def test_kto_config(micro, tmp_path):
    """KTO through the writer alone (the planner searches odd micro-batches, which KTO refuses): KTOConfig's
    loss_type and precompute_ref_log_probs."""
    setup = TrainingSetup(model=micro, seq_len=32, objective="kto", batch_size=2, loss_type="apo_zero_unpaired")
    e = ExportPlan(micro, "LlamaForCausalLM", Layout("single", 1, 1, 1), 2, 3, 32, "bf16-mixed", True, False)
    path = tmp_path / "kto.yaml"
    for name, text in export_trl(types.SimpleNamespace(setup=setup), e, str(path), None).items():
        Path(name).write_text(text)
    (_script, config, _model, _mix), to_launch = _parsed("kto", path)
    assert type(config).__name__ == "KTOConfig" and to_launch == []
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps, config.loss_type) == \
        (2, 3, "apo_zero_unpaired")
    assert (config.precompute_ref_log_probs, config.gradient_checkpointing) == (False, True)
    back = setup_from_file(path).setup
    assert (back.objective, back.loss_type, back.batch_size, back.precompute_ref_log_probs) == \
        ("kto", "apo_zero_unpaired", 2, False)


@pytest.mark.parametrize(("fields", "message"), [
    ({"objective": "sft"}, "plan with --objective trl-sft"),       # `trl sft` runs SFTTrainer's fused head
    ({"objective": "orpo"}, "no command for --objective orpo"),
    ({"objective": "simpo"}, "no command for --objective simpo"),
    ({"objective": "dpo", "ref_dtype": "compute"}, "drop --ref-dtype"),
    ({"objective": "dpo", "fused_ce": False, "optimizer": "sgd"}, "--optimizer sgd"),
])
def test_refusals(micro, fields, message):
    with pytest.raises(LlmemError, match=message):
        check_exportable(TrainingSetup(model=micro, seq_len=32, **fields), "--export trl", "trl")


def test_other_exports_still_refuse_the_objective(micro):
    with pytest.raises(LlmemError, match="--objective dpo"):
        check_exportable(TrainingSetup(model=micro, seq_len=32, objective="dpo"), "--export accelerate", "accelerate")
