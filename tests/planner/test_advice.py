"""`llmem plan`'s advice when nothing fits: each what-if's best layout is the best over every layout that can run it
(checked against a brute force over the candidate layouts with the engine itself), and the "combined" saver holds
only what each method's support check accepts (checked against llmem.setup.support.check_support)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from llmem.errors import LlmemError
from llmem.model.anatomy import load_anatomy
from llmem.planner.engines import LlmemEngine, fits_within
from llmem.planner.options import PlanOptions
from llmem.planner.plan import plan
from llmem.planner.search import CandidatePlan, PlanContext, attach_time, limit_bytes
from llmem.planner.suggestions import CHEAP_SAVERS, combined_savers, full_finetune_savers
from llmem.setup.gpus import resolve_gpu
from llmem.setup.layout import candidate_layouts
from llmem.setup.methods import METHODS
from llmem.setup.optimizers import OPTIMIZERS
from llmem.setup.support import check_support
from llmem.setup.training import TrainingSetup

CAP = 8          # the batch cap of the plans below: the brute force scans every batch up to it


def _accepted(setup: TrainingSetup, method) -> bool:
    try:
        check_support(setup, method)
    except LlmemError:
        return False
    return True


# ------------------------------------------------------------------------------------------------ combined saver

SETUPS = [
    TrainingSetup(model="tiny-llama"),
    TrainingSetup(model="tiny-llama", fused_ce=True),
    TrainingSetup(model="tiny-llama", grad_ckpt=True, ckpt_every=2),
    TrainingSetup(model="tiny-llama", offload_optimizer=True),
    TrainingSetup(model="tiny-llama", optimizer_in_backward=True),
] + [TrainingSetup(model="tiny-llama", optimizer=name) for name in OPTIMIZERS]


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: f"{s.optimizer}-{s.fused_ce}-{s.grad_ckpt}-"
                         f"{s.offload_optimizer}-{s.optimizer_in_backward}")
def test_combined_saver_holds_only_what_each_method_accepts(setup):
    methods = list(METHODS.values())
    savers = full_finetune_savers(setup, methods)
    # every saver offered alone is one the support check accepts for some method
    for sv in savers:
        assert any(_accepted(sv.apply(setup), m) for m in methods), sv.kind
    combos = combined_savers(setup, savers, methods)
    cheap = [sv for sv in savers if sv.kind in CHEAP_SAVERS]
    for saver, names in combos:
        assert names
        for name in names:
            # the whole combination is accepted by the method it is offered for ...
            assert _accepted(saver.apply(setup), METHODS[name]), (saver.flags, name)
            # ... and it is the largest such set: each cheap saver left out is refused on top of it
            kinds = {k for k, _ in saver.changes}
            for sv in cheap:
                if not {k for k, _ in sv.changes} <= kinds:
                    assert not _accepted(sv.apply(saver.apply(setup)), METHODS[name]), (sv.flags, name)
    # every method whose accepted cheap savers number two or more has its combination
    for m in methods:
        best = max((sub for r in range(len(cheap) + 1) for sub in itertools.combinations(cheap, r)
                    if _accepted(_apply_all(setup, sub), m)), key=len, default=())
        offered = [sv for sv, names in combos if m.name in names]
        assert len(offered) == (1 if len(best) > 1 else 0), m.name
        if offered:
            assert dict(offered[0].changes) == dict(c for sv in best for c in sv.changes)


def _apply_all(setup, savers):
    for sv in savers:
        setup = sv.apply(setup)
    return setup


def test_combined_saver_under_fsdp_has_no_8bit_adamw_unless_supported():
    """The issue's case: the combination offered for a sharding method leaves out what check_support refuses for it
    (here 8-bit AdamW on FSDP2's DTensor shards) instead of ruling the method out."""
    setup = TrainingSetup(model="tiny-llama", gpus=4)
    methods = [lay.spec for lay in candidate_layouts(4, None, 8, 8)]
    combos = dict((names, saver) for saver, names in combined_savers(setup, full_finetune_savers(setup, methods),
                                                                      methods))
    eight_bit = replace(setup, optimizer="adamw-8bit")
    for names, saver in combos.items():
        changed = dict(saver.changes)
        for name in names:
            if not _accepted(eight_bit, METHODS[name]):
                assert changed.get("optimizer") != "adamw-8bit"
    # a sharding method gets a combination of its own (fused CE and checkpointing)
    sharding = [n for names in combos for n in names if METHODS[n].shards_model_states and not METHODS[n].has_tp]
    assert sharding


# ------------------------------------------------------------------------------------------------ best layout

# tiny-llama (4 layers, 45M parameters) at 1024 tokens on 4 GPUs of 1340 MiB: full fine-tuning fits nowhere at
# batch 1, the savers fit on some layouts, and the layouts that fit differ from saver to saver
TIGHT = TrainingSetup(model="tiny-llama", gpus=4, seq_len=1024, gpu="A100-80GB", gpu_memory="1340MiB")


@pytest.fixture(scope="module")
def tight_plan():
    # dp x tp layouts only: under context parallelism (cp 4: a quarter of the tokens per rank) TIGHT fits
    return plan(TIGHT, PlanOptions(batch_cap=CAP, layouts="dp-tp"))


def _brute_force(p, setup: TrainingSetup, methods=None, offload=False):
    """The fastest fitting plan of `setup` over every candidate layout of its GPUs, each layout's largest batch
    found by scanning every batch 1..CAP with the full estimate (a fresh engine), timed by the plan's time model;
    and the smallest device-used memory at batch 1 over the layouts that can run it."""
    anatomy = load_anatomy(setup.model)
    gpu = resolve_gpu(setup.gpu, setup.gpu_memory, setup.cuda_context)
    limit = limit_bytes(gpu, p.options.headroom)
    engine = LlmemEngine(anatomy, gpu, limit)
    ctx = PlanContext(anatomy, gpu, p.options, engine, limit)
    best, closest = None, None
    for layout in candidate_layouts(setup.gpus, setup.gpus_per_node, anatomy.num_heads, anatomy.num_kv_heads):
        if methods is not None and layout.method not in methods:
            continue
        if not _accepted(setup, layout.spec):
            continue
        try:
            at = [engine.full(setup.with_layout(layout, b)) for b in range(1, CAP + 1)]
        except LlmemError:
            continue
        n = next((i for i, m in enumerate(at) if not fits_within(m, limit)), CAP)   # fits at 1..n
        if closest is None or at[0].device_used_bytes < closest:
            closest = at[0].device_used_bytes
        if n == 0:
            continue
        c = CandidatePlan(layout, n, at[n - 1], limit, offload_optimizer=offload)
        attach_time(ctx, c, setup)
        if best is None or c.time.tokens_per_s > best.time.tokens_per_s:
            best = c
    return best, closest


def test_nothing_fits_as_given(tight_plan):
    assert tight_plan.recommended is None and not any(c.fits for c in tight_plan.candidates)
    assert len(tight_plan.candidates) == 5                   # ddp, fsdp, zero2, tp, fsdp+tp: all searched


@pytest.mark.parametrize("kind", ["fused_ce", "optimizer_8bit", "grad_ckpt_every_2", "grad_ckpt",
                                  "offload_activations"])
def test_each_saver_is_the_best_over_every_layout(tight_plan, kind):
    sug = next(s for s in tight_plan.suggestions if s["kind"] == kind)
    best, closest = _brute_force(tight_plan, replace(TIGHT, **sug["changes"]))
    _same_pick(sug, best, closest)


def test_combined_is_the_best_over_every_method_and_its_combination(tight_plan):
    """Brute force: for every layout, the largest set of the cheap savers its method accepts (subsets tried by
    check_support), searched as above; the fastest fitting one over all of them."""
    sug = next(s for s in tight_plan.suggestions if s["kind"] == "combined")
    cheap = {"fused_ce": {"fused_ce": True}, "optimizer_8bit": {"optimizer": "adamw-8bit"},
             "grad_ckpt": {"grad_ckpt": True, "ckpt_every": 1}}
    best, best_changes, closest = None, None, None
    for method in sorted({c.layout.method for c in tight_plan.candidates}):
        subsets = [dict(c for k in sub for c in cheap[k].items())
                   for r in (3, 2) for sub in itertools.combinations(cheap, r)]
        accepted = [ch for ch in subsets if _accepted(replace(TIGHT, **ch), METHODS[method])]
        if not accepted:
            continue
        changes = accepted[0]
        b, cl = _brute_force(tight_plan, replace(TIGHT, **changes), methods={method})
        if b is not None and (best is None or b.time.tokens_per_s > best.time.tokens_per_s):
            best, best_changes = b, changes
        if cl is not None and (closest is None or cl < closest):
            closest = cl
    _same_pick(sug, best, closest)
    if best is not None:
        assert sug["changes"] == best_changes
        # the fastest combination here keeps FSDP2 or DDP as the support check allows: 8-bit AdamW only on DDP
        assert (sug["changes"].get("optimizer") == "adamw-8bit") == (sug["method"] == "ddp")


def test_offload_suggestion_is_the_best_over_every_layout(tight_plan):
    sug = next(s for s in tight_plan.suggestions if s["kind"] == "offload_optimizer")
    best, closest = _brute_force(tight_plan, replace(TIGHT, offload_optimizer=True), offload=True)
    _same_pick(sug, best, closest)


def test_pruned_suggestions_are_the_exhaustive_ones(tight_plan, monkeypatch):
    """The suggestions skip the layouts whose tokens/s at their quick batch bound cannot beat the fastest found
    (and the sequences a quick bound rules out); searching every screened layout instead gives the same
    suggestions, with more searches. Both runs share the plan's engine (its estimates are kept), so only the
    layouts the pruned run skipped are estimated here."""
    import llmem.planner.search as search
    from llmem.planner.suggestions import suggest

    searched: list[bool] = []
    real = search.search_candidate
    monkeypatch.setattr(search, "search_candidate", lambda *a, **k: searched.append(True) or real(*a, **k))
    p = tight_plan
    ctx = PlanContext(p.anatomy, p.gpu, p.options, p.engine, p.limit_bytes)
    layouts = candidate_layouts(TIGHT.gpus, None, p.anatomy.num_heads, p.anatomy.num_kv_heads)
    ticks: list[tuple[int, int]] = []
    pruned = suggest(ctx, TIGHT, layouts, progress=lambda what, i, n: ticks.append((i, n)))
    n_pruned = len(searched)
    # the progress bar advances once per what-if: 5 savers, combined, seq, 3 adapter menus (LoRA, QLoRA,
    # FSDP-QLoRA), optimizer offload, parameter offload, more GPUs
    assert ticks == [(i, 13) for i in range(13)]
    exhaustive = suggest(replace(ctx, prune=False), TIGHT, layouts)
    assert pruned == p.suggestions
    assert exhaustive == pruned
    assert len(searched) - n_pruned > n_pruned, (n_pruned, len(searched) - n_pruned)   # it did skip some


def _same_pick(sug: dict, best: CandidatePlan | None, closest: int | None) -> None:
    assert sug["fits"] is (best is not None), sug["text"]
    if best is None:
        # nothing fits: the memory named is the smallest over the layouts searched, never below the true minimum
        assert sug["device_used_bytes"] >= closest
        return
    assert (sug["label"], sug["max_batch_size"]) == (best.layout.label, best.max_batch_size), sug["text"]
    assert sug["tokens_per_s"] == pytest.approx(best.time.tokens_per_s)
    assert sug["device_used_bytes"] == best.memory.device_used_bytes


def test_the_tight_case_is_a_real_choice(tight_plan):
    """Guard on the fixture: with checkpointing several layouts fit (so the pick above is a choice among them), and
    the combined saver's combinations differ by method (FSDP2's without 8-bit AdamW, DDP's with it)."""
    limit = tight_plan.limit_bytes
    engine = LlmemEngine(tight_plan.anatomy, tight_plan.gpu, limit)
    s = replace(TIGHT, grad_ckpt=True)
    fitting = [lay.label for lay in candidate_layouts(4, None, 8, 8)
               if fits_within(engine.full(s.with_layout(lay, 1)), limit)]
    assert len(fitting) >= 2, fitting
    sug = next(x for x in tight_plan.suggestions if x["kind"] == "combined")
    assert sug["alternatives"] and all(a["flags"] != sug["flags"] for a in sug["alternatives"])
