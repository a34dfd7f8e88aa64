"""The parameters' shape-free facts a step schedule reads (llmem.estimator.param_facts): worked out once per set-up
less its shape and shared by its schedules, which must lay out the same events as with the facts worked out
afresh."""

from __future__ import annotations

from dataclasses import replace

import pytest

import llmem.estimator.param_facts as param_facts
from llmem.errors import LlmemError
from llmem.estimator.engine import rank_step, step_schedule
from llmem.model.resolved import resolve
from llmem.setup.training import TrainingSetup

SETUPS = [dict(method="single", gpus=1), dict(method="fsdp", gpus=8), dict(method="fsdp", gpus=8, cp=2),
          dict(method="fsdp+tp", gpus=8, tp=2, sequence_parallel=True), dict(method="ddp", gpus=2, lora_rank=8),
          dict(method="single", gpus=1, lora_rank=8, quant_base="nf4")]


def _events(setup: TrainingSetup, layers: int | None = None) -> list:
    r, act = rank_step(resolve(setup))
    return step_schedule(r, act, layers).build().events


@pytest.mark.parametrize("kw", SETUPS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_shared_facts_lay_out_the_events_fresh_facts_do(kw):
    """Batch 3 after batch 1 has filled the cache (the facts shared) against batch 3 with the cache emptied first
    (worked out afresh): the same events, at the whole depth and at a draft's."""
    base = TrainingSetup(model="tiny-llama", gpu="A100-80GB", seq_len=128, batch_size=1, **kw)
    at3 = replace(base, batch_size=3)
    for layers in (None, 2):
        _events(base, layers)
        shared = _events(at3, layers)
        param_facts._KEPT.clear()
        assert _events(at3, layers) == shared


def test_one_set_up_at_two_shapes_shares_its_facts_and_another_layout_does_not():
    def facts(setup: TrainingSetup, layers: int):
        r, act = rank_step(resolve(setup))
        return param_facts.param_facts(r, act.blocks, layers)

    base = TrainingSetup(model="tiny-llama", gpu="A100-80GB", method="fsdp", gpus=8, seq_len=128, batch_size=1)
    first = facts(base, 4)
    assert facts(replace(base, batch_size=5, seq_len=256), 4) is first
    assert facts(base, 2) is not first and len(facts(base, 2).kept) < len(first.kept)
    other = facts(replace(base, gpus=4), 4)
    # tiny-llama's q_proj [512, 512]: a rank's shard is 512 / 8 rows at 8 GPUs, 512 / 4 at 4
    q = "model.layers.0.self_attn.q_proj.weight"
    assert first.shard_numel[q] == 512 * 512 // 8 and other.shard_numel[q] == 512 * 512 // 4
    # the set-up's other fields are in the key too: pure bf16 stores the weight (and its gradient) in 2 bytes, mixed
    # precision's master weight in 4
    assert first.element_bytes[q] == 4 and facts(replace(base, precision="bf16"), 4).element_bytes[q] == 2


def test_a_pipeline_ranks_schedules_share_its_sub_model_and_facts():
    """A pipeline rank's schedules at two micro-batch sizes: one sub-model (stage_anatomy) and one set of facts, and
    the events the schedule lays out with everything worked out afresh."""
    import llmem.estimator.pipeline as pipeline

    base = TrainingSetup(model="tiny-llama", gpu="A100-80GB", method="fsdp", gpus=4, pp=2, seq_len=128, batch_size=2)
    at4 = replace(base, batch_size=4)
    for rank in (0, 1):
        pipeline.stage_whole(resolve(base), rank)
        kept = len(param_facts._KEPT)
        shared = pipeline.stage_whole(resolve(at4), rank).events
        assert len(param_facts._KEPT) == kept
        r = resolve(at4)
        splits = pipeline.splits_of(r, rank)
        assert pipeline.stage_anatomy(r.anatomy, splits) is pipeline.stage_anatomy(resolve(base).anatomy, splits)
        param_facts._KEPT.clear()
        pipeline._STAGE_ANATOMIES.clear()
        assert pipeline.stage_whole(resolve(at4), rank).events == shared


def test_the_identity_cache_keys_on_the_object_not_its_value_and_drops_the_oldest():
    from llmem.estimator.identity_cache import IdentityCache

    cache: IdentityCache[list] = IdentityCache(2)
    a, equal_to_a = [1], [1]
    first = cache.get(a, "k", lambda: ["a"])
    assert cache.get(a, "k", lambda: ["again"]) is first                 # the same object: kept
    assert cache.get(equal_to_a, "k", lambda: ["b"]) == ["b"]            # equal but another object: worked out
    cache.get(a, "other", lambda: ["c"])                                 # a third entry drops the oldest used
    assert len(cache) == 2 and cache.get(a, "k", lambda: ["a2"]) == ["a2"]


ACTIVATION_VARIANTS = [dict(grad_ckpt=True), dict(grad_ckpt=True, ckpt_every=2), dict(fused_ce=True),
                       dict(offload_activations=True)]


@pytest.mark.parametrize("kw", SETUPS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_activation_only_fields_share_the_facts_and_lay_out_the_same_events(kw):
    """Each of ACTIVATION_ONLY_FIELDS left out of the key: the set-up with it set shares the facts of the one
    without (the cache filled by the latter), and lays out the events it lays out with its own facts worked out
    afresh; and those fresh facts equal the shared ones."""
    assert {k for v in ACTIVATION_VARIANTS for k in v} == set(param_facts.ACTIVATION_ONLY_FIELDS)
    base = TrainingSetup(model="tiny-llama", gpu="A100-80GB", seq_len=128, batch_size=2, **kw)
    ran = 0
    for variant in ACTIVATION_VARIANTS:
        try:
            other = replace(base, **variant)
            r, act = rank_step(resolve(other))
        except LlmemError:         # a combination the layout refuses (--cp with --fused-ce)
            continue
        _events(base)
        shared_facts = param_facts.param_facts(r, act.blocks, r.anatomy.num_layers)
        shared = _events(other)
        param_facts._KEPT.clear()
        fresh_facts = param_facts.param_facts(r, act.blocks, r.anatomy.num_layers)
        assert fresh_facts is not shared_facts and fresh_facts == shared_facts, variant
        assert _events(other) == shared, variant
        ran += 1
    assert ran >= 1


@pytest.mark.parametrize("kw", [*SETUPS, dict(method="zero2", gpus=4), dict(method="ds-zero3", gpus=4, lora_rank=8)],
                         ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_activation_only_fields_leave_the_model_states_as_they_are(kw):
    """The planner's engine keeps one set-up's model states for every resolved set-up of the same
    activation_free_key (an adapter menu's variants): each variant's states, worked out on their own, equal the
    base's."""
    from llmem.estimator.states import model_states

    base = TrainingSetup(model="tiny-llama", gpu="A100-80GB", seq_len=128, batch_size=2, **kw)
    r = resolve(base)
    want = model_states(r)
    ran = 0
    for variant in ACTIVATION_VARIANTS:
        try:
            other = resolve(replace(base, **variant))
        except LlmemError:
            continue
        if param_facts.activation_free_key(other.setup) != param_facts.activation_free_key(r.setup):
            continue        # resolved to other values: another key, not shared
        assert model_states(other) == want, variant
        ran += 1
    assert ran >= 1
