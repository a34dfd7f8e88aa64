"""A built schedule's builder holds no cycle: its parts (which call the builder's hooks) are dropped once it is built,
so the schedule's events are freed as soon as the caller drops them, with the cyclic garbage collector off; before,
every schedule of a plan waited for the collector (a fifth of a 70B plan's CPU time went to it)."""

from __future__ import annotations

import gc
import weakref

import pytest

from llmem.estimator.engine import rank_step, step_schedule
from llmem.estimator.events import built_within
from llmem.estimator.pipeline import stage_builder
from llmem.model.resolved import resolve
from llmem.setup.training import TrainingSetup

SETUPS = [dict(), dict(method="fsdp", gpus=4, grad_ckpt=True, lora_rank=8), dict(method="ds-zero3", gpus=2),
          dict(method="ddp", gpus=2, objective="dpo", lora_rank=8), dict(objective="grpo", num_generations=2, max_completion_length=64),
          dict(method="fsdp", gpus=4, pp=2)]


def _builder(kw: dict):
    r = resolve(TrainingSetup(model="tiny-llama", seq_len=128, batch_size=2, **kw))
    if r.layout.pp > 1:
        return stage_builder(r, 0)
    r, act = rank_step(r)
    return step_schedule(r, act)


@pytest.mark.parametrize("kw", SETUPS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()) or "single")
def test_a_built_schedule_is_freed_without_the_cyclic_collector(kw):
    builder = _builder(kw)
    was = gc.isenabled()
    gc.disable()
    try:
        schedule = builder.build()
        assert len(schedule.events) > 100
        held, builder_held = weakref.ref(schedule), weakref.ref(builder)
        del schedule, builder
        assert held() is None and builder_held() is None
    finally:
        if was:
            gc.enable()


def test_an_abandoned_build_is_freed_too():
    """built_within stops the build once the live tensors pass the bytes given (LiveBytesOver): the half-built
    builder and its schedule go as well."""
    builder = _builder(dict(method="fsdp", gpus=4))
    was = gc.isenabled()
    gc.disable()
    try:
        held = weakref.ref(builder)
        assert built_within(builder, 1) is None
        del builder
        assert held() is None
    finally:
        if was:
            gc.enable()
