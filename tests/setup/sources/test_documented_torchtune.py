"""torchtune (0.6.1, recipes/configs): a config of each recipe family it ships (full_finetune single-device and
distributed, lora_finetune with the lora_* / qlora_* builders, DoRA and QDoRA (use_dora, quantize_base), lora_dpo,
full_dpo; knowledge_distillation, ppo and qat refused or approximate, eleuther_eval refused) read with the
`--from` reader and checked field by field against the file (tests/setup/sources/data/torchtune; most are torchtune's own config files).
torchtune builds and trains the model in `dtype` (bf16: pure bf16, the LoRA modules in the same dtype), maps
output_proj to o_proj and apply_lora_to_mlp to gate / up / down_proj, and its distributed recipes shard with
FSDP2 over the `tune run --nproc_per_node` GPUs of the file's launch comment. Most configs say max_seq_len null
(the data decides: listed as an approximation) and use the chunked output loss, CEWithChunkedOutputLoss with the model's
chunked_output (--output-chunks 8, its default num_output_chunks)."""

from __future__ import annotations

import pytest
from documented_configs import check_case, read

from llmem.errors import LlmemError

NO_CAP = "tokenizer.max_seq_len"       # max_seq_len null / absent: no cap in the file
CHUNKED = "loss._component_"           # LinearCrossEntropyLoss, or the DPO recipe's logits
ATTN_MLP = "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"   # ['q_proj', 'v_proj', 'output_proj'] + MLP
LLAMA32_1B = "meta-llama/Llama-3.2-1B"
PURE_BF16 = {"precision": "bf16"}
CHUNKED_OUT = {"output_chunks": 8}     # CEWithChunkedOutputLoss: the model's chunked_output, 8 chunks

CASES = {
    "full-single-device.yaml": ({**CHUNKED_OUT, "model": LLAMA32_1B, "method": "single", "gpus": 1, "objective": "sft",
                                 "batch_size": 4, "packing": False, "grad_ckpt": False,
                                 "optimizer": "paged-adamw-8bit", "optimizer_in_backward": True, "lora_rank": 0,
                                 **PURE_BF16}, None, {NO_CAP}),
    "full-distributed.yaml": ({**CHUNKED_OUT, "model": LLAMA32_1B, "method": "fsdp", "gpus": 4, "objective": "sft",
                               "batch_size": 4, "grad_ckpt": False, "optimizer": "adamw-fused",
                               "optimizer_in_backward": False, "lora_rank": 0, **PURE_BF16}, None, {NO_CAP}),
    "full-muon-single-device.yaml": ({"model": LLAMA32_1B, "method": "single", "gpus": 1, "batch_size": 2,
                                      "seq_len": 2048, "packing": True, "grad_ckpt": True, "optimizer": "muon",
                                      **PURE_BF16}, None, {CHUNKED}),
    "lora-single-device.yaml": ({**CHUNKED_OUT, "model": LLAMA32_1B, "method": "single", "gpus": 1, "batch_size": 4,
                                 "lora_rank": 64, "lora_alpha": 128, "lora_dropout": 0.0, "lora_targets": ATTN_MLP,
                                 "quant_base": "none", "adapter_dtype": "base", "optimizer": "adamw-fused",
                                 **PURE_BF16}, None, {NO_CAP}),
    "qlora-single-device.yaml": ({**CHUNKED_OUT, "model": LLAMA32_1B, "method": "single", "gpus": 1, "batch_size": 4,
                                  "lora_rank": 64, "lora_alpha": 128, "lora_targets": ATTN_MLP,
                                  "quant_base": "torchao-nf4", "adapter_dtype": "base", **PURE_BF16}, None,
                                 {NO_CAP}),
    "dora-single-device.yaml": ({**CHUNKED_OUT, "model": "meta-llama/Meta-Llama-3-8B", "method": "single", "gpus": 1,
                                 "batch_size": 2, "grad_ckpt": True, "quant_base": "none", "lora_rank": 0,
                                 "adapter_dtype": "base", **PURE_BF16},
                                {"peft_type": "LORA", "use_dora": True, "r": 8, "lora_alpha": 16.0,
                                 "lora_dropout": 0.0, "target_modules": ATTN_MLP.split(",")}, {NO_CAP}),
    "qdora-single-device.yaml": ({**CHUNKED_OUT, "model": "meta-llama/Meta-Llama-3-8B", "method": "single", "gpus": 1,
                                  "batch_size": 2, "grad_ckpt": True, "quant_base": "torchao-nf4", "lora_rank": 0,
                                  "adapter_dtype": "base", **PURE_BF16},
                                 {"peft_type": "LORA", "use_dora": True, "r": 8, "lora_alpha": 16.0,
                                  "lora_dropout": 0.0, "target_modules": ATTN_MLP.split(",")}, {NO_CAP}),
    "qdora-qlora-builder.yaml": ({"model": LLAMA32_1B, "method": "single", "gpus": 1, "batch_size": 2,
                                  "seq_len": 1024, "quant_base": "torchao-nf4", "lora_rank": 0,
                                  "optimizer": "adamw-fused", **PURE_BF16},
                                 {"peft_type": "LORA", "use_dora": True, "r": 16, "lora_alpha": 32.0,
                                  "lora_dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj"]}, set()),
    "lora-dpo-single-device.yaml": ({"model": "meta-llama/Llama-3.1-8B", "method": "single", "gpus": 1,
                                     "objective": "dpo", "loss_type": "sigmoid", "batch_size": 4, "seq_len": 1024,
                                     "max_length": 1024, "lora_rank": 8, "lora_alpha": 16, "lora_targets": ATTN_MLP,
                                     **PURE_BF16}, None, {CHUNKED}),
    "full-dpo-distributed.yaml": ({"model": "meta-llama/Llama-3.1-8B", "method": "fsdp", "gpus": 4,
                                   "objective": "dpo", "loss_type": "sigmoid", "batch_size": 4, "seq_len": 1024,
                                   "max_length": 1024, "grad_ckpt": True, "lora_rank": 0, **PURE_BF16}, None,
                                  {CHUNKED}),
    # quantization-aware training's fake quantisation is not modelled: the LoRA step stands in, said so
    "qat-lora-distributed.yaml": ({**CHUNKED_OUT, "model": LLAMA32_1B, "method": "fsdp", "gpus": 2, "batch_size": 4,
                                   "lora_rank": 64, "lora_alpha": 128, "lora_targets": ATTN_MLP, **PURE_BF16},
                                  None, {NO_CAP, "quantizer._component_"}),
}


@pytest.mark.parametrize("name", CASES)
def test_each_documented_recipe_reads_as_written(name):
    check_case(read("torchtune", name), *CASES[name])


@pytest.mark.parametrize("name, refusal", [
    ("kd-lora-single-device.yaml", "teacher_model = 'torchtune.models.llama3_1.llama3_1_8b' marks torchtune's "
                                   "knowledge_distillation"),
    ("ppo-full-single-device.yaml", "policy_model = 'torchtune.models.mistral.mistral_7b' marks torchtune's "
                                    "ppo_full_finetune"),
    ("evaluation.yaml", "# tune run = 'eleuther_eval' is a torchtune recipe that does not train"),
])
def test_recipes_llmem_does_not_model_are_refused_in_one_line(name, refusal):
    with pytest.raises(LlmemError, match=refusal) as exc:
        read("torchtune", name)
    assert "\n" not in str(exc.value)
