"""`llmem plan`: the largest batch per distributed method, a step-time model, and a recommendation.

For a model, a GPU type and count, a sequence length and the training options, the planner

1. lists the candidate layouts (`candidate_layouts`): single (one GPU only), ddp, fsdp, zero2, tp over all GPUs
   (only inside one node) and fsdp+tp for every tp dividing the node size with dp >= 2; across nodes HSDP; under
   the llmem engine and the time ranking also pipeline (single, fsdp, tp and fsdp+tp x pp, and fsdp / fsdp+tp x pp
   under HSDP: llmem.setup.layout's scale_out_layouts), context-parallel (fsdp, dp x cp) and, for an MoE,
   expert-parallel (fsdp, the experts over ep of the dp ranks) layouts of every degree the model allows
   (--pp N / --cp N / --ep N: only those). The plain layouts of one node are all searched; the others (HSDP, pp,
   cp, ep, every layout across nodes) only where an upper bound on their tokens/s (the
   time model at the batch cap, then at the largest batch the quick memory bound allows: under --pp the
   pipeline's floor, its first and last stages' schedules built, not replayed) could beat the fastest found, and
   not where a few full estimates prove every batch at which it would is out of memory (search.cannot_win); the
   likeliest fastest searched first (the time model at the quick bound's batch within FIT_SHARE of the limit),
   and every layout left out proved unable to win, so the answer is the one searching them all would give;
2. finds each candidate's largest micro-batch that fits (`max_batch_size`: exponential probe 1, 2, 4, ... then
   bisection over the memory engine, which is monotone in the batch size), with the user's headroom;
3. ranks the candidates, either by the time model below (`--ranking time`, default) or by LLMem's Algorithm 1
   (`--ranking paper`, LLMem §5, llmem.paper.algorithm1: eval = bs * gpu_n * 1.5 for CDP/ddp, bs * gpu_n for ADP/fsdp, bs for TP,
   bs * dp_n for DP+TP; argmax, ties to the earlier of CDP > ADP > TP > DP+TP; CPU offloading when nothing fits);
4. when nothing fits, says what would, each with its largest batch, memory, tokens/s and its time per token
   against the set-up as given (`time_cost_pct`): memory savers that keep full fine-tuning (fused cross-entropy,
   8-bit AdamW, the optimizer step in backward, checkpointing every 2nd / every layer, activation offloading, the
   cheap ones together), a shorter sequence, the LoRA (r16, all linear layers) and QLoRA (the same over a 4-bit
   NF4 base) settings that fit (each tried plain, with fused CE, with checkpointing, with both), optimizer
   offloading, FSDP2's CPU offload of parameters, gradients and optimizer (CPUOffloadPolicy, plain and with
   checkpointing and fused CE, timed with its host <-> device copies and the optimizer step on the host), or more
   GPUs of the same type;
5. writes a table or JSON, a memory-vs-batch plot, and a launch config for the recommended plan (accelerate YAML,
   torchrun script, DeepSpeed JSON).
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

from llmem.errors import LlmemError
from llmem.memory.activations.learned import learning_need
from llmem.model.anatomy import ModelAnatomy, setup_anatomy
from llmem.model.moe import moe_facts
from llmem.model.resolved import resolve
from llmem.model.vision import vision_spec
from llmem.paper.algorithm1 import CPU_OFFLOADING, EVAL_FORMULAS
from llmem.planner.engines import MemoryEngine, memory_engine
from llmem.planner.generation_plan import (
    VllmChoice,
    choose_utilization,
    plan_generation,
    searches_utilization,
)
from llmem.planner.options import PlanOptions
from llmem.planner.search import (
    FIT_SHARE,
    CandidatePlan,
    PlanContext,
    attach_time,
    cannot_win,
    limit_bytes,
    paper_eval,
    rank_by_paper,
    rank_by_time,
    screened,
    tokens_per_s_bound,
)
from llmem.planner.side_by_side import side_by_side
from llmem.planner.suggestions import suggest
from llmem.planner.suggestions.job_phase import job_phase_suggestion
from llmem.planner.timing import HOST_ADAMW_PARAMS_PER_S, PCIE_GBPS, peak_flops_per_s
from llmem.search import BATCH_CAP
from llmem.setup.expert_parallel import check_ep_model, check_expert_parallel
from llmem.setup.generation import with_fixed_steps
from llmem.setup.gpus import GpuSpec, resolve_gpu
from llmem.setup.layout import Layout, ModelLimits, candidate_layouts, gpus_per_node
from llmem.setup.objectives import setup_batch_multiple
from llmem.setup.pipeline import pipeline_schedule
from llmem.setup.training import TrainingSetup
from llmem.units import format_bytes


@dataclass
class Plan:
    setup: TrainingSetup
    anatomy: ModelAnatomy
    gpu: GpuSpec
    options: PlanOptions
    candidates: list[CandidatePlan]
    recommended: CandidatePlan | None
    recommendation: str                  # a label, "cpu-offloading", or "" when nothing fits
    reason: str
    suggestions: list[dict]
    notes: list[str]
    engine: MemoryEngine | None = field(repr=False, default=None)
    dataset_time_s: float | None = None
    generation: dict | None = None       # a generation objective's answer: layout, phases, vLLM (generation_plan)
    what_if_layouts: list[Layout] = field(repr=False, default_factory=list)   # the suggestions' (searched on these)

    @property
    def limit_bytes(self) -> int:
        return limit_bytes(self.gpu, self.options.headroom)

    def to_dict(self) -> dict:
        rec: dict | None
        if self.recommended is not None:
            rec = {**self.recommended.to_dict(), "reason": self.reason}
            if self.dataset_time_s is not None:
                rec["dataset_time_s"] = self.dataset_time_s
        else:
            rec = {"method": self.recommendation or None, "reason": self.reason}
        setup = self.setup.to_dict()
        setup.update({
            "model": self.anatomy.name, "total_params": self.anatomy.total_params, "gpu": self.gpu.name,
            "gpu_memory_bytes": self.gpu.memory_bytes, "headroom": self.options.headroom,
            "limit_bytes": self.limit_bytes, "engine": self.options.engine, "ranking": self.options.ranking,
            "mfu": self.options.mfu, "inter_node_gbps": self.options.inter_node_gbps,
            "global_batch": self.options.global_batch, "dataset_tokens": self.options.dataset_tokens,
            "gpus_per_node": gpus_per_node(self.setup.gpus, self.setup.gpus_per_node),
        })
        setup.pop("method", None)
        setup.pop("batch_size", None)
        out = {"methods": [c.to_dict() for c in self.candidates], "recommended": rec,
               "suggestions": self.suggestions, "setup": setup, "notes": self.notes}
        if self.generation is not None:
            out["generation"] = self.generation
        return out


def plan(setup: TrainingSetup, options: PlanOptions | None = None, *, anatomy: ModelAnatomy | None = None,
         progress: Callable[[str, int, int], None] | None = None) -> Plan:
    """Plan `setup`'s model on setup.gpus GPUs of type setup.gpu (setup.method and batch_size are ignored)."""
    options = options or PlanOptions()
    setup, steps_note = with_fixed_steps(setup)     # GRPO's generation_batch_size: its steps per generation
    anatomy = anatomy or setup_anatomy(setup)
    options, cap_note = vision_batch_cap(setup, anatomy, options)
    options = in_turn_when_learned(setup, anatomy, options)
    gpu = resolve_gpu(setup.gpu, setup.gpu_memory, setup.cuda_context)
    limit = limit_bytes(gpu, options.headroom)
    engine = memory_engine(options.engine, anatomy, gpu, options.m_base_bytes, limit)
    ctx = PlanContext(anatomy, gpu, options, engine, limit)
    layouts = plan_layouts(ctx, setup)
    notes = plan_notes(setup, gpu, options, anatomy) + [n for n in (steps_note, cap_note) if n]
    total_steps = len(layouts) + 1
    search = LayoutSearch(ctx, setup, layouts, notes, progress, total_steps)
    search.run()
    candidates = [search.found[i] for i in sorted(search.found)]   # in the layouts' order: rank_by_time breaks ties
    notes += search_notes(setup, candidates, search.pruned, search.skipped)
    if not candidates:
        raise LlmemError(no_layout_message(search.failures))
    best, recommendation, reason = recommend(candidates, options.ranking)
    layouts = [lay for lay in layouts if lay.pp == lay.cp == lay.ep == 1]     # the what-ifs run on dp x tp layouts
    suggestions = what_would_fit(ctx, setup, layouts, candidates, progress, total_steps)
    result = Plan(setup, anatomy, gpu, options, candidates, best, recommendation, reason, suggestions, notes, engine,
                  what_if_layouts=layouts)
    result.generation = plan_generation(ctx, setup, layouts, best, suggestions, search.vllm_choices)
    if best is not None and best.time is not None and options.dataset_tokens:
        result.dataset_time_s = options.dataset_tokens / best.time.tokens_per_s
    if progress:
        progress("done", total_steps, total_steps)
    return result


