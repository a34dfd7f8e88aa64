"""The loss's tensors: HF's causal-LM loss on full logits, or the fused linear cross-entropy (`--fused-ce`)."""

from __future__ import annotations

from dataclasses import dataclass

from llmem.errors import LlmemError
from llmem.memory.activations.blocks import Dims, config_value
from llmem.model.anatomy import ModelAnatomy
from llmem.model.families import family_of
from llmem.model.sharding import is_embedding, is_lm_head
from llmem.setup.precision import F32, Regime
from llmem.setup.training import TrainingSetup


def loss_logits_bytes(setup: TrainingSetup, r: Regime) -> int:
    """Bytes per element of the logits the cross-entropy reads, and so of its log-softmax and of their gradients:
    fp32 under transformers' ForCausalLMLoss (logits.float()), the lm_head's output dtype under --logits-dtype
    model. Also under autocast: cross_entropy_loss calls log_softmax(x, dim, dtype=x.dtype), and autocast's
    fp32_set_opt_dtype policy leaves an explicit dtype as it is."""
    return F32 if setup.logits_dtype == "fp32" else r.mm


def nll_cast_bytes(setup: TrainingSetup, r: Regime) -> int:
    """Bytes per element of autocast's fp32 cast of a low-precision log-softmax for nll_loss (on CUDA's fp32 list),
    which NllLossBackward keeps: --logits-dtype model under autocast; 0 otherwise."""
    return F32 if r.autocast and loss_logits_bytes(setup, r) != F32 else 0


