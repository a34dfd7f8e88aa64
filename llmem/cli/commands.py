"""The commands: each reads its options, calls the library, and prints a table or JSON."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import TYPE_CHECKING

from llmem.cli.options import file_model, plan_options_from_args, setup_and_source
from llmem.cli.paths import check_device, check_output_path, check_plot_path
from llmem.cli.progress import LazyProgress, RowProgress
from llmem.cli.streams import stdout_to_stderr
from llmem.errors import LlmemError
from llmem.planner.options import EXPORT_KINDS
from llmem.setup.gpus import GPU_CATALOG
from llmem.units import format_bytes

if TYPE_CHECKING:
    from llmem.result import MemoryResult
    from llmem.setup.sources import SourceRecord

# The engines import transformers and torch (seconds), rich and matplotlib tens of milliseconds: each command
# imports what it runs and prints with, so that `--help` and a refused option answer at once (benchmarks/startup.md).


def _emit(args: argparse.Namespace, result: MemoryResult, source: SourceRecord | None = None) -> None:
    from llmem.cli.tables import print_approximate, print_json, print_memory, print_source

    if args.json:
        print_json(result.to_dict() | ({"from_file": source.to_dict()} if source is not None else {}))
    else:
        if source is not None:
            print_approximate(source)
        print_memory(result)
        if source is not None:
            print_source(source)


def _check_iterations(args: argparse.Namespace) -> None:
    if args.iterations < 1:
        raise LlmemError(f"--iterations must be >= 1 (the step is run that many times), got {args.iterations}")


def _written(flag: str, path: str, write):
    """Write an output file whose path was checked up front; what the system still refuses (a full disk, a folder
    removed meanwhile) as one line."""
    try:
        return write()
    except OSError as exc:
        raise LlmemError(f"{flag} {path}: could not write it ({exc.strerror or exc}); choose another path") from None


def cmd_estimate(args: argparse.Namespace) -> int:
    from llmem import estimate

    if args.m_base and args.engine != "paper":
        raise LlmemError("--m-base applies to --engine paper only: drop it, or add --engine paper")
    setup, source = setup_and_source(args)
    with file_model(source), stdout_to_stderr(), _learning_status(setup, args):
        result = estimate(setup, engine=args.engine, m_base=args.m_base or None)
    _emit(args, result, source)
    return int(args.check and not result.fits)     # --check: 1 when it does not fit (a refusal exits 2)


def _learning_status(setup, args: argparse.Namespace):
    """A status line on stderr while the estimate learns its step from the real code (llmem.learn: seconds, up to
    minutes for a vision-language step with many large images; once per set-up, then read from the cache); nothing
    when the answer is a hand recipe's or cached, or for --json."""
    import contextlib

    if args.json or args.engine == "paper":
        return contextlib.nullcontext()
    from llmem.memory.activations.learned import learned_for, learning_need
    from llmem.model.resolved import resolve

    try:
        r = resolve(setup)
    except LlmemError:
        return contextlib.nullcontext()          # the estimate says why, in one line
    if not learning_need(r)[0] or learned_for(r) is not None:
        return contextlib.nullcontext()
    from rich.console import Console

    return Console(stderr=True).status("learning the step from the real code on fake tensors (once for this "
                                       "set-up; cached after)")


def cmd_trace(args: argparse.Namespace) -> int:
    from rich.console import Console

    from llmem.cli.plots import plot_timeline

    setup, source = setup_and_source(args)
    _check_iterations(args)
    if args.plot is not None:
        check_plot_path("--plot", args.plot)
    # torch's runtime (seconds) imported after the refusals, which answer at once; what DeepSpeed and the other
    # libraries print while the step runs goes to stderr (llmem.cli.streams)
    with file_model(source), stdout_to_stderr():
        from llmem.runtime.trace import trace

        if args.json:
            result = trace(setup, iterations=args.iterations)
        else:
            with Console(stderr=True).status("tracing") as status:
                result = trace(setup, iterations=args.iterations,
                               progress=lambda msg: status.update(f"trace: {msg}"))
    if args.plot is not None:
        _written("--plot", args.plot, lambda: plot_timeline(result, args.plot))
    _emit(args, result, source)
    return 0


