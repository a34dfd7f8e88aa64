"""`llmem plan --export`: the torchrun script launches llmem's own training script with exactly the flags it reads,
and it runs (in process on one GPU's worth of work, and as two gloo processes under torchrun); the DeepSpeed JSON
says which memory llmem estimated."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from llmem.errors import LlmemError
from llmem.planner.export import (
    EXPORT_NOTES,
    ExportPlan,
    export_deepspeed,
    export_plan,
    export_torchrun,
    train_script_args,
    write_export,
)
from llmem.planner.options import PlanOptions
from llmem.planner.plan import plan
from llmem.runtime import train_script
from llmem.setup.layout import Layout
from llmem.setup.methods import METHODS
from llmem.setup.training import TrainingSetup

VOCAB = 256
MICRO = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": VOCAB,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-05, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def micro_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("micro") / "config.json"
    path.write_text(json.dumps(MICRO))
    return str(path)


def _launch_line(text: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith("torchrun"))
    return shlex.split(line.replace('"$@"', ""))


def _script_argv(text: str) -> list[str]:
    argv = _launch_line(text)
    i = argv.index("-m")
    assert argv[i + 1] == train_script.MODULE
    return argv[i + 2:]


def _micro_plan(micro_config: str, gpus: int, methods: tuple[str, ...] | None = None, **kw):
    setup = TrainingSetup(model=micro_config, gpus=gpus, seq_len=16, **kw)
    return plan(setup, PlanOptions(batch_cap=2, global_batch=4 * gpus, methods=methods))


@pytest.mark.parametrize("method,dp,tp", [("single", 1, 1), ("ddp", 16, 1), ("fsdp", 8, 1), ("zero2", 8, 1),
                                          ("tp", 1, 8), ("fsdp+tp", 2, 4)])
def test_torchrun_export_passes_exactly_the_script_flags(method, dp, tp):
    e = ExportPlan("meta-llama/Llama-3.1-8B", "LlamaForCausalLM", Layout(method, dp, tp, 8), 3, 5, 2048,
                   "bf16-mixed", True, False, "adamw-fused")
    text = export_torchrun(e)
    args = train_script.build_parser().parse_args(_script_argv(text))      # the script's own parser
    assert (args.model, args.method, args.dp, args.tp) == ("meta-llama/Llama-3.1-8B", method, dp, tp)
    assert (args.micro_batch_size, args.gradient_accumulation_steps, args.seq_len) == (3, 5, 2048)
    assert (args.precision, args.optimizer, args.grad_ckpt, args.offload_optimizer) == \
        ("bf16-mixed", "adamw-fused", True, False)
    argv = _launch_line(text)
    assert int(argv[argv.index("--nproc_per_node") + 1]) * int(argv[argv.index("--nnodes") + 1]) == dp * tp
    assert "train.py" not in text and "TRAIN_SCRIPT" not in text


def test_torchrun_export_refuses_what_the_script_cannot_run():
    with pytest.raises(LlmemError, match="ZeRO-Offload"):
        train_script_args(ExportPlan("m", "A", Layout("ddp", 2, 1, 8), 1, 1, 16, "bf16-mixed", False, True))
    with pytest.raises(LlmemError, match="--optimizer sgd"):
        train_script_args(ExportPlan("m", "A", Layout("fsdp", 2, 1, 8), 1, 1, 16, "bf16-mixed", False, False,
                                     "sgd"))


def test_exported_single_gpu_command_trains(micro_config):
    """The export of a one-GPU plan, its flags run through the script itself (in process, 2 steps)."""
    p = _micro_plan(micro_config, 1, grad_ckpt=True)
    e = export_plan(p)
    argv = _script_argv(export_torchrun(e))
    args = train_script.build_parser().parse_args(argv + ["--steps", "2"])
    assert args.method == "single" and args.micro_batch_size == e.micro_batch_size == 2
    assert args.gradient_accumulation_steps == 2 and args.grad_ckpt
    losses = train_script.run(args)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    # random initial weights give near-uniform predictions: cross-entropy ln(vocab) (independent of llmem)
    assert losses[0] == pytest.approx(math.log(VOCAB), abs=0.1)


def test_script_refuses_a_world_that_is_not_the_plan(micro_config):
    args = train_script.build_parser().parse_args(["--model", micro_config, "--method", "fsdp", "--dp", "2",
                                                   "--micro-batch-size", "1", "--seq-len", "8"])
    with pytest.raises(LlmemError, match="process"):
        train_script.run(args)
    assert train_script.main(["--model", micro_config, "--method", "fsdp", "--dp", "2", "--micro-batch-size", "1",
                              "--seq-len", "8"]) == 2


def _launched_loss(path: Path, cwd: Path) -> float:
    """Run the exported launch script for one step (torchrun from this venv, gloo on the CPU): its logged loss."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([str(path), "--steps", "1"], capture_output=True, text=True, env=env, timeout=240, cwd=cwd)
    assert run.returncode == 0, run.stderr[-3000:]
    return float(re.search(r"step 1/1: loss ([\d.]+)", run.stdout).group(1))