@dataclass
class LayoutSearch:
    """The plan's search over its layouts as it runs: the plain dp x tp layouts of one node first, every one searched
    and shown; then the screened ones (HSDP, pp, cp, ep, every layout across nodes), each searched only where its
    bound could beat the fastest found (module docstring, step 1)."""
    ctx: PlanContext
    setup: TrainingSetup
    layouts: list[Layout]
    notes: list[str]                        # the plan's notes: a plain layout's refusal is told there
    progress: Callable[[str, int, int], None] | None
    total_steps: int
    found: dict[int, CandidatePlan] = field(default_factory=dict)
    vllm_choices: dict[str, VllmChoice] = field(default_factory=dict)
    bounds: dict[int, float] = field(default_factory=dict)     # the screened layouts' tokens/s bounds at the cap
    skipped: list[str] = field(default_factory=list)           # screened layouts the set-up cannot run
    pruned: list[str] = field(default_factory=list)            # screened layouts proved unable to win
    deferred: list[tuple[int, Layout]] = field(default_factory=list)   # out of memory by their bound
    failures: dict[str, list[Layout]] = field(default_factory=dict)   # each refusal's reason: the layouts it refused

    def run(self) -> None:
        ctx, setup = self.ctx, self.setup
        plain = [(i, lay) for i, lay in enumerate(self.layouts) if not screened(lay) or not _screens(ctx, setup)]
        rest = [(i, lay) for i, lay in enumerate(self.layouts) if (i, lay) not in plain]
        self.bounds = {i: tokens_per_s_bound(ctx, setup, lay, at_cap=True) for i, lay in rest}   # no estimate: cheap
        self.search_all(plain)
        self.search_screened(rest)
        if not any(c.fits for c in self.found.values()):    # searched only if nothing fits
            self.search_all(self.deferred)
        else:
            self.pruned += [layout.label for _, layout in self.deferred]

    def search_all(self, layouts: list[tuple[int, Layout]]) -> None:
        """Layouts whose searches do not depend on each other's answers, side by side on the plan's workers
        (llmem.planner.side_by_side), recorded in their order."""
        def done(k: int, count: int) -> None:
            if self.progress:
                self.progress(f"searched {layouts[k][1].label}", len(self.found) + count, self.total_steps)

        outcomes = side_by_side([partial(self.searched, layout) for _, layout in layouts], self.ctx.options.workers,
                                done=done)
        for (i, layout), outcome in zip(layouts, outcomes, strict=True):
            self.record(i, layout, outcome)

    def search(self, i: int, layout: Layout) -> None:
        """One layout's search, here."""
        if self.progress:
            self.progress(f"searching {layout.label}", len(self.found), self.total_steps)
        self.record(i, layout, self.searched(layout))

    def searched(self, layout: Layout) -> tuple[CandidatePlan | None, VllmChoice | None, LlmemError | None]:
        """One layout's largest batch (and, under GRPO --use-vllm colocate, its vLLM utilization), timed; or the
        set-up's refusal there. Changes nothing of the search's (`record` keeps it)."""
        ctx, setup = self.ctx, self.setup
        choice = None
        try:
            if searches_utilization(setup):     # GRPO --use-vllm colocate: its utilization searched too
                c, _, choice = choose_utilization(ctx, setup, layout)
            else:
                c = ctx.search(setup, layout)
        except LlmemError as exc:
            return None, None, exc
        if choice is None:                       # choose_utilization timed it at its utilization
            attach_time(ctx, c, setup)
        if ctx.options.ranking == "paper":
            c.eval = paper_eval(layout, c.max_batch_size)
        return c, choice, None

    def record(self, i: int, layout: Layout,
               outcome: tuple[CandidatePlan | None, VllmChoice | None, LlmemError | None]) -> None:
        """A layout's search as the plan keeps it: its candidate (and vLLM choice), or its refusal told."""
        c, choice, exc = outcome
        if exc is not None:
            (self.skipped if i in self.bounds and not _fixed(self.setup) else self.notes).append(
                f"{layout.label} skipped: {exc}")
            self.failures.setdefault(str(exc), []).append(layout)
            return
        if choice is not None:
            self.vllm_choices[layout.label] = choice
        self.found[i] = c

    def search_screened(self, rest: list[tuple[int, Layout]]) -> None:
        """The screened layouts best first: the highest bound popped, refined (the time model at the quick memory
        bound's batch) and pushed back, searched once its likely tokens/s (the same at the quick bound's batch within
        FIT_SHARE of the limit, where a step likely stops fitting: the fastest found early proves more of the rest
        out) is the highest; each pruned where its bound is not above the fastest found (a tie goes to the earlier
        layout, as rank_by_time breaks it), or where every batch at which it would be is out of memory (cannot_win:
        a few estimates). The order decides which are searched, not the answer: every pruned layout is proved not to
        be it."""
        ctx, setup, bounds = self.ctx, self.setup, self.bounds
        queue = [(-bounds[i], i, False, bounds[i]) for i, _ in rest]     # (-priority, index, refined, bound)
        heapq.heapify(queue)
        while queue:
            _, i, refined, bound = heapq.heappop(queue)
            layout, best = self.layouts[i], rank_by_time([self.found[k] for k in sorted(self.found)])
            earlier = best is not None and i < self.layouts.index(best.layout)

            def wins(tps: float, best: CandidatePlan | None = best, earlier: bool = earlier) -> bool:
                return best is None or _may_win(tps, best, earlier)

            if not wins(bound):
                self.pruned.append(layout.label)
            elif not refined:
                tight = tokens_per_s_bound(ctx, setup, layout)
                if best is None and tight == 0.0:
                    self.deferred.append((i, layout))
                else:
                    likely = tokens_per_s_bound(ctx, setup, layout, slack=FIT_SHARE - 1) if tight else 0.0
                    heapq.heappush(queue, (-min(likely, tight), i, True, tight))
            elif best is not None and cannot_win(ctx, setup, layout, wins):
                self.pruned.append(layout.label)
            else:
                self.search(i, layout)


