"""A deep step schedule made from a shallow one's template layer (llmem.estimator.deepen) against the same schedule
built layer by layer: a toy builder written here (whose deep schedule is known by building it), and the engine's
own schedules of real catalog models, every event compared (keys by the order of their allocation)."""

from __future__ import annotations

import random

import pytest

from llmem.estimator import deepen
from llmem.estimator import engine as eng
from llmem.estimator import pipeline as pl
from llmem.estimator.deepen import (
    _python_live_bytes,
    _python_repeat_events,
    alike_layers,
    deepened,
    same_schedule,
    whole_from_template,
)
from llmem.estimator.events import REDUCE_SCATTER, Schedule
from llmem.model.resolved import resolve
from llmem.setup.training import TrainingSetup

MiB = 1 << 20


def toy(depth: int, *, bucket: bool = False, special: int | None = None) -> Schedule:
    """An FSDP-like step over `depth` layers, written without deepen's rule: each layer's unit gathered (the next
    one prefetched by the layer before), resharded after its forward; its activations kept for its backward; the
    backward's reduce-scatter input freed at the next layer's; the optimizer's states per parameter and a foreach
    temporary of every parameter, freed after all of them. `bucket`: one buffer sized by the depth (as DDP's
    buckets span layers); `special`: that layer keeps one tensor more."""
    sch = Schedule()
    sch.phase = "setup:setup"
    sch.alloc(7 * MiB, "weights")                       # the root's parameters
    for i in range(depth):
        sch.own(i)
        sch.alloc(4 * MiB, "weights")
        sch.alloc(1 * MiB, "weights")
    sch.own(None)
    if bucket:
        sch.alloc(depth * 5 * MiB, "communication_buffers")
    kept: dict[int, list[int]] = {}
    for it in range(2):
        sch.phase = f"it{it}:forward"
        embed = sch.alloc(3 * MiB, "activations")
        gathered = {0: sch.alloc(16 * MiB, "gathered_weights")}
        for i in range(depth):
            sch.enter_layer(i)
            if i + 1 < depth:
                gathered[i + 1] = sch.alloc(16 * MiB, "gathered_weights")
            kept[i] = [sch.alloc(2 * MiB, "activations"), sch.alloc(6 * MiB, "activations")]
            if i == special:
                kept[i].append(sch.alloc(9 * MiB, "activations"))
            tmp = sch.alloc(11 * MiB, "activations")
            sch.free(tmp)
            sch.free(gathered.pop(i))
        sch.own(None)
        logits = sch.alloc(20 * MiB, "activations")
        sch.phase = f"it{it}:backward"
        sch.mark("lm_head and loss")
        sch.free(logits)
        pending = -1
        for i in reversed(range(depth)):
            sch.enter_layer(i)
            unit = sch.alloc(16 * MiB, "gathered_weights")
            grad = sch.alloc(4 * MiB, "gradients")
            sch.free_all(kept.pop(i))
            sch.free(pending)
            pending = sch.alloc(4 * MiB, "communication_buffers", REDUCE_SCATTER)
            sch.free(grad)
            sch.free(unit)
        sch.own(None)
        sch.free(pending)
        sch.free(embed)
        sch.phase = f"it{it}:optimizer_step"
        sch.mark("optimizer step")
        if it == 0:
            for i in range(depth):
                sch.own(i)
                sch.alloc(8 * MiB, "optimizer_states")
            sch.own(None)
        temps = []
        for i in range(depth):
            sch.own(i)
            temps.append(sch.alloc(4 * MiB, "optimizer_temporaries"))
        sch.own(None)
        sch.free_all(temps)
    return sch


@pytest.mark.parametrize("layers", [5, 6, 7, 8, 12, 40, 81])
def test_toy_deepened_is_the_toy_built_at_that_depth(layers):
    got = deepened(toy(5), 5, layers)
    want = toy(layers)
    assert got is not None
    assert same_schedule(got, want)
    assert (got.peak_live_bytes, got.live_bytes) == (want.peak_live_bytes, want.live_bytes)
    assert got.where(len(got.events) - 1) == "optimizer step"
    assert [m for _, m in got.marks].count(f"layer {layers - 1}") == 4      # its forward and backward, twice


def test_whole_from_template_checks_the_rule_against_a_deeper_build():
    assert same_schedule(whole_from_template(toy, 40), toy(40))
    # a buffer sized by the depth outside any layer's part: deepening keeps the shallow one's, the check sees it
    assert whole_from_template(lambda d: toy(d, bucket=True), 40) is None
    # a layer unlike the others within the checked depth
    assert whole_from_template(lambda d: toy(d, special=6), 40) is None
    # too shallow to gain: built
    assert whole_from_template(toy, deepen.DEEPEN_FROM_LAYERS - 1) is None


