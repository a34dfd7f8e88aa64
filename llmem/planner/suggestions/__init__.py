"""What would fit when nothing does (`llmem plan`'s suggestions): memory savers that keep full fine-tuning, a shorter
sequence, the LoRA and QLoRA settings that fit, optimizer offload, FSDP2's CPU offload of parameters, gradients and
optimizer, more GPUs; each with its largest batch, memory, tokens/s and its time per token against the set-up as
given. One module per kind of what-if; `suggest` is the recipe that tries them in turn."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

from llmem.paper.algorithm1 import CPU_OFFLOADING
from llmem.planner.engines import LlmemEngine
from llmem.planner.search import PlanContext
from llmem.planner.side_by_side import side_by_side
from llmem.planner.suggestions.adapters import (
    ADAPTER_VARIANTS,
    LORA_RANK,
    LORA_TARGETS,
    AdapterMenu,
    adapter_menus,
    menu_suggestion,
)
from llmem.planner.suggestions.fitting import (
    CLOSEST_LAYOUTS,
    QUICK_SLACK,
    applied,
    best_fitting,
    plan_layouts,
    screened_layouts,
    supports,
)
from llmem.planner.suggestions.generations import generations_suggestion
from llmem.planner.suggestions.gpus import MAX_SUGGESTED_GPUS, more_gpus_suggestions
from llmem.planner.suggestions.offload import (
    OFFLOAD_PARAM_VARIANTS,
    offload_optimizer_suggestion,
    offload_param_suggestion,
)
from llmem.planner.suggestions.record import describe_fit, suggestion_dict, time_cost_pct
from llmem.planner.suggestions.savers import (
    CHEAP_SAVERS,
    Saver,
    combined_savers,
    combined_suggestion,
    full_finetune_savers,
    saver_candidates,
    saver_suggestion,
)
from llmem.planner.suggestions.sequence import sequence_knob, shorter_sequence_suggestion
from llmem.planner.suggestions.vision import not_modelled
from llmem.setup.layout import Layout
from llmem.setup.objectives import objective_spec
from llmem.setup.training import TrainingSetup

__all__ = [
    "ADAPTER_VARIANTS", "CHEAP_SAVERS", "CLOSEST_LAYOUTS", "LORA_RANK", "LORA_TARGETS", "MAX_SUGGESTED_GPUS",
    "OFFLOAD_PARAM_VARIANTS", "QUICK_SLACK", "AdapterMenu", "Saver", "adapter_menus", "applied", "best_fitting",
    "combined_savers", "combined_suggestion", "describe_fit", "full_finetune_savers", "generations_suggestion",
    "menu_suggestion", "more_gpus_suggestions", "offload_optimizer_suggestion", "offload_param_suggestion",
    "plan_layouts", "saver_suggestion", "screened_layouts", "sequence_knob", "shorter_sequence_suggestion",
    "suggest", "suggestion_dict", "supports", "time_cost_pct",
]


def suggest(ctx: PlanContext, setup: TrainingSetup, layouts: list[Layout] | None = None,
            progress: Callable[[str, int, int], None] | None = None) -> list[dict]:
    """What would fit when nothing does: memory savers that keep full fine-tuning (fused CE, 8-bit AdamW, the
    optimizer step in backward, checkpointing every 2nd / every layer, activation offloading, the cheap ones
    together as each method allows them), a shorter sequence, the LoRA and QLoRA settings that fit, optimizer
    offload, more GPUs. Each is searched over every layout in `layouts` (default: every layout of the plan on
    setup.gpus GPUs) that can run it, side by side on the plan's workers (PlanOptions.workers).
    `progress(description, done, total)` is told as each what-if is done."""
    if layouts is None:
        layouts = plan_layouts(ctx, setup.gpus, setup.gpus_per_node)
    # the paper's equations model none of the savers: they are always priced by the llmem estimator
    engine_note = " (memory from the llmem estimator: the paper engine does not model it)" \
        if ctx.options.engine == "paper" else ""
    savers = ctx if isinstance(ctx.engine, LlmemEngine) else \
        replace(ctx, engine=LlmemEngine(ctx.anatomy, ctx.gpu, ctx.limit))
    methods = list({lay.spec.name: lay.spec for lay in layouts}.values())
    alone = full_finetune_savers(setup, methods)
    combos = combined_savers(setup, alone, methods)
    menus = [m for m in adapter_menus(setup) if applied(setup, **dict(m.changes)) is not None]
    # a vision-language step's unwired what-ifs: told, not searched
    skipped = not_modelled(setup, [*((sv.kind, sv.flags, sv.changes) for sv in saver_candidates(setup)),
                                   *((m.kind, m.flags, m.changes) for m in adapter_menus(setup)),
                                   ("offload_optimizer", "--offload-optimizer", (("offload_optimizer", True),)),
                                   *([("offload_param", "--offload-param", (("method", "fsdp"), ("offload_param", True)))]
                                     if any(lay.shards_model_states for lay in layouts) else [])])
    offload_optimizer = applied(setup, offload_optimizer=True) is not None
    # each what-if: (what it tries, its search, how many searches it runs: the longest are handed out first)
    tasks: list[tuple[str, Callable[[], list[dict | None]], int]] = []
    # 1. full fine-tuning kept: each memory saver alone, then the cheap ones together (as each method allows)
    tasks += [(sv.flags, partial(_one, saver_suggestion, savers, sv, setup, layouts, engine_note), 1) for sv in alone]
    if combos:
        tasks.append(("the cheap savers together",
                      partial(_one, combined_suggestion, savers, combos, setup, layouts, engine_note), 1))
    # 2. the longest sequence (a generation objective's: completion) that fits at the smallest batch, and under a
    # generation objective fewer completions (the per-GPU batch is a multiple of what num_generations asks)
    tasks.append(("a shorter sequence", partial(_one, shorter_sequence_suggestion, ctx, setup, layouts), 1))
    if objective_spec(setup.objective).generates:
        tasks.append(("fewer --num-generations", partial(_one, generations_suggestion, ctx, setup, layouts), 1))
    # 3. adapters over a frozen base (LoRA), and over a 4-bit base (QLoRA): the settings that fit
    tasks += [(m.flags, partial(_one, menu_suggestion, savers, m, setup, layouts, engine_note), len(ADAPTER_VARIANTS))
              for m in menus]
    # 4. optimizer states on the CPU; 5. FSDP2's CPU offload of the parameters, gradients and optimizer
    if offload_optimizer:
        tasks.append(("optimizer offload",
                      partial(_one, offload_optimizer_suggestion, savers, setup, layouts, engine_note), 1))
    tasks.append(("--offload-param", partial(_one, offload_param_suggestion, savers, setup, layouts, engine_note), 1))
    # 6. more GPUs of the same type (then also with checkpointing)
    tasks.append(("more GPUs", partial(more_gpus_suggestions, ctx, setup, layouts), 1))
    out = [x for got in _searched(tasks, ctx.options.workers, progress) for x in got]
    if ctx.options.ranking == "paper":
        out.append(suggestion_dict(CPU_OFFLOADING, "LLMem's Algorithm 1 recommends CPU offloading (heterogeneous "
                                   "training) when no method fits at batch 1", None))
    return [x for x in out if x is not None] + skipped   # a what-if its objective refuses is not proposed


def _one(search: Callable[..., dict | None], *args) -> list[dict | None]:
    return [search(*args)]


def _searched(tasks: list[tuple[str, Callable[[], list[dict | None]], int]], workers: int,
              progress: Callable[[str, int, int], None] | None) -> list[list[dict | None]]:
    """The what-ifs' suggestions in order, searched side by side (llmem.planner.side_by_side) on `workers`
    processes, the longest handed out first; `progress` told as each is done."""
    first = sorted(range(len(tasks)), key=lambda i: -tasks[i][2])
    if progress:
        progress(f"what would fit: {tasks[first[0]][0]}", 0, len(tasks))

    def done(i: int, count: int) -> None:
        if progress and count < len(tasks):      # (the last is the plan's own "done")
            progress(f"what would fit: {tasks[i][0]} done", count, len(tasks))

    return side_by_side([search for _, search, _ in tasks], workers, first=first, done=done)