def search_notes(setup: TrainingSetup, candidates: list[CandidatePlan], pruned: list[str],
                 skipped: list[str]) -> list[str]:
    """What the plan tells about the layouts it searched: the expert-parallel and pipeline layouts' assumptions,
    those the bounds proved unable to win, those the set-up cannot run."""
    notes = []
    if any(c.layout.ep > 1 for c in candidates):
        notes.append(expert_parallel_note(setup))
    if any(c.layout.pp > 1 for c in candidates):
        notes.append(f"pipeline layouts: {setup.pp_schedule} over m micro-batches per step (--pp-microbatches, "
                     "default pp: the fewest torch's schedules take), timed with its bubble, the busiest stage and "
                     "the stage-to-stage sends (llmem.planner.parallel_time)")
    if pruned:
        notes.append(f"not searched, as an upper bound on their tokens/s (the time model at their largest possible "
                     f"micro-batch; 0 where the quick memory bound rules out batch 1) is not above the fastest "
                     f"found, or every micro-batch at which it would be is out of memory: {', '.join(pruned)}")
    if skipped:
        notes.append(f"{len(skipped)} pipeline / context- / expert-parallel / HSDP layout(s) this set-up cannot run: "
                     + skipped[0] + (" (and the like)" if len(skipped) > 1 else ""))
    return notes


