"""Attention kernels: one row per `--attn`, registered by name, as transformers runs them in a decoder layer.

- sdpa: transformers' "sdpa", F.scaled_dot_product_attention: a fused kernel (flash / memory-efficient / cuDNN)
  keeps q, k, v, the output and the logsumexp, never the [b, heads, s, s] scores; classes without an SDPA
  implementation fall back to eager (transformers' own fallback).
- eager: transformers' "eager": the scores, softmax and dropout as plain ops, the probabilities kept.
- flash: transformers' "flash_attention_2" (the flash-attn package; fp16 / bf16 only), modelled by PyTorch's flash
  SDPA kernel (the same saved tensors: q, k, v, out, logsumexp); packed rows run its varlen kernel (cu_seqlens,
  no mask).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionSpec:
    name: str                       # TrainingSetup.attn
    keeps_scores: bool              # the [b, heads, s, s] probabilities are materialised and kept (no fused kernel)
    recipe: str                     # the row whose saved tensors model it in the hand recipes (flash: sdpa's)
    without_sdpa: str               # what a class without an SDPA implementation runs instead (transformers' fallback)
    # F.scaled_dot_product_attention is what runs (torch's ring attention dispatches its kernels only)
    calls_torch_sdpa: bool = False
    flash_kernel: bool = False      # PyTorch's flash SDPA kernel only; the class needs _supports_flash_attn
    low_precision_only: bool = False   # no fp32 kernel
    varlen_packing: bool = False    # --packing runs a varlen kernel through cu_seqlens: no packed mask
    packing_note: str = ""          # what --packing does to it (the activation notes)


ATTENTIONS: dict[str, AttentionSpec] = {a.name: a for a in (
    AttentionSpec("sdpa", False, "sdpa", "eager", calls_torch_sdpa=True,
                  packing_note="SDPA gets transformers' block-diagonal causal mask and keeps it as a bias per layer "
                               "(no native GQA)"),
    AttentionSpec("eager", True, "eager", "eager",
                  packing_note="eager attention's mask is [b, 1, s, s] as without packing"),
    AttentionSpec("flash", False, "sdpa", "flash", flash_kernel=True, low_precision_only=True, varlen_packing=True,
                  packing_note="flash attention runs varlen (cu_seqlens, no mask)"),
)}
