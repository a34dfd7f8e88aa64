"""Memory savers that keep full fine-tuning (fused CE, 8-bit AdamW, the optimizer step in backward, checkpointing,
activation offloading), each alone and the cheap ones together as each method allows them."""

from __future__ import annotations

from dataclasses import dataclass

from llmem.planner.search import CandidatePlan, PlanContext
from llmem.planner.suggestions.fitting import applied, best_fitting, supports
from llmem.planner.suggestions.record import closest_plan, describe_fit, suggestion_dict, time_cost_pct
from llmem.setup.layout import Layout
from llmem.setup.methods import MethodSpec
from llmem.setup.optimizers import EIGHT_BIT_ALTERNATIVE
from llmem.setup.training import TrainingSetup
from llmem.units import format_bytes

CHEAP_SAVERS = ("fused_ce", "optimizer_8bit", "grad_ckpt")   # the savers tried together ("combined")


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
    return [sv for sv in saver_candidates(setup) if any(supports(sv.apply(setup), m) for m in methods)]


def saver_candidates(setup: TrainingSetup) -> list[Saver]:
    """Every saver not already on, before the support check."""
    out: list[Saver] = []
    if not setup.fused_ce:
        out.append(Saver("fused_ce", (("fused_ce", True),), "--fused-ce",
                         "no [tokens, vocab] fp32 logits, same FLOPs"))
    optimizer = setup.optimizer_spec
    if optimizer.adam and not optimizer.low_bit and not setup.offload_optimizer:
        out.append(Saver("optimizer_8bit", (("optimizer", EIGHT_BIT_ALTERNATIVE),),
                         f"--optimizer {EIGHT_BIT_ALTERNATIVE}",
                         "bitsandbytes' 8-bit Adam states, 2 instead of 8 bytes per parameter"))
    if not setup.optimizer_in_backward and not optimizer.low_bit:
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
    return out


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


def saver_suggestion(ctx: PlanContext, saver: Saver, setup: TrainingSetup, layouts: list[Layout],
                     engine_note: str) -> dict:
    s = saver.apply(setup)
    best, plans = best_fitting(ctx, s, layouts) if s is not None else (None, [])
    return _saver_dict(ctx, saver, setup, best, plans, engine_note)


def _saver_dict(ctx: PlanContext, saver: Saver, setup: TrainingSetup, best: CandidatePlan | None,
                plans: list[CandidatePlan], engine_note: str, also: str = "", **extra) -> dict:
    cost = time_cost_pct(ctx, best, setup)
    when = f", time per token {cost:+.0f} %" if cost is not None else ""
    return suggestion_dict(saver.kind, f"{saver.flags} ({saver.cost}{when}): " + describe_fit(best, plans, ctx.limit)
                       + also + engine_note,
                       best or closest_plan(plans), flags=saver.flags, time_cost_pct=cost,
                       changes=dict(saver.changes), **extra)


def combined_suggestion(ctx: PlanContext, combos: list[tuple[Saver, tuple[str, ...]]], setup: TrainingSetup,
                        layouts: list[Layout], engine_note: str) -> dict:
    """The cheap savers together: each method's combination searched on that method's layouts; the fastest that
    fits (else the closest) is the suggestion, the others are listed under `alternatives`."""
    tried = []
    for saver, methods in combos:
        best, plans = best_fitting(ctx, saver.apply(setup), [lay for lay in layouts if lay.method in methods])
        tried.append((saver, best, plans))
    fitting = [(sv, b, p) for sv, b, p in tried if b is not None]
    if fitting:
        pick = max(fitting, key=lambda x: x[1].time.tokens_per_s)
    else:
        pick = min(tried, key=lambda x: closest_plan(x[2]).memory.device_used_bytes if x[2] else float("inf"))
    alternatives = []
    for sv, b, p in tried:
        if sv is pick[0]:
            continue
        c = b or closest_plan(p)
        alternatives.append({"flags": sv.flags, "fits": b is not None, "label": c.layout.label if c else None,
                             "max_batch_size": b.max_batch_size if b else 0,
                             "device_used_bytes": c.memory.device_used_bytes if c else None})
    also = "".join(f"; {a['flags']}: {a['label']} " + (f"batch {a['max_batch_size']}" if a["fits"] else
                                                        f"needs {format_bytes(a['device_used_bytes'])}")
                   for a in alternatives if a["label"])
    return _saver_dict(ctx, pick[0], setup, pick[1], pick[2], engine_note,
                       also=f" (also tried{also[1:]})" if also else "", alternatives=alternatives)