@dataclass(frozen=True)
class FusedCE:
    """llmem.runtime.losses' fused linear cross-entropy (Liger's algorithm): what it allocates, in bytes per element.

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


def fused_ce_for(anatomy: ModelAnatomy, setup: TrainingSetup, shards_model_states: bool, d: Dims,
                 r: Regime) -> FusedCE:
    if config_value(anatomy, "final_logit_softcapping", default=None):
        raise LlmemError("--fused-ce does not model final_logit_softcapping (Gemma-2)")
    head = next((p for p in anatomy.params if p.layer_index is None and is_lm_head(p)), None)
    if head is None:   # tied: the input embedding is the lm_head weight
        head = next(p for p in anatomy.params if p.layer_index is None and is_embedding(p)
                    and p.shape and p.shape[0] == anatomy.vocab_size)
    vocab, hidden = head.shape[0], head.shape[1]
    weight_bytes = setup.gather_bytes if shards_model_states else setup.stored_bytes(head.trainable)
    # the final norm's output: RMSNorm returns the stream dtype; F.layer_norm runs in fp32 under autocast
    layernorm = family_of(anatomy.model_type).norm == "layernorm"
    hidden_bytes = F32 if (layernorm and r.autocast) else r.res
    return FusedCE(d.t, hidden, vocab, hidden_bytes, r.mm, weight_bytes, head.trainable,
                   chunk_tokens(d.t, hidden, vocab))


def chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Liger's chunk size: tokens per chunk so that a chunk's logits hold about tokens x hidden elements
    (inc_factor = ceil(V / H), chunk = next_power_of_2(ceil(BT / inc_factor)), at most BT)."""
    inc_factor = -(-vocab // hidden)
    per = -(-tokens // inc_factor)
    power = 1 << max(per - 1, 0).bit_length()   # triton.next_power_of_2
    return max(min(power, tokens), 1)


@dataclass(frozen=True)
class ChunkedOutput:
    """torchtune's chunked output (`--output-chunks N`): TransformerDecoder.chunked_output runs the output projection
    on `h.chunk(N, dim=1)` (torchtune/modules/transformer.py) and returns the list of chunk logits in the model's
    dtype; CEWithChunkedOutputLoss (torchtune/modules/loss/ce_chunked_output_loss.py) then, chunk by chunk,
    `F.cross_entropy(logits.float(), labels, reduction="sum")`, and the recipe's `_loss_step` drops the logits
    (`del logits`) before backward. In bytes per element of the model's dtype `mm`; the loss's tensors are fp32.

    Kept for backward: every chunk's fp32 log-softmax (all the logits' worth) and, where the lm_head weight is
    trained, its input: views of the final hidden states, or (batch > 1: a chunk of a [batch, seq, hidden] tensor
    along dim 1 is not contiguous) matmul's contiguous copy of each chunk. In backward the autograd engine runs the
    nodes newest first, so every chunk's loss backward (nll_loss's and log_softmax's fp32 gradients, the cast to
    the model's dtype) runs before any chunk's matmul backward: every chunk's logits gradient is live at once."""
    batch: int
    seq_chunks: tuple[int, ...]    # torch.chunk's sizes along the sequence: ceil(seq / N) each, the last the rest
    hidden: int
    vocab: int
    mm: int                        # the model's dtype: the logits' and their gradients'
    # torchtune's compile_loss: compute_cross_entropy compiled (upcast and cross-entropy of one chunk in one fused
    # kernel each way, llmem.runtime.compiled_loss): the chunk's logits, its row maxima and log-sum-exp kept, no fp32
    # [chunk, vocab] tensor
    compiled: bool = False

    @property
    def token_chunks(self) -> tuple[int, ...]:
        """Tokens per chunk (all rows)."""
        return tuple(self.batch * c for c in self.seq_chunks)

    @property
    def upcast_bytes(self) -> int:
        """Bytes per element of logits.float()'s copy (none when the logits are fp32: .float() returns them)."""
        return F32 if self.mm != F32 else 0

    @property
    def copies_input(self) -> bool:
        """matmul folds a non-contiguous [batch, chunk, hidden] view into rows through a contiguous copy."""
        return self.batch > 1

    @property
    def forward_peak_bytes(self) -> int:
        """The loss's tensor bytes at its forward peak, the last chunk's cross-entropy: every chunk's logits, every
        log-softmax, the last chunk's upcast (the lm_head's input is the head's saved tensors)."""
        t = sum(self.token_chunks)
        if self.compiled:    # inductor's fused kernel: no [chunk, vocab] tensor besides the logits
            return t * self.vocab * self.mm
        return t * self.vocab * (self.mm + F32) + self.token_chunks[-1] * self.vocab * self.upcast_bytes

    @property
    def backward_peak_bytes(self) -> int:
        """The loss's tensor bytes at its backward peak: at chunk k's log_softmax backward, the later chunks' logits
        gradients, chunks 0..k's log-softmax outputs and chunk k's two fp32 gradients; or, once every chunk's loss
        backward ran, all the logits gradients (the lm_head's matmuls then free them one by one)."""
        v, t = self.vocab, sum(self.token_chunks)
        peaks = [t * v * self.mm]
        if self.compiled:    # at chunk k's fused backward: every chunk's logits or gradient, and chunk k's both
            return max(peaks + [(t + n) * v * self.mm for n in self.token_chunks])
        for k, n in enumerate(self.token_chunks):
            later = sum(self.token_chunks[k + 1:])
            kept = sum(self.token_chunks[:k + 1])
            peaks.append(later * v * self.mm + kept * v * F32 + 2 * n * v * F32)
        return max(peaks)


def chunked_output_for(setup: TrainingSetup, d: Dims, r: Regime) -> ChunkedOutput:
    """The chunked output of `setup` (torch.chunk: chunks of ceil(seq / N) tokens, as many as fit)."""
    size = -(-d.s // setup.output_chunks)
    chunks = tuple(min(size, d.s - start) for start in range(0, d.s, size))
    return ChunkedOutput(d.b, chunks, d.h, d.vocab, r.mm, compiled=setup.compile)


@dataclass(frozen=True)
class LossLogits:
    """The logits the causal-LM loss reads, as the step computes them (ActivationProfile.loss)."""
    element_bytes: int = F32     # its logits, log-softmax and their gradients (loss_logits_bytes)
    nll_cast: int = 0            # autocast's fp32 cast of a low-precision log-softmax, kept by nll_loss (nll_cast_bytes)
    chunked: ChunkedOutput | None = None   # torchtune's chunked output and loss (--output-chunks)


def loss_logits(setup: TrainingSetup, d: Dims, r: Regime) -> LossLogits:
    return LossLogits(loss_logits_bytes(setup, r), nll_cast_bytes(setup, r),
                      chunked_output_for(setup, d, r) if setup.output_chunks else None)
