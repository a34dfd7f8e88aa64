"""The matrices for a real GPU (llmem.validate.matrices names them): 125M to 8B under every method with ranks
emulated on one device, the activation options (benchmarks/gpu_validation.sh), and torchao's float8 training."""

from __future__ import annotations

from llmem.setup.training import TrainingSetup
from llmem.validate.rows import bundled_peft_config
from llmem.validate.rows import row as _s

# For a real GPU (benchmarks/gpu_validation.sh): 125M to 8B, every method with ranks emulated on one device.
GPU_MATRIX: list[TrainingSetup] = [
    TrainingSetup(model=m, method=method, gpus=g, tp=tp, precision=prec, batch_size=b, seq_len=s_, gpu="H200",
                  grad_ckpt=ckpt, optimizer=opt)
    for (m, method, g, tp, prec, b, s_, ckpt, opt) in [
        ("gpt2", "single", 1, None, "fp32", 4, 512, False, "adamw"),
        ("gpt2", "single", 1, None, "bf16-mixed", 8, 1024, False, "adamw"),
        ("gpt2", "ddp", 4, None, "bf16-mixed", 8, 1024, False, "adamw"),
        ("facebook/opt-125m", "single", 1, None, "bf16", 8, 1024, False, "sgd"),
        ("facebook/opt-350m", "single", 1, None, "bf16-mixed", 8, 1024, True, "adamw"),
        ("facebook/opt-1.3b", "single", 1, None, "bf16-mixed", 4, 1024, False, "adamw"),
        ("facebook/opt-1.3b", "fsdp", 4, None, "bf16-mixed", 4, 1024, False, "adamw"),
        ("bigscience/bloom-560m", "single", 1, None, "bf16-mixed", 4, 512, False, "adamw"),
        ("bigscience/bloom-1b1", "fsdp", 4, None, "bf16-mixed", 4, 512, True, "adamw"),
        ("Qwen/Qwen2.5-0.5B", "single", 1, None, "bf16-mixed", 4, 2048, False, "adamw"),
        ("Qwen/Qwen2.5-0.5B", "single", 1, None, "bf16", 8, 2048, True, "adamw"),
        ("Qwen/Qwen2.5-1.5B", "single", 1, None, "bf16-mixed", 2, 2048, True, "adamw"),
        ("Qwen/Qwen2.5-1.5B", "fsdp", 8, None, "bf16-mixed", 4, 2048, False, "adamw"),
        ("Qwen/Qwen2.5-1.5B", "tp", 2, 2, "bf16-mixed", 2, 2048, False, "adamw"),
        ("meta-llama/Llama-3.2-1B", "single", 1, None, "bf16-mixed", 4, 2048, False, "adamw"),
        ("meta-llama/Llama-3.2-1B", "single", 1, None, "bf16", 4, 2048, False, "sgd"),
        ("meta-llama/Llama-3.2-1B", "ddp", 8, None, "bf16-mixed", 4, 2048, True, "adamw"),
        ("meta-llama/Llama-3.2-1B", "fsdp", 8, None, "bf16-mixed", 4, 2048, False, "adamw"),
        ("meta-llama/Llama-3.2-1B", "zero2", 8, None, "bf16-mixed", 4, 2048, False, "adamw"),
        ("meta-llama/Llama-3.2-1B", "tp", 4, 4, "bf16-mixed", 4, 2048, False, "adamw"),
        ("meta-llama/Llama-3.2-1B", "fsdp+tp", 8, 2, "bf16-mixed", 4, 2048, False, "adamw"),
        ("meta-llama/Llama-3.2-3B", "single", 1, None, "bf16-mixed", 2, 2048, True, "adamw"),
        ("meta-llama/Llama-3.2-3B", "fsdp", 8, None, "bf16-mixed", 2, 4096, True, "adamw"),
        ("meta-llama/Llama-3.2-3B", "tp", 8, 8, "bf16", 2, 4096, False, "adamw"),
        ("meta-llama/Llama-3.1-8B", "single", 1, None, "bf16", 1, 2048, True, "sgd"),
        ("meta-llama/Llama-3.1-8B", "fsdp", 8, None, "bf16-mixed", 1, 4096, True, "adamw"),
        ("meta-llama/Llama-3.1-8B", "fsdp", 8, None, "bf16-mixed", 2, 2048, False, "adamw"),
        ("meta-llama/Llama-3.1-8B", "zero2", 8, None, "bf16-mixed", 1, 2048, True, "adamw"),
        ("meta-llama/Llama-3.1-8B", "tp", 8, 8, "bf16-mixed", 1, 4096, False, "adamw"),
        ("meta-llama/Llama-3.1-8B", "fsdp+tp", 8, 2, "bf16-mixed", 1, 4096, True, "adamw"),
        ("mistralai/Mistral-7B-v0.1", "fsdp", 8, None, "bf16-mixed", 1, 4096, True, "adamw-fused"),
        ("mistralai/Mistral-7B-v0.1", "fsdp+tp", 8, 4, "bf16-mixed", 1, 4096, False, "adamw"),
        ("Qwen/Qwen2.5-0.5B", "single", 1, None, "bf16-mixed", 4, 2048, False, "adafactor"),
        ("meta-llama/Llama-3.2-1B", "single", 1, None, "bf16", 4, 2048, False, "lion"),
        ("meta-llama/Llama-3.2-1B", "single", 1, None, "bf16-mixed", 4, 2048, False, "muon"),
        ("meta-llama/Llama-3.2-1B", "fsdp", 2, None, "bf16-mixed", 4, 2048, False, "muon"),
    ]
] + [TrainingSetup(model="Qwen/Qwen2.5-0.5B", precision="bf16-mixed", batch_size=4, seq_len=2048, gpu="H200",
                   optimizer_in_backward=True)]   # bitsandbytes' 8-bit states need bnb itself on a GPU: not here

