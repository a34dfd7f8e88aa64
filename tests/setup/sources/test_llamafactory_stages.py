"""LLaMA-Factory's preference stages (0.9.5, hparams/finetuning_args.py) as the TRL trainers it subclasses:
stage dpo by pref_loss (sigmoid / hinge / ipo: DPO's loss types; orpo / simpo: no reference), stage kto; the
answer marked approximate for LLaMA-Factory's own forward, which keeps the whole fp32 logits. Expected values are
read off the YAML written here."""

from __future__ import annotations

import pytest

from llmem.errors import LlmemError
from llmem.setup.sources import setup_from_file

LF = """model_name_or_path: meta-llama/Llama-3.1-8B
stage: {stage}
finetuning_type: lora
lora_rank: 8
cutoff_len: 1024
per_device_train_batch_size: 2
bf16: true
{extra}"""


def _read(tmp_path, stage: str, extra: str = ""):
    path = tmp_path / "lf.yaml"
    path.write_text(LF.format(stage=stage, extra=extra))
    return setup_from_file(path)


@pytest.mark.parametrize("loss, objective, loss_type", [("sigmoid", "dpo", "sigmoid"), ("ipo", "dpo", "ipo"),
                                                        ("orpo", "orpo", None), ("simpo", "simpo", None)])
def test_dpo_stage_by_pref_loss(tmp_path, loss, objective, loss_type):
    read = _read(tmp_path, "dpo", f"pref_loss: {loss}\n")
    s = read.setup
    assert (s.objective, s.batch_size, s.seq_len, s.max_length) == (objective, 2, 1024, 1024)
    if loss_type:
        assert s.loss_type == loss_type
    assert not read.record.exact


def test_kto_stage(tmp_path):
    s = _read(tmp_path, "kto").setup
    assert (s.objective, s.batch_size) == ("kto", 2)


def test_a_loss_llmem_does_not_model_is_refused(tmp_path):
    with pytest.raises(LlmemError, match="pref_loss = 'kto_pair' is not a loss llmem models"):
        _read(tmp_path, "dpo", "pref_loss: kto_pair\n")


def test_sft_stays_exact(tmp_path):
    read = _read(tmp_path, "sft")
    assert read.setup.objective == "sft" and read.record.exact
