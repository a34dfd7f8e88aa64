"""The estimator against the trace over the CI matrix: every configuration within 2 % on peak allocated and peak
reserved. The trace runs the real HF step on fake tensors, so this takes a few dozen seconds."""

from __future__ import annotations

import json

from llmem.cli import main
from llmem.validate.compare import COUNTERS
from llmem.validate.matrices import CI_MATRIX


def test_ci_matrix_covers_the_required_space():
    methods = {s.method for s in CI_MATRIX}
    assert methods >= {"single", "ddp", "fsdp", "zero2", "tp", "fsdp+tp"}
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
    assert len(CI_MATRIX) >= 20


def test_estimate_agrees_with_trace_within_2_percent(tmp_path):
    out, png = tmp_path / "ci.json", tmp_path / "ci.png"
    code = main(["validate", "--against", "trace", "--matrix", "ci", "--max-error", "2", "--out", str(out),
                 "--plot", str(png), "--json"])
    data = json.loads(out.read_text())
    worst = {r["setup"]["model"] + " " + r["setup"]["method"]: r.get("error_pct") for r in data["rows"]}
    assert code == 0, worst
    assert png.stat().st_size > 10_000
    for row in data["rows"]:
        assert not row["error"], row["error"]
        for counter in COUNTERS[:2]:
            truth, est = row["truth"][counter], row["estimate"][counter]
            assert abs(est - truth) <= 0.02 * truth, (row["setup"], counter, est, truth)
