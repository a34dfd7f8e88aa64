"""The gradients in the step schedule: AccumulateGrad's gradient of each trained parameter (through autocast's
low-precision matmul output where there is one), the out-of-place accumulation into an existing one (tied weights),
FSDP2's unsharded gradients per unit (the root's, a decoder layer's) until their reduce-scatter, and the
--optimizer-in-backward hooks queued as gradients are made.

Known Limitations: a tied embedding's hook fires once, after its second gradient; the gradient's own dtype is the
trained parameter's (peft's fp32 adapters: 4 bytes), whatever the autocast output's.
"""

from __future__ import annotations

from llmem.estimator.events import Schedule
from llmem.estimator.schedule.facts import StepFacts
from llmem.estimator.schedule.state import StepState
from llmem.model.adapter_params import is_embedding_adapter
from llmem.model.anatomy import ParamInfo
from llmem.model.sharding import MATMUL_KINDS, is_embedding


class Gradients:
    """AccumulateGrad's events of a step."""

    def __init__(self, facts: StepFacts, sch: Schedule, state: StepState) -> None:
        self.f, self.sch, self.live = facts, sch, state.grads

    def accumulate(self, old: int, size: int) -> int:
        """AccumulateGrad into an existing gradient (tied weights): out of place, the new gradient and the sum
        exist before both addends are freed. Returns the sum's key."""
        new, total = self.sch.alloc(size, "gradients"), self.sch.alloc(size, "gradients")
        self.sch.free(new)
        self.sch.free(old)
        return total

    def make(self, p: ParamInfo, root_unit: bool = False, low: int | None = None) -> None:
        """`p`'s gradient: FSDP2's unsharded one (for its unit's reduce-scatter), or the final one (`low`: the key of
        autocast's low-precision matmul output, already made)."""
        if self.f.fsdp:
            self.make_unsharded(p, root_unit)
            return
        f, alloc, grads = self.f, self.sch.alloc, self.live.grads
        # DTensor: a vocab-parallel embedding's gradient comes back replicated (full size)
        size = (p.numel if p.name in f.params.vocab_parallel else f.params.shard_numel[p.name]) \
            * f.params.element_bytes[p.name]
        if p.name in grads:       # accumulation into an existing gradient (tied weights): out of place
            grads[p.name] = self.accumulate(grads[p.name], size)
            if f.in_backward:
                self.live.pending_steps.append(p)
            return
        if low is not None or f.regime.autocast and p.module_kind in MATMUL_KINDS:
            if low is None:
                low = alloc(f.params.tp_local[p.name] * f.regime.mm, "gradients")
            grads[p.name] = alloc(size, "gradients")
            self.sch.free(low)
        else:
            grads[p.name] = alloc(size, "gradients")
        # a tied embedding's hook fires once, after its second (embedding) gradient is accumulated
        if f.in_backward and not (p.tied_to is not None and is_embedding(p)):
            self.live.pending_steps.append(p)

    def make_unsharded(self, p: ParamInfo, root_unit: bool) -> None:
        """FSDP2: the unsharded gradient in param_dtype, held by its unit until the reduce-scatter."""
        alloc, live = self.sch.alloc, self.live
        size = self.f.params.unsharded[p.name] * self.f.gather_bytes
        if root_unit and self.f.replicated_grad(p):   # DTensor: the whole [vocab, h] (root_post_backward)
            size = p.numel * self.f.gather_bytes
        if root_unit and p.name in live.root_unsharded:   # tied: accumulate out of place
            live.root_unsharded[p.name] = self.accumulate(live.root_unsharded[p.name], size)
        elif root_unit:
            live.root_unsharded[p.name] = alloc(size, "gradients")
        else:
            live.layer_unsharded.append(alloc(size, "gradients"))
            live.unsharded_of[p.name] = live.layer_unsharded[-1]

    def hand_over(self, p: ParamInfo, key: int) -> None:
        """The lm_head gradient `key` a fused head hands to AccumulateGrad: held for the root's reduce-scatter
        (FSDP2) or the optimizer step."""
        (self.live.root_unsharded if self.f.fsdp else self.live.grads)[p.name] = key

    def head_params(self) -> list[ParamInfo]:
        """The root unit's parameters the head's backward makes gradients for (the lm_head or score and the final
        norm; the embedding only when tied), the per-unit gradient lists started afresh for the root."""
        self.live.root_unsharded.clear()
        self.live.layer_unsharded.clear()
        return [p for p in self.f.root if p.trainable and (not is_embedding(p) or p.tied_to is not None)
                and p.name not in self.f.vision_params and not is_embedding_adapter(p.name)]
