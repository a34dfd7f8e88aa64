"""axolotl (0.19): a config of each objective (no `rl:`: SFT; `rl:` dpo / ipo / kto / orpo / simpo / grpo,
`reward_model: true`; utils/schemas/enums.py RLType) and adapter family (full, lora, lora on an 8-bit base, qlora,
DoRA and QDoRA via peft_use_dora, llama-adapter) it documents, read with the `--from` reader and checked field by
field against the file (tests/setup/sources/data/axolotl). axolotl's defaults used where a file leaves a key out:
micro_batch_size 1, sequence_len 512, optimizer adamw_torch_fused, gradient_checkpointing off, lora_alpha = lora_r,
lora_dropout 0.0, bnb_4bit_use_double_quant true (loaders' BitsAndBytesConfig), sdpa attention."""

from __future__ import annotations

import pytest
from documented_configs import DATA, approximate, check_case, read

from llmem.errors import LlmemError
from llmem.setup.sources import setup_from_file

MODEL = "meta-llama/Llama-3.2-1B"
ONE_GPU = {"model": MODEL, "method": "single", "gpus": 1}

# file -> (the set-up's fields as the file says them, the peft config llmem writes (None: flags), approximate keys)
CASES = {
    "sft-full.yml": ({**ONE_GPU, "objective": "sft", "batch_size": 1, "seq_len": 4096, "packing": True,
                      "grad_ckpt": True, "optimizer": "paged-adamw-8bit", "attn": "flash", "lora_rank": 0,
                      "quant_base": "none", "precision": "bf16"},      # bf16 weights trained as loaded
                     None, set()),
    "sft-lora.yml": ({**ONE_GPU, "objective": "sft", "batch_size": 2, "seq_len": 2048, "packing": True,
                      "grad_ckpt": True, "optimizer": "adamw-fused", "attn": "sdpa", "lora_rank": 16,
                      "lora_alpha": 32, "lora_dropout": 0.05, "lora_targets": "q_proj,k_proj,v_proj,o_proj",
                      "quant_base": "none", "precision": "bf16-mixed", "adapter_dtype": "fp32"}, None, set()),
    "sft-lora-8bit.yml": ({**ONE_GPU, "batch_size": 2, "seq_len": 1024, "optimizer": "adamw-8bit",
                           "lora_rank": 32, "lora_alpha": 16, "lora_dropout": 0.05, "lora_targets": "all-linear",
                           "quant_base": "int8", "kbit_upcast": True, "grad_ckpt": True}, None, set()),
    "sft-qlora.yml": ({**ONE_GPU, "batch_size": 2, "seq_len": 4096, "packing": True, "optimizer": "adamw",
                       "attn": "flash", "lora_rank": 32, "lora_alpha": 16, "lora_dropout": 0.05,
                       "lora_targets": "all-linear", "quant_base": "nf4", "double_quant": True,
                       "kbit_upcast": True, "precision": "bf16-mixed"}, None, set()),
    "sft-dora.yml": ({**ONE_GPU, "batch_size": 4, "seq_len": 1024, "quant_base": "none", "lora_rank": 0},
                     {"peft_type": "LORA", "use_dora": True, "r": 8, "lora_alpha": 16.0, "lora_dropout": 0.0,
                      "target_modules": ["q_proj", "v_proj"]}, set()),
    "sft-qdora.yml": ({**ONE_GPU, "batch_size": 1, "seq_len": 2048, "quant_base": "nf4", "double_quant": False,
                       "kbit_upcast": True, "lora_rank": 0},
                      {"peft_type": "LORA", "use_dora": True, "r": 16, "lora_alpha": 32.0, "lora_dropout": 0.0,
                       "target_modules": "all-linear"}, set()),
    "sft-lora-layers.yml": ({**ONE_GPU, "seq_len": 1024, "lora_rank": 0},
                            {"peft_type": "LORA", "use_dora": False, "r": 8, "lora_alpha": 16.0,
                             "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
                             "layers_to_transform": [0, 1, 2, 3], "rank_pattern": {"v_proj": 4}}, set()),
    "sft-muon.yml": ({**ONE_GPU, "batch_size": 2, "seq_len": 2048, "optimizer": "muon", "precision": "bf16"},
                     None, set()),
    # llama-adapter (peft's adaption prompt) is not modelled: full fine-tuning stands in, said so
    "sft-llama-adapter.yml": ({**ONE_GPU, "lora_rank": 0, "seq_len": 1024}, None, {"adapter"}),
    "dpo-lora.yml": ({**ONE_GPU, "objective": "dpo", "batch_size": 2, "seq_len": 4096, "max_length": 4096,
                      "optimizer": "adamw-8bit", "lora_rank": 32, "lora_alpha": 16, "lora_dropout": 0.05,
                      "lora_targets": "all-linear", "loss_type": None}, None, set()),
    "ipo-full.yml": ({**ONE_GPU, "objective": "dpo", "loss_type": "ipo", "batch_size": 1, "seq_len": 1024,
                      "max_length": 1024, "lora_rank": 0}, None, set()),
    "kto-lora.yml": ({**ONE_GPU, "objective": "kto", "batch_size": 4, "seq_len": 2048, "max_length": 2048,
                      "lora_rank": 16, "lora_alpha": 32, "lora_targets": "all-linear"}, None, set()),
    "simpo-full.yml": ({**ONE_GPU, "objective": "simpo", "batch_size": 2, "seq_len": 1024, "max_length": 1024,
                        "lora_rank": 0}, None, set()),
    # GRPOStrategy drops max_length / max_prompt_length: TRL's untruncated prompt (512 tokens assumed) + 512
    "grpo-lora.yml": ({**ONE_GPU, "objective": "grpo", "batch_size": 8, "num_generations": 8,
                       "max_completion_length": 512, "beta": 0.04, "seq_len": 512 + 512, "lora_rank": 16,
                       "lora_alpha": 32, "lora_targets": "all-linear"}, None, set()),
    "reward-full.yml": ({**ONE_GPU, "objective": "reward", "batch_size": 1, "seq_len": 8192, "max_length": 8192,
                         "optimizer": "adamw-8bit", "lora_rank": 0}, None, set()),
    # QLoRA under FSDP2: axolotl skips prepare_model_for_kbit_training (no upcast); GPUs left to the launcher
    "qlora-fsdp2.yml": ({"model": MODEL, "method": "fsdp", "gpus": 8, "batch_size": 1, "seq_len": 2048,
                         "optimizer": "adamw-fused", "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.05,
                         "lora_targets": "all-linear", "quant_base": "nf4", "kbit_upcast": False,
                         "offload_param": False, "precision": "bf16-mixed"}, None, set()),
    # DeepSpeed ZeRO-2 with the optimizer on the CPU, GPUs left to the launcher (one node of 8 assumed)
    "sft-ds-zero2.yml": ({"model": MODEL, "method": "ds-zero2", "gpus": 8, "batch_size": 2, "seq_len": 2048,
                          "optimizer": "adamw", "offload_optimizer": True, "precision": "bf16-mixed"}, None,
                         {"gradient_clipping"}),     # contiguous_gradients true: DeepSpeed's default, modelled
}


