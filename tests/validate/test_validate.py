"""The estimator against the trace over the CI matrix: every configuration within 2 % on peak allocated and peak
reserved. The trace runs the real HF step on fake tensors, a few seconds a row: every run checks the matrix's
covering sample (every setting it holds, once: llmem.validate.sample), `make test-slow` the whole matrix."""

from __future__ import annotations

import json

import pytest

from llmem.cli import main
from llmem.validate.compare import COUNTERS
from llmem.validate.matrices import CI_MATRIX, MATRICES


def test_ci_matrix_covers_the_required_space():
    methods = {s.method for s in CI_MATRIX}
    assert methods >= {"single", "ddp", "fsdp", "zero2", "tp", "fsdp+tp", "ds-zero1", "ds-zero2", "ds-zero3"}
    assert {s.precision for s in CI_MATRIX} >= {"fp32", "bf16-mixed", "bf16"}
    assert {s.grad_ckpt for s in CI_MATRIX} == {True, False}
    assert {s.optimizer.split("-")[0] for s in CI_MATRIX} >= {"adamw", "sgd"}
    optimizers = {s.optimizer for s in CI_MATRIX}
    assert optimizers >= {"adamw", "sgd", "sgd-momentum", "adafactor", "lion", "adamw-8bit", "paged-adamw-8bit",
                          "muon"}
    assert {s.method for s in CI_MATRIX if s.optimizer == "muon"} >= {"single", "fsdp"}
    assert sum(s.optimizer == "adafactor" for s in CI_MATRIX) >= 2
    assert any(s.optimizer_in_backward for s in CI_MATRIX)
    assert {s.attn for s in CI_MATRIX} == {"sdpa", "eager", "flash"}
    # every-layer and every-2nd-layer checkpointing (single and sharded), fused CE (with checkpointing
    # too), activation offloading
    every_2nd = {s.method for s in CI_MATRIX if s.grad_ckpt and s.ckpt_every == 2}
    assert {"single", "fsdp"} <= every_2nd
    assert any(s.grad_ckpt and s.ckpt_every == 1 for s in CI_MATRIX)
    fused = [s for s in CI_MATRIX if s.fused_ce]
    assert len(fused) >= 2 and any(s.grad_ckpt for s in fused) and any(s.method == "fsdp" for s in fused)
    assert any(s.offload_activations for s in CI_MATRIX)
    assert any(s.packing for s in CI_MATRIX)
    compiled = [s for s in CI_MATRIX if s.compile]
    assert {s.method for s in compiled} >= {"single", "fsdp"} and {s.grad_ckpt for s in compiled} == {True, False}
    assert any(s.lora_rank for s in compiled)
    vlm = [s for s in CI_MATRIX if s.images_per_sample]     # a vision-language step: each part frozen, LoRA, ckpt
    assert all(any(getattr(s, f) for s in vlm) for f in ("freeze_vision_tower", "freeze_projector",
                                                          "freeze_language_model", "lora_rank", "grad_ckpt"))
    assert len(CI_MATRIX) >= 20


SHARDS = 8     # the matrix in eight parts, so that test workers (pytest -n) share it without a long tail
SAMPLE_SHARDS = 4


def test_the_sample_shows_every_setting_of_the_matrix():
    """Worked out here by another path: each row's settings as the flat `to_dict()` of its --json differ from a
    default set-up's; every such (key, value) of the matrix, and every model and method, is in some sampled row."""
    from llmem.setup.training import TrainingSetup

    sample, base = MATRICES["ci-sample"], TrainingSetup("gpt2").to_dict()

    def shown(rows, key):
        return {json.dumps(r.to_dict()[key], sort_keys=True, default=str) for r in rows}

    for key in base:
        if key in ("gpu", "gpu_memory"):     # resolved by the row helper: the same on every row
            continue
        assert shown(CI_MATRIX, key) == shown(sample, key), key
    assert len(sample) < len(CI_MATRIX) / 2
    assert [s for s in CI_MATRIX if s in sample] == sample          # in the matrix's order


def _agrees_with_trace(tmp_path, matrix: str, shard: int, shards: int) -> None:
    out, png = tmp_path / "ci.json", tmp_path / "ci.png"
    code = main(["validate", "--against", "trace", "--matrix", matrix, "--max-error", "2", "--shard",
                 f"{shard}/{shards}", "--out", str(out), "--plot", str(png), "--json"])
    data = json.loads(out.read_text())
    worst = {r["setup"]["model"] + " " + r["setup"]["method"]: r.get("error_pct") for r in data["rows"]}
    assert code == 0, worst
    assert png.stat().st_size > 10_000
    assert len(data["rows"]) == len(MATRICES[matrix][shard - 1::shards]) and data["shard"] == f"{shard}/{shards}"
    for row in data["rows"]:
        assert not row["error"], row["error"]
        for counter in COUNTERS[:2]:
            truth, est = row["truth"][counter], row["estimate"][counter]
            assert abs(est - truth) <= 0.02 * truth, (row["setup"], counter, est, truth)


@pytest.mark.first
@pytest.mark.parametrize("shard", range(1, SAMPLE_SHARDS + 1))
def test_the_sample_agrees_with_trace_within_2_percent(tmp_path, shard):
    _agrees_with_trace(tmp_path, "ci-sample", shard, SAMPLE_SHARDS)


@pytest.mark.slow
@pytest.mark.first
@pytest.mark.parametrize("shard", range(1, SHARDS + 1))
def test_estimate_agrees_with_trace_within_2_percent(tmp_path, shard):
    _agrees_with_trace(tmp_path, "ci", shard, SHARDS)


@pytest.mark.parametrize("bad", ["0/4", "5/4", "1-4", "a/b", "1/0"])
def test_a_bad_shard_is_one_line(bad, capsys):
    assert main(["validate", "--shard", bad]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--shard" in err


def test_validate_help_names_every_matrix(capsys):
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in MATRICES:
        assert f" {name}," in text or f" {name} " in text or f"{name} or" in text, name
