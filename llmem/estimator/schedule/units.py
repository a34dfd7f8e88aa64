"""FSDP2's units in the step schedule (torch/distributed/fsdp/_fully_shard): a unit's all-gather (the copy-in of
the local shards, the gathered output on the all-gather stream), its copy-out into the unsharded parameters, the
explicit and implicit prefetches, the reshard after forward (or to post-forward shards: llmem.estimator.post_forward),
the reduce-scatter of each unit's gradients after its backward and the root's post-backward.

Under --shard-embeddings the input embedding and the lm_head are units of their own (torchtune's
custom_sharded_layers): each gathered around its forward (resharded after it, per reshard_after_forward) and its
backward, the lm_head's reduce-scatter at its post-backward, the embedding's in the root's final callback after the
root's (FSDPState._root_post_backward_final_callback runs the states in module order: its inputs need no gradient).

A vision-language model's tower units (its encoder blocks: llmem.estimator.schedule.vision_units) are gathered and
reduced by the vision side's events through the same operations.

Known Limitations: a unit is a decoder layer, the root, a vision tower's block, or under --shard-embeddings the
embedding or the lm_head;
ZeRO's own gathering is llmem.estimator.deepspeed's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from llmem.estimator.events import ALL_GATHER, REDUCE_SCATTER
from llmem.estimator.post_forward import post_forward_param_bytes
from llmem.estimator.schedule.hooks import StepHooks
from llmem.estimator.schedule.state import StepState, UnitKey
from llmem.model.anatomy import ParamInfo

T = TypeVar("T")


class FsdpUnits:
    """FSDP2's unshard, prefetch, reshard and reduce-scatter events of a step."""

    def __init__(self, step: StepHooks, state: StepState) -> None:
        self.step, self.f, self.sch = step, step.facts, step.sch
        self.live, self.grads = state.units, state.grads
        # sums over a unit's parameters, per (what, unit identity): a unit is gathered and reduced in each iteration
        self._sums: dict[tuple[str, int], tuple[list[ParamInfo], object]] = {}

    def unit_sum(self, what: str, unit: list[ParamInfo], work_out: Callable[[], T]) -> T:
        """`work_out()` for `unit`, worked out once in this schedule (the unit is held beside its value, so its
        identity cannot pass to another list while the value is kept)."""
        key = (what, id(unit))
        got = self._sums.get(key)
        if got is None or got[0] is not unit:
            got = self._sums[key] = (unit, work_out())
        return got[1]   # type: ignore[return-value]

    # ------------------------------------------------------------------------------------------ all-gather
    def all_gather(self, unit: list[ParamInfo]) -> int:
        """FSDP2 foreach_all_gather: the copy-in of the local shards that MixedPrecisionPolicy casts (a parameter
        already in param_dtype, or without a policy, is copied straight into the output: _get_param_all_gather_inputs)
        and the gathered output, on its stream."""
        alloc, params = self.sch.alloc, self.f.params
        if self.f.cpu_offload:
            inputs = self.copies_from_host(unit)
        else:
            shards = params.shard_of[unit[0].name] if unit else self.f.shards      # one FSDP2 group's mesh
            cast = self.unit_sum("cast", unit, lambda: sum(sum(params.gather_sizes[p.name]) for p in unit
                                                           if params.cast_in[p.name])) // shards
            cast = 0 if self.from_post_forward(unit) else cast
            inputs = [alloc(cast, "communication_buffers", ALL_GATHER)] if cast else []
        out = alloc(self.unit_sum("gathered", unit, lambda: self.f.gathered_bytes(unit)), "communication_buffers",
                    ALL_GATHER)
        self.sch.free_all(inputs)
        return out

    def copies_from_host(self, unit: list[ParamInfo]) -> list[int]:
        """CPUOffloadPolicy's all-gather inputs (FSDPParam.all_gather_inputs, no foreach copy): each parameter's
        padded shard copied from the host in its stored dtype (`.to(device)`), then cast to MixedPrecisionPolicy's
        param_dtype where that differs (the copy dies with the cast); they live until the copy-in is done."""
        alloc, dp, params = self.sch.alloc, self.f.shards, self.f.params
        keys = []
        for p in unit:
            if params.quantised[p.name]:   # its sharded storage (bitsandbytes' packed weight) copied as it is stored
                keys.append(alloc(sum(params.gather_sizes[p.name]) // dp, "communication_buffers", ALL_GATHER))
                continue
            copy = alloc(params.unsharded[p.name] // dp * params.element_bytes[p.name], "communication_buffers",
                         ALL_GATHER)
            if params.cast_in[p.name]:
                keys.append(alloc(sum(params.gather_sizes[p.name]) // dp, "communication_buffers", ALL_GATHER))
                self.sch.free(copy)
            else:
                keys.append(copy)
        return keys

    def fsdp_groups(self, unit: list[ParamInfo]) -> list[list[ParamInfo]]:
        """A unit's FSDPParamGroups in order of their first parameter: one, or under --ep the dense parameters and
        the routed experts on their own mesh (torch's _init_param_group groups by process group)."""
        if self.f.layout.ep == 1:
            return [unit]
        groups: dict[int, list[ParamInfo]] = {}
        for p in unit:
            groups.setdefault(self.f.params.shard_of[p.name], []).append(p)
        return list(groups.values())

    def copy_out(self, unit_key: UnitKey, unit: list[ParamInfo]) -> None:
        sizes = self.unit_sum("outputs", unit, lambda: [n for p in unit for n in self.f.params.gather_sizes[p.name]])
        keys = self.sch.alloc_many(sizes, "gathered_weights")
        self.live.gathered.setdefault(unit_key, []).extend(keys)
        self.live.gathered_by.setdefault(unit_key, []).append(keys)

    def gather_unsharded(self, unit_key: UnitKey, group: list[ParamInfo]) -> None:
        """FSDP2 on a one-rank mesh (--ep with efsdp 1: the experts' group), wait_for_unshard's world_size == 1 path
        without a collective: per parameter its shard cast to param_dtype (all_gather_inputs), the unsharded output
        allocated (alloc_storage) and copied into, the cast released once the next one exists."""
        sch, alloc, params = self.sch, self.sch.alloc, self.f.params
        keys, prev = [], -1
        for p in group:
            cast = alloc(sum(params.gather_sizes[p.name]), "communication_buffers") if params.cast_in[p.name] else -1
            sch.free(prev)
            prev = cast
            keys += sch.alloc_many(params.gather_sizes[p.name], "gathered_weights")
        sch.free(prev)
        self.live.gathered.setdefault(unit_key, []).extend(keys)
        self.live.gathered_by.setdefault(unit_key, []).append(keys)

    # ------------------------------------------------------------------------------------------ unshard, reshard
    def unshard_forward(self, unit_key: UnitKey, unit: list[ParamInfo]) -> None:
        live = self.live
        if not self.f.fsdp or unit_key in live.gathered:
            return
        prefetched = live.ag_forward.pop(unit_key, None)
        for g, group in enumerate(self.fsdp_groups(unit)):      # each group's pre_forward: all-gather, copy-out
            if self.f.params.shard_of[group[0].name] == 1:
                self.sch.free_all(live.last_forward_ag)   # wait_for_unshard frees the previous state first
                self.gather_unsharded(unit_key, group)
                continue
            out = prefetched[g] if prefetched is not None else self.all_gather(group)
            self.copy_out(unit_key, group)
            self.sch.free_all(live.last_forward_ag)   # the previous output is released once this one is gathered
            live.last_forward_ag.append(out)

    def unshard_backward(self, unit_key: UnitKey, unit: list[ParamInfo]) -> None:
        if not self.f.fsdp or unit_key in self.live.gathered:
            return
        outs = self.live.ag_out.pop(unit_key, None)
        for g, group in enumerate(self.fsdp_groups(unit)):
            if self.f.params.shard_of[group[0].name] == 1:    # no collective: its unshard (prefetch) allocates nothing
                self.gather_unsharded(unit_key, group)
                continue
            out = outs[g] if outs is not None else self.all_gather(group)
            self.copy_out(unit_key, group)
            self.free_post_forward(unit_key)
            self.sch.free(out)

    def prefetch_forward(self, i: int) -> None:
        """--ep: torchtitan's explicit forward prefetch (apply_fsdp_to_decoder's set_modules_to_forward_prefetch):
        layer i's groups all-gathered once the root / layer i - 1 is unsharded (a one-rank group allocates
        nothing until its copy-out)."""
        if self.f.layout.ep == 1 or not self.f.fsdp or i >= self.f.layers or i in self.live.gathered:
            return
        self.live.ag_forward[i] = [self.all_gather(group) if self.f.params.shard_of[group[0].name] > 1 else -1
                                   for group in self.fsdp_groups(self.f.unit(i))]

    def prefetch(self, unit_key: UnitKey, unit: list[ParamInfo]) -> None:
        live = self.live
        if self.f.fsdp and unit_key not in live.gathered and unit_key not in live.ag_out:
            live.ag_out[unit_key] = [self.all_gather(group) if self.f.params.shard_of[group[0].name] > 1 else -1
                                     for group in self.fsdp_groups(unit)]

    def reshard_unit(self, unit_key: UnitKey) -> None:
        self.live.gathered_by.pop(unit_key, None)
        self.sch.free_all(self.live.gathered.pop(unit_key, []))

    # ------------------------------------------------------------------------------------------ post-forward shards
    def reshard_to_post_forward(self, i: int) -> None:
        """FSDPParamGroup.reshard after layer i's forward under --reshard-after-forward N: per parameter its
        post-forward shard allocated, then its unsharded copy freed; the shards are kept until backward
        (llmem.estimator.post_forward)."""
        unit = self.f.unit(i)
        keys = self.live.gathered.pop(i, [])
        self.live.gathered_by.pop(i, None)
        shards = []
        for p, k in zip(unit, keys, strict=True):
            shards.append(self.sch.alloc(post_forward_param_bytes(sum(self.f.params.gather_sizes[p.name]),
                                                                  self.f.post_forward_ranks), "gathered_weights"))
            self.sch.free(k)
        self.live.post_forward_shards[i] = shards

    def from_post_forward(self, unit: list[ParamInfo]) -> bool:
        """The unit's next all-gather reads its post-forward shards (already in param_dtype: no copy-in cast)."""
        return bool(unit) and unit[0].layer_index in self.live.post_forward_shards

    def free_post_forward(self, i: UnitKey) -> None:
        """FSDPParam.to_unsharded after layer i's backward copy-out: its post-forward shards are freed."""
        self.sch.free_all(self.live.post_forward_shards.pop(i, []))

    # ------------------------------------------------------------------------------------------ reduce-scatter
    def reduce_scatter_layer(self, i: int) -> None:
        """FSDP2's post-backward for a decoder layer: reshard (also for zero2), the reduce-scatter input on the
        current stream (the previous one has finished by now), its sharded output on the reduce-scatter stream."""
        sch, alloc, f = self.sch, self.sch.alloc, self.f
        unit = f.unit(i)
        if f.layout.ep > 1:
            self.reduce_scatter_groups(i, unit)
            return
        self.step.reshard_unit(i)
        sch.free_all(self.live.pending_rs)
        rs_bytes = self.unit_sum("reduced", unit, lambda: f.unit_bytes(unit, f.reduce_bytes, True))
        rs_in = alloc(rs_bytes, "communication_buffers")
        sch.free_all(self.grads.layer_unsharded)
        self.sharded_grads(alloc(rs_bytes // f.shards, "gradients", REDUCE_SCATTER))
        self.live.pending_rs.append(rs_in)

    def reduce_scatter_groups(self, i: int, unit: list[ParamInfo]) -> None:
        """--ep: each FSDPParamGroup's post_backward in turn (reshard, reduce-scatter input, the group's unsharded
        gradients freed, its output sharded over the group's mesh: efsdp for the routed experts)."""
        sch, alloc, f, live = self.sch, self.sch.alloc, self.f, self.live
        gathered = live.gathered_by.pop(i, [])
        live.gathered.pop(i, None)
        unsharded_of = self.grads.unsharded_of
        for g, group in enumerate(self.fsdp_groups(unit)):
            sch.free_all(gathered[g] if g < len(gathered) else [])
            sch.free_all(live.pending_rs)
            rs_bytes = f.unit_bytes(group, f.reduce_bytes, True)
            rs_in = alloc(rs_bytes, "communication_buffers")
            sch.free_all([unsharded_of.pop(p.name) for p in group if p.name in unsharded_of])
            self.sharded_grads(alloc(rs_bytes // f.params.shard_of[group[0].name], "gradients", REDUCE_SCATTER))
            live.pending_rs.append(rs_in)
        self.grads.layer_unsharded.clear()

    def sharded_grads(self, key: int) -> None:
        """foreach_reduce's output: the sharded gradients until the optimizer step, or under CPUOffloadPolicy
        copied to the host as it returns (`new_sharded_grad.to("cpu")`), so the device output dies then."""
        if self.f.cpu_offload:
            self.sch.free(key)
        else:
            self.live.rs_outputs.append(key)

    def redistribute_root_grads(self) -> None:
        """FSDPParamGroup.post_backward's unsharded_grad_data (FSDPParam._get_grad_inner_tensor): a replicated
        gradient redistributed to the parameter's TP placement (its vocab shard, a new tensor); the whole one dies
        with `unsharded_param.grad = None`, before the reshard and the reduce-scatter input."""
        grads = self.grads.root_unsharded
        for p in self.f.root:
            if p.name in grads and self.f.replicated_grad(p):
                shard = self.sch.alloc(self.f.params.unsharded[p.name] * self.f.gather_bytes, "gradients")
                self.sch.free(grads[p.name])
                grads[p.name] = shard

    def root_post_backward(self) -> None:
        """FSDPParamGroup.post_backward of the root: it reshards before foreach_reduce; the copy-in loop's variable
        still holds the last parameter's gradient (lm_head's, in module order) while the output is allocated."""
        sch, alloc, f = self.sch, self.sch.alloc, self.f
        root, grads = f.root_unit, self.grads.root_unsharded
        self.redistribute_root_grads()
        sch.free_all(self.live.pending_rs)
        self.step.reshard_unit(None)
        rs_bytes = f.unit_bytes(root, f.reduce_bytes, True)
        rs_in = alloc(rs_bytes, "communication_buffers")
        ordered = [grads[p.name] for p in root if p.name in grads]
        for k in ordered[:-1]:
            sch.free(k)
        out = alloc(rs_bytes // f.shards, "gradients", REDUCE_SCATTER)
        sch.free_all(ordered[-1:])
        self.sharded_grads(out)
        if "embed" in f.own_units:   # the embedding's post-backward next, in the same final callback
            self.live.pending_rs.append(rs_in)
            self.own_post_backward("embed")
            sch.free_all(self.live.pending_rs)   # the callback waits on the last reduce-scatter
        else:
            sch.free(rs_in)
        for u in list(self.live.gathered):
            self.step.reshard_unit(u)

    # ------------------------------------------------------------------------------------------ own units
    def own_forward(self, key: str) -> None:
        """--shard-embeddings: the embedding's or the lm_head's pre-forward (all-gather, copy-out; the previous
        all-gather output freed)."""
        self.unshard_forward(key, self.f.own_units[key])

    def own_post_forward(self, key: str) -> None:
        """Its post-forward: resharded under reshard_after_forward True (zero2 keeps it gathered to backward)."""
        if self.f.reshard:
            self.step.reshard_unit(key)

    def own_post_backward(self, key: str) -> None:
        """FSDPParamGroup.post_backward of a unit of its own: reshard, the previous reduce-scatter input released
        (reduce_scatter_max_input_buffers 1), the reduce-scatter input, the sharded output allocated while the
        copy-in loop's variable holds the last gradient (as at the root's). A frozen unit reduces nothing; a
        prefetch never waited on (a frozen embedding's, gathered by layer 0's backward) dies in
        finalize_backward."""
        self.unit_post_backward(key, self.f.own_units[key])

    def unit_post_backward(self, key: UnitKey, unit: list[ParamInfo]) -> None:
        """own_post_backward's events for any unit whose gradients are held by name (`grads.root_unsharded`): a
        unit of its own, a vision tower's (llmem.estimator.schedule.vision_units)."""
        sch, alloc, f, grads = self.sch, self.sch.alloc, self.f, self.grads.root_unsharded
        self.step.reshard_unit(key)
        sch.free_all(self.live.ag_out.pop(key, []))
        sch.free_all(self.live.pending_rs)
        ordered = [grads.pop(p.name) for p in unit if p.name in grads]
        if not ordered:
            return
        rs_bytes = f.unit_bytes(unit, f.reduce_bytes, True)
        rs_in = alloc(rs_bytes, "communication_buffers")
        sch.free_all(ordered[:-1])
        out = alloc(rs_bytes // f.shards, "gradients", REDUCE_SCATTER)
        sch.free_all(ordered[-1:])
        self.sharded_grads(out)
        self.live.pending_rs.append(rs_in)