@pytest.mark.parametrize("name", CASES)
def test_each_documented_pair_reads_as_written(name):
    check_case(read("axolotl", name), *CASES[name])


@pytest.mark.parametrize("name, refusal", [
    # GDPO is GRPO's trainer (rewards normalised apart): one sample per GPU cannot hold GRPOConfig's default 8
    # generations, which TRL refuses as well
    ("gdpo.yml", "--num-generations 8 must divide the generation batch"),
    ("prm.yml", "process_reward_model = True runs TRL's PRMTrainer"),
    # ORPO on a 4-bit base in bf16: ORPOTrainer casts its embeddings and lm_head back to bf16 (not modelled)
    ("orpo-qlora.yml", "--qlora with --objective orpo in bf16 is not modelled"),
])
def test_documented_pairs_llmem_does_not_model_are_refused_in_one_line(name, refusal):
    with pytest.raises(LlmemError, match=refusal) as exc:
        read("axolotl", name)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("key, value", [("lora_target_parameters", "[mlp.experts.gate_up_proj]"),
                                        ("peft_trainable_token_indices", "[0, 1, 2]"),
                                        ("peft_layer_replication", "[[0, 4], [2, 8]]")])
def test_peft_keys_llmem_does_not_model_make_the_answer_approximate(tmp_path, key, value):
    """loaders/adapter.py passes these to peft too; llmem does not model them, and says so."""
    path = tmp_path / "lora.yml"
    path.write_text((DATA / "axolotl" / "sft-lora.yml").read_text() + f"{key}: {value}\n")
    assert approximate(setup_from_file(path)) == {key}
