"""Output for people (rich tables) and for programs (JSON)."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from llmem.result import COMPONENTS, MemoryResult
from llmem.units import format_bytes


def to_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=lambda o: o.to_dict() if hasattr(o, "to_dict") else str(o))


def print_json(obj: Any) -> None:
    sys.stdout.write(to_json(obj) + "\n")


def memory_table(result: MemoryResult) -> Table:
    s = result.setup
    title = (f"{s.get('model')} · {s.get('method')} (dp {s.get('dp')} × tp {s.get('tp')}) · {s.get('gpu')} · "
             f"batch {s.get('batch_size')} × seq {s.get('seq_len')} · {s.get('precision')} · {s.get('optimizer')}"
             f"{' · grad-ckpt' if s.get('grad_ckpt') else ''} · engine {result.engine}")
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
    from rich.markup import escape

    console = console or Console()
    console.print(memory_table(result))
    if result.peak_phase:
        console.print(f"peak during: {result.peak_phase}")
    for note in result.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
