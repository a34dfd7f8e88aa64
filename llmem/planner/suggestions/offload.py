"""Offload to the host: the optimizer's states and update (ZeRO-Offload style), and FSDP2's CPU offload of the
parameters, gradients and optimizer (CPUOffloadPolicy) with the activation savers."""

from __future__ import annotations

from dataclasses import replace

from llmem.estimator.states import cpu_offload_host_bytes, offloaded_optimizer_host_bytes
from llmem.model.resolved import assemble
from llmem.planner.search import CandidatePlan, PlanContext, layout_setup, timed
from llmem.planner.suggestions.fitting import (
    applied,
    best_fitting,
    quick_batch_bound,
    screened_layouts,
    supports,
)
from llmem.planner.suggestions.record import closest_plan, describe_fit, suggestion_dict, time_cost_pct
from llmem.planner.timing import accumulation_for
from llmem.setup.layout import Layout, gpus_per_node
from llmem.setup.objectives import setup_batch_multiple
from llmem.setup.training import TrainingSetup
from llmem.units import format_bytes


def offload_optimizer_suggestion(ctx: PlanContext, setup: TrainingSetup, layouts: list[Layout],
                                 engine_note: str) -> dict:
    """The optimizer's states and update on the CPU (ZeRO-Offload style): the fastest layout that fits (else the
    closest), and the host memory its states and fp32 master copy take per GPU and per node."""
    offloaded_opt = applied(setup, offload_optimizer=True)
    best, plans = best_fitting(ctx, offloaded_opt, layouts, offload=True) if offloaded_opt else (None, [])
    pick = best or closest_plan(plans)
    ram = offloaded_optimizer_host_bytes(assemble(layout_setup(
        setup, pick.layout, setup_batch_multiple(setup, pick.layout.world_size)), ctx.anatomy, ctx.gpu,
        pick.layout)) if pick else 0
    per_node = gpus_per_node(setup.gpus, setup.gpus_per_node)
    return suggestion_dict("offload_optimizer", "offload the optimizer to the CPU (states and update, "
                           f"ZeRO-Offload style): {describe_fit(best, plans, ctx.limit)}; CPU RAM "
                           f"{format_bytes(ram)} per GPU ({format_bytes(ram * per_node)} per node) for the states and "
                           "an fp32 master copy" + engine_note,
                           pick, cpu_ram_bytes_per_gpu=ram, cpu_ram_bytes_per_node=ram * per_node)


# --offload-param with the activation savers, each layout's method taking those its support check allows (fused CE:
# not under tensor parallelism): fused CE alone (same FLOPs, so never slower than no saver), then checkpointing too.
# The host's optimizer step dominates the step time, so the larger micro-batch checkpointing allows usually wins
# despite its recompute: the fastest that fits is the suggestion.
OFFLOAD_PARAM_VARIANTS: tuple[tuple[tuple[str, object, str], ...], ...] = (
    (("fused_ce", True, "--fused-ce"),),
    (("grad_ckpt", True, "--grad-ckpt"), ("fused_ce", True, "--fused-ce")),
)


def _variant_groups(base: TrainingSetup, variant: tuple[tuple[str, object, str], ...], layouts: list[Layout]
                    ) -> dict[tuple, list[Layout]]:
    """The layouts by the changes of `variant` their method takes on top of `base` (what it lacks and supports)."""
    groups: dict[tuple, list[Layout]] = {}
    for lay in layouts:
        s, taken = base, []
        for f, v, flag in variant:
            if getattr(s, f) != v and supports(applied(s, **{f: v}), lay.spec):
                s = replace(s, **{f: v})
                taken.append((f, v, flag))
        groups.setdefault(tuple(taken), []).append(lay)
    return groups


def _tokens_per_s_at(ctx: PlanContext, setup: TrainingSetup, layout: Layout, batch: int) -> float:
    """The time model's tokens/s of `layout` if its largest micro-batch were `batch` (attach_time's accumulation)."""
    micro, steps = accumulation_for(ctx.options.global_batch, batch, layout.dp)
    return timed(ctx, setup, layout, micro, steps).tokens_per_s


