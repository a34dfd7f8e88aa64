"""torchtune's DPO recipes (lora_dpo_single_device, lora_dpo_distributed, full_dpo_distributed) read as the DPO
step: the loss component names the objective and TRL's loss_type of the same formula (DPOLoss: sigmoid, RSOLoss:
hinge), batch_size counts pairs, tokenizer.max_seq_len truncates each sequence; the recipe's own forward keeps the
whole logits, so the answer says it is approximate."""

from __future__ import annotations

import pytest

from llmem.setup.sources import setup_from_file

RECIPE = """model:
  _component_: torchtune.models.llama3_1.lora_llama3_1_8b
  lora_attn_modules: [q_proj, v_proj]
  lora_rank: 8
  lora_alpha: 16
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  max_seq_len: 1024
batch_size: 4
dtype: bf16
loss:
  _component_: torchtune.rlhf.loss.{loss}
"""


@pytest.mark.parametrize("loss, loss_type", [("DPOLoss", "sigmoid"), ("RSOLoss", "hinge")])
def test_dpo_recipes(tmp_path, loss, loss_type):
    path = tmp_path / "dpo.yaml"
    path.write_text(RECIPE.format(loss=loss))
    read = setup_from_file(path)
    s = read.setup
    assert (s.objective, s.loss_type, s.batch_size, s.seq_len, s.max_length) == ("dpo", loss_type, 4, 1024, 1024)
    assert (s.model, s.lora_rank) == ("meta-llama/Llama-3.1-8B", 8)
    assert not read.record.exact


def test_a_supervised_recipe_stays_sft(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text(RECIPE.format(loss="DPOLoss").replace("torchtune.rlhf.loss.DPOLoss",
                                                          "torchtune.modules.loss.LinearCrossEntropyLoss"))
    assert setup_from_file(path).setup.objective == "sft"
