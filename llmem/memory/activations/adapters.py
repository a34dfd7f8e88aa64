"""What peft changes in a decoder layer's saved tensors: the frozen base's weights need no inputs kept for their
gradients (with_trainability), LoRA / DoRA / IA3 adapters keep their own (with_adapters), and with a frozen
embedding the blocks before the first adapter of layer 0 keep nothing (first_layer_skip)."""

from __future__ import annotations

from llmem.memory.activations.blocks import MASK, Block, Dims, LayerRecipe, Sizes, block_owner
from llmem.memory.activations.quantised import quant_input_bytes
from llmem.memory.quant import is_quantised
from llmem.model.anatomy import ModelAnatomy
from llmem.model.sharding import is_embedding
from llmem.setup.precision import F32, Regime
from llmem.setup.training import TrainingSetup


def with_trainability(anatomy: ModelAnatomy, recipe: LayerRecipe, adapters_read: bool = True,
                      frozen_base: bool = False, quant_base: str = "none") -> LayerRecipe:
    """Drop the tensors kept only for gradients of weights that are frozen (peft's base). A shared input still
    stays when an adapter reads it itself (`adapters_read`: LoRA's lora_A outside autocast and without dropout; IA3
    on a feed-forward input outside autocast); an autocast cast of it does not. `frozen_base`: no exact model of
    the adapters, activations as for the frozen base alone. bitsandbytes' MatMul8bitLt keeps its input
    (ctx.tensors) even for a frozen int8 weight."""

    layer0 = [p for p in anatomy.params if p.layer_index == 0]
    root = [p for p in anatomy.params if p.layer_index is None]

    def needed(params, keepers: tuple[str, ...], cast: bool) -> bool:
        for p in params:
            int8 = quant_base == "int8" and not cast and is_quantised(p, quant_base)
            if not int8 and (not p.trainable or frozen_base and p.layer_index is not None):
                continue
            names = (p.name, p.tied_to or "")
            peft = ".lora_" in p.name or ".ia3_l." in p.name
            base = (not peft and not p.name.endswith(".bias")) or int8    # a bias gradient needs no input
            adapter = adapters_read and not cast and (".lora_A." in p.name or ".ia3_l." in p.name
                                                      and p.shape[0] == 1)
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
    moved: list[list[tuple[int, float, float]]] = [[] for _ in recipe.blocks]
    for b in recipe.blocks:
        for i, keepers, cast in b.for_weights:
            if not needed(layer0, keepers, cast):
                owner = block_owner(recipe.blocks, f"x.{keepers[0]}.weight")
                at = -0.6 + 0.01 * len(moved[owner])
                # one linear's autocast cast lives for that matmul only; a shared input until the block's end
                moved[owner].append((b.tensors[i], at, at if cast else None))
    blocks = tuple(Block(b.name, kept, b.params, b.transient, temps=tuple(
                             (n, a, len(kept) + 0.95 if f is None else f) for n, a, f in moved[j]),
                         outputs=remap(b.outputs, b.for_weights, layer0))
                   for j, b in enumerate(recipe.blocks) for kept in [keep(b.tensors, b.for_weights, layer0)])
    return LayerRecipe(blocks, recipe.embed, keep(recipe.head, recipe.head_for_weights, root), recipe.shared)


def adapters_upcast(anatomy: ModelAnatomy, setup: TrainingSetup, r: Regime) -> bool:
    """peft's fp32 adapters over a pure fp16/bf16 base (get_peft_model(autocast_adapter_dtype=True), peft's default:
    llmem.model.peft.LOW_DTYPE): each adapted linear casts its input to fp32 (`_cast_input_dtype`), runs its adapter
    in fp32 and casts the sum back to the base's dtype (`result.to(torch_result_dtype)`). Not under autocast (its
    own path), nor where the stream is fp32 anyway (a kbit upcast), nor in peft's bitsandbytes layers (lora/bnb.py
    casts lora_B's output back before the sum: llmem.memory.quant's transients)."""
    return (setup.precision_spec.low_precision and not setup.mixed and not r.autocast and r.mm != F32
            and setup.quant_base == "none" and any(p.trainable and p.layer_index is not None and p.dtype == "float32" for p in anatomy.params))


