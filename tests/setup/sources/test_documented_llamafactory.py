"""LLaMA-Factory (0.9.5, hparams/finetuning_args.py): a config of each stage (pt, sft, rm, ppo, dpo by pref_loss,
kto) and finetuning_type (full, freeze, lora, oft; LoRA on a 4- or 8-bit bitsandbytes base, use_dora with and
without quantization_bit 4, use_muon) it documents, read with the `--from` reader and checked field by field
against the file (tests/setup/sources/data/llamafactory). LLaMA-Factory's defaults where a file leaves a key out:
lora_alpha = 2 x lora_rank, lora_dropout 0.0, lora_target all, double_quantization true, cutoff_len 2048,
gradient checkpointing on, optim adamw_torch_fused (transformers'), oft_block_size 32 / oft_rank 0, module_dropout
0.0; it never runs prepare_model_for_kbit_training, and upcasts the trained parameters to fp32 (bf16-mixed)."""

from __future__ import annotations

import pytest
from documented_configs import check_case, read

from llmem.errors import LlmemError

MODEL = "meta-llama/Llama-3.2-1B"
ONE_GPU = {"model": MODEL, "method": "single", "gpus": 1}
OWN_FORWARD = {"stage"}     # the preference stages' own concatenated_forward keeps the fp32 logits: approximate

