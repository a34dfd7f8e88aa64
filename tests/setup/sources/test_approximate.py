"""A --from answer that is not the file's run says so: every ignored key that changes memory (torch.compile, an
optimizer or adapter llmem does not model) makes the record inexact, named in `--json` (`exact`,
`approximate_because`) and above the table; keys with no memory effect (checkpoint saving, the other keys) do not."""

from __future__ import annotations

import json

from llmem.cli import main
from llmem.setup.sources import setup_from_file

TRL = """model_name_or_path: meta-llama/Llama-3.1-8B
per_device_train_batch_size: 1
max_length: 512
bf16: true
"""


def _record(tmp_path, extra: str):
    path = tmp_path / "sft.yaml"
    path.write_text(TRL + extra)
    return setup_from_file(path).record


def test_a_file_read_whole_is_exact(tmp_path):
    record = _record(tmp_path, "logging_steps: 10\nsave_steps: 500\n")     # read or no memory effect
    assert record.exact and record.to_dict()["approximate_because"] == []


def test_torch_compile_makes_it_approximate(tmp_path):
    record = _record(tmp_path, "torch_compile: true\n")
    assert not record.exact
    assert [i.key for i in record.approximations] == ["torch_compile"]
    assert record.to_dict()["approximate_because"][0].startswith(
        "torch_compile: the Trainer's torch.compile of the whole model is not modelled")


def test_the_table_says_approximate_first(tmp_path, capsys):
    path = tmp_path / "sft.yaml"
    path.write_text(TRL + "torch_compile: true\n")
    assert main(["estimate", "tiny-llama", "--from", str(path)]) == 0
    first = capsys.readouterr().out.lstrip().splitlines()[0]
    assert first.startswith("approximate:") and "torch_compile" in first
    assert main(["estimate", "tiny-llama", "--from", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["from_file"]["exact"] is False


def test_the_plan_says_approximate_first_too(tmp_path, capsys):
    path = tmp_path / "sft.yaml"
    path.write_text(TRL + "torch_compile: true\n")
    assert main(["plan", "tiny-llama", "--from", str(path), "--gpus", "2", "--seq-len", "64"]) == 0
    first = capsys.readouterr().out.lstrip().splitlines()[0]
    assert first.startswith("approximate:") and "torch_compile" in first
