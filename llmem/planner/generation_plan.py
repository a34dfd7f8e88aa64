"""`llmem plan --objective grpo`: the generation settings a layout runs with, and what the answer's phases are.

The colocated vLLM utilization (GRPOConfig's vllm_gpu_memory_utilization) is searched when --use-vllm runs vLLM
colocated and the user did not give it, over UTILIZATIONS (0.10 to 0.90): each one's largest training micro-batch
searched with the memory engine (the pool sits beside training: resident through it, or, with sleep mode, beside
the generation phase's live tensors) and timed with its generation (llmem.planner.generation_time: a larger pool
holds more KV blocks, so vLLM decodes the batch in fewer, larger waves). The rule: the fastest by the time model
(tokens/s of the whole step, generation included), ties to the lower utilization (more room left to training). A
utilization vLLM would refuse to start with (its KV cache cannot hold one max_model_len sequence, or the device has
less free memory than it asks: llmem.estimator.generation) is skipped; the others are searched in the order of an
upper bound on their tokens/s, and one whose bound cannot beat the fastest found is not searched.

When the set-up generates with transformers, the answer (the recommended plan, or the fastest fitting suggestion)
is also tried with vLLM colocated at its best utilization (the answer's layout first, then the plan's others),
reported beside it, never in its place: the user's set-up stays as given.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmem.errors import LlmemError
from llmem.estimator.generation import colocated_pool
from llmem.model.resolved import assemble
from llmem.planner.generation_time import amortised_note
from llmem.planner.search import (
    QUICK_BOUND_SLACK,
    CandidatePlan,
    PlanContext,
    attach_time,
    layout_setup,
    time_at_max_batch,
)
from llmem.result import MemoryResult
from llmem.search import max_batch_size
from llmem.setup.generation import steps_per_generation, vllm_mode, vllm_utilization
from llmem.setup.layout import Layout
from llmem.setup.objectives import objective_spec, setup_batch_multiple
from llmem.setup.training import TrainingSetup

UTILIZATIONS = tuple(round(0.05 * i, 2) for i in range(2, 19))     # 0.10, 0.15, ..., 0.90
VLLM_REFUSAL = "vLLM would not start"     # how llmem.memory.vllm and check_vllm_starts word vLLM's own refusals
RULE = ("the fastest by the time model (generation included: more KV blocks, fewer decode waves), ties to the lower "
        "utilization, over 0.10 to 0.90")


# suggestions that change the task itself (the completions' length and count): reported, never taken as the answer
TASK_CHANGES = ("seq_len", "num_generations")


@dataclass(frozen=True)
class VllmTry:
    """One utilization tried on a layout."""
    utilization: float
    max_batch_size: int            # 0: no training batch fits beside the pool
    tokens_per_s: float | None
    kv_blocks: int | None          # at max_batch_size (TRL's max_num_seqs); None: vLLM would not start
    concurrent_sequences: int | None   # sequences of --seq-len the KV cache holds at once
    refusal: str = ""
    pruned: bool = False           # not batch-searched: its tokens/s bound cannot beat the fastest found

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class VllmChoice:
    """The utilization chosen for one layout (None when none fits) and every one tried."""
    label: str
    utilization: float | None
    tries: tuple[VllmTry, ...]
    hint: str = ""                 # what would let vLLM start lower

    def to_dict(self) -> dict:
        return {"label": self.label, "vllm_gpu_memory_utilization": self.utilization, "rule": RULE,
                "tried": [t.to_dict() for t in self.tries], "hint": self.hint}


def searches_utilization(setup: TrainingSetup) -> bool:
    """Whether the plan searches the colocated utilization: vLLM colocated, the utilization not given."""
    return vllm_mode(setup) == "colocate" and setup.vllm_gpu_memory_utilization is None


def _pool_try(ctx: PlanContext, s: TrainingSetup, layout: Layout, batch: int = 0) -> tuple[int, int] | str:
    """(KV blocks, concurrent sequences of --seq-len) of the pool at micro-batch `batch` (TRL's max_num_seqs; 0:
    the smallest), or vLLM's refusal."""
    try:
        pool = colocated_pool(assemble(layout_setup(s, layout, batch or setup_batch_multiple(s, layout.world_size)),
                                       ctx.anatomy, ctx.gpu, layout))
    except LlmemError as exc:
        return str(exc)
    return pool.num_blocks, pool.concurrent_sequences(s.seq_len)


