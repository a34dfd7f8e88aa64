"""torchao's Float8Linear in an activation recipe (llmem.setup.float8 says what its autograd Function keeps): the
kept tensors are nn.Linear's (the high-precision input; the weight is a parameter), so only the casts' temporaries
are new, added to the blocks that own converted linears.

One cast of an n-element bf16 tensor (float8_scaling_utils.hp_tensor_to_float8_dynamic, eager): abs(x) for the
amax (freed once reduced), then x.to(float32) * scale (the copy freed after the product), clamp, .to(float8):
at its peak the product, the clamped copy and the float8 result live, 4n + 4n + n bytes, and it leaves the n-byte
float8 tensor (its scale is a scalar, or one fp32 per row under rowwise). The float8 operands of a matmul are
locals of the autograd Function: they die when its forward or backward returns.
- forward: the input, then the weight (none under FSDP2's float8 all-gather: the gathered weight is float8 already),
  then torch._scaled_mm's output, which the recipe counts;
- backward: grad_output, the weight, grad_input (the recipe's transient), grad_output again (cast anew for the
  weight gradient), the saved input, then the weight gradient; the four float8 tensors live to the end.

Known Limitations: the first layer's linears stand for every layer's; in backward the block's transient is made
after its last linear's first casts (grad_input is part of it), and its other linears' casts follow it; the scales
(a scalar, or one fp32 per row) and the amax reductions' few bytes are left out; FSDP2's float8 cast of each shard
before the all-gather (fsdp_pre_all_gather) is left out of the copy-in. Eager only: torch.compile fuses the casts.
"""

from __future__ import annotations

from dataclasses import replace

from llmem.memory.activations.blocks import Block, Dims, LayerRecipe, block_owner
from llmem.model.anatomy import ModelAnatomy, ParamInfo
from llmem.model.sharding import MATMUL_KINDS
from llmem.setup.float8 import FP8, Float8Recipe, converted
from llmem.setup.precision import F32

CAST_PEAK = 2 * F32 + FP8     # bytes an element at a cast's peak: the scaled fp32 copy, its clamp, the float8 result
LOW = 2                       # bytes of a bf16 element (abs(x) keeps the input's dtype)

Event = tuple[int, int, int]  # (+1 allocate / -1 free, tag, bytes), as llmem.memory.quant's transients


def converted_linears(anatomy: ModelAnatomy) -> list[ParamInfo]:
    """The weights of the linears convert_to_float8_training swaps (torchtitan's filter), over all layers."""
    return [p for p in anatomy.params if p.module_kind in MATMUL_KINDS and p.name.endswith(".weight")
            and converted(p.name.removesuffix(".weight"), p.in_features, p.out_features)]


def cast_events(n: int, tag: int) -> list[Event]:
    """One cast of an n-element bf16 tensor in allocation order; it leaves the float8 tensor (tag + 4) allocated:
    abs(x) for the amax, x.to(float32), its product with the scale (the copy then freed), clamp, .to(float8),
    the clamped and the scaled copies freed (to_fp8_saturated returns, then _ToFloat8ConstrFunc.forward)."""
    return [(1, tag, LOW * n), (-1, tag, LOW * n),
            (1, tag + 1, F32 * n), (1, tag + 2, F32 * n), (-1, tag + 1, F32 * n),
            (1, tag + 3, F32 * n), (1, tag + 4, FP8 * n), (-1, tag + 3, F32 * n), (-1, tag + 2, F32 * n)]


def _freed(events: list[Event]) -> list[Event]:
    """Frees of what `events` leave allocated (the Function's float8 locals, when it returns)."""
    live: dict[int, int] = {}
    for sign, tag, n in events:
        if sign > 0:
            live[tag] = n
        else:
            live.pop(tag)
    return [(-1, tag, n) for tag, n in live.items()]


def forward_events(t: int, p: ParamInfo, weight_cast: bool, tag: int = 0) -> list[Event]:
    """One Float8Linear's forward beyond nn.Linear's: the input's cast, the weight's (none when FSDP2 gathered it
    in float8), both float8 operands freed once torch._scaled_mm has made the output (the recipe's tensor)."""
    events = cast_events(t * p.in_features, tag)
    if weight_cast:
        events += cast_events(p.numel, tag + 5)
    return events + _freed(events)


def backward_events(t: int, p: ParamInfo, weight_cast: bool, weight_grad_float8: bool,
                    tag: int = 0) -> tuple[list[Event], list[Event]]:
    """One Float8Linear's backward beyond nn.Linear's, split where grad_input is made (the recipe's transient):
    grad_output's and the weight's casts before it; after it, where the weight gradient runs in float8,
    grad_output's second cast and the input's; every float8 operand freed when the backward returns."""
    before = cast_events(t * p.out_features, tag)
    if weight_cast:
        before += cast_events(p.numel, tag + 5)
    after = cast_events(t * p.out_features, tag + 10) + cast_events(t * p.in_features, tag + 15) \
        if weight_grad_float8 else []
    return before, after + _freed(before + after)


def with_float8(recipe: LayerRecipe, anatomy: ModelAnatomy, d: Dims, float8: Float8Recipe,
                weight_cast: bool) -> LayerRecipe:
    """The recipe with each block's Float8Linear temporaries (the first layer's linears stand for every layer's);
    weight_cast False: FSDP2 gathers the weights in float8."""
    linears = [p for p in converted_linears(anatomy) if p.layer_index == 0]
    blocks = list(recipe.blocks)
    for i, b in enumerate(blocks):
        own = [p for p in linears if block_owner(recipe.blocks, p.name) == i]
        if own:
            blocks[i] = _converted(b, own, d.t, weight_cast, float8.weight_grad_float8)
    return replace(recipe, blocks=tuple(blocks))


def _converted(b: Block, own: list[ParamInfo], t: int, weight_cast: bool, weight_grad_float8: bool) -> Block:
    """The block's linears one after the other: in forward in order, at the block's end (after its kept tensors);
    in backward in reverse, the last linear's casts before the block's transient is made."""
    forward = [e for k, p in enumerate(own) for e in forward_events(t, p, weight_cast, 20 * k)]
    pieces = [backward_events(t, p, weight_cast, weight_grad_float8, 20 * k) for k, p in enumerate(reversed(own))]
    before, after = pieces[0][0], pieces[0][1] + [e for b_, a in pieces[1:] for e in b_ + a]
    return replace(b, temps=b.temps + _as_temps(forward, len(b.tensors)), back_casts=(tuple(before), tuple(after)))


def _as_temps(events: list[Event], end: int) -> tuple[tuple[int, float, float], ...]:
    """Events as a block's forward temporaries (Block.temps), each event at its own position after `end`."""
    step = 1 / (len(events) + 1)
    made: dict[int, tuple[int, float]] = {}
    temps: list[tuple[int, float, float]] = []
    for k, (sign, tag, n) in enumerate(events):
        at = end + (k + 1) * step
        if sign > 0:
            made[tag] = (n, at)
        else:
            size, born = made.pop(tag)
            temps.append((size, born, at))
    return tuple(temps)
