"""--from: the configs' Liger switches (TrainingArguments' use_liger_kernel and liger_kernel_config, LLaMA-Factory's
enable_liger_kernel, axolotl's LigerPlugin keys) turn on --liger, or stay ignored where llmem does not model it."""

from __future__ import annotations

import pytest

from llmem.errors import LlmemError
from llmem.setup.sources import setup_from_file

FULL = "model_name_or_path: meta-llama/Llama-3.2-1B\nper_device_train_batch_size: 2\nmax_length: 512\nbf16: true\n"
AXOLOTL = ("base_model: meta-llama/Llama-3.2-1B\nmicro_batch_size: 2\nsequence_len: 512\nbf16: true\n"
           "plugins:\n  - axolotl.integrations.liger.LigerPlugin\n")


def _read(tmp_path, text: str, name: str = "sft.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return setup_from_file(path)


def test_use_liger_kernel_turns_on_what_the_trainer_applies(tmp_path):
    """transformers' Trainer calls apply_liger_kernel_to_<model>(): rope, rms_norm, swiglu and the fused linear
    cross-entropy on by default (a TrainingArguments mapping, no TRL key: --objective sft)."""
    (tmp_path / "training_args.yaml").write_text("per_device_train_batch_size: 2\nbf16: true\noutput_dir: out\n"
                                                 "use_liger_kernel: true\n")
    got = setup_from_file(tmp_path / "training_args.yaml", model="meta-llama/Llama-3.2-1B")
    assert got.setup.objective == "sft" and got.setup.liger == "auto" and got.setup.fused_ce


def test_sft_trainer_keeps_the_layer_kernels_and_its_own_head(tmp_path):
    """TRL's SFTTrainer (sft_trainer.py __init__) sets liger_kernel_config's fused_linear_cross_entropy False (its
    fused LM head computes the loss) and refuses it set True."""
    got = _read(tmp_path, FULL + "use_liger_kernel: true\n")
    assert (got.setup.objective, got.setup.liger, got.setup.fused_ce) == ("trl-sft", "auto", False)
    (used,) = [u for u in got.record.used if u.key == "use_liger_kernel" and u.field == "fused_ce"]
    assert "TRL trainer's fused LM head" in used.note
    with pytest.raises(LlmemError, match="refused by TRL's trainer"):
        _read(tmp_path, FULL + "use_liger_kernel: true\nliger_kernel_config:\n  fused_linear_cross_entropy: true\n")


def test_liger_kernel_config_turns_kernels_off(tmp_path):
    got = _read(tmp_path, FULL + "use_liger_kernel: true\nliger_kernel_config:\n  rope: false\n"
                "  fused_linear_cross_entropy: false\n  cross_entropy: true\n")
    assert got.setup.liger == "rms_norm,swiglu" and not got.setup.fused_ce
    assert [i.key for i in got.record.ignored] == ["liger_kernel_config.cross_entropy"]


@pytest.mark.parametrize("keys, objective", [
    ("beta: 0.1\nloss_type: apo_zero\npadding_free: true\n", "dpo"),
    ("num_generations: 2\nmax_completion_length: 64\nmax_prompt_length: 64\n", "grpo"),
])
def test_trl_fused_head_trainers_keep_the_layer_kernels(tmp_path, keys, objective):
    """TRL 1.16's DPO, KTO, GRPO and RLOO trainers do as SFTTrainer does (e.g. dpo_trainer.py __init__): Liger's
    layer kernels on the model, fused_linear_cross_entropy forced off (their fused LM head computes the log-probs).
    Both were refused ('--fused-ce with --objective dpo'); the alignment-handbook's SmolLM3 APO and open-r1's GRPO
    recipes set use_liger_kernel. DPOTrainer also turns padding_free off with a warning (standard padding): read as
    ignored, not as --packing."""
    got = _read(tmp_path, FULL + keys + "use_liger_kernel: true\n")
    s = got.setup
    assert (s.objective, s.liger, s.fused_ce, s.packing) == (objective, "auto", False, False)
    ignored = [i for i in got.record.ignored if i.key == "padding_free"]
    assert [("padding_free" in keys, "turns padding_free off" in i.why) for i in ignored] == \
        ([(True, True)] if "padding_free" in keys else [])


def test_llamafactory_enable_liger_kernel(tmp_path):
    text = ("model_name_or_path: Qwen/Qwen2.5-0.5B\nstage: sft\nfinetuning_type: full\nper_device_train_batch_size: "
            "2\ncutoff_len: 512\nbf16: true\nenable_liger_kernel: true\n")
    got = _read(tmp_path, text)
    assert got.setup.liger == "auto" and got.setup.fused_ce


def test_axolotl_plugin_keys_each_turn_on_their_kernel(tmp_path):
    got = _read(tmp_path, AXOLOTL + "liger_rms_norm: true\nliger_glu_activation: true\n")
    assert got.setup.liger == "rms_norm,swiglu" and not got.setup.fused_ce


def test_liger_with_lora_is_read(tmp_path):
    got = _read(tmp_path, AXOLOTL + "adapter: lora\nlora_r: 16\nlora_target_linear: true\nliger_rope: true\n"
                "liger_rms_norm: true\nliger_fused_linear_cross_entropy: true\n")
    assert got.setup.liger == "rms_norm,rope" and got.setup.fused_ce and got.setup.lora_rank == 16


def test_liger_with_a_quantised_base_stays_ignored_not_refused(tmp_path):
    """--liger is not modelled over a quantised base: a QLoRA run's Liger keys are ignored (HF's modules stand
    in), the fused cross-entropy still read."""
    got = _read(tmp_path, AXOLOTL + "adapter: qlora\nload_in_4bit: true\nlora_r: 16\nlora_target_linear: true\n"
                "liger_rope: true\nliger_rms_norm: true\nliger_fused_linear_cross_entropy: true\n")
    assert got.setup.liger == "none" and got.setup.fused_ce and got.setup.quant_base == "nf4"
    assert {i.key for i in got.record.ignored} >= {"liger_rope", "liger_rms_norm"}
