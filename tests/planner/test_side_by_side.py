"""The plan's what-ifs side by side (llmem.planner.side_by_side): in forked workers on Linux, the answers those of
the searches run in turn, an error in a worker raised in the plan as it would be in turn."""

from __future__ import annotations

import json
import os
import sys

import pytest

from llmem.errors import LlmemError
from llmem.planner.options import PlanOptions, parse_workers
from llmem.planner.plan import plan
from llmem.planner.side_by_side import available_cpus, side_by_side
from llmem.setup.training import TrainingSetup

linux = pytest.mark.skipif(sys.platform != "linux", reason="the searches fork only on Linux")


def _pid() -> int:
    return os.getpid()


def _square(x: int) -> int:
    return x * x


def _refuse() -> int:
    raise LlmemError("--lora-rank 0 must be >= 1: give a rank")


@linux
def test_tasks_run_in_other_processes_and_come_back_in_order():
    done: list[tuple[int, int]] = []
    got = side_by_side([_pid] * 3 + [lambda x=x: _square(x) for x in range(5)], 2, first=[7, 6, 5, 4, 3, 2, 1, 0],
                       done=lambda i, n: done.append((i, n)))
    assert os.getpid() not in got[:3]
    assert got[3:] == [0, 1, 4, 9, 16]
    assert sorted(i for i, _ in done) == list(range(8)) and [n for _, n in done] == list(range(1, 9))


def test_one_worker_runs_them_here_in_the_order_handed_out():
    order: list[int] = []
    got = side_by_side([_pid, _pid], 1, first=[1, 0], done=lambda i, n: order.append(i))
    assert got == [os.getpid(), os.getpid()] and order == [1, 0]


@linux
def test_a_refusal_in_a_worker_is_the_plans():
    with pytest.raises(LlmemError, match="--lora-rank 0 must be >= 1"):
        side_by_side([_pid, _refuse], 2)


def test_workers_flag():
    assert parse_workers("auto") == available_cpus() >= 1
    assert parse_workers("3") == 3
    with pytest.raises(LlmemError, match="--workers takes a number of processes or auto"):
        parse_workers("many")
    with pytest.raises(LlmemError, match="--workers must be >= 1"):
        PlanOptions(workers=0)


@linux
def test_plan_side_by_side_is_the_plan_in_turn():
    """tiny-llama on 4 GPUs of 1340 MiB at 1024 tokens: nothing fits as given, so every what-if (savers, shorter
    sequence, LoRA / QLoRA menus, offload, more GPUs) is searched; the whole answer is the same on 1 and 3 workers."""
    setup = TrainingSetup(model="tiny-llama", gpus=4, seq_len=1024, gpu="A100-80GB", gpu_memory="1340MiB")
    alone = plan(setup, PlanOptions(layouts="dp-tp", workers=1)).to_dict()
    beside = plan(setup, PlanOptions(layouts="dp-tp", workers=3)).to_dict()
    assert alone["recommended"]["method"] is None and len(alone["suggestions"]) >= 8
    assert json.dumps(beside, sort_keys=True) == json.dumps(alone, sort_keys=True)


def _unpicklable():
    return lambda: os.getpid()


@linux
def test_an_answer_pickle_cannot_carry_is_worked_out_here():
    got = side_by_side([_pid, _unpicklable], 2)
    assert got[0] == os.getpid() and got[1]() == os.getpid()     # the fork's answers dropped, both run here


def test_a_plan_whose_activations_are_learned_searches_in_turn(monkeypatch):
    """A vision-language step learns its vision side at each set-up and batch (llmem.learn, torch): side by side
    each worker would learn it again, so such a plan runs its searches in turn; a text model's keeps its workers
    (learning as users get it: the tests' default is never)."""
    monkeypatch.setenv("LLMEM_LEARN", "auto")
    from llmem.model.anatomy import setup_anatomy
    from llmem.planner.plan import in_turn_when_learned

    def workers(**kw) -> int:
        setup = TrainingSetup(**kw)
        return in_turn_when_learned(setup, setup_anatomy(setup), PlanOptions(workers=4)).workers

    assert workers(model="tiny-qwen2_5_vl", gpus=2, seq_len=64, images_per_sample=1, image_size="448x448") == 1
    assert workers(model="tiny-llama", gpus=2, seq_len=64) == 4
