"""The commands: each reads its options, calls the library, and prints a table or JSON."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from llmem.cli.options import plan_options_from_args, setup_from_args
from llmem.cli.plots import plot_plan, plot_timeline, plot_validation
from llmem.cli.progress import LazyProgress
from llmem.cli.tables import print_json, print_memory, print_plan, validation_table
from llmem.errors import LlmemError
from llmem.model.catalog import catalog
from llmem.planner.options import EXPORT_KINDS
from llmem.result import MemoryResult
from llmem.setup.gpus import GPU_CATALOG
from llmem.units import format_bytes
from llmem.validate.matrices import MATRICES

# The engines import transformers and torch (seconds): each command imports the ones it runs, so that `--help`,
# `models` and `gpus` start at once.


def _emit(args: argparse.Namespace, result: MemoryResult) -> None:
    if args.json:
        print_json(result.to_dict())
    else:
        print_memory(result)


def cmd_estimate(args: argparse.Namespace) -> int:
    from llmem import estimate

    _emit(args, estimate(setup_from_args(args), engine=args.engine, m_base=args.m_base or None))
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from llmem.runtime.trace import trace

    setup = setup_from_args(args)
    if args.json:
        result = trace(setup, iterations=args.iterations)
    else:
        with Console(stderr=True).status("tracing") as status:
            result = trace(setup, iterations=args.iterations, progress=lambda msg: status.update(f"trace: {msg}"))
    if args.plot:
        plot_timeline(result, args.plot)
    _emit(args, result)
    return 0


def cmd_measure(args: argparse.Namespace) -> int:
    from llmem.runtime.measure import measure

    setup = setup_from_args(args)
    if args.json:
        result = measure(setup, device=args.device, iterations=args.iterations)
    else:
        with Console(stderr=True).status("measuring"):
            result = measure(setup, device=args.device, iterations=args.iterations)
    _emit(args, result)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from llmem.validate.compare import compared_counters, failed_rows, validate

    counters = compared_counters(args.against)
    console = Console(stderr=args.json)
    with Progress(console=console, transient=True, disable=args.json) as progress:
        task = progress.add_task(f"{args.against} x {args.matrix}", total=len(MATRICES.get(args.matrix, ())))
        rows, summary = validate(args.against, args.matrix, args.max_error, args.device,
                                 on_row=lambda r: progress.advance(task))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(summary, fh, indent=2)
    if args.plot:
        plot_validation(rows, counters, args.plot)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        console.print(validation_table(rows, args.against, args.matrix, counters, args.max_error))
        failed = len(failed_rows(rows, counters, args.max_error))
        console.print(f"worst error {summary['worst_error_pct']:.2f}% (limit {args.max_error}%): "
                      + ("[green]pass[/]" if not failed else f"[red]{failed} configuration(s) fail[/]"))
    return 0 if summary["passed"] else 1


def cmd_plan(args: argparse.Namespace) -> int:
    from llmem.planner.export import write_export
    from llmem.planner.plan import plan

    setup = setup_from_args(args)
    options = plan_options_from_args(args, setup)
    export = args.export
    if export and export[0] not in EXPORT_KINDS:
        raise LlmemError(f"unknown export {export[0]!r}: choose {', '.join(EXPORT_KINDS)}")
    progress = LazyProgress(enabled=not args.json)
    try:
        p = plan(setup, options, progress=progress)
    finally:
        progress.close()
    messages = []
    if args.plot:
        plot_plan(p, args.plot)
        messages.append(f"wrote {args.plot}")
    export_error = None
    if export:
        try:
            e = write_export(p, export[0], export[1])
            messages.append(f"wrote {export[0]} config for {e.layout.label} to {export[1]}")
        except LlmemError as exc:
            export_error = exc
    if args.json:
        out = p.to_dict()
        if messages:
            out["written"] = messages
        print_json(out)
    else:
        console = Console()
        print_plan(p, console)
        for m in messages:
            console.print(m)
    if export_error is not None:
        raise LlmemError(f"--export {export[0]}: {export_error}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
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
