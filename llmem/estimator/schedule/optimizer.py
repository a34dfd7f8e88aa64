"""The optimizer in the step schedule: its states made at its first step (bitsandbytes' shared quantisation maps
with the first 8-bit parameter), its step's temporaries as its row describes them (llmem.setup.optimizers), a
vocab-parallel embedding's gradient redistributed where the step first combines it with a sharded tensor, the
--optimizer-in-backward hooks, and zero_grad(set_to_none=True).

Known Limitations: a host step (CPUOffloadPolicy, DeepSpeed's offload) lays out nothing on the device; the
temporaries of a composite optimizer run part after part.
"""

from __future__ import annotations

from llmem.estimator.events import Schedule
from llmem.estimator.schedule.facts import StepFacts
from llmem.estimator.schedule.state import StepState
from llmem.estimator.states import by_bytes
from llmem.model.anatomy import ParamInfo
from llmem.model.sharding import foreach_groups
from llmem.setup.optimizers import AFTER_TEMPORARIES, ALL_PARAMETERS, AT_FIRST_FREE, NO_TEMPORARIES


class OptimizerEvents:
    """optimizer.step()'s states and temporaries, in the step or in backward."""

    def __init__(self, facts: StepFacts, sch: Schedule, state: StepState) -> None:
        self.f, self.sch, self.live = facts, sch, state

    def create_states(self, params: list[ParamInfo]) -> None:
        """The optimizer's state tensors, created at its first step (per parameter, in order); bitsandbytes makes
        its shared quantisation maps at the first 8-bit parameter."""
        alloc, spec, shapes, pb = self.sch.alloc, self.f.optimizer, self.f.params.shapes, self.f.params.element_bytes
        states = self.live.states
        per_parameter = self.f.setup.optimizer_in_backward
        shared = spec.shared_state_bytes([shapes[p.name] for p in params], per_parameter)
        owner = self.sch.owner
        for p in params:
            self.sch.own(p.layer_index)
            if shared and spec.shared_state_bytes([shapes[p.name]], per_parameter):
                states.extend(alloc(shared // 2, "optimizer_states") for _ in range(2))
                shared = 0
            states.extend(alloc(b, "optimizer_states") for b in spec.part(p).states(shapes[p.name], pb[p.name]))
        self.sch.own(owner)

    def redistribute_vocab_grads(self, params: list[ParamInfo]) -> None:
        """DTensor: the replicated vocab-parallel embedding gradient is redistributed to the parameter's shards
        where the optimizer first combines it with a sharded tensor (a temporary of the shard's size)."""
        alloc, facts = self.sch.alloc, self.f.params
        redistributed = [alloc(facts.shard_numel[p.name] * facts.element_bytes[p.name], "optimizer_temporaries")
                         for p in params if p.name in facts.vocab_parallel]
        self.sch.free_all(redistributed)

    def step_temporaries(self, params: list[ParamInfo]) -> None:
        """One step's temporaries over `params` (a composite optimizer: each part over its own, in order)."""
        sch, spec = self.sch, self.f.optimizer
        redistribute = spec.redistribute == AT_FIRST_FREE   # e.g. Lion: in _foreach_add_(updates, grads)
        # per dtype (foreach kernels group their tensors by dtype), then per part of a composite optimizer
        runs = [(part, ps, n) for n, same in by_bytes(params, self.f.params.element_bytes)
                for part, ps in spec.split(same)]
        owner = sch.owner
        for part, ps, n in runs:
            keys: dict[int, int] = {}
            param_of = part.event_param      # (whose layer each temporary is: llmem.estimator.deepen)
            for sign, tag, size in part.step_events([self.f.params.shapes[p.name] for p in ps], n, self.f.shards):
                if sign > 0:
                    if param_of is not None:
                        sch.own(ps[param_of(tag)].layer_index)
                    keys[tag] = sch.alloc(size, "optimizer_temporaries")
                else:
                    sch.own(None)           # (a free outside a layer's part: its tensor's layer's)
                    if redistribute:
                        self.redistribute_vocab_grads(params)
                        redistribute = False
                    sch.free(keys.pop(tag))
        sch.own(owner)

    def flush_steps(self, it: int) -> None:
        """The hooks fire once the gradient's node has run and released what it saved (the engine runs
        AccumulateGrad first: it has the highest priority)."""
        pending = self.live.grads.pending_steps
        for p in pending:
            self.step_in_backward(p, it)
        pending.clear()

    def step_in_backward(self, p: ParamInfo, it: int) -> None:
        """--optimizer-in-backward: the post-accumulate-grad hook steps this parameter's own optimizer (states
        created lazily at its first step, temporaries of a one-parameter group) and frees its gradient."""
        if it == 0:
            self.create_states([p])
        self.step_temporaries([p])
        self.sch.free(self.live.grads.grads.pop(p.name))

    def step(self, it: int) -> None:
        """optimizer.step() (its states at the first step, its temporaries as its row describes them), then
        zero_grad(set_to_none=True)."""
        sch, spec, f = self.sch, self.f.optimizer, self.f
        trainable = f.params.trainable
        if not f.host_step:
            groups = foreach_groups(trainable, f.layout)
            if it == 0 and not f.in_backward:
                self.create_states(trainable)
            if not f.in_backward and spec.redistribute == AFTER_TEMPORARIES:
                self.step_over(groups)
            if f.params.vocab_parallel and spec.redistribute != AT_FIRST_FREE:
                self.redistribute_vocab_grads(f.root)
            if not f.in_backward and spec.redistribute != AFTER_TEMPORARIES:
                self.step_over(groups)
        grads = self.live.grads.grads
        for k in list(grads.values()):
            sch.free(k)
        grads.clear()
        if f.fsdp:
            sch.free_all(self.live.units.rs_outputs)

    def step_over(self, groups: list[list[ParamInfo]]) -> None:
        """The step's temporaries: per parameter group (foreach kernels, one kind of tensor each under TP), or
        over all parameters in order (a for-loop implementation)."""
        if self.f.optimizer.step_scope == NO_TEMPORARIES:
            return
        for group in (groups if self.f.optimizer.step_scope != ALL_PARAMETERS else [self.f.params.trainable]):
            self.step_temporaries(group)
