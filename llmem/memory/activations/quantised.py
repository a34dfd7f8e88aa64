"""A bitsandbytes-quantised base inside a decoder layer: bitsandbytes' linears return their input's dtype, and
LLM.int8 keeps its inputs (ctx.tensors) even for a frozen weight (llmem.memory.quant has the storage and
transients; this module what the layer keeps because of them)."""

from __future__ import annotations

from dataclasses import replace

from llmem.memory.activations.blocks import Block, Dims, LayerRecipe, Sizes, block_owner
from llmem.memory.quant import is_quantised
from llmem.model.anatomy import DTYPE_BYTES, ModelAnatomy
from llmem.setup.precision import F32, Regime
from llmem.setup.quant_bases import quant_base_spec

NORM_FED_BLOCKS = ("qkv_proj", "gate_up_proj", "c_attn", "c_fc", "fc1", "query_key_value", "dense_h_to_4h",
             "qkv_and_fc_in")


def fp32_behind_quant(quant_base: str, r: Regime) -> bool:
    """bitsandbytes' linears return their input's dtype: behind prepare_model_for_kbit_training's fp32 norms under
    autocast (an fp32 residual stream), the MLP's gate/up outputs (and what silu and the product keep) are fp32,
    not the compute dtype."""
    return quant_base_spec(quant_base).bitsandbytes and r.autocast and r.res == F32


def adapter_regime(quant_base: str, r: Regime) -> Regime:
    """The regime peft's adapters see in its bitsandbytes LoRA layers (peft/tuners/lora/bnb.py forward): under
    autocast they cast nothing (`requires_conversion = not torch.is_autocast_enabled()`), so with a low-precision
    input (no kbit upcast: a bf16 residual stream) lora_A reads and keeps the base linear's input itself, as outside
    autocast; behind the upcast's fp32 norms autocast casts that input for lora_A as for any fp32 activation."""
    if quant_base_spec(quant_base).bitsandbytes and r.autocast and r.res != F32:
        return Regime("lowp", r.res, r.mm)
    return r


def quant_adapters_upcast(anatomy: ModelAnatomy, setup, r: Regime) -> bool:
    """peft's bitsandbytes LoRA layers outside autocast (lora/bnb.py: `requires_conversion`): fp32 adapters over a
    bf16/fp16 input (pure low precision without the kbit upcast; under *-mixed autocast is on, or FSDP2 gathers the
    adapters in bf16) cast it to fp32 (`_cast_input_dtype`), lora_A and
    lora_B run in fp32 and their output is cast back before the sum. Modelled as peft's plain lora.Linear upcast
    (the same kept tensors: the fp32 copy, lora_A's fp32 output); the clone and the low-precision sum are laid out
    with the dequantisation (llmem.estimator.schedule.blocks.BlockEvents.dequantise)."""
    return (setup.quant_spec.bitsandbytes and setup.precision_spec.low_precision and not setup.mixed
            and r.mm != F32 and any(p.trainable and p.layer_index is not None and p.dtype == "float32" for p in anatomy.params))


def quant_adapters_downcast(anatomy: ModelAnatomy, setup, r: Regime) -> int:
    """TRL's bf16 adapters (llmem.setup.objectives.cast_by_trainer) in peft's bitsandbytes LoRA layers over an
    fp32 input outside autocast (fp32, or pure bf16 / fp16 behind the kbit upcast's fp32 stream): lora/bnb.py's
    `requires_conversion` casts the input down to the adapters' dtype for lora_A (`_cast_input_dtype`), the adapter
    runs in it and its output is cast back up before the sum. The adapters' bytes per element (0: not so)."""
    if not setup.quant_spec.bitsandbytes or r.autocast or r.mm != F32:
        return 0
    return min((DTYPE_BYTES[p.dtype] for p in anatomy.params if p.trainable and p.layer_index is not None
                and DTYPE_BYTES.get(p.dtype, F32) < F32), default=0)


def quant_input_bytes(block: Block, r: Regime, fp32_behind_quant: bool) -> int:
    """Bytes per element of the input a block's linears read: a norm's output (the residual dtype), the MLP
    product (fp32 behind bitsandbytes' fp32 outputs), else a matmul output."""
    if block.name in NORM_FED_BLOCKS:
        return r.res
    if block.name in ("down_proj", "mlp_out", "fc2", "dense_4h_to_h") and fp32_behind_quant:
        return F32
    return r.mm


def int8_inputs_kept(anatomy: ModelAnatomy, blocks: tuple[Block, ...], t: int, r: Regime,
                     fp32_behind_quant: bool = False) -> Sizes:
    """Bytes of one layer's inputs that bitsandbytes' MatMul8bitLt keeps as a ctx attribute (ctx.tensors), which
    non-reentrant checkpointing cannot drop: one per block of int8 linears (linears of one block share it)."""

    per_block: dict[int, int] = {}
    for p in anatomy.layer0_params:
        if is_quantised(p, "int8"):
            i = block_owner(blocks, p.name)
            size = t * p.in_features * quant_input_bytes(blocks[i], r, fp32_behind_quant)
            per_block[i] = max(per_block.get(i, 0), size)
    return tuple(per_block[i] for i in sorted(per_block))


def with_fp32_mlp(recipe: LayerRecipe, d: Dims) -> LayerRecipe:
    """Llama-like MLP behind bitsandbytes' linears with an fp32 input: gate, silu(gate) and up come out fp32 (the
    product down_proj reads is kept only as lora_A's own cast, in the compute dtype)."""
    blocks = []
    for b in recipe.blocks:
        if b.name == "mlp_act" and len(b.tensors) >= 4:
            b = replace(b, tensors=(d.t * d.i * F32,) * 3 + b.tensors[3:])
        blocks.append(b)
    return LayerRecipe(tuple(blocks), recipe.embed, recipe.head, recipe.shared, recipe.head_for_weights,
                       recipe.head_back)


def with_int8_inputs(anatomy: ModelAnatomy, recipe: LayerRecipe, t: int, r: Regime) -> LayerRecipe:
    """The fp32 inputs MatMul8bitLt keeps (ctx.tensors) behind fp32 norms and the fp32 MLP product: nothing else
    keeps them (lora_A keeps its own cast). The attention output o_proj reads is SDPA's, already kept."""
    kept = dict.fromkeys(range(len(recipe.blocks)), 0)

    for p in anatomy.layer0_params:
        if is_quantised(p, "int8"):
            i = block_owner(recipe.blocks, p.name)
            if quant_input_bytes(recipe.blocks[i], r, True) == F32:
                kept[i] = max(kept[i], t * p.in_features * F32)
    blocks = tuple(replace(b, tensors=b.tensors + ((kept[i],) if kept[i] else ()), for_weights=())
                   for i, b in enumerate(recipe.blocks))
    return LayerRecipe(blocks, recipe.embed, recipe.head, recipe.shared, recipe.head_for_weights,
                       recipe.head_back)