def cmd_measure(args: argparse.Namespace) -> int:
    from rich.console import Console

    setup, source = setup_and_source(args)
    _check_iterations(args)
    device = _measure_device(args.device)
    with stdout_to_stderr():
        from llmem.runtime.measure import measure

        if args.json:
            result = measure(setup, device=device, iterations=args.iterations)
        else:
            with Console(stderr=True).status("measuring"):
                result = measure(setup, device=device, iterations=args.iterations)
    _emit(args, result, source)
    return 0


def _measure_device(device: str | None) -> str | None:
    """--device checked before any work: a kind measure runs on, and a CUDA index this machine has."""
    check_device("--device", device)
    if device is not None and device.startswith("cuda:"):
        import torch

        count = torch.cuda.device_count()
        if count and int(device[5:]) >= count:
            raise LlmemError(f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to "
                             f"cuda:{count - 1}; choose one of those")
    return device


def _shard(text: str | None) -> tuple[int, int] | None:
    """--shard I/N as (I, N); checked by llmem.validate.compare.shard_of."""
    if text is None:
        return None
    parts = text.split("/")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise LlmemError(f"--shard {text!r}: write I/N with 1 <= I <= N, e.g. --shard 1/4")
    i, n = (int(p) for p in parts)
    if not 1 <= i <= n:
        raise LlmemError(f"--shard {text}: write I/N with 1 <= I <= N, e.g. --shard 1/4")
    return i, n


def cmd_validate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from llmem.cli.plots import plot_validation
    from llmem.cli.tables import setup_label, validation_table
    from llmem.validate.compare import compared_counters, failed_rows, shard_of, validate
    from llmem.validate.matrices import MATRICES

    if args.matrix not in MATRICES:
        raise LlmemError(f"unknown matrix {args.matrix!r}: choose one of {', '.join(MATRICES)}")
    if not args.max_error >= 0:             # also refuses nan, which no error would exceed
        raise LlmemError(f"--max-error must be a percentage >= 0, got {args.max_error}")
    if args.out is not None:
        check_output_path("--out", args.out, "results.json")
    if args.plot is not None:
        check_plot_path("--plot", args.plot)
    if args.against == "measure":
        _measure_device(args.device)
    else:
        check_device("--device", args.device)
    counters = compared_counters(args.against)
    shard = _shard(args.shard)
    total = len(shard_of(MATRICES[args.matrix], shard))
    with RowProgress(f"validate {args.against} x {args.matrix}", total) as progress, stdout_to_stderr():
        rows, summary = validate(args.against, args.matrix, args.max_error, args.device,
                                 on_row=lambda r: progress.advance(setup_label(r.setup, compact=True)), shard=shard)
    if args.out is not None:
        _written("--out", args.out, lambda: _write_json(args.out, summary))
    if args.plot is not None:
        _written("--plot", args.plot, lambda: plot_validation(rows, counters, args.plot, args.max_error))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        console = Console()
        console.print(validation_table(rows, args.against, args.matrix, counters, args.max_error))
        failed = len(failed_rows(rows, counters, args.max_error))
        console.print(f"worst error {summary['worst_error_pct']:.2f}% (limit {args.max_error}%): "
                      + ("[green]pass[/]" if not failed else f"[red]{failed} configuration(s) fail[/]"))
    return 0 if summary["passed"] else 1


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)


EXPORT_FILE_EXAMPLES = {"accelerate": "accelerate.yaml", "torchrun": "launch.sh", "deepspeed": "ds_config.json",
                        "torchtitan": "train.toml", "trl": "trl_config.yaml"}


def _check_export(args: argparse.Namespace, setup, methods: tuple[str, ...] | None) -> None:
    """What --export refuses that the set-up and the searched `methods` alone decide, before the plan runs."""
    from llmem.planner.export import check_exportable, check_methods_exportable

    kind, path = args.export
    if kind not in EXPORT_KINDS:
        raise LlmemError(f"unknown export {kind!r}: choose {', '.join(EXPORT_KINDS)}")
    check_output_path(f"--export {kind}", path, EXPORT_FILE_EXAMPLES.get(kind, "launch.cfg"))
    check_exportable(setup, f"--export {kind}", kind)
    check_methods_exportable(setup, kind, methods)