def no_layout_message(failures: dict[str, list[Layout]]) -> str:
    """Why no layout could be estimated, the reason first: the one every layout was refused for (reasons that differ
    only in naming the layout's own method are one, naming them all), then which layouts; else each reason with its
    layouts, those of the plain dp x tp layouts first (the scale-out ones' refusals are theirs), then the most
    common (the first met on ties)."""
    grouped: dict[str, list[Layout]] = {}
    for reason, layouts in failures.items():
        for lay in layouts:
            grouped.setdefault(_method_named(reason, lay.method, METHOD_SLOT), []).append(lay)

    def said(reason: str, layouts: list[Layout]) -> str:
        return reason.replace(METHOD_SLOT, ", ".join(dict.fromkeys(lay.method for lay in layouts)))

    def labels(layouts: list[Layout]) -> str:
        return ", ".join(lay.label for lay in layouts)

    if len(grouped) == 1:
        (reason, layouts), = grouped.items()
        return f"{said(reason, layouts)} (no layout could be estimated: {labels(layouts)})"
    (first, lays), *rest = sorted(grouped.items(), key=lambda x: (all(screened(lay) for lay in x[1]), -len(x[1])))
    return (f"{said(first, lays)} ({labels(lays)}); no other layout could be estimated either: "
            + "; ".join(f"{said(reason, others)} ({labels(others)})" for reason, others in rest))


