"""TRL (1.16) / TrainingArguments: a config of each trainer TRL documents (trl sft / dpo / kto / reward / grpo /
rloo, trl.experimental's ORPO and CPO; the trainer told from the keys only its config has) and each adapter family
its ModelConfig builds (full, use_peft LoRA, load_in_4bit QLoRA, load_in_8bit, use_dora DoRA and QDoRA), read with
the `--from` reader and checked field by field against the file (tests/setup/sources/data/trl). TRL's defaults where
a file leaves a key out (trl/trainer/*_config.py, model_config.py): per_device_train_batch_size 8, max_length 1024,
gradient_checkpointing True, bf16 True unless fp16, dtype float32, lora_r 16, lora_alpha 32, lora_dropout 0.05,
lora_target_modules None (peft's q_proj / v_proj for the model type), use_bnb_nested_quant False; transformers'
optim adamw_torch_fused. A generation trainer's prompt is not truncated by TRL 1.16: 512 tokens assumed, plus
max_completion_length. `trl sft`'s SFTConfig reads as --objective trl-sft (SFTTrainer: the loss from TRL's fused
LM head)."""

from __future__ import annotations

import pytest
from documented_configs import DATA, approximate, check, check_case, read

from llmem.errors import LlmemError
from llmem.setup.sources import setup_from_file

MODEL = "Qwen/Qwen2.5-0.5B"
ONE_GPU = {"model": MODEL, "method": "single", "gpus": 1}
PROMPT = 512        # the untruncated prompt llmem assumes under GRPO / RLOO
# bf16 autocast over the fp32 weights TRL loads by default, LoRA's adapters in fp32 (peft's default)
DEFAULT_PRECISION = {"precision": "bf16-mixed", "adapter_dtype": "fp32"}

CASES = {
    "sft-full.yaml": ({**ONE_GPU, "objective": "trl-sft", "batch_size": 4, "seq_len": 2048, "packing": True,
                       "grad_ckpt": True, "optimizer": "adamw-fused", "attn": "flash", "lora_rank": 0,
                       "precision": "bf16"}, None),          # dtype bfloat16: the bf16 weights trained as loaded
    "sft-lora.yaml": ({**ONE_GPU, **DEFAULT_PRECISION, "objective": "trl-sft", "batch_size": 2, "seq_len": 1024,
                       "optimizer": "adamw", "lora_rank": 32, "lora_alpha": 16, "lora_dropout": 0.1,
                       "lora_targets": "q_proj,k_proj,v_proj,o_proj", "quant_base": "none"}, None),
    "sft-old-cap.yaml": ({**ONE_GPU, "objective": "trl-sft", "batch_size": 1, "seq_len": 8192, "grad_ckpt": False,
                          "precision": "fp16-mixed"}, None),
    # TRL never runs prepare_model_for_kbit_training, but the unquantised parameters load in fp32 (dtype's default)
    "sft-qlora.yaml": ({**ONE_GPU, **DEFAULT_PRECISION, "batch_size": 2, "seq_len": 1024, "lora_rank": 16,
                        "lora_alpha": 32, "lora_dropout": 0.05, "lora_targets": "all-linear", "quant_base": "nf4",
                        "double_quant": True, "kbit_upcast": True, "optimizer": "paged-adamw-8bit"}, None),
    "sft-lora-8bit.yaml": ({**ONE_GPU, "batch_size": 2, "seq_len": 512, "lora_rank": 16, "lora_alpha": 32,
                            "lora_dropout": 0.05, "lora_targets": "q_proj,v_proj", "quant_base": "int8"}, None),
    "sft-dora.yaml": ({**ONE_GPU, "batch_size": 2, "seq_len": 1024, "quant_base": "none", "lora_rank": 0},
                      {"peft_type": "LORA", "use_dora": True, "r": 8, "lora_alpha": 16.0, "lora_dropout": 0.0,
                       "target_modules": ["q_proj", "v_proj"]}),
    "sft-qdora.yaml": ({**ONE_GPU, "batch_size": 1, "seq_len": 2048, "quant_base": "nf4", "double_quant": False,
                        "lora_rank": 0},
                       {"peft_type": "LORA", "use_dora": True, "r": 16, "lora_alpha": 32.0, "lora_dropout": 0.0,
                        "target_modules": "all-linear"}),
    "dpo-lora.yaml": ({**ONE_GPU, "objective": "dpo", "loss_type": "ipo", "batch_size": 2, "seq_len": 1024,
                       "max_length": 1024, "lora_rank": 16, "lora_alpha": 32}, None),
    "kto-full.yaml": ({**ONE_GPU, "objective": "kto", "batch_size": 4, "seq_len": 1024, "max_length": 1024,
                       "lora_rank": 0}, None),
    "reward-full.yaml": ({**ONE_GPU, "objective": "reward", "batch_size": 2, "seq_len": 2048, "max_length": 2048,
                          "lora_rank": 0}, None),
    "grpo-lora.yaml": ({**ONE_GPU, "objective": "grpo", "batch_size": 8, "num_generations": 8,
                        "max_completion_length": 256, "beta": 0.04, "seq_len": PROMPT + 256, "use_vllm": True,
                        "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3, "lora_rank": 16,
                        "lora_alpha": 32}, None),
    "rloo-full.yaml": ({**ONE_GPU, "objective": "rloo", "batch_size": 4, "num_generations": 4,
                        "max_completion_length": 128, "seq_len": PROMPT + 128, "lora_rank": 0}, None),
    "orpo-full.yaml": ({**ONE_GPU, "objective": "orpo", "batch_size": 2, "seq_len": 1024, "max_length": 1024},
                       None),
    "cpo-simpo.yaml": ({**ONE_GPU, "objective": "simpo", "loss_type": "simpo", "batch_size": 2, "seq_len": 1024,
                        "max_length": 1024}, None),
}


