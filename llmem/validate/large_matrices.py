"""The large validation matrices (llmem.validate.matrices names them): 7B-70B models under every method on 8 GPUs
(benchmarks/accuracy_large.py, benchmarks/accuracy.md) and the 70B-405B scale-out rows
(benchmarks/accuracy_scaleout.py, benchmarks/accuracy_scaleout.md). Never in CI."""

from __future__ import annotations

from llmem.setup.training import TrainingSetup
from llmem.validate.rows import row as _s

# The committed accuracy report (benchmarks/accuracy.md): 7B-70B models, every method on 8 GPUs.
LARGE_MODELS = ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-3.1-8B", "mistralai/Mistral-7B-v0.1",
                "Qwen/Qwen2.5-7B", "meta-llama/Llama-2-70b-hf")
_LARGE_TP = {"Qwen/Qwen2.5-7B": 4}   # 28 query / 4 kv heads: pure 8-way TP is impossible, fsdp+tp uses tp 4
LARGE_MATRIX: list[TrainingSetup] = [
    _s(m, method, 8, tp=tp, precision="bf16-mixed", batch_size=1, seq_len=1024)
    for m in LARGE_MODELS
    for method, tp in (("ddp", None), ("fsdp", None), ("zero2", None), ("tp", 8), ("fsdp+tp", _LARGE_TP.get(m, 2)))
    if not (m.endswith("70b-hf") and method in ("ddp", "zero2"))   # 70B replicas: > 1 TB per GPU, nothing to learn
    and not (method == "tp" and m in _LARGE_TP)
] + [_s("meta-llama/Llama-2-7b-hf", "fsdp", 8, precision="bf16-mixed", batch_size=1, seq_len=1024, grad_ckpt=True)]
# Scale-out at 70B-405B (issue 11; benchmarks/accuracy_scaleout.py, benchmarks/accuracy_scaleout.md): one row per
# piece as torchtitan / torchtune run it. Never in CI (each traces in minutes on 2 cores).
SCALEOUT_MATRIX: list[TrainingSetup] = [
    # torchtitan's 70B: FSDP 32 x TP 8 with SequenceParallel and loss parallel, full AC (the example)
    _s("meta-llama/Llama-3.1-70B", "fsdp+tp", 256, tp=8, precision="bf16-mixed", batch_size=16, seq_len=8192,
       grad_ckpt=True, sequence_parallel=True, loss_parallel=True),
    # torchtune's 70B full fine-tune on 8 GPUs: FSDP2 CPUOffloadPolicy, bf16, fused AdamW, AC
    _s("meta-llama/Llama-3.1-70B", "fsdp", 8, precision="bf16", optimizer="adamw-fused", batch_size=2, seq_len=2048,
       grad_ckpt=True, offload_param=True),
    # 405B HSDP: 2 replicas x (FSDP 32 x TP 8), SP + loss parallel, full AC
    _s("meta-llama/Llama-3.1-405B", "fsdp+tp", 512, tp=8, dp_replicate=2, precision="bf16-mixed", batch_size=2,
       seq_len=8192, grad_ckpt=True, sequence_parallel=True, loss_parallel=True),
    # FSDP 8 x PP 8 (10 layers a stage), 8 micro-batches of 1 x 2048: 1F1B (stage 0 holds 8, the last 1) and GPipe
    # (every stage all 8); each traced stage costs a whole-model trace (layers / pp x micro-batches)
    _s("meta-llama/Llama-3.1-70B", "fsdp", 64, pp=8, precision="bf16-mixed", batch_size=8, seq_len=2048,
       grad_ckpt=True),
    _s("meta-llama/Llama-3.1-70B", "fsdp", 64, pp=8, pp_schedule="gpipe", precision="bf16-mixed", batch_size=8,
       seq_len=2048, grad_ckpt=True),
    # FSDP 8 x CP 4 at 64k tokens (16k a rank), full AC
    _s("meta-llama/Llama-3.1-70B", "fsdp", 32, cp=4, precision="bf16-mixed", batch_size=1, seq_len=65536,
       grad_ckpt=True),
    # torchtitan's op-level selective AC on FSDP 64
    _s("meta-llama/Llama-3.1-70B", "fsdp", 64, precision="bf16-mixed", batch_size=1, seq_len=4096, ac_policy="op"),
    # MoE under FSDP2 (experts sharded on dim 0, no EP): Qwen3-30B-A3B on one node, Qwen3-235B-A22B on 16 nodes
    _s("Qwen/Qwen3-30B-A3B", "fsdp", 8, precision="bf16-mixed", batch_size=2, seq_len=4096, grad_ckpt=True),
    _s("Qwen/Qwen3-235B-A22B", "fsdp", 128, precision="bf16-mixed", batch_size=1, seq_len=4096, grad_ckpt=True),
    # expert parallel: Qwen3-30B-A3B's 128 experts over the node's 8 ranks (16 whole experts a rank, the tokens
    # routed by all-to-all), FSDP2 over the rest, as row 7 otherwise
    _s("Qwen/Qwen3-30B-A3B", "fsdp", 8, ep=8, precision="bf16-mixed", batch_size=2, seq_len=4096, grad_ckpt=True),
    # a looped schedule: TP 8 (SequenceParallel) x PP 8 with interleaved 1F1B, 2 stages a rank (5 layers each),
    # 8 micro-batches of 1 x 2048, full AC; pure bf16 (autocast over a whole schedule step is not modelled)
    _s("meta-llama/Llama-3.1-70B", "tp", 64, tp=8, pp=8, pp_schedule="interleaved-1f1b", pp_virtual_stages=2,
       precision="bf16", batch_size=8, seq_len=2048, grad_ckpt=True, sequence_parallel=True),
]
LARGE_MATRIX += SCALEOUT_MATRIX