CASES = {
    "sft-lora.yaml": ({**ONE_GPU, "objective": "sft", "batch_size": 1, "seq_len": 2048, "packing": False,
                       "grad_ckpt": True, "optimizer": "adamw-fused", "lora_rank": 8, "lora_alpha": 16,
                       "lora_dropout": 0.0, "lora_targets": "all-linear", "quant_base": "none",
                       "precision": "bf16-mixed", "adapter_dtype": "fp32", "trust_remote_code": True}, None, set()),
    "sft-full-ds3.yaml": ({"model": MODEL, "method": "ds-zero3", "gpus": 8, "batch_size": 1, "seq_len": 2048,
                           "lora_rank": 0, "precision": "bf16-mixed", "prefetch_bucket_size": "auto",
                           "param_persistence_threshold": "auto", "reduce_bucket_size": "auto",
                           "overlap_comm": False, "sub_group_size": 10**9, "max_live_parameters": 10**9,
                           "max_reuse_distance": 10**9}, None,
                          {"gradient_clipping"}),    # contiguous_gradients true is modelled; the permission no effect
    "sft-qlora.yaml": ({**ONE_GPU, "batch_size": 2, "seq_len": 1024, "lora_rank": 16, "lora_alpha": 16,
                        "lora_dropout": 0.05, "lora_targets": "q_proj,v_proj", "quant_base": "nf4",
                        "double_quant": True, "kbit_upcast": False, "precision": "bf16-mixed"}, None, set()),
    "sft-lora-8bit.yaml": ({**ONE_GPU, "batch_size": 2, "seq_len": 1024, "lora_rank": 8, "lora_alpha": 16,
                            "lora_targets": "all-linear", "quant_base": "int8", "kbit_upcast": False}, None, set()),
    "sft-dora.yaml": ({**ONE_GPU, "batch_size": 1, "seq_len": 2048, "quant_base": "none", "lora_rank": 0},
                      {"peft_type": "LORA", "use_dora": True, "r": 16, "lora_alpha": 32.0, "lora_dropout": 0.0,
                       "target_modules": "all-linear"}, set()),
    "sft-qdora.yaml": ({**ONE_GPU, "batch_size": 2, "seq_len": 1024, "quant_base": "nf4", "double_quant": False,
                        "kbit_upcast": False, "lora_rank": 0},
                       {"peft_type": "LORA", "use_dora": True, "r": 8, "lora_alpha": 32.0, "lora_dropout": 0.0,
                        "target_modules": ["q_proj", "k_proj", "v_proj"]}, set()),
    "sft-oft.yaml": ({**ONE_GPU, "batch_size": 2, "seq_len": 1024, "quant_base": "none", "lora_rank": 0,
                      "precision": "bf16-mixed"},
                     {"peft_type": "OFT", "r": 0, "oft_block_size": 32, "module_dropout": 0.1,
                      "target_modules": ["q_proj", "v_proj"]}, set()),
    "sft-qoft.yaml": ({**ONE_GPU, "batch_size": 1, "seq_len": 1024, "quant_base": "nf4", "double_quant": True,
                       "kbit_upcast": False, "lora_rank": 0},
                      {"peft_type": "OFT", "r": 8, "oft_block_size": 0, "module_dropout": 0.0,
                       "target_modules": "all-linear"}, set()),
    "sft-muon.yaml": ({**ONE_GPU, "batch_size": 2, "seq_len": 1024, "optimizer": "muon", "lora_rank": 0,
                       "precision": "bf16-mixed"}, None, set()),
    # freeze tuning (the last layers only) is not expressible: full fine-tuning stands in, said so
    "sft-freeze.yaml": ({**ONE_GPU, "lora_rank": 0, "seq_len": 1024}, None, {"finetuning_type"}),
    "pt-full.yaml": ({**ONE_GPU, "objective": "sft", "batch_size": 1, "seq_len": 4096, "packing": True,
                      "grad_ckpt": False, "optimizer": "adamw", "attn": "flash", "lora_rank": 0}, None, set()),
    "dpo-lora.yaml": ({**ONE_GPU, "objective": "dpo", "loss_type": "sigmoid", "batch_size": 1, "seq_len": 2048,
                       "max_length": 2048, "lora_rank": 8, "lora_alpha": 16, "lora_targets": "all-linear"}, None,
                      OWN_FORWARD),
    "orpo-full.yaml": ({**ONE_GPU, "objective": "orpo", "batch_size": 2, "seq_len": 1024, "max_length": 1024,
                        "lora_rank": 0}, None, OWN_FORWARD),
    "simpo-lora.yaml": ({**ONE_GPU, "objective": "simpo", "batch_size": 2, "seq_len": 1024, "max_length": 1024,
                         "lora_rank": 16, "lora_alpha": 32}, None, OWN_FORWARD),
    "kto-lora.yaml": ({**ONE_GPU, "objective": "kto", "batch_size": 2, "seq_len": 2048, "max_length": 2048,
                       "lora_rank": 8, "lora_targets": "all-linear"}, None, OWN_FORWARD),
    # the reward model's value head and PPO's models are not modelled: the policy's step stands in, said so;
    # stage rm runs chosen and rejected as one batch of 2 x per_device_train_batch_size
    "rm-lora.yaml": ({**ONE_GPU, "objective": "sft", "batch_size": 2, "seq_len": 2048, "lora_rank": 8}, None,
                     {"stage"}),
    "ppo-lora.yaml": ({**ONE_GPU, "objective": "sft", "batch_size": 1, "seq_len": 2048, "lora_rank": 8}, None,
                      {"stage"}),
}


@pytest.mark.parametrize("name", CASES)
def test_each_documented_pair_reads_as_written(name):
    check_case(read("llamafactory", name), *CASES[name])


def test_a_pref_loss_llmem_does_not_model_is_refused_in_one_line():
    with pytest.raises(LlmemError, match="pref_loss = 'kto_pair' is not a loss llmem models") as exc:
        read("llamafactory", "kto-pair.yaml")
    assert "\n" not in str(exc.value)


@pytest.mark.slow       # the estimate learns OFT's activations from a 2-layer trace (~8 s on a shared CPU)
def test_oft_reaches_the_estimate_as_oft():
    """The OFT adapters are estimated as peft builds OFT (not replaced by LoRA or full fine-tuning), on a tiny
    model."""
    import llmem

    fs = read("llamafactory", "sft-oft.yaml", model="tiny-llama", seq_len=64)
    result = llmem.estimate(fs.setup)
    assert any(n.startswith("peft type OFT") for n in result.notes), result.notes
