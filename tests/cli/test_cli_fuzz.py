"""Garbage on the command line: every option of every command (read from the parser, so a new flag is fuzzed by
itself) with huge, negative, zero, inf/nan, empty, unicode and path values, run in-process through
`llmem.cli.main`. Each command line ends with exit 0 or 2 (argparse's usage errors exit 2 too), never a traceback:
any exception other than SystemExit fails the test, with the command line in hypothesis' report.

Bounded: a fixed number of examples and a per-example deadline; estimate, plan, models and gpus run for real on
tiny or small models; trace, measure and validate run their whole command-line path (parsing, the set-up's checks,
the output-path checks, the tables, plots and files they write) with the engine's run replaced by the estimate of
the same set-up, so that no real step runs here; serve checks its address and binds it, then closes it unserved.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

os.environ.setdefault("HF_HUB_OFFLINE", "1")     # a garbage MODEL must not reach the network

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llmem
from llmem.cli import build_parser, main
from llmem.setup.gpus import GPU_CATALOG
from llmem.setup.methods import METHODS
from llmem.setup.optimizers import OPTIMIZERS
from llmem.setup.precision import PRECISIONS
from llmem.setup.training import ATTENTIONS

EXAMPLES = int(os.environ.get("LLMEM_FUZZ_EXAMPLES", "150"))     # more, to search longer by hand
DEADLINE = timedelta(seconds=20)       # a cap on one command line, generous for a shared 2-core machine


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _arguments(sub: argparse.ArgumentParser) -> tuple[list[argparse.Action], list[argparse.Action]]:
    """(positionals, options) of one subcommand, --help left out."""
    actions = [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]
    return [a for a in actions if not a.option_strings], [a for a in actions if a.option_strings]


SUBCOMMANDS = _subcommands(build_parser())

# values that mean something to some option (so that the fuzz gets past the first check now and then)
MEANINGFUL = sorted({*METHODS, *(a for m in METHODS.values() for a in m.aliases), *PRECISIONS, *OPTIMIZERS,
                     *ATTENTIONS, *GPU_CATALOG, "all-linear", "q_proj,v_proj", "lm_head", "ci", "trace", "measure",
                     "cpu", "cuda", "cuda:0", "accelerate", "torchrun", "deepspeed", "llmem", "paper", "time"})
NUMBERS = ["0", "-1", "1", "2", "3", "4", "7", "8", "64", "1024", "4096", str(10**10), str(2**63), str(-(2**31)),
           "0.5", "1.5", "-0.0", "1e308", "1e-320", "inf", "-inf", "nan", "NaN", "1e400", "0x10", "1_000"]
SIZES = ["0", "0B", "1", "500MiB", "80GiB", "-1GiB", "1e30GiB", "infGiB", "nanMiB", "1.5B", "2e9", "500M", "5%",
         "100%", "150%", "-5%", "nan%", "GiB", "12 XB"]
# relative paths only: the test runs in a scratch folder two levels down, so that '..' stays inside it
# ('caf\udce9': the byte 0xe9 of a non-UTF-8 name, as Python hands it over from argv)
PATHS = ["", ".", "..", "out", "out.", "out.png", "out.PNG", "out.svg", "out.pdf", "out.jpg", "out.json",
         "out.yaml", "missing/x.png", "missing/x.json", "adir", "adir/", "adir/x.png", "afile", "afile/x.png",
         "../x.png", "x" * 300 + ".png", "bad\x00name.png", "ünï cödé.png", "caf\udce9.png", "\ud800.png",
         "~/x.png", "config.json", "bad.json", "binary.json"]
MODELS = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-bloom", "gpt2", "facebook/opt-125m", "", "tiny-",
          "tiny-nope", "nonexistent-model", "org/nonexistent", "adir", "afile", "config.json", "bad.json",
          "binary.json", "missing/config.json", "x" * 300, "caf\udce9", "bad\x00name"]
SMALL_MODELS = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-bloom", "gpt2", "facebook/opt-125m"]

garbage = st.one_of(st.sampled_from(NUMBERS), st.sampled_from(SIZES), st.sampled_from(PATHS),
                    st.sampled_from(MEANINGFUL), st.text(max_size=12),
                    st.integers(min_value=-(2**70), max_value=2**70).map(str),
                    st.floats(allow_nan=True, allow_infinity=True).map(repr))


def _value(draw, action: argparse.Action, index: int = 0) -> str:
    metavar = action.metavar[index] if isinstance(action.metavar, tuple) else action.metavar or ""
    if action.choices and draw(st.booleans()):
        return draw(st.sampled_from(sorted(action.choices)))
    if ("PATH" in metavar or "FILE" in metavar) and draw(st.booleans()):     # a path option: mostly paths
        return draw(st.sampled_from(PATHS))
    return draw(garbage)


def _option(draw, action: argparse.Action) -> list[str]:
    flag = draw(st.sampled_from(action.option_strings))
    if action.nargs == 0:
        return [flag]
    if isinstance(action.nargs, int):          # --export KIND PATH
        return [flag, *(_value(draw, action, i) for i in range(action.nargs))]
    if draw(st.booleans()):
        return [f"{flag}={_value(draw, action)}"]     # '--x=-inf': a value argparse would read as a flag
    return [flag, _value(draw, action)]


@st.composite
def command_lines(draw, max_options: int = 5, good_model: bool = False) -> list[str]:
    """A subcommand, its MODEL (mostly a small real one, so that the options' own checks are reached) and up to
    `max_options` options with garbage values."""
    name = draw(st.sampled_from(sorted(SUBCOMMANDS)))
    positionals, options = _arguments(SUBCOMMANDS[name])
    argv = [name]
    if positionals:
        real = good_model or draw(st.integers(0, 3))
        argv.append(draw(st.sampled_from(SMALL_MODELS if real else MODELS)))
    for action in draw(st.lists(st.sampled_from(options), min_size=int(max_options == 1), max_size=max_options)):
        argv += _option(draw, action)
    if positionals and "--json" not in argv and draw(st.booleans()):
        argv.append("--json")
    return argv


def _estimated(setup, *args, **kwargs):
    """The trace's and measure's stand-in: the estimate of the same set-up (its checks, a real MemoryResult)."""
    progress = kwargs.get("progress")
    if progress is not None:
        progress("step")
    return llmem.estimate(setup)


def _rows(setups, against, device=None, on_row=None):
    from llmem.validate.compare import Row

    rows = []
    for setup in setups[:2]:
        est = llmem.estimate(setup)
        rows.append(Row(setup, est, est, 0.0))
        if on_row:
            on_row(rows[-1])
    return rows


def _bound(host: str, port: int, options=None) -> None:
    """`llmem serve`'s stand-in: its checks and the listening socket, closed again instead of serving."""
    from llmem.cli.serve import bind

    bind(host, port).close()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A scratch folder as the working directory, with a folder, a file and malformed configs in it; the engines'
    runs replaced (see the module's docstring)."""
    import llmem.cli.serve
    import llmem.runtime.measure
    import llmem.runtime.trace
    import llmem.validate.compare

    work = tmp_path_factory.mktemp("fuzz") / "a" / "work"
    work.mkdir(parents=True)
    (work / "adir").mkdir()
    (work / "afile").write_text("not a folder")
    (work / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, '
                                      '"num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256}')
    (work / "bad.json").write_text("{not json")
    (work / "binary.json").write_bytes(b"\xff\xfe\x00garbage\x80")
    old = os.getcwd()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llmem.runtime.trace, "trace", _estimated)
        mp.setattr(llmem.runtime.measure, "measure", _estimated)
        mp.setattr(llmem.validate.compare, "run_matrix", _rows)
        mp.setattr(llmem.cli.serve, "serve", _bound)
        os.chdir(work)
        try:
            assert main(["estimate", "tiny-llama", "--json"]) == 0      # imports and first builds, not timed
            assert main(["estimate", "gpt2", "--json"]) == 0
            yield work
        finally:
            os.chdir(old)


def _run(argv: list[str]) -> int:
    try:
        code = main(argv)
    except SystemExit as exc:        # argparse: --help (0), usage errors (2)
        code = exc.code
    return 0 if code is None else code


def test_fuzz_fixture_sees_every_subcommand():
    """The fuzz reads the real parser: every subcommand and its options are there to be drawn."""
    assert set(SUBCOMMANDS) == {"estimate", "trace", "measure", "validate", "plan", "models", "gpus", "serve"}
    _, options = _arguments(SUBCOMMANDS["plan"])
    flags = {f for a in options for f in a.option_strings}
    assert {"--batch-size", "--export", "--plot", "--max-batch", "--lora-rank"} <= flags


def _check(argv: list[str], capsys) -> None:
    code = _run(argv)
    captured = capsys.readouterr()
    assert code in (0, 2), f"exit {code} for {argv}: {captured.err[-500:]}"
    if code == 2 and "error:" in captured.err:
        error = captured.err[captured.err.index("error:"):]
        assert error.count("\n") <= 1, f"a refusal of more than one line for {argv}: {error[:500]}"


# derandomized: CI draws the same examples every run (LLMEM_FUZZ_RANDOM=1 for fresh ones in a hand search)
FUZZ = settings(max_examples=EXAMPLES, deadline=DEADLINE, database=None,
                derandomize=not os.environ.get("LLMEM_FUZZ_RANDOM"),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@FUZZ
@given(argv=command_lines())
def test_garbage_command_lines_exit_0_or_2_without_a_traceback(scratch, argv, capsys):
    _check(argv, capsys)


@FUZZ
@given(argv=command_lines(max_options=1, good_model=True))
def test_one_garbage_option_on_a_good_command_line(scratch, argv, capsys):
    """One option at a time on a small real model: each option's own handling is reached (with several garbage
    options, the first refusal hides the others)."""
    _check(argv, capsys)
