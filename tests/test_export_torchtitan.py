"""`llmem plan --export torchtitan`: the TOML names torchtitan's own fields, reads back (--from) to the planned
set-up, and refuses what torchtitan cannot run."""

from __future__ import annotations

import pytest
import tomllib

from llmem.cli import main
from llmem.errors import LlmemError
from llmem.planner.export import write_export
from llmem.planner.options import PlanOptions
from llmem.planner.plan import plan
from llmem.setup.sources import setup_from_file
from llmem.setup.training import TrainingSetup

# torchtitan 0.3.0's config/configs.py (TrainingConfig, ParallelismConfig), components/optimizer/optimizer.py and the
# 0.1-0.2 TOMLs' [job] / [model] / [activation_checkpoint]: the fields a written TOML may use
TORCHTITAN_FIELDS = {
    "job": {"description", "dump_folder"},
    "model": {"name", "flavor", "hf_assets_path"},
    "optimizer": {"name", "implementation", "lr", "eps"},
    "training": {"local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps", "enable_cpu_offload",
                 "dtype", "mixed_precision_param", "mixed_precision_reduce"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "enable_sequence_parallel", "pipeline_parallel_degree",
                    "context_parallel_degree", "expert_parallel_degree"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
}
MODEL = "meta-llama/Llama-3.2-1B"


def _export(tmp_path, setup: TrainingSetup, methods: tuple[str, ...]) -> tuple[dict, TrainingSetup, object]:
    p = plan(setup, PlanOptions(methods=methods))
    path = tmp_path / "train.toml"
    write_export(p, "torchtitan", str(path))
    return tomllib.loads(path.read_text()), setup_from_file(str(path)).setup, p


@pytest.mark.parametrize("methods,gpus,kw", [
    (("fsdp",), 16, {"grad_ckpt": True}),                    # HSDP 2 x 8 across two nodes
    (("zero2",), 8, {}),                                      # fsdp_reshard_after_forward = never
    (("ddp",), 8, {"precision": "fp32"}),                     # replication alone
])
def test_written_toml_reads_back_to_the_planned_setup(tmp_path, methods, gpus, kw):
    setup = TrainingSetup(model=MODEL, gpus=gpus, gpus_per_node=8, seq_len=2048, **kw)
    toml, back, p = _export(tmp_path, setup, methods)
    for section, keys in toml.items():
        assert set(keys) <= TORCHTITAN_FIELDS[section], (section, set(keys) - TORCHTITAN_FIELDS[section])
    c = p.recommended
    assert (back.model, back.method, back.gpus, back.dp_replicate) == (MODEL, c.layout.method, gpus, c.layout.replicas)
    assert (back.batch_size, back.seq_len, back.precision, back.grad_ckpt) == \
        (c.time.micro_batch_size, 2048, setup.precision, setup.grad_ckpt)
    par = toml["parallelism"]
    assert par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] * par["tensor_parallel_degree"] \
        == gpus
    assert toml["training"]["global_batch_size"] == c.time.global_batch_size


def test_refusals_are_one_line(tmp_path, capsys):
    out = str(tmp_path / "t.toml")
    for argv, why in [
        (["plan", "gpt2", "--gpus", "2", "--export", "torchtitan", out], "no model flavor llmem knows for gpt2"),
        (["plan", MODEL, "--gpus", "2", "--precision", "fp16-mixed", "--export", "torchtitan", out], "not fp16-mixed"),
        (["plan", MODEL, "--gpus", "2", "--method", "ds-zero2", "--export", "torchtitan", out], "DeepSpeed's engine"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(LlmemError, match="--sequence-parallel --loss-parallel"):
        _export(tmp_path, TrainingSetup(model=MODEL, gpus=8, seq_len=2048), ("tp",))


@pytest.mark.parametrize("kw,ac", [({"ac_policy": "op"}, {"mode": "selective", "selective_ac_option": "op"}),
                                   ({"grad_ckpt": True, "ckpt_every": 2},
                                    {"mode": "selective", "selective_ac_option": "2"})])
def test_selective_checkpointing_is_written_as_torchtitan_names_it(tmp_path, kw, ac):
    setup = TrainingSetup(model=MODEL, gpus=8, seq_len=2048, **kw)
    toml, back, _ = _export(tmp_path, setup, ("fsdp",))
    assert toml["activation_checkpoint"] == ac
    assert (back.ac_policy, back.ckpt_every, back.grad_ckpt) == (setup.ac_policy, setup.ckpt_every, True)
