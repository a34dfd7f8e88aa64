"""A config whose GPU count the launcher decides (a multi-GPU method, no count in the file) is answered, not
refused: on this machine's GPUs where the driver lists several, else on one node of 8, said in the record."""

from __future__ import annotations

import pytest

import llmem.setup.sources as sources
from llmem.setup.local_gpus import parse_query
from llmem.setup.sources import setup_from_file

H100 = "{i}, NVIDIA H100 80GB HBM3, 81559, 81000\n"     # one line of `nvidia-smi --query-gpu=...` (MiB)


def _driver_lists(monkeypatch, n: int) -> None:
    """This machine's driver lists `n` GPUs (llmem.setup.local_gpus, which the reader asks)."""
    monkeypatch.setattr(sources, "local_gpus", lambda: parse_query("".join(H100.format(i=i) for i in range(n))))

FSDP_TRL = """model_name_or_path: meta-llama/Llama-3.1-8B
per_device_train_batch_size: 1
max_length: 512
bf16: true
fsdp: full_shard auto_wrap
fsdp_config:
  fsdp_version: 2
"""


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "fsdp.yaml"
    path.write_text(FSDP_TRL)
    return path


def test_no_gpu_here_answers_one_node_of_eight(config, monkeypatch):
    _driver_lists(monkeypatch, 0)
    read = setup_from_file(config)
    assert (read.setup.method, read.setup.gpus) == ("fsdp", 8)
    launcher = [u for u in read.record.used if u.key == "(launcher)"]
    assert launcher and launcher[0].value == 8 and "one node of 8 GPUs" in launcher[0].note
    assert any("give --gpus N" in n for n in read.record.notes)


@pytest.mark.parametrize("listed", [2, 4])
def test_this_machines_gpus_when_it_has_several(config, monkeypatch, listed):
    _driver_lists(monkeypatch, listed)
    assert setup_from_file(config).setup.gpus == listed


def test_the_command_line_count_wins(config, monkeypatch):
    _driver_lists(monkeypatch, 4)
    read = setup_from_file(config, gpus=2)
    assert read.setup.gpus == 2 and not [u for u in read.record.used if u.key == "(launcher)"]

