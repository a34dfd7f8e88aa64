"""Command-line options built from the dataclasses' fields: TrainingSetup's fields carry their `Option`
(llmem.setup.training), PlanOptions' their flag (llmem.planner.options). The parser and the set-up are made from the
same fields, so they cannot drift apart."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from llmem.errors import LlmemError
from llmem.planner.options import PlanOptions
from llmem.setup.training import (
    ACTIVATIONS,
    ADAPTERS,
    LAYOUT,
    MODEL,
    OPTIMIZER,
    STEP,
    Option,
    TrainingSetup,
    user_setup,
)

GROUP_TITLES = {MODEL: "model", LAYOUT: "layout", STEP: "step", OPTIMIZER: "optimizer", ACTIVATIONS: "activations",
                ADAPTERS: "adapters"}


def _option(f) -> Option | None:
    return f.metadata.get("option")


def _flag(f, opt: Option) -> str:
    return opt.flag or "--" + f.name.replace("_", "-")


def _dest(f) -> str:
    return f"setup_{f.name}"


def _metavar(name: str, type_: Any) -> str:
    """What --help shows for a flag's value: N for a count, else the field's last word (METHOD, MEMORY, TOKENS)."""
    return "N" if type_ is int else name.split("_")[-1].upper()


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """The set-up's options, grouped as --help shows them, and --json."""
    groups = {key: parser.add_argument_group(title) for key, title in GROUP_TITLES.items()}
    for f in fields(TrainingSetup):
        opt = _option(f)
        if opt is None:
            continue
        g = groups[opt.group]
        default = f.default if opt.cli_default is ... else opt.cli_default
        if opt.kind == "positional":
            g.add_argument(_dest(f), metavar=opt.metavar, help=opt.help)
        elif opt.kind == "switch":
            g.add_argument(_flag(f, opt), dest=_dest(f), action="store_true", help=opt.help)
        elif opt.kind == "negate":
            g.add_argument(_flag(f, opt), dest=_dest(f), action="store_false", help=opt.help)
        elif opt.kind == "switches":
            for flag, value, help_text in opt.switches:
                g.add_argument(flag, dest=f"{_dest(f)}{flag}", action="store_const", const=value, help=help_text)
        else:
            g.add_argument(_flag(f, opt), dest=_dest(f), type=opt.type, default=default,
                           metavar=opt.metavar or _metavar(f.name, opt.type), help=opt.help)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def setup_from_args(args: argparse.Namespace) -> TrainingSetup:
    """The TrainingSetup the parsed options describe (what a flag implies, what excludes or requires what)."""
    values: dict[str, Any] = {}
    given: set[str] = set()
    for f in fields(TrainingSetup):
        opt = _option(f)
        if opt is None:
            continue
        if opt.kind == "switches":
            chosen = [(flag, v) for flag, v, _ in opt.switches if getattr(args, f"{_dest(f)}{flag}") is not None]
            if len(chosen) > 1:
                raise LlmemError(f"{' and '.join(flag for flag, _ in chosen)} exclude each other: choose one "
                                 f"{opt.noun}")
            if chosen:
                values[f.name] = chosen[0][1]
                given.add(f.name)
            continue
        value = getattr(args, _dest(f))
        parser_default = f.default if opt.cli_default is ... else opt.cli_default
        if opt.kind == "positional" or value != parser_default:
            given.add(f.name)
        if value is None and parser_default is None and f.default is not None:
            continue                       # not given: the field's default (or what resolving decides)
        values[f.name] = value
    for f in fields(TrainingSetup):
        opt = _option(f)
        if opt is not None and f.name in given:
            values.update(dict(opt.implies))
            if opt.requires and values.get(opt.requires[0]) != opt.requires[1]:
                raise LlmemError(f"{_flag(f, opt)} applies to {_flag_for(*opt.requires)} only")
    return user_setup(**values)


def _flag_for(name: str, value: Any) -> str:
    """The flag that sets field `name` to `value`."""
    f = next(f for f in fields(TrainingSetup) if f.name == name)
    opt = _option(f)
    if opt.kind == "switches":
        return next(flag for flag, v, _ in opt.switches if v == value)
    return _flag(f, opt)


def add_plan_options(parser: argparse.ArgumentParser) -> None:
    """`plan`'s own options (PlanOptions' fields with a flag)."""
    g = parser.add_argument_group("plan")
    for f in fields(PlanOptions):
        meta = f.metadata
        if "flag" not in meta:
            continue
        kw: dict[str, Any] = {"dest": f"plan_{f.name}", "default": meta["cli_default"], "help": meta["help"]}
        if meta["choices"]:
            kw["choices"] = meta["choices"]
        else:
            kw["metavar"] = meta["metavar"] or _metavar(f.name, meta["type"])
        if meta["type"] is not None:
            kw["type"] = meta["type"]
        g.add_argument(meta["flag"], **kw)
    g.add_argument("--plot", default=None, metavar="FILE.png",
                   help="write memory vs batch size per method (png, svg or pdf, from the extension)")
    g.add_argument("--export", nargs=2, default=None, metavar=("KIND", "PATH"),
                   help="write a launch config for the recommended plan: accelerate (YAML), torchrun (shell), "
                        "deepspeed (JSON)")


def plan_options_from_args(args: argparse.Namespace, setup: TrainingSetup) -> PlanOptions:
    values: dict[str, Any] = {}
    for f in fields(PlanOptions):
        meta = f.metadata
        if "flag" not in meta:
            continue
        value = getattr(args, f"plan_{f.name}")
        values[f.name] = meta["parse"](value) if meta["parse"] is not None and value is not None else value
    given_method = getattr(args, "setup_method", None)
    return PlanOptions(**values, methods=(setup.method,) if given_method else None, tp=setup.tp)
