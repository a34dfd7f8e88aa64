"""Liger-Kernel's RMSNorm and SwiGLU in an activation recipe (llmem.setup.liger says what their Functions keep): the
Llama-like recipe's norms and MLP activation rewritten as Liger's autograd Functions save and allocate."""

from __future__ import annotations

from dataclasses import replace

from llmem.memory.activations.blocks import Block, Dims, LayerRecipe, norm_saved
from llmem.setup.precision import F32, Regime

# rms_norm_backward's fp32 dW partial is [sm_count, hidden]: an H100's multi_processor_count
DW_PARTIAL_ROWS = 132
NORM_BLOCKS = ("input_norm", "mlp_norm")


def liger_norm_saved(r: Regime, t: int, h: int) -> tuple[int, ...]:
    """LigerRMSNormFunction's saved tensors: the input X as it is (the residual stream's dtype) and the fp32 RSTD."""
    return (t * h * r.res, F32 * t)


def _norm(b: Block, r: Regime, d: Dims) -> Block:
    """Its backward writes dX over dY and sums the fp32 [sm_count, hidden] dW partial: the partial is the transient.
    Both tensors are kept whether the weight trains or not (save_for_backward(X, W, RSTD))."""
    return replace(b, tensors=liger_norm_saved(r, d.ts, d.h), transient=DW_PARTIAL_ROWS * d.h * F32, for_weights=())


def _swiglu(b: Block, r: Regime, d: Dims) -> Block:
    """LigerSiLUMulFunction keeps a (gate_proj's output) and b (up_proj's); down_proj keeps the product. Its backward
    writes da, db over a and b, which live on as gate_proj's and up_proj's output gradients."""
    n = d.t * d.i * r.mm
    return replace(b, tensors=(n, n, n), transient=2 * n, for_weights=((2, ("down_proj",), False),),
                   outputs=(("gate_proj", 0), ("up_proj", 1)))


def with_liger(recipe: LayerRecipe, kernels: tuple[str, ...], d: Dims, r: Regime) -> LayerRecipe:
    """The recipe with Liger's rms_norm (the layers' norms and the final norm) and swiglu (the MLP activation)."""
    blocks = list(recipe.blocks)
    head, head_tags = recipe.head, recipe.head_for_weights
    if "rms_norm" in kernels:
        blocks = [_norm(b, r, d) if b.name in NORM_BLOCKS else b for b in blocks]
        hf_kept = len(norm_saved("rmsnorm", r, d.ts, d.h)[0])
        head = liger_norm_saved(r, d.ts, d.h) + head[hf_kept:]
        shift = hf_kept - 2
        # the final norm's weight tag goes (Liger keeps X and RSTD for any weight); the lm_head's input moves up
        head_tags = tuple((i - shift, names, cast) for i, names, cast in head_tags if "norm" not in names)
    if "swiglu" in kernels:
        blocks = [_swiglu(b, r, d) if b.name == "mlp_act" else b for b in blocks]
    return replace(recipe, blocks=tuple(blocks), head=head, head_for_weights=head_tags)
