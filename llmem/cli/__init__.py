"""`llmem` command line: estimate, trace, measure, validate, plan, models, gpus, serve. A thin layer over the
library: options built from the dataclasses' fields (options), commands (commands), rich tables (tables), plots
(plots), the local web page (serve).

Every command takes --json. Bad input prints one line on stderr and exits with code 2.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import warnings

from llmem.errors import LlmemError

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PLOT_HELP = "(png, svg or pdf, from the extension)"
# An answer makes and drops hundreds of thousands of small containers (a schedule's builders' lists and dicts). With
# CPython's first-generation threshold (700 allocations) a 72B plan runs ~580 collections, 0.33 s of its CPU; at
# 5,000, ~100 and 0.15 s (benchmarks/cli_timing.md, session 15). Set for the command line's process only.
GC_FIRST_GENERATION = 5000


class Parser(argparse.ArgumentParser):
    """argparse's usage errors as one line that says where the help is (exit 2, as argparse does)."""

    def error(self, message: str):
        self.exit(2, _printable(f"{self.prog}: error: {message}; see {self.prog} --help\n"))


class DefaultsFormatter(argparse.HelpFormatter):
    """--help states each option's default: the help text's own words where it gives them, else "(default X)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.nargs == 0
                or any(action.default is nothing for nothing in (None, False, argparse.SUPPRESS))):
            return text
        return f"{text} (default %(default)s)".lstrip()


class VersionAction(argparse.Action):
    """--version: the installed package's version, read only when asked (importlib.metadata costs milliseconds)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"llmem {installed_version()}")
        parser.exit()


def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llmem")
    except PackageNotFoundError:
        return "(not installed: pip install -e . in the checkout)"


def build_parser() -> argparse.ArgumentParser:
    from llmem.cli import commands
    from llmem.cli.options import add_plan_options, add_training_options
    from llmem.planner.options import ENGINES

    parser = Parser(prog="llmem", description="GPU memory of fine-tuning an LLM, per GPU and method",
                    formatter_class=DefaultsFormatter)
    parser.add_argument("--version", action=VersionAction, help="print llmem's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, formatter_class=DefaultsFormatter)
        p.set_defaults(func=func)
        return p

    p = command("estimate", "fast analytic estimate of per-GPU peak memory", commands.cmd_estimate)
    add_training_options(p)
    p.add_argument("--engine", default="llmem", choices=ENGINES,
                   help="llmem (PyTorch-native, default) or paper (LLMem's equations)")
    p.add_argument("--check", action="store_true",
                   help="a launch guard: exit 0 when the step fits, 1 when it does not, 2 when llmem cannot tell "
                   "(a refusal), e.g. llmem estimate ... --check && torchrun ...")
    p.add_argument("--m-base", default=None, metavar="BYTES",
                   help="paper engine: memory in use before training, e.g. 700MiB (default: 600MiB on V100s, else "
                        "the CUDA context)")

    p = command("trace", "run the real step on fake tensors through a model of the CUDA allocator",
                commands.cmd_trace)
    add_training_options(p)
    p.add_argument("--iterations", type=int, default=2, metavar="N", help="training steps to run")
    p.add_argument("--plot", default=None, metavar="FILE.png", help=f"write the memory timeline {PLOT_HELP}")

    p = command("measure", "run the real step on a real device (GPU if present, else CPU)", commands.cmd_measure)
    add_training_options(p)
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available, else cpu)")
    p.add_argument("--iterations", type=int, default=2, metavar="N", help="training steps to run")

    p = command("validate", "compare estimate against trace or measure over a matrix of set-ups",
                commands.cmd_validate)
    p.add_argument("--against", default="trace", choices=("trace", "measure"), help="the truth engine")
    p.add_argument("--matrix", default="ci", help="ci, ci-sample (every setting of ci, once), objectives, large, "
                   "gpu, float8, vlm or vlm-gpu (see llmem/validate/matrices.py)")
    p.add_argument("--max-error", type=float, default=2.0, metavar="PCT",
                   help="fail when any error exceeds this percentage")
    p.add_argument("--shard", default=None, metavar="I/N", help="run every N-th row from the I-th (split a matrix "
                   "over machines)")
    p.add_argument("--out", default=None, metavar="FILE.json", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help=f"write estimate vs truth {PLOT_HELP}")
    p.add_argument("--device", default=None,
                   help="measure: cuda, cuda:N or cpu (default: cuda if available, else cpu)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = command("plan", "largest batch per method, a time model, and a recommendation", commands.cmd_plan)
    add_training_options(p)
    add_plan_options(p)

    p = command("models", "list the bundled model catalog", commands.cmd_models)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = command("gpus", "list the GPU catalog", commands.cmd_gpus)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = command("serve", "a local web page: the estimate, its breakdown, sweeps and the plan, from a form",
                commands.cmd_serve)
    p.add_argument("--host", default="127.0.0.1", help="IP address to listen on (0.0.0.0: every interface), or "
                   "localhost")
    p.add_argument("--port", type=int, default=8000, metavar="N", help="port to listen on (0: any free one)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME", help="also answer requests for "
                   "this Host name (a reverse proxy's); by default only the address served (repeat for several)")
    p.add_argument("--allow-local-paths", nargs="+", default=[], metavar="ROOT", help="let a query name files "
                   "below these folders (MODEL, --peft-config); by default no path on the server is read")
    p.add_argument("--workers", type=int, default=2, metavar="N", help="worker processes for estimates and sweeps "
                   "(plans have their own, --plan-workers)")
    p.add_argument("--plan-workers", type=int, default=1, metavar="N", help="worker processes for plans")
    p.add_argument("--estimate-timeout", type=float, default=10.0, metavar="S", help="an estimate's or a sweep's "
                   "time limit in seconds, after which it is stopped")
    p.add_argument("--plan-timeout", type=float, default=60.0, metavar="S", help="a plan's time limit in seconds")
    return parser


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore")
    gc.set_threshold(GC_FIRST_GENERATION, *gc.get_threshold()[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except LlmemError as exc:
        print(f"llmem: error: {_printable(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("llmem: interrupted", file=sys.stderr)
        return 130


def _printable(text: str) -> str:
    """A message naming a path or a model as given: the bytes of a non-UTF-8 name (surrogates in Python's argv)
    written as \\udcXX, so that any stream can print it (sys.stderr does the same; a captured one may not)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


if __name__ == "__main__":
    sys.exit(main())
