"""torchtitan's train-config TOML (both schemas): torchtitan documents one objective (causal-LM pre-training, full
parameters; its LoRA converter came with the Python presets that replaced the TOMLs), so a config of each layout
and setting family it documents (FSDP2 over data_parallel_shard_degree, FSDP2 x TP, selective AC by block or op,
full AC, the optimizer's implementation, float8 converters (recipes, float8 all-gather) and compile, DistMuon) is read with the `--from` reader
and checked field by field against the file (tests/setup/sources/data/torchtitan). torchtitan's defaults: AdamW
implementation "fused", mixed_precision_param bfloat16 under FSDP2 (bf16-mixed), TP sequence-parallel with the loss
parallel unless disable_loss_parallel."""

from __future__ import annotations

import pytest
from documented_configs import approximate, check, read

LLAMA3_8B = "meta-llama/Llama-3.1-8B"       # torchtitan's llama3 8B flavor: Llama 3.1 8B's dimensions

CASES = {
    "fsdp-8b.toml": ({"model": LLAMA3_8B, "objective": "sft", "method": "fsdp", "gpus": 8, "batch_size": 1,
                      "seq_len": 8192, "grad_ckpt": True, "ac_policy": "op", "optimizer": "adamw-fused",
                      "precision": "bf16-mixed", "lora_rank": 0}, set()),
    # 8 x 8 GPUs; "foreach" is torch's foreach AdamW
    "fsdp-tp-full-ac.toml": ({"model": "meta-llama/Llama-3.1-70B", "method": "fsdp+tp", "gpus": 64, "tp": 8,
                              "sequence_parallel": True, "loss_parallel": True, "batch_size": 8, "seq_len": 8192,
                              "grad_ckpt": True, "ckpt_every": 1, "ac_policy": "full", "optimizer": "adamw",
                              "precision": "bf16-mixed"}, set()),
    "old-schema-selective.toml": ({"model": LLAMA3_8B, "method": "fsdp", "gpus": 4, "batch_size": 2,
                                   "seq_len": 4096, "grad_ckpt": True, "ckpt_every": 2,
                                   "optimizer": "adamw-fused"}, set()),
    # float8 linears without a [float8] section: torchao's tensorwise default, the output projection converted too
    # (no filter_fqns), which llmem does not express; [compile] with float8 is not modelled (the layers run
    # eagerly, said so), nor the loss's compile (torchtitan's default components ["model", "loss"])
    "float8-compile.toml": ({"model": LLAMA3_8B, "method": "fsdp", "gpus": 8, "batch_size": 1, "seq_len": 8192,
                             "grad_ckpt": False, "float8": "tensorwise", "float8_all_gather": False,
                             "compile": False}, {"float8.filter_fqns", "compile.enable", "compile.components"}),
    # torchtitan's llama3 TOMLs' float8 section: tensorwise with the float8 all-gather under FSDP2
    "float8-all-gather.toml": ({"model": LLAMA3_8B, "method": "fsdp", "gpus": 8, "precision": "bf16-mixed",
                                "float8": "tensorwise", "float8_all_gather": True}, set()),
    # a recipe by name (Float8LinearConfig.from_recipe_name), the 0.2 converter name and section
    "float8-rowwise.toml": ({"model": LLAMA3_8B, "method": "fsdp", "gpus": 4, "float8": "rowwise",
                             "float8_all_gather": False}, set()),
    # DistMuon (FlexShard's) is not in llmem's optimizer registry: AdamW stands in, said so
    "muon.toml": ({"model": LLAMA3_8B, "method": "fsdp", "gpus": 8, "batch_size": 1, "seq_len": 4096,
                   "grad_ckpt": True}, {"optimizer.name"}),
}


@pytest.mark.parametrize("name", CASES)
def test_each_documented_setting_reads_as_written(name):
    fields, approx = CASES[name]
    fs = read("torchtitan", name)
    check(fs, fields)
    assert fs.setup.peft_config is None
    assert approximate(fs) == approx
