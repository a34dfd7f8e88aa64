"""TRL's sequence cap in every spelling TRL has had: SFTConfig's max_seq_length (before TRL 0.20 renamed it
max_length) caps the sequence as max_length does now; it was read as 'not an SFTConfig field' and the answer fell
back to TRL's default 1024, so a 4096-token run could be answered as fitting."""

from __future__ import annotations

from llmem.setup.sources import setup_from_file

BASE = "model_name_or_path: Qwen/Qwen2.5-7B\nper_device_train_batch_size: 2\nbf16: true\noutput_dir: out\n"


def _read(tmp_path, extra: str):
    path = tmp_path / "sft.yaml"
    path.write_text(BASE + extra)
    return setup_from_file(path)


def test_older_trls_max_seq_length_caps_the_sequence(tmp_path):
    read = _read(tmp_path, "max_seq_length: 4096\n")
    assert read.setup.seq_len == 4096
    used = [u for u in read.record.used if u.key == "max_seq_length"]
    assert used and "renamed in TRL 0.20" in used[0].note
    assert not [i for i in read.record.ignored if i.key == "max_seq_length"]


def test_max_length_wins_where_both_are_given(tmp_path):
    read = _read(tmp_path, "max_length: 2048\nmax_seq_length: 4096\n")
    assert read.setup.seq_len == 2048
    assert [i.key for i in read.record.ignored if i.key == "max_seq_length"] == ["max_seq_length"]


def test_no_cap_is_trls_default(tmp_path):
    assert _read(tmp_path, "").setup.seq_len == 1024