def choose_utilization(ctx: PlanContext, setup: TrainingSetup, layout: Layout
                       ) -> tuple[CandidatePlan, TrainingSetup, VllmChoice]:
    """The layout's candidate at the chosen utilization (module docstring), timed, with that set-up and the tries;
    when none fits, the candidate of the last utilization searched (LlmemError when vLLM starts at none). The
    utilizations vLLM starts at are batch-searched in the order of an upper bound on their tokens/s
    (`_tokens_per_s_bound`), and one whose bound cannot beat the fastest found is not searched (`pruned`): the
    answer is that of searching every one."""
    layout_setup(setup, layout, setup_batch_multiple(setup, layout.world_size))   # the layout's own refusal first
    tries: dict[float, VllmTry] = {}
    bounds: dict[float, float] = {}
    for u in UTILIZATIONS:
        s = replace(setup, vllm_gpu_memory_utilization=u)
        pool = _pool_try(ctx, s, layout)
        if isinstance(pool, str) and not pool.startswith(VLLM_REFUSAL):
            raise LlmemError(pool)      # the layout's own refusal (e.g. --pp under TRL's trainers), not vLLM's
        if isinstance(pool, str):
            tries[u] = VllmTry(u, 0, None, None, None, pool)
        else:
            tries[u] = VllmTry(u, 0, None, *pool, pruned=True)
            bounds[u] = _tokens_per_s_bound(ctx, s, layout)
    best: tuple[CandidatePlan, TrainingSetup, float] | None = None
    last: tuple[CandidatePlan, TrainingSetup] | None = None
    for u in sorted(bounds, key=lambda u: (-bounds[u], u)):
        if best is not None and (bounds[u], -u) <= (best[0].time.tokens_per_s, -best[2]):
            continue                    # it cannot be faster (nor as fast at a lower utilization)
        s = replace(setup, vllm_gpu_memory_utilization=u)
        try:
            c = ctx.search(s, layout)
        except LlmemError as exc:       # e.g. vLLM's free-memory check once the training weights are loaded
            tries[u] = replace(tries[u], refusal=str(exc), pruned=False)
            continue
        attach_time(ctx, c, s)
        at_batch = _pool_try(ctx, s, layout, c.max_batch_size) if c.fits else None
        tries[u] = VllmTry(u, c.max_batch_size, c.time.tokens_per_s if c.time else None,
                           *(at_batch if isinstance(at_batch, tuple) else (tries[u].kv_blocks,
                                                                           tries[u].concurrent_sequences)))
        last = (c, s)
        if c.fits and (best is None or (c.time.tokens_per_s, -u) > (best[0].time.tokens_per_s, -best[2])):
            best = (c, s, u)
    pick = best[:2] if best else last
    ordered = [tries[u] for u in UTILIZATIONS]
    if pick is None:
        refusals = [t.refusal for t in ordered if t.refusal]
        raise LlmemError(f"vLLM colocated would not start at any utilization up to {UTILIZATIONS[-1]:g}: "
                         + (refusals[-1] if refusals else "no utilization could be searched"))
    choice = VllmChoice(layout.label, best[2] if best else None, tuple(ordered), _start_hint(setup, ordered))
    return pick[0], pick[1], choice


