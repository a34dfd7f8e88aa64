"""Liger-Kernel's kernels (liger_kernel 0.8, liger_kernel/transformers/monkey_patch.py): which llmem models, and the
model families whose patch Liger ships.

A kernel's row says what its autograd Function keeps and allocates, as Liger's code does:
- rms_norm: LigerRMSNormFunction (ops/rms_norm.py, casting_mode "llama") saves the input X itself and an fp32 RSTD
  [rows] (no fp32 copy, no normalised tensor); its output is in X's dtype; backward writes dX over dY (in_place)
  and sums an fp32 [sm_count, hidden] dW partial;
- swiglu: LigerSiLUMulFunction (ops/swiglu.py) saves gate_proj's and up_proj's outputs a and b (silu(a) and the
  product are not kept: recomputed), and backward writes da, db over a and b;
- rope: LigerRopeFunction (ops/rope.py) rotates q and k in place (q_proj's and k_proj's outputs, contiguous once
  transposed back) and saves cos and sin only; backward rotates dq, dk in place. HF's apply_rotary_pos_emb makes new
  q, k (and their temporaries) but keeps nothing either: attention keeps the rotated q, k in both, so the saved
  tensors are the same and only the rotation's transients go.
`use_liger_kernel=True` (transformers' Trainer) turns on rope, rms_norm, swiglu and fused_linear_cross_entropy: the
last is --fused-ce.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.errors import LlmemError


@dataclass(frozen=True)
class LigerKernel:
    name: str
    modelled: bool
    why_not: str = ""           # the refusal's fix, for a kernel not modelled


LIGER_KERNELS: dict[str, LigerKernel] = {k.name: k for k in (
    LigerKernel("rms_norm", True),
    LigerKernel("swiglu", True),
    LigerKernel("rope", True),
    LigerKernel("fused_linear_cross_entropy", False, "use --fused-ce (llmem's fused linear cross-entropy, Liger's "
                                                     "algorithm)"),
    LigerKernel("cross_entropy", False, "Liger's cross-entropy without the lm_head is not modelled: leave it out"),
)}


@dataclass(frozen=True)
class LigerFamily:
    """A model type whose apply_liger_kernel_to_<name> Liger ships, with the HF classes its rms_norm and swiglu
    patches replace (the SwiGLU MLP: gate_proj, up_proj, down_proj with SiLU)."""
    model_type: str
    patch: str                  # Liger's monkey_patch function
    norm_class: str
    mlp_class: str
    modeling: str               # the transformers module whose apply_rotary_pos_emb Liger's rope replaces


LIGER_FAMILIES: dict[str, LigerFamily] = {f.model_type: f for f in (
    LigerFamily("llama", "apply_liger_kernel_to_llama", "LlamaRMSNorm", "LlamaMLP",
                "transformers.models.llama.modeling_llama"),
    LigerFamily("mistral", "apply_liger_kernel_to_mistral", "MistralRMSNorm", "MistralMLP",
                "transformers.models.mistral.modeling_mistral"),
    LigerFamily("qwen2", "apply_liger_kernel_to_qwen2", "Qwen2RMSNorm", "Qwen2MLP",
                "transformers.models.qwen2.modeling_qwen2"),
)}


# --liger auto: what transformers' Trainer(use_liger_kernel=True) applies, apply_liger_kernel_to_<model>()'s
# defaults besides fused_linear_cross_entropy (--fused-ce); on a model type without a Liger patch the Trainer
# applies nothing (_apply_liger_kernel_to_instance logs and goes on)
AUTO = "auto"
LIGER_DEFAULTS = ("rms_norm", "swiglu", "rope")


def liger_kernels(text: str) -> tuple[str, ...]:
    """--liger's value as kernel names ("none": no kernel; "auto": LIGER_DEFAULTS, where the family is modelled:
    applied_kernels), each one Liger ships and llmem models."""
    if text.strip() == AUTO:
        return LIGER_DEFAULTS
    names = tuple(n.strip() for n in text.split(",") if n.strip() and n.strip() != "none")
    for n in names:
        if n not in LIGER_KERNELS:
            raise LlmemError(f"unknown Liger kernel {n!r} in --liger: choose from {', '.join(LIGER_KERNELS)}")
        if not LIGER_KERNELS[n].modelled:
            raise LlmemError(f"--liger {n} is not modelled: {LIGER_KERNELS[n].why_not}")
    return names


def applied_kernels(text: str, model_type: str) -> tuple[str, ...]:
    """The kernels --liger puts on a model of `model_type`: the named ones (refused on a family llmem does not
    model, llmem.setup.support), or under "auto" Liger's defaults where llmem models the family's patch, none
    elsewhere (HF's modules, a note says so)."""
    if text.strip() == AUTO and model_type not in LIGER_FAMILIES:
        return ()
    return liger_kernels(text)
