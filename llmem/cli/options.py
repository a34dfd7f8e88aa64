"""Options on the command-line floor: argparse flags built from the dataclasses' fields.

Command-line options built from the dataclasses' fields: TrainingSetup's fields carry their `Option`
(llmem.setup.training), PlanOptions' their flag (llmem.planner.options). The parser and the set-up are made from the
same fields, so they cannot drift apart."""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from dataclasses import fields
from typing import Any

from llmem.errors import LlmemError, UnknownModel
from llmem.planner.options import EXPORT_FILES, PlanOptions
from llmem.setup.flags import IMAGES, JOB
from llmem.setup.objectives import OBJECTIVE_GROUP, batch_multiple, fixed_steps_per_generation, objective_spec
from llmem.setup.sources import SourceRecord, setup_from_file
from llmem.setup.training import (
    ACTIVATIONS,
    ADAPTERS,
    DEEPSPEED,
    LAYOUT,
    MODEL,
    OPTIMIZER,
    STEP,
    Option,
    TrainingSetup,
    default_method,
    option_fields,
    user_setup,
)

GROUP_TITLES = {MODEL: "model", LAYOUT: "layout", STEP: "step", OPTIMIZER: "optimizer", ACTIVATIONS: "activations",
                ADAPTERS: "adapters", DEEPSPEED: "DeepSpeed ZeRO (ds-zero1/2/3)",
                OBJECTIVE_GROUP: "objective (TRL's trainers)", JOB: "job phases (loading, evaluation, saving)",
                IMAGES: "images (vision-language models)"}


def _option(f) -> Option | None:
    return f.metadata.get("option")


def _flag(f, opt: Option) -> str:
    return opt.flag or "--" + f.name.replace("_", "-")


def _dest(f) -> str:
    return f"setup_{f.name}"


def _metavar(name: str, type_: Any) -> str:
    """What --help shows for a flag's value: N for a count, else the field's last word (METHOD, MEMORY, TOKENS)."""
    return "N" if type_ is int else name.split("_")[-1].upper()


GIVEN = "setup_given"      # the namespace's set of the dests the command line gave


class _Given(argparse.Action):
    """argparse's store / store_true / store_false / store_const that also notes its dest as given, so that --from
    FILE knows which flags override the file (also one given at its default value)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        setattr(namespace, GIVEN, getattr(namespace, GIVEN, frozenset()) | {self.dest})


class _GivenBoolean(argparse.BooleanOptionalAction):
    """argparse's --flag / --no-flag pair (BooleanOptionalAction) that notes its dest as given: a file's choice
    can be turned off from the command line as well as on."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        setattr(namespace, GIVEN, getattr(namespace, GIVEN, frozenset()) | {self.dest})


def _positive(flag: str) -> str:
    """The flag a negating switch turns off: --no-kbit-upcast -> --kbit-upcast."""
    return "--" + flag.removeprefix("--no-")


def _typed(convert: Any) -> Any:
    """A field's converter as argparse calls it: llmem's own converters' refusals (LlmemError: the problem and the
    fix) become argparse's message for the flag; int, float and str keep argparse's own."""
    if convert in (int, float, str):
        return convert

    def typed(text: str) -> Any:
        try:
            return convert(text)
        except LlmemError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    typed.__name__ = getattr(convert, "__name__", "value")
    return typed


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """The set-up's options, grouped as --help shows them, --from and --json."""
    groups = {key: parser.add_argument_group(title) for key, title in GROUP_TITLES.items()}
    for f in option_fields():
        opt = _option(f)
        if opt is None:
            continue
        g = groups[opt.group]
        default = f.default if opt.cli_default is ... else opt.cli_default
        if opt.kind == "positional":
            g.add_argument(_dest(f), metavar=opt.metavar, nargs="?", default=None,
                           help=opt.help + " (optional with --from: the file names it)")
        elif opt.kind == "switch":            # --flag / --no-flag
            g.add_argument(_flag(f, opt), dest=_dest(f), action=_GivenBoolean, default=False, help=opt.help)
        elif opt.kind == "negate":            # --no-flag (the help's) / --flag
            g.add_argument(_positive(_flag(f, opt)), dest=_dest(f), action=_GivenBoolean, default=True,
                           help=opt.help)
        elif opt.kind == "switches":
            for flag, value, help_text in opt.switches:
                g.add_argument(flag, dest=f"{_dest(f)}{flag}", action=_Given, nargs=0, const=value, help=help_text)
        else:
            g.add_argument(_flag(f, opt), dest=_dest(f), action=_Given, type=_typed(opt.type), default=default,
                           metavar=opt.metavar or _metavar(f.name, opt.type), help=opt.help)
    groups[MODEL].add_argument("--from", dest="from_files", action="append", default=None, metavar="FILE",
                               help="read the set-up from a training config: axolotl, LLaMA-Factory, ms-swift, "
                               "TRL / TrainingArguments, torchtune or accelerate YAML, DeepSpeed JSON, torchtitan TOML "
                               "(repeat to add the accelerate config it is launched with); flags override the file")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def setup_from_args(args: argparse.Namespace) -> TrainingSetup:
    """The TrainingSetup the parsed options describe (what a flag implies, what excludes or requires what)."""
    return setup_and_source(args)[0]