@pytest.mark.slow
def test_exported_two_process_fsdp_script_runs_under_torchrun(micro_config, tmp_path):
    """The exported file itself, launched: torchrun, two gloo processes, FSDP2 over both, one step (two fresh
    interpreters importing torch and transformers: 45 s on a loaded 2-core machine, hence slow)."""
    p = _micro_plan(micro_config, 2, ("fsdp",))
    path = tmp_path / "launch.sh"
    e = write_export(p, "torchrun", str(path))
    assert e.layout.method == "fsdp" and e.layout.dp == 2
    assert os.access(path, os.X_OK)
    assert _launched_loss(path, tmp_path) == pytest.approx(math.log(VOCAB), abs=0.1)


@pytest.mark.slow
def test_exported_sequence_parallel_tp_script_runs_under_torchrun(micro_config, tmp_path):
    """--sequence-parallel --loss-parallel through the torchrun export: two gloo processes run TP 2 with
    SequenceParallel and the loss under loss_parallel(); the loss of random tokens is ln(vocab) as without them."""
    setup = TrainingSetup(model=micro_config, gpus=2, seq_len=16, sequence_parallel=True, loss_parallel=True,
                          method="tp")
    p = plan(setup, PlanOptions(batch_cap=2, global_batch=4, methods=("tp",)))
    path = tmp_path / "launch.sh"
    e = write_export(p, "torchrun", str(path))
    assert (e.layout.method, e.sequence_parallel, e.loss_parallel) == ("tp", True, True)
    assert "--sequence-parallel" in path.read_text() and "--loss-parallel" in path.read_text()
    assert _launched_loss(path, tmp_path) == pytest.approx(math.log(VOCAB), abs=0.1)


@pytest.mark.parametrize("method", ["fsdp", "zero2", "ddp", "tp"])
def test_deepspeed_export_says_which_memory_was_estimated(method):
    dp, tp = (1, 8) if METHODS[method].has_tp else (8, 1)
    e = ExportPlan("meta-llama/Llama-3.1-8B", "LlamaForCausalLM", Layout(method, dp, tp, 8), 2, 4, 4096,
                   "bf16-mixed", True, False)
    cfg = json.loads(export_deepspeed(e))
    stage = METHODS[method].deepspeed_stage
    assert cfg["zero_optimization"]["stage"] == stage
    comment = cfg["comment"]
    assert f"PyTorch's {method}" in comment and f"ZeRO stage {stage}" in comment and "differs" in comment
    assert EXPORT_NOTES["deepspeed"](e) == comment


def test_written_deepspeed_export_carries_its_note(micro_config, tmp_path):
    p = _micro_plan(micro_config, 2, ("fsdp",))
    path = tmp_path / "ds.json"
    e = write_export(p, "deepspeed", str(path))
    cfg = json.loads(path.read_text())
    assert e.notes == (cfg["comment"],) and "PyTorch's fsdp" in cfg["comment"]
    assert "ZeRO stage 3" in cfg["comment"]


def test_the_cli_says_which_memory_a_deepspeed_export_assumes(tmp_path, capsys):
    from llmem.cli import main

    out = tmp_path / "ds.json"
    assert main(["plan", "tiny-llama", "--gpus", "2", "--method", "fsdp", "--seq-len", "256",
                 "--export", "deepspeed", str(out)]) == 0
    printed = capsys.readouterr().out
    written = json.loads(out.read_text())
    # the same words in the file's comment and on the screen, beside "wrote ..."
    assert "note:" in printed and "DeepSpeed" in written["comment"]
    assert re.sub(r"\s+", " ", written["comment"])[:60] in re.sub(r"\s+", " ", printed)
