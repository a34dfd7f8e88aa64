"""Adapters on the memory floor: what peft's adapters change in a decoder layer's saved tensors.

The frozen base's weights need no inputs kept for their gradients (with_trainability), LoRA / DoRA / IA3 adapters
keep their own (with_adapters), and with a frozen embedding the blocks before the first adapter of layer 0 keep
nothing (first_layer_skip)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmem.memory.activations.blocks import MASK, Block, Dims, LayerRecipe, Sizes, block_owner
from llmem.memory.activations.quantised import quant_input_bytes
from llmem.memory.quant import is_quantised, quant_layout
from llmem.model.adapter_params import (
    IA3_L,
    LORA_A,
    LORA_B,
    adapted_module,
    adapter_part,
    is_adapter_param,
    is_embedding_adapter,
    partner,
    reads_module_input,
)
from llmem.model.anatomy import ModelAnatomy, ParamInfo
from llmem.model.sharding import is_embedding
from llmem.setup.precision import F32, Regime
from llmem.setup.training import TrainingSetup

Temp = tuple[int, float, float]   # a forward temporary: (bytes, made at, freed at), positions as in Block.temps


# ------------------------------------------------------------------------------------ the forward's moments, named
# A forward temporary is made and freed at positions in its block (Block.temps, ordered by
# llmem.estimator.schedule.block_plan): kept tensor k is made at k, and k + offset is a moment between kept tensors.
# The offsets below name the moments of each forward, in the order the forward reaches them, from an anchor: the
# adapter's first kept tensor `i` or its last one `last` (`last + 1`: the tensor a later block keeps, made here
# from the module's output when the adapter hands it on). Equal positions are one moment (block_plan's ties).

class Frozen:
    """with_trainability: an input kept only for a frozen weight is still made, a temporary of its block."""
    DROPPED_INPUT = -0.6            # before the block's first kept tensor (the k-th such input: + k x STEP)
    DROPPED_INPUT_STEP = 0.01
    BLOCK_END = 0.95                # from len(kept): the block's end as with_trainability leaves it


class Lora:
    """peft's lora/layer.py Linear.forward: `result = base_layer(x)`, `x = _cast_input_dtype(x)`,
    `result = result + lora_B(lora_A(dropout(x))) * scaling`, `result.to(torch_result_dtype)`."""
    # from i, before lora_A keeps its input
    BASE_OUTPUT = -0.5              # result = base_layer(x)
    INPUT_COPY = -0.4               # x.to(adapter dtype)
    DROPOUT_OUTPUT = -0.3           # dropout(x), fp32 (autocast: until lora_A has kept its cast, at i + 1)
    DROPOUT_FREED = 1.5
    # from last (lora_B's input), after lora_A and lora_B ran
    LORA_B_OUTPUT = 0.2             # lora_B(...)
    SCALED = 0.25                   # ... * scaling
    LORA_B_OUTPUT_FREED = 0.27
    SUM = 0.3                       # result + ...
    SCALED_FREED = 0.31             # (fp32 adapters)
    BASE_OUTPUT_FREED = 0.33        # (fp32 adapters)
    CAST_BACK = 0.35                # result.to(torch_result_dtype) (fp32 adapters)
    SUM_FREED = 0.4                 # (fp32 adapters: the fp32 sum once cast back)
    RETURNED = 0.5                  # the module's output handed on, the forward's temporaries freed
    COPY_FREED = 0.6                # (fp32 adapters with dropout: the fp32 copy of the input)
    RETURNED_AFTER_HANDOFF = 1.5    # the output is the tensor made at last + 1: freed after it


class Dora:
    """peft's lora/dora.py DoraLinearLayer.forward: lora_weight = lora_B(lora_A(eye)).T, the weight norm, then
    `(m / norm - 1) * base_result + (m / norm) * lora_result * scaling`, added to the base output."""
    # from i (base_result, kept): lora_weight's graph and the weight norm
    INPUT_COPY = 0.1                # x.to(fp32) for the adapter (autocast)
    EYE = 0.2                       # eye(in)
    EYE_CAST = 0.21                 # lora_A's cast of the eye (autocast)
    LORA_A_EYE = 0.22               # lora_A(eye)
    LORA_B_EYE = 0.23               # lora_B(...)
    LORA_WEIGHT_FP32 = 0.3          # lora_weight.to(fp32) (autocast)
    EYE_FREED = 0.35                # (autocast)
    LORA_B_EYE_FREED = 0.4          # (autocast)
    WEIGHT_FP32 = 0.4               # W.to(fp32)
    SCALED_WEIGHT = 0.45            # scaling * lora_weight
    WEIGHT_SUM = 0.5                # W + that
    WEIGHT_SUM_FREED = 0.7          # both, once the norm is taken
    # from last (the vectors): the magnitude products [t, out]
    BASE_PRODUCT = 0.1              # (m / norm - 1) * base_result
    LORA_PRODUCT = 0.2              # (m / norm) * lora_result
    SCALED_PRODUCT = 0.3            # ... * scaling
    LORA_PRODUCT_FREED = 0.4
    RESULT_DORA = 0.5               # the two products' sum
    PRODUCTS_FREED = 0.6
    SUM = 0.7                       # result + result_dora (the module's output)
    RESULT_DORA_FREED = 0.8
    RETURNED = 0.9                  # lora_weight's graph freed as the forward returns
    CAST_BACK = 0.9                 # the sum cast back (fp32 adapters on a low-precision base)
    SUM_FREED = 0.95
    CAST_BACK_FREED = 0.97


class Ia3:
    """peft's ia3/layer.py Linear.forward: `(base_layer(x) * ia3_l).to(dtype)` on an output, `base_layer((x.to(ia3
    dtype) * ia3_l).to(dtype))` on a feed-forward input; offsets from i (the adapter's first kept tensor)."""
    PRODUCT = 0.3                   # base_layer(x) * ia3_l
    RETURNED = 0.5                  # the output handed on / the scaled input read by the base linear
    RETURNED_AFTER_HANDOFF = 1.5    # the output is the tensor made at i + 1: freed after it


def with_trainability(anatomy: ModelAnatomy, recipe: LayerRecipe, adapters_read: bool = True,
                      frozen_base: bool = False, quant_base: str = "none") -> LayerRecipe:
    """Drop the tensors kept only for gradients of weights that are frozen (peft's base). A shared input still
    stays when an adapter reads it itself (`adapters_read`: LoRA's lora_A outside autocast and without dropout; IA3
    on a feed-forward input outside autocast); an autocast cast of it does not. `frozen_base`: no exact model of
    the adapters, activations as for the frozen base alone. bitsandbytes' MatMul8bitLt keeps its input
    (ctx.tensors) even for a frozen int8 weight."""

    layer0, root = anatomy.layer0_params, anatomy.outside_layer_params

    def needed(params, keepers: tuple[str, ...], cast: bool) -> bool:
        for p in params:
            int8 = not cast and is_quantised(p, quant_base) and quant_layout(quant_base).keeps_inputs
            if not int8 and (not p.trainable or frozen_base and p.layer_index is not None):
                continue
            names = (p.name, p.tied_to or "")
            peft = is_adapter_param(p.name)
            base = (not peft and not p.name.endswith(".bias")) or int8    # a bias gradient needs no input
            adapter = adapters_read and not cast and reads_module_input(p.name, p.shape)
            if (base or adapter) and any(f"{k}." in n for k in keepers for n in names):
                return True
        return False

    def keep(tensors: Sizes, tags, params) -> Sizes:
        drop = {i for i, keepers, cast in tags if not needed(params, keepers, cast)}
        return tuple(n for i, n in enumerate(tensors) if i not in drop)

    def remap(outputs, tags, params):
        drop = {i for i, keepers, cast in tags if not needed(params, keepers, cast)}
        return tuple((m, i - sum(1 for j in drop if j < i)) for m, i in outputs if i not in drop)

    # a dropped tensor is still made in forward, and freed once the linears reading it have run: a temporary of
    # the block owning those linears (from its start to its end)
    moved: list[list[tuple[int, float, float | None]]] = [[] for _ in recipe.blocks]
    for b in recipe.blocks:
        for i, keepers, cast in b.for_weights:
            if not needed(layer0, keepers, cast):
                owner = block_owner(recipe.blocks, f"x.{keepers[0]}.weight")
                at = Frozen.DROPPED_INPUT + Frozen.DROPPED_INPUT_STEP * len(moved[owner])
                # one linear's autocast cast lives for that matmul only; a shared input until the block's end
                moved[owner].append((b.tensors[i], at, at if cast else None))
    blocks = tuple(Block(b.name, kept, b.params, b.transient, temps=tuple(
                             (n, a, len(kept) + Frozen.BLOCK_END if f is None else f) for n, a, f in moved[j]),
                         outputs=remap(b.outputs, b.for_weights, layer0), back_events=b.back_events)
                   for j, b in enumerate(recipe.blocks) for kept in [keep(b.tensors, b.for_weights, layer0)])
    return LayerRecipe(blocks, recipe.embed, keep(recipe.head, recipe.head_for_weights, root), recipe.shared,
                       head_back=recipe.head_back)


def adapters_upcast(anatomy: ModelAnatomy, setup: TrainingSetup, r: Regime) -> bool:
    """peft's fp32 adapters over a pure fp16/bf16 base (get_peft_model(autocast_adapter_dtype=True), peft's default:
    llmem.model.peft.LOW_DTYPE): each adapted linear casts its input to fp32 (`_cast_input_dtype`), runs its adapter
    in fp32 and casts the sum back to the base's dtype (`result.to(torch_result_dtype)`). Not under autocast (its
    own path), nor where the stream is fp32 anyway (a kbit upcast), nor in peft's bitsandbytes layers (lora/bnb.py
    casts lora_B's output back before the sum: llmem.memory.quant's transients)."""
    return (setup.precision_spec.low_precision and not setup.mixed and not r.autocast and r.mm != F32
            and not setup.quant_spec.quantised and any(p.trainable and p.layer_index is not None and p.dtype == "float32" for p in anatomy.params))


def adapters_read_input(anatomy: ModelAnatomy, r: Regime, upcast: bool = False) -> bool:
    """Whether LoRA's lora_A keeps the very tensor the base linear reads. Not under autocast: peft casts the input
    to the fp32 adapter dtype (`_cast_input_dtype`, autocast_adapter_dtype) and autocast casts that copy back for
    lora_A, which keeps its own low-precision cast; not with fp32 adapters on a pure low-precision base
    (`upcast`): lora_A keeps peft's fp32 copy; not with dropout: lora_A reads the dropout output."""
    return not r.autocast and not upcast and not (anatomy.peft is not None and anatomy.peft.lora_dropout > 0)


def with_adapters(anatomy: ModelAnatomy, recipe: LayerRecipe, d: Dims, r: Regime,
                  fp32_behind_quant: bool = False, upcast: bool = False, downcast: int = 0) -> LayerRecipe:
    """What peft's adapters keep for backward, per block, in forward order (peft's lora/layer.py, ia3/layer.py).

    LoRA, `result + lora_B(lora_A(dropout(x.to(adapter dtype)))) * scaling`: lora_B keeps its input (lora_A's
    output, [t, rank]); lora_A keeps its input: under autocast its own low-precision cast of the fp32 copy peft
    makes (`_cast_input_dtype`; the adapters are fp32 by autocast_adapter_dtype), with dropout the dropout output
    (native_dropout also keeps a bool mask), else the base linear's input itself. Forward temporaries: the fp32
    copy (until the adapted module's forward returns), the fp32 dropout output, lora_B's output, its scaled copy
    and their sum (the module's output: handed to the tensor a later block keeps, where Block.outputs names it).
    IA3 on an output (k, v: `(base(x) * ia3_l).to(dtype)`): the multiply keeps the base output [t, out] for the
    vector's gradient; the product is fp32 under autocast (ia3_l is fp32) until cast back. IA3 on a feed-forward
    input (down_proj: `(x.to(ia3 dtype) * ia3_l).to(dtype)`): the multiply keeps x, an fp32 copy under autocast.
    `upcast` (adapters_upcast: fp32 adapters on a pure fp16/bf16 base): lora_A keeps peft's fp32 copy of the input
    (or, with dropout, the fp32 dropout output and its mask; the copy lives until the forward returns), lora_B its
    fp32 input; lora_B's output, its scaled copy and the sum with the base output are fp32, the sum cast back to the
    base's dtype; IA3 as under autocast (fp32 vectors). `downcast` (llmem.memory.activations.quantised
    .quant_adapters_downcast: TRL's bf16 adapters over an fp32 input outside autocast, its value the adapters' bytes
    per element): LoRA as under `upcast`, the copy, lora_A's output and the adapter's outputs in the adapters' dtype.
    Applied after with_trainability: the tensors it adds are all needed.
    """
    adapters = _LayerAdapters(anatomy, recipe, d.t, r, fp32_behind_quant, upcast, downcast)
    for p in anatomy.layer0_params:
        forward = _FORWARDS.get(adapter_part(p.name))
        if p.trainable and forward is not None:
            forward(adapters, p, block_owner(recipe.blocks, p.name))
    taken = adapters.taken
    blocks = tuple(Block(b.name, tuple(n for x, n in enumerate(b.tensors) if (j, x) not in taken) + tuple(a.kept),
                         b.params, b.transient + a.back, b.for_weights, b.temps + tuple(a.temps),
                         back_events=b.back_events if not a.back else ())
                   for j, (b, a) in enumerate(zip(recipe.blocks, adapters.added, strict=True)))
    return LayerRecipe(blocks, recipe.embed, recipe.head, recipe.shared, recipe.head_for_weights, recipe.head_back)


@dataclass
class _Added:
    """What peft's adapters add to one block: tensors kept after its own, forward temporaries, and the largest
    backward transient on top of the block's."""
    kept: list[int] = field(default_factory=list)
    temps: list[Temp] = field(default_factory=list)
    back: int = 0


class _LayerAdapters:
    """with_adapters' pass over layer 0's adapter parameters: each adapted module's forward adds to its block."""

    def __init__(self, anatomy: ModelAnatomy, recipe: LayerRecipe, t: int, r: Regime, fp32_behind_quant: bool,
                 upcast: bool, downcast: int = 0) -> None:
        self.anatomy, self.blocks, self.t, self.r = anatomy, recipe.blocks, t, r
        self.fp32_behind_quant, self.upcast = fp32_behind_quant, upcast
        self.downcast = downcast                      # the adapters' bytes when narrower than their input (0)
        self.dropout = anatomy.peft.lora_dropout if anatomy.peft is not None else 0.0
        self.dora = anatomy.peft is not None and anatomy.peft.use_dora
        self.added = [_Added() for _ in recipe.blocks]
        self.taken: set[tuple[int, int]] = set()      # (block, tensor) made by an adapter instead (Block.outputs)
        self.trailing: list[int] = []                 # the last handoff's trailing tensors, kept right after it

    def handoff(self, name: str, j: int) -> int:
        """Bytes of the tensor a block after block j keeps that is this adapted linear's output (0: none); it moves
        here. When that tensor opens its block, the tensors after it up to the next linear's output move too
        (`trailing`): they are made from it before the next linear runs (silu(gate) before up_proj)."""
        module = adapted_module(name)
        self.trailing.clear()
        for jb, b in enumerate(self.blocks):
            for m, x in b.outputs:
                if m == module and jb > j and (jb, x) not in self.taken:
                    self.taken.add((jb, x))
                    if x == 0:
                        others = {y for _, y in b.outputs}
                        for y in range(1, next((y for y in sorted(others) if y > 0), len(b.tensors))):
                            self.taken.add((jb, y))
                            self.trailing.append(b.tensors[y])
                    return b.tensors[x]
        return 0

    def lora_shape(self, p: ParamInfo) -> tuple[int, int, int]:
        """lora_A's (rank, in_features) and its lora_B's out_features."""
        rank, in_f = p.shape
        return rank, in_f, next((q.shape[0] for q in self.anatomy.params if q.name == partner(p.name, LORA_B)), in_f)

    def lora_a(self, p: ParamInfo, j: int) -> None:
        """A LoRA tuner layer (read at its lora_A): DoRA, fp32 adapters on a low-precision base, or plain LoRA."""
        a, block, t, r = self.added[j], self.blocks[j], self.t, self.r
        i = len(block.tensors) + len(a.kept)          # index of this adapter's first kept tensor
        rank, in_f, out_f = self.lora_shape(p)
        if self.dora:
            kept, temps = dora_forward(t, in_f, out_f, rank, r, i, self.upcast)
            a.kept += kept
            a.temps += temps
            # backward of the two magnitude multiplies: the incoming gradient times base_result / lora_result
            # (for the vectors, before their sum), and the gradients of base_result and lora_result [t, out]
            a.back = max(a.back, 3 * t * out_f * (F32 if r.autocast or self.upcast else r.mm))
        elif self.upcast or self.downcast:
            kept, temps, back = upcast_lora_forward(t, in_f, out_f, rank, r, i, self.dropout,
                                                    self.handoff(p.name, j), self.downcast or F32)
            a.kept += kept + self.trailing
            a.temps += temps
            a.back = max(a.back, back - block.transient)   # the base's input gradient comes after: not on top
        else:
            self.lora(a, block, i, rank, in_f, out_f, p.name, j)

    def lora(self, a: _Added, block: Block, i: int, rank: int, in_f: int, out_f: int, name: str, j: int) -> None:
        """Plain LoRA: the adapter in the base's compute dtype (or under autocast, from peft's fp32 copy)."""
        t, r, dropout = self.t, self.r, self.dropout
        mine: list[int] = []                                  # this adapter's kept tensors, from index i
        in_bytes = quant_input_bytes(block, r, self.fp32_behind_quant)
        # the base linear's output: fp32 from a bitsandbytes linear reading fp32, else the matmul dtype
        out_bytes = F32 if self.fp32_behind_quant and in_bytes == F32 else r.mm
        pre: list[tuple[int, float]] = [(t * out_f * out_bytes, i + Lora.BASE_OUTPUT)]
        # peft's bitsandbytes LoRA layer under autocast (here only behind the kbit upcast's fp32 stream:
        # adapter_regime) casts nothing itself (lora/bnb.py `requires_conversion`): a low-precision input (o_proj's,
        # the attention output) reaches lora_A as it is, which keeps that very tensor
        as_is = self.fp32_behind_quant and in_bytes != F32
        if r.autocast and as_is:
            if dropout > 0:
                mine += [t * in_f * r.mm, t * in_f * MASK]
        elif r.autocast:
            if in_bytes != F32:
                pre.append((t * in_f * F32, i + Lora.INPUT_COPY))   # x.to(fp32), until the forward returns
            if dropout > 0:                                   # fp32 dropout output, until lora_A cast it
                a.temps.append((t * in_f * F32, i + Lora.DROPOUT_OUTPUT, i + Lora.DROPOUT_FREED))
                mine += [t * in_f * MASK, t * in_f * r.mm]
            else:
                mine.append(t * in_f * r.mm)
        elif dropout > 0:
            mine += [t * in_f * r.mm, t * in_f * MASK]
        mine.append(t * rank * r.mm)
        if r.autocast:   # backward: lora_A's input gradient, back through the casts (fp32, then low; bnb: its own)
            casts = (0 if as_is else F32) if self.fp32_behind_quant else r.mm + F32
            a.back = max(a.back, t * in_f * (r.mm + casts))
        last = i + len(mine) - 1
        moved = self.handoff(name, j)
        if moved:                                  # the sum is the tensor a later block keeps
            mine += [moved, *self.trailing]
            done = last + Lora.RETURNED_AFTER_HANDOFF
        else:                                      # the sum, made and handed on (the module's output)
            a.temps.append((t * out_f * out_bytes, last + Lora.SUM, last + Lora.RETURNED))
            done = last + Lora.RETURNED
        a.temps += [(n, at, done) for n, at in pre]
        # lora_B's output (freed once scaled), its scaled copy (freed after the sum)
        a.temps += [(t * out_f * r.mm, last + Lora.LORA_B_OUTPUT, last + Lora.LORA_B_OUTPUT_FREED),
                    (t * out_f * r.mm, last + Lora.SCALED, done)]
        a.kept += mine

    def ia3(self, p: ParamInfo, j: int) -> None:
        """An IA3 tuner layer: its vector scales the base linear's output ([out, 1]) or a feed-forward input."""
        a, block, t, r = self.added[j], self.blocks[j], self.t, self.r
        i = len(block.tensors) + len(a.kept)          # index of this adapter's first kept tensor
        out_f, in_f = p.shape
        fp32 = r.autocast or self.upcast                       # ia3_l fp32 over a low-precision base
        if in_f == 1:                                          # output scaling [out, 1]
            a.kept.append(t * out_f * r.mm)                    # base(x), kept for ia3_l's gradient
            moved = self.handoff(p.name, j)
            returned = i + (Ia3.RETURNED_AFTER_HANDOFF if moved else Ia3.RETURNED)
            if fp32:                                           # the fp32 product, until cast back
                a.temps.append((t * out_f * F32, i + Ia3.PRODUCT, returned))
            elif not moved:
                a.temps.append((t * out_f * r.mm, i + Ia3.PRODUCT, i + Ia3.RETURNED))
            if moved:
                a.kept += [moved, *self.trailing]
            # backward: the incoming gradient (cast up to fp32), its products with ia3_l and with base(x)
            a.back = max(a.back, 3 * t * out_f * F32 if fp32 else 2 * t * out_f * r.mm)
        else:                                                  # feed-forward input scaling [1, in]
            at = i + Ia3.RETURNED                              # made and freed as the base linear reads it
            if fp32:
                a.kept.append(t * in_f * F32)
                a.temps += [(t * in_f * F32, at, at), (t * in_f * r.mm, at, at)]
            else:                                              # x * ia3_l, the base linear's input
                a.temps.append((t * in_f * r.mm, at, at))
            # backward, after the base linear's input gradient (the block's transient): that gradient cast up
            # to fp32 (which frees it) or kept, and its products with ia3_l and with x
            a.back = max(a.back, 3 * t * in_f * (F32 if fp32 else r.mm) - block.transient)


# the forward each adapter part opens (lora_B and DoRA's magnitude are read with their lora_A)
_FORWARDS = {LORA_A: _LayerAdapters.lora_a, IA3_L: _LayerAdapters.ia3}


def upcast_lora_forward(t: int, in_f: int, out_f: int, rank: int, r: Regime, i: int, dropout: float, moved: int,
                        adapter_bytes: int = F32) -> tuple[list[int], list[Temp], int]:
    """One LoRA-adapted linear with fp32 adapters on a pure low-precision base (peft's lora/layer.py Linear.forward:
    `x = self._cast_input_dtype(x, lora_A.weight.dtype)`, `result = result + lora_B(lora_A(dropout(x))) * scaling`,
    `result.to(torch_result_dtype)`), as (kept tensors from index i, forward temporaries, backward transient).

    Kept: the fp32 copy of the input (lora_A's input; with dropout the fp32 dropout output and its bool mask
    instead, the copy a temporary until the forward returns), lora_A's fp32 output, and `moved` (the cast-back sum,
    when a later block keeps the module's output). Temporaries, in the order the forward makes them: the base
    output (until the sum is made), lora_B's fp32 output (freed once scaled), its scaled copy (freed after the sum),
    the fp32 sum (freed once cast back) and the cast (the module's output, handed on when no block keeps it).
    `adapter_bytes` below the input's (TRL's bf16 adapters over an fp32 input, peft's bitsandbytes LoRA layer:
    `x = self._cast_input_dtype(x, lora_A.weight.dtype)`, `output.to(expected_dtype)`): the same tensors, the copy,
    lora_A's output and the adapter's outputs in the adapters' dtype."""
    base, wide = t * out_f * r.mm, t * out_f * adapter_bytes
    copy = t * in_f * adapter_bytes
    kept = [copy, t * in_f * MASK] if dropout > 0 else [copy]   # lora_A's input (the dropout's output and mask)
    kept.append(t * rank * adapter_bytes)                       # lora_B's input
    last = i + len(kept) - 1
    temps = [(base, i + Lora.BASE_OUTPUT, last + Lora.BASE_OUTPUT_FREED)]
    if dropout > 0:
        temps.append((copy, i + Lora.INPUT_COPY, last + (Lora.RETURNED_AFTER_HANDOFF if moved else Lora.COPY_FREED)))
    temps += [(wide, last + Lora.LORA_B_OUTPUT, last + Lora.LORA_B_OUTPUT_FREED),
              (wide, last + Lora.SCALED, last + Lora.SCALED_FREED),
              (wide, last + Lora.SUM, last + Lora.SUM_FREED)]
    if moved:                          # the cast-back sum is the tensor a later block keeps: made at last + 1
        kept.append(moved)
        temps[-1] = (wide, last + Lora.SUM, last + Lora.RETURNED_AFTER_HANDOFF)
    else:
        temps.append((base, last + Lora.CAST_BACK, last + Lora.RETURNED))
    # backward, above what is kept: the gradient for the base output (cast to its dtype) stays while the fp32
    # gradients of the sum and of lora_B's output are made, then lora_A's fp32 input gradient (its fp32 input is
    # freed as that node runs, before the cast back and the base linear's input gradient)
    return kept, temps, t * out_f * r.mm + max(2 * wide, t * in_f * adapter_bytes)


def dora_forward(t: int, in_f: int, out_f: int, rank: int, r: Regime, i: int, upcast: bool = False
                 ) -> tuple[list[int], list[Temp]]:
    """One DoRA-adapted linear in training (peft's lora/dora.py DoraLinearLayer.forward, no dropout), as (kept
    tensors, forward temporaries at positions from i, the index of its first kept tensor).

    lora_weight = lora_B(lora_A(eye(in))).T, cast to x's dtype; ||W + scaling * lora_weight|| per output row with
    W cast to x's dtype: [in, in] and [out, in] temporaries per forward, the eye's cast and lora_A's output held by
    lora_weight's graph until the forward returns. Then (m / norm - 1) * base_result + (m / norm) * lora_result *
    scaling: the two multiplies keep base_result and lora_result [t, out] (and [out] vectors); their products are
    fp32 under autocast (the magnitude is fp32). Under autocast x is peft's fp32 copy of the input, cast again for
    lora_A (kept); with fp32 adapters on a pure low-precision base (`upcast`) lora_A keeps that fp32 copy itself,
    the adapter computes in fp32 (the eye, lora_weight, W's copy, lora_A's and lora_B's outputs) and the fp32 sum is
    cast back; otherwise lora_A keeps x itself (the base linear's input)."""
    fp32 = r.autocast or upcast
    ad = F32 if fp32 else r.mm                # x's dtype inside the adapter (the adapter dtype)
    prod = F32 if fp32 else r.mm              # the magnitude products
    mm = F32 if upcast else r.mm              # the adapter's matmul outputs
    kept = [t * out_f * r.mm]                 # base_result, kept by (m / norm - 1) * base_result
    if fp32:
        kept.append(t * in_f * (F32 if upcast else r.mm))   # lora_A's input: the fp32 copy (or autocast's cast)
    kept += [t * rank * mm, t * out_f * mm, 3 * out_f * F32]   # lora_B's input, lora_result, the vectors
    last = i + len(kept) - 1                  # the products follow the last kept tensor
    end = last + Dora.RETURNED
    D = Dora
    temps = [(in_f * in_f * ad, i + D.EYE, i + D.EYE_FREED if r.autocast else end),   # (lora_A keeps it: lowp)
             (in_f * rank * mm, i + D.LORA_A_EYE, end),
             (in_f * out_f * mm, i + D.LORA_B_EYE, i + D.LORA_B_EYE_FREED if r.autocast else end),
             (out_f * in_f * ad, i + D.SCALED_WEIGHT, i + D.WEIGHT_SUM_FREED),
             (out_f * in_f * ad, i + D.WEIGHT_SUM, i + D.WEIGHT_SUM_FREED),
             (t * out_f * prod, last + D.BASE_PRODUCT, last + D.PRODUCTS_FREED),
             (t * out_f * prod, last + D.LORA_PRODUCT, last + D.LORA_PRODUCT_FREED),
             (t * out_f * prod, last + D.SCALED_PRODUCT, last + D.PRODUCTS_FREED),
             (t * out_f * prod, last + D.RESULT_DORA, last + D.RESULT_DORA_FREED),
             (t * out_f * prod, last + D.SUM, last + D.SUM_FREED)]
    if r.autocast:
        temps += [(t * in_f * F32, i + D.INPUT_COPY, end),           # x.to(fp32) for the adapter
                  (in_f * in_f * r.mm, i + D.EYE_CAST, end),         # lora_A's cast of the eye, kept by the graph
                  (out_f * in_f * F32, i + D.LORA_WEIGHT_FP32, end)]  # lora_weight.to(fp32)
    if fp32:
        temps.append((out_f * in_f * F32, i + D.WEIGHT_FP32, end))   # W.to(fp32)
    if upcast:
        temps.append((t * out_f * r.mm, last + D.CAST_BACK, last + D.CAST_BACK_FREED))   # the sum cast back
    return kept, temps


def first_layer_skip(anatomy: ModelAnatomy, blocks: tuple[Block, ...]) -> int:
    """With a frozen embedding and no prompt (peft adapters in the layers), layer 0's input needs no gradient:
    autograd records nothing until the first trained parameter of layer 0 is used, so the blocks before it keep
    nothing (and their backward never runs); with peft's LoRA on the embedding its output has a graph."""
    if anatomy.peft is None or any(p.trainable and (is_embedding(p) or is_embedding_adapter(p.name))
                                   for p in anatomy.outside_layer_params):
        return 0
    owners = [block_owner(blocks, p.name) for p in anatomy.layer0_params if p.trainable]
    return min(owners, default=0)

