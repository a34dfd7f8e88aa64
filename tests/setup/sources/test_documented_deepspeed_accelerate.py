"""DeepSpeed JSON and accelerate config YAML: neither names an objective or an adapter (the training script does),
so a config of each layout and setting family they document is read with the `--from` reader and checked field by
field against the file (tests/setup/sources/data/deepspeed and accelerate; most are accelerate's and
LLaMA-Factory's own templates): DeepSpeed ZeRO stages 0-3 (0: data parallel, modelled by ddp), the optimizer and
parameter offloads, the buckets and their "auto" values (left "auto", filled from the model's hidden size as HF
fills them), fp16 / bf16, the optimizer block (torch_adam: torch's AdamW, else DeepSpeed's FusedAdam); accelerate's
NO / MULTI_GPU / FSDP (v1 and v2) / DEEPSPEED (its own keys or a JSON), num_processes and num_machines,
mixed_precision and parallelism_config's TP. The model comes from the command line (MODEL)."""

from __future__ import annotations

import pytest
from documented_configs import DATA, approximate, check, read

from llmem.errors import LlmemError
from llmem.setup.sources import setup_from_file

MODEL = "meta-llama/Llama-3.2-1B"
LAUNCHER = 8       # a DeepSpeed JSON leaves the GPU count to the launcher: one node of 8 assumed (no local GPUs)
AUTO_BUCKETS = {"reduce_bucket_size": "auto", "prefetch_bucket_size": "auto", "param_persistence_threshold": "auto"}

DEEPSPEED = {
    "zero0.json": ({"method": "ddp", "gpus": LAUNCHER, "precision": "bf16-mixed"}, {"gradient_clipping"}),
    # accelerate's templates: fp16 on, AdamW with torch_adam (torch.optim.AdamW) at stages 1-2
    "zero1.json": ({"method": "ds-zero1", "gpus": LAUNCHER, "precision": "fp16-mixed", "optimizer": "adamw",
                    "overlap_comm": True, "reduce_bucket_size": "auto", "offload_optimizer": False},
                   {"gradient_clipping"}),
    "zero2.json": ({"method": "ds-zero2", "precision": "fp16-mixed", "optimizer": "adamw", "overlap_comm": True,
                    "reduce_bucket_size": "auto", "offload_optimizer": False}, {"gradient_clipping"}),
    "zero2-offload.json": ({"method": "ds-zero2", "precision": "fp16-mixed", "optimizer": "adamw",
                            "offload_optimizer": True, "offload_param": False}, {"gradient_clipping"}),
    "zero3.json": ({"method": "ds-zero3", "precision": "fp16-mixed", "optimizer": "adamw-fused", "overlap_comm": True,
                    **AUTO_BUCKETS, "sub_group_size": 10**9, "max_live_parameters": 10**9,
                    "max_reuse_distance": 10**9, "offload_param": False}, {"gradient_clipping"}),
    # contiguous_gradients false departs from what llmem models (DeepSpeed's default true): approximate
    "zero3-buckets.json": ({"method": "ds-zero3", "batch_size": 2, "precision": "bf16-mixed", "overlap_comm": True,
                            "reduce_bucket_size": 50_000_000, "prefetch_bucket_size": 40_000_000,
                            "param_persistence_threshold": 100_000, "max_live_parameters": 500_000_000,
                            "max_reuse_distance": 500_000_000, "sub_group_size": 100_000_000,
                            "offload_param": True, "offload_optimizer": True},
                           {"zero_optimization.contiguous_gradients"}),
    # DeepSpeed's Muon is not in llmem's registry under DeepSpeed: the optimizer stands in, said so
    "zero2-muon.json": ({"method": "ds-zero2", "batch_size": 4, "precision": "bf16-mixed"}, {"optimizer.type"}),
}

ACCELERATE = {
    "single.yaml": ({"method": "single", "gpus": 1, "precision": "bf16-mixed"}, set()),
    "multi-gpu.yaml": ({"method": "ddp", "gpus": 2, "precision": "bf16-mixed"}, set()),
    "multi-node.yaml": ({"method": "ddp", "gpus": 8, "gpus_per_node": 4, "precision": "fp32"}, set()),
    "fp8.yaml": ({"method": "single", "gpus": 1, "precision": "bf16-mixed"}, {"mixed_precision"}),
    # FSDP1's keys (prefetch, orig params, loading, saving) leave the step as FSDP2 runs it: exact
    "fsdp1.yaml": ({"method": "fsdp", "gpus": 2, "precision": "bf16-mixed", "offload_param": False}, set()),
    "fsdp2.yaml": ({"method": "fsdp", "gpus": 8, "precision": "bf16-mixed", "offload_param": False}, set()),
    "fsdp2-tp.yaml": ({"method": "fsdp+tp", "gpus": 8, "tp": 2, "precision": "bf16-mixed"}, set()),
    "deepspeed-plugin.yaml": ({"method": "ds-zero2", "gpus": 8, "precision": "bf16-mixed", "offload_optimizer": True,
                               "offload_param": False}, set()),     # zero3_init_flag: load time only
    "deepspeed-file.yaml": ({"method": "ds-zero3", "gpus": 4, "precision": "fp16-mixed", "offload_param": True,
                             "offload_optimizer": True, "optimizer": "adamw-fused", **AUTO_BUCKETS,
                             "overlap_comm": True, "sub_group_size": 10**9}, {"gradient_clipping"}),
}


@pytest.mark.parametrize("name", DEEPSPEED)
def test_each_deepspeed_layout_reads_as_written(name):
    fields, approx = DEEPSPEED[name]
    fs = read("deepspeed", name, model=MODEL)
    check(fs, {"model": MODEL, "lora_rank": 0, **fields})
    assert approximate(fs) == approx


@pytest.mark.parametrize("name", ACCELERATE)
def test_each_accelerate_layout_reads_as_written(name):
    fields, approx = ACCELERATE[name]
    fs = read("accelerate", name, model=MODEL)
    check(fs, {"model": MODEL, **fields})
    assert approximate(fs) == approx


def test_deepspeed_refuses_bf16_with_fp16_in_one_line():
    with pytest.raises(LlmemError, match="fp16.enabled = True with bf16.enabled true") as exc:
        read("deepspeed", "bf16-and-fp16.json", model=MODEL)
    assert "\n" not in str(exc.value)


def test_an_accelerate_config_with_the_training_config_it_launches():
    """`--from fsdp2.yaml --from sft-lora.yaml`: the layout from accelerate's file, the rest from TRL's."""
    fs = setup_from_file([DATA / "accelerate" / "fsdp2.yaml", DATA / "trl" / "sft-lora.yaml"])
    check(fs, {"model": "Qwen/Qwen2.5-0.5B", "method": "fsdp", "gpus": 8, "batch_size": 2, "seq_len": 1024,
               "lora_rank": 32, "lora_alpha": 16, "optimizer": "adamw", "precision": "bf16-mixed"})
