"""`llmem estimate ... --check`: a launch guard (`llmem estimate ... --check && torchrun ...`) that exits 0 when the
step fits, 1 when it does not and 2 when llmem cannot tell (a refusal), the answer printed either way."""

from __future__ import annotations

import json

from llmem import estimate
from llmem.cli import main

TINY = ["estimate", "tiny-llama", "--seq-len", "64", "--json"]


def test_fits_exits_0(capsys):
    assert main([*TINY, "--check"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True


def test_does_not_fit_exits_1_and_still_answers(capsys):
    """tiny-llama's fp32 weights alone (Adam's states on top) are over 64 MiB of device memory."""
    assert estimate("tiny-llama", seq_len=64).device_used_bytes > 64 * 2**20
    assert main([*TINY, "--gpu-memory", "64MiB", "--check"]) == 1
    assert json.loads(capsys.readouterr().out)["fits"] is False


def test_without_check_a_step_that_does_not_fit_exits_0(capsys):
    assert main([*TINY, "--gpu-memory", "64MiB"]) == 0


def test_cannot_tell_exits_2(capsys):
    assert main(["estimate", "tiny-llama", "--gpus", "0", "--check"]) == 2
    assert capsys.readouterr().err.startswith("llmem: error: ")
