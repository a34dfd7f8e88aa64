"""The validation matrices: named lists of set-ups the estimator is checked on.

- ci: small enough for 2 CPU cores, checked against the trace by `make test-slow` and `llmem validate --matrix ci`;
  ci-sample, its covering sample (llmem.validate.sample: every setting the matrix holds, shown once), on every CI
  run (tests/validate/test_validate.py).
- large: 7B-70B models under every method on 8 GPUs (benchmarks/accuracy_large.py, benchmarks/accuracy.md), and
  70B-405B scale-out rows (SCALEOUT_MATRIX: benchmarks/accuracy_scaleout.py, benchmarks/accuracy_scaleout.md); in
  llmem.validate.large_matrices.
- gpu, float8: for a real GPU (benchmarks/gpu_validation.sh): 125M to 8B, every method with ranks emulated on one
  device, and torchao's float8 training; in llmem.validate.gpu_matrices.
- vlm, vlm-gpu: vision-language steps at real sizes (benchmarks/vlm_estimate.md, the GPU script).
"""

from __future__ import annotations

from llmem.setup.methods import method_spec
from llmem.setup.training import TrainingSetup
from llmem.validate.gpu_matrices import FLOAT8_MATRIX, GPU_MATRIX  # noqa: F401 - re-exported
from llmem.validate.labels import label  # noqa: F401 - re-exported: the reports name rows by it
from llmem.validate.large_matrices import LARGE_MATRIX, SCALEOUT_MATRIX  # noqa: F401 - re-exported
from llmem.validate.rows import bundled_peft_config
from llmem.validate.rows import row as _s
from llmem.validate.sample import covering_sample
from llmem.validate.trl_qlora_rows import TRL_QLORA_ROWS
from llmem.validate.vlm_matrices import INTERNVL_CI_ROWS, LLAMA4_CI_ROWS, MLLAMA_CI_ROWS, VL_SHAPE, VLM_MATRIX

# peft types learned from the real code with a CI row each (llmem/model/catalog/peft/NAME)
PEFT_LEARNED_ROWS = ("vera-r256-q-v", "pvera-q-v", "randlora-q-v", "vblora-q-v", "lily-r140-mlp", "loha-r32-q-v",
                     "lokr-r32-q-v", "fourierft-q-v", "lora-mica-r32-q-v", "adaption-prompt-4", "tinylora-q-v",
                     "unilora-q-v", "lora-bd-r14-mlp", "waveft-q-v", "shira-r32-q-v", "frod-q-v")

