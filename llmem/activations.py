"""Activation memory of one training step, per GPU, from the model's structure and PyTorch's kernels.

Every formula counts the tensors that autograd keeps for backward (the "saved tensors") of the HF implementation of a
decoder layer, as they are on CUDA:
- the CUDA autocast policy: matmuls (linear, addmm, bmm, baddbmm, SDPA) run in the low-precision dtype, while
  layer_norm, softmax, log_softmax, pow, nll_loss run in fp32; autocast casts each activation input of a matmul
  again for every matmul that consumes it (only leaf weights are cached), and a bf16 tensor plus an fp32 tensor
  promotes to fp32 (so under autocast the residual stream stays fp32);
- dropout is `native_dropout`: its output plus a bool mask (1 byte per element) is saved; p = 0 is a no-op;
- SDPA runs the flash / memory-efficient kernels: they save q, k, v, the output and an fp32 logsumexp (B, H, S),
  never the S x S matrix, with or without dropout; GQA runs natively (no repeated k/v) when no mask is passed;
- nn.Linear saves its input; `F.silu`/`F.gelu`/`relu`/`tanh` save their input or output as their backward needs.

Three regimes decide the dtypes:
- fp32: everything in fp32.
- lowp: parameters in bf16/fp16 (pure low precision, or FSDP's MixedPrecisionPolicy that gathers bf16 weights).
- autocast: fp32 parameters with `torch.autocast` (single GPU, DDP and TP under *-mixed precision).

Sizes are in bytes, per GPU, for one micro-batch. With tensor parallelism (no sequence parallelism) the column-
parallel outputs (heads, MLP intermediate) are split tp ways and everything else stays replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmem.anatomy import ModelAnatomy
from llmem.config import TrainingSetup

F32 = 4
MASK = 1  # CUDA dropout keeps a bool mask


@dataclass(frozen=True)
class Regime:
    name: str        # fp32 / lowp / autocast
    res: int         # bytes per element of the residual stream (embedding output dtype)
    mm: int          # bytes per element of matmul outputs

    @property
    def autocast(self) -> bool:
        return self.name == "autocast"


def regime_for(setup: TrainingSetup, method: str) -> Regime:
    if setup.precision == "fp32":
        return Regime("fp32", 4, 4)
    if setup.mixed and method not in ("fsdp", "zero2", "fsdp+tp"):
        # LoRA keeps the frozen embedding in the compute dtype, so its output - the residual stream - is too
        return Regime("autocast", setup.stored_bytes(not setup.peft), 2)
    return Regime("lowp", 2, 2)


@dataclass(frozen=True)
class Dims:
    """Per-GPU shapes of one micro-batch."""
    b: int
    s: int
    h: int
    i: int           # MLP intermediate, local to this GPU under tp
    qd: int          # query width (heads x head_dim), local under tp
    kvd: int         # key/value width, local under tp
    heads: int       # local query heads
    vocab: int
    layers: int
    tp: int
    masked: bool = False   # --packing under SDPA: a block-diagonal boolean mask [b, 1, s, s] goes to every layer
    pos_rows: int = 1      # rows of position ids (and of rotary cos/sin): b when packing, else 1 (broadcast)

    @property
    def t(self) -> int:
        return self.b * self.s


@dataclass(frozen=True)
class FusedCE:
    """llmem.losses' fused linear cross-entropy (Liger's algorithm): what it allocates, in bytes per element.

    In the forward, after the final norm: the lm_head weight cast to the compute dtype (autocast, fp32 weights),
    grad_input [t, h] in the hidden states' dtype and grad_weight [V, h] in the weight's dtype (kept for backward;
    the latter becomes the lm_head gradient, which AccumulateGrad takes over without a copy), then per chunk of
    `chunk` tokens: the chunk's hidden states cast to the compute dtype, its logits [c, V] in the compute dtype,
    their fp32 upcast (the softmax and its gradient, in place), grad_weight's fp32 copy of the chunk's hidden states
    (fp32 accumulator only), the gradient cast back to the compute dtype, and grad_input's matmul output when its
    dtype differs. No [t, V] tensor exists."""
    tokens: int
    hidden: int
    vocab: int
    hidden_bytes: int          # the final hidden states (loss input, norm output)
    mm: int                    # the compute dtype
    weight_bytes: int          # the lm_head weight as the loss reads it (gathered under FSDP)
    weight_trainable: bool
    chunk: int

    @property
    def chunk_sizes(self) -> list[int]:
        return [min(self.chunk, self.tokens - s) for s in range(0, self.tokens, self.chunk)]

    @property
    def weight_cast_bytes(self) -> int:
        return self.vocab * self.hidden * self.mm if self.weight_bytes != self.mm else 0

    @property
    def grad_input_bytes(self) -> int:
        return self.tokens * self.hidden * self.hidden_bytes

    @property
    def grad_weight_bytes(self) -> int:
        return self.vocab * self.hidden * self.weight_bytes if self.weight_trainable else 0

    def chunk_peak_bytes(self, c: int) -> int:
        """The largest sum of a chunk's own transients."""
        x = c * self.hidden * self.mm if self.hidden_bytes != self.mm else 0
        logits, upcast = c * self.vocab * self.mm, c * self.vocab * F32
        # logits and their upcast, then the upcast and the gradient cast back (as large): one fp32 tensor when fp32
        return x + (logits if self.mm == F32 else logits + upcast)

    @property
    def forward_peak_bytes(self) -> int:
        """Tensor bytes the loss adds at its peak (the hidden states included)."""
        return (self.tokens * self.hidden * self.hidden_bytes + self.weight_cast_bytes + self.grad_input_bytes
                + self.grad_weight_bytes + self.chunk_peak_bytes(self.chunk))


def fused_ce_for(anatomy: ModelAnatomy, setup: TrainingSetup, method: str, d: Dims, r: Regime) -> FusedCE:
    from llmem.errors import LlmemError
    from llmem.losses import chunk_tokens

    if _cfg(anatomy, "final_logit_softcapping", default=None):
        raise LlmemError("--fused-ce does not model final_logit_softcapping (Gemma-2)")
    head = next((p for p in anatomy.params if p.layer_index is None and (
        p.name.startswith("lm_head") or (p.tied_to or "").startswith("lm_head"))), None)
    if head is None:   # tied: the input embedding is the lm_head weight
        head = next(p for p in anatomy.params if p.layer_index is None and p.module_kind.endswith("Embedding")
                    and p.shape and p.shape[0] == anatomy.vocab_size)
    vocab, hidden = head.shape[0], head.shape[1]
    fsdp = method in ("fsdp", "zero2", "fsdp+tp")
    weight_bytes = setup.gather_bytes if fsdp else setup.stored_bytes(head.trainable)
    # the final norm's output: RMSNorm returns the stream dtype; F.layer_norm runs in fp32 under autocast
    layernorm = _FAMILIES.get(anatomy.model_type, _llama_like) is not _llama_like
    hidden_bytes = F32 if (layernorm and r.autocast) else r.res
    return FusedCE(d.t, hidden, vocab, hidden_bytes, r.mm, weight_bytes, head.trainable,
                   chunk_tokens(d.t, hidden, vocab))


