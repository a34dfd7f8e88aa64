"""The command line's surface: output paths and formats refused before any work, devices, --version, the defaults
--help states, argparse's errors on one line."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version

import pytest

import llmem.cli.plots
from llmem.cli import build_parser, main
from llmem.cli.paths import check_device, check_output_path, check_plot_path
from llmem.errors import LlmemError


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    return tmp_path


@pytest.fixture
def no_work(monkeypatch):
    """The engines, replaced by a function that fails the test: a refusal must come before any of them runs."""
    import llmem.planner.plan
    import llmem.runtime.measure
    import llmem.runtime.trace

    def ran(*args, **kwargs):
        raise AssertionError("the engine ran before the refusal")

    monkeypatch.setattr(llmem.runtime.trace, "trace", ran)
    monkeypatch.setattr(llmem.runtime.measure, "measure", ran)
    monkeypatch.setattr(llmem.planner.plan, "plan", ran)
    monkeypatch.setattr(llmem.cli.plots, "plot_plan", ran)


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err          # one line
    return err


# ------------------------------------------------------------------------------------------------ output paths


@pytest.mark.parametrize("path, words", [
    ("missing/x.png", ["folder missing does not exist", "mkdir -p missing"]),
    ("x.jpg", ["cannot write .jpg plots", "x.png, .svg or .pdf"]),
    ("x.gif", ["cannot write .gif plots"]),
    ("x", ["no extension", "x.png, .svg or .pdf"]),
    ("x.", ["no extension"]),
    ("adir", ["is a folder", "adir/plot.png"]),
    ("afile/x.png", ["afile is a file, not a folder"]),
    ("", ["needs a file path, got an empty one"]),
    ("y" * 300 + ".png", ["longer than"]),
])
def test_trace_plot_path_refused_before_the_trace(in_tmp, no_work, capsys, path, words):
    assert main(["trace", "tiny-llama", "--plot", path]) == 2
    err = _error(capsys)
    assert err.startswith("llmem: error: --plot")
    for w in words:
        assert w in err


@pytest.mark.parametrize("ext", ["png", "svg", "pdf", "PNG"])
def test_plot_formats_matplotlib_writes_are_accepted(in_tmp, ext):
    assert check_plot_path("--plot", f"out.{ext}") == f"out.{ext}"
    assert check_plot_path("--plot", str(in_tmp / "adir" / f"out.{ext}"))


def test_plot_written_in_the_format_its_extension_names(in_tmp, capsys):
    """A real plan --plot of each format: the file holds that format (not a PNG named .svg)."""
    for ext, magic in (("svg", b"<?xml"), ("pdf", b"%PDF")):
        assert main(["plan", "tiny-llama", "--seq-len", "64", "--max-batch", "4", "--json", "--plot",
                     f"p.{ext}"]) == 0
        assert (in_tmp / f"p.{ext}").read_bytes().startswith(magic)
        assert not (in_tmp / f"p.{ext}.png").exists()


@pytest.mark.parametrize("path, words", [
    ("", ["--export accelerate needs a file path"]),
    ("adir", ["--export accelerate adir: is a folder", "adir/accelerate.yaml"]),
    ("missing/acc.yaml", ["folder missing does not exist"]),
])
def test_export_path_refused_before_the_plan(in_tmp, no_work, capsys, path, words):
    assert main(["plan", "tiny-llama", "--export", "accelerate", path, "--plot", "p.png"]) == 2
    err = _error(capsys)
    for w in words:
        assert w in err
    assert not (in_tmp / "p.png").exists()


def test_export_refusals_the_set_up_decides_come_before_the_plan(in_tmp, no_work, capsys):
    assert main(["plan", "tiny-llama", "--lora-rank", "8", "--export", "torchrun", "run.sh"]) == 2
    assert "cannot express --lora-rank" in _error(capsys)
    assert main(["plan", "tiny-llama", "--gpus", "4", "--method", "fsdp+tp", "--export", "deepspeed",
                 "ds.json"]) == 2
    assert "DeepSpeed has no equivalent of --method fsdp+tp" in _error(capsys)
    assert main(["plan", "tiny-llama", "--export", "yaml", "a.yaml"]) == 2
    assert "unknown export 'yaml'" in _error(capsys)
    assert not list(in_tmp.glob("*.*"))


def test_export_refused_after_the_plan_draws_no_plot(in_tmp, capsys, monkeypatch):
    """An export only the plan can refuse (here: nothing fits) is refused before the plot is drawn."""
    monkeypatch.setattr(llmem.cli.plots, "plot_plan", lambda *a: pytest.fail("plotted a plan with nothing to export"))
    code = main(["plan", "tiny-llama", "--gpu-memory", "1MiB", "--json", "--plot", "p.png", "--export",
                 "accelerate", "a.yaml"])
    assert code == 2
    err = capsys.readouterr().err
    assert "llmem: error: --export accelerate: nothing fits" in err
    assert not (in_tmp / "a.yaml").exists()


def test_validate_out_and_plot_refused_before_the_matrix(in_tmp, capsys, monkeypatch):
    import llmem.validate.compare

    monkeypatch.setattr(llmem.validate.compare, "run_matrix", lambda *a, **k: pytest.fail("ran the matrix"))
    assert main(["validate", "--out", "missing/r.json"]) == 2
    assert "--out missing/r.json: folder missing does not exist" in _error(capsys)
    assert main(["validate", "--out", "adir"]) == 2
    assert "--out adir: is a folder" in _error(capsys)
    assert main(["validate", "--plot", "v.bmp"]) == 2
    assert "cannot write .bmp plots" in _error(capsys)
    assert main(["validate", "--matrix", "nope"]) == 2
    assert "unknown matrix 'nope'" in _error(capsys)
    assert main(["validate", "--max-error", "nan"]) == 2
    assert "--max-error must be a percentage >= 0" in _error(capsys)


def test_output_path_checks_directly(in_tmp):
    assert check_output_path("--out", "r.json") == "r.json"
    assert check_output_path("--out", "adir/r.json") == "adir/r.json"
    for bad in ("", "adir", "adir/", "missing/r.json", "afile/r.json", "a\0b.json"):
        with pytest.raises(LlmemError):
            check_output_path("--out", bad)


# ------------------------------------------------------------------------------------------------ devices


@pytest.mark.parametrize("device", ["tpu", "mps", "cuda:", "cuda:x", "cpu:0", "cuda:-1", "", "CUDA", "cuda:١"])
def test_measure_unknown_device_is_one_line(no_work, capsys, device):
    assert main(["measure", "tiny-llama", "--device", device]) == 2
    err = _error(capsys)
    assert f"--device {device!r}: measure runs on cuda, cuda:N or cpu" in err


def test_known_devices_pass_the_check():
    for device in (None, "cpu", "cuda", "cuda:0", "cuda:12"):
        assert check_device("--device", device) == device


def test_validate_device_checked_too(capsys):
    assert main(["validate", "--against", "measure", "--device", "tpu"]) == 2
    assert "--device 'tpu'" in _error(capsys)


def test_iterations_below_one_refused(no_work, capsys):
    assert main(["trace", "tiny-llama", "--iterations", "0"]) == 2
    assert "--iterations must be >= 1" in _error(capsys)
    assert main(["measure", "tiny-llama", "--iterations", "-3", "--device", "cpu"]) == 2
    assert "--iterations must be >= 1" in _error(capsys)


def test_m_base_needs_the_paper_engine(capsys):
    assert main(["estimate", "tiny-llama", "--m-base", "700MiB"]) == 2
    assert "--m-base applies to --engine paper only" in _error(capsys)
    assert main(["estimate", "tiny-llama", "--m-base", "700MiB", "--engine", "paper", "--json"]) == 0


# ------------------------------------------------------------------------------------------------ --version, --help


def test_version_is_the_installed_packages(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"llmem {version('llmem')}\n"


def test_version_as_a_process():
    out = subprocess.run([sys.executable, "-m", "llmem.cli", "--version"], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == f"llmem {version('llmem')}"


def _help(command: str) -> str:
    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices and command in a.choices)
    text = sub.choices[command].format_help()
    return " ".join(text.split())          # the words, whatever the terminal's width wrapped


def test_help_states_the_defaults():
    est = _help("estimate")
    assert "default single on one GPU, fsdp on more" in est           # the method for --gpus > 1
    assert "GPUs per node (default: min(gpus, 8))" in est             # the node size
    assert "(default: all GPUs under tp, 2 under fsdp+tp)" in est      # --tp
    assert "(default 2048)" in est and "(default 1)" in est
    assert "--lora-alpha N LoRA alpha (scaling; no effect on memory) (default 16)" in est
    assert "--lora-rank N LoRA adapters of this rank (base frozen); 0: full fine-tuning (default 0)" in est
    assert "(default: 600MiB on V100s, else the CUDA context)" in est
    trace = _help("trace")
    assert "--iterations N training steps to run (default 2)" in trace
    assert "png, svg or pdf" in trace
    val = _help("validate")
    assert "the truth engine (default trace)" in val and "(default ci)" in val and "(default 2.0)" in val
    plan = _help("plan")
    assert "(default 4096)" in plan and "(default 0%)" in plan and "(default 0.4)" in plan


def test_help_never_shows_internal_names():
    for command in ("estimate", "plan", "trace", "measure", "validate"):
        text = _help(command)
        assert "SETUP_" not in text and "PLAN_" not in text
        assert "(default None)" not in text and "(default False)" not in text


def test_every_command_has_help_and_exits_0(capsys):
    for command in ("estimate", "trace", "measure", "validate", "plan", "models", "gpus"):
        with pytest.raises(SystemExit) as exc:
            main([command, "--help"])
        assert exc.value.code == 0
    assert "usage: llmem gpus" in capsys.readouterr().out


def test_usage_errors_are_one_line_with_where_the_help_is(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["estimate", "tiny-llama", "--batch-size", "many"])
    assert exc.value.code == 2
    err = _error(capsys)
    assert "argument --batch-size: invalid int value: 'many'" in err and "see llmem estimate --help" in err
    with pytest.raises(SystemExit):
        main(["estimate", "tiny-llama", "--engine", "magic"])
    assert "invalid choice: 'magic'" in _error(capsys)


def test_json_of_a_good_command_still_parses(capsys):
    assert main(["estimate", "tiny-llama", "--seq-len", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["seq_len"] == 64


def test_an_error_naming_a_non_utf8_name_prints_on_a_strict_stream(in_tmp, no_work, capsys):
    """A non-UTF-8 byte in argv reaches Python as a surrogate ('caf\\udce9'); the refusal escapes it instead of
    failing to print (pytest's captured stderr, like an embedding program's, is strict UTF-8)."""
    assert main(["trace", "tiny-llama", "--plot", "missing/caf\udce9.png"]) == 2
    assert "--plot missing/caf\\udce9.png: folder missing does not exist" in _error(capsys)
    with pytest.raises(SystemExit):
        main(["estimate", "tiny-llama", "--batch-size", "caf\udce9"])
    assert "invalid int value" in _error(capsys)
