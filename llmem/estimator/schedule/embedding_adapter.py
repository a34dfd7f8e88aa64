"""The backward of peft's LoRA on the input embedding in the step schedule (llmem.memory.activations.embedding_adapter
says what peft's Embedding.forward keeps and why), after the embedding output's gradient: autograd's order by
sequence number (the matmul's backward, autocast's casts back, embedding_dense_backward, then B's and A's
AccumulateGrad, each copying its transposed gradient into the parameter's layout)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmem.memory.activations.embedding_adapter import EmbeddingAdapter

if TYPE_CHECKING:
    from llmem.estimator.schedule.hooks import StepHooks


def embedding_adapter_backward(s: StepHooks, adapters: tuple[EmbeddingAdapter, ...], stream_bytes: int) -> None:
    """Each adapter's backward events in `s`; `stream_bytes`: the embedding output's dtype (its gradient's)."""
    sch = s.sch
    alloc, free = sch.alloc, sch.free
    by_name = {p.name: p for p in s.facts.root}
    for a in adapters:
        t = a.tokens
        # outside autocast the sum was promoted to the adapters' dtype and cast back: its gradient cast up first
        up = alloc(t * a.h * a.seen, "activations") if a.mm == a.seen and a.seen != stream_bytes else -1
        scaled = alloc(t * a.h * a.mm, "activations")                  # the scaling's MulBackward
        free(up)
        grad_a = alloc(t * a.r * a.mm, "activations")                  # MmBackward: after_A's gradient,
        grad_b = alloc(a.r * a.h * a.mm, "activations")                # then B.T's
        free(scaled)
        if a.mm != a.seen:                                             # autocast's ToCopyBackward: B's, after_A's
            cast_b = alloc(a.r * a.h * a.seen, "activations")
            free(grad_b)
            grad_b = cast_b
            cast_a = alloc(t * a.r * a.seen, "activations")
            free(grad_a)
            grad_a = cast_a
        dense = alloc(a.v * a.r * a.seen, "activations")               # embedding_dense_backward [v, r]
        free(grad_a)
        s.make_grad(by_name[a.b_name], root_unit=True)                  # AccumulateGrad's copy in B's layout
        free(grad_b)
        s.make_grad(by_name[a.a_name], root_unit=True)                  # ... and in A's
        free(dense)