@dataclass(frozen=True)
class ActivationProfile:
    """What the forward keeps, and the transient peaks around it, in bytes per GPU."""
    per_layer_saved: int       # kept for backward by one decoder layer (its input included), no checkpointing
    checkpoint_saved: int      # kept per layer under gradient checkpointing (the layer input)
    embed_saved: int           # kept by the embedding block (outside the layers)
    head_saved: int            # kept by the final norm and the lm_head input
    shared_saved: int          # shared by every layer: rotary cos/sin, attention mask
    loss_peak: int             # logits, their fp32 upcast, log-softmax and their gradients at the loss backward
    blocks: tuple[Block, ...]  # one decoder layer, forward order
    grad_ckpt: bool
    layers: int
    embed_tensors: tuple[int, ...] = ()
    head_tensors: tuple[int, ...] = ()
    mask_bytes: int = 0        # --packing under SDPA: the boolean mask, live during the forward
    shared_tensors: tuple[int, ...] = ()
    int8_kept: tuple[int, ...] = ()   # checkpointing: inputs LLM.int8 keeps per layer (in checkpoint_saved)
    ckpt_every: int = 1        # with grad_ckpt: layers whose index % ckpt_every == 0 are checkpointed
    fused_ce: FusedCE | None = None   # the fused linear cross-entropy's tensors (None: HF's loss on full logits)
    offload: bool = False      # saved tensors of the layers (not checkpointed) and the final norm on the host
    first_layer_skip: int = 0  # leading blocks of layer 0 that keep nothing (their inputs need no gradient)

    def checkpointed(self, layer: int) -> bool:
        """HF `_set_gradient_checkpointing(every_n_layers=k)`: decoder layer i is checkpointed when i % k == 0; the
        others keep all their tensors. (torchtune's selective "every k-th layer", training/activations.py 0.6,
        counts from 1 and wraps layers with (i + 1) % k == 0: the same number when k divides the depth, but the
        top layer is then checkpointed; llmem follows transformers, whose step it runs.)"""
        return self.grad_ckpt and layer % self.ckpt_every == 0

    def checkpointed_layers(self, layers: int | None = None) -> int:
        """How many of the first `layers` decoder layers are checkpointed: ceil(layers / k)."""
        n = self.layers if layers is None else layers
        return -(-n // self.ckpt_every) if self.grad_ckpt else 0

    def layers_saved(self, layers: int | None = None) -> int:
        """Bytes kept for backward by the first `layers` decoder layers at the end of the forward."""
        n = self.layers if layers is None else layers
        ck = self.checkpointed_layers(n)
        return ck * self.checkpoint_saved + (n - ck) * self.per_layer_saved

    def device_layers_saved(self, layers: int | None = None) -> int:
        """What the first `layers` decoder layers keep on the device at the end of the forward: with offloading only
        the checkpointed layers' inputs (held by the checkpoint), the rest is on the host."""
        n = self.layers if layers is None else layers
        return self.checkpointed_layers(n) * self.checkpoint_saved if self.offload else self.layers_saved(n)

    @property
    def device_outside_saved(self) -> int:
        """Embedding, head and shared tensors on the device at the end of the forward: with offloading only the
        lm_head's input (the output layer is not offloaded; the fused loss keeps none)."""
        if not self.offload:
            return self.embed_saved + self.head_saved + self.shared_saved
        return self.head_tensors[-1] if self.head_tensors and self.fused_ce is None else 0

    @property
    def offloaded_bytes(self) -> int:
        """--offload-activations: the saved tensors that leave the device in forward (one formula for the estimate's
        note and the planner): the layers not checkpointed, the embedding's, the shared rotary cos/sin and the final
        norm's; a checkpointed layer's input (held by the checkpoint) and the lm_head's input stay. Each tensor is
        counted once: autograd packs a tensor per save (a norm's fp32 input twice, a shared input per linear), so the
        pinned host copies can add up to more."""
        if not self.offload:
            return 0
        return self.saved_at_loss - self.device_layers_saved() - self.device_outside_saved

    @property
    def saved_at_loss(self) -> int:
        """Everything kept for backward when the loss backward starts (the usual activation peak)."""
        return self.embed_saved + self.layers_saved() + self.head_saved + self.shared_saved


def virtual_tokens(anatomy: ModelAnatomy) -> int:
    """Prompt tuning: peft prepends this many trained embeddings, so the model runs seq_len + n tokens (and the
    labels get n -100 entries, so the logits and the loss are over seq_len + n positions too)."""
    return anatomy.peft.num_virtual_tokens if anatomy.peft is not None else 0


def dims_for(anatomy: ModelAnatomy, setup: TrainingSetup, tp: int) -> Dims:
    return Dims(
        b=setup.batch_size, s=setup.seq_len + virtual_tokens(anatomy), h=anatomy.hidden_size,
        i=_ceil_div(anatomy.intermediate_size, tp), qd=anatomy.num_heads // tp * anatomy.head_dim,
        kvd=max(anatomy.num_kv_heads // tp, 1) * anatomy.head_dim, heads=anatomy.num_heads // tp,
        vocab=anatomy.vocab_size, layers=anatomy.num_layers, tp=tp,
        masked=setup.packing and effective_attention(anatomy, setup) == "sdpa" and setup.attn != "flash",
        pos_rows=setup.batch_size if setup.packing else 1,
    )


def has_recipe(anatomy: ModelAnatomy) -> bool:
    """Whether llmem has a recipe written for this family (others use the Llama one, with a note)."""
    return anatomy.model_type in _FAMILIES


def effective_attention(anatomy: ModelAnatomy, setup: TrainingSetup) -> str:
    """HF runs eager attention for models without an SDPA implementation (BLOOM, GPT-Neo, Gemma-2).

    flash (HF flash_attention_2) keeps what PyTorch's flash SDPA kernel keeps (q, k, v, out, logsumexp; GQA native,
    dropout regenerated from the RNG state): the sdpa recipe."""
    if setup.attn == "flash":
        if not anatomy.supports_sdpa:
            from llmem.errors import LlmemError
            raise LlmemError(f"--attn flash: transformers has no flash attention for {anatomy.model_type!r} models")
        return "sdpa"
    return setup.attn if anatomy.supports_sdpa else "eager"


def activation_notes(setup: TrainingSetup) -> list[str]:
    """What the estimate and the trace say about the activation options (both engines print them)."""
    notes = []
    if setup.attn == "flash":
        notes.append("--attn flash: the flash-attn package's kernel (HF flash_attention_2) is modelled by PyTorch's "
                     "flash SDPA kernel (the same saved tensors: q, k, v, output, logsumexp)")
    if setup.fused_ce:
        notes.append("--fused-ce: llmem's PyTorch fused linear cross-entropy (Liger-Kernel's algorithm and chunk "
                     "size; an fp32 upcast of each chunk's logits); no [tokens, vocab] logits")
    if setup.offload_activations:
        notes.append("--offload-activations: saved tensors of 1 KiB and more (parameters and their views excepted) "
                     "in pinned host memory from their layer's forward to its backward (torchtune's "
                     "OffloadActivations rules, weight views kept too); the lm_head and the loss stay on the "
                     "device; synchronous copies")
    if setup.packing:
        notes.append("--packing: position ids restart per packed sample; " + (
            "flash attention runs varlen (cu_seqlens, no mask)" if setup.attn == "flash" else
            "SDPA gets transformers' block-diagonal causal mask and keeps it as a bias per layer (no native GQA)"
            if setup.attn == "sdpa" else "eager attention's mask is [b, 1, s, s] as without packing"))
    if setup.grad_ckpt and setup.ckpt_every > 1:
        notes.append(f"checkpointing decoder layers with index % {setup.ckpt_every} == 0 (HF every_n_layers)")
    return notes


def block_owner(blocks: tuple[Block, ...], param_name: str) -> int:
    """Index of the block whose weights include this decoder-layer parameter (unmatched: the last block)."""
    inner = param_name.split(".", 1)[1] if "." in param_name else param_name
    return next((i for i, b in enumerate(blocks) if any(k in inner for k in b.params)), len(blocks) - 1)


def adapters_read_input(anatomy: ModelAnatomy, r: Regime) -> bool:
    """Whether LoRA's lora_A keeps the very tensor the base linear reads. Not under autocast: peft casts the input
    to the fp32 adapter dtype (`_cast_input_dtype`, autocast_adapter_dtype) and autocast casts that copy back for
    lora_A, which keeps its own low-precision cast; not with dropout: lora_A reads the dropout output."""
    return not r.autocast and not (anatomy.peft is not None and anatomy.peft.lora_dropout > 0)


def with_adapters(anatomy: ModelAnatomy, recipe: LayerRecipe, d: Dims, r: Regime,
                  fp32_behind_quant: bool = False) -> LayerRecipe:
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
    Applied after with_trainability: the tensors it adds are all needed.
    """
    dropout = anatomy.peft.lora_dropout if anatomy.peft is not None else 0.0
    dora = anatomy.peft is not None and anatomy.peft.use_dora
    added: list[tuple[list[int], list[tuple[int, float, float]]]] = [([], []) for _ in recipe.blocks]
    back = [0] * len(recipe.blocks)
    t = d.t
    taken: set[tuple[int, int]] = set()      # (block, tensor) made by an adapter instead (Block.outputs)

    def handoff(name: str) -> int:
        """Bytes of the later block's tensor that is this adapted linear's output (0: none); it moves here."""
        module = name.split(".lora_A.")[0].split(".ia3_l.")[0].rsplit(".", 1)[-1]
        for jb, b in enumerate(recipe.blocks):
            for m, x in b.outputs:
                if m == module and jb > j and (jb, x) not in taken:
                    taken.add((jb, x))
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
            k, tm = dora_forward(t, in_f, out_f, rank, r, i)
            kept += k
            temps += tm
            # backward of the two magnitude multiplies: the incoming gradient times base_result / lora_result
            # (for the vectors, before their sum), and the gradients of base_result and lora_result [t, out]
            back[j] = max(back[j], 3 * t * out_f * (F32 if r.autocast else r.mm))
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
                mine.append(moved)
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
            if in_f == 1:                                          # output scaling [out, 1]
                kept.append(t * out_f * r.mm)                      # base(x), kept for ia3_l's gradient
                moved = handoff(p.name)
                if r.autocast:                                     # the fp32 product, until cast back
                    temps.append((t * out_f * F32, i + 0.3, i + 1.5 if moved else i + 0.5))
                elif not moved:
                    temps.append((t * out_f * r.mm, i + 0.3, i + 0.5))
                if moved:
                    kept.append(moved)
            elif r.autocast:                                       # feed-forward input scaling [1, in]
                kept.append(t * in_f * F32)
                temps += [(t * in_f * F32, i + 0.5, i + 0.5), (t * in_f * r.mm, i + 0.5, i + 0.5)]
            else:                                                  # x * ia3_l, the base linear's input
                temps.append((t * in_f * r.mm, i + 0.5, i + 0.5))
    blocks = tuple(Block(b.name, tuple(n for x, n in enumerate(b.tensors) if (j, x) not in taken) + tuple(k),
                         b.params, b.transient + back[j], b.for_weights, b.temps + tuple(tm))
                   for j, (b, (k, tm)) in enumerate(zip(recipe.blocks, added, strict=True)))
    return LayerRecipe(blocks, recipe.embed, recipe.head, recipe.shared, recipe.head_for_weights)


def dora_forward(t: int, in_f: int, out_f: int, rank: int, r: Regime, i: int
                 ) -> tuple[list[int], list[tuple[int, float, float]]]:
    """One DoRA-adapted linear in training (peft's lora/dora.py DoraLinearLayer.forward, no dropout), as (kept
    tensors, forward temporaries at positions from i, the index of its first kept tensor).

    lora_weight = lora_B(lora_A(eye(in))).T, cast to x's dtype; ||W + scaling * lora_weight|| per output row with
    W cast to x's dtype: [in, in] and [out, in] temporaries per forward, the eye's cast and lora_A's output held by
    lora_weight's graph until the forward returns. Then (m / norm - 1) * base_result + (m / norm) * lora_result *
    scaling: the two multiplies keep base_result and lora_result [t, out] (and [out] vectors); their products are
    fp32 under autocast (the magnitude is fp32). Under autocast x is peft's fp32 copy of the input, cast again for
    lora_A (kept); otherwise lora_A keeps x itself (the base linear's input)."""
    ad = F32 if r.autocast else r.mm          # x's dtype inside the adapter (the adapter dtype)
    prod = F32 if r.autocast else r.mm        # the magnitude products
    kept = [t * out_f * r.mm]                 # base_result, kept by (m / norm - 1) * base_result
    if r.autocast:
        kept.append(t * in_f * r.mm)          # lora_A's cast of the fp32 copy
    kept += [t * rank * r.mm, t * out_f * r.mm, 3 * out_f * F32]   # lora_B's input, lora_result, the vectors
    last = i + len(kept) - 1                  # the products follow the last kept tensor
    end = last + 0.9
    temps = [(in_f * in_f * ad, i + 0.2, i + 0.35 if r.autocast else end),   # eye(in) (lora_A keeps it: lowp)
             (in_f * rank * r.mm, i + 0.22, end),                              # lora_A(eye)
             (in_f * out_f * r.mm, i + 0.23, i + 0.4 if r.autocast else end),  # lora_B(...)
             (out_f * in_f * ad, i + 0.45, i + 0.7),                           # scaling * lora_weight
             (out_f * in_f * ad, i + 0.5, i + 0.7),                            # W + that
             (t * out_f * prod, last + 0.1, last + 0.6), (t * out_f * prod, last + 0.2, last + 0.4),
             (t * out_f * prod, last + 0.3, last + 0.6), (t * out_f * prod, last + 0.5, last + 0.8),
             (t * out_f * prod, last + 0.7, last + 0.95)]                      # the products and their sums
    if r.autocast:
        temps += [(t * in_f * F32, i + 0.1, end),            # x.to(fp32) for the adapter
                  (in_f * in_f * r.mm, i + 0.21, end),       # lora_A's cast of the eye, kept by the graph
                  (out_f * in_f * F32, i + 0.3, end),        # lora_weight.to(fp32)
                  (out_f * in_f * F32, i + 0.4, end)]        # W.to(fp32)
    return kept, temps


def activation_profile(anatomy: ModelAnatomy, setup: TrainingSetup, method: str, tp: int) -> ActivationProfile:
    regime = regime_for(setup, method)
    d = dims_for(anatomy, setup, tp)
    attn = effective_attention(anatomy, setup)
    family = _FAMILIES.get(anatomy.model_type, _llama_like)
    recipe = family(anatomy, d, regime, attn)
    # bitsandbytes' linears return their input's dtype: behind prepare_model_for_kbit_training's fp32 norms, under
    # autocast, the MLP's gate/up outputs (and what silu and the product keep) are fp32, not the compute dtype
    fp32_behind_quant = setup.quant_base != "none" and regime.autocast and regime.res == F32
    if fp32_behind_quant:
        recipe = with_fp32_mlp(recipe, d)
    fused = fused_ce_for(anatomy, setup, method, d, regime) if setup.fused_ce else None
    if fused is not None:   # the lm_head's input (the recipe's last head tensor) is not kept: the loss keeps grads
        last = len(recipe.head) - 1
        recipe = LayerRecipe(recipe.blocks, recipe.embed, recipe.head[:last], recipe.shared,
                             tuple(tag for tag in recipe.head_for_weights if tag[0] < last))
    exact = anatomy.peft is None or anatomy.peft.exact
    if any(not p.trainable for p in anatomy.params):
        recipe = with_trainability(anatomy, recipe, adapters_read_input(anatomy, regime), frozen_base=not exact,
                                   quant_base="none" if fp32_behind_quant else setup.quant_base)
    if exact and any(".lora_A." in p.name or ".ia3_l." in p.name for p in anatomy.params):
        recipe = with_adapters(anatomy, recipe, d, regime, fp32_behind_quant)
    int8_kept: Sizes = ()
    if setup.quant_base == "int8":
        int8_kept = int8_inputs_kept(anatomy, recipe.blocks, d.t, regime, fp32_behind_quant)
        if fp32_behind_quant and (not setup.grad_ckpt or setup.ckpt_every > 1):   # fp32 inputs only LLM.int8 keeps
            recipe = with_int8_inputs(anatomy, recipe, d.t, regime)
    return ActivationProfile(
        first_layer_skip=first_layer_skip(anatomy, recipe.blocks),
        per_layer_saved=sum(b.saved for b in recipe.blocks),
        checkpoint_saved=d.t * d.h * regime.res + sum(int8_kept),
        int8_kept=int8_kept,
        embed_saved=sum(recipe.embed), head_saved=sum(recipe.head), shared_saved=sum(recipe.shared),
        embed_tensors=recipe.embed, head_tensors=recipe.head, shared_tensors=recipe.shared,
        loss_peak=(fused.grad_input_bytes + fused.grad_weight_bytes if fused is not None else
                   loss_peak_bytes(d) + (d.t * d.vocab * regime.mm if _cfg(anatomy, "final_logit_softcapping",
                                                                           default=None) else 0)),
        blocks=recipe.blocks,
        grad_ckpt=setup.grad_ckpt, layers=d.layers, ckpt_every=setup.ckpt_every, fused_ce=fused,
        offload=setup.offload_activations, mask_bytes=packed_mask_bytes(d),
    )


def first_layer_skip(anatomy: ModelAnatomy, blocks: tuple[Block, ...]) -> int:
    """With a frozen embedding and no prompt (peft adapters in the layers), layer 0's input needs no gradient:
    autograd records nothing until the first trained parameter of layer 0 is used, so the blocks before it keep
    nothing (and their backward never runs)."""
    if anatomy.peft is None or any(p.trainable and p.layer_index is None and p.module_kind.endswith("Embedding")
                                   for p in anatomy.params):
        return 0
    owners = [block_owner(blocks, p.name) for p in anatomy.params if p.layer_index == 0 and p.trainable]
    return min(owners, default=0)


# ---------------------------------------------------------------------------------------------------------------
# Building blocks. Each returns bytes kept for backward; `t` = tokens (batch x sequence) of the micro-batch.

def loss_peak_bytes(d: Dims) -> int:
    """HF's ForCausalLMLoss: logits.float() -> cross_entropy = log_softmax + nll_loss.

    At the nll_loss backward three fp32 [tokens, vocab] tensors are live at once: the saved log-softmax output,
    nll_loss's gradient (zeros + scatter) and log_softmax's input gradient. The logits themselves are dropped with
    the model output before backward (as HF Trainer does), so they do not add here. Logits are full-vocab under
    tensor parallelism (the lm_head output is gathered).
    """
    return 3 * F32 * d.t * d.vocab


Sizes = tuple[int, ...]   # the byte sizes of individual tensors


def norm_saved(kind: str, r: Regime, t: int, h: int) -> tuple[Sizes, int]:
    """(tensors kept, bytes of its output) for a norm whose input is the residual stream.

    layernorm (F.layer_norm; fp32 under autocast): saves its input, mean and rstd (fp32 [t]); output in residual
    dtype (fp32 under autocast).
    rmsnorm (HF Llama): x.to(fp32); x * rsqrt(mean(x^2) + eps); weight * y.to(input dtype). Saves the fp32 input
    (a copy when the stream is low precision), rsqrt (fp32 [t]), the normalised tensor in the stream dtype.
    rmsnorm_gemma: x.float() normalised in fp32 then * (1 + w) in fp32, cast back: saves the fp32 input, rsqrt,
    the fp32 normalised tensor.
    Output size is returned so the caller can count who keeps it (the next linears).
    """
    stream_in: Sizes = (t * h * r.res,)
    if kind == "layernorm":
        if r.autocast:     # autocast runs layer_norm in fp32: it keeps an fp32 copy
            stream_in = (t * h * F32,)
        out_bytes = F32 if r.autocast else r.res
        return stream_in + (F32 * t, F32 * t), t * h * out_bytes
    if kind == "rmsnorm":
        if r.res == F32:   # .to(fp32) is a no-op: pow keeps the input itself; weight*n keeps n (fp32)
            return stream_in + (F32 * t, F32 * t * h), t * h * F32
        return (F32 * t * h, F32 * t, r.res * t * h), t * h * r.res
    if kind == "rmsnorm_gemma":
        if r.res == F32:
            return stream_in + (F32 * t, F32 * t * h), t * h * F32
        return (F32 * t * h, F32 * t, F32 * t * h), t * h * r.res
    raise ValueError(kind)


def linear_inputs_saved(r: Regime, t: int, width: int, consumers: int, out_of_norm_bytes: int) -> Sizes:
    """Tensors kept for the inputs of `consumers` linears that read one tensor of [t, width].

    fp32/lowp: the tensor itself is kept once. Autocast: each linear keeps its own low-precision cast of an fp32
    input (activations are not in autocast's cache); a low-precision input is kept once.
    """
    if r.autocast and out_of_norm_bytes // max(t * width, 1) == F32:
        return (t * width * r.mm,) * consumers
    return (out_of_norm_bytes,)


def dropout_saved(p: float, elements: int) -> Sizes:
    return (MASK * elements,) if p > 0 else ()


def sdpa_saved(r: Regime, d: Dims, q_kept: Sizes, k_kept: Sizes, v_kept: Sizes) -> Sizes:
    """Flash / memory-efficient SDPA: q, k, v (as passed, low precision under autocast), the output, fp32 lse; with
    a packed mask also the additive bias (sdp::convert_boolean_attn_mask, [b, 1, s, s] in the compute dtype, kept by
    the efficient / cuDNN kernel for its backward)."""
    out = d.t * d.qd * r.mm
    lse = F32 * d.b * d.heads * d.s
    return q_kept + k_kept + v_kept + (out, lse) + packed_bias_saved(r, d)


def packed_bias_saved(r: Regime, d: Dims) -> Sizes:
    """--packing under SDPA: transformers passes the block-diagonal causal mask of the packed samples (bool
    [b, 1, s, s]); SDPA converts it to an additive bias in the compute dtype per layer, which its kernel keeps."""
    return (d.b * d.s * d.s * r.mm,) if d.masked else ()


def packed_mask_bytes(d: Dims) -> int:
    """The boolean block-diagonal mask the model builds once per forward (freed with the model's forward)."""
    return d.b * d.s * d.s if d.masked else 0


def eager_attention_saved(r: Regime, d: Dims, dropout_p: float, repeat_kv: bool, softmax_fp32: bool) -> Sizes:
    """Eager attention: matmul(q, k^T) -> (+mask) -> softmax -> [cast] -> dropout -> matmul(p, v) -> contiguous.

    Saved: q and k (low precision), the softmax output (fp32 when softmax runs in fp32), its cast back to the
    value dtype, the dropout mask (bool) and output, v, and the merged-heads copy that o_proj keeps.
    """
    scores = d.b * d.heads * d.s * d.s
    softmax_bytes = F32 if (softmax_fp32 or r.autocast or r.mm == F32) else r.mm
    kept: Sizes = (scores * softmax_bytes,)
    if softmax_bytes != r.mm:
        kept += (scores * r.mm,)                    # .to(value dtype)
    if dropout_p > 0:
        kept += (scores * MASK, scores * r.mm)      # native_dropout output is what matmul(p, v) keeps
    qk = (d.t * d.qd * r.mm,) * 2 if repeat_kv else (d.t * d.qd * r.mm, d.t * d.kvd * r.mm)
    v = d.t * (d.qd if repeat_kv else d.kvd) * r.mm
    merged = d.t * d.qd * r.mm
    return kept + qk + (v, merged)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _cfg(anatomy: ModelAnatomy, *names: str, default=0.0):
    for n in names:
        v = anatomy.config.get(n)
        if v is not None:
            return v
    return default


# ---------------------------------------------------------------------------------------------------------------
# Families. Each describes one decoder layer as blocks in forward order, plus what the embedding block, the final
# norm and lm_head input, and the tensors shared by all layers keep.

@dataclass(frozen=True)
class Block:
    """A stretch of a decoder layer: what it keeps for backward, whose weights it owns, its backward transient."""
    name: str
    tensors: Sizes                 # the tensors it keeps for backward, in allocation order
    params: tuple[str, ...] = ()   # substrings of the parameter names (within a layer) this block owns
    transient: int = 0             # largest extra memory while its backward runs (input gradients, temporaries)
    # tensors kept only for some weights' gradients: (index in tensors, the modules whose weights need it, whether
    # it is one linear's own autocast cast). A frozen weight's op keeps only what the input gradient needs.
    for_weights: tuple[tuple[int, tuple[str, ...], bool], ...] = ()
    # forward temporaries: (bytes, allocated before tensors[i], freed before tensors[j]; j = len(tensors): at the
    # block's end). Only peft's adapters set them (their casts and products live next to the kept tensors).
    temps: tuple[tuple[int, float, float], ...] = ()
    # tensors that are a linear's output as it is (module name, index in tensors): a peft adapter on that linear
    # makes this tensor itself (its sum), so with_adapters moves it to the adapter, where it is made
    outputs: tuple[tuple[str, int], ...] = ()

    @property
    def saved(self) -> int:
        return sum(self.tensors)


@dataclass(frozen=True)
class LayerRecipe:
    blocks: tuple[Block, ...]
    embed: Sizes
    head: Sizes
    shared: Sizes
    head_for_weights: tuple[tuple[int, tuple[str, ...], bool], ...] = ()


def _norm_block(name: str, kind: str, r: Regime, t: int, h: int, params: tuple[str, ...]) -> tuple[Block, int]:
    kept, out = norm_saved(kind, r, t, h)
    transient = t * h * (2 * F32 if kind.startswith("rmsnorm") else r.res)
    # HF RMSNorm's `weight * normalised`: the normalised tensor (last) is kept for the weight's gradient only
    for_weights = ((len(kept) - 1, params, False),) if kind.startswith("rmsnorm") else ()
    return Block(name, kept, params, transient, for_weights), out


def _proj_block(name: str, r: Regime, t: int, width: int, consumers: int, source_bytes: int,
                params: tuple[str, ...], readers: tuple[str, ...] | None = None) -> Block:
    """The inputs that `consumers` linears (named `readers`, default `params`) keep for their weight gradients."""
    tensors = linear_inputs_saved(r, t, width, consumers, source_bytes)
    readers = readers or params
    if len(tensors) == consumers and consumers > 1:          # one autocast cast per linear
        for_weights = tuple((i, (readers[i],), True) for i in range(consumers))
    else:                                                     # one tensor: the source itself, or one linear's cast
        for_weights = ((0, readers, tensors[0] != source_bytes),)
    return Block(name, tensors, params, consumers * t * width * r.mm, for_weights)


def with_trainability(anatomy: ModelAnatomy, recipe: LayerRecipe, adapters_read: bool = True,
                      frozen_base: bool = False, quant_base: str = "none") -> LayerRecipe:
    """Drop the tensors kept only for gradients of weights that are frozen (peft's base). A shared input still
    stays when an adapter reads it itself (`adapters_read`: LoRA's lora_A outside autocast and without dropout; IA3
    on a feed-forward input outside autocast); an autocast cast of it does not. `frozen_base`: no exact model of
    the adapters, activations as for the frozen base alone. bitsandbytes' MatMul8bitLt keeps its input
    (ctx.tensors) even for a frozen int8 weight."""
    from llmem.quant import is_quantised

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


_NORM_FED = ("qkv_proj", "gate_up_proj", "c_attn", "c_fc", "fc1", "query_key_value", "dense_h_to_4h",
             "qkv_and_fc_in")


def quant_input_bytes(block: Block, r: Regime, fp32_behind_quant: bool) -> int:
    """Bytes per element of the input a block's linears read: a norm's output (the residual dtype), the MLP
    product (fp32 behind bitsandbytes' fp32 outputs), else a matmul output."""
    if block.name in _NORM_FED:
        return r.res
    if block.name in ("down_proj", "mlp_out", "fc2", "dense_4h_to_h") and fp32_behind_quant:
        return F32
    return r.mm


def int8_inputs_kept(anatomy: ModelAnatomy, blocks: tuple[Block, ...], t: int, r: Regime,
                     fp32_behind_quant: bool = False) -> Sizes:
    """Bytes of one layer's inputs that bitsandbytes' MatMul8bitLt keeps as a ctx attribute (ctx.tensors), which
    non-reentrant checkpointing cannot drop: one per block of int8 linears (linears of one block share it)."""
    from llmem.quant import is_quantised

    per_block: dict[int, int] = {}
    for p in anatomy.params:
        if p.layer_index == 0 and is_quantised(p, "int8"):
            i = block_owner(blocks, p.name)
            in_features = p.shape[0] if p.module_kind == "Conv1D" else p.shape[1]
            size = t * in_features * quant_input_bytes(blocks[i], r, fp32_behind_quant)
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
    return LayerRecipe(tuple(blocks), recipe.embed, recipe.head, recipe.shared, recipe.head_for_weights)


def with_int8_inputs(anatomy: ModelAnatomy, recipe: LayerRecipe, t: int, r: Regime) -> LayerRecipe:
    """The fp32 inputs MatMul8bitLt keeps (ctx.tensors) behind fp32 norms and the fp32 MLP product: nothing else
    keeps them (lora_A keeps its own cast). The attention output o_proj reads is SDPA's, already kept."""
    kept = dict.fromkeys(range(len(recipe.blocks)), 0)
    from llmem.quant import is_quantised

    for p in anatomy.params:
        if p.layer_index == 0 and is_quantised(p, "int8"):
            i = block_owner(recipe.blocks, p.name)
            if quant_input_bytes(recipe.blocks[i], r, True) == F32:
                in_features = p.shape[0] if p.module_kind == "Conv1D" else p.shape[1]
                kept[i] = max(kept[i], t * in_features * F32)
    blocks = tuple(replace(b, tensors=b.tensors + ((kept[i],) if kept[i] else ()), for_weights=())
                   for i, b in enumerate(recipe.blocks))
    return LayerRecipe(blocks, recipe.embed, recipe.head, recipe.shared, recipe.head_for_weights)


def _llama_like(a: ModelAnatomy, d: Dims, r: Regime, attn: str) -> LayerRecipe:
    """Llama, Mistral, Qwen2, Phi-3, Mixtral, Gemma-2: RMSNorm, RoPE, SwiGLU / GeGLU gated MLP, no dropout."""
    t = d.t
    norm = "rmsnorm_gemma" if a.model_type == "gemma2" else "rmsnorm"
    fused = a.model_type == "phi3"
    n1, out1 = _norm_block("input_norm", norm, r, t, d.h, ("input_layernorm",))
    qkv = _proj_block("qkv_proj", r, t, d.h, 1 if fused else 3, out1, ("q_proj", "k_proj", "v_proj", "qkv_proj"),
                      ("qkv_proj",) if fused else ("q_proj", "k_proj", "v_proj"))
    # RoPE makes new q, k (fp32 under autocast: cos/sin follow the fp32 stream); SDPA/eager keep casts of them
    core: Sizes = (t * (d.qd + d.kvd) * r.mm,) if fused else ()   # phi3: v is a view of the fused qkv, kept
    if attn == "sdpa":
        kv = d.qd if d.masked else d.kvd    # a mask turns GQA off: repeat_kv's copies are what SDPA keeps
        core += sdpa_saved(r, d, (t * d.qd * r.mm,), (t * kv * r.mm,), (t * kv * r.mm,))
        core_transient = t * (d.qd + 2 * d.kvd) * r.mm
    else:
        p_attn = float(_cfg(a, "attention_dropout"))
        core += eager_attention_saved(r, d, p_attn, repeat_kv=d.kvd != d.qd, softmax_fp32=True)
        if _cfg(a, "attn_logit_softcapping", default=None):   # tanh(scores / cap) keeps its output
            core += (d.b * d.heads * d.s * d.s * r.mm,)
        core_transient = 2 * d.b * d.heads * d.s * d.s * F32
    # SDPA keeps v_proj's output as is (not behind a mask with GQA: then it keeps repeat_kv's copy)
    v_out = (("v_proj", 2),) if attn == "sdpa" and not fused and not (d.masked and d.kvd != d.qd) else ()
    blocks = [n1, qkv, Block("attention", core, (), core_transient, outputs=v_out),
              Block("o_proj", (), ("o_proj",), t * d.qd * r.mm)]
    if a.model_type == "gemma2":  # post-attention and post-feedforward norms
        post, _ = _norm_block("post_norms", norm, r, t, d.h, ("post_attention_layernorm", "post_feedforward"))
        blocks.append(Block(post.name, post.tensors * 2, post.params, post.transient))
    n2, out2 = _norm_block("mlp_norm", norm, r, t, d.h, ("post_attention_layernorm", "pre_feedforward_layernorm"))
    if a.model_type == "gemma2":
        n2 = Block(n2.name, n2.tensors, ("pre_feedforward_layernorm",), n2.transient)
    blocks.append(n2)
    blocks.append(_proj_block("gate_up_proj", r, t, d.h, 1 if fused else 2, out2,
                              ("gate_proj", "up_proj", "gate_up_proj", "w1", "w3", "gate.weight"),
                              ("gate_up_proj",) if fused else ("gate_proj", "up_proj")))
    experts = int(_cfg(a, "num_experts_per_tok", default=1)) if a.model_type == "mixtral" else 1
    mlp: Sizes = (t * d.i * r.mm * experts,) * 4       # gate, act(gate), up, act * up
    if a.model_type == "mixtral":                       # router logits and softmax
        mlp += (t * int(_cfg(a, "num_local_experts", default=8)) * F32,) * 2
    # gate (silu's input), act and up (the product's inputs), act * up (down_proj's input, for its weight only)
    gate_up_out = (("gate_proj", 0), ("up_proj", 2)) if not fused and experts == 1 else ()
    blocks.append(Block("mlp_act", mlp, (), 3 * t * d.i * r.mm * experts, ((3, ("down_proj",), False),),
                        outputs=gate_up_out))
    blocks.append(Block("down_proj", (), ("down_proj", "w2", "experts"), t * d.i * r.mm))
    head_kept, head_out = norm_saved(norm, r, t, d.h)
    head = head_kept + linear_inputs_saved(r, t, d.h, 1, head_out)
    head_tags = ((len(head_kept) - 1, ("norm",), False), (len(head) - 1, ("lm_head",), r.autocast))
    # the embedding output is layer 0's input, counted there (fp32) or copied to fp32 there (lowp)
    return LayerRecipe(tuple(blocks), (), head, (d.pos_rows * d.s * a.head_dim * r.res,) * 2, head_tags)


def _gpt2(a: ModelAnatomy, d: Dims, r: Regime, attn: str) -> LayerRecipe:
    """GPT-2, GPT-BigCode, GPT-Neo: LayerNorm, fused c_attn (GPT-Neo: q/k/v), dropouts, gelu_new MLP."""
    t = d.t
    p_resid = float(_cfg(a, "resid_pdrop", "resid_dropout"))
    p_attn = float(_cfg(a, "attn_pdrop", "attention_dropout"))
    p_embd = float(_cfg(a, "embd_pdrop", "embed_dropout"))
    separate_qkv = a.model_type == "gpt_neo"
    n1, out1 = _norm_block("ln_1", "layernorm", r, t, d.h, ("ln_1",))
    proj = _proj_block("c_attn", r, t, d.h, 3 if separate_qkv else 1, out1,
                       ("attn.c_attn", "q_attn", "attention.q_proj", "attention.k_proj", "attention.v_proj"))
    qkv = t * (d.qd + 2 * d.kvd) * r.mm           # q, k, v (views of one c_attn output, kept whole)
    if attn == "sdpa":
        core: Sizes = (qkv, t * d.qd * r.mm, F32 * d.b * d.heads * d.s) + packed_bias_saved(r, d)
    else:
        core = eager_attention_saved(r, d, p_attn, repeat_kv=False, softmax_fp32=separate_qkv)
    core += dropout_saved(p_resid, t * d.h)
    n2, out2 = _norm_block("ln_2", "layernorm", r, t, d.h, ("ln_2",))
    blocks = (n1, proj, Block("attention", core, (), t * (d.qd + 2 * d.kvd) * r.mm),
              Block("attn_out", (), ("attn.c_proj", "attention.out_proj"), t * d.qd * r.mm),
              n2, _proj_block("c_fc", r, t, d.h, 1, out2, ("mlp.c_fc",)),
              Block("mlp_act", _mlp_act_saved(a, r, t * d.i) + dropout_saved(p_resid, t * d.h), (),
                    2 * t * d.i * (F32 if r.autocast else r.mm), _mlp_out_tag(a, r, ("mlp.c_proj",))),
              Block("mlp_out", (), ("mlp.c_proj",), t * d.i * r.mm))
    head, head_tags = _layernorm_head(r, t, d.h)
    return LayerRecipe(blocks, dropout_saved(p_embd, t * d.h), head, (), head_tags)


def _opt(a: ModelAnatomy, d: Dims, r: Regime, attn: str) -> LayerRecipe:
    """OPT and BioGPT: LayerNorm (pre-LN), separate q/k/v, dropout on residual branches, ReLU/GELU MLP."""
    t = d.t
    p = float(_cfg(a, "dropout", "hidden_dropout_prob"))
    p_attn = float(_cfg(a, "attention_dropout", "attention_probs_dropout_prob"))
    n1, out1 = _norm_block("attn_norm", "layernorm", r, t, d.h, ("self_attn_layer_norm",))
    if attn == "sdpa":
        core = sdpa_saved(r, d, (t * d.qd * r.mm,), (t * d.kvd * r.mm,), (t * d.kvd * r.mm,))
    else:
        core = eager_attention_saved(r, d, p_attn, repeat_kv=False, softmax_fp32=False)
    core += dropout_saved(p, t * d.h)
    n2, out2 = _norm_block("mlp_norm", "layernorm", r, t, d.h, ("final_layer_norm",))
    blocks = (n1, _proj_block("qkv_proj", r, t, d.h, 3, out1, ("q_proj", "k_proj", "v_proj")),
              Block("attention", core, (), 3 * t * d.qd * r.mm),
              Block("out_proj", (), ("out_proj",), t * d.qd * r.mm),
              n2, _proj_block("fc1", r, t, d.h, 1, out2, ("fc1",)),
              Block("mlp_act", _mlp_act_saved(a, r, t * d.i) + dropout_saved(p, t * d.h), (), t * d.i * r.mm,
                    _mlp_out_tag(a, r, ("fc2",))),
              Block("fc2", (), ("fc2",), t * d.i * r.mm))
    head, head_tags = _layernorm_head(r, t, d.h)
    return LayerRecipe(blocks, dropout_saved(p, t * d.h), head, (), head_tags)


def _bloom(a: ModelAnatomy, d: Dims, r: Regime, attn: str) -> LayerRecipe:
    """BLOOM: LayerNorm, fused query_key_value, ALiBi baddbmm eager attention, custom GeLU autograd function."""
    t = d.t
    p = float(_cfg(a, "hidden_dropout"))
    p_attn = float(_cfg(a, "attention_dropout"))
    n1, out1 = _norm_block("input_norm", "layernorm", r, t, d.h, ("input_layernorm",))
    core = eager_attention_saved(r, d, p_attn, repeat_kv=False, softmax_fp32=True)
    core += dropout_saved(p, t * d.h)
    n2, out2 = _norm_block("mlp_norm", "layernorm", r, t, d.h, ("post_attention_layernorm",))
    blocks = (n1, _proj_block("query_key_value", r, t, d.h, 1, out1, ("query_key_value",)),
              Block("attention", core, (), 2 * d.b * d.heads * d.s * d.s * F32),
              Block("dense", (), ("self_attention.dense",), t * d.qd * r.mm),
              n2, _proj_block("dense_h_to_4h", r, t, d.h, 1, out2, ("dense_h_to_4h",)),
              # GeLUFunction keeps its input; dense_4h_to_h keeps the output
              Block("gelu", (t * d.i * r.mm,) * 2 + dropout_saved(p, t * d.h), (), 5 * t * d.i * r.mm,
                    ((1, ("dense_4h_to_h",), False),)),
              Block("dense_4h_to_h", (), ("dense_4h_to_h",), t * d.i * r.mm))
    embed_norm, _ = norm_saved("layernorm", r, t, d.h)  # word_embeddings_layernorm
    head, head_tags = _layernorm_head(r, t, d.h)
    return LayerRecipe(blocks, embed_norm, head, (d.b * d.heads * d.s * r.res,), head_tags)   # shared: alibi


def _layernorm_head(r: Regime, t: int, h: int) -> tuple[Sizes, tuple]:
    """Final LayerNorm (input, mean, rstd) and the lm_head's input, which only the lm_head weight needs."""
    head_kept, head_out = norm_saved("layernorm", r, t, h)
    head = head_kept + linear_inputs_saved(r, t, h, 1, head_out)
    return head, ((len(head) - 1, ("lm_head",), head[-1] != head_out),)


def _mlp_out_tag(a: ModelAnatomy, r: Regime, out_linear: tuple[str, ...]) -> tuple:
    """The MLP activation's output, kept by the output linear for its weight gradient only (relu keeps its own
    output for its backward, so nothing to drop there)."""
    act = str(_cfg(a, "activation_function", "hidden_act", "activation", default="gelu_new"))
    if act == "relu":
        return ()
    index = 4 if act == "gelu_new" else 1
    return ((index, out_linear, act == "gelu_new" and r.autocast),)


def _mlp_act_saved(a: ModelAnatomy, r: Regime, n: int) -> Sizes:
    """Bytes kept by the MLP activation of n = tokens x intermediate elements (fc output to fc2 input).

    gelu_new (GPT-2, CodeGen, GPT-Neo): the python tanh formula keeps x (fp32 under autocast: pow upcasts),
    tanh's output, 1 + tanh, 0.5 * x and the product (cast for c_proj under autocast).
    gelu / gelu_pytorch_tanh (F.gelu): keeps its input; the output is kept by the next linear.
    relu: keeps its output, which is also the next linear's input.
    """
    act = str(_cfg(a, "activation_function", "hidden_act", "activation", default="gelu_new"))
    if act == "gelu_new":
        if r.autocast:
            return (n * F32, n * F32, n * F32, n * r.mm, n * r.mm)
        return (n * r.mm,) * 5
    if act == "relu":
        return (n * r.mm,)
    return (n * r.mm,) * 2


def _parallel_block(a: ModelAnatomy, d: Dims, r: Regime, attn: str) -> LayerRecipe:
    """Falcon (7B: multi-query, parallel attention + MLP from one LayerNorm) and CodeGen (GPT-J style).

    One LayerNorm feeds both the fused qkv projection and the MLP. Falcon with one kv head cannot use the flash /
    memory-efficient kernels (head counts differ), so SDPA takes the math path and keeps the S x S softmax.
    CodeGen splits its fused qkv with a reshape that copies q, k and v; gelu_new as in GPT-2.
    """
    t = d.t
    n1, out1 = _norm_block("input_norm", "layernorm", r, t, d.h, ("input_layernorm", "ln_1"))
    proj = _proj_block("qkv_and_fc_in", r, t, d.h, 2, out1,
                       ("query_key_value", "qkv_proj", "dense_h_to_4h", "fc_in"))
    if a.model_type == "falcon":
        core: Sizes = (t * (d.qd + 2 * d.kvd) * r.mm, t * d.qd * r.mm, t * d.kvd * r.mm)  # fused qkv, roped q, k
        core += (d.b * d.heads * d.s * d.s * r.mm, t * d.qd * r.mm, t * d.qd * r.mm)      # softmax, out, merged
        mlp: Sizes = (t * d.i * r.mm,) * 2                                                 # F.gelu in, fc2 in
    else:
        if attn == "sdpa":                                                    # q, k (roped), v copies, out, lse
            core = (t * d.qd * r.mm,) * 4 + (F32 * d.b * d.heads * d.s,) + packed_bias_saved(r, d)
        else:
            core = (t * d.qd * r.mm,) + eager_attention_saved(r, d, 0.0, repeat_kv=False, softmax_fp32=True)
        mlp = _mlp_act_saved(a, r, t * d.i)
    blocks = (n1, proj, Block("attention", core, (), 3 * t * d.qd * r.mm),
              Block("attn_out", (), ("self_attention.dense", "out_proj"), t * d.qd * r.mm),
              Block("mlp_act", mlp, (), 3 * t * d.i * r.mm,
                    ((len(mlp) - 1, ("dense_4h_to_h", "fc_out"), r.autocast and a.model_type != "falcon"),)),
              Block("mlp_out", (), ("dense_4h_to_h", "fc_out"), t * d.i * r.mm))
    head, head_tags = _layernorm_head(r, t, d.h)
    return LayerRecipe(blocks, (), head, (d.pos_rows * d.s * a.head_dim * r.res,) * 2, head_tags)


_FAMILIES = {
    "llama": _llama_like, "mistral": _llama_like, "qwen2": _llama_like, "phi3": _llama_like,
    "mixtral": _llama_like, "gemma2": _llama_like,
    "gpt2": _gpt2, "gpt_bigcode": _gpt2, "gpt_neo": _gpt2,
    "opt": _opt, "biogpt": _opt,
    "bloom": _bloom, "falcon": _parallel_block, "codegen": _parallel_block,
}
