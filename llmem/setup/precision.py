"""Precisions: what `--precision` stores, computes and gathers in, and the dtype regime it gives a method.

Three regimes decide the dtypes of activations (llmem.memory.activations):
- fp32: everything in fp32.
- lowp: parameters in bf16/fp16 (pure low precision, or FSDP2's MixedPrecisionPolicy, which gathers bf16 weights).
- autocast: fp32 parameters with `torch.autocast` (methods without FSDP2 under *-mixed precision).
"""

from __future__ import annotations

from dataclasses import dataclass

F32 = 4   # bytes of an fp32 element


@dataclass(frozen=True, kw_only=True)
class Precision:
    name: str
    param_bytes: int      # stored trained parameters, their gradients and optimizer states
    compute_bytes: int    # matmul outputs (activations)
    compute_dtype: str    # the torch dtype of the compute (autocast's dtype under *-mixed)
    mixed: bool           # fp32 master weights with low-precision compute
    accelerate: str       # accelerate's `mixed_precision` value for it

    @property
    def low_precision(self) -> bool:
        return self.compute_dtype != "float32"


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision(name="fp32", param_bytes=4, compute_bytes=4, compute_dtype="float32", mixed=False,
              accelerate="no"),
    Precision(name="bf16-mixed", param_bytes=4, compute_bytes=2, compute_dtype="bfloat16", mixed=True,
              accelerate="bf16"),
    Precision(name="fp16-mixed", param_bytes=4, compute_bytes=2, compute_dtype="float16", mixed=True,
              accelerate="fp16"),
    Precision(name="bf16", param_bytes=2, compute_bytes=2, compute_dtype="bfloat16", mixed=False,
              accelerate="no"),
    Precision(name="fp16", param_bytes=2, compute_bytes=2, compute_dtype="float16", mixed=False,
              accelerate="no"),
)}


@dataclass(frozen=True)
class Regime:
    name: str        # fp32 / lowp / autocast
    res: int         # bytes per element of the residual stream (embedding output dtype)
    mm: int          # bytes per element of matmul outputs

    @property
    def autocast(self) -> bool:
        return self.name == "autocast"


def regime_for(setup, method) -> Regime:
    """The regime of `setup` (a TrainingSetup) under `method` (a MethodSpec)."""
    if not setup.precision_spec.low_precision or (setup.kbit_upcasts and not setup.mixed):
        # pure bf16/fp16 QLoRA with prepare_model_for_kbit_training: the fp32 embedding and norms make the residual
        # stream fp32, bitsandbytes' linears return their input's dtype and the fp32 lm_head fp32 logits, so every
        # activation is fp32 (only bitsandbytes' own matmuls run in the compute dtype)
        return Regime("fp32", F32, F32)
    if setup.mixed and method.autocast_under_mixed:
        # LoRA (or a frozen language model: --freeze-language-model) keeps the frozen embedding in the compute dtype,
        # so its output - the residual stream - is too
        return Regime("autocast", setup.stored_bytes(not setup.peft and not setup.freeze_language_model), 2)
    return Regime("lowp", 2, 2)
