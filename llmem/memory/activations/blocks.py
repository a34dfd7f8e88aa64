"""The building blocks of activation recipes: the shapes of one micro-batch, a block of a decoder layer (what it
keeps for backward, whose weights it owns, its backward transient), and what each kind of op keeps.

Every formula counts the tensors that autograd keeps for backward (the "saved tensors") of the HF implementation,
as they are on CUDA:
- the CUDA autocast policy: matmuls (linear, addmm, bmm, baddbmm, SDPA) run in the low-precision dtype, while
  layer_norm, softmax, log_softmax, pow, nll_loss run in fp32; autocast casts each activation input of a matmul
  again for every matmul that consumes it (only leaf weights are cached), and a bf16 tensor plus an fp32 tensor
  promotes to fp32 (so under autocast the residual stream stays fp32);
- dropout is `native_dropout`: its output plus a bool mask (1 byte per element) is saved; p = 0 is a no-op;
- SDPA runs the flash / memory-efficient kernels: they save q, k, v, the output and an fp32 logsumexp (B, H, S),
  never the S x S matrix, with or without dropout; GQA runs natively (no repeated k/v) when no mask is passed;
- nn.Linear saves its input; `F.silu`/`F.gelu`/`relu`/`tanh` save their input or output as their backward needs.

Sizes are in bytes, per GPU, for one micro-batch; `t` = tokens (batch x sequence). With tensor parallelism (no
sequence parallelism) the column-parallel outputs (heads, MLP intermediate) are split tp ways and everything else
stays replicated. Under --sequence-parallel (torchtitan's plan) the residual stream and the norms hold `ts` = the
sequence shard's tokens, the linears after a norm keep its all-gathered [t, h] output; under --loss-parallel the
logits and the loss are [t, vocab / tp].
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.model.anatomy import ModelAnatomy
from llmem.setup.precision import F32, Regime

MASK = 1  # CUDA dropout keeps a bool mask

Sizes = tuple[int, ...]   # the byte sizes of individual tensors


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
    seq_shards: int = 1    # --sequence-parallel: the residual stream and the norms sharded tp ways on the sequence
    vocab_shards: int = 1  # --loss-parallel: the logits and the loss sharded tp ways on the vocabulary

    @property
    def t(self) -> int:
        return self.b * self.s

    @property
    def ts(self) -> int:
        """Tokens of the residual stream on this GPU: under sequence parallel Shard(1) of the sequence (torch.chunk,
        rank 0 the ceiling), else all of them."""
        return self.b * -(-self.s // self.seq_shards)

    @property
    def sp(self) -> bool:
        return self.seq_shards > 1


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
    # torchao's Float8Linear casts in backward, as (+1/-1, tag, bytes) events (llmem.memory.activations.float8):
    # those before the block's transient is made, those after it
    back_casts: tuple[tuple[tuple[int, int, int], ...], tuple[tuple[int, int, int], ...]] = ((), ())
    # the backward as its own (+1/-1, tag, bytes) events, where they are known op by op (HF's RMSNorm:
    # rmsnorm_backward); `transient` is then their peak. Empty: the backward is one allocation of `transient`
    back_events: tuple[tuple[int, int, int], ...] = ()

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
    head_back: tuple[tuple[int, int, int], ...] = ()   # the final norm's backward events, where known (RMSNorm)


def config_value(anatomy: ModelAnatomy, *names: str, default=0.0):
    for n in names:
        v = anatomy.config.get(n)
        if v is not None:
            return v
    return default


def block_owner(blocks: tuple[Block, ...], param_name: str) -> int:
    """Index of the block whose weights include this decoder-layer parameter (unmatched: the last block)."""
    inner = param_name.split(".", 1)[1] if "." in param_name else param_name
    return next((i for i, b in enumerate(blocks) if any(k in inner for k in b.params)), len(blocks) - 1)


def loss_peak_bytes(d: Dims, loss_bytes: int = F32, nll_cast: int = 0) -> int:
    """HF's ForCausalLMLoss: logits.float() -> cross_entropy = log_softmax + nll_loss.

    At the nll_loss backward three [tokens, vocab] tensors in the loss's dtype (fp32, or the model's under
    --logits-dtype model: `loss_bytes`) are live at once: the saved log-softmax output,
    nll_loss's gradient (zeros + scatter) and log_softmax's input gradient. The logits themselves are dropped with
    the model output before backward (as HF Trainer does), so they do not add here. Logits are full-vocab under
    tensor parallelism (the lm_head output is gathered), except under --loss-parallel (loss_parallel_peak_bytes).
    """
    if d.vocab_shards > 1:
        return loss_parallel_peak_bytes(d)
    if nll_cast:     # the log-softmax, autocast's fp32 cast of it nll_loss keeps, nll_loss's fp32 gradient
        return (loss_bytes + 2 * nll_cast) * d.t * d.vocab
    return 3 * loss_bytes * d.t * d.vocab


def local_vocab(d: Dims) -> int:
    """The logits' vocabulary on this GPU: ColwiseParallel's torch.chunk of the lm_head rows (rank 0 the ceiling)."""
    return -(-d.vocab // d.vocab_shards)


def loss_parallel_peak_bytes(d: Dims) -> int:
    """--loss-parallel: torch's loss_parallel() cross-entropy on [tokens, vocab/tp] logits
    (torch/distributed/tensor/parallel/loss.py). Its backward (_nll_loss_and_log_softmax_backward) holds four fp32
    shards at once: the saved log-softmax, zeros_like (the one-hot), exp(log-softmax) and their sum."""
    return 4 * F32 * d.t * local_vocab(d)


def loss_parallel_forward_bytes(d: Dims, mm: int) -> int:
    """--loss-parallel's forward peak (_log_softmax): the local logits (compute dtype), HF's fp32 upcast (none when
    fp32), x - max and its exp, all [tokens, vocab/tp]."""
    n = d.t * local_vocab(d)
    return n * mm + (n * F32 if mm != F32 else 0) + 2 * n * F32


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


def gathered_input(d: Dims, norm_out_bytes: int) -> tuple[int, tuple[tuple[int, float, float], ...]]:
    """--sequence-parallel: PrepareModuleInput(Shard(1) -> Replicate()) all-gathers the norm's sequence-sharded
    output before a TP region (DTensor's redistribute: funcol's all-gather output, then the chunks concatenated
    along the sequence, as traced). Returns the gathered [t, h] tensor's bytes (the norm output's dtype) and the
    two gather buffers as forward temporaries (made before it, freed at the block's end)."""
    gathered = norm_out_bytes // d.ts * d.t
    return gathered, ((gathered, 0, 1), (gathered, 0, 1))


def sp_norm_transient(r: Regime, d: Dims) -> int:
    """--sequence-parallel: a norm's backward also reduce-scatters its output's gradient (the TP region's input
    gradient, [t, h] in the compute dtype) to its sequence shard: the full gradient and its rearranged copy."""
    return 2 * d.t * d.h * r.mm if d.sp else 0


def rmsnorm_backward(r: Regime, t: int, h: int) -> tuple[tuple[int, int, int], ...]:
    """HF LlamaRMSNorm's backward on a low-precision stream as autograd runs it, op by op (torch's
    derivatives.yaml), as (+1/-1, tag, bytes) events; what is left allocated at the end is the input's gradient.
    `weight * y.to(dtype)`: MulBackward0 makes grad * weight (the stream dtype); ToCopyBackward0 casts it to fp32;
    `x * rsqrt(v)`: MulBackward0 makes both gradients, [t, h] each, the rsqrt's summed to [t, 1] (validate_outputs'
    sum_to) and its [t, h] product freed; RsqrtBackward0 `-0.5 * grad * result.pow(3)` on [t, 1]; MeanBackward0
    expands the gradient to [t, h] / n; PowBackward0 `grad * (2 * x.pow(1))`: three [t, h]; the input buffer sums the
    fp32 copy's two gradients into a new one (neither can be stolen), cast back to the stream's dtype. Empty on an
    fp32 stream: there `x.to(fp32)` is x itself, the residual, whose gradient the input buffer sums with the residual
    branch's as each arrives (a real layer's order, not the norm's alone): the block's backward stays one lump."""
    if r.res == F32:
        return ()
    f, s, g = F32 * t * h, F32 * t, r.res * t * h
    return ((1, 0, g), (1, 1, f), (-1, 0, g),                  # grad * weight, its .to(fp32)'s backward
            (1, 2, f), (1, 3, f), (1, 4, s), (-1, 2, f), (-1, 1, f),                 # x * rsqrt's
            (1, 5, s), (1, 6, s), (1, 7, s), (-1, 6, s), (-1, 5, s), (-1, 4, s),     # rsqrt's
            (1, 8, f), (-1, 7, s),                                                    # mean's
            (1, 9, f), (1, 10, f), (1, 11, f), (-1, 10, f), (-1, 9, f), (-1, 8, f),   # pow's
            (1, 12, f), (-1, 3, f), (-1, 11, f),                # the copy's two gradients summed
            (1, 13, g), (-1, 12, f))                            # x.to(fp32)'s backward: back to the stream dtype


def events_peak_bytes(events: tuple[tuple[int, int, int], ...]) -> int:
    """The largest sum of the bytes `events` hold at once."""
    live = peak = 0
    for sign, _tag, n in events:
        live += sign * n
        peak = max(peak, live)
    return peak


def rmsnorm_forward_temps(r: Regime, t: int, h: int) -> tuple[tuple[int, float, float], ...]:
    """HF LlamaRMSNorm's forward temporaries on a low-precision stream among its kept tensors (norm_saved's: the
    fp32 copy, the rsqrt, the normalised tensor in the stream dtype), as Block.temps: `x.pow(2)` [t, h] fp32 until
    mean has read it; `variance` [t, 1], held by its local until forward returns; `variance + eps` until rsqrt has
    read it; `x * rsqrt(...)` [t, h] fp32 until forward returns. Empty on an fp32 stream (with rmsnorm_backward)."""
    if r.res == F32:
        return ()
    f, s = F32 * t * h, F32 * t
    return (f, 0.2, 0.4), (s, 0.3, 3), (s, 0.5, 1), (f, 1.5, 3)


def norm_block(name: str, kind: str, r: Regime, t: int, h: int, params: tuple[str, ...]) -> tuple[Block, int]:
    kept, out = norm_saved(kind, r, t, h)
    back = rmsnorm_backward(r, t, h) if kind == "rmsnorm" else ()      # op by op (a low-precision stream)
    temps = rmsnorm_forward_temps(r, t, h) if back else ()
    transient = events_peak_bytes(back) if back else t * h * (2 * F32 if kind.startswith("rmsnorm") else r.res)
    # HF RMSNorm's `weight * normalised`: the normalised tensor (last) is kept for the weight's gradient only
    for_weights = ((len(kept) - 1, params, False),) if kind.startswith("rmsnorm") else ()
    return Block(name, kept, params, transient, for_weights, temps=temps, back_events=back), out


def proj_block(name: str, r: Regime, t: int, width: int, consumers: int, source_bytes: int,
                params: tuple[str, ...], readers: tuple[str, ...] | None = None) -> Block:
    """The inputs that `consumers` linears (named `readers`, default `params`) keep for their weight gradients."""
    tensors = linear_inputs_saved(r, t, width, consumers, source_bytes)
    readers = readers or params
    if len(tensors) == consumers and consumers > 1:          # one autocast cast per linear
        for_weights = tuple((i, (readers[i],), True) for i in range(consumers))
    else:                                                     # one tensor: the source itself, or one linear's cast
        for_weights = ((0, readers, tensors[0] != source_bytes),)
    return Block(name, tensors, params, consumers * t * width * r.mm, for_weights)

