"""Context parallelism on the memory floor: the ring attention's buffers in a rank's activations.

What context parallelism (--cp N) changes in a rank's step, as torch's ring attention allocates it
(torch/distributed/tensor/experimental/_context_parallel/_attention.py).

- Every activation is the rank's: seq_len / cp tokens per sample (the head-tail load balancer's two chunks), so
  the family recipes run at the local sequence length (`rank_seq_len`); the saved tensors of the attention kernel
  are those of the same kernel at the local length (autograd saves the DTensor inputs and the merged out / lse),
  plus one: the merged output is [b, h, s, d]-contiguous, so HF's transpose(1, 2).contiguous() copies it.
- Per attention call, forward (`_templated_ring_attention`, rotate method all-gather): K and V flattened and
  concatenated (2 x kv bytes), all-gathered once over the cp ranks (cp x 2 x kv), the merged output in fp32
  (_SDPAMerger, convert_to_f32) while the cp partial outputs are merged.
- Backward (`_templated_ring_attention_backward`): the fp32 dq / dk / dv accumulators, the K/V all-gather again,
  and the K/V gradients rotated by all-to-all in fp32 (2 x kv x 4 bytes, a new buffer per round).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmem.errors import LlmemError
from llmem.memory.activations.blocks import Dims, LayerRecipe
from llmem.model.resolved import ResolvedSetup
from llmem.setup.precision import F32, Regime


@dataclass(frozen=True)
class RingBuffers:
    """The ring attention's buffers of one attention call of one rank (cp >= 2, rank 0: every later round is a
    load-balanced partial round), in bytes, unrounded."""
    kv_concat_bytes: int        # torch.cat([k.flatten(), v.flatten()]) in the compute dtype
    kv_gathered_bytes: int      # all_gather_single of that over the cp ranks (held through the call)
    forward_merge_bytes: int    # _SDPAMerger at a partial round: the fp32 output, the half-size partial output
    #                             (as computed and in fp32), one merge temporary and the fp32 output re-concatenated
    grad_accum_fp32_bytes: int  # backward: the fp32 dq, dk, dv accumulators
    grad_rounds_bytes: int      # backward: round 0's dq / dk / dv in the compute dtype, and the next round's
    #                             (half the query) while round 0's are still referenced
    grad_kv_rotated_bytes: int  # backward: [dk, dv] in fp32 concatenated, and its all-to-all output
    merge_pieces: tuple[int, ...] = ()   # forward_merge_bytes' tensors

    @property
    def forward_pieces(self) -> tuple[int, ...]:
        """The forward buffers as torch allocates them (live together at a partial round's re-concatenation)."""
        return (self.kv_gathered_bytes, *self.merge_pieces)

    @property
    def forward_excess_bytes(self) -> int:
        """The most the ring holds above q, k, v in forward (before its merged output exists): the gathered K/V and
        a partial round's merge."""
        return self.kv_gathered_bytes + self.forward_merge_bytes

    @property
    def backward_excess_bytes(self) -> int:
        """The most the ring's backward holds above the saved tensors: accumulators, K/V concatenated and
        gathered, the rounds' gradients and the rotated fp32 K/V gradients."""
        return self.grad_accum_fp32_bytes + self.kv_concat_bytes + self.kv_gathered_bytes + \
            self.grad_rounds_bytes + self.grad_kv_rotated_bytes


def ring_buffers(t: int, q_dim: int, kv_dim: int, cp: int, compute_bytes: int) -> RingBuffers:
    """The buffers for `t` = batch x local tokens, query / key-value widths (heads x head_dim), `cp` ranks."""
    q, kv, mm = t * q_dim, t * kv_dim, compute_bytes
    return RingBuffers(
        kv_concat_bytes=2 * kv * mm,
        kv_gathered_bytes=cp * 2 * kv * mm,
        forward_merge_bytes=3 * q * F32 + q * mm // 2,
        merge_pieces=(q * F32, q * mm // 2, q * F32 // 2, q * F32 // 2, q * F32),
        grad_accum_fp32_bytes=(q + 2 * kv) * F32,
        grad_rounds_bytes=(q + 2 * kv) * mm + (q // 2 + 2 * kv) * mm,
        grad_kv_rotated_bytes=2 * (2 * kv * F32),
    )


def with_ring_attention(recipe: LayerRecipe, d: Dims, regime: Regime, cp: int) -> LayerRecipe:
    """The recipe's SDPA block as the ring runs it: its kept tensors unchanged (autograd saves the DTensor q, k,
    v and the merged out / lse, those of the kernel at the local length), the ring's forward buffers as a
    temporary before the output, its backward buffers as the block's backward transient."""
    ring = ring_buffers(d.t, d.qd, d.kvd, cp, regime.mm)
    sdpa_tail = (d.t * d.qd * regime.mm, F32 * d.b * d.heads * d.s)     # sdpa_saved's out and lse
    if not any(b.name == "attention" and b.tensors[-2:] == sdpa_tail for b in recipe.blocks):
        raise LlmemError("--cp: this model's activation recipe has no SDPA block of the flash / efficient kind "
                         "the ring replaces (a learned or non-Llama recipe): context parallelism is not modelled "
                         "for it")
    blocks = []
    for b in recipe.blocks:
        if b.name == "attention" and b.tensors[-2:] == sdpa_tail:
            out_at = len(b.tensors) - 2         # sdpa_saved: q, k, v, out, lse
            # HF's attn_output.transpose(1, 2).contiguous(): a view of the kernels' [b, s, h, d] output, but a copy of
            # the ring's merged one (_SDPAMerger.results' out.to(dtype) is [b, h, s, d]-contiguous), kept by o_proj
            b = replace(b, tensors=b.tensors + (d.t * d.qd * regime.mm,),
                        temps=b.temps + tuple((n, out_at, out_at) for n in ring.forward_pieces),
                        transient=ring.backward_excess_bytes)
        blocks.append(b)
    return replace(recipe, blocks=tuple(blocks))


def rank_seq_len(seq_len: int, cp: int) -> int:
    """The tokens per sample of one rank (two of the head-tail load balancer's 2 x cp chunks)."""
    return seq_len // cp


def rank_tokens(r: ResolvedSetup) -> ResolvedSetup:
    """The set-up as one rank runs its step under --cp: seq_len / cp tokens per sample (the layout keeps cp: the
    FSDP2 shards over dp x cp and the ring's buffers); unchanged without --cp."""
    if r.layout.cp == 1:
        return r
    return replace(r, setup=replace(r.setup, seq_len=rank_seq_len(r.setup.seq_len, r.layout.cp), cp=1))