# Small enough for 2 CPU cores: GPT-2, OPT-125m/350m, small Llama / Mistral / Qwen2 / BLOOM shapes, a ~1B model;
# all methods; fp32, bf16-mixed, bf16; checkpointing on and off; AdamW, SGD, Adafactor, Lion, Muon, bitsandbytes'
# 8-bit AdamW (paged and not) and paged 32-bit AdamW, torchao's 8-bit / 4-bit / fp8 AdamW, optimizer in backward;
# SDPA and eager.
_TINY_VL = dict(precision="bf16-mixed", batch_size=4, seq_len=64, images_per_sample=1, image_size="448x448")
CI_MATRIX: list[TrainingSetup] = [
    _s("gpt2", precision="fp32", batch_size=2, seq_len=128),
    _s("gpt2", precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=256),
    _s("gpt2", "ddp", 2, precision="fp32", optimizer="sgd", attn="eager", batch_size=1, seq_len=128),
    _s("gpt2", "fsdp", 2, precision="bf16", optimizer="sgd-momentum", batch_size=4, seq_len=256),
    _s("facebook/opt-125m", precision="bf16", batch_size=2, seq_len=256),
    _s("facebook/opt-125m", "fsdp", 4, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=256),
    _s("facebook/opt-125m", precision="fp32", optimizer="sgd", attn="eager", batch_size=1, seq_len=256),
    _s("facebook/opt-350m", precision="fp32", optimizer="sgd", grad_ckpt=True, batch_size=1, seq_len=256),
    _s("tiny-llama", precision="fp32", optimizer="sgd", batch_size=2, seq_len=256),
    _s("tiny-llama", precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=256),
    _s("tiny-llama", "fsdp", 4, precision="bf16-mixed", batch_size=2, seq_len=256),
    _s("tiny-llama", "tp", 2, precision="bf16", optimizer="sgd", batch_size=2, seq_len=256),
    _s("tiny-llama", "fsdp+tp", 4, tp=2, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=256),
    _s("tiny-mistral", precision="bf16-mixed", optimizer="sgd", grad_ckpt=True, batch_size=2, seq_len=256),
    _s("tiny-mistral", "zero2", 4, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=256),
    _s("tiny-mistral", "tp", 2, precision="fp32", optimizer="sgd", attn="eager", batch_size=1, seq_len=256),
    _s("tiny-qwen2", "ddp", 2, precision="bf16-mixed", batch_size=2, seq_len=128),
    _s("tiny-qwen2", "fsdp", 2, precision="bf16", optimizer="sgd", grad_ckpt=True, batch_size=2, seq_len=256),
    _s("tiny-bloom", precision="bf16", optimizer="sgd", batch_size=4, seq_len=256),
    _s("tiny-bloom", "fsdp", 2, precision="fp32", batch_size=1, seq_len=128),
    _s("Qwen/Qwen2.5-0.5B", precision="bf16", optimizer="sgd", batch_size=1, seq_len=256),
    _s("meta-llama/Llama-3.2-1B", "fsdp", 8, precision="bf16-mixed", grad_ckpt=True, batch_size=1, seq_len=256),
    # LoRA through peft (frozen base in the compute dtype)
    _s("tiny-mistral", precision="bf16", batch_size=2, seq_len=256, lora_rank=64, lora_targets="all-linear"),
    _s("facebook/opt-125m", precision="bf16", batch_size=2, seq_len=256, lora_rank=16, lora_targets="all-linear"),
    _s("gpt2", precision="fp32", optimizer="sgd", batch_size=2, seq_len=256, lora_rank=16, lora_targets="all-linear"),
    _s("tiny-llama", precision="bf16", grad_ckpt=True, batch_size=2, seq_len=256, lora_rank=8,
       lora_targets="all-linear"),
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", batch_size=2, seq_len=256, lora_rank=16,
       lora_targets="all-linear"),
    _s("tiny-llama", precision="fp32", batch_size=2, seq_len=256, lora_rank=8),
    # LoRA on the input embedding (peft's lora.Embedding): its kept matmul operands, the embedding output's graph,
    # AccumulateGrad's copies of the transposed gradients; autocast, pure bf16 checkpointed, FSDP2's root unit
    *(_s("tiny-llama", meth, g, precision=p, batch_size=2, seq_len=n, lora_rank=8, grad_ckpt=ckpt,
         lora_targets="embed_tokens,q_proj,v_proj")
      for meth, g, p, n, ckpt in (("single", 1, "bf16-mixed", 128, False), ("single", 1, "bf16", 256, True),
                                  ("fsdp", 2, "bf16-mixed", 256, False))),
    # optimizers: short sequences, so the optimizer step is the peak or close to it
    _s("tiny-llama", precision="bf16-mixed", optimizer="adafactor", batch_size=1, seq_len=64),
    _s("tiny-llama", "ddp", 2, precision="bf16-mixed", optimizer="adafactor", batch_size=1, seq_len=64),
    _s("tiny-llama", precision="bf16", optimizer="lion", batch_size=1, seq_len=64),
    _s("tiny-llama", "tp", 2, precision="bf16", optimizer="lion", batch_size=1, seq_len=64),
    _s("tiny-llama", precision="bf16-mixed", optimizer="adamw-8bit", batch_size=1, seq_len=64),
    _s("tiny-qwen2", "ddp", 2, precision="bf16-mixed", optimizer="adamw-8bit", batch_size=1, seq_len=64),
    _s("tiny-llama", precision="bf16-mixed", optimizer="paged-adamw-8bit", batch_size=1, seq_len=64),
    _s("tiny-llama", precision="bf16-mixed", optimizer="paged-adamw-32bit", batch_size=1, seq_len=64),
    # torchao's low-bit AdamW (emulated in the trace: torchao's state tensors, in-place update), one GPU and FSDP2
    _s("tiny-llama", precision="bf16-mixed", optimizer="torchao-adamw-8bit", batch_size=1, seq_len=64),
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", optimizer="torchao-adamw-8bit", batch_size=1, seq_len=64),
    _s("tiny-llama", precision="bf16", optimizer="torchao-adamw-4bit", batch_size=1, seq_len=64),
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", optimizer="torchao-adamw-4bit", batch_size=1, seq_len=64),
    _s("tiny-qwen2", precision="bf16-mixed", optimizer="torchao-adamw-4bit-b256", batch_size=1, seq_len=64),
    _s("tiny-llama", precision="bf16-mixed", optimizer="torchao-adamw-fp8", batch_size=1, seq_len=64),
    _s("tiny-qwen2", "fsdp", 2, precision="bf16-mixed", optimizer="torchao-adamw-fp8", batch_size=1, seq_len=64),
    _s("tiny-llama", precision="bf16-mixed", optimizer_in_backward=True, batch_size=1, seq_len=64),
    _s("gpt2", precision="fp32", optimizer="adafactor", optimizer_in_backward=True, batch_size=1, seq_len=64),
    # torch.optim.Muon over the decoder layers' matrices, AdamW over the rest (one registry row, one builder)
    _s("tiny-llama", precision="bf16-mixed", optimizer="muon", batch_size=1, seq_len=64),
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", optimizer="muon", batch_size=1, seq_len=64),
    # QLoRA / LLM.int8 base (bitsandbytes' storage and transients; its kernels emulated in the trace)
    _s("tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=256, lora_rank=16, lora_targets="all-linear",
       quant_base="nf4"),
    _s("tiny-llama", precision="bf16-mixed", grad_ckpt=True, batch_size=2, seq_len=256, lora_rank=16,
       lora_targets="all-linear", quant_base="nf4"),
    _s("tiny-llama", precision="fp32", batch_size=2, seq_len=256, lora_rank=8, quant_base="nf4", double_quant=False),
    _s("tiny-qwen2", "ddp", 2, precision="bf16-mixed", batch_size=2, seq_len=128, lora_rank=16,
       lora_targets="all-linear", quant_base="nf4"),
    _s("tiny-mistral", precision="bf16-mixed", batch_size=2, seq_len=256, lora_rank=8, lora_targets="all-linear",
       quant_base="int8"),
    _s("tiny-mistral", precision="bf16-mixed", grad_ckpt=True, batch_size=2, seq_len=256, lora_rank=8,
       quant_base="int8"),
    # torch's reentrant checkpoint (--ckpt-reentrant: axolotl's and LLaMA-Factory's default): LLM.int8 keeps no
    # layer inputs; QLoRA and full fine-tuning under DDP as under the non-reentrant one
    _s("tiny-llama", precision="bf16-mixed", ckpt_reentrant=True, batch_size=2, seq_len=256, lora_rank=8,
       quant_base="int8"),
    _s("tiny-llama", precision="bf16-mixed", ckpt_reentrant=True, batch_size=2, seq_len=256, lora_rank=16,
       lora_targets="all-linear", quant_base="nf4"),
    _s("tiny-llama", "ddp", 2, precision="bf16-mixed", ckpt_reentrant=True, batch_size=2, seq_len=256),
    # QLoRA as each framework runs it: pure bf16 (peft's fp32 adapters; with and without the kbit upcast),
    # torchao's NF4Tensor (torchtune: bf16 adapters), FSDP-QLoRA (bnb storage in the compute dtype; torchao's
    # sharded NF4Tensor), QLoRA under DDP
    _s("tiny-llama", precision="bf16", batch_size=2, seq_len=256, lora_rank=16, lora_targets="all-linear",
       quant_base="nf4"),
    _s("tiny-llama", precision="bf16", grad_ckpt=True, batch_size=2, seq_len=256, lora_rank=16,
       lora_targets="all-linear", quant_base="nf4", kbit_upcast=False),
    _s("tiny-llama", precision="bf16", batch_size=2, seq_len=256, lora_rank=16, lora_targets="all-linear",
       quant_base="torchao-nf4", adapter_dtype="base"),
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", batch_size=2, seq_len=256, lora_rank=16,
       lora_targets="all-linear", quant_base="nf4", kbit_upcast=False),
    _s("tiny-mistral", "fsdp", 2, precision="bf16", batch_size=2, seq_len=256, lora_rank=16,
       lora_targets="all-linear", quant_base="torchao-nf4", adapter_dtype="base"),
    _s("tiny-llama", "ddp", 2, precision="bf16-mixed", batch_size=2, seq_len=256, lora_rank=16,
       lora_targets="all-linear", quant_base="nf4"),
    # activations: every-2nd-layer checkpointing, fused cross-entropy, flash attention, offloading
    _s("tiny-llama", precision="bf16-mixed", optimizer="sgd", grad_ckpt=True, ckpt_every=2, batch_size=2,
       seq_len=256),
    _s("tiny-llama", "fsdp", 4, precision="bf16-mixed", grad_ckpt=True, ckpt_every=2, batch_size=2, seq_len=256),
    _s("tiny-llama", precision="bf16-mixed", optimizer="sgd", fused_ce=True, batch_size=2, seq_len=256),
    _s("tiny-llama", precision="bf16-mixed", optimizer="sgd", fused_ce=True, grad_ckpt=True, batch_size=2,
       seq_len=256),
    _s("tiny-mistral", "fsdp", 2, precision="bf16-mixed", optimizer="sgd", fused_ce=True, batch_size=2,
       seq_len=256),
    _s("facebook/opt-125m", precision="bf16", fused_ce=True, grad_ckpt=True, ckpt_every=2, batch_size=2,
       seq_len=256),
    # the loss on the lm_head's output as it is (--logits-dtype model): bf16, and bf16 under autocast
    _s("tiny-llama", precision="bf16", optimizer="sgd", logits_dtype="model", batch_size=2, seq_len=256),
    _s("tiny-llama", precision="bf16-mixed", optimizer="sgd", logits_dtype="model", batch_size=2, seq_len=256),
    # torchtune's chunked output and CEWithChunkedOutputLoss (--output-chunks): one GPU (chunks of a non-contiguous
    # batch copied by matmul; torch.chunk's short last chunk), DDP with checkpointing, FSDP2, LoRA (frozen lm_head),
    # offloaded checkpointing (torchtune's recipes: the lm_head's input stays on the device)
    _s("tiny-llama", precision="bf16", optimizer="sgd", output_chunks=8, batch_size=1, seq_len=256),
    _s("tiny-llama", precision="bf16", optimizer="adamw", output_chunks=3, batch_size=2, seq_len=200),
    _s("tiny-llama", "ddp", 2, precision="bf16", optimizer="sgd", output_chunks=4, grad_ckpt=True, batch_size=1,
       seq_len=256),
    _s("tiny-llama", "fsdp", 2, precision="bf16", optimizer="sgd", output_chunks=8, batch_size=2, seq_len=256),
    _s("tiny-llama", precision="bf16", optimizer="sgd", output_chunks=8, lora_rank=8, batch_size=1, seq_len=256),
    _s("tiny-llama", precision="bf16", optimizer="sgd", output_chunks=8, offload_activations=True, grad_ckpt=True,
       batch_size=2, seq_len=256),
    _s("tiny-llama", precision="bf16", optimizer="sgd", output_chunks=8, offload_activations=True, grad_ckpt=True,
       lora_rank=8, adapter_dtype="base", batch_size=1, seq_len=256),
    # ... with torchtune's compile flag: the layers and the loss's compute_cross_entropy compiled (compile_loss)
    _s("tiny-llama", precision="bf16", optimizer="sgd", output_chunks=8, compile=True, batch_size=1, seq_len=256),
    _s("tiny-llama", precision="bf16", optimizer="adamw", output_chunks=4, compile=True, grad_ckpt=True, batch_size=2,
       seq_len=256),
    # Liger-Kernel's RMSNorm, SwiGLU and RoPE Functions (--liger), one GPU and FSDP2, with and without checkpointing
    _s("tiny-llama", precision="bf16", optimizer="sgd", liger="rms_norm,swiglu,rope", batch_size=2, seq_len=256),
    _s("tiny-qwen2", precision="bf16-mixed", optimizer="sgd", liger="rms_norm,swiglu", batch_size=2, seq_len=256),
    _s("tiny-qwen2", "fsdp", 2, precision="bf16-mixed", liger="rms_norm,swiglu,rope", grad_ckpt=True, batch_size=2,
       seq_len=256),
    _s("tiny-llama", precision="bf16-mixed", liger="auto", batch_size=2, seq_len=256, lora_rank=16,
       lora_targets="all-linear"),
    _s("tiny-mistral", precision="bf16-mixed", optimizer="sgd", attn="flash", batch_size=2, seq_len=256),
    # torch.compile of each decoder layer (--compile: inductor's partitioner on fake tensors), one GPU and FSDP2,
    # with and without checkpointing, full fine-tuning and LoRA
    _s("tiny-llama", precision="bf16", optimizer="sgd", compile=True, batch_size=4, seq_len=512),
    _s("tiny-qwen3", precision="bf16-mixed", optimizer="sgd", compile=True, grad_ckpt=True, batch_size=2,
       seq_len=256),
    _s("tiny-qwen2", "fsdp", 2, precision="bf16-mixed", compile=True, grad_ckpt=True, batch_size=2, seq_len=256),
    _s("tiny-mistral", precision="bf16-mixed", compile=True, attn="flash", batch_size=2, seq_len=256, lora_rank=16,
       lora_targets="all-linear"),
    # ... over torchao's NF4 base (the dequantisation in each layer's graph); torchtune's QLoRA recipe (checkpointed
    # and offloaded, the chunked loss compiled)
    _s("tiny-llama", precision="bf16", optimizer="sgd", quant_base="torchao-nf4", lora_rank=8, adapter_dtype="base",
       compile=True, batch_size=2, seq_len=256),
    _s("tiny-llama", precision="bf16", quant_base="torchao-nf4", lora_rank=8, adapter_dtype="base", compile=True,
       grad_ckpt=True, offload_activations=True, output_chunks=8, batch_size=2, seq_len=256),
    _s("tiny-llama", precision="bf16-mixed", optimizer="sgd", offload_activations=True, batch_size=2, seq_len=256),
    _s("gpt2", precision="bf16", optimizer="sgd", offload_activations=True, batch_size=4, seq_len=512),
    # ... around compiled layers (torchtune's OffloadActivations packs what the compiled Function saves): the
    # layer's saved tensors on the host; torchtune's LoRA recipe (checkpointed input on the host, chunked loss)
    _s("tiny-llama", precision="bf16-mixed", optimizer="sgd", offload_activations=True, compile=True, batch_size=2,
       seq_len=256),
    _s("tiny-llama", precision="bf16", optimizer="sgd", output_chunks=8, offload_activations=True, grad_ckpt=True,
       compile=True, lora_rank=8, adapter_dtype="base", batch_size=1, seq_len=256),
    # offloading under checkpointing (torchtune's: the checkpointed layer inputs on the host until recompute)
    _s("tiny-llama", precision="bf16-mixed", optimizer="sgd", grad_ckpt=True, offload_activations=True, batch_size=2,
       seq_len=256),
    _s("meta-llama/Llama-3.2-1B", precision="bf16", grad_ckpt=True, lora_rank=8, offload_activations=True,
       batch_size=2, seq_len=512),
    _s("gpt2", precision="bf16", optimizer="sgd", grad_ckpt=True, ckpt_every=2, offload_activations=True,
       batch_size=4, seq_len=512),
    # Unsloth's offloaded checkpoints (--ckpt-offload): the smart one over 2 MiB layer inputs (4 MiB here; the last
    # layer's kept, two staging buffers), LoRA, QLoRA, one staging buffer, a full fine-tune with an fp32 stream
    # (stored as bf16); the classic one (LLaMA-Factory's use_unsloth_gc, axolotl's legacy offload)
    _s("meta-llama/Llama-3.2-1B", precision="bf16", ckpt_offload="unsloth", lora_rank=8, batch_size=2, seq_len=512),
    _s("meta-llama/Llama-3.2-1B", precision="bf16", ckpt_offload="unsloth", lora_rank=16, lora_targets="all-linear",
       quant_base="nf4", batch_size=2, seq_len=512),
    _s("meta-llama/Llama-3.2-1B", precision="bf16", ckpt_offload="unsloth-single", lora_rank=8, batch_size=2,
       seq_len=512),
    _s("meta-llama/Llama-3.2-1B", precision="bf16-mixed", optimizer="sgd", ckpt_offload="unsloth", batch_size=2,
       seq_len=512),
    _s("meta-llama/Llama-3.2-1B", precision="bf16", ckpt_offload="unsloth-classic", lora_rank=8, batch_size=2,
       seq_len=512),
    _s("tiny-llama", precision="bf16-mixed", ckpt_offload="unsloth-classic", batch_size=2, seq_len=256),
    # the optimizer offloaded (states and update on the host: ZeRO-Offload / FSDP's), one GPU and FSDP2
    _s("gpt2", precision="bf16-mixed", offload_optimizer=True, batch_size=2, seq_len=256),
    _s("gpt2", "fsdp", 2, precision="bf16-mixed", offload_optimizer=True, batch_size=2, seq_len=256),
    # sequence packing: SDPA with the packed block-diagonal mask (GQA model: repeated k/v), and GPT-2
    _s("tiny-mistral", precision="bf16-mixed", optimizer="sgd", packing=True, batch_size=2, seq_len=256),
    _s("gpt2", precision="bf16", optimizer="sgd", packing=True, batch_size=2, seq_len=512),
    # adapters as peft makes them on a pure bf16 base: fp32 (autocast_adapter_dtype, its default) or the base's
    # dtype (--adapter-dtype base: torchtune's, autocast_adapter_dtype=False)
    _s("tiny-llama", precision="bf16", batch_size=2, seq_len=384, peft_config=bundled_peft_config("dora-r8-all-linear")),
    _s("tiny-mistral", precision="bf16", batch_size=2, seq_len=256, lora_rank=64, lora_targets="all-linear",
       lora_dropout=0.1),
    # LoRA on the lm_head too, the adapters in the model's dtype (torchtune's apply_lora_to_output) or peft's fp32
    # ones: lora_B's [tokens, vocab] output, its scaled copy and their sum beside the logits, and their gradients
    _s("tiny-llama", precision="bf16", adapter_dtype="base", batch_size=2, seq_len=512, lora_rank=8,
       lora_targets="all-linear,lm_head"),
    _s("tiny-mistral", "fsdp", 2, precision="bf16", adapter_dtype="base", batch_size=2, seq_len=512, lora_rank=8,
       lora_targets="all-linear,lm_head"),
    _s("tiny-llama", precision="bf16", batch_size=2, seq_len=512, lora_rank=8, lora_targets="all-linear,lm_head"),
    _s("tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=512, lora_rank=8, lora_targets="all-linear,lm_head",
       lora_dropout=0.05),
    _s("tiny-mistral", "fsdp", 2, precision="bf16-mixed", batch_size=2, seq_len=512, lora_rank=8,
       lora_targets="all-linear,lm_head"),
    _s("tiny-llama", precision="bf16", batch_size=2, seq_len=256, lora_rank=16, lora_targets="all-linear",
       adapter_dtype="base"),
    _s("tiny-llama", precision="bf16", adapter_dtype="base", lora_rank=8, lora_alpha=16,
       lora_targets="q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", optimizer="adamw-fused", grad_ckpt=True,
       batch_size=2, seq_len=256),
    # activations learned from the real code (llmem.learn) where no hand recipe exists: peft types without
    # an exact model (OFT, DeLoRA, C3A, MiSS, HiRA, OSF and its buffers, RoAd) and families without a recipe (Qwen3, Phi,
    # GPT-NeoX / Pythia)
    *(_s("tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=384, peft_config=bundled_peft_config(name))
      for name in ("oft-r32-q-v", "delora-r32-q-v", "c3a-q-v", "miss-r64-q-v", "hira-r32-q-v", "osf-q-v")),
    _s("tiny-mistral", precision="bf16", batch_size=2, seq_len=384, peft_config=bundled_peft_config("road2-q-v")),
    # learned too: the cross-layer adapters (one module object shared by the layers, llmem.learn.unshare), LyCORIS'
    # module-dropout draw (llmem.runtime.host_reads), FourierFT's host indices, MiCA built data-free
    # (llmem.model.peft_data_free), adaption prompt's layer count cut for the copy, TinyLoRA / UniLoRA's shared vectors,
    # BD-LoRA (a LoRA variant the hand recipe does not model), WaveFT's and SHiRA's host indices
    # (llmem.runtime.adapter_host_tensors; SHiRA built data-free, its sparse delta: llmem.runtime.fake_sparse), FRoD
    # built data-free (its projections on meta), its sparse S's size read on the host and its coalesce
    *(_s("tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=384, peft_config=bundled_peft_config(name))
      for name in PEFT_LEARNED_ROWS),
    _s("tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=384, grad_ckpt=True,
       peft_config=bundled_peft_config("oft-r32-q-v")),
    _s("tiny-qwen3", precision="bf16", batch_size=2, seq_len=384),
    _s("tiny-qwen3", precision="bf16-mixed", batch_size=2, seq_len=384, lora_rank=8),
    _s("tiny-phi", precision="fp32", batch_size=2, seq_len=256),
    _s("tiny-phi", precision="bf16-mixed", batch_size=2, seq_len=256, lora_rank=8, grad_ckpt=True),
    _s("tiny-pythia", precision="bf16-mixed", batch_size=2, seq_len=384),
    # LoRA under autocast (peft's fp32 adapters cast their input), LoRA dropout, and --peft-config adapters
    _s("tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=384, lora_rank=8),
    _s("tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=384, lora_rank=64, lora_targets="all-linear"),
    _s("tiny-llama", precision="bf16", batch_size=2, seq_len=256, lora_rank=16, lora_targets="all-linear",
       lora_dropout=0.05),
    _s("tiny-mistral", precision="bf16-mixed", batch_size=2, seq_len=384, lora_rank=16, lora_dropout=0.1),
    _s("tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=256,
       peft_config=bundled_peft_config("dora-r8-all-linear")),
    _s("tiny-qwen2", precision="bf16-mixed", batch_size=2, seq_len=384, peft_config=bundled_peft_config("ia3-k-v-down")),
    _s("tiny-mistral", precision="bf16", batch_size=2, seq_len=384, peft_config=bundled_peft_config("ia3-k-v-down")),
    _s("gpt2", precision="fp32", batch_size=2, seq_len=256, peft_config=bundled_peft_config("prompt-tuning-20")),
    _s("tiny-llama", precision="bf16", batch_size=2, seq_len=384, peft_config=bundled_peft_config("prompt-tuning-20")),
    # DeepSpeed's engine (llmem.estimator.deepspeed) against DeepSpeed's own engine traced (llmem.runtime.deepspeed):
    # ZeRO-1 / 2 / 3, HF's auto buckets and DeepSpeed's defaults, overlap_comm, checkpointing, LoRA (frozen
    # parameters left whole), fp32 and fp16
    _s("tiny-llama", "ds-zero1", 2, precision="bf16-mixed", batch_size=1, seq_len=256, reduce_bucket_size="auto"),
    _s("tiny-llama", "ds-zero2", 4, precision="bf16-mixed", batch_size=2, seq_len=256, overlap_comm=True,
       grad_ckpt=True),
    _s("tiny-llama", "ds-zero2", 2, precision="fp16-mixed", batch_size=1, seq_len=256, reduce_bucket_size=5_000_000),
    _s("tiny-mistral", "ds-zero2", 2, precision="bf16-mixed", batch_size=2, seq_len=256, lora_rank=16,
       lora_targets="all-linear"),
    _s("tiny-llama", "ds-zero3", 2, precision="bf16-mixed", batch_size=1, seq_len=256),
    _s("gpt2", "ds-zero3", 2, precision="fp32", optimizer="sgd", batch_size=2, seq_len=128),
    _s("tiny-qwen2", "ds-zero3", 2, precision="bf16-mixed", batch_size=2, seq_len=256, grad_ckpt=True,
       reduce_bucket_size=2_000_000),
    # FSDP2's CPUOffloadPolicy (--offload-param): sharded parameters, gradients and the optimizer on the host; fp32
    # (each shard's host copy is the all-gather input) and bf16-mixed under zero2 (the copy cast to bf16)
    _s("tiny-llama", "fsdp", 4, precision="fp32", batch_size=2, seq_len=256, grad_ckpt=True, offload_param=True),
    _s("tiny-llama", "zero2", 2, precision="bf16-mixed", batch_size=1, seq_len=256, grad_ckpt=True,
       offload_param=True),
    # ... of FSDP-QLoRA: the packed NF4 shards to the host, the quantisation state kept on the GPU
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", batch_size=2, seq_len=256, lora_rank=8, quant_base="nf4",
       kbit_upcast=False, offload_param=True),
    # HSDP (--dp-replicate): FSDP2 on a (dp_replicate, dp_shard) mesh, sharded within each replica; with TP a 3-D mesh
    _s("tiny-llama", "fsdp", 4, precision="bf16-mixed", batch_size=2, seq_len=256, dp_replicate=2),
    _s("tiny-llama", "fsdp+tp", 8, tp=2, precision="bf16-mixed", batch_size=2, seq_len=256, dp_replicate=2),
    # FSDP2's reshard_after_forward=N (llmem.estimator.post_forward): each layer kept as 1/N of its bf16 all-gather
    # until backward gathers it over N; tiny-mistral over 6 ranks pads its rows (512 -> 516, 128 -> 132)
    _s("tiny-llama", "fsdp", 4, precision="bf16-mixed", batch_size=2, seq_len=256, reshard_after_forward=2),
    _s("tiny-mistral", "fsdp", 6, precision="bf16-mixed", batch_size=2, seq_len=256, reshard_after_forward=3),
    # --shard-embeddings (torchtune's custom_sharded_layers): the embedding and the lm_head FSDP2 units of their own,
    # gathered around their own forward and backward; with checkpointing, and under CPUOffloadPolicy
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", batch_size=2, seq_len=256, shard_embeddings=True),
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", batch_size=2, seq_len=256, grad_ckpt=True,
       shard_embeddings=True),
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", batch_size=2, seq_len=256, offload_param=True,
       shard_embeddings=True),
    # TRL's DPOTrainer (--objective dpo; llmem.estimator.objectives against TRL's own _compute_loss traced,
    # llmem.runtime.objectives): chosen + rejected in one forward, TRL's fused LM head; the reference as a frozen
    # copy, the policy with its adapters disabled (LoRA), precomputed log-probs; DDP; another loss type and a prompt
    _s("tiny-llama", precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=256, objective="dpo"),
    _s("tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=256, objective="dpo", lora_rank=16),
    _s("tiny-llama", precision="bf16", optimizer="sgd", grad_ckpt=True, batch_size=2, seq_len=256, objective="dpo",
       precompute_ref_log_probs=True),
    _s("tiny-llama", "ddp", 2, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=128, objective="dpo"),
    _s("tiny-qwen2", precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=256, objective="dpo",
       loss_type="ipo", prompt_len=64),
    # use_liger_kernel under TRL's fused-head trainers: Liger's layer kernels, its fused cross-entropy off
    # (dpo_trainer.py / kto_trainer.py / grpo_trainer.py __init__)
    *(_s("tiny-llama", precision="bf16-mixed", optimizer="sgd", objective=o, liger="auto", **kw)
      for o, kw in (("dpo", {"batch_size": 2, "seq_len": 256}), ("kto", {"batch_size": 2, "seq_len": 256}),
                    ("grpo", {"batch_size": 4, "seq_len": 16, "num_generations": 4, "max_completion_length": 4}))),
    # TRL's SFTTrainer (--objective trl-sft; llmem.estimator.fused_sft against its compute_loss traced): sft's step,
    # the loss from TRL's fused head; FSDP2, LoRA, Liger's kernels, ZeRO-3, Qwen2 with dft and a prompt's -100 labels
    *(_s(m, meth, g, precision="bf16-mixed", batch_size=b, seq_len=n, objective="trl-sft", **kw)
      for m, meth, g, b, n, kw in (("tiny-llama", "single", 1, 2, 512, {"optimizer": "sgd"}),
                                   ("tiny-llama", "fsdp", 2, 2, 256, {"optimizer": "sgd"}),
                                   ("tiny-llama", "single", 1, 2, 512, {"lora_rank": 16}),
                                   ("tiny-llama", "single", 1, 2, 512, {"optimizer": "sgd", "liger": "auto"}),
                                   ("tiny-llama", "ds-zero3", 2, 1, 64, {"optimizer": "sgd"}),
                                   ("tiny-qwen2", "single", 1, 2, 256, {"optimizer": "sgd", "loss_type": "dft",
                                                                         "prompt_len": 64}))),
    # TRL's KTOTrainer (--objective kto): unpaired completions and their KL sequences (no_grad forwards of the policy
    # and the reference); the reference as a copy, and as the policy with its adapters disabled
    _s("tiny-llama", precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=256, objective="kto"),
    _s("tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=256, objective="kto", lora_rank=16),
    # LoRA with checkpointing under TRL's trainers: the embedding's output a leaf (enable_input_require_grads) in the
    # no_grad reference / KL forwards, HF's RMSNorm backward op by op on small-pool blocks
    *(_s("tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=256, objective=o, lora_rank=8, grad_ckpt=True)
      for o in ("trl-sft", "dpo", "kto")),
    # trl.experimental's ORPOTrainer and CPOTrainer (simpo): no reference, the loss on full fp32 logits (the
    # chosen NLL and the log-prob kernel); TRL's RewardTrainer: the score head (llmem.estimator.pairwise)
    _s("tiny-llama", precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=256, objective="orpo"),
    _s("tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=256, objective="simpo", lora_rank=16),
    _s("tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=256, objective="reward"),
    # TRL's trainers under FSDP2 as accelerate's plugin runs them: the reference copy one fully_shard unit of its own
    # (trl's prepare_fsdp), gathered whole for its forward; LoRA's reference through the policy's own units; KTO's
    # no_grad KL forwards with checkpointing; ORPO's fp32 logits (convert_outputs_to_fp32) under zero2
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=128, objective="dpo"),
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", batch_size=2, seq_len=128, objective="dpo", lora_rank=16),
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=128, objective="kto",
       grad_ckpt=True),
    _s("tiny-llama", "zero2", 2, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=128,
       objective="orpo"),
    *TRL_QLORA_ROWS,      # QLoRA under TRL's trainers, their bf16 cast of the adapters (llmem.validate.trl_qlora_rows)
    # TP as torchtitan applies it: SequenceParallel norms and a sequence-sharded residual stream, the loss on the
    # vocab-sharded logits under loss_parallel(); pure bf16, autocast, FSDP2 over TP, and with checkpointing
    _s("tiny-llama", "tp", 2, precision="bf16", optimizer="sgd", batch_size=2, seq_len=256, sequence_parallel=True,
       loss_parallel=True),
    _s("tiny-llama", "tp", 2, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=256,
       sequence_parallel=True, loss_parallel=True),
    _s("tiny-llama", "fsdp+tp", 4, tp=2, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=256,
       sequence_parallel=True, loss_parallel=True),
    _s("tiny-llama", "fsdp+tp", 4, tp=2, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=256,
       grad_ckpt=True, sequence_parallel=True, loss_parallel=True),
    # torchtitan's op-level selective checkpointing (--ac-policy op, llmem.memory.activations.selective): every
    # other mm output and SDPA's kept per layer; Qwen2's biased q/k/v run addmm, so its saved mms are o and up
    _s("tiny-llama", precision="bf16-mixed", optimizer="sgd", ac_policy="op", batch_size=2, seq_len=256),
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", optimizer="sgd", ac_policy="op", batch_size=2, seq_len=256),
    _s("tiny-qwen2", precision="bf16-mixed", optimizer="sgd", ac_policy="op", batch_size=2, seq_len=256),
    # ... on learned layers (llmem.learn.selective_read: the op that made each tensor read with the layer): Qwen3
    # (q_proj's output normed on: stored beside the layer's tensors), Phi (biased linears run addmm: SDPA's outputs
    # only), a Qwen3-MoE layer (the router's mm; the experts' grouped_mm is not on the save list)
    _s("tiny-qwen3", precision="bf16-mixed", optimizer="sgd", ac_policy="op", batch_size=2, seq_len=256),
    _s("tiny-qwen3", "fsdp", 2, precision="bf16-mixed", optimizer="sgd", ac_policy="op", batch_size=2, seq_len=256),
    _s("tiny-phi", precision="bf16-mixed", optimizer="sgd", ac_policy="op", batch_size=2, seq_len=256),
    _s("tiny-qwen3-moe", precision="bf16-mixed", optimizer="sgd", ac_policy="op", batch_size=2, seq_len=256),
    # TRL's GRPOTrainer with transformers' generate (--objective grpo; llmem.estimator.generation against generate
    # and TRL's _compute_loss traced, llmem.runtime.generation): generation, scoring, training; beta 0 (no
    # reference), LoRA with beta 0.04 (the reference is the policy with its adapters off), DDP with beta 0.04 (a
    # reference copy; 2 GPUs x 2 completions hold one prompt's 4 generations). Completions of 4 tokens after a
    # 12-token prompt keep the trace's decode loop (one traced forward per token) short: each row traces in ~2-3 s
    _s("tiny-llama", precision="bf16-mixed", optimizer="sgd", batch_size=4, seq_len=16, objective="grpo",
       num_generations=4, max_completion_length=4),
    _s("tiny-llama", precision="bf16-mixed", batch_size=4, seq_len=16, objective="grpo", num_generations=4,
       max_completion_length=4, beta=0.04, lora_rank=16),
    _s("tiny-llama", "ddp", 2, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=16, objective="grpo",
       num_generations=4, max_completion_length=4, beta=0.04),
    # ... under FSDP2: every generate forward gathers each layer and reshards it (the root kept gathered), the
    # reference copy one unit (trl's prepare_fsdp); a prompt of 8 tokens
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=12, objective="grpo",
       num_generations=4, max_completion_length=4, beta=0.04),
    # TRL's RLOOTrainer (--objective rloo): RLOOConfig's 2 generations and beta 0.05 (a reference copy); its scoring
    # phase runs the policy under no_grad (old-policy log-probs) before the reference; ~2 s of trace
    _s("tiny-llama", precision="bf16-mixed", optimizer="sgd", batch_size=4, seq_len=16, objective="rloo",
       max_completion_length=4),
    # ... with flash attention (nearly every TRL recipe's attn_implementation): the prompts and completions full
    # length, so transformers passes the kernel no mask, in generate as in the training forward
    _s("tiny-llama", precision="bf16-mixed", optimizer="sgd", batch_size=4, seq_len=16, objective="grpo",
       num_generations=4, max_completion_length=4, attn="flash"),
    _s("tiny-qwen2", precision="bf16-mixed", optimizer="sgd", batch_size=4, seq_len=16, objective="rloo",
       max_completion_length=4, attn="flash"),
    # The generation batch (GRPOConfig's steps_per_generation, TRL's default gradient_accumulation_steps): each GPU
    # generates and scores --batch-size x steps_per_generation completions at once (the scoring in chunks of
    # --batch-size), the batch buffered through the steps it serves. LoRA over 4 steps (8 rows: generation the
    # peak); RLOO with gradient accumulation 2 (its default steps_per_generation); DDP with one completion per GPU
    # over 2 steps (a generation batch of 4 on 2 GPUs: one prompt's group; accumulation 1, so GRPO also scores the
    # old policy); FSDP2 with generation_batch_size 8 (2 steps); ~2-9 s of trace each
    _s("tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=16, objective="grpo", num_generations=4,
       max_completion_length=4, beta=0.04, lora_rank=16, steps_per_generation=4),
    _s("tiny-llama", precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=16, objective="rloo",
       max_completion_length=4, gradient_accumulation_steps=2),
    _s("tiny-llama", "ddp", 2, precision="bf16-mixed", optimizer="sgd", batch_size=1, seq_len=16, objective="grpo",
       num_generations=4, max_completion_length=4, beta=0.04, steps_per_generation=2),
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=12, objective="grpo",
       num_generations=4, max_completion_length=4, beta=0.04, generation_batch_size=8),
    # vLLM under FSDP2 (not run: the trace runs TRL's own weight sync, llmem.runtime.generation.sync_weights):
    # colocated with LoRA, peft's merge_adapter on the sharded DTensors, each full_tensor handed over one at a time,
    # the unmerge; server mode, vLLM's packed broadcast (one chunk of every full tensor + its torch.cat copy on a
    # side stream), under zero2 beside RLOO's reference kept gathered; ~5-25 s of trace each
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=16, objective="grpo",
       num_generations=2, max_completion_length=4, use_vllm=True, lora_rank=8),
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=16, objective="grpo",
       num_generations=2, max_completion_length=4, use_vllm=True, vllm_mode="server"),
    _s("tiny-llama", "zero2", 2, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=16, objective="rloo",
       num_generations=2, max_completion_length=4, use_vllm=True, vllm_mode="server"),
    # MoE as MoE (llmem.model.moe): transformers' grouped_mm experts, activations learned from the real code; one
    # GPU, FSDP2 sharding the 3-D expert weights on dim 0, DeepSeek-V3's MLA with a shared expert and a dense layer 0
    _s("tiny-qwen3-moe", precision="bf16-mixed", batch_size=2, seq_len=128),
    _s("tiny-qwen3-moe", "fsdp", 2, precision="bf16-mixed", batch_size=2, seq_len=256),
    _s("tiny-deepseek-v3", precision="bf16", batch_size=2, seq_len=256),
    # expert parallelism (llmem.setup.expert_parallel): torchtitan's dispatch / combine all-to-all on the fake
    # process group (balanced splits), 4 of the 8 experts per rank; the experts' FSDP2 mesh efsdp 1 (dp 2 = ep 2:
    # FSDP2's one-rank path) and efsdp 2 (dp 4), the dense parameters over dp
    _s("tiny-qwen3-moe", "fsdp", 2, precision="bf16-mixed", batch_size=2, seq_len=256, ep=2),
    _s("tiny-qwen3-moe", "fsdp", 4, precision="bf16-mixed", batch_size=2, seq_len=256, ep=2),
    # pipeline parallelism (llmem.estimator.pipeline / llmem.runtime.pipeline): pure PP on 2 stages, 4 micro-batches
    # of 1 (1F1B holds 2 on stage 0, GPipe all 4), every stage traced; fp32 AdamW for the optimizer's states
    _s("tiny-llama", "single", 2, precision="bf16", optimizer="sgd", batch_size=4, seq_len=128, pp=2),
    _s("tiny-llama", "single", 2, precision="bf16", optimizer="sgd", batch_size=4, seq_len=128, pp=2,
       pp_schedule="gpipe"),
    _s("tiny-llama", "single", 2, precision="fp32", batch_size=2, seq_len=128, pp=2),
    # Interleaved1F1B (torch's _PipelineScheduleRuntime): 2 ranks x 2 stages (rank 1's second only norm + lm_head),
    # and x 3 under checkpointing (rank 0's first the embedding alone); every rank's stages in one trace each
    _s("tiny-llama", "single", 2, precision="bf16", optimizer="sgd", batch_size=4, seq_len=128, pp=2,
       pp_schedule="interleaved-1f1b"),
    _s("tiny-llama", "single", 2, precision="bf16", optimizer="sgd", batch_size=2, seq_len=64, pp=2,
       pp_schedule="interleaved-1f1b", pp_virtual_stages=3, grad_ckpt=True),
    # FSDP2 x PP (dp 2 x pp 2): no reshard after forward, the unsharded gradients accumulated until the last backward
    _s("tiny-llama", "fsdp", 4, precision="bf16-mixed", optimizer="sgd", batch_size=4, seq_len=128, pp=2),
    # TP x PP, torchtitan's 3-D layout (mesh pp x dp x tp): each stage's layers under the TP plan (SequenceParallel:
    # [mb, seq / tp, hidden] sent between stages; the vocab-parallel embedding's Partial gradient accumulated full
    # size over the micro-batches), FSDP2 over dp; pure TP x PP under Interleaved1F1B; Megatron TP with AdamW
    _s("tiny-llama", "fsdp+tp", 8, tp=2, pp=2, precision="bf16-mixed", optimizer="sgd", batch_size=4, seq_len=128,
       sequence_parallel=True, loss_parallel=True),
    _s("tiny-llama", "tp", 4, pp=2, pp_schedule="interleaved-1f1b", precision="bf16", optimizer="sgd", batch_size=4,
       seq_len=128, sequence_parallel=True, loss_parallel=True),
    _s("tiny-llama", "fsdp+tp", 8, tp=2, pp=2, pp_schedule="gpipe", precision="bf16-mixed", batch_size=2,
       seq_len=128, grad_ckpt=True),
    # context parallelism (llmem.setup.context_parallel): torch's ring attention on 2 cp ranks (128 tokens each,
    # cuDNN SDPA on the H100 dispatched to the ring), FSDP2 over dp x cp; without and with checkpointing
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", batch_size=2, seq_len=256, cp=2),
    _s("tiny-llama", "fsdp", 2, precision="bf16-mixed", batch_size=2, seq_len=256, cp=2, grad_ckpt=True),
    # TRL's trainers under DeepSpeed's engine (the policy through deepspeed.initialize, the reference through TRL's
    # prepare_deepspeed: ZeRO off for it under stages 1-2, a bf16 copy on every rank): DPO's copy, LoRA's adapters-off
    # reference; under ZeRO-3 the reference partitioned by its own engine (gathered per module, then prefetched
    # whole), TRL's fused head gathering the lm_head itself, ORPO's full logits (the second step's coalesced prefetch)
    _s("tiny-llama", "ds-zero2", 2, precision="bf16-mixed", optimizer="sgd", batch_size=1, seq_len=64, objective="dpo"),
    _s("tiny-llama", "ds-zero2", 2, precision="bf16-mixed", batch_size=1, seq_len=64, objective="dpo", lora_rank=16),
    _s("tiny-llama", "ds-zero3", 2, precision="bf16-mixed", optimizer="sgd", batch_size=1, seq_len=64, objective="dpo"),
    _s("tiny-llama", "ds-zero3", 2, precision="bf16-mixed", optimizer="sgd", batch_size=1, seq_len=64,
       objective="orpo"),
    # GRPO under DeepSpeed (TRL's unwrap_model_for_generation on the engine): ZeRO-2's module as it is, the reference
    # copy at stage 0; ZeRO-3's GatheredParameters over the whole policy for generate, its hooks removed and re-added
    # (the coordinator's trace invalidated every step: no prefetch); ~15-25 s of trace each
    _s("tiny-llama", "ds-zero2", 2, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=16,
       objective="grpo", num_generations=2, max_completion_length=4, beta=0.04),
    _s("tiny-llama", "ds-zero3", 2, precision="bf16-mixed", optimizer="sgd", batch_size=2, seq_len=16,
       objective="grpo", num_generations=2, max_completion_length=4, beta=0.0),
    # a vision-language step (Qwen2.5-VL, tiny): each part trained or frozen, LoRA, checkpointing (which hooks the
    # frozen encoder's patch embedding: it keeps its blocks' inputs); its vision side learned (learned_vision)
    *(_s("tiny-qwen2_5_vl", precision="bf16-mixed", batch_size=4, seq_len=64, images_per_sample=1,
         image_size="448x448", **kw)
      for kw in ({}, {"freeze_vision_tower": True}, {"freeze_projector": True}, {"freeze_language_model": True},
                 {"lora_rank": 8}, {"freeze_vision_tower": True, "grad_ckpt": True})),
    # Gemma 3 (tiny): its projector beside the SigLIP tower, the image tokens' bidirectional mask (token_type_ids),
    # the tied embedding; every image one fixed-size crop (224x224 here: 256 patches pooled to 16 tokens)
    *(_s("tiny-gemma3", precision="bf16-mixed", batch_size=4, seq_len=64, images_per_sample=1, image_size="448x448",
         **kw)
      for kw in ({}, {"freeze_vision_tower": True}, {"freeze_projector": True}, {"freeze_language_model": True},
                 {"lora_rank": 8}, {"freeze_vision_tower": True, "grad_ckpt": True}, {"grad_ckpt": True},
                 {"attn": "eager"})),       # (transformers' advice for training Gemma 3: eager attention)
    *(_s("tiny-qwen3_vl", **_TINY_VL, **kw) for kw in (   # Qwen3-VL: deepstack features added in 3 of 4 layers
      {}, {"freeze_vision_tower": True}, {"freeze_projector": True}, {"freeze_language_model": True},
      {"lora_rank": 8}, {"freeze_vision_tower": True, "grad_ckpt": True}, {"grad_ckpt": True})),
    # LLaVA-OneVision (tiny, 384x384 crops of 64 patches): 448x448 takes 2x2 tiles and the base crop (336 tokens),
    # 768x1152 2x3; 1536x1536's 4x4 tiles pooled to 9 tiles' worth, 768x1024's unpadded, two images a sample one crop
    # each
    *(_s("tiny-llava_onevision", **{**_TINY_VL, **kw}) for kw in (
      {}, {"freeze_vision_tower": True}, {"freeze_projector": True},
      {"freeze_language_model": True, "image_size": "768x1152"},     # (at 448x448: -3.6 % reserved, the layers')
      {"lora_rank": 8}, {"freeze_vision_tower": True, "grad_ckpt": True}, {"grad_ckpt": True},
      {"image_size": "1536x1536", "lora_rank": 8}, {"image_size": "768x1024", "lora_rank": 8},
      {"image_size": "768x1152", "images_per_sample": 2})),
    # Idefics3 / SmolVLM (tiny, 128 px tiles of 64 patches, pixel-shuffled to 16 / 4 tokens a frame): 448x448 takes
    # 4 x 4 tiles and the global frame; LoRA at 256x384 (3 x 4 tiles; at 448x448 -4.5 % reserved), two 300x500
    # images a sample; SmolVLM's tower and language model frozen together or under bf16 (its forward casts the
    # features to the tower's dtype: one of them frozen under bf16-mixed is refused); DDP with a frozen tower
    *(_s(m, **{**_TINY_VL, **kw}) for m, kw in (
      ("tiny-idefics3", {}), ("tiny-idefics3", {"freeze_vision_tower": True}),
      ("tiny-idefics3", {"freeze_projector": True}), ("tiny-idefics3", {"freeze_language_model": True}),
      ("tiny-idefics3", {"lora_rank": 8, "image_size": "256x384"}),
      ("tiny-idefics3", {"freeze_vision_tower": True, "grad_ckpt": True}),
      ("tiny-idefics3", {"images_per_sample": 2, "image_size": "300x500"}),
      ("tiny-smolvlm", {}), ("tiny-smolvlm", {"lora_rank": 8}),
      ("tiny-smolvlm", {"precision": "bf16", "freeze_vision_tower": True}),
      ("tiny-smolvlm", {"grad_ckpt": True, "image_size": "1000x300"}))),
    _s("tiny-idefics3", "ddp", 2, **_TINY_VL, freeze_vision_tower=True, grad_ckpt=True),
    _s("tiny-smolvlm", "ddp", 2, **_TINY_VL),
    # ... under DDP: the one-GPU step on each rank, the reducer's bucket copy of every trained gradient, the tower's too
    _s("tiny-qwen2_5_vl", "ddp", 2, precision="bf16-mixed", batch_size=4, seq_len=64, images_per_sample=1,
       image_size="448x448"),
    _s("tiny-qwen2_5_vl", "ddp", 2, precision="bf16-mixed", batch_size=4, seq_len=64, images_per_sample=1,
       image_size="448x448", freeze_vision_tower=True, grad_ckpt=True),
    _s("tiny-gemma3", "ddp", 2, precision="bf16-mixed", batch_size=4, seq_len=64, images_per_sample=1,
       image_size="448x448", lora_rank=8),
    _s("tiny-qwen3_vl", "ddp", 2, **_TINY_VL),
    _s("tiny-llava_onevision", "ddp", 2, **_TINY_VL, lora_rank=8),
    _s("tiny-llava_onevision", "ddp", 2, **_TINY_VL, freeze_vision_tower=True, grad_ckpt=True),
    # ... under FSDP2: each vision block a unit of its own (accelerate's auto-wrap of _no_split_modules; Gemma 3's
    # SigLIP patch embedding too), gathered and reduced around the learned vision side (schedule/vision_units)
    *(_s(m, method, 2, **_TINY_VL, **kw) for m, method, kw in (
        ("tiny-qwen2_5_vl", "fsdp", {"freeze_vision_tower": True}), ("tiny-qwen2_5_vl", "fsdp", {"lora_rank": 8}),
        ("tiny-qwen2_5_vl", "zero2", {}),
        ("tiny-gemma3", "fsdp", {"freeze_vision_tower": True}), ("tiny-gemma3", "fsdp", {"lora_rank": 8}),
        ("tiny-gemma3", "zero2", {}),
        ("tiny-qwen3_vl", "fsdp", {"freeze_vision_tower": True}), ("tiny-qwen3_vl", "fsdp", {"lora_rank": 8}),
        ("tiny-llava_onevision", "fsdp", {"freeze_vision_tower": True}),
        ("tiny-llava_onevision", "fsdp", {"lora_rank": 8}),
        # (within 2 % once the vision side's temporaries outside its modules are held as the model holds them)
        ("tiny-gemma3", "zero2", {"lora_rank": 8}))),
    # ... under DeepSpeed's engine: the module cast to bf16, ZeRO's buffers sized from the trained parameters (a
    # frozen tower left whole under stages 1-2, partitioned under 3); HF's "auto" sizes (hidden 512: buckets of
    # 512^2 elements, persistence 5,120) so that ZeRO-3 fetches the tower's matrices piece by piece
    # (estimator/deepspeed_tower) and the buckets do not hide the step
    *(_s(m, method, 2, **_TINY_VL, reduce_bucket_size="auto",
         **({"prefetch_bucket_size": "auto", "param_persistence_threshold": "auto"} if method == "ds-zero3" else {}),
         **kw) for m, method, kw in (
        ("tiny-llava_onevision", "ds-zero1", {}),
        ("tiny-gemma3", "ds-zero2", {}), ("tiny-llava_onevision", "ds-zero2", {}),
        ("tiny-qwen2_5_vl", "ds-zero2", {"freeze_vision_tower": True}), ("tiny-qwen3_vl", "ds-zero2", {"lora_rank": 8}),
        ("tiny-qwen2_5_vl", "ds-zero3", {}), ("tiny-qwen2_5_vl", "ds-zero3", {"freeze_vision_tower": True}),
        ("tiny-qwen2_5_vl", "ds-zero3", {"grad_ckpt": True}), ("tiny-gemma3", "ds-zero3", {}),
        ("tiny-qwen3_vl", "ds-zero3", {"freeze_vision_tower": True}))),
    # Idefics3 / SmolVLM under FSDP2: each block's attention a unit (their _no_split_modules: Idefics3VisionAttention),
    # the rest of the tower in the root unit (tiny-smolvlm under zero2: -8.1 % reserved, not a row)
    *(_s(m, method, 2, **_TINY_VL, **kw) for m, method, kw in (
        ("tiny-idefics3", "fsdp", {"freeze_vision_tower": True}), ("tiny-idefics3", "fsdp", {"lora_rank": 8}),
        ("tiny-idefics3", "zero2", {}), ("tiny-smolvlm", "fsdp", {"lora_rank": 8}))),
    *INTERNVL_CI_ROWS, *MLLAMA_CI_ROWS, *LLAMA4_CI_ROWS]