@contextmanager
def file_model(source: SourceRecord | None):
    """A model the --from file names that llmem cannot find: the refusal says how to name another."""
    try:
        yield
    except LlmemError as exc:
        named = [u for u in source.used if u.field == "model"] if source is not None else []
        if not named or "model" in source.overridden or not isinstance(exc, UnknownModel):
            raise
        raise LlmemError(f"{exc}; {named[-1].file}'s {named[-1].key} names it: give MODEL before --from to use a "
                         "catalog model of the same architecture (e.g. llmem estimate meta-llama/Llama-3.1-8B --from "
                         "FILE)") from None


def setup_and_source(args: argparse.Namespace) -> tuple[TrainingSetup, SourceRecord | None]:
    """The set-up and, under --from FILE, how the file was read (the flags given override the file's values)."""
    values: dict[str, Any] = {}
    given: set[str] = set()
    recorded = getattr(args, GIVEN, frozenset())
    for f in option_fields():
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
        if value is not None if opt.kind == "positional" else (value != parser_default or _dest(f) in recorded):
            given.add(f.name)
        if value is None and parser_default is None and f.default is not None:
            continue                       # not given: the field's default (or what resolving decides)
        values[f.name] = value
    for f in option_fields():
        opt = _option(f)
        if opt is not None and f.name in given and values.get(f.name) is not False:
            values.update(dict(opt.implies))
        if opt is not None and f.name in given and values.get(f.name) != f.default:
            if opt.requires and values.get(opt.requires[0]) != opt.requires[1]:
                raise LlmemError(f"{_flag(f, opt)} applies to {_flag_for(*opt.requires)} only")
    files = getattr(args, "from_files", None)
    if files:
        implied = {k: v for f in option_fields() if f.name in given and _option(f) is not None
                   for k, v in _option(f).implies}
        read = setup_from_file(files, **{k: values[k] for k in given | set(implied) if k in values})
        return read.setup, read.record
    if values.get("model") is None:
        raise LlmemError("give a MODEL (a catalog name, hub id, config.json or model folder), or --from FILE with "
                         "the training config that names it")
    spec = objective_spec(values.get("objective") or "sft")
    if "batch_size" not in given:       # the default micro-batch: the objective's smallest (KTO's 2, GRPO's)
        values["batch_size"] = max(values.get("batch_size") or 1,
                                   batch_multiple(spec.name, values.get("gpus") or 1, values.get("num_generations"),
                                                  fixed_steps_per_generation(values)))
        if (values.get("pp") or 1) > 1:  # --pp: a micro-batch of 1 per pipeline micro-batch, as many as torch needs
            values["batch_size"] = max(values["batch_size"], values.get("pp_microbatches") or values["pp"])
    limit = values.get("max_length") or spec.max_length
    if "seq_len" not in given and limit and values.get("seq_len", 0) > limit:
        values["seq_len"] = limit       # the default sequence: TRL's max_length truncates it (DPO / KTO's 1024)
    return user_setup(**values), None


def _flag_for(name: str, value: Any) -> str:
    """The flag that sets field `name` to `value`."""
    f = next(f for f in option_fields() if f.name == name)
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
                   help="write a launch config for the recommended plan: "
                        + ", ".join(f"{kind} ({files})" for kind, files in EXPORT_FILES.items()))


def plan_options_from_args(args: argparse.Namespace, setup: TrainingSetup,
                           source: SourceRecord | None = None) -> PlanOptions:
    """`plan`'s options; the method searched is the one given, by --method or by the --from file (`source`)."""
    values: dict[str, Any] = {}
    for f in fields(PlanOptions):
        meta = f.metadata
        if "flag" not in meta:
            continue
        value = getattr(args, f"plan_{f.name}")
        values[f.name] = meta["parse"](value) if meta["parse"] is not None and value is not None else value
    given_method = getattr(args, "setup_method", None) or (source is not None and source.states_method)
    return PlanOptions(**values, methods=(setup.method,) if given_method else None, tp=setup.tp)


def option_flags(values: dict[str, Any], attached: bool = False) -> list[str]:
    """The flags that set TrainingSetup fields to `values` (field name -> value, MODEL left out), in field order:
    a switch when true, a negated switch when false, one of several switches by the value it maps to. attached:
    `--flag=VALUE`, which argparse reads as the value even when it starts with '-'."""
    out: list[str] = []
    for f in option_fields():
        opt = _option(f)
        if opt is None or opt.kind == "positional" or f.name not in values:
            continue
        value = values[f.name]
        if opt.kind == "switch":
            out += [_flag(f, opt)] if value else []
        elif opt.kind == "negate":
            out += [] if value else [_flag(f, opt)]
        elif opt.kind == "switches":
            out += [flag for flag, v, _ in opt.switches if v == value]
        elif value is not None:
            out += [f"{_flag(f, opt)}={value}"] if attached else [_flag(f, opt), str(value)]
    return out


def _unset_value(name: str, setup: TrainingSetup) -> Any:
    """A field's value when its flag is not given: the method follows --gpus (user_setup), the others their
    field's default."""
    if name == "method":
        return default_method(setup.gpus, setup.objective)
    return next(f.default for f in option_fields() if f.name == name)


def setup_flags(setup: TrainingSetup) -> list[str]:
    """`setup` as the command line that gives it (the inverse of setup_from_args): MODEL, then the flag of each
    field whose value differs from its unset value, less what a given flag implies (--grad-ckpt under
    --grad-ckpt-every K)."""
    changed = {f.name: getattr(setup, f.name) for f in option_fields()
               if _option(f) is not None and getattr(setup, f.name) != _unset_value(f.name, setup)}
    implied = {name: value for f in option_fields() if f.name in changed
               for name, value in _option(f).implies}
    return [setup.model] + option_flags({k: v for k, v in changed.items() if implied.get(k, ...) != v})