def offload_param_suggestion(ctx: PlanContext, setup: TrainingSetup, layouts: list[Layout],
                             engine_note: str) -> dict | None:
    """FSDP2's CPUOffloadPolicy on the layouts that shard with FSDP2 (fsdp, zero2, fsdp+tp): the device keeps only
    the gathered units, so full fine-tuning can fit where nothing else does, at the price of the host <-> device
    copies and the optimizer step on the host (llmem.planner.timing.host_copies). Every variant
    (OFFLOAD_PARAM_VARIANTS) on every layout its quick bound admits is a candidate; each one's tokens/s at its
    quick batch bound bounds what it can reach (tokens/s grows with the micro-batch), so they are batch-searched in
    the order of that bound until the next cannot beat the fastest found. When none fits, the last variant is
    searched on its nearest layouts, for the report. None when the set-up offloads already or no layout shards
    with FSDP2."""
    sharded = [lay for lay in layouts if lay.shards_model_states]
    if setup.offload_param or not sharded:
        return None
    base = applied(setup, method=sharded[0].method, offload_param=True)
    if base is None:          # the objective's methods do not shard (GRPO: single / ddp)
        return None
    candidates: list[tuple[float, int, TrainingSetup, tuple, Layout]] = []
    by_variant = [list(_variant_groups(base, variant, sharded).items()) for variant in OFFLOAD_PARAM_VARIANTS]
    for changes, group in (x for groups in by_variant for x in groups):
        s = replace(base, **{f: v for f, v, _ in changes})
        for lay in screened_layouts(ctx, s, group, closest=0):
            bound = quick_batch_bound(ctx, s, lay)
            if bound:
                candidates.append((_tokens_per_s_at(ctx, s, lay, bound), len(candidates), s, changes, lay))
    best, plans, chosen, seen = None, [], (), set()
    for upper, _i, s, changes, lay in sorted(candidates, key=lambda x: (-x[0], x[1])):
        if best is not None and upper <= best.time.tokens_per_s:
            break                                   # nothing left can beat it
        if (s, lay) in seen:
            continue
        seen.add((s, lay))
        found, searched = best_fitting(ctx, s, [lay], closest=0)
        plans += searched
        if found is not None and (best is None or found.time.tokens_per_s > best.time.tokens_per_s):
            best, chosen = found, changes
    for changes, group in by_variant[-1] if best is None else ():
        _, searched = best_fitting(ctx, replace(base, **{f: v for f, v, _ in changes}), group)
        plans += searched
    flags = " ".join(["--offload-param", *(flag for _, _, flag in chosen)])
    pick = best or closest_plan(plans)
    host = cpu_offload_host_bytes(assemble(
        layout_setup(base, pick.layout, setup_batch_multiple(base, pick.layout.world_size)), ctx.anatomy, ctx.gpu,
        pick.layout)) if pick else None
    per_node = gpus_per_node(setup.gpus, setup.gpus_per_node)
    ram = host.total if host else 0
    cost = time_cost_pct(ctx, best, setup)
    text = (f"{flags} (FSDP2's CPUOffloadPolicy: parameters, gradients and the optimizer in host memory"
            + (f", time per token {cost:+.0f} %" if cost is not None else "") + "): "
            + describe_fit(best, plans, ctx.limit) + _offload_time(best)
            + (f"; CPU RAM {format_bytes(ram)} per GPU ({format_bytes(ram * per_node)} per node: "
               f"{format_bytes(host.pinned)} of pinned parameters and gradients, {format_bytes(host.optimizer)} of "
               "optimizer states per GPU)" if host else "") + engine_note)
    return suggestion_dict("offload_param", text, pick, flags=flags, time_cost_pct=cost,
                       changes={"offload_param": True, **{f: v for f, v, _ in chosen}},
                       cpu_ram_bytes_per_gpu=ram, cpu_ram_bytes_per_node=ram * per_node)


def _offload_time(c: CandidatePlan | None) -> str:
    """What the offload costs in the plan's step: the host's optimizer step and the host <-> device copies."""
    if c is None or c.time is None:
        return ""
    t = c.time
    return (f"; of its {t.step_s:.1f} s step, {t.host_step_s:.1f} s is the optimizer step on the host (torch's "
            f"AdamW, one core per rank: more gradient accumulation amortises it) and {t.host_copy_s:.1f} s the host "
            "<-> device copies (overlapped with compute where they are shorter)")
