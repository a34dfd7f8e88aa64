"""`--from` a torchtitan TOML reads pipeline parallelism back: the inverse of `--export torchtitan`'s pipeline fields
(llmem.setup.pipeline.torchtitan_pipeline), with torchtitan 0.3.0's arithmetic (distributed/pipeline_parallel.py:
local_batch_size / pipeline_parallel_microbatch_size micro-batches, ceil((n_layers + 1 + 1) /
pipeline_parallel_layers_per_stage) stages over pipeline_parallel_degree ranks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmem.errors import LlmemError
from llmem.planner.export import ExportPlan
from llmem.planner.export_torchtitan import export_torchtitan
from llmem.setup.layout import Layout
from llmem.setup.sources import setup_from_file
from llmem.setup.training import TrainingSetup

MODEL = "meta-llama/Llama-3.1-8B"        # torchtitan's llama3 8B: 32 layers, untied embeddings


@pytest.mark.parametrize("kw,dp,microbatches", [
    ({"method": "fsdp", "gpus": 4, "pp": 2, "pp_schedule": "gpipe", "batch_size": 4}, 2, 4),
    ({"method": "fsdp", "gpus": 4, "pp": 2, "pp_schedule": "1f1b", "batch_size": 4, "pp_microbatches": 2}, 2, 2),
    # pure PP trains in fp32 (no FSDP2, no autocast); torchtitan's default 2 stages per rank: no layers_per_stage
    ({"method": "single", "gpus": 2, "pp": 2, "pp_schedule": "interleaved-1f1b", "batch_size": 4,
      "precision": "fp32"}, 1, 4),
    ({"method": "single", "gpus": 4, "pp": 4, "pp_schedule": "interleaved-1f1b", "batch_size": 8,
      "pp_microbatches": 4, "pp_virtual_stages": 3, "precision": "fp32"}, 1, 4),
])
def test_exported_pipeline_reads_back_to_the_same_setup(tmp_path, kw, dp, microbatches):
    setup = TrainingSetup(model=MODEL, seq_len=256, optimizer="adamw-fused", **{"precision": "bf16-mixed", **kw})
    lay = Layout(kw["method"], dp, 1, 8, pp=kw["pp"])
    e = ExportPlan(MODEL, "LlamaForCausalLM", lay, kw["batch_size"] // microbatches, 1, 256, setup.precision,
                   False, False, optimizer="adamw-fused")
    p = SimpleNamespace(setup=setup, anatomy=SimpleNamespace(num_layers=32),
                        recommended=SimpleNamespace(layout=lay, time=SimpleNamespace(pp_microbatches=microbatches)))
    path = tmp_path / "train.toml"
    path.write_text(export_torchtitan(p, e))
    fs = setup_from_file(str(path))
    assert fs.setup == setup
    assert not [i for i in fs.record.ignored if "pipeline" in i.key or i.key == "(other keys)"]


HAND = """
[job]
description = "70B, 4 pipeline ranks"
[model]
name = "llama3"
flavor = "70B"
[training]
local_batch_size = 16
seq_len = 1024
[parallelism]
data_parallel_shard_degree = {shard}
tensor_parallel_degree = {tp}
pipeline_parallel_degree = 4
pipeline_parallel_schedule = "{schedule}"
pipeline_parallel_microbatch_size = 2
pipeline_parallel_layers_per_stage = {per}
"""


def _read(tmp_path, shard: int = 1, tp: int = 1, schedule: str = "interleaved1f1b", per: int = 7):
    path = tmp_path / "hand.toml"
    path.write_text(HAND.format(shard=shard, tp=tp, schedule=schedule, per=per))
    return setup_from_file(str(path)).setup


def test_hand_written_pipeline_toml(tmp_path):
    # 70B: 80 layers + embedding + head = 82 over 7 per stage -> ceil(82 / 7) = 12 stages, 3 on each of 4 ranks;
    # 16 samples in micro-batches of 2 -> 8; shard degree 1 -> pure PP on 4 GPUs (the schedule name any case)
    # (no FSDP2, so torchtitan's default mixed_precision_param bfloat16 takes no effect: fp32 training.dtype)
    s = _read(tmp_path)
    assert (s.model, s.method, s.gpus, s.pp, s.pp_schedule, s.pp_microbatches, s.pp_virtual_stages, s.precision) == \
        ("meta-llama/Llama-3.1-70B", "single", 4, 4, "interleaved-1f1b", 8, 3, "fp32")
    # 2 FSDP2 shards per stage under 1F1B (its MixedPrecisionPolicy: bf16-mixed), 82 over 21 -> 4 stages, 1 per rank
    s = _read(tmp_path, shard=2, schedule="1F1B", per=21)
    assert (s.method, s.gpus, s.pp, s.pp_schedule, s.pp_microbatches, s.pp_virtual_stages, s.precision) == \
        ("fsdp", 8, 4, "1f1b", 8, None, "bf16-mixed")


@pytest.mark.parametrize("kw,words", [
    ({"per": 5}, "= 17 stages, not a whole number per rank"),        # ceil(82 / 5) = 17 over 4 ranks
    ({"per": 21}, "1 per rank, but ScheduleInterleaved1F1B runs at least 2"),   # ceil(82 / 21) = 4 stages
    ({"schedule": "1F1B", "per": 7}, "Schedule1F1B runs 1"),           # 12 stages: 3 per rank
    ({"shard": 2}, "FSDP2 over several stages per rank"),
    ({"schedule": "ZBVZeroBubble"}, "splits each backward"),
])
def test_pipeline_toml_refusals(tmp_path, kw, words):
    with pytest.raises(LlmemError, match="pipeline_parallel_") as err:
        _read(tmp_path, **kw)
    assert words in str(err.value) and "\n" not in str(err.value)
