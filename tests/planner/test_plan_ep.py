"""`llmem plan` over expert parallelism (torchtitan's FSDP2 x EP, llmem.setup.expert_parallel): the ep degrees
searched for an MoE (each dividing the routed experts and the GPUs, no more FSDP2 ranks than experts), a given
--ep fixing the degree, the plan's memory against `llmem estimate` of the same set-up, the all-to-all term of its
time worked out by hand, the exports' refusals, and no ep layout for a dense model."""

from __future__ import annotations

import pytest

from llmem.errors import LlmemError
from llmem.estimator.engine import estimate
from llmem.memory.activations.learned import LEARN_ENV
from llmem.model.anatomy import load_anatomy
from llmem.planner.engines import memory_engine
from llmem.planner.export import write_export
from llmem.planner.options import PlanOptions
from llmem.planner.plan import expert_parallel_experts, plan, plan_layouts
from llmem.planner.search import PlanContext, limit_bytes
from llmem.planner.timing import COLLECTIVE_LATENCY_S
from llmem.setup.gpus import resolve_gpu
from llmem.setup.training import TrainingSetup

MOE = "tiny-qwen3-moe"      # 4 decoder layers, hidden 256, 8 routed experts, top-2, no dense layer


def _setup(model: str = MOE, gpus: int = 4, **kw) -> TrainingSetup:
    return TrainingSetup(model=model, method="fsdp", gpus=gpus, precision="bf16-mixed", seq_len=256, **kw)


def _layouts(setup: TrainingSetup) -> list:
    a, gpu = load_anatomy(setup.model), resolve_gpu("A100-80GB")
    options = PlanOptions()
    limit = limit_bytes(gpu, options.headroom)
    return plan_layouts(PlanContext(a, gpu, options, memory_engine("llmem", a, gpu, None, limit), limit), setup)


def _eps(setup: TrainingSetup) -> list[int]:
    return [lay.ep for lay in _layouts(setup) if lay.ep > 1]


def test_ep_degrees_searched_for_a_tiny_moe():
    # 8 experts: at 4 GPUs the eps dividing both 8 and 4 (2, 4); at 8 GPUs 2, 4, 8 (ep 8: one expert per rank,
    # efsdp 1); at 16 GPUs none (16 FSDP2 ranks > 8 experts: torchtitan shards them on dim 1, not modelled)
    assert _eps(_setup(gpus=4)) == [2, 4]
    assert _eps(_setup(gpus=8)) == [2, 4, 8]
    assert _eps(_setup(gpus=16, gpus_per_node=8)) == []
    labels = [lay.label for lay in _layouts(_setup(gpus=8)) if lay.ep > 1]
    assert labels == ["fsdp (dp 8, ep 2)", "fsdp (dp 8, ep 4)", "fsdp (dp 8, ep 8)"]
    assert all((lay.dp, lay.tp, lay.pp, lay.cp, lay.replicas) == (8, 1, 1, 1, 1)
               for lay in _layouts(_setup(gpus=8)) if lay.ep > 1)
    # a given --ep fixes the degree: only that layout
    assert [(lay.label, lay.ep) for lay in _layouts(_setup(gpus=8, ep=4))] == [("fsdp (dp 8, ep 4)", 4)]
    # options --ep refuses (here --fused-ce) leave the ep layouts out, as the estimator would refuse them
    assert _eps(_setup(gpus=4, fused_ce=True)) == []


def test_dense_model_never_gets_ep_layouts():
    dense = _setup("tiny-llama", gpus=8)
    assert expert_parallel_experts(load_anatomy("tiny-llama"), dense) == 0
    assert _eps(dense) == []
    with pytest.raises(LlmemError, match="dense"):
        _layouts(_setup("tiny-llama", gpus=4, ep=2))


def test_plan_with_ep_matches_estimate_and_times_the_all_to_all(tmp_path, monkeypatch):
    monkeypatch.setenv(LEARN_ENV, "auto")      # --ep's all-to-all buffers are in the learned EP forward only
    setup = _setup(ep=2)
    p = plan(setup, PlanOptions(batch_cap=4))
    (c,) = p.candidates
    assert p.recommended is c and c.layout.label == "fsdp (dp 4, ep 2)" and c.max_batch_size == 4
    out = p.to_dict()
    assert out["recommended"]["label"] == "fsdp (dp 4, ep 2)" and out["recommended"]["ep"] == 2
    # the plan's memory is `llmem estimate` of the same set-up at the plan's batch
    e = estimate(_setup(ep=2, batch_size=4))
    assert (c.memory.peak_allocated_bytes, c.memory.peak_reserved_bytes) == \
        (e.peak_allocated_bytes, e.peak_reserved_bytes)
    # the dispatch and combine all-to-alls, forward and backward, per MoE layer: the rank's 4 x 256 tokens x top-2
    # = 2048 rows x hidden 256 x bf16 2 B, half of them to the other ep rank, over A100's 300 GB/s NVLink
    moved = 4 * 256 * 2 * 256 * 2 / 2
    assert c.time.ep_comm_s == pytest.approx(4 * 4 * (moved / 300e9 + COLLECTIVE_LATENCY_S))
    assert c.time.step_s > c.time.compute_s + c.time.ep_comm_s
    # torchtitan has no flavor for Qwen3-MoE: one line; the torch launchers cannot express ep: one line
    with pytest.raises(LlmemError, match="torchtitan has no model flavor") as exc:
        write_export(p, "torchtitan", str(tmp_path / "t.toml"))
    assert "\n" not in str(exc.value)
    with pytest.raises(LlmemError, match="only --export torchtitan writes"):
        write_export(p, "accelerate", str(tmp_path / "a.yaml"))
    assert not list(tmp_path.iterdir())