@pytest.mark.parametrize("name", CASES)
def test_each_documented_pair_reads_as_written(name):
    check_case(read("trl", name), *CASES[name])


def test_training_arguments_alone():
    """A TrainingArguments JSON (no TRL key): its own defaults, the model and sequence given on the command line."""
    fs = read("trl", "training-args.json", model=MODEL, seq_len=1024)
    check(fs, {**ONE_GPU, "objective": "sft", "batch_size": 4, "seq_len": 1024, "grad_ckpt": True,
               "optimizer": "adamw-fused", "lora_rank": 0})
    assert approximate(fs) == set()


def test_distillation_is_refused_not_read_as_grpo():
    """trl distillation's teacher model is not modelled: refused in one line, never read as GRPOConfig's keys."""
    with pytest.raises(LlmemError, match="'DistillationConfig' is what the keys .* --objective distillation is not "
                                         "modelled") as exc:
        read("trl", "distillation.yaml")
    assert "\n" not in str(exc.value)


def test_lora_on_parameters_is_not_read_silently(tmp_path):
    """ModelConfig's lora_target_parameters (LoRA on MoE expert weights) is not modelled: the answer says so."""
    path = tmp_path / "sft.yaml"
    extra = "lora_target_parameters: [mlp.experts.gate_up_proj]\n"
    path.write_text((DATA / "trl" / "sft-lora.yaml").read_text() + extra)
    assert approximate(setup_from_file(path)) == {"lora_target_parameters"}


def test_keys_several_trainers_take_make_the_answer_approximate_until_objective_names_one():
    """An alignment-handbook ORPO recipe has only keys DPOConfig, KTOConfig, ORPOConfig and CPOConfig share: DPO (the
    first) is estimated and the answer says it may not be the file's run; --objective orpo settles it."""
    fs = read("trl", "orpo-handbook.yaml")
    check(fs, {"objective": "dpo", "batch_size": 1, "seq_len": 2048, "optimizer": "adamw-8bit"})
    assert approximate(fs) == {"(trainer)"}
    fs = read("trl", "orpo-handbook.yaml", objective="orpo")
    check(fs, {"objective": "orpo", "batch_size": 1, "seq_len": 2048, "max_length": 2048})
    assert approximate(fs) == set()
