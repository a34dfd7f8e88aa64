"""peft's LoRA on the input embedding (peft/tuners/lora/layer.py Embedding.forward, vanilla LoRA): what its forward
keeps for backward and what its backward allocates.

The forward: `result = base_layer(x)`; `after_A = F.embedding(x, lora_embedding_A.T)` [b, s, r] in A's dtype (its
backward keeps only the indices); `(after_A @ lora_embedding_B.T) * scaling` [b, s, h]; `result + adapter_output`
cast back to result's dtype. torch.matmul keeps both operands: under autocast (A and B fp32 as the step holds them)
its bf16 casts of after_A and of B.T (a view, so not autocast's cached leaf: a fresh copy), otherwise after_A itself
(B.T is a view of the parameter). peft applies no dropout here (lora_dropout is not called in Embedding.forward).

The backward, after the embedding output's gradient (autograd's order by sequence number): the scaling's product,
the matmul's two gradients ([b, s, r] and [r, h] in the matmul's dtype), autocast's casts of them back to the
parameters' dtype, the embedding's dense backward [num_embeddings, r] (embedding_dense_backward), then each
gradient through its transpose to AccumulateGrad, which copies a gradient whose strides differ from the parameter's
into the parameter's layout (torch/csrc/autograd/functions/accumulate_grad.h, clone_obey_contract): B's, then A's.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.model.adapter_params import EMBEDDING_A, EMBEDDING_B
from llmem.model.anatomy import ModelAnatomy
from llmem.model.peft import element_bytes
from llmem.setup.precision import Regime
from llmem.setup.training import TrainingSetup


@dataclass(frozen=True)
class EmbeddingAdapter:
    """One embedding's LoRA as the step runs it: rank r, embedding_dim h, num_embeddings v, the bytes per element
    the forward reads the adapters in (`seen`: the stored dtype, FSDP2's param_dtype when it gathers them) and the
    matmul's (`mm`: autocast's compute dtype, else `seen`)."""
    a_name: str
    b_name: str
    r: int
    h: int
    v: int
    seen: int
    mm: int
    tokens: int

    def kept(self) -> tuple[int, ...]:
        """What the forward keeps: the matmul's operands (autocast's copies of after_A and B.T when it casts them,
        else after_A)."""
        if self.mm != self.seen:
            return (self.tokens * self.r * self.mm, self.r * self.h * self.mm)
        return (self.tokens * self.r * self.seen,)


def embedding_adapters(anatomy: ModelAnatomy, setup: TrainingSetup, regime: Regime, tokens: int,
                       gathered: bool) -> tuple[EmbeddingAdapter, ...]:
    """The embeddings' LoRA adapters that train (`gathered`: FSDP2 gathers them in its param_dtype)."""
    by_name = {p.name: p for p in anatomy.outside_layer_params}
    out = []
    for a in anatomy.outside_layer_params:
        if not a.trainable or EMBEDDING_A not in a.name:
            continue
        b = by_name[a.name.replace(EMBEDDING_A, EMBEDDING_B)]
        seen = setup.gather_bytes if gathered else element_bytes(a, setup)
        mm = regime.mm if regime.autocast else seen
        out.append(EmbeddingAdapter(a.name, b.name, a.shape[0], b.shape[0], a.shape[1], seen, mm, tokens))
    return tuple(out)


def embedding_adapter_kept(adapters: tuple[EmbeddingAdapter, ...]) -> tuple[int, ...]:
    return tuple(n for a in adapters for n in a.kept())

