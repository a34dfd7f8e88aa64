"""A bitsandbytes-quantised frozen base (QLoRA's 4-bit NF4, LLM.int8): its storage, its transients, its emulation.

bitsandbytes' CUDA kernels cannot run on fake tensors (or without a GPU), so llmem models them and, for the trace,
emulates them: every tensor bitsandbytes allocates is allocated with the same shape and dtype by plain torch ops.

Which modules are quantised (transformers' `replace_with_bnb_linear`): every `nn.Linear` (and GPT-2's Conv1D) except
the output embedding and tied weights (`get_keys_to_not_convert`). The rest (embeddings, norms, lm_head, biases) is
fp32: llmem follows the QLoRA recipe, whose peft `prepare_model_for_kbit_training` upcasts every fp16/bf16
parameter that is not quantised (TrainingSetup.stored_bytes); its other steps are the set-up's own (the base is
frozen anyway; gradient checkpointing is --grad-ckpt, non-reentrant as transformers' default, so no input-grad
hook). Under autocast the residual stream is then fp32, and bitsandbytes' linears, which return their input's
dtype, give fp32 MLP intermediates (activations.with_fp32_mlp).

Storage (bitsandbytes 0.4x-0.50, `quantize_4bit` / `Params4bit`, `Int8Params`), per quantised weight of n elements:
- nf4: the packed weight, uint8 [ceil(n/2), 1]; the NF4 code table, fp32 [16] (`get_4bit_type` makes one per
  weight); absmax per 64-element block: fp32 [ceil(n/64)], or with double quantisation (`compress_statistics`)
  uint8 [ceil(n/64)] + the nested state: fp32 absmax per 256 of those blocks, its own copy of the 8-bit dynamic
  code (fp32 [256], `quantize_blockwise` copies it per call) and the fp32 offset (a 0-d tensor).
- int8: the weight, int8 [out, in], and its row scales SCB, fp32 [out].
Nothing is shared between layers.

Transients (CUDA path):
- nf4 forward (`MatMul4Bit.forward` -> `gemm_4bit`): with more than 1536 rows (tokens of the micro-batch) CUDA
  takes `_dequant_linear_fallback`: with double quantisation the fp32 absmax [ceil(n/64)] and absmax + offset (both
  live), then the dequantised weight [out, in] in the compute dtype, then F.linear. Up to 1536 rows it may take a
  fused kernel with no transient (arch-dependent heuristics); llmem always models the fallback (an upper bound by
  one dequantised weight for short micro-batches). Nothing of the input is kept: the weight is frozen.
- nf4 backward (`F.dequantize_4bit`): the fp32 absmax (double quantisation), the dequantised weight [out, in] in the
  quantisation dtype, then grad_output @ W for the input gradient.
- int8 forward (`MatMul8bitLt.forward`): the input cast to fp16 (unless it is fp16), its int8 copy CA [t, in] and
  row scales SCA fp32 [t], the int32 product [t, out], then the output; the input itself stays referenced by the
  function (ctx.tensors) until backward. Outlier columns (threshold 6.0) depend on the data: none are modelled.
- int8 backward: the weight dequantised to the input dtype [out, in] (CB.to(dtype).mul_(SCB / 127)), then
  grad_output @ W.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.errors import LlmemError
from llmem.model.sharding import MATMUL_KINDS
from llmem.setup.precision import F32
from llmem.setup.training import QUANT_BASES
from llmem.units import ceil_div

NF4_BLOCK = 64                  # Params4bit blocksize (transformers' BitsAndBytesConfig default)
NESTED_BLOCK = 256              # quantize_blockwise(absmax, blocksize=256) for double quantisation
NF4_CODE_BYTES = 16 * 4         # get_4bit_type("nf4"): fp32 [16]
DYNAMIC_CODE_BYTES = 256 * 4    # create_dynamic_map(): fp32 [256], copied into each nested QuantState
GEMM_4BIT_CUSTOM_MAX_ROWS = 1536   # bitsandbytes/backends/cuda/ops.py: past this, dequantise + F.linear


def nf4_storage_tensors(numel: int, double_quant: bool) -> tuple[int, ...]:
    """Bytes of each tensor bitsandbytes keeps for one NF4 weight of `numel` elements (allocation order)."""
    blocks = ceil_div(numel, NF4_BLOCK)
    packed = ceil_div(numel, 2)
    if not double_quant:
        return (packed, blocks * F32, NF4_CODE_BYTES)
    return (packed, blocks, ceil_div(blocks, NESTED_BLOCK) * F32, DYNAMIC_CODE_BYTES, F32, NF4_CODE_BYTES)


def int8_storage_tensors(out_features: int, in_features: int) -> tuple[int, ...]:
    """Int8Params: the int8 weight [out, in] and SCB, fp32 [out]."""
    return (out_features * in_features, out_features * F32)


def storage_tensors(shape: tuple[int, ...], quant_base: str, double_quant: bool,
                    conv1d: bool = False) -> tuple[int, ...]:
    """Bytes of every tensor a quantised weight of this (module) shape is stored as."""
    out_f, in_f = (shape[1], shape[0]) if conv1d else (shape[0], shape[1])
    if quant_base == "nf4":
        return nf4_storage_tensors(out_f * in_f, double_quant)
    if quant_base == "int8":
        return int8_storage_tensors(out_f, in_f)
    raise LlmemError(f"unknown quantised base {quant_base!r}: choose one of {', '.join(QUANT_BASES)}")


def is_quantised(p, quant_base: str) -> bool:
    """Whether transformers' bitsandbytes integration replaces this parameter's module (a ParamInfo): the weight
    of an nn.Linear / Conv1D that is not the output embedding nor tied (LoRA adapters are never quantised)."""
    if quant_base == "none" or not p.name.endswith(".weight") or p.module_kind not in MATMUL_KINDS:
        return False
    module = p.name.rsplit(".", 1)[0]
    return ".lora_" not in p.name and p.tied_to is None and module.rsplit(".", 1)[-1] != "lm_head"


def storage_bytes(p, quant_base: str, double_quant: bool) -> int:
    return sum(storage_tensors(p.shape, quant_base, double_quant, p.module_kind == "Conv1D"))


@dataclass(frozen=True)
class Transients:
    """Bytes a quantised linear allocates around its matmuls, in allocation order (all freed at the op's end)."""
    forward: tuple[int, ...]
    backward: tuple[int, ...]


def transients(shape: tuple[int, ...], quant_base: str, double_quant: bool, tokens: int, compute_bytes: int,
               input_fp16: bool, conv1d: bool = False) -> Transients:
    """What bitsandbytes' matmul allocates besides its output (forward) and the input gradient (backward).

    compute_bytes: bytes per element of the activation entering the op (the compute dtype): nf4 dequantises to it,
    int8 dequantises its weight to the input's dtype in backward; input_fp16: int8 casts a non-fp16 input to fp16.
    """
    out_f, in_f = (shape[1], shape[0]) if conv1d else (shape[0], shape[1])
    n = out_f * in_f
    if quant_base == "nf4":
        blocks = ceil_div(n, NF4_BLOCK)
        absmax = (blocks * F32, blocks * F32) if double_quant else ()
        return Transients(absmax + (n * compute_bytes,), absmax[:1] + (n * compute_bytes,))
    if quant_base == "int8":
        fp16_copy = () if input_fp16 else (tokens * in_f * 2,)
        # int8_vectorwise_quant(A.to(fp16)): CA int8 [t, in], SCA fp32 [t]; int8_linear_matmul: int32 [t, out]
        fwd = fp16_copy + (tokens * in_f, tokens * F32, tokens * out_f * 4)
        return Transients(fwd, (n * compute_bytes, out_f * F32))
    raise LlmemError(f"unknown quantised base {quant_base!r}")