# the activation options on a real GPU (flash runs PyTorch's flash SDPA kernel; offload uses pinned memory)
GPU_MATRIX += [
    TrainingSetup(model=m, gpu="H200", precision=prec, batch_size=b, seq_len=s_, optimizer="adamw", **kw)
    for (m, prec, b, s_, kw) in [
        ("meta-llama/Llama-3.2-1B", "bf16-mixed", 4, 2048, {"grad_ckpt": True, "ckpt_every": 2}),
        ("meta-llama/Llama-3.2-1B", "bf16-mixed", 4, 2048, {"fused_ce": True}),
        ("meta-llama/Llama-3.2-1B", "bf16-mixed", 4, 2048, {"fused_ce": True, "grad_ckpt": True}),
        ("meta-llama/Llama-3.2-1B", "bf16", 4, 2048, {"attn": "flash"}),
        ("meta-llama/Llama-3.2-1B", "bf16-mixed", 4, 2048, {"offload_activations": True}),
        ("Qwen/Qwen2.5-0.5B", "bf16-mixed", 4, 2048, {"packing": True}),
        # issue 10's options: offload under checkpointing, peft's fp32 adapters on a bf16 base (and torchtune's
        # bf16 ones), pure-bf16 bitsandbytes QLoRA, torchao NF4, a peft type through the learned path
        # torchtune's chunked output and loss (--output-chunks), with its optimizer-in-backward recipe; Unsloth's
        # offloaded checkpoint (--ckpt-offload unsloth) under LoRA
        ("meta-llama/Llama-3.2-1B", "bf16", 4, 2048, {"output_chunks": 8}),
        ("meta-llama/Llama-3.2-1B", "bf16", 4, 2048, {"output_chunks": 8, "grad_ckpt": True,
                                                       "optimizer_in_backward": True}),
        ("meta-llama/Llama-3.2-1B", "bf16", 4, 2048, {"ckpt_offload": "unsloth", "lora_rank": 8}),
        ("meta-llama/Llama-3.2-1B", "bf16-mixed", 4, 2048, {"offload_activations": True, "grad_ckpt": True}),
        ("meta-llama/Llama-3.2-1B", "bf16", 4, 2048, {"lora_rank": 16, "lora_targets": "all-linear"}),
        ("meta-llama/Llama-3.2-1B", "bf16", 4, 2048, {"lora_rank": 16, "lora_targets": "all-linear",
                                                      "adapter_dtype": "base"}),
        ("meta-llama/Llama-3.2-1B", "bf16", 4, 2048, {"lora_rank": 16, "lora_targets": "all-linear",
                                                      "quant_base": "nf4"}),
        ("meta-llama/Llama-3.2-1B", "bf16", 4, 2048, {"lora_rank": 16, "lora_targets": "all-linear",
                                                      "quant_base": "torchao-nf4", "adapter_dtype": "base"}),
        ("meta-llama/Llama-3.2-1B", "bf16-mixed", 4, 2048, {"peft_config": bundled_peft_config("oft-r32-q-v")}),
        # torchtitan's op-level selective checkpointing (--ac-policy op): Llama (every other mm) and Qwen2 (addmm)
        ("meta-llama/Llama-3.2-1B", "bf16-mixed", 4, 2048, {"ac_policy": "op"}),
        ("Qwen/Qwen2.5-0.5B", "bf16-mixed", 4, 2048, {"ac_policy": "op"}),
        # issue 11's pieces that measure runs (the ranks emulated on the one device; --pp, --cp and --offload-param
        # are traced only): torchtitan's TP with SequenceParallel + loss parallel, HSDP, reshard_after_forward=N
        ("meta-llama/Llama-3.2-1B", "bf16-mixed", 4, 2048, {"method": "fsdp+tp", "gpus": 4, "tp": 2,
                                                            "sequence_parallel": True, "loss_parallel": True}),
        ("meta-llama/Llama-3.2-1B", "bf16-mixed", 4, 2048, {"method": "fsdp", "gpus": 4, "dp_replicate": 2}),
        ("meta-llama/Llama-3.2-1B", "bf16-mixed", 4, 2048, {"method": "fsdp", "gpus": 4,
                                                            "reshard_after_forward": 2}),
        # issue 12's: TRL's DPO with its reference copy, KTO, GRPO with transformers' generate (beta 0 and 0.04)
        ("Qwen/Qwen2.5-0.5B", "bf16-mixed", 2, 1024, {"objective": "dpo"}),
        ("Qwen/Qwen2.5-0.5B", "bf16-mixed", 2, 1024, {"objective": "kto"}),
        ("Qwen/Qwen2.5-0.5B", "bf16-mixed", 4, 384, {"objective": "grpo", "num_generations": 4,
                                                     "max_completion_length": 128}),
        ("Qwen/Qwen2.5-0.5B", "bf16-mixed", 4, 384, {"objective": "grpo", "num_generations": 4,
                                                     "max_completion_length": 128, "beta": 0.04}),
    ]
]

# torchao's float8 training (--float8), traced with torchao's own Float8Linear (pip install 'llmem[float8]'): each
# recipe on one GPU (the MLP's casts above the loss: the fused CE), FSDP2 with and without the float8 all-gather
FLOAT8_MATRIX: list[TrainingSetup] = [
    _s("tiny-llama", precision="bf16", optimizer="sgd", batch_size=2, seq_len=256, float8="tensorwise"),
    *(_s("tiny-llama", precision="bf16", optimizer="sgd", batch_size=2, seq_len=512, fused_ce=True, float8=recipe)
      for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp")),
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=512, fused_ce=True,
       float8="tensorwise", float8_all_gather=True),
    _s("tiny-llama", "fsdp", 4, precision="bf16-mixed", batch_size=2, seq_len=512, float8="tensorwise",
       float8_all_gather=True),
    _s("tiny-llama", "fsdp", 4, precision="bf16-mixed", batch_size=2, seq_len=512, float8="rowwise"),
]