METHOD_SLOT = "\x00method\x00"     # where a refusal names the refused layout's own method


def _method_named(reason: str, method: str, slot: str) -> str:
    """`reason` with `method` where it stands as a name of its own (not inside ds-zero2, fsdp+tp, --tp) as `slot`."""
    return re.sub(rf"(?<![\w+-]){re.escape(method)}(?![\w+-])", slot, reason)


def recommend(candidates: list[CandidatePlan], ranking: str) -> tuple[CandidatePlan | None, str, str]:
    """The recommended plan, its label ("cpu-offloading" or "" when nothing fits) and the reason: by LLMem's
    Algorithm 1 (`--ranking paper`) or by the time model."""
    if ranking == "paper":
        best = rank_by_paper(candidates)
        if best is None:
            return best, CPU_OFFLOADING, ("Algorithm 1: every method's eval is 0 (nothing fits at batch 1), so CPU "
                                          "offloading (heterogeneous training)")
        return best, best.layout.label, (f"Algorithm 1: largest eval {best.eval:g} (max batch "
                                         f"{best.max_batch_size}; eval = "
                                         + EVAL_FORMULAS[best.layout.spec.paper_name] + ")")
    best = rank_by_time(candidates)
    blocked = [c for c in candidates if c.blocked_by]
    if best is None and blocked:
        return best, "", (f"the step fits on {len(blocked)} layout(s), but the job runs out of memory in its "
                          f"{blocked[0].blocked_by} phase; see the suggestions")
    if best is None:
        return best, "", "nothing fits at batch 1 on these GPUs; see the suggestions"
    piped = f" x {best.time.pp_microbatches} pipeline micro-batches" if best.layout.pp > 1 else ""
    return best, best.layout.label, (f"fastest by the time model: {best.time.tokens_per_s:,.0f} tokens/s at "
                                     f"micro-batch {best.time.micro_batch_size}{piped} x "
                                     f"{best.time.accumulation_steps} accumulation step(s)")


def what_would_fit(ctx: PlanContext, setup: TrainingSetup, layouts: list[Layout], candidates: list[CandidatePlan],
                   progress: Callable[[str, int, int], None] | None, total_steps: int) -> list[dict]:
    """The suggestions when no candidate fits (none otherwise): every what-if searched on every dp x tp layout that
    can run it (screened by the quick bound: llmem.planner.suggestions.fitting), its progress after the layouts'."""
    if any(c.fits for c in candidates) or not layouts:
        return []
    blocked = [c for c in candidates if c.blocked_by]
    if blocked:      # the step fits: what blocks is a phase no step-side change (adapters, savers, GPUs) shrinks
        return [job_phase_suggestion(blocked)]
    if progress:
        progress("looking for what would fit", len(layouts), total_steps)
    return suggest(ctx, setup, layouts, progress=progress and (
        lambda what, i, n: progress(what, len(layouts) + i, len(layouts) + n + 1)))


def _may_win(bound: float, best: CandidatePlan, earlier: bool) -> bool:
    """Whether a layout whose tokens/s is at most `bound` could still be the answer against `best`."""
    return bound > best.time.tokens_per_s or (earlier and bound == best.time.tokens_per_s)


def _fixed(setup: TrainingSetup) -> bool:
    """--pp N, --cp N or --ep N given: the plan searches only that degree."""
    return setup.pp > 1 or setup.cp > 1 or setup.ep > 1


