"""CI rows of QLoRA under TRL's trainers (llmem.validate.matrices takes them into CI_MATRIX): a bitsandbytes base with
peft's LoRA as TRL 1.16's trainers prepare it, estimate against trace within 2 %.

SFTTrainer, DPOTrainer and KTOTrainer cast a bitsandbytes-quantised model's trained parameters to bf16 in their
__init__ (llmem.setup.objectives.casts_quantised_adapters; the trace applies the same cast): under autocast, under
pure bf16 (peft's bitsandbytes LoRA layer casting nothing) and under fp32 (the layer casting the fp32 input to the
bf16 adapters and their output back). DPO's and KTO's reference is the policy with its adapters disabled, its
forward through the same dequantising linears. ORPOTrainer keeps peft's fp32 adapters behind peft's
prepare_model_for_kbit_training (fp32 here: in bf16 it casts a 4-bit model's embeddings back, which is refused).
GRPOTrainer and RLOOTrainer cast alike and generate with the 4-bit model itself (transformers' generate: every
forward dequantises each linear's weight, the KV cache in the dtype bitsandbytes' linears return, fp32 behind the
kbit upcast); RLOO scores the base with its adapters disabled. Tiny shapes: each row traces in about 1-2 s, the
GRPO ones 5-10 s (one traced forward per generated token; 16 rows of a 62-token prompt make generation the peak)."""

from __future__ import annotations

from llmem.setup.training import TrainingSetup
from llmem.validate.rows import row as _s

_QLORA = dict(lora_rank=16, lora_targets="all-linear", quant_base="nf4")
TRL_QLORA_ROWS: list[TrainingSetup] = [
    _s("tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=256, objective="trl-sft", **_QLORA),
    _s("tiny-llama", precision="fp32", batch_size=2, seq_len=256, objective="trl-sft", **_QLORA),
    _s("tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=256, objective="dpo", **_QLORA),
    _s("tiny-llama", precision="bf16", batch_size=2, seq_len=256, objective="dpo", **_QLORA),
    _s("tiny-llama", precision="bf16-mixed", batch_size=2, seq_len=128, objective="kto", **_QLORA),
    _s("tiny-llama", precision="fp32", batch_size=2, seq_len=256, objective="orpo", lora_rank=8,
       lora_targets="all-linear", quant_base="nf4"),
    _s("tiny-llama", precision="bf16-mixed", optimizer="sgd", batch_size=1, seq_len=64, objective="grpo",
       num_generations=4, max_completion_length=2, steps_per_generation=16, lora_rank=8, lora_targets="all-linear",
       quant_base="nf4"),
    _s("tiny-llama", precision="bf16", batch_size=4, seq_len=16, objective="grpo", num_generations=4,
       max_completion_length=4, lora_rank=8, lora_targets="all-linear", quant_base="nf4"),
    _s("tiny-llama", precision="bf16-mixed", batch_size=4, seq_len=16, objective="rloo", max_completion_length=4,
       lora_rank=8, lora_targets="all-linear", quant_base="nf4"),
]
