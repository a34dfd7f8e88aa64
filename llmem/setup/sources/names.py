"""The frameworks' names for what llmem's registries hold: optimizers (transformers' `optim` names, torch / bitsandbytes
/ torchao classes, DeepSpeed's optimizer types) and attention kernels. One row per name: llmem's name, or None with
why it is not modelled (llmem's default optimizer then stands in, and the record says so)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NameRow:
    llmem: str | None          # the registry's name (None: not modelled)
    note: str = ""             # how it maps, or why it is not modelled


_NOT_MODELLED = "not in llmem's optimizer registry"

# transformers' OptimizerNames (training_args.py), as HF Trainer builds them (trainer.get_optimizer_cls_and_kwargs)
HF_OPTIMIZERS: dict[str, NameRow] = {
    "adamw_torch": NameRow("adamw", "torch.optim.AdamW, foreach on CUDA"),
    "adamw_hf": NameRow("adamw", "transformers' removed AdamW, now torch.optim.AdamW"),
    "adamw_torch_fused": NameRow("adamw-fused", "torch.optim.AdamW(fused=True)"),
    "adamw_bnb_8bit": NameRow("adamw-8bit", "bitsandbytes AdamW8bit"),
    "adamw_8bit": NameRow("adamw-8bit", "transformers' alias of adamw_bnb_8bit"),
    "paged_adamw_8bit": NameRow("paged-adamw-8bit", "bitsandbytes PagedAdamW8bit"),
    # transformers' _get_torchao_optimizer: AdamW8bit / AdamW4bit with block_size=256 (optim_args' default)
    "adamw_torch_8bit": NameRow("torchao-adamw-8bit", "torchao AdamW8bit(block_size=256)"),
    "adamw_torch_4bit": NameRow("torchao-adamw-4bit-b256", "torchao AdamW4bit(block_size=256), as transformers "
                                "builds it"),
    # axolotl's own names (utils/schemas/enums.py CustomSupportedOptimizers): torchao's classes, default block sizes
    "ao_adamw_8bit": NameRow("torchao-adamw-8bit", "axolotl's name for torchao AdamW8bit"),
    "ao_adamw_4bit": NameRow("torchao-adamw-4bit", "axolotl's name for torchao AdamW4bit (block 128)"),
    "ao_adamw_fp8": NameRow("torchao-adamw-fp8", "axolotl's name for torchao AdamWFp8"),
    "adafactor": NameRow("adafactor", "transformers' Adafactor, modelled by torch.optim.Adafactor (the same factored "
                         "second moments, no first moment)"),
    "sgd": NameRow("sgd", "torch.optim.SGD (momentum 0)"),
    "lion_32bit": NameRow("lion", "bitsandbytes Lion (one fp32 state), modelled by lion-pytorch's update"),
    "muon": NameRow("muon", "axolotl's Muon, modelled by torch.optim.Muon for the hidden matrices with AdamW"),
    "paged_adamw_32bit": NameRow("paged-adamw-32bit", "bitsandbytes PagedAdamW (fp32 states in CUDA managed "
                                 "memory)"),
    "paged_lion_32bit": NameRow(None, f"{_NOT_MODELLED}: bitsandbytes PagedLion (managed memory)"),
    "lion_8bit": NameRow(None, f"{_NOT_MODELLED}: bitsandbytes Lion8bit"),
    "paged_lion_8bit": NameRow(None, f"{_NOT_MODELLED}: bitsandbytes PagedLion8bit"),
    "adamw_anyprecision": NameRow(None, f"{_NOT_MODELLED}: torchdistx AnyPrecisionAdamW"),
    "ademamix": NameRow(None, f"{_NOT_MODELLED}: AdEMAMix keeps three states"),
    "ademamix_8bit": NameRow(None, f"{_NOT_MODELLED}: bitsandbytes AdEMAMix8bit"),
    "paged_ademamix_32bit": NameRow(None, f"{_NOT_MODELLED}: bitsandbytes PagedAdEMAMix"),
    "paged_ademamix_8bit": NameRow(None, f"{_NOT_MODELLED}: bitsandbytes PagedAdEMAMix8bit"),
    "adagrad": NameRow(None, f"{_NOT_MODELLED}: torch.optim.Adagrad"),
    "rmsprop": NameRow(None, f"{_NOT_MODELLED}: torch.optim.RMSprop"),
}

# a config's `_component_` / class path -> (name, the keyword that switches the fused kernel)
TORCH_CLASSES: dict[str, NameRow] = {
    "torch.optim.AdamW": NameRow("adamw"),
    "torch.optim.Adam": NameRow("adamw", "torch.optim.Adam keeps the same two states as AdamW"),
    "torch.optim.SGD": NameRow("sgd"),
    "torch.optim.Adafactor": NameRow("adafactor"),
    "torch.optim.Muon": NameRow("muon"),
    "bitsandbytes.optim.AdamW8bit": NameRow("adamw-8bit"),
    "bitsandbytes.optim.PagedAdamW8bit": NameRow("paged-adamw-8bit"),
    "bitsandbytes.optim.PagedAdamW": NameRow("paged-adamw-32bit", "bitsandbytes PagedAdamW (optim_bits=32)"),
    "bitsandbytes.optim.PagedAdamW32bit": NameRow("paged-adamw-32bit"),
    # torchtune's `_component_`: torchao's classes with their default block sizes (torchao 0.18 optim/adam.py)
    "torchao.optim.AdamW8bit": NameRow("torchao-adamw-8bit"),
    "torchao.optim.AdamW4bit": NameRow("torchao-adamw-4bit", "torchao AdamW4bit (block 128)"),
    "torchao.optim.AdamWFp8": NameRow("torchao-adamw-fp8"),
    "torchao.prototype.low_bit_optim.AdamW8bit": NameRow("torchao-adamw-8bit", "torchao's former path"),
    "torchao.prototype.low_bit_optim.AdamW4bit": NameRow("torchao-adamw-4bit", "torchao's former path (block 128)"),
    "torchao.prototype.low_bit_optim.AdamWFp8": NameRow("torchao-adamw-fp8", "torchao's former path"),
    "torchao.optim.CPUOffloadOptimizer": NameRow(None, f"{_NOT_MODELLED}: torchao CPUOffloadOptimizer (host states "
                                                 "and step for parameters of >= 4096 elements, gradients copied "
                                                 "to the host in their hooks)"),
}

# attn_implementation values -> llmem's --attn
HF_ATTENTIONS: dict[str, NameRow] = {
    "sdpa": NameRow("sdpa"),
    "eager": NameRow("eager"),
    "flash_attention_2": NameRow("flash"),
    "flash_attention_3": NameRow("flash", "flash attention 3, modelled by flash_attention_2 (same saved tensors)"),
    "kernels-community/vllm-flash-attn3": NameRow("flash", "a hub flash-attention 3 kernel, modelled by "
                                                  "flash_attention_2"),
    "kernels-community/flash-attn": NameRow("flash", "a hub flash-attention kernel"),
    "kernels-community/flash-attn3": NameRow("flash", "a hub flash-attention 3 kernel, modelled by "
                                             "flash_attention_2"),
    "flex_attention": NameRow(None, "flex attention is not modelled; sdpa stands in"),
}