def _screens(ctx: PlanContext, setup: TrainingSetup) -> bool:
    """Whether screened layouts may be skipped by their bound: under the time ranking, not when the user fixed
    the degree (then those are all there is), nor where the plan searches vLLM's utilization too (the bound does
    not model it)."""
    return ctx.options.ranking == "time" and ctx.engine.has_quick and not _fixed(setup) \
        and not searches_utilization(setup)


def plan_layouts(ctx: PlanContext, setup: TrainingSetup) -> list[Layout]:
    """The layouts a plan searches: candidate_layouts of the set-up's GPUs, with the pipeline, context- and
    expert-parallel ones under the llmem engine and the time ranking (--pp / --cp / --ep N: only N; the degrees
    the model allows)."""
    scale_out = ctx.options.engine == "llmem" and ctx.options.ranking == "time" and ctx.options.layouts == "all"
    if _fixed(setup) and not scale_out:
        raise LlmemError("plan --pp / --cp / --ep searches with the llmem engine, the time ranking and --layouts "
                         "all: drop --engine paper / --ranking paper / --layouts dp-tp")
    if setup.ep > 1:    # a dense model or too many ranks for its experts: expert_parallel's one line
        facts = moe_facts(ctx.anatomy)
        check_ep_model(setup.ep, facts.experts if facts else None, setup.gpus)
    limits = ModelLimits(ctx.anatomy.num_layers, setup.seq_len,
                         setup.pp_virtual_stages or pipeline_schedule(setup.pp_schedule).virtual_stages,
                         expert_parallel_experts(ctx.anatomy, setup))
    layouts = candidate_layouts(setup.gpus, setup.gpus_per_node, *ctx.heads, methods=ctx.options.methods,
                                tp=ctx.options.tp, limits=limits if scale_out else None,
                                pp=setup.pp if setup.pp > 1 else None, cp=setup.cp if setup.cp > 1 else None,
                                ep=setup.ep if setup.ep > 1 else None)
    if not layouts:
        what = f" with --pp {setup.pp}" if setup.pp > 1 else f" with --cp {setup.cp}" if setup.cp > 1 else \
            f" with --ep {setup.ep}" if setup.ep > 1 else ""
        raise LlmemError(f"no layout of {setup.gpus} GPU(s){what} matches the requested method/tp for "
                         f"{ctx.anatomy.name}: choose another degree or method")
    return layouts


def expert_parallel_experts(anatomy: ModelAnatomy, setup: TrainingSetup) -> int:
    """The routed experts the plan's expert-parallel layouts split (ModelLimits.experts): 0 for a dense model, or
    where the set-up's options are ones expert_parallel refuses under --ep (adapters, offloading, --fused-ce, ...)."""
    facts = moe_facts(anatomy)
    if facts is None:
        return 0
    try:        # the set-up's own options under FSDP2 x EP (the layout's refusals are the layout search's)
        check_expert_parallel(replace(setup, method="fsdp", tp=None, dp_replicate=1, pp=1, cp=1,
                                      ep=max(setup.ep, setup.gpus)))
    except LlmemError:
        return 0
    return facts.experts


def expert_parallel_note(setup: TrainingSetup) -> str:
    """What the plan's expert-parallel layouts assume (llmem.setup.expert_parallel)."""
    routing = "balanced routing" if setup.ep_imbalance == 1.0 else f"routing imbalance {setup.ep_imbalance:g}"
    return (f"expert-parallel layouts (fsdp, dp N, ep E: the routed experts over E of the N FSDP2 ranks, "
            f"torchtitan's efsdp x ep): {routing} (--ep-imbalance), their dispatch / combine all-to-alls timed and "
            "never hidden (llmem.planner.timing.ep_alltoall_time_s)")


def fits_note(gpu: GpuSpec, options: PlanOptions) -> str:
    limit = f"{100 * (1 - options.headroom):g}% of {format_bytes(gpu.memory_bytes)} = " \
            f"{format_bytes(limit_bytes(gpu, options.headroom))}"
    if options.engine == "paper":
        return f"fits: device-used memory <= {limit} (engine paper)"
    return (f"fits: the step's allocations complete within {limit} less the CUDA context, as PyTorch decides OOM "
            f"(the allocator releases its cache and retries when full); engine {options.engine}")