def cmd_plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    from llmem.cli.plots import plot_plan
    from llmem.cli.tables import print_approximate, print_json, print_plan, print_source
    from llmem.planner.plan import plan

    setup, source = setup_and_source(args)
    options = plan_options_from_args(args, setup, source)
    export = args.export
    if export:
        _check_export(args, setup, options.methods)
    if args.plot is not None:
        check_plot_path("--plot", args.plot)
    progress = LazyProgress(enabled=not args.json)
    try:
        with file_model(source), stdout_to_stderr():
            p = plan(setup, options, progress=progress)
    finally:
        progress.close()
    messages = []
    export_error = None
    if export:                  # before the plot: a plan with nothing to export is refused without drawing it
        try:
            e = _written(f"--export {export[0]}", export[1], lambda: _export(p, *export))
            messages.append(f"wrote {export[0]} config for {e.layout.label} to {export[1]}")
            messages += [f"note: {n}" for n in e.notes]   # e.g. which memory a DeepSpeed JSON assumes
        except LlmemError as exc:
            export_error = exc
    if args.plot is not None and export_error is None:
        _written("--plot", args.plot, lambda: plot_plan(p, args.plot))
        messages.append(f"wrote {args.plot}")
    if args.json:
        out = p.to_dict()
        if messages:
            out["written"] = messages
        if source is not None:
            out["from_file"] = source.to_dict()
        print_json(out)
    else:
        console = Console()
        if source is not None:
            print_approximate(source, console)
        print_plan(p, console)
        if source is not None:
            print_source(source, console)
        for m in messages:
            console.print(m)
    if export_error is not None:
        raise export_error
    return 0


def _export(p, kind: str, path: str):
    from llmem.planner.export import write_export

    try:
        return write_export(p, kind, path)
    except LlmemError as exc:
        raise LlmemError(f"--export {kind}: {exc}") from None


def cmd_models(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from llmem.cli.tables import print_json
    from llmem.model.catalog import catalog

    rows = [{"id": e.hub_id, "aliases": list(e.aliases), "params": e.published_params} for e in catalog().values()]
    if args.json:
        print_json(rows)
        return 0
    table = Table(title="bundled model configs")
    for col in ("model", "parameters", "aliases"):
        table.add_column(col, justify="right" if col == "parameters" else "left")
    for r in rows:
        table.add_row(r["id"], f"{r['params'] / 1e9:.2f} B", ", ".join(r["aliases"]))
    Console().print(table)
    return 0


def cmd_gpus(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from llmem.cli.tables import print_json

    if args.json:
        print_json([asdict(g) for g in GPU_CATALOG.values()])
        return 0
    table = Table(title="GPU catalog (CUDA context is an assumption; override with --cuda-context)")
    for col in ("gpu", "memory", "CUDA context", "bf16 TFLOP/s", "link GB/s", "memory GB/s"):
        table.add_column(col)
    for g in GPU_CATALOG.values():
        table.add_row(g.name, format_bytes(g.memory_bytes), format_bytes(g.cuda_context_bytes),
                      f"{g.bf16_tflops:g}", f"{g.link_gbps:g}", f"{g.memory_gbps:g}")
    Console().print(table)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from llmem.cli.serve import ServeOptions, serve

    if args.workers < 1 or args.plan_workers < 1 or args.estimate_timeout <= 0 or args.plan_timeout <= 0:
        raise LlmemError("--workers and --plan-workers take 1 or more, --estimate-timeout and --plan-timeout a "
                         "positive number of seconds")
    serve(args.host, args.port, ServeOptions(
        allow_hosts=tuple(args.allow_host), allow_local_paths=tuple(args.allow_local_paths),
        workers=args.workers, plan_workers=args.plan_workers, estimate_timeout_s=args.estimate_timeout,
        plan_timeout_s=args.plan_timeout))
    return 0
