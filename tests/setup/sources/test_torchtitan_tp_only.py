"""torchtitan's TP without FSDP2 (its TOML era, torchtitan 0.2): data_parallel_shard_degree 1, or -1 (the GPUs the
other degrees leave) resolving to 1, applies no fully_shard, and maybe_enable_amp then turns mixed precision off
under TP ("Mixed precision training with TP or PP is only supported when FSDP/HSDP/CP is enabled"): the model trains
in training.dtype, float32 by default."""

from __future__ import annotations

import pytest

from llmem.setup.sources import setup_from_file

TOML = """[model]
name = "llama3"
flavor = "8B"

[training]
local_batch_size = 1
seq_len = 2048
{dtype}
[parallelism]
data_parallel_shard_degree = {shard}
tensor_parallel_degree = 8
"""


def _read(tmp_path, shard: int, dtype: str = "", **overrides):
    path = tmp_path / "train.toml"
    path.write_text(TOML.format(shard=shard, dtype=dtype))
    return setup_from_file(path, **overrides)


@pytest.mark.parametrize("shard", [1, -1])
def test_tp_alone_trains_in_fp32(tmp_path, shard):
    s = _read(tmp_path, shard, gpus=8).setup
    assert (s.method, s.tp, s.gpus, s.precision) == ("tp", 8, 8, "fp32")


def test_training_dtype_bf16_is_pure_bf16(tmp_path):
    assert _read(tmp_path, -1, 'dtype = "bfloat16"\n', gpus=8).setup.precision == "bf16"


def test_the_rest_over_more_gpus_is_fsdp_with_mixed_precision(tmp_path):
    """16 GPUs over tp 8: two left to shard over, FSDP2's MixedPrecisionPolicy (bf16 params, fp32 reduce)."""
    s = _read(tmp_path, -1, gpus=16).setup
    assert (s.method, s.tp, s.gpus, s.precision) == ("fsdp+tp", 8, 16, "bf16-mixed")


def test_the_command_lines_precision_wins(tmp_path):
    assert _read(tmp_path, -1, gpus=8, precision="bf16-mixed").setup.precision == "bf16-mixed"