# A vision-language step's batch search stops at this many images per GPU unless --max-batch says otherwise: its
# vision side is learned from the real code at each micro-batch searched, and that run's host memory grows faster
# than the images (tiny-qwen2_5_vl at 448x448: 0.4 GB at 16 images, 2.2 GB at 256; a plan searching up to
# BATCH_CAP took 24 GB and was killed)
VISION_BATCH_IMAGES = 64


def vision_batch_cap(setup: TrainingSetup, anatomy: ModelAnatomy,
                     options: PlanOptions) -> tuple[PlanOptions, str | None]:
    """The plan's options with the batch search capped at VISION_BATCH_IMAGES images per GPU for a vision-language
    step where --max-batch is the default (a user's --max-batch stands), and the note saying so."""
    if vision_spec(anatomy.model_type) is None or not setup.images_per_sample or options.batch_cap != BATCH_CAP:
        return options, None
    cap = max(1, VISION_BATCH_IMAGES // setup.images_per_sample)
    return replace(options, batch_cap=cap), (
        f"the batch search stops at {cap} sample(s) a GPU ({VISION_BATCH_IMAGES} images): the vision side is learned "
        "from the real code at each micro-batch searched, and that run's host memory grows faster than its images; "
        "--max-batch N searches further")


def in_turn_when_learned(setup: TrainingSetup, anatomy: ModelAnatomy, options: PlanOptions) -> PlanOptions:
    """The plan's searches in turn where its activations are learned (a vision-language step, --compile, a family
    or peft type without a recipe: llmem.learn runs the real model at each set-up and batch): side by side, each
    worker would learn again what another learned, at seconds of CPU and a torch process's memory each."""
    if options.workers <= 1:
        return options
    try:
        learns, _ = learning_need(resolve(replace(setup, method="single", gpus=1, tp=1), anatomy))
    except LlmemError:         # not a one-GPU set-up: the layouts' searches tell what is wrong with it
        return options
    return replace(options, workers=1) if learns else options


def plan_notes(setup: TrainingSetup, gpu: GpuSpec, options: PlanOptions, anatomy: ModelAnatomy) -> list[str]:
    notes = [
        fits_note(gpu, options),
        f"time model: {gpu.name} peak {peak_flops_per_s(gpu, setup.precision) / 1e12:g} TFLOP/s for "
        f"{setup.precision} x MFU {options.mfu:g}; links {gpu.link_gbps:g} GB/s in a node, "
        f"{options.inter_node_gbps:g} GB/s per GPU across nodes; optimizer step, data loading not timed "
        f"(except the host's step under CPU offload: {HOST_ADAMW_PARAMS_PER_S / 1e9:g} G parameters/s per rank, "
        f"host <-> device copies at {PCIE_GBPS:g} GB/s)",
    ]
    if not setup.precision_spec.low_precision:
        notes.append("fp32 matmuls timed as TF32 (half the bf16 peak) on Ampere and newer, 1/8 of it before")
    if options.engine == "paper":
        notes.append("paper engine: LLMem's equations (fp16 mixed precision, Gemini chunks, gradient "
                     "checkpointing assumed); the time model still uses the setup given")
    if setup.batch_size != setup_batch_multiple(setup) and setup.pp == 1:
        notes.append("--batch-size is ignored by plan: the largest micro-batch is searched")
    if vision_spec(anatomy.model_type) is not None:
        notes.append("a vision-language step: searched on one GPU, DDP and FSDP2 (fsdp / zero2: each vision block a "
                     "unit of its own, as accelerate's auto-wrap makes it), and DeepSpeed's ds-zero1/2/3 when --method "
                     "names them (ZeRO-3 fetching the tower's pieces as its hooks do); its vision side is learned from the real "
                     "code at each micro-batch searched (cached); the time model runs --seq-len tokens through "
                     "every weight (the images' tokens and the tower's patches are not timed apart): its tokens/s "
                     "rank the layouts, not the run's throughput")
    if setup.optimizer_in_backward and options.global_batch:
        notes.append("--optimizer-in-backward cannot accumulate gradients: each step is one micro-batch per GPU, "
                     "so --global-batch is reached only when it fits in one micro-batch x data-parallel ranks")
    return notes

