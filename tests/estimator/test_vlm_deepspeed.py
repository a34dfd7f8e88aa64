"""Vision-language steps under DeepSpeed's engine (ds-zero1/2/3): ZeRO-3's fetches of the tower's pieces
(llmem.estimator.deepspeed_tower), the norm's views of a share the embedding straddles, plan's DeepSpeed layouts,
and the refusals. The trace agreement itself is the CI rows' (llmem.validate.matrices)."""

from __future__ import annotations

import pytest

from llmem.cli import main
from llmem.estimator.engine import learn_if_needed, step_schedule
from llmem.memory.activations.learned import LEARN_ENV
from llmem.memory.activations.profile import activation_profile
from llmem.model.resolved import resolve
from llmem.planner.options import PlanOptions
from llmem.planner.plan import plan
from llmem.setup.deepspeed import partition_gradient_numels, partition_norm_numels
from llmem.setup.training import TrainingSetup

# HF's "auto" thresholds for the text hidden size 512: persistence 10 x 512 = 5,120 elements, so the tiny tower's
# matrices are fetched (at DeepSpeed's default 1e5 every one of them would stay whole on every rank)
AUTO = dict(reduce_bucket_size="auto", prefetch_bucket_size="auto", param_persistence_threshold="auto")
VL = dict(model="tiny-qwen2_5_vl", method="ds-zero3", gpus=2, gpu="H100-80GB", precision="bf16-mixed", batch_size=4,
          seq_len=64, images_per_sample=1, image_size="448x448", **AUTO)

# tiny-qwen2_5_vl's vision config: hidden 128, MLP 344, patches 3 x 2 x 14 x 14, merger 4 x 128 -> 512 -> 512.
# Elements above the persistence threshold, by hand: a block's qkv 128 x 384, proj 128 x 128, gate / up / down
# 128 x 344 each (norms and biases persistent); the patch embedding's Conv3d; the merger's two 512 x 512 matrices
PATCH_EMBED = 3 * 2 * 14 * 14 * 128
BLOCK = 128 * 384 + 128 * 128 + 3 * 128 * 344
MERGER = 2 * 512 * 512
EMBED = 16000 * 512


@pytest.fixture(autouse=True)
def _learning(monkeypatch):
    """The vision side is learned from the trace (llmem.learn); the suite turns learning off by default."""
    monkeypatch.setenv(LEARN_ENV, "auto")


def _gathers(setup: TrainingSetup, phase: str) -> list[int]:
    """The bf16 elements of each ZeRO-3 fetch in `phase` of the estimate's schedule: its gathered_weights
    allocations above the persistence threshold (smaller ones are the learned side's own copies)."""
    r = resolve(setup)
    learn_if_needed(r)
    sch = step_schedule(r, activation_profile(r)).build()
    bounds = [*sch.phase_starts, (len(sch.events), "")]
    out = []
    for (start, name), (stop, _) in zip(bounds, bounds[1:], strict=False):
        out += [size // 2 for sign, _k, size, _s, what in sch.events[start:stop]
                if name == phase and sign > 0 and what == "gathered_weights" and size > 2 * 10 * 512]
    return out


def test_zero3_fetches_each_tower_piece_in_forward_and_backward():
    """The first step records the coordinator's trace: each piece fetched at its forward and released after it,
    the input embedding first (every VLM embeds the ids before it encodes the images), then again in reverse in
    the backward, which runs through the trained tower before the embedding's."""
    tower = [PATCH_EMBED, *[BLOCK] * 4, MERGER]
    forward = _gathers(TrainingSetup(**VL), "it0:forward")
    assert forward[:1 + len(tower)] == [EMBED, *tower]
    backward = _gathers(TrainingSetup(**VL), "it0:backward")
    at = backward.index(MERGER)
    assert backward[at:at + len(tower) + 1] == [*reversed(tower), EMBED]


def test_a_frozen_tower_is_fetched_in_forward_only():
    """--freeze-vision-tower: the blocks' outputs need no gradient, so no pre-backward hook fetches them; the
    merger (Qwen's projector, still trained) runs its backward."""
    setup = TrainingSetup(**VL, freeze_vision_tower=True)
    assert _gathers(setup, "it0:forward")[:7] == [EMBED, PATCH_EMBED, *[BLOCK] * 4, MERGER]
    backward = _gathers(setup, "it0:backward")
    assert MERGER in backward and BLOCK not in backward and PATCH_EMBED not in backward


def test_the_norm_reads_the_share_of_a_straddling_parameter():
    """ZeRO-1/2's norm (get_grad_norm_direct over averaged_gradients: get_flat_partition's views) reads the part of
    each parameter inside rank 0's share; grads_in_partition holds them whole. A VLM's tower (760 elements here)
    comes before its embedding (4,096), which straddles the end of the share: 6,856 elements padded to a multiple
    of 2 x 2 (nccl_start_alignment_factor x dp), 3,428 a rank."""
    numels = [760, 4096, 2000]
    assert partition_norm_numels(numels, 2, 2) == [760, 3428 - 760]
    assert partition_gradient_numels(numels, 2, 2) == [760, 4096]
    assert partition_norm_numels(numels, 3, 2) == [380, 2048, 1000]      # stage 3: each parameter's partition


def test_plan_searches_the_deepspeed_layout_it_is_asked_for():
    """As for a text model, DeepSpeed's engine is searched when --method names it."""
    setup = TrainingSetup(**{**VL, "method": "ds-zero2", "param_persistence_threshold": None,
                             "prefetch_bucket_size": None})
    p = plan(setup, PlanOptions(batch_cap=2, layouts="dp-tp", methods=("ds-zero2",)))
    assert [c.layout.method for c in p.candidates] == ["ds-zero2"]
    assert p.candidates[0].fits and p.candidates[0].max_batch_size == 2


@pytest.mark.parametrize("argv, named", [
    (["--method", "ds-zero3", "--offload-param"], "--offload-param"),
    (["--method", "ds-zero2", "--offload-optimizer"], "--offload-optimizer"),
])
def test_what_is_not_wired_is_refused_in_one_line(capsys, argv, named):
    base = ["estimate", "tiny-qwen2_5_vl", "--images-per-sample", "1", "--image-size", "448x448", "--seq-len", "64",
            "--gpus", "2"]
    assert main(base + argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and "Traceback" not in err
