"""--json: stdout is exactly one JSON document under every method and objective, on a machine without CUDA.

What the libraries print while an engine runs goes to stderr (llmem.cli.streams): DeepSpeed's "Setting accelerator to
CPU" warning (printed when deepspeed is first imported, by TRL's import too) and its engine's `begin bf16_optimizer`
/ `MA ... GB` lines. The traces run as a user runs them, in a fresh process (the warning is printed once per
process, and only a real file descriptor 1 shows the C-level writes); estimate and plan in this process, their stdout
captured at the file descriptor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmem.cli import main

ROOT = Path(__file__).resolve().parents[2]

# each method on tiny-llama (4 heads, 2 KV heads: tp 2 divides both)
METHOD_FLAGS = {"single": ["--gpus", "1"], "ddp": ["--gpus", "2"], "fsdp": ["--gpus", "2"],
                "zero2": ["--gpus", "2"], "tp": ["--gpus", "2"], "fsdp+tp": ["--gpus", "4", "--tp", "2"],
                "ds-zero1": ["--gpus", "2"], "ds-zero2": ["--gpus", "2"], "ds-zero3": ["--gpus", "2"]}
# each objective: GRPO / RLOO with 2 generations of 16 tokens (the prompt is the rest of --seq-len)
GENERATING = ["--batch-size", "2", "--num-generations", "2", "--max-completion-length", "16"]
OBJECTIVE_FLAGS = {"sft": [], "dpo": [], "kto": [], "orpo": [], "simpo": [], "reward": [],
                   "grpo": GENERATING, "rloo": GENERATING}
# the trace case run by default (the others are marked slow; test_deepspeeds_chatter_goes_to_stderr is DeepSpeed's)
DEFAULT_TRACES = {("method", "single")}


def _cases() -> list:
    cases = [("method", m, ["--method", m, *f]) for m, f in METHOD_FLAGS.items()]
    cases += [("objective", o, ["--objective", o, *f]) for o, f in OBJECTIVE_FLAGS.items()]
    return cases


def _trace_cases() -> list:
    return [pytest.param(flags, id=f"{kind}-{name}",
                         marks=() if (kind, name) in DEFAULT_TRACES else pytest.mark.slow)
            for kind, name, flags in _cases()]


def _one_document(stdout: str) -> dict:
    """stdout parsed as one JSON document (json.loads refuses anything before or after it)."""
    doc = json.loads(stdout)
    assert isinstance(doc, dict)
    return doc


def _cli(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("DS_ACCELERATOR", None)    # DeepSpeed detects the accelerator, as on a user's machine
    return subprocess.run([sys.executable, "-m", "llmem.cli", *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


@pytest.mark.parametrize("flags", _trace_cases())
def test_trace_json_stdout_is_one_document(flags):
    run = _cli(["trace", "tiny-llama", *flags, "--seq-len", "64", "--iterations", "1", "--json"])
    assert run.returncode == 0, run.stderr[-2000:]
    doc = _one_document(run.stdout)
    assert doc["engine"] == "trace" and doc["peak_allocated_bytes"] > 0


def test_deepspeeds_chatter_goes_to_stderr():
    """What DeepSpeed prints under TRL's DPO on ds-zero1 (the accelerator warning at its import, its
    BF16_Optimizer's memory report) is on stderr, and stdout is the JSON alone."""
    run = _cli(["trace", "tiny-llama", "--objective", "dpo", "--method", "ds-zero1", "--gpus", "2",
                "--seq-len", "32", "--iterations", "1", "--json"])
    assert run.returncode == 0, run.stderr[-2000:]
    assert _one_document(run.stdout)["setup"]["method"] == "ds-zero1"
    assert "begin bf16_optimizer" in run.stderr and "MA " in run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    pytest.param(["--method", "single", "--precision", "bf16", "--optimizer", "sgd"], id="single"),
    pytest.param(["--method", "ds-zero1", "--gpus", "2", "--objective", "dpo"], id="ds-zero1-dpo"),
])
def test_measure_json_stdout_is_one_document(flags):
    """measure on the CPU (real tensors, 25-45 s here): the same one document, DeepSpeed's lines on stderr."""
    run = _cli(["measure", "tiny-llama", *flags, "--device", "cpu", "--seq-len", "32", "--iterations", "1", "--json"])
    assert run.returncode == 0, run.stderr[-2000:]
    assert _one_document(run.stdout)["engine"] == "measure"


@pytest.mark.parametrize("command", ["estimate", "plan"])
@pytest.mark.parametrize("kind, name, flags", _cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_estimate_and_plan_json_stdout_is_one_document(command, kind, name, flags, capfd):
    assert main([command, "tiny-llama", *flags, "--seq-len", "64", "--json"]) == 0
    doc = _one_document(capfd.readouterr().out)
    if command == "estimate" or kind == "objective":
        assert doc["setup"][kind] == name
    else:
        assert [m["method"] for m in doc["methods"]] == [name]


# ------------------------------------------------------------------------------------------------ validate's progress


def test_row_progress_in_a_log_states_rows_done_and_time_left(monkeypatch):
    """Not a terminal: one line per row, the time left the mean row's times the rows left. Rows done at 30 s
    (4 x 30 s = 120 s left: "2 min"), 80 s (3 x 40 s = 120 s: "2 min") and 300 s ("5 min" elapsed; 2 x 100 s =
    200 s left: "3 min")."""
    import io

    import llmem.cli.progress as progress

    clock = iter([0.0, 30.0, 80.0, 300.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    with progress.RowProgress("validate trace x ci", 5, stream=out) as rows:
        rows.advance("tiny-llama")
        rows.advance("gpt2 fsdp")
        rows.advance()
    assert out.getvalue().splitlines() == [
        "validate trace x ci: 5 rows",
        "validate trace x ci: 1/5 rows, 30 s elapsed, ~2 min left (tiny-llama)",
        "validate trace x ci: 2/5 rows, 80 s elapsed, ~2 min left (gpt2 fsdp)",
        "validate trace x ci: 3/5 rows, 5 min elapsed, ~3 min left",
    ]


def test_validate_shows_progress_on_stderr_and_its_answer_alone_on_stdout(capfd, monkeypatch):
    """A matrix of two rows (tiny-llama under ds-zero1, whose engine prints, and single): stderr has a line per row
    with the time left, stdout the JSON summary alone."""
    from llmem.setup.training import TrainingSetup
    from llmem.validate.matrices import MATRICES

    rows = [TrainingSetup("tiny-llama", method=m, gpus=g, optimizer="sgd", batch_size=1, seq_len=32)
            for m, g in (("ds-zero1", 2), ("single", 1))]
    monkeypatch.setitem(MATRICES, "two", rows)
    assert main(["validate", "--matrix", "two", "--max-error", "100", "--json"]) == 0
    out, err = capfd.readouterr()
    summary = _one_document(out)
    assert [r["setup"]["method"] for r in summary["rows"]] == ["ds-zero1", "single"]
    lines = [line for line in err.splitlines() if line.startswith("validate trace x two: ")]
    assert lines[0] == "validate trace x two: 2 rows"
    assert lines[1].startswith("validate trace x two: 1/2 rows, ") and " left (" in lines[1]
    assert lines[2].startswith("validate trace x two: 2/2 rows, ") and "left" not in lines[2]