def _tokens_per_s_bound(ctx: PlanContext, s: TrainingSetup, layout: Layout) -> float:
    """An upper bound on the tokens/s `s` reaches on `layout`: the time model at the largest batch whose quick
    bound (the trainer's tensor bytes at its largest moment, no replay) stays within the limit less the pool
    resident in training, with search.py's slack (a fitting batch's quick bound never lay above 1.16x its
    allocated peak), vLLM generating the batch in one wave; tokens/s does not fall as the largest batch grows
    then. Infinite where it cannot be computed."""
    if not ctx.engine.has_quick:
        return float("inf")
    try:
        unit = setup_batch_multiple(s, layout.world_size)
        pool = colocated_pool(assemble(layout_setup(s, layout, unit), ctx.anatomy, ctx.gpu, layout))
        room = (ctx.limit - (pool.resident_in_training_bytes if pool else 0)) * (1 + QUICK_BOUND_SLACK)
        units = max_batch_size(lambda b: ctx.engine.quick(layout_setup(s, layout, b * unit), layout) <= room,
                               max(ctx.options.batch_cap // unit, 1))
        if not units:
            return 0.0
        # vLLM's waves grow with the batch (its sampler's rows, max_num_seqs = the batch, take KV blocks), so its
        # generation is bounded by one wave of the whole batch: timed as a server engine (generation_time), with
        # the pool's bf16 weights and KV cache
        one_wave = replace(s, vllm_mode="server", vllm_gpu_memory_utilization=None, vllm_enable_sleep_mode=False,
                           vllm_max_model_length=None)
        return time_at_max_batch(ctx, one_wave, layout, units * unit).tokens_per_s
    except LlmemError:
        return float("inf")


def _start_hint(setup: TrainingSetup, tries: list[VllmTry]) -> str:
    """When vLLM refused to start at the lower utilizations (its KV cache short of one max_model_len sequence) and
    max_model_len is vLLM's default (the model's max_position_embeddings, far above the sequence): the flag that
    lets it start lower."""
    if setup.vllm_max_model_length is not None or not any(t.kv_blocks is None for t in tries):
        return ""
    return (f"vLLM starts only from {next(t.utilization for t in tries if t.kv_blocks is not None):g} because its "
            f"KV cache must hold one max_model_len sequence (vLLM's default: the model's max_position_embeddings); "
            f"--vllm-max-model-length {setup.seq_len} (the sequence) lets it start lower") \
        if any(t.kv_blocks is not None for t in tries) else ""


def phases_of(memory: MemoryResult) -> list[dict]:
    """The step's phases (generation / scoring / training peaks; the one marked is the answer). A phase in which
    the replay allocated nothing has no peak of its own (llmem.estimator.events marks it -1: under vLLM the
    trainer's generation phase can be empty) and is left out."""
    return [p.to_dict() for p in memory.phases if p.allocated_bytes >= 0]


def answer_generation(ctx: PlanContext, setup: TrainingSetup, layout: Layout, max_batch: int,
                      choice: VllmChoice | None, others: list[Layout] = ()) -> dict:
    """What the plan says of a generation objective's answer: its layout, its phases at its batch, how it generates
    and, for transformers generation, vLLM colocated at its best utilization beside it (`vllm_alternative`, on
    the answer's layout first, then `others`)."""
    memory = ctx.engine.full(layout_setup(setup, layout, max_batch), layout)
    out: dict = {"label": layout.label, "max_batch_size": max_batch, "phases": phases_of(memory),
                 "generation": "vllm-" + vllm_mode(setup) if vllm_mode(setup) else "transformers"}
    if steps_per_generation(setup) > 1:
        out["generation_time"] = amortised_note(setup, max_batch)
    if vllm_mode(setup) == "colocate":
        out["vllm_gpu_memory_utilization"] = vllm_utilization(setup)
        out["vllm_pool_bytes"] = memory.components.get("vllm_pool", 0)
        out["vllm_given"] = setup.vllm_gpu_memory_utilization is not None and choice is None
        out["vllm_chosen"] = choice.to_dict() if choice else None     # None: the user's (or TRL's default)
        return out
    if vllm_mode(setup) is None:
        out["vllm_colocate"] = vllm_alternative(ctx, replace(setup, use_vllm=True), [layout, *others])
    return out


def vllm_alternative(ctx: PlanContext, setup: TrainingSetup, layouts: list[Layout]) -> dict:
    """vLLM colocated for a set-up that generates with transformers: its utilization chosen on each layout that
    runs it (the answer's first), the fastest that fits; else why none does."""
    found: list[tuple[CandidatePlan, VllmChoice]] = []
    reasons: list[str] = []
    for lay in layouts:
        try:
            c, _, alt = choose_utilization(ctx, setup, lay)
        except LlmemError as exc:
            reasons.append(f"{lay.label}: {exc}")
            continue
        if c.fits:
            found.append((c, alt))
        else:
            reasons.append(f"{lay.label}: no training batch fits beside the pool at any utilization")
    if not found:
        more = f" (and {len(reasons) - 3} more layouts)" if len(reasons) > 3 else ""
        return {"fits": False, "reason": "; ".join(reasons[:3]) + more if reasons else "no layout runs it",
                "reasons": reasons}
    c, alt = max(found, key=lambda x: x[0].time.tokens_per_s)
    return {"fits": True, "flags": f"--use-vllm --vllm-gpu-memory-utilization {alt.utilization:g}",
            "max_batch_size": c.max_batch_size, "tokens_per_s": c.time.tokens_per_s,
            "vllm_pool_bytes": c.memory.components.get("vllm_pool", 0), "phases": phases_of(c.memory),
            **alt.to_dict()}


def generates(setup: TrainingSetup) -> bool:
    return objective_spec(setup.objective).generates


def plan_generation(ctx: PlanContext, setup: TrainingSetup, layouts: list[Layout], best: CandidatePlan | None,
                    suggestions: list[dict], choices: dict[str, VllmChoice]) -> dict | None:
    """The generation objective's answer (None for another objective, or when nothing fits): the recommended plan,
    else the fastest fitting suggestion on these GPUs that keeps the task (its changes applied; not a shorter
    completion nor fewer generations: TASK_CHANGES), with `answer_generation`'s report."""
    if not generates(setup):
        return None
    by_label = {lay.label: lay for lay in layouts}
    if best is not None:
        choice = choices.get(best.layout.label)
        s = replace(setup, vllm_gpu_memory_utilization=choice.utilization) if choice else setup
        others = [lay for lay in layouts if lay.label != best.layout.label]
        return {"from": "recommended", **answer_generation(ctx, s, best.layout, best.max_batch_size, choice,
                                                           others)}
    fitting = [x for x in suggestions if x["fits"] and x.get("label") in by_label and "changes" in x
               and x.get("tokens_per_s") and x["kind"] not in TASK_CHANGES]
    if not fitting:
        return None
    pick = max(fitting, key=lambda x: x["tokens_per_s"])
    try:
        s = replace(setup, **pick["changes"])
    except LlmemError:
        return None
    layout, batch, choice = by_label[pick["label"]], pick["max_batch_size"], None
    if searches_utilization(s):         # the suggestions ran at TRL's default utilization: the answer's searched
        c, chosen, choice = choose_utilization(ctx, s, layout)
        if c.fits:
            s, batch = chosen, c.max_batch_size
        else:
            choice = None
    return {"from": "suggestion", "kind": pick["kind"], "flags": pick.get("flags", ""),
            **answer_generation(ctx, s, layout, batch, choice, [lay for lay in layouts if lay is not layout])}