def adapters_read_input(anatomy: ModelAnatomy, r: Regime, upcast: bool = False) -> bool:
    """Whether LoRA's lora_A keeps the very tensor the base linear reads. Not under autocast: peft casts the input
    to the fp32 adapter dtype (`_cast_input_dtype`, autocast_adapter_dtype) and autocast casts that copy back for
    lora_A, which keeps its own low-precision cast; not with fp32 adapters on a pure low-precision base
    (`upcast`): lora_A keeps peft's fp32 copy; not with dropout: lora_A reads the dropout output."""
    return not r.autocast and not upcast and not (anatomy.peft is not None and anatomy.peft.lora_dropout > 0)


def with_adapters(anatomy: ModelAnatomy, recipe: LayerRecipe, d: Dims, r: Regime,
                  fp32_behind_quant: bool = False, upcast: bool = False) -> LayerRecipe:
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
    base's dtype; IA3 as under autocast (fp32 vectors).
    Applied after with_trainability: the tensors it adds are all needed.
    """
    dropout = anatomy.peft.lora_dropout if anatomy.peft is not None else 0.0
    dora = anatomy.peft is not None and anatomy.peft.use_dora
    added: list[tuple[list[int], list[tuple[int, float, float]]]] = [([], []) for _ in recipe.blocks]
    back = [0] * len(recipe.blocks)
    t = d.t
    taken: set[tuple[int, int]] = set()      # (block, tensor) made by an adapter instead (Block.outputs)
    trailing: list[int] = []                 # the last handoff's trailing tensors, kept right after it

    def handoff(name: str) -> int:
        """Bytes of the later block's tensor that is this adapted linear's output (0: none); it moves here. When
        that tensor opens its block, the tensors after it up to the next linear's output move too (`trailing`): they
        are made from it before the next linear runs (silu(gate) before up_proj)."""
        module = name.split(".lora_A.")[0].split(".ia3_l.")[0].rsplit(".", 1)[-1]
        trailing.clear()
        for jb, b in enumerate(recipe.blocks):
            for m, x in b.outputs:
                if m == module and jb > j and (jb, x) not in taken:
                    taken.add((jb, x))
                    if x == 0:
                        others = {y for _, y in b.outputs}
                        for y in range(1, next((y for y in sorted(others) if y > 0), len(b.tensors))):
                            taken.add((jb, y))
                            trailing.append(b.tensors[y])
                    return b.tensors[x]
        return 0

    for p in anatomy.params:
        if p.layer_index != 0 or not p.trainable:
            continue
        j = block_owner(recipe.blocks, p.name)
        block = recipe.blocks[j]
        kept, temps = added[j]
        i = len(block.tensors) + len(kept)            # index of this adapter's first kept tensor
        if ".lora_A." in p.name and dora:
            rank, in_f = p.shape
            out_f = next((q.shape[0] for q in anatomy.params
                          if q.name == p.name.replace(".lora_A.", ".lora_B.")), in_f)
            k, tm = dora_forward(t, in_f, out_f, rank, r, i, upcast)
            kept += k
            temps += tm
            # backward of the two magnitude multiplies: the incoming gradient times base_result / lora_result
            # (for the vectors, before their sum), and the gradients of base_result and lora_result [t, out]
            back[j] = max(back[j], 3 * t * out_f * (F32 if r.autocast or upcast else r.mm))
        elif ".lora_A." in p.name and upcast:
            rank, in_f = p.shape
            out_f = next((q.shape[0] for q in anatomy.params
                          if q.name == p.name.replace(".lora_A.", ".lora_B.")), in_f)
            k, tm, b = upcast_lora_forward(t, in_f, out_f, rank, r, i, dropout, handoff(p.name))
            kept += k + trailing
            temps += tm
            back[j] = max(back[j], b - block.transient)   # the base's input gradient comes after: not on top
        elif ".lora_A." in p.name:
            rank, in_f = p.shape
            out_f = next((q.shape[0] for q in anatomy.params
                          if q.name == p.name.replace(".lora_A.", ".lora_B.")), in_f)
            mine: list[int] = []                                  # this adapter's kept tensors, from index i
            in_bytes = quant_input_bytes(block, r, fp32_behind_quant)
            # the base linear's output: fp32 from a bitsandbytes linear reading fp32, else the matmul dtype
            out_bytes = F32 if fp32_behind_quant and in_bytes == F32 else r.mm
            pre: list[tuple[int, float]] = [(t * out_f * out_bytes, i - 0.5)]
            if r.autocast:
                if in_bytes != F32:
                    pre.append((t * in_f * F32, i - 0.4))         # x.to(fp32), until the forward returns
                if dropout > 0:                                   # fp32 dropout output, until lora_A cast it
                    temps.append((t * in_f * F32, i - 0.3, i + 1.5))
                    mine += [t * in_f * MASK, t * in_f * r.mm]
                else:
                    mine.append(t * in_f * r.mm)
            elif dropout > 0:
                mine += [t * in_f * r.mm, t * in_f * MASK]
            mine.append(t * rank * r.mm)
            if r.autocast:   # backward: lora_A's input gradient, back through the two casts (fp32, then low)
                back[j] = max(back[j], t * in_f * (2 * r.mm + F32))
            last = i + len(mine) - 1
            moved = handoff(p.name)
            if moved:                                  # the sum is the tensor a later block keeps
                mine += [moved, *trailing]
                done = last + 1.5
            else:                                      # the sum, made and handed on (the module's output)
                temps.append((t * out_f * out_bytes, last + 0.3, last + 0.5))
                done = last + 0.5
            temps += [(n, a, done) for n, a in pre]
            # lora_B's output (freed once scaled), its scaled copy (freed after the sum)
            temps += [(t * out_f * r.mm, last + 0.2, last + 0.27), (t * out_f * r.mm, last + 0.25, done)]
            kept += mine
        elif ".ia3_l." in p.name:
            out_f, in_f = p.shape
            fp32 = r.autocast or upcast                            # ia3_l fp32 over a low-precision base
            if in_f == 1:                                          # output scaling [out, 1]
                kept.append(t * out_f * r.mm)                      # base(x), kept for ia3_l's gradient
                moved = handoff(p.name)
                if fp32:                                           # the fp32 product, until cast back
                    temps.append((t * out_f * F32, i + 0.3, i + 1.5 if moved else i + 0.5))
                elif not moved:
                    temps.append((t * out_f * r.mm, i + 0.3, i + 0.5))
                if moved:
                    kept += [moved, *trailing]
                # backward: the incoming gradient (cast up to fp32), its products with ia3_l and with base(x)
                back[j] = max(back[j], 3 * t * out_f * F32 if fp32 else 2 * t * out_f * r.mm)
            else:                                                  # feed-forward input scaling [1, in]
                if fp32:
                    kept.append(t * in_f * F32)
                    temps += [(t * in_f * F32, i + 0.5, i + 0.5), (t * in_f * r.mm, i + 0.5, i + 0.5)]
                else:                                              # x * ia3_l, the base linear's input
                    temps.append((t * in_f * r.mm, i + 0.5, i + 0.5))
                # backward, after the base linear's input gradient (the block's transient): that gradient cast up
                # to fp32 (which frees it) or kept, and its products with ia3_l and with x
                back[j] = max(back[j], 3 * t * in_f * (F32 if fp32 else r.mm) - block.transient)
    blocks = tuple(Block(b.name, tuple(n for x, n in enumerate(b.tensors) if (j, x) not in taken) + tuple(k),
                         b.params, b.transient + back[j], b.for_weights, b.temps + tuple(tm))
                   for j, (b, (k, tm)) in enumerate(zip(recipe.blocks, added, strict=True)))
    return LayerRecipe(blocks, recipe.embed, recipe.head, recipe.shared, recipe.head_for_weights)


def upcast_lora_forward(t: int, in_f: int, out_f: int, rank: int, r: Regime, i: int, dropout: float, moved: int
                        ) -> tuple[list[int], list[tuple[int, float, float]], int]:
    """One LoRA-adapted linear with fp32 adapters on a pure low-precision base (peft's lora/layer.py Linear.forward:
    `x = self._cast_input_dtype(x, lora_A.weight.dtype)`, `result = result + lora_B(lora_A(dropout(x))) * scaling`,
    `result.to(torch_result_dtype)`), as (kept tensors from index i, forward temporaries, backward transient).

    Kept: the fp32 copy of the input (lora_A's input; with dropout the fp32 dropout output and its bool mask
    instead, the copy a temporary until the forward returns), lora_A's fp32 output, and `moved` (the cast-back sum,
    when a later block keeps the module's output). Temporaries, in the order the forward makes them: the base
    output (until the sum is made), lora_B's fp32 output (freed once scaled), its scaled copy (freed after the sum),
    the fp32 sum (freed once cast back) and the cast (the module's output, handed on when no block keeps it)."""
    base, wide = t * out_f * r.mm, t * out_f * F32
    copy = t * in_f * F32
    kept = [copy, t * in_f * MASK] if dropout > 0 else [copy]   # lora_A's input (the dropout's output and mask)
    kept.append(t * rank * F32)                                 # lora_B's input
    last = i + len(kept) - 1
    temps = [(base, i - 0.5, last + 0.33)]
    if dropout > 0:
        temps.append((copy, i - 0.4, last + 1.5 if moved else last + 0.6))
    temps += [(wide, last + 0.2, last + 0.27), (wide, last + 0.25, last + 0.31), (wide, last + 0.3, last + 0.4)]
    if moved:                          # the cast-back sum is the tensor a later block keeps: made at last + 1
        kept.append(moved)
        temps[-1] = (wide, last + 0.3, last + 1.5)
    else:
        temps.append((base, last + 0.35, last + 0.5))
    # backward, above what is kept: the gradient for the base output (cast to its dtype) stays while the fp32
    # gradients of the sum and of lora_B's output are made, then lora_A's fp32 input gradient (its fp32 input is
    # freed as that node runs, before the cast back and the base linear's input gradient)
    return kept, temps, t * out_f * r.mm + max(2 * wide, t * in_f * F32)


def dora_forward(t: int, in_f: int, out_f: int, rank: int, r: Regime, i: int, upcast: bool = False
                 ) -> tuple[list[int], list[tuple[int, float, float]]]:
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
    end = last + 0.9
    temps = [(in_f * in_f * ad, i + 0.2, i + 0.35 if r.autocast else end),   # eye(in) (lora_A keeps it: lowp)
             (in_f * rank * mm, i + 0.22, end),                                # lora_A(eye)
             (in_f * out_f * mm, i + 0.23, i + 0.4 if r.autocast else end),    # lora_B(...)
             (out_f * in_f * ad, i + 0.45, i + 0.7),                           # scaling * lora_weight
             (out_f * in_f * ad, i + 0.5, i + 0.7),                            # W + that
             (t * out_f * prod, last + 0.1, last + 0.6), (t * out_f * prod, last + 0.2, last + 0.4),
             (t * out_f * prod, last + 0.3, last + 0.6), (t * out_f * prod, last + 0.5, last + 0.8),
             (t * out_f * prod, last + 0.7, last + 0.95)]                      # the products and their sums
    if r.autocast:
        temps += [(t * in_f * F32, i + 0.1, end),            # x.to(fp32) for the adapter
                  (in_f * in_f * r.mm, i + 0.21, end),       # lora_A's cast of the eye, kept by the graph
                  (out_f * in_f * F32, i + 0.3, end)]        # lora_weight.to(fp32)
    if fp32:
        temps.append((out_f * in_f * F32, i + 0.4, end))     # W.to(fp32)
    if upcast:
        temps.append((t * out_f * r.mm, last + 0.9, last + 0.97))   # the sum cast back (the module's output)
    return kept, temps


def first_layer_skip(anatomy: ModelAnatomy, blocks: tuple[Block, ...]) -> int:
    """With a frozen embedding and no prompt (peft adapters in the layers), layer 0's input needs no gradient:
    autograd records nothing until the first trained parameter of layer 0 is used, so the blocks before it keep
    nothing (and their backward never runs)."""
    if anatomy.peft is None or any(p.trainable and p.layer_index is None and is_embedding(p)
                                   for p in anatomy.params):
        return 0
    owners = [block_owner(blocks, p.name) for p in anatomy.params if p.layer_index == 0 and p.trainable]
    return min(owners, default=0)

