"""The replays a plan's searches share (llmem.estimator.shared_replays): set-ups that differ only in fields no step
schedule reads lay out the same events, and the engine replays them once; any other difference is replayed anew."""

from __future__ import annotations

from dataclasses import replace

import pytest
from micro_model import write_config

import llmem.estimator.engine as engine
from llmem.estimator.engine import rank_step, step_schedule
from llmem.estimator.shared_replays import SCHEDULE_FREE_FIELDS, schedule_key
from llmem.model.anatomy import setup_anatomy
from llmem.model.resolved import resolve
from llmem.planner.engines import LlmemEngine
from llmem.setup.gpus import resolve_gpu
from llmem.setup.training import TrainingSetup

# a value of each SCHEDULE_FREE_FIELDS field other than the set-up's
OTHER_VALUE = {"vllm_gpu_memory_utilization": 0.6}


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> str:
    return write_config(tmp_path_factory)


def _colocated(micro: str, **kw) -> TrainingSetup:
    """GRPO with vLLM colocated on the trainer's GPU (its pool's share: vllm_gpu_memory_utilization)."""
    fields = {"model": micro, "gpu": "H100-80GB", "seq_len": 64, "objective": "grpo", "num_generations": 2,
              "max_completion_length": 32, "batch_size": 2, "use_vllm": True, "vllm_mode": "colocate",
              "vllm_max_model_length": 1024, "vllm_gpu_memory_utilization": 0.3, **kw}
    return TrainingSetup(**fields)


def _events(setup: TrainingSetup, layers: int | None) -> tuple[list, list]:
    r, act = rank_step(resolve(setup))
    sch = step_schedule(r, act, layers).build()
    return sch.events, sch.phase_starts


@pytest.mark.parametrize("kw", [{}, {"method": "fsdp", "gpus": 2}, {"lora_rank": 8}], ids=["single", "fsdp", "lora"])
def test_no_schedule_reads_the_fields_the_replays_are_shared_across(micro, kw):
    """The premise: the schedule (whole, and a draft's first layer) at another value of each free field is the same
    events; at another micro-batch (a field it reads) it is not, so the comparison can tell them apart."""
    setup = _colocated(micro, **kw)
    for layers in (None, 1):
        events = _events(setup, layers)
        for name in SCHEDULE_FREE_FIELDS:
            assert _events(replace(setup, **{name: OTHER_VALUE[name]}), layers) == events
        assert _events(replace(setup, batch_size=4), layers) != events


def test_the_key_leaves_out_the_free_fields_only(micro):
    setup = _colocated(micro)
    assert schedule_key(replace(setup, vllm_gpu_memory_utilization=0.6)) == schedule_key(setup)
    assert schedule_key(replace(setup, batch_size=4)) != schedule_key(setup)
    assert schedule_key(replace(setup, vllm_max_model_length=2048)) != schedule_key(setup)


def test_an_engine_replays_a_step_once_across_vllm_utilizations(micro, monkeypatch):
    """Two utilizations: one whole-step replay between them, and each answer the one a fresh engine gives (the
    pool beside the trainer differs: 0.3 or 0.6 of the 80 GiB device is vLLM's, so the answers do too)."""
    made = []
    real = engine.replay
    monkeypatch.setattr(engine, "replay", lambda *a, **k: made.append(1) or real(*a, **k))
    at_3 = _colocated(micro)
    at_6 = replace(at_3, vllm_gpu_memory_utilization=0.6)
    gpu = resolve_gpu("H100-80GB")
    shared = LlmemEngine(setup_anatomy(at_3), gpu)
    first = shared.full(at_3)
    replays = len(made)
    second = shared.full(at_6)
    assert replays >= 1 and len(made) == replays      # the uncapped replay read, not made again
    assert second.peak_reserved_bytes == first.peak_reserved_bytes
    assert second.components["vllm_pool"] != first.components["vllm_pool"]
    fresh = LlmemEngine(setup_anatomy(at_6), gpu).full(at_6)
    assert second.to_dict() == fresh.to_dict()
    shared.full(replace(at_3, batch_size=4))          # another shape: its own replay
    assert len(made) > replays