def test_a_layer_part_outside_a_pass_is_not_deepened():
    sch = toy(5)
    sch.own(2)                  # a lone part of the template layer, between nothing of its neighbours'
    sch.alloc(MiB, "activations")
    sch.own(None)
    assert deepened(sch, 5, 9) is None


def test_the_compiled_copies_match_their_python_twin():
    rng = random.Random(3)
    part = [(rng.choice((1, -1)), rng.randrange(50), rng.randrange(1, 1 << 40), rng.randrange(3), "activations")
            for _ in range(300)]
    moved = {k: 1000 + 7 * k for k in range(0, 50, 2)}
    shifts = [0, 64, 128, 9000]
    want: list = []
    _python_repeat_events(part, moved, shifts, want)
    got: list = []
    deepen._repeat_events(part, moved, shifts, got)
    assert got == want
    assert deepen._live_bytes(want) == _python_live_bytes(want)
    assert _python_live_bytes([(1, 0, 5, 0, "a"), (1, 1, 7, 0, "a"), (-1, 0, 5, 0, "a")]) == (12, 7)


def _step(**kw):
    r, act = eng.rank_step(resolve(TrainingSetup(**kw)))
    return r, act


# set-ups of 80-layer models whose whole schedules the engine deepens, each compared with the one it builds
DEEPENED = [
    dict(model="meta-llama/Llama-3.1-70B", method="fsdp", gpus=8, seq_len=512),
    dict(model="meta-llama/Llama-3.1-70B", method="fsdp+tp", gpus=8, tp=4, seq_len=512, grad_ckpt=True),
    dict(model="meta-llama/Llama-3.1-70B", method="fsdp", gpus=8, seq_len=512, grad_ckpt=True, lora_rank=16,
         lora_targets="all-linear"),
    dict(model="meta-llama/Llama-3.1-70B", method="fsdp", gpus=8, seq_len=512, quant_base="nf4", lora_rank=16,
         grad_ckpt=True),
    dict(model="Qwen/Qwen2.5-72B", method="zero3", gpus=8, seq_len=512, optimizer="adamw-forloop"),
    dict(model="Qwen/Qwen2.5-72B", method="zero2", gpus=8, seq_len=512, optimizer="lion"),
    dict(model="Qwen/Qwen2.5-72B", method="single", gpus=1, seq_len=256, lora_rank=8, optimizer="adamw-8bit",
         offload_activations=True),
    dict(model="Qwen/Qwen2.5-72B", method="tp", gpus=8, seq_len=512, precision="bf16", sequence_parallel=True),
    dict(model="meta-llama/Llama-3.1-70B", method="fsdp", gpus=8, cp=2, seq_len=1024, grad_ckpt=True),
    dict(model="meta-llama/Llama-3.1-70B", method="fsdp", gpus=8, seq_len=512, objective="dpo", lora_rank=16),
]


@pytest.mark.parametrize("kw", DEEPENED, ids=lambda kw: f"{kw['method']}-{kw.get('optimizer', 'adamw')}")
def test_the_engine_deepens_real_schedules_event_for_event(kw):
    r, act = _step(**kw)
    got = eng.from_template(r, act)
    assert got is not None, "expected deepened"
    built = eng.step_schedule(r, act).build()
    assert same_schedule(got, built)
    assert (got.peak_live_bytes, got.live_bytes) == (built.peak_live_bytes, built.live_bytes)
    assert eng.whole_schedule_within(r, act, built.peak_live_bytes - 1) is None
    assert eng.whole_schedule_within(r, act, built.peak_live_bytes) is not None


def test_a_pipeline_stage_of_alike_layers_is_deepened():
    r = resolve(TrainingSetup(model="Qwen/Qwen2.5-72B", method="fsdp", gpus=8, pp=2, seq_len=512, batch_size=4))
    for rank in range(2):
        split = pl.splits_of(r, rank)[0]
        got = pl.stage_from_template(r, split, rank)
        assert got is not None
        assert same_schedule(got, pl.stage_builder(r, rank).build())


def test_layers_unlike_each_other_are_built():
    r, act = _step(model="meta-llama/Llama-3.1-70B", method="fsdp", gpus=8, seq_len=512, grad_ckpt=True,
                   ckpt_every=2)
    assert not alike_layers(r.anatomy, act)
    r, act = _step(model="meta-llama/Llama-3.1-70B", method="ddp", gpus=8, seq_len=512, lora_rank=8)
    assert eng.from_template(r, act) is None           # DDP's gradient buckets span the layers