OBJECTIVES_MATRIX = [s for s in CI_MATRIX if s.objective != "sft"]     # TRL's objectives alone


# Vision-language steps at real sizes: vlm (llmem.validate.vlm_matrices), vlm-gpu (benchmarks/gpu_validation.sh: the
# CI rows, then the 3B / 7B where they fit)
# (DeepSpeed's engine is measured inside the user's own launch, not by measure --device cuda: its rows left out)
VLM_GPU_MATRIX: list[TrainingSetup] = [s for s in CI_MATRIX if s.images_per_sample
                                       and method_spec(s.method).zero_stage is None] + [_s(
    f"Qwen/Qwen2.5-VL-{size}-Instruct", batch_size=1, grad_ckpt=True, **VL_SHAPE, **kw) for size, kw in (
        ("3B", {"lora_rank": 16}), ("3B", {"freeze_vision_tower": True}), ("7B", {"lora_rank": 16}))] + [
    _s("google/gemma-3-4b-it", batch_size=1, grad_ckpt=True, lora_rank=16, **VL_SHAPE)] + [
    _s(f"Qwen/Qwen3-VL-{size}-Instruct", batch_size=1, grad_ckpt=True, lora_rank=16, **VL_SHAPE) for size in ("2B", "8B")] + [
    _s(f"llava-hf/llava-onevision-qwen2-{size}-ov-hf", batch_size=1, grad_ckpt=True, lora_rank=16, **VL_SHAPE)
    for size in ("0.5b", "7b")] + [
    # (SmolVLM-256M alone: gpu_validation.sh gives the whole matrix 300 s; Idefics3-8B's rows are the vlm matrix's)
    _s("HuggingFaceTB/SmolVLM-256M-Instruct", batch_size=1, grad_ckpt=True, lora_rank=16, **VL_SHAPE)] + [
    # FSDP2 over 2 ranks (the tower's blocks units of their own): LoRA, and the tower trained under a frozen LM
    _s("Qwen/Qwen2.5-VL-3B-Instruct", "fsdp", 2, batch_size=1, grad_ckpt=True, **VL_SHAPE, **kw)
    for kw in ({"lora_rank": 16}, {"freeze_language_model": True})]

MATRICES = {"ci": CI_MATRIX, "ci-sample": covering_sample(CI_MATRIX), "objectives": OBJECTIVES_MATRIX,
            "large": LARGE_MATRIX, "gpu": GPU_MATRIX, "float8": FLOAT8_MATRIX, "vlm": VLM_MATRIX, "vlm-gpu": VLM_GPU_MATRIX}
