"""What would fit when nothing does (`llmem plan`'s suggestions): memory savers that keep full fine-tuning, a shorter
sequence, the LoRA and QLoRA settings that fit, optimizer offload, FSDP2's CPU offload of parameters, gradients and
optimizer, more GPUs; each with its largest batch, memory, tokens/s and its time per token against the set-up as
given."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from llmem.errors import LlmemError
from llmem.estimator.states import cpu_offload_host_bytes, offloaded_optimizer_host_bytes
from llmem.model.resolved import assemble, setup_for
from llmem.paper.algorithm1 import CPU_OFFLOADING
from llmem.planner.engines import LlmemEngine, fits_within
from llmem.planner.search import (
    CandidatePlan,
    PlanContext,
    attach_time,
    frozen_base_trainable_params,
    rank_by_time,
    time_at_max_batch,
    timed,
)
from llmem.planner.timing import accumulation_for
from llmem.search import calibrated_max, max_batch_size
from llmem.setup.generation import completion_length, num_generations, prompt_length
from llmem.setup.layout import Layout, candidate_layouts, gpus_per_node
from llmem.setup.methods import MethodSpec
from llmem.setup.objectives import batch_multiple, objective_spec, setup_batch_multiple
from llmem.setup.optimizers import EIGHT_BIT_ALTERNATIVE
from llmem.setup.support import check_support
from llmem.setup.training import LORA_ALL_LINEAR, TrainingSetup
from llmem.units import format_bytes

LORA_RANK = 16
LORA_TARGETS = LORA_ALL_LINEAR
MAX_SUGGESTED_GPUS = 64
# Each what-if is searched on every layout that can run it, screened by the engine's quick bound at batch 1 (tensor
# bytes at the step's largest moment, ~1 ms): a layout whose bound exceeds the limit by more than QUICK_SLACK is
# not batch-searched (the bound lay within 0.98-1.16x of the allocated peak on the sweeps, and the allocated peak
# never exceeds what the step needs); the CLOSEST_LAYOUTS with the lowest bound are always searched, so a what-if
# that fits nowhere is reported against full estimates of its nearest layouts.
QUICK_SLACK = 0.25
CLOSEST_LAYOUTS = 3
CHEAP_SAVERS = ("fused_ce", "optimizer_8bit", "grad_ckpt")   # the savers tried together ("combined")


def plan_layouts(ctx: PlanContext, gpus: int, per_node: int | None) -> list[Layout]:
    """Every layout the plan may use on `gpus` GPUs (the plan's --method / --tp restrictions kept)."""
    return candidate_layouts(gpus, per_node, *ctx.heads, methods=ctx.options.methods, tp=ctx.options.tp)


def supports(setup: TrainingSetup | None, method: MethodSpec) -> bool:
    """Whether `method` may run `setup`: the set-up's own validation with that method (its objective's refusals:
    GRPO's methods, its options) and the support check (llmem.setup.support, the engines' own). None (a what-if
    the validation refused: `applied`) is never supported."""
    if setup is None:
        return False
    gpus = 1 if method.one_gpu else setup.gpus
    try:
        s = replace(setup, method=method.name, gpus=gpus, batch_size=setup_batch_multiple(setup, gpus))
        check_support(s, method)
    except LlmemError:
        return False
    return True


def applied(setup: TrainingSetup, **changes) -> TrainingSetup | None:
    """`setup` with `changes`, or None where its validation refuses them (an option its objective does not take,
    e.g. --fused-ce under GRPO): the what-if is then not proposed."""
    try:
        return replace(setup, **changes)
    except LlmemError:
        return None


def screened_layouts(ctx: PlanContext, setup: TrainingSetup, layouts: list[Layout],
                     closest: int = CLOSEST_LAYOUTS) -> list[Layout]:
    """The layouts worth a full batch search for `setup`: those whose method supports it and whose quick bound at
    batch 1 does not rule them out, and at least the `closest` nearest by that bound; in the given order."""
    runnable = [lay for lay in layouts if supports(setup, lay.spec)]
    if not ctx.engine.has_quick:
        return runnable
    scored: list[tuple[int, int, Layout]] = []
    for i, lay in enumerate(runnable):
        try:
            scored.append((ctx.engine.quick(setup_for(setup, lay, setup_batch_multiple(setup, lay.world_size))), i,
                           lay))
        except LlmemError:          # the model refuses it (e.g. no tensor-parallel plan): not a layout for it
            continue
    scored.sort(key=lambda x: (x[0], x[1]))
    bound = ctx.limit * (1 + QUICK_SLACK)
    keep = {i for k, (q, i, _) in enumerate(scored) if q <= bound or k < closest}
    return [lay for i, lay in enumerate(runnable) if i in keep]


def _best_fitting(ctx: PlanContext, setup: TrainingSetup, layouts: list[Layout], adapter_params: int = 0,
                  offload: bool = False, closest: int = CLOSEST_LAYOUTS
                  ) -> tuple[CandidatePlan | None, list[CandidatePlan]]:
    """The fastest fitting plan of `setup` over every layout in `layouts` that can run it (screened by the quick
    bound, then batch-searched with full estimates), and every plan searched. With ctx.prune, a layout is not
    searched once a bound proves it cannot change the answer: its tokens/s at its quick batch bound is below the
    fastest found, or (nothing fitting yet) its draft is out of memory and needs more than the nearest searched;
    the answer and the closest plan are those of searching every screened layout."""
    screened = screened_layouts(ctx, setup, layouts, closest)
    order = list(enumerate(screened))
    uppers = {i: float("inf") for i, _ in order}
    floors: dict[int, float | None] = {i: None for i, _ in order}
    if ctx.prune and ctx.engine.has_quick and len(screened) > 1:
        uppers = {i: _tokens_per_s_bound(ctx, setup, lay, adapter_params, offload) for i, lay in order}
        floors = {i: _out_of_memory_floor(ctx, setup, lay) for i, lay in order}
        # the likely fastest first, so the rest are soon ruled out; then those out of memory, nearest first
        order.sort(key=lambda x: (-uppers[x[0]], floors[x[0]] if floors[x[0]] is not None else -1.0))
    found: dict[int, CandidatePlan] = {}
    best: CandidatePlan | None = None
    nearest = float("inf")
    for i, layout in order:
        if best is not None and uppers[i] < best.time.tokens_per_s:
            continue                 # its tokens/s at its quick batch bound already falls short: it cannot win
        if best is None and floors[i] is not None and floors[i] > nearest:
            continue                 # out of memory, and needs more than the nearest one searched: not the closest
        try:
            c = ctx.search(setup, layout)
        except LlmemError:
            continue
        c.offload_optimizer = offload
        attach_time(ctx, c, setup, adapter_params)
        found[i] = c
        nearest = min(nearest, c.memory.device_used_bytes)
        if c.fits and c.time is not None and (best is None or c.time.tokens_per_s > best.time.tokens_per_s):
            best = c
    plans = [found[i] for i in sorted(found)]       # in the layouts' order: rank_by_time breaks ties by it
    return rank_by_time(plans), plans


def _out_of_memory_floor(ctx: PlanContext, setup: TrainingSetup, layout: Layout) -> float | None:
    """A lower bound on the full estimate's device-used memory at batch 1 where the draft proves it out of memory
    (its allocated peak is exact and over the capacity): the draft's device-used with its reserved peak replaced by
    that allocated peak (the full estimate's reserved is never below its allocated: llmem.estimator.events
    extrapolate); None where the draft does not rule batch 1 out (or cannot be made)."""
    try:
        d = ctx.engine.draft(setup_for(setup, layout, setup_batch_multiple(setup, layout.world_size)))
    except LlmemError:
        return None
    if fits_within(d, ctx.limit) or d.capped_reserved_bytes is not None:
        return None
    return d.device_used_bytes - d.peak_reserved_bytes + d.peak_allocated_bytes


def _tokens_per_s_bound(ctx: PlanContext, setup: TrainingSetup, layout: Layout, adapter_params: int,
                        offload: bool) -> float:
    """An upper bound on the tokens/s `layout` can reach for `setup`: the time model at its quick batch bound
    (tokens/s does not fall as the largest micro-batch grows); 0 where even batch 1 is out of the bound, infinite
    where the bound cannot be computed (then it is searched)."""
    try:
        bound = _quick_batch_bound(ctx, setup, layout)
        if not bound:
            return 0.0
        return time_at_max_batch(ctx, setup, layout, bound, adapter_params, offload).tokens_per_s
    except LlmemError:
        return float("inf")


def _suggestion(kind: str, text: str, c: CandidatePlan | None, **extra) -> dict:
    out = {"kind": kind, "text": text, "fits": bool(c and c.fits)}
    if c is not None:
        out.update({"method": c.layout.method, "label": c.layout.label, "dp": c.layout.dp, "tp": c.layout.tp,
                    "replicas": c.layout.replicas, "gpus": c.layout.world_size, "max_batch_size": c.max_batch_size,
                    "peak_reserved_bytes": c.memory.peak_reserved_bytes,
                    "device_used_bytes": c.memory.device_used_bytes,
                    "step_time_s": c.time.step_s if c.time else None,
                    "tokens_per_s": c.time.tokens_per_s if c.time else None})
    out.update(extra)
    return out


def _closest(plans: list[CandidatePlan]) -> CandidatePlan | None:
    return min(plans, key=lambda c: c.memory.device_used_bytes, default=None)


def _fewest_gpus(ctx: PlanContext, setup: TrainingSetup, methods: tuple[str, ...] | None = None
                 ) -> CandidatePlan | None:
    """The fastest fitting plan on the smallest power-of-two GPU count above setup.gpus (up to 64), or None."""
    n = 1
    while n < MAX_SUGGESTED_GPUS:
        n *= 2
        per = setup.gpus_per_node
        if n <= setup.gpus or (per and n > per and n % per):
            continue
        try:
            layouts = candidate_layouts(n, per, *ctx.heads, methods=methods or ctx.options.methods)
        except LlmemError:
            continue
        more = applied(setup, gpus=n)
        best = _best_fitting(ctx, more, layouts)[0] if more is not None else None
        if best is not None:
            return best
    return None


def describe_fit(c: CandidatePlan | None, plans: list[CandidatePlan], limit: int) -> str:
    if c is not None:
        t = f", {c.time.tokens_per_s:,.0f} tokens/s" if c.time else ""
        return (f"{c.layout.label} fits up to batch {c.max_batch_size} "
                f"({format_bytes(c.memory.device_used_bytes)} at that batch{t})")
    closest = _closest(plans)
    if closest is None:
        return "no layout could be estimated"
    return (f"still does not fit: best {closest.layout.label} needs "
            f"{format_bytes(closest.memory.device_used_bytes)} at batch {_smallest_batch(closest)} (limit "
            f"{format_bytes(limit)})")


def _smallest_batch(c: CandidatePlan) -> int:
    """The batch a plan that does not fit shows its memory at: its smallest (GRPO's num_generations multiple)."""
    setup = c.memory.setup.setup if c.memory.setup is not None else None
    return setup.batch_size if setup is not None else 1


@dataclass(frozen=True)
class Saver:
    """One way to make the step smaller: the set-up fields it changes, the CLI flags that ask for it, its cost."""
    kind: str
    changes: tuple[tuple[str, object], ...]
    flags: str
    cost: str

    def apply(self, setup: TrainingSetup) -> TrainingSetup | None:
        """The set-up with this saver, or None where the set-up's validation refuses it (`applied`)."""
        return applied(setup, **dict(self.changes))


def full_finetune_savers(setup: TrainingSetup, methods: list[MethodSpec]) -> list[Saver]:
    """Ways to keep full fine-tuning with less memory, cheapest in time first: those already on are skipped, and so
    is one no method in `methods` supports (the support check decides). The savers tried together are
    `combined_savers`'."""
    out: list[Saver] = []
    if not setup.fused_ce:
        out.append(Saver("fused_ce", (("fused_ce", True),), "--fused-ce",
                         "no [tokens, vocab] fp32 logits, same FLOPs"))
    optimizer = setup.optimizer_spec
    if optimizer.adam and not optimizer.eight_bit and not setup.offload_optimizer:
        out.append(Saver("optimizer_8bit", (("optimizer", EIGHT_BIT_ALTERNATIVE),),
                         f"--optimizer {EIGHT_BIT_ALTERNATIVE}",
                         "bitsandbytes' 8-bit Adam states, 2 instead of 8 bytes per parameter"))
    if not setup.optimizer_in_backward and not optimizer.eight_bit:
        out.append(Saver("optimizer_in_backward", (("optimizer_in_backward", True),), "--optimizer-in-backward",
                         "each gradient freed after its own update; no gradient accumulation"))
    if not setup.grad_ckpt:
        out.append(Saver("grad_ckpt_every_2", (("grad_ckpt", True), ("ckpt_every", 2)), "--grad-ckpt-every 2",
                         "recomputes half the decoder layers"))
    if not setup.grad_ckpt or setup.ckpt_every > 1:
        out.append(Saver("grad_ckpt", (("grad_ckpt", True), ("ckpt_every", 1)), "--grad-ckpt",
                         "recomputes every decoder layer's forward (about 1/3 more compute)"))
    if not setup.offload_activations:
        out.append(Saver("offload_activations", (("offload_activations", True),), "--offload-activations",
                         "saved activations to pinned host memory and back over PCIe"))
    return [sv for sv in out if any(supports(sv.apply(setup), m) for m in methods)]


def combined_savers(setup: TrainingSetup, savers: list[Saver], methods: list[MethodSpec]
                    ) -> list[tuple[Saver, tuple[str, ...]]]:
    """The cheap savers together, as each method allows them: for every method, those of CHEAP_SAVERS (in order)
    that the support check accepts on top of the ones already taken; one "combined" saver per distinct set of two
    or more, with the methods it is for (8-bit AdamW joins only where plain tensors are kept, fused CE only
    without tensor parallelism, as llmem.setup.support says)."""
    cheap = [sv for sv in savers if sv.kind in CHEAP_SAVERS]
    groups: dict[tuple[str, ...], list[str]] = {}
    for method in methods:
        taken, s = [], setup
        for sv in cheap:
            if supports(sv.apply(s), method):      # None (refused) is not supported
                taken.append(sv)
                s = sv.apply(s)
        if len(taken) > 1:
            names = groups.setdefault(tuple(sv.kind for sv in taken), [])
            if method.name not in names:
                names.append(method.name)
    by_kind = {sv.kind: sv for sv in cheap}
    out = []
    for kinds, names in groups.items():
        chosen = [by_kind[k] for k in kinds]
        out.append((Saver("combined", tuple(c for sv in chosen for c in sv.changes),
                          " ".join(sv.flags for sv in chosen), "; ".join(sv.cost for sv in chosen)), tuple(names)))
    return out


def time_cost_pct(ctx: PlanContext, c: CandidatePlan | None, base: TrainingSetup) -> float | None:
    """Time per token of a suggestion against the set-up as given, at the same layout and micro-batch (the
    given set-up's time is modelled even though it does not fit): + is slower, - faster."""
    if c is None or not c.fits or c.time is None:
        return None
    micro = c.time.micro_batch_size
    try:
        ref = timed(ctx, base, c.layout, micro, c.time.accumulation_steps,
                    frozen_base_trainable_params(setup_for(base, c.layout, micro), ctx.anatomy))
    except LlmemError:      # the set-up as given cannot run that micro-batch (GRPO's num_generations multiple)
        return None
    return 100.0 * (ref.tokens_per_s / c.time.tokens_per_s - 1.0)


def saver_suggestion(ctx: PlanContext, saver: Saver, setup: TrainingSetup, layouts: list[Layout],
                     engine_note: str) -> dict:
    s = saver.apply(setup)
    best, plans = _best_fitting(ctx, s, layouts) if s is not None else (None, [])
    return _saver_dict(ctx, saver, setup, best, plans, engine_note)


def _saver_dict(ctx: PlanContext, saver: Saver, setup: TrainingSetup, best: CandidatePlan | None,
                plans: list[CandidatePlan], engine_note: str, also: str = "", **extra) -> dict:
    cost = time_cost_pct(ctx, best, setup)
    when = f", time per token {cost:+.0f} %" if cost is not None else ""
    return _suggestion(saver.kind, f"{saver.flags} ({saver.cost}{when}): " + describe_fit(best, plans, ctx.limit)
                       + also + engine_note,
                       best or _closest(plans), flags=saver.flags, time_cost_pct=cost,
                       changes=dict(saver.changes), **extra)


def combined_suggestion(ctx: PlanContext, combos: list[tuple[Saver, tuple[str, ...]]], setup: TrainingSetup,
                        layouts: list[Layout], engine_note: str) -> dict:
    """The cheap savers together: each method's combination searched on that method's layouts; the fastest that
    fits (else the closest) is the suggestion, the others are listed under `alternatives`."""
    tried = []
    for saver, methods in combos:
        best, plans = _best_fitting(ctx, saver.apply(setup), [lay for lay in layouts if lay.method in methods])
        tried.append((saver, best, plans))
    fitting = [(sv, b, p) for sv, b, p in tried if b is not None]
    if fitting:
        pick = max(fitting, key=lambda x: x[1].time.tokens_per_s)
    else:
        pick = min(tried, key=lambda x: _closest(x[2]).memory.device_used_bytes if x[2] else float("inf"))
    alternatives = []
    for sv, b, p in tried:
        if sv is pick[0]:
            continue
        c = b or _closest(p)
        alternatives.append({"flags": sv.flags, "fits": b is not None, "label": c.layout.label if c else None,
                             "max_batch_size": b.max_batch_size if b else 0,
                             "device_used_bytes": c.memory.device_used_bytes if c else None})
    also = "".join(f"; {a['flags']}: {a['label']} " + (f"batch {a['max_batch_size']}" if a["fits"] else
                                                        f"needs {format_bytes(a['device_used_bytes'])}")
                   for a in alternatives if a["label"])
    return _saver_dict(ctx, pick[0], setup, pick[1], pick[2], engine_note,
                       also=f" (also tried{also[1:]})" if also else "", alternatives=alternatives)


@dataclass(frozen=True)
class AdapterMenu:
    """Adapters over a frozen base, tried with the activation savers that matter most for them."""
    kind: str
    title: str
    changes: tuple[tuple[str, object], ...]
    flags: str
    sharded: bool | None = None     # only layouts that shard model states (True), that replicate them (False), any


# (field, value, flag) sets tried on top of each adapter menu, cheapest in time first
ADAPTER_VARIANTS: tuple[tuple[tuple[str, object, str], ...], ...] = (
    (),
    (("fused_ce", True, "--fused-ce"),),
    (("grad_ckpt", True, "--grad-ckpt"),),
    (("grad_ckpt", True, "--grad-ckpt"), ("fused_ce", True, "--fused-ce")),
)


def adapter_menus(setup: TrainingSetup) -> list[AdapterMenu]:
    """LoRA r16 on all linear layers over the base as given, and the same over a 4-bit NF4 base as each framework
    runs it:
    - QLoRA, HF/TRL's recipe: bitsandbytes NF4 with prepare_model_for_kbit_training's fp32 upcast, under autocast
      (TRL's bf16=True; so pure bf16 becomes bf16-mixed), on one GPU or DDP;
    - FSDP-QLoRA on several GPUs (Answer.AI's recipe, TRL, axolotl): the NF4 weights packed in the compute dtype
      (bnb_4bit_quant_storage) and sharded by FSDP2 / zero2, without the upcast (TRL and axolotl skip it there);
    - for a pure bf16 / fp32 set-up with LoRA, torchtune's QLoRA: torchao's NF4Tensor, adapters in the model dtype,
      no upcast, on any layout.
    A set-up that already trains adapters gets the QLoRA menus on its own adapters; a quantised one gets none."""
    if setup.quant_spec.quantised:
        return []
    lora = (("lora_rank", LORA_RANK), ("lora_targets", LORA_TARGETS))
    lora_flags = f"--lora-rank {LORA_RANK} --lora-targets {LORA_TARGETS}"
    menus = []
    if not setup.peft:
        menus.append(AdapterMenu("lora", f"LoRA r={LORA_RANK} on all linear layers", lora, lora_flags))
    else:
        lora, lora_flags = (), ""
    with_lora = f" with LoRA r={LORA_RANK} on all linear layers" if lora else " with the given adapters"
    mixed = {"bf16": "bf16-mixed", "fp16": "fp16-mixed"}.get(setup.precision)
    precision = (("precision", mixed),) if mixed else ()

    def flags(*parts: str) -> str:
        return " ".join(f for f in (*parts, lora_flags, f"--precision {mixed}" if mixed else "") if f)

    menus.append(AdapterMenu("qlora", "QLoRA (bitsandbytes 4-bit NF4 base, double quantisation)" + with_lora,
                             (("quant_base", "nf4"),) + lora + precision, flags("--qlora"),
                             sharded=False if setup.gpus > 1 else None))
    if setup.gpus > 1:
        menus.append(AdapterMenu(
            "fsdp-qlora", "FSDP-QLoRA (NF4 base packed in the compute dtype and sharded, no kbit upcast)" + with_lora,
            (("quant_base", "nf4"), ("kbit_upcast", False)) + lora + precision,
            flags("--qlora", "--no-kbit-upcast"), sharded=True))
    if setup.precision in ("bf16", "fp32") and not setup.peft_config:
        base = (("adapter_dtype", "base"),) if setup.precision == "bf16" else ()
        menus.append(AdapterMenu(
            "qlora-torchao", "torchtune's QLoRA (torchao NF4Tensor base, adapters in the model dtype)" + with_lora,
            (("quant_base", "torchao-nf4"),) + base + lora,
            " ".join(f for f in ("--qlora-torchao", "--adapter-dtype base" if base else "", lora_flags) if f)))
    return menus


def menu_suggestion(ctx: PlanContext, menu: AdapterMenu, setup: TrainingSetup, layouts: list[Layout],
                    engine_note: str) -> dict | None:
    """Every variant of the menu that fits, with its largest batch and speed; the fastest is the suggestion (None
    where the set-up's objective refuses the menu)."""
    base = applied(setup, **dict(menu.changes))
    if base is None:          # the objective refuses the menu (e.g. QLoRA under GRPO): not proposed
        return None
    if menu.sharded is not None:
        layouts = [lay for lay in layouts if lay.shards_model_states == menu.sharded]
    settings: list[dict] = []
    fastest: tuple[CandidatePlan, str, tuple] | None = None
    closest: CandidatePlan | None = None
    tried: set[tuple] = set()
    for variant in ADAPTER_VARIANTS:
        changes = tuple((k, v) for k, v, _ in variant if getattr(base, k) != v)   # what the set-up lacks
        if changes in tried:
            continue
        tried.add(changes)
        flags = " ".join(f for k, v, f in variant if (k, v) in changes)
        s = applied(base, **dict(changes))
        if s is None:         # the objective refuses the variant (e.g. --fused-ce under GRPO)
            continue
        best, plans = _best_fitting(ctx, s, layouts)
        all_flags = " ".join(f for f in (menu.flags, flags) if f)
        pick = best or _closest(plans)
        if pick is not None and (closest is None
                                 or pick.memory.device_used_bytes < closest.memory.device_used_bytes):
            closest = pick
        settings.append({"flags": all_flags, "fits": best is not None,
                         "max_batch_size": best.max_batch_size if best else 0,
                         "label": pick.layout.label if pick else None,
                         "device_used_bytes": pick.memory.device_used_bytes if pick else None,
                         "tokens_per_s": best.time.tokens_per_s if best and best.time else None,
                         "time_cost_pct": time_cost_pct(ctx, best, setup)})
        if best is not None and best.time is not None and (
                fastest is None or best.time.tokens_per_s > fastest[0].time.tokens_per_s):
            fastest = (best, all_flags, changes)
    trainable = frozen_base_trainable_params(base, ctx.anatomy)
    head = f"{menu.title} ({trainable:,} trainable parameters)"
    if fastest is None:
        text = f"{head}: no setting fits — " + describe_fit(None, [closest] if closest else [], ctx.limit)
        return _suggestion(menu.kind, text + engine_note, closest, flags=menu.flags, settings=settings,
                           adapter_params=trainable, changes=dict(menu.changes))
    best, flags, changes = fastest
    fitting = [x for x in settings if x["fits"]]
    others = "; ".join(f"{x['flags']}: batch {x['max_batch_size']}" for x in fitting if x["flags"] != flags)
    text = (f"{head}: {flags} — {describe_fit(best, [], ctx.limit)}"
            + (f"; also fits: {others}" if others else "") + engine_note)
    return _suggestion(menu.kind, text, best, flags=flags, settings=settings, adapter_params=trainable,
                       time_cost_pct=time_cost_pct(ctx, best, setup),
                       changes={**dict(menu.changes), **dict(changes)})


def suggest(ctx: PlanContext, setup: TrainingSetup, layouts: list[Layout] | None = None,
            progress: Callable[[str, int, int], None] | None = None) -> list[dict]:
    """What would fit when nothing does: memory savers that keep full fine-tuning (fused CE, 8-bit AdamW, the
    optimizer step in backward, checkpointing every 2nd / every layer, activation offloading, the cheap ones
    together as each method allows them), a shorter sequence, the LoRA and QLoRA settings that fit, optimizer
    offload, more GPUs. Each is searched over every layout in `layouts` (default: every layout of the plan on
    setup.gpus GPUs) that can run it. `progress(description, done, total)` is told as each what-if begins."""
    anatomy, gpu, options, engine, limit = ctx.anatomy, ctx.gpu, ctx.options, ctx.engine, ctx.limit
    if layouts is None:
        layouts = plan_layouts(ctx, setup.gpus, setup.gpus_per_node)
    out: list[dict] = []
    # the paper's equations model none of the savers: they are always priced by the llmem estimator
    engine_note = " (memory from the llmem estimator: the paper engine does not model it)" \
        if options.engine == "paper" else ""
    savers = ctx if isinstance(engine, LlmemEngine) else replace(ctx, engine=LlmemEngine(anatomy, gpu, limit))

    def describe(c: CandidatePlan | None, plans: list[CandidatePlan]) -> str:
        return describe_fit(c, plans, limit)

    # 1. full fine-tuning kept: each memory saver alone, then the cheap ones together (as each method allows)
    methods = list({lay.spec.name: lay.spec for lay in layouts}.values())
    alone = full_finetune_savers(setup, methods)
    combos = combined_savers(setup, alone, methods)
    menus = [m for m in adapter_menus(setup) if applied(setup, **dict(m.changes)) is not None]
    fewer = objective_spec(setup.objective).generates
    steps = [sv.flags for sv in alone] + (["the cheap savers together"] if combos else []) + [
        "a shorter sequence", *(["fewer --num-generations"] if fewer else []), *(m.flags for m in menus),
        "optimizer offload", "--offload-param", "more GPUs"]
    done = iter(range(len(steps)))

    def tick() -> None:
        i = next(done)
        if progress:
            progress(f"what would fit: {steps[i]}", i, len(steps))

    for saver in alone:
        tick()
        out.append(saver_suggestion(savers, saver, setup, layouts, engine_note))
    if combos:
        tick()
        out.append(combined_suggestion(savers, combos, setup, layouts, engine_note))
    # 2. the longest sequence (a generation objective's: completion) that fits at the smallest batch
    tick()
    out.append(shorter_sequence_suggestion(ctx, setup, layouts))
    if fewer:       # a generation objective: the per-GPU batch is a multiple of what num_generations asks
        tick()
        generations = generations_suggestion(ctx, setup, layouts)
        if generations is not None:
            out.append(generations)
    # 3. adapters over a frozen base (LoRA), and over a 4-bit base (QLoRA): the settings that fit
    for menu in menus:
        tick()
        menu_out = menu_suggestion(savers, menu, setup, layouts, engine_note)
        if menu_out is not None:
            out.append(menu_out)
    # 4. optimizer states on the CPU
    tick()
    offloaded_opt = applied(setup, offload_optimizer=True)
    best, plans = _best_fitting(savers, offloaded_opt, layouts, offload=True) if offloaded_opt else (None, [])
    pick = best or _closest(plans)
    ram = offloaded_optimizer_host_bytes(assemble(setup_for(
        setup, pick.layout, setup_batch_multiple(setup, pick.layout.world_size)), anatomy, gpu, pick.layout)) if pick else 0
    per_node = gpus_per_node(setup.gpus, setup.gpus_per_node)
    out.append(_suggestion("offload_optimizer", "offload the optimizer to the CPU (states and update, "
                           f"ZeRO-Offload style): {describe(best, plans)}; CPU RAM {format_bytes(ram)} per GPU "
                           f"({format_bytes(ram * per_node)} per node) for the states and an fp32 master copy"
                           + engine_note,
                           pick, cpu_ram_bytes_per_gpu=ram, cpu_ram_bytes_per_node=ram * per_node))
    # 5. FSDP2's CPU offload of the parameters, gradients and optimizer
    tick()
    offloaded = offload_param_suggestion(savers, setup, layouts, engine_note)
    if offloaded is not None:
        out.append(offloaded)
    # 6. more GPUs of the same type (then also with checkpointing)
    tick()
    # the methods that came closest, on more GPUs ("single" has no multi-GPU form: from one GPU, try every method)
    methods = tuple(sorted({lay.method for lay in layouts if not lay.spec.one_gpu})) or None
    found = _fewest_gpus(ctx, setup, methods)
    ckpt = applied(setup, grad_ckpt=True)
    if found is None and not setup.grad_ckpt and options.engine != "paper" and ckpt is not None:
        found = _fewest_gpus(ctx, ckpt, methods)
        if found is not None:
            out.append(_suggestion("gpus", f"use {found.layout.world_size} {gpu.name} GPUs with --grad-ckpt: "
                                   + describe(found, []), found, grad_ckpt=True))
    elif found is not None:
        out.append(_suggestion("gpus", f"use {found.layout.world_size} {gpu.name} GPUs: "
                               + describe(found, []), found))
    if found is None:
        out.append(_suggestion("gpus", f"even {MAX_SUGGESTED_GPUS} {gpu.name} GPUs do not fit this set-up as it "
                               "is: combine the suggestions above", None))
    if options.ranking == "paper":
        out.append(_suggestion(CPU_OFFLOADING, "LLMem's Algorithm 1 recommends CPU offloading (heterogeneous "
                               "training) when no method fits at batch 1", None))
    return out



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


def _quick_batch_bound(ctx: PlanContext, setup: TrainingSetup, layout: Layout) -> int:
    """An upper bound on the micro-batch `layout` fits: the largest whose quick bound stays within the screening
    slack (the bound never lay above 1.16x the allocated peak, and a batch that fits keeps that within the
    limit)."""
    bound = ctx.limit * (1 + QUICK_SLACK)
    return max_batch_size(lambda b: ctx.engine.quick(setup_for(setup, layout, b)) <= bound,
                          ctx.options.batch_cap)


def _quick_seq_bound(ctx: PlanContext, setup: TrainingSetup, layout: Layout) -> int:
    """An upper bound on the longest length below the set-up's (`sequence_knob`) that `layout` fits at its smallest
    batch (as _quick_batch_bound's, over the length); the set-up's length where the bound cannot be computed."""
    _, longest, at = sequence_knob(setup)
    bound = ctx.limit * (1 + QUICK_SLACK)
    unit = setup_batch_multiple(setup, layout.world_size)
    try:
        return max_batch_size(lambda n: ctx.engine.quick(setup_for(at(n), layout, unit)) <= bound, longest - 1)
    except LlmemError:
        return longest


def sequence_knob(setup: TrainingSetup) -> tuple[str, int, Callable[[int], TrainingSetup]]:
    """What "a shorter sequence" shortens: its flag, the set-up's value, and the set-up at a value. --seq-len, or
    under a generation objective --max-completion-length with the prompt kept (GRPO's sequence is prompt +
    completion; llmem.setup.generation)."""
    if not objective_spec(setup.objective).generates:
        return "--seq-len", setup.seq_len, lambda n: replace(setup, seq_len=n)
    prompt, completion = prompt_length(setup), completion_length(setup)
    return ("--max-completion-length", completion,
            lambda n: replace(setup, seq_len=prompt + n, max_completion_length=n))


def generations_suggestion(ctx: PlanContext, setup: TrainingSetup, layouts: list[Layout]) -> dict | None:
    """The largest --num-generations below the set-up's whose smallest per-GPU batch fits: GRPOConfig needs the
    global batch a multiple of num_generations, so each GPU runs at least num_generations / gcd(num_generations,
    GPUs) completions (llmem.setup.objectives.batch_multiple); a count whose smallest batch is no smaller than one
    already found not to fit is not searched. None when the set-up's own smallest batch is 1 on every layout
    (fewer generations cannot make the step smaller)."""
    g = num_generations(setup)
    units = {lay.label: setup_batch_multiple(setup, lay.world_size) for lay in layouts}
    if max(units.values(), default=1) == 1:
        return None
    failed_unit = min(units.values())           # the set-up's own smallest batch does not fit (nothing does)
    closest: list[CandidatePlan] = []
    for fewer in range(g - 1, 1, -1):
        s = applied(setup, num_generations=fewer, batch_size=batch_multiple(setup.objective, setup.gpus, fewer))
        if s is None:
            continue
        unit = min(setup_batch_multiple(s, lay.world_size) for lay in layouts)
        if unit >= failed_unit:
            continue
        best, plans = _best_fitting(ctx, s, layouts)
        if best is not None:
            return _suggestion("num_generations", f"--num-generations {fewer} (the largest below {g} whose "
                               f"smallest batch fits; each GPU runs at least {unit} completion(s)): "
                               + describe_fit(best, plans, ctx.limit), best, flags=f"--num-generations {fewer}",
                               changes={"num_generations": fewer, "batch_size": s.batch_size})
        failed_unit, closest = unit, plans or closest
    return _suggestion("num_generations", "fewer --num-generations do not help: no smaller count fits at its smallest "
                       "batch — " + describe_fit(None, closest, ctx.limit), _closest(closest),
                       flags="--num-generations")


def shorter_sequence_suggestion(ctx: PlanContext, setup: TrainingSetup, layouts: list[Layout]) -> dict:
    """The longest length (`sequence_knob`) that fits at each layout's smallest batch, searched on the layouts whose
    quick bound at length 1 does not rule them out (full estimates calibrate the quick bound; drafts without it)."""
    engine, limit = ctx.engine, ctx.limit
    flag, longest, at = sequence_knob(setup)
    best_n, best_c = 0, None
    for layout in screened_layouts(ctx, at(1), layouts):
        if best_n and ctx.prune and engine.has_quick and _quick_seq_bound(ctx, setup, layout) <= best_n:
            continue                # its quick bound rules out a longer sequence than the one found
        unit = setup_batch_multiple(setup, layout.world_size)

        def fits_n(n: int, layout=layout, unit=unit) -> bool:
            return engine.draft(setup_for(at(n), layout, unit)).device_used_bytes <= limit

        def used(n: int, layout=layout, unit=unit) -> int:
            return engine.full(setup_for(at(n), layout, unit)).device_used_bytes

        def quick_used(n: int, layout=layout, unit=unit) -> int:
            return engine.quick(setup_for(at(n), layout, unit))
        try:
            if longest <= 1:
                n = 0
            elif engine.has_quick:
                n = calibrated_max(used, quick_used, limit, longest - 1)
            else:
                n = max_batch_size(fits_n, longest - 1)
        except LlmemError:
            continue
        if n > best_n:
            s = at(n)
            best_n = n
            best_c = ctx.search(s, layout)
            attach_time(ctx, best_c, s)
    what = "the completion" if flag == "--max-completion-length" else "the sequence"
    if best_c is None:
        return _suggestion("seq_len", f"a shorter sequence does not help: even {flag} 1 does not fit at the "
                           "smallest batch", None, seq_len=0, flags=flag)
    s = at(best_n)
    return _suggestion("seq_len", f"shorten {what}: {flag} {best_n} is the longest that fits at the smallest batch "
                       f"({best_c.layout.label}, {format_bytes(best_c.memory.device_used_bytes)} at batch "
                       f"{best_c.max_batch_size})", best_c, seq_len=s.seq_len, flags=f"{flag} {best_n}",
                       changes={"seq_len": s.seq_len, **({"max_completion_length": best_n}
                                                         if flag != "--seq-len" else {})})


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
            bound = _quick_batch_bound(ctx, s, lay)
            if bound:
                candidates.append((_tokens_per_s_at(ctx, s, lay, bound), len(candidates), s, changes, lay))
    best, plans, chosen, seen = None, [], (), set()
    for upper, _i, s, changes, lay in sorted(candidates, key=lambda x: (-x[0], x[1])):
        if best is not None and upper <= best.time.tokens_per_s:
            break                                   # nothing left can beat it
        if (s, lay) in seen:
            continue
        seen.add((s, lay))
        found, searched = _best_fitting(ctx, s, [lay], closest=0)
        plans += searched
        if found is not None and (best is None or found.time.tokens_per_s > best.time.tokens_per_s):
            best, chosen = found, changes
    for changes, group in by_variant[-1] if best is None else ():
        _, searched = _best_fitting(ctx, replace(base, **{f: v for f, v, _ in changes}), group)
        plans += searched
    flags = " ".join(["--offload-param", *(flag for _, _, flag in chosen)])
    pick = best or _closest(plans)
    host = cpu_offload_host_bytes(assemble(setup_for(base, pick.layout, setup_batch_multiple(base, pick.layout.world_size)),
                                           ctx.anatomy, ctx.gpu, pick.layout)) \
        if pick else None
    per_node = gpus_per_node(setup.gpus, setup.gpus_per_node)
    ram = host.total if host else 0
    cost = time_cost_pct(ctx, best, setup)
    text = (f"{flags} (FSDP2's CPUOffloadPolicy: parameters, gradients and the optimizer in host memory"
            + (f", time per token {cost:+.0f} %" if cost is not None else "") + "): "
            + describe_fit(best, plans, ctx.limit) + _offload_time(best)
            + (f"; CPU RAM {format_bytes(ram)} per GPU ({format_bytes(ram * per_node)} per node: "
               f"{format_bytes(host.pinned)} of pinned parameters and gradients, {format_bytes(host.optimizer)} of "
               "optimizer states per GPU)" if host else "") + engine_note)
    return _suggestion("offload_param", text, pick, flags=flags, time_cost_pct=cost,
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
