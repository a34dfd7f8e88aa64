"""Output for people (rich tables) and for programs (JSON): a memory result, a plan, a validation."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from llmem.paper.algorithm1 import CPU_OFFLOADING
from llmem.result import COMPONENTS, MemoryResult
from llmem.units import format_bytes
from llmem.validate.matrices import label

if TYPE_CHECKING:
    from llmem.planner.plan import Plan
    from llmem.validate.compare import Row


def to_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=lambda o: o.to_dict() if hasattr(o, "to_dict") else str(o))


def print_json(obj: Any) -> None:
    sys.stdout.write(to_json(obj) + "\n")


def memory_table(result: MemoryResult) -> Table:
    s = result.setup
    title = (f"{s.model} · {s.method} (dp {s.dp} × tp {s.tp}) · {s.gpu} · "
             f"batch {s.batch_size} × seq {s.seq_len} · {s.precision} · {s.optimizer}"
             f"{' · grad-ckpt' if s.grad_ckpt else ''} · engine {result.engine}")
    table = Table(title=title, title_justify="left")
    table.add_column("component")
    table.add_column("per GPU", justify="right")
    table.add_column("share", justify="right")
    total = max(result.device_used_bytes, 1)
    for name in COMPONENTS:
        value = result.components.get(name, 0)
        if value:
            table.add_row(name.replace("_", " "), format_bytes(value), f"{100 * value / total:.1f}%")
    table.add_section()
    table.add_row("[bold]peak_allocated[/]", format_bytes(result.peak_allocated_bytes), "max_memory_allocated")
    table.add_row("[bold]peak_reserved[/]", format_bytes(result.peak_reserved_bytes), "max_memory_reserved")
    table.add_row("[bold]device_used[/]", format_bytes(result.device_used_bytes), "nvidia-smi")
    verdict = "[green]fits[/]" if result.fits else "[red]does not fit[/]"
    table.add_row("GPU memory", format_bytes(result.gpu_memory_bytes), verdict)
    return table


def print_memory(result: MemoryResult, console: Console | None = None) -> None:
    console = console or Console()
    console.print(memory_table(result))
    if result.peak_phase:
        console.print(f"peak during: {result.peak_phase}")
    for note in result.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    hours, rem = divmod(seconds, 3600)
    return f"{int(hours)} h {int(rem // 60):02d} min" if hours else f"{seconds / 60:.1f} min"


def plan_table(p: Plan) -> Table:
    s = p.setup
    title = (f"{p.anatomy.name} · {s.gpus}x {p.gpu.name} · seq {s.seq_len} · {s.precision} · {s.optimizer}"
             f"{' · grad-ckpt' if s.grad_ckpt else ''} · engine {p.options.engine} · ranking {p.options.ranking}")
    table = Table(title=title, title_justify="left")
    accum = p.options.global_batch is not None
    cols = ["method", "layout dp×tp", "max batch", "peak reserved", "device used"]
    if accum:
        cols += ["micro × accum"]
    cols += ["step time", "tokens/s"]
    if p.options.ranking == "paper":
        cols += ["eval"]
    cols += ["fits"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("method", "fits") else "right")
    for c in p.candidates:
        mark = "[bold green]★ [/]" if c is p.recommended else ""
        t = c.time
        row = [mark + c.layout.label, f"{c.layout.dp}×{c.layout.tp}", str(c.max_batch_size),
               format_bytes(c.memory.peak_reserved_bytes), format_bytes(c.memory.device_used_bytes)]
        if accum:
            row.append(f"{t.micro_batch_size} × {t.accumulation_steps}" if t else "-")
        row += [_fmt_time(t.step_s if t else None), f"{t.tokens_per_s:,.0f}" if t else "-"]
        if p.options.ranking == "paper":
            row.append(f"{c.eval:g}" if c.eval is not None else "-")
        row.append("[green]yes[/]" if c.fits else "[red]no[/] (batch 1)")
        table.add_row(*row)
    return table


def print_plan(p: Plan, console: Console | None = None) -> None:
    console = console or Console()
    console.print(plan_table(p))
    if p.recommended is not None:
        line = f"[bold]recommended:[/] {p.recommendation} — {p.reason}"
        if p.dataset_time_s is not None:
            line += f"; {p.options.dataset_tokens:,} tokens in {_fmt_time(p.dataset_time_s)}"
        console.print(line)
    elif p.recommendation == CPU_OFFLOADING:
        console.print(f"[bold]recommended:[/] CPU offloading — {p.reason}")
    else:
        console.print(f"[bold red]nothing fits[/] — {p.reason}")
    for sug in p.suggestions:
        console.print(f"[cyan]suggestion ({sug['kind']}):[/] {escape(sug['text'])}")
    for note in p.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")


def validation_table(rows: list[Row], against: str, matrix: str, counters: tuple[str, ...],
                     max_error_pct: float) -> Table:
    table = Table(title=f"estimate vs {against}, matrix {matrix} (error = (estimate - truth) / truth)")
    table.add_column("configuration")
    for c in counters:
        name = c.replace("_bytes", "")
        table.add_column(f"{name} est", justify="right")
        table.add_column(f"{name} {against}", justify="right")
        table.add_column("err %", justify="right")
    table.add_column("s", justify="right")
    for r in rows:
        cells = [label(r.setup)]
        for c in counters:
            e = r.error_pct(c)
            truth = format_bytes(getattr(r.truth, c)) if r.truth else (
                f"skipped: {r.skipped}"[:40] if r.skipped else r.error[:40])
            colour = "yellow" if r.skipped else "red" if e is None or abs(e) > max_error_pct else "green"
            cells += [format_bytes(getattr(r.estimate, c)), truth,
                      f"[{colour}]{e:+.2f}[/]" if e is not None else f"[{colour}]n/a[/]"]
        cells.append(f"{r.seconds:.1f}")
        table.add_row(*cells)
    return table
