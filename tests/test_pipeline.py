"""Pipeline parallelism: micro-batches in flight per schedule and stage (by hand, and against torch's own action
lists), torchtitan's layer split by hand, and the refusals."""

from __future__ import annotations

import contextlib

import pytest

from llmem.errors import LlmemError
from llmem.setup.pipeline import PIPELINE_SCHEDULES, stage_actions, stage_splits
from llmem.setup.training import TrainingSetup, user_setup


def _held(kinds) -> int:
    """The most forwards not yet matched by their backward, over an action list."""
    held = peak = 0
    for kind in kinds:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("schedule, pp, n, expected", [
    ("gpipe", 4, 8, [8, 8, 8, 8]),          # every forward before the first backward
    ("1f1b", 4, 8, [4, 3, 2, 1]),           # pp - rank warm-up forwards (the last stage one at a time)
    ("1f1b", 2, 2, [2, 1]),
    ("interleaved-1f1b", 2, 4, [5, 3]),     # (v-1) x 2 + 2 per hop + 1, in stage chunks
    ("interleaved-1f1b", 4, 4, [8, 8, 7, 5]),   # capped at v x n = 8
])
def test_micro_batches_in_flight_by_hand(schedule, pp, n, expected):
    spec = PIPELINE_SCHEDULES[schedule]
    assert [spec.microbatches_in_flight(r, pp, n) for r in range(pp)] == expected
    if spec.virtual_stages == 1:
        assert [_held(k for k, _ in stage_actions(schedule, r, pp, n)) for r in range(pp)] == expected


@contextlib.contextmanager
def _fake_group(world: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _torch_order(schedule: str, pp: int, n: int) -> dict[int, list[str]]:
    """torch's own pipeline_order (its schedule IR) for every rank, as F / B kinds."""
    import torch
    from torch import nn
    from torch.distributed import pipelining

    spec = PIPELINE_SCHEDULES[schedule]
    stages = [pipelining.PipelineStage(nn.Linear(2, 2), k * pp, pp * spec.virtual_stages, torch.device("cpu"))
              for k in range(spec.virtual_stages)]
    cls = getattr(pipelining, spec.torch_class)
    sch = cls(stages if spec.virtual_stages > 1 else stages[0], n_microbatches=n, loss_fn=lambda o, t: o.sum())
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    return {r: [kinds[a.computation_type.name] for a in acts if a is not None and a.computation_type.name in kinds]
            for r, acts in sch.pipeline_order.items()}


@pytest.mark.parametrize("schedule", list(PIPELINE_SCHEDULES))
@pytest.mark.parametrize("pp, n", [(2, 4), (4, 8)])
def test_micro_batches_in_flight_follow_torchs_schedule(schedule, pp, n):
    """The counts against the action list torch's schedule class builds itself (pipeline_order), and the order of
    a stage's forwards and backwards against it."""
    spec = PIPELINE_SCHEDULES[schedule]
    with _fake_group(pp):
        order = _torch_order(schedule, pp, n)
    assert [_held(order[r]) for r in range(pp)] == [spec.microbatches_in_flight(r, pp, n) for r in range(pp)]
    if spec.virtual_stages == 1:
        assert all(order[r] == [k for k, _ in stage_actions(schedule, r, pp, n)] for r in range(pp))


def test_layer_split_by_hand():
    """torchtitan's split: layers + 1 (embedding) + 1 (norm + lm_head) "effective layers" spread evenly, the first
    stages one more where they do not divide."""
    two = stage_splits(4, 2)               # 6 effective: 3 each
    assert [(s.embedding, list(s.layers), s.head) for s in two] == [(True, [0, 1], False), (False, [2, 3], True)]
    four = stage_splits(32, 4)             # 34 effective: 9, 9, 8, 8
    assert [list(s.layers)[::len(s.layers) - 1] for s in four] == [[0, 7], [8, 16], [17, 24], [25, 31]]
    assert [len(s.layers) for s in four] == [8, 9, 8, 7]
    assert four[0].embedding and four[-1].head and not any(s.embedding or s.head for s in four[1:3])


@pytest.mark.parametrize("fields, words", [
    ({"method": "single", "gpus": 2, "pp": 2, "batch_size": 4, "pp_microbatches": 3}, "divisible"),
    ({"method": "single", "gpus": 2, "pp": 2, "batch_size": 4, "pp_microbatches": 1}, "at least as many"),
    ({"method": "ddp", "gpus": 4, "pp": 2, "batch_size": 2}, "single"),
    ({"method": "single", "pp_microbatches": 2}, "add --pp"),
    ({"method": "single", "gpus": 2, "pp": 2, "pp_schedule": "zb"}, "unknown --pp-schedule"),
])
def test_bad_pipeline_options_are_one_line(fields, words):
    with pytest.raises(LlmemError, match=words) as info:
        TrainingSetup(model="tiny-llama", **fields)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("fields, words", [
    ({"method": "single", "gpus": 5, "pp": 5, "batch_size": 5}, "more stages than"),     # 4 layers
    ({"method": "fsdp", "gpus": 2, "pp": 2, "batch_size": 2}, "at least 2 data-parallel"),
    ({"method": "single", "gpus": 4, "pp": 2, "batch_size": 2}, "--gpus 2"),
])
def test_bad_pipeline_layouts_are_one_line(fields, words):
    from llmem.model.resolved import resolve

    with pytest.raises(LlmemError, match=words) as info:
        resolve(TrainingSetup(model="tiny-llama", **fields))
    assert "\n" not in str(info.value)


def test_pp_on_as_many_gpus_defaults_to_pure_pipeline():
    assert user_setup(model="tiny-llama", gpus=2, pp=2, batch_size=2).method == "single"
    assert user_setup(model="tiny-llama", gpus=4, pp=2, batch_size=2).method == "fsdp"
