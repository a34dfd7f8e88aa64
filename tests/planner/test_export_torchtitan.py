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


# torchtitan 0.3.0, read from its wheel: the presets of torchtitan/models/llama3/config_registry.py, the subcommands
# of torchtitan/distributed/activation_checkpoint.py's ActivationCheckpointingConfig (tyro.conf.subcommand names under
# Trainer.Config's field activation_checkpoint), and TrainingConfig.disable_cuda_graphs (config/configs.py). The lines
# written for ten plans (8B and 70B; full, none and op checkpointing; fsdp, zero2, tp, HSDP, offload, PP) were also
# parsed with torchtitan 0.3.0's own ConfigManager.parse_args (tyro) to the planned FullAC / SelectiveAC / None, batch,
# degrees and offload.
TORCHTITAN_03_PRESETS = {"llama3_8b", "llama3_70b", "llama3_405b", "llama3_debugmodel"}
TORCHTITAN_03_AC = {"activation-checkpoint:selective", "activation-checkpoint:full",
                    "activation-checkpoint:memory-budget", "activation-checkpoint:none"}
TORCHTITAN_03_FLAGS = {f"--{sec}.{key}" for sec in ("optimizer", "training", "parallelism")
                       for key in TORCHTITAN_FIELDS[sec]} | {"--training.disable_cuda_graphs"}


def _line_03(sections: dict) -> list[str]:
    from llmem.planner.export_torchtitan import torchtitan_03_command

    return torchtitan_03_command("torchrun -m torchtitan.train", sections).split()


def _sections(flavor: str, ac: dict) -> dict:
    return {"model": {"name": "llama3", "flavor": flavor}, "optimizer": {"name": "AdamW", "implementation": "fused"},
            "training": {"local_batch_size": 2, "seq_len": 4096}, "parallelism": {"data_parallel_shard_degree": 8},
            "activation_checkpoint": ac}


@pytest.mark.parametrize("ac, subcommand", [
    ({"mode": "full"}, "activation-checkpoint:full"),
    ({"mode": "none"}, "activation-checkpoint:none"),       # llama3_8b's preset would checkpoint selectively
    ({"mode": "selective", "selective_ac_option": "op"}, "activation-checkpoint:selective"),
])
def test_torchtitan_03_command_names_the_planned_checkpointing(ac, subcommand):
    words = _line_03(_sections("70B", ac))
    assert words[words.index("--config") + 1] == "llama3_70b" and words[-1] == subcommand
    flags = [w for w in words[words.index("--config") + 2:] if w.startswith("--")]
    assert set(flags) <= TORCHTITAN_03_FLAGS and "--training.disable_cuda_graphs" in flags
    assert [w for w in words if w.startswith("activation-checkpoint:")] == [subcommand]
    assert subcommand in TORCHTITAN_03_AC


@pytest.mark.parametrize("flavor, ac, why", [
    ("8B", {"mode": "selective", "selective_ac_option": "2"}, "no every-2-layers option"),
    ("1B", {"mode": "full"}, "presets of llama3 8B, 70B and 405B only, not llama3 1B"),
])
def test_torchtitan_03_command_says_why_it_cannot(flavor, ac, why):
    line = " ".join(_line_03(_sections(flavor, ac)))
    assert line.startswith("cannot run this plan: ") and why in line and "\n" not in line


def test_written_header_gives_03_the_planned_full_checkpointing(tmp_path):
    """An 8B plan with --grad-ckpt: the 0.3 line runs llama3_8b (whose preset checkpoints selectively) with full AC."""
    setup = TrainingSetup(model="meta-llama/Llama-3.1-8B", gpus=8, seq_len=4096, grad_ckpt=True)
    p = plan(setup, PlanOptions(methods=("fsdp",)))
    path = tmp_path / "train.toml"
    write_export(p, "torchtitan", str(path))
    line = next(x for x in path.read_text().splitlines() if x.startswith("# torchtitan 0.3+:"))
    words = line.split()
    assert words[words.index("--config") + 1] == "llama3_8b" and words[-1] == "activation-checkpoint:full"
    assert words[words.index("--training.local_batch_size") + 1] == str(p.recommended.time.micro_batch_size)
