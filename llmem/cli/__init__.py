"""`llmem` command line: estimate, trace, measure, validate, plan, models, gpus. A thin layer over the library:
options built from the dataclasses' fields (options), commands (commands), rich tables (tables), plots (plots).

Every command takes --json. Bad input prints one line on stderr and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from llmem.errors import LlmemError

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def build_parser() -> argparse.ArgumentParser:
    from llmem.cli import commands
    from llmem.cli.options import add_plan_options, add_training_options

    parser = argparse.ArgumentParser(prog="llmem", description="GPU memory of fine-tuning an LLM, per GPU and method")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("estimate", help="fast analytic estimate of per-GPU peak memory")
    add_training_options(p)
    p.add_argument("--engine", default="llmem", help="llmem (PyTorch-native, default) or paper (LLMem's equations)")
    p.add_argument("--m-base", default=None, help="paper engine: memory in use before training, e.g. 700MiB")
    p.set_defaults(func=commands.cmd_estimate)

    p = sub.add_parser("trace", help="run the real step on fake tensors through a model of the CUDA allocator")
    add_training_options(p)
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write the memory timeline as a PNG")
    p.set_defaults(func=commands.cmd_trace)

    p = sub.add_parser("measure", help="run the real step on a real device (GPU if present, else CPU)")
    add_training_options(p)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--iterations", type=int, default=2)
    p.set_defaults(func=commands.cmd_measure)

    p = sub.add_parser("validate", help="compare estimate against trace or measure over a matrix of set-ups")
    p.add_argument("--against", default="trace", choices=("trace", "measure"))
    p.add_argument("--matrix", default="ci", help="ci, large, or gpu (see llmem/validate/matrices.py)")
    p.add_argument("--max-error", type=float, default=2.0, help="fail when any error exceeds this percentage")
    p.add_argument("--out", default=None, metavar="FILE.json", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write estimate vs truth as a PNG")
    p.add_argument("--device", default=None, help="measure: cuda or cpu")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=commands.cmd_validate)

    p = sub.add_parser("plan", help="largest batch per method, a time model, and a recommendation")
    add_training_options(p)
    add_plan_options(p)
    p.set_defaults(func=commands.cmd_plan)

    p = sub.add_parser("models", help="list the bundled model catalog")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=commands.cmd_models)

    p = sub.add_parser("gpus", help="list the GPU catalog")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=commands.cmd_gpus)
    return parser


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except LlmemError as exc:
        print(f"llmem: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("llmem: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
