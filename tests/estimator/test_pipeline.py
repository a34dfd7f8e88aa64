"""Pipeline parallelism: micro-batches in flight per schedule and stage (by hand, and against torch's own action
lists), torchtitan's layer split by hand, and the refusals."""

from __future__ import annotations

import contextlib

import pytest

from llmem.errors import LlmemError
from llmem.setup.pipeline import (
    PIPELINE_SCHEDULES,
    rank_actions,
    rank_splits,
    stage_splits,
    torchtitan_pipeline,
)
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
    assert [_held(k for k, _, _ in rank_actions(schedule, r, pp, n, spec.virtual_stages))
            for r in range(pp)] == expected


def test_interleaved_order_by_hand():
    """pp 2, v 2, 4 micro-batches (two rounds of 2): rank 1 warms up (v - 1) x 2 = 2 forwards of
    its first stage, then 1F1B from its second (the last stage), whose backwards come first."""
    assert rank_actions("interleaved-1f1b", 1, 2, 4, 2)[:6] == (
        ("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1))
    # three stages per rank: rank 0 warms up (3 - 1) x 2 + 2 = 6 forwards, two per stage
    assert [c for _, c, _ in rank_actions("interleaved-1f1b", 0, 2, 4, 3)[:7]] == [0, 0, 1, 1, 2, 2, 0]


@contextlib.contextmanager
def _fake_group(world: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _torch_order(schedule: str, pp: int, n: int, v: int) -> dict[int, list[tuple[str, int, int]]]:
    """torch's own pipeline_order (its schedule IR) for every rank, as (F / B, the rank's chunk, micro-batch)."""
    import torch
    from torch import nn
    from torch.distributed import pipelining

    spec = PIPELINE_SCHEDULES[schedule]
    stages = [pipelining.PipelineStage(nn.Linear(2, 2), k * pp, pp * v, torch.device("cpu")) for k in range(v)]
    cls = getattr(pipelining, spec.torch_class)
    sch = cls(stages if spec.looped else stages[0], n_microbatches=n, loss_fn=lambda o, t: o.sum())
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    return {r: [(kinds[a.computation_type.name], a.stage_index // pp, a.microbatch_index) for a in acts
                if a is not None and a.computation_type.name in kinds]
            for r, acts in sch.pipeline_order.items()}


_MODELLED = [name for name, spec in PIPELINE_SCHEDULES.items() if spec.modelled]


@pytest.mark.parametrize("schedule, v", [(name, PIPELINE_SCHEDULES[name].virtual_stages) for name in _MODELLED]
                         + [("interleaved-1f1b", 3)])
@pytest.mark.parametrize("pp, n", [(2, 4), (4, 8), (4, 6), (2, 2)])
def test_micro_batches_in_flight_follow_torchs_schedule(schedule, v, pp, n):
    """The order of each rank's forwards and backwards (stage, micro-batch) and the counts in flight against the
    action list torch's schedule class builds itself (pipeline_order, what _PipelineScheduleRuntime runs)."""
    spec = PIPELINE_SCHEDULES[schedule]
    if not spec.looped and n < pp:
        pytest.skip("torch refuses fewer micro-batches than stages")
    with _fake_group(pp):
        order = _torch_order(schedule, pp, n, v)
    # a single-stage schedule's IR numbers a later rank's micro-batches off by one (its _get_pipeline_order is for
    # display; _step_microbatches runs them in order): its kinds only
    def kinds(actions):
        return list(actions) if spec.looped else [k for k, _, _ in actions]

    assert all(kinds(order[r]) == kinds(rank_actions(schedule, r, pp, n, v)) for r in range(pp))
    assert [_held(k for k, _, _ in order[r]) for r in range(pp)] == \
        [spec.microbatches_in_flight(r, pp, n, v) for r in range(pp)]


def test_layer_split_by_hand():
    """torchtitan's split: layers + 1 (embedding) + 1 (norm + lm_head) "effective layers" spread evenly, the first
    stages one more where they do not divide."""
    two = stage_splits(4, 2)               # 6 effective: 3 each
    assert [(s.embedding, list(s.layers), s.head) for s in two] == [(True, [0, 1], False), (False, [2, 3], True)]
    four = stage_splits(32, 4)             # 34 effective: 9, 9, 8, 8
    assert [list(s.layers)[::len(s.layers) - 1] for s in four] == [[0, 7], [8, 16], [17, 24], [25, 31]]
    assert [len(s.layers) for s in four] == [8, 9, 8, 7]
    assert four[0].embedding and four[-1].head and not any(s.embedding or s.head for s in four[1:3])
    # interleaved, 2 ranks x 2 stages of 4 layers (6 effective: 2, 2, 1, 1): rank 0 holds stages 0 and 2, rank 1
    # stages 1 and 3 (the last: norm and lm_head only)
    assert [[list(s.layers) for s in rank_splits(4, 2, 2, r)] for r in range(2)] == [[[0], [3]], [[1, 2], []]]


def test_torchtitan_pipeline_fields_by_hand():
    """torchtitan's defaults need no layers-per-stage (2 stages per rank for a looped schedule); 3 per rank on 4
    layers: 6 stages of ceil(6 / 6) = 1 effective layer each, which torchtitan turns back into ceil(6 / 1) = 6."""
    assert torchtitan_pipeline(2, "1f1b", 1, 4) == {"pipeline_parallel_degree": 2,
                                                    "pipeline_parallel_schedule": "1F1B",
                                                    "pipeline_parallel_microbatch_size": 1}
    assert "pipeline_parallel_layers_per_stage" not in torchtitan_pipeline(2, "interleaved-1f1b", 2, 4)
    assert torchtitan_pipeline(2, "interleaved-1f1b", 1, 4, 3)["pipeline_parallel_layers_per_stage"] == 1
    # 32 layers, 4 ranks x 3: 34 effective over 12 stages, 3 each -> ceil(34 / 3) = 12 stages
    assert torchtitan_pipeline(4, "interleaved-1f1b", 1, 32, 3)["pipeline_parallel_layers_per_stage"] == 3
    # 2 ranks x 8 on 32 layers: 16 stages would need ceil(34 / 16) = 3 layers each, which torchtitan makes 12 stages
    with pytest.raises(LlmemError, match="layers_per_stage"):
        torchtitan_pipeline(2, "interleaved-1f1b", 1, 32, 8)


@pytest.mark.parametrize("fields, words", [
    ({"method": "single", "gpus": 2, "pp": 2, "batch_size": 4, "pp_microbatches": 3}, "divisible"),
    ({"method": "single", "gpus": 2, "pp": 2, "batch_size": 4, "pp_microbatches": 1}, "at least as many"),
    ({"method": "ddp", "gpus": 4, "pp": 2, "batch_size": 2}, "single"),
    ({"method": "single", "pp_microbatches": 2}, "add --pp"),
    ({"method": "single", "gpus": 2, "pp": 2, "pp_schedule": "zb"}, "unknown --pp-schedule"),
    ({"method": "single", "gpus": 2, "pp": 2, "pp_virtual_stages": 2}, "1 stage per rank"),
    ({"method": "single", "gpus": 2, "pp": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 1},
     "at least 2 stages per rank"),
    # ScheduleInterleaved1F1B: 5 micro-batches on 2 ranks are 2 rounds, and 5 is not a multiple of 2
    ({"method": "single", "gpus": 2, "pp": 2, "pp_schedule": "interleaved-1f1b", "batch_size": 5}, "rounds"),
    ({"method": "single", "pp_virtual_stages": 2}, "add --pp"),
    ({"method": "fsdp", "gpus": 4, "pp": 2, "batch_size": 2, "pp_schedule": "interleaved-1f1b"}, "not modelled"),
    ({"method": "single", "gpus": 2, "pp": 2, "pp_schedule": "interleaved-zb"}, "weight-gradient"),
    ({"method": "single", "gpus": 2, "pp": 2, "pp_schedule": "zbv"}, "weight-gradient"),
    ({"method": "single", "gpus": 2, "pp": 2, "pp_schedule": "dualpipev"}, "overlapped"),
])
def test_bad_pipeline_options_are_one_line(fields, words):
    with pytest.raises(LlmemError, match=words) as info:
        TrainingSetup(model="tiny-llama", **fields)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("fields, words", [
    ({"method": "single", "gpus": 7, "pp": 7, "batch_size": 7}, "more stages than"),     # 4 layers + 2
    ({"method": "single", "gpus": 2, "pp": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 4},
     "more stages than"),
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


def test_virtual_stages_on_the_command_line(capsys):
    """--pp-virtual-stages reaches the set-up; a refused value is one line, exit 2."""
    from llmem.cli import main

    assert main(["estimate", "tiny-llama", "--gpus", "2", "--pp", "2", "--pp-schedule", "interleaved-1f1b",
                 "--pp-virtual-stages", "1", "--batch-size", "2", "--seq-len", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert "at least 2 stages per rank" in err and "\n" not in err


def test_interleaved_estimate_holds_the_ranks_stages():
    """Interleaved1F1B on 2 ranks x 2 stages of tiny-llama (4 layers): rank 0 holds the embedding and layers 0 and 3
    (stages 0 and 2), rank 1 layers 1-2 and the head; the answer names both of the rank's stages."""
    from llmem.estimator.engine import estimate

    r = estimate(TrainingSetup(model="tiny-llama", method="single", gpus=2, pp=2, pp_schedule="interleaved-1f1b",
                               precision="bf16", optimizer="sgd", batch_size=4, seq_len=64))
    assert [s["stage"] for s in r.stages] == [0, 1]
    note = next(n for n in r.notes if n.startswith("pipeline (ScheduleInterleaved1F1B"))
    assert "stages 1, 3 of 4" in note and "layers 1-2" in note and "norm, lm_head" in note


def test_stage_chunks_compose_to_the_whole_model():
    """Interleaved1F1B's stages as the trace builds them (each rank's split model, a StageChunk per stage), run in
    stage order across the two ranks on real CPU tensors, give the whole HF model's logits."""
    import copy

    import torch

    from llmem.runtime.build import init_real_weights, materialize, meta_model_for
    from llmem.runtime.pipeline import split_model, stage_chunks

    whole = meta_model_for(TrainingSetup(model="tiny-llama", precision="fp32", seq_len=16))
    materialize(whole, "cpu")
    init_real_weights(whole)
    whole.eval()
    ids = torch.randint(0, whole.config.vocab_size, (1, 16))
    with torch.no_grad():
        expected = whole(input_ids=ids).logits
    ranks = []
    for rank, model in enumerate((copy.deepcopy(whole), whole)):
        splits = rank_splits(4, 2, 2, rank)
        split_model(model, splits)
        ranks.append(stage_chunks(model, splits))
    x = ids
    with torch.no_grad():
        for stage in range(4):                  # stage s on rank s % 2, its chunk s // 2
            x = ranks[stage % 2][stage // 2](x)
    torch.testing.assert_close(x, expected)


def test_interleaved_bubble_by_hand():
    """The fill and drain of pp - 1 slots shrink with the v stages per rank: 4 ranks, 8 micro-batches, 2 stages each
    idle 3 / (2 x 8 + 3) of the step, against 1F1B's 3 / (8 + 3)."""
    assert PIPELINE_SCHEDULES["interleaved-1f1b"].bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    assert PIPELINE_SCHEDULES["interleaved-1f1b"].bubble_fraction(4, 8, 4) == pytest.approx(3 / 35)
    assert PIPELINE_SCHEDULES["1f1b"].bubble_fraction(4, 8) == pytest.approx(3 / 11)


@pytest.mark.parametrize("command", ["estimate", "trace", "measure"])
@pytest.mark.parametrize("argv", [
    # GPT-2 ties wte and lm_head (on the first and the last stage); its decoder is `h`, not `layers`
    ["gpt2", "--pp", "2", "--gpus", "2", "--method", "single", "--precision", "bf16", "--seq-len", "64"],
    # tiny-qwen3 ties them too, under TP x PP (the trace failed in each rank's thread)
    ["tiny-qwen3", "--method", "tp", "--gpus", "4", "--pp", "2", "--precision", "bf16", "--seq-len", "64"],
    # autocast over a whole schedule step
    ["tiny-llama", "--pp", "2", "--gpus", "2", "--method", "single", "--precision", "bf16-mixed", "--seq-len", "64"],
], ids=["gpt2-tied", "qwen3-tp-tied", "llama-autocast"])
def test_trace_and_measure_refuse_what_the_estimate_refuses(command, argv, capsys, monkeypatch):
    """A pipeline set-up the estimate does not model is refused by trace and measure in the estimate's line, exit 2,
    before any model is built."""
    import llmem.runtime.step
    from llmem.cli import main

    def built(*args, **kwargs):
        raise AssertionError("a model was built before the refusal")

    monkeypatch.setattr(llmem.runtime.step, "meta_model_stage", built)
    assert main([command, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("llmem: error: --pp with "), err
    words = "autocast over the whole schedule step" if "bf16-mixed" in argv else "tied input and output embeddings"
    assert words in err
