"""axolotl's `rl:` read as the TRL trainer axolotl's builder runs (axolotl 0.19: utils/schemas/enums.py RLType,
core/builders/rl.py): the objective, the micro-batch in its units, the loss type and TRL's max_length as axolotl
passes them; a trainer llmem does not model refused, never answered as supervised fine-tuning. Each expected value
is read off the YAML written here."""

from __future__ import annotations

import pytest

from llmem.errors import LlmemError
from llmem.setup.sources import setup_from_file

BASE = """base_model: meta-llama/Llama-3.1-8B
micro_batch_size: {batch}
sequence_len: {seq}
bf16: true
"""
LORA = "adapter: lora\nlora_r: 16\nlora_alpha: 32\nlora_target_linear: true\n"


def _read(tmp_path, extra: str, batch: int = 2, seq: int = 1024, lora: bool = True):
    path = tmp_path / "axolotl.yml"
    path.write_text(BASE.format(batch=batch, seq=seq) + (LORA if lora else "") + extra)
    return setup_from_file(path)


@pytest.mark.parametrize("rl, objective, loss_type", [
    ("dpo", "dpo", None),            # DPOConfig's default loss
    ("ipo", "dpo", "ipo"),           # DPOStrategy: loss_type ["ipo"]
    ("orpo", "orpo", None),
    ("simpo", "simpo", None),        # TRL's CPOTrainer, loss_type "simpo"
])
def test_paired_rl_types_run_their_trl_trainer(tmp_path, rl, objective, loss_type):
    s = _read(tmp_path, f"rl: {rl}\n").setup
    assert s.objective == objective
    assert s.batch_size == 2                 # micro_batch_size counts pairs (chosen and rejected: 2 rows each)
    assert (s.seq_len, s.max_length) == (1024, 1024)     # _set_base_training_args: max_length = sequence_len
    if loss_type is not None:
        assert s.loss_type == loss_type


def test_dpo_loss_type_list_and_precomputed_reference(tmp_path):
    s = _read(tmp_path, "rl: dpo\ndpo_loss_type: [hinge]\nprecompute_ref_log_probs: true\n").setup
    assert (s.loss_type, s.precompute_ref_log_probs) == ("hinge", True)


def test_kto_counts_rows(tmp_path):
    s = _read(tmp_path, "rl: kto\n", batch=4).setup
    assert (s.objective, s.batch_size) == ("kto", 4)


def test_grpo_reads_the_trl_block(tmp_path):
    """GRPOStrategy passes the trl block's num_generations, max_completion_length and beta; axolotl drops
    max_length and max_prompt_length, so the prompt is TRL 1.16's untruncated one (512 tokens assumed)."""
    s = _read(tmp_path, "rl: grpo\ntrl:\n  num_generations: 4\n  max_completion_length: 256\n  beta: 0.04\n",
              batch=4).setup
    assert (s.objective, s.num_generations, s.max_completion_length, s.beta) == ("grpo", 4, 256, 0.04)
    assert s.seq_len == 512 + 256


GDPO_TRL = ("trl:\n  num_generations: 2\n  max_completion_length: 128\n  beta: 0.001\n"
            "  reward_weights: [1.0, 2.0]\n")


def test_gdpo_is_grpos_trainer_with_rewards_normalised_apart(tmp_path):
    """axolotl's RLType.GDPO runs GRPO's trainer with TRL's multi_objective_aggregation 'normalize_then_sum'
    (core/builders/rl.py): the same step, so the same set-up as the file with rl: grpo."""
    gdpo = _read(tmp_path, "rl: gdpo\n" + GDPO_TRL, batch=4)
    grpo = _read(tmp_path, "rl: grpo\n" + GDPO_TRL, batch=4).setup
    assert gdpo.setup == grpo and grpo.objective == "grpo"
    assert any(u.key == "rl" and "normalize_then_sum" in u.note for u in gdpo.record.used)


def test_gdpo_with_grpos_aggregation_is_refused_as_axolotl_refuses_it(tmp_path):
    with pytest.raises(LlmemError, match="'sum_then_normalize' is GRPO: axolotl refuses the pair") as got:
        _read(tmp_path, "rl: gdpo\n" + GDPO_TRL + "  multi_objective_aggregation: sum_then_normalize\n")
    assert "\n" not in str(got.value)


def test_reward_model(tmp_path):
    s = _read(tmp_path, "reward_model: true\n", lora=False).setup   # TRL's RewardTrainer: the score head in full
    assert (s.objective, s.batch_size, s.max_length) == ("reward", 2, 1024)


def test_a_trainer_llmem_does_not_model_is_refused(tmp_path):
    with pytest.raises(LlmemError, match="rl = 'ebft' runs a trainer llmem does not model"):
        _read(tmp_path, "rl: ebft\n")


def test_no_rl_is_supervised_fine_tuning(tmp_path):
    s = _read(tmp_path, "").setup
    assert (s.objective, s.batch_size, s.seq_len) == ("sft", 2, 1024)
