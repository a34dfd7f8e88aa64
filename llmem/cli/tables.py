"""Output for people (rich tables) and for programs (JSON): a memory result, a plan, a validation.

Titles are the set-up in words (`SetupRecord.describe`), wrapped phrase by phrase to the terminal's width. Plan and
validation tables adapt to the width they are drawn at: a compact layout (short headers with the unit once, bare
numbers, no vertical rules) that fits 80 columns without cutting a cell, and, from WIDE_COLUMNS columns on where it
fits, the full one (full headers, rules)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from llmem.paper.algorithm1 import CPU_OFFLOADING
from llmem.result import COMPONENTS, MemoryResult
from llmem.setup.methods import METHODS
from llmem.setup.training import TrainingSetup
from llmem.units import GIB, MIB, format_bytes

if TYPE_CHECKING:
    from llmem.planner.plan import Plan
    from llmem.setup.sources import SourceRecord
    from llmem.validate.compare import Row

WIDE_COLUMNS = 120     # from this terminal width on, plan and validate draw their wide layout where it fits
SEPARATOR = " · "


def to_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=lambda o: o.to_dict() if hasattr(o, "to_dict") else str(o))


def print_json(obj: Any) -> None:
    sys.stdout.write(to_json(obj) + "\n")


# ------------------------------------------------------------------------------------------------ titles


def wrap_phrases(parts: Iterable[str], width: int, sep: str = SEPARATOR) -> list[str]:
    """Phrases joined by `sep` into lines of at most `width` columns, breaking only between phrases (a phrase
    longer than a line gets a line of its own, which the console then wraps at its spaces)."""
    lines: list[str] = []
    line = ""
    parts = list(parts)
    mark = sep.rstrip()      # a broken line ends with the separator: keep room for it
    for i, part in enumerate(parts):
        candidate = f"{line}{sep}{part}" if line else part
        room = width if i == len(parts) - 1 else width - len(mark)
        if line and len(candidate) > room:
            lines.append(line + mark)
            line = part
        else:
            line = candidate
    if line:
        lines.append(line)
    return lines


class Title:
    """A title of phrases, wrapped to the width it is drawn at (the terminal's, or a table's container's)."""

    def __init__(self, parts: list[str], style: str = "bold"):
        self.parts = parts
        self.style = style

    def __str__(self) -> str:
        return SEPARATOR.join(self.parts)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for line in wrap_phrases(self.parts, options.max_width):
            yield Text(line, style=self.style)


class ByWidth:
    """A renderable that draws `wide()` where its natural width fits the width it is given, else `narrow()` (which
    fits 80 columns)."""

    def __init__(self, narrow: Callable[[], Any], wide: Callable[[], Any]):
        self.narrow, self.wide = narrow, wide

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        wide = self.wide()
        if options.max_width >= WIDE_COLUMNS and natural_width(console, options, wide) <= options.max_width:
            yield wide
        else:
            yield self.narrow()


def natural_width(console: Console, options: ConsoleOptions, renderable: Any) -> int:
    """The width `renderable` takes when nothing wraps (a Group: its widest part)."""
    parts = renderable.renderables if isinstance(renderable, Group) else [renderable]
    return max(Measurement.get(console, options.update(width=10_000), r).maximum
               for r in parts if not isinstance(r, (Title, Text)))


def memory_title(result: MemoryResult) -> list[str]:
    """What was estimated, as phrases: the set-up as it ran (record.describe) and the engine."""
    parts = result.setup.describe() if result.setup is not None else []
    return parts + [f"engine {result.engine}"]


# ------------------------------------------------------------------------------------------------ a result


def memory_table(result: MemoryResult) -> Table:
    table = Table()
    table.add_column("component")
    table.add_column("per GPU", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    total = max(result.device_used_bytes, 1)
    for name in COMPONENTS:
        value = result.components.get(name, 0)
        if value:
            table.add_row(name.replace("_", " "), format_bytes(value), f"{100 * value / total:.1f}%")
    table.add_section()
    table.add_row("[bold]peak_allocated[/]", format_bytes(result.peak_allocated_bytes), "max_memory_allocated")
    table.add_row("[bold]peak_reserved[/]", format_bytes(result.peak_reserved_bytes), "max_memory_reserved")
    if result.reserved_on_device_bytes != result.peak_reserved_bytes:
        table.add_row("[bold]reserved on GPU[/]", format_bytes(result.reserved_on_device_bytes), "cache released")
    table.add_row("[bold]device_used[/]", format_bytes(result.device_used_bytes), "nvidia-smi")
    over = result.job_over
    verdict = "[green]fits[/]" if result.fits else \
        "[red]does not fit[/]" + (f" ({over.name})" if over is not None and result.step_fits else "")
    table.add_row("GPU memory", format_bytes(result.gpu_memory_bytes), verdict)
    return table


def phases_table(result: MemoryResult) -> Table:
    """A step with phases (GRPO): each phase's peak, what fills it most, and which phase is the step's peak."""
    table = Table()
    for name, justify in (("phase", "left"), ("allocated", "right"), ("reserved", "right"), ("largest parts", "left")):
        table.add_column(name, justify=justify)
    cap = getattr(result, "capped_reserved_bytes", None)   # at capacity the allocator frees its cache and retries
    for p in result.phases:
        if p.allocated_bytes < 0:          # the replay allocated nothing in it (no peak of its own)
            continue
        parts = sorted(p.components.items(), key=lambda kv: -kv[1])[:3]
        filled = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in parts)
        name = f"[bold]{p.name} (peak)[/]" if p.is_peak else p.name
        reserved = format_bytes(p.reserved_bytes) if cap is None or p.reserved_bytes <= cap \
            else f"{format_bytes(cap)}*"    # *: capped as the step's reserved is (the cache released at capacity)
        table.add_row(name, format_bytes(p.allocated_bytes), reserved, filled)
    return table


def job_phases_table(result: MemoryResult) -> Table:
    """The job's phases beside its step: loading, the step, evaluation, saving, each one's peak on one GPU and on one
    node's host (the step's host: offloaded states, in its notes)."""
    table = Table()
    for name, justify in (("job phase", "left"), ("path", "left"), ("per GPU", "right"), ("host per node", "right")):
        table.add_column(name, justify=justify, no_wrap=name != "path")
    rows = [(p.name, p.kind, p.device_bytes, format_bytes(p.host_bytes)) for p in result.job_phases]
    first = 1 if result.job_phases[0].name == "load" else 0        # the step after loading
    rows.insert(first, ("step", "peak_allocated", result.peak_allocated_bytes, ""))
    top = result.job_peak[1]        # the largest of the rows' per-GPU bytes: the step's and every job phase's
    for name, kind, device, host in rows:
        table.add_row(f"[bold]{name} (peak)[/]" if device == top else name, kind, format_bytes(device), host)
    return table


def print_memory(result: MemoryResult, console: Console | None = None) -> None:
    console = console or Console()
    console.print(Title(memory_title(result)))
    console.print(memory_table(result))
    if result.phases:
        console.print(phases_table(result))
    if result.peak_phase:
        console.print(f"peak during: {result.peak_phase}")
    oom = getattr(result, "oom", None)
    if oom is not None:
        console.print(f"[red]out of memory:[/] {escape(oom.describe())}")
    if getattr(result, "job_phases", None):
        console.print(job_phases_table(result))
    for note in result.notes + list(getattr(result, "job_notes", [])):
        console.print(f"[yellow]note:[/] {escape(note)}")


def print_approximate(record: SourceRecord, console: Console | None = None) -> None:
    """Above a result read --from a file that llmem cannot express whole: that the answer is approximate, and the
    keys that make it so (each listed with its reason under the result)."""
    if record.exact:
        return
    keys = ", ".join(dict.fromkeys(i.key for i in record.approximations))
    (console or Console()).print(f"[bold yellow]approximate:[/] the file's run without what llmem does not model "
                                 f"({escape(keys)}; see 'ignored' below)")


def print_source(record: SourceRecord, console: Console | None = None) -> None:
    """Under a result read --from a file: each file, the keys used (key = value -> field = value), those ignored
    and why, the notes."""
    console = console or Console()
    several = len({p for p, _ in record.files}) > 1
    for path, fmt in record.files:
        console.print(f"[bold]from[/] {escape(path)} ({fmt})")
    for u in record.used:
        console.print(f"  [green]used[/] {escape((u.file + ': ') if several else '')}{escape(u.text())}")
    for i in record.ignored:
        console.print(f"  [yellow]ignored[/] {escape((i.file + ': ') if several else '')}{escape(i.text())}")
    if record.overridden:
        console.print(f"  overridden by the command line: {escape(', '.join(record.overridden))}")
    for note in record.notes:
        console.print(f"  [yellow]note:[/] {escape(note)}")


# ------------------------------------------------------------------------------------------------ a plan


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    hours, rem = divmod(seconds, 3600)
    return f"{int(hours)} h {int(rem // 60):02d} min" if hours else f"{seconds / 60:.1f} min"


def byte_unit(values: Iterable[float]) -> tuple[str, int]:
    """One unit for a column of byte counts: GiB when the largest is at least 1 GiB, else MiB."""
    return ("GiB", GIB) if max(list(values) + [0]) >= GIB else ("MiB", MIB)


def _number(n: float, size: int) -> str:
    return f"{n / size:.2f}"


def plan_title(p: Plan) -> list[str]:
    """The plan's set-up in words: the model, the GPUs, the sequence, precision, optimizer, adapters (from an
    estimate's record: their trainable count), the activation options, the engine and the ranking."""
    s = p.setup
    record = next((c.memory.setup for c in ([p.recommended] if p.recommended else []) + list(p.candidates)
                   if c.memory is not None and c.memory.setup is not None), None)
    where = f"{s.gpus}× {p.gpu.name}"
    if record is not None:
        words = record.describe(layout=False, shape=False)
        parts = [words[0], where, f"seq {s.seq_len}"] + words[1:]
    else:
        parts = [p.anatomy.name, where, f"seq {s.seq_len}", s.precision, s.optimizer] \
            + (["grad-ckpt"] if s.grad_ckpt else [])
    return parts + [f"engine {p.options.engine}", f"ranking {p.options.ranking}"]


def _plan_rows(p: Plan, wide: bool) -> tuple[list[tuple[str, str]], list[list[str]]]:
    """(header, justify) per column and the cells, for the wide or the compact layout."""
    accum = p.options.global_batch is not None
    paper = p.options.ranking == "paper"
    unit, size = byte_unit(v for c in p.candidates for v in (c.memory.peak_reserved_bytes,
                                                             c.memory.device_used_bytes))
    # reserved on the GPU (capped where the allocator released its cache, marked *); the wide layout adds the
    # uncapped peak, what an unlimited device would reserve
    cols = [("layout", "left")] + ([("dp×tp", "right")] if wide else []) \
        + [("max batch" if wide else "batch", "right"),
           (f"reserved on GPU {unit}" if wide else f"reserved {unit}", "right")] \
        + ([(f"unlimited reserved {unit}", "right")] if wide else []) \
        + [(f"device used {unit}" if wide else f"used {unit}", "right")] \
        + ([("micro × accum" if wide else "micro×acc", "right")] if accum else []) \
        + [("step time" if wide else "step", "right"), ("tokens/s" if wide else "tok/s", "right")] \
        + ([("eval", "right")] if paper else []) + [("fits", "left")]
    rows = []
    for c in p.candidates:
        mark = "★ " if c is p.recommended else ""
        t = c.time
        row = [f"[bold green]{mark}[/]{escape(c.layout.label)}" if mark else escape(c.layout.label)]
        if wide:
            row.append(f"{c.layout.dp}×{c.layout.tp}")
        m = c.memory
        capped = "*" if m.reserved_on_device_bytes != m.peak_reserved_bytes else ""
        row += [str(c.max_batch_size), _number(m.reserved_on_device_bytes, size) + capped]
        if wide:
            row.append(_number(m.peak_reserved_bytes, size))
        row.append(_number(m.device_used_bytes, size))
        if accum:
            row.append((f"{t.micro_batch_size} × {t.accumulation_steps}" if wide
                        else f"{t.micro_batch_size}×{t.accumulation_steps}") if t else "-")
        row += [_fmt_time(t.step_s if t else None), f"{t.tokens_per_s:,.0f}" if t else "-"]
        if paper:
            row.append(f"{c.eval:g}" if c.eval is not None else "-")
        row.append("[green]yes[/]" if c.fits else f"[red]no[/] ({c.blocked_by})" if c.blocked_by
                   else ("[red]no[/] (batch 1)" if wide else "[red]no[/]"))
        rows.append(row)
    return cols, rows


def _table(cols: list[tuple[str, str]], rows: list[list[str]], wide: bool, caption: str | None = None,
           wrap_first: bool = True) -> Table:
    """A table in the wide style (rules, padding) or the compact one (a rule under the header, one space between
    columns): every cell but the first column's keeps to one line."""
    if wide:
        table = Table(box=box.HEAVY_HEAD, caption=caption, caption_justify="left")
    else:
        table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False, caption=caption,
                      caption_justify="left", collapse_padding=True)
    for i, (name, justify) in enumerate(cols):
        first = i == 0
        table.add_column(name, justify=justify, no_wrap=not (first and wrap_first), overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def plan_table(p: Plan, wide: bool | None = None):
    """The candidates: the compact layout below WIDE_COLUMNS columns, the wide one from there (wide=True / False
    forces one)."""
    def build(w: bool) -> Table:
        cols, rows = _plan_rows(p, w)
        caption = None if w or all(c.max_batch_size >= 1 for c in p.candidates) else \
            "a layout that does not fit shows its memory at batch 1"
        return _table(cols, rows, w, caption)

    if wide is not None:
        return build(wide)
    return ByWidth(lambda: build(False), lambda: build(True))


def print_plan(p: Plan, console: Console | None = None, wide: bool | None = None) -> None:
    console = console or Console()
    console.print(Title(plan_title(p)))
    console.print(plan_table(p, wide))
    if any(c.memory.reserved_on_device_bytes != c.memory.peak_reserved_bytes for c in p.candidates):
        console.print("* reserved on the GPU: the allocator fills it and releases its cache to go on, as PyTorch "
                      "does before an OOM (an unlimited device would reserve more)")
    if p.recommended is not None:
        line = f"[bold]recommended:[/] {escape(p.recommendation)} — {escape(p.reason)}"
        if p.dataset_time_s is not None:
            line += f"; {p.options.dataset_tokens:,} tokens in {_fmt_time(p.dataset_time_s)}"
        console.print(line)
        if p.recommended.memory.phases:       # a step with phases (GRPO): the recommended one's
            console.print(phases_table(p.recommended.memory))
            t = p.recommended.time
            if t is not None and t.generation_s:
                console.print(f"generation and scoring: {_fmt_time(t.generation_s)} of the {_fmt_time(t.step_s)} step")
    elif p.recommendation == CPU_OFFLOADING:
        console.print(f"[bold]recommended:[/] CPU offloading — {escape(p.reason)}")
    else:
        console.print(f"[bold red]nothing fits[/] — {escape(p.reason)}")
    for sug in p.suggestions:
        console.print(f"[cyan]suggestion ({sug['kind']}):[/] {escape(sug['text'])}")
    if p.generation is not None:
        print_generation(p.generation, console)
    for note in p.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")


def print_generation(g: dict, console: Console) -> None:
    """A generation objective's answer (llmem.planner.generation_plan): its layout, phases and generation."""
    what = "the recommended plan" if g["from"] == "recommended" else f"the fastest suggestion ({g['flags']})"
    how = g["generation"]
    if "vllm_gpu_memory_utilization" in g:
        how += f" at vllm_gpu_memory_utilization {g['vllm_gpu_memory_utilization']:g}, its pool " \
            f"{format_bytes(g['vllm_pool_bytes'])} on the device in training" + (
            " (chosen: " + g["vllm_chosen"]["rule"] + ")" if g.get("vllm_chosen") else
            " (as given)" if g.get("vllm_given") else " (GRPOConfig's default)")
    console.print(f"[bold]answer:[/] {escape(what)}: {g['label']}, batch {g['max_batch_size']} per GPU, "
                  f"generation by {escape(how)}")
    if "generation_time" in g:
        console.print(escape(g["generation_time"]))
    hint = (g.get("vllm_chosen") or g.get("vllm_colocate") or {}).get("hint")
    if hint:
        console.print(escape(hint))
    if g["from"] != "recommended":      # the recommended plan's phases are printed above
        console.print(phases_table(_phase_view(g["phases"])))
    alt = g.get("vllm_colocate")
    if alt is None:
        return
    if not alt["fits"]:
        console.print("vLLM colocated instead: " + escape(alt.get("reason") or "no utilization leaves a training "
                                                           "batch on this layout"))
        return
    console.print(f"vLLM colocated instead on {alt['label']} ({escape(alt['flags'])}, chosen: {escape(alt['rule'])}): batch "
                  f"{alt['max_batch_size']}, {alt['tokens_per_s']:,.0f} tokens/s, its pool "
                  f"{format_bytes(alt['vllm_pool_bytes'])} on the device in training (the time model runs "
                  "transformers' generate at the same memory-bandwidth bound: its per-token overheads are not "
                  "modelled); phases:")
    console.print(phases_table(_phase_view(alt["phases"])))


def _phase_view(phases: list[dict]):
    """PhaseMemory rows back from their dicts, for phases_table."""
    from llmem.result import PhaseMemory

    return type("Phases", (), {"phases": [PhaseMemory(d["name"], d["allocated_bytes"], d["reserved_bytes"],
                                                      d["components"], d["is_peak"]) for d in phases]})()


# ------------------------------------------------------------------------------------------------ a validation


DEFAULT_LABEL = TrainingSetup("model")      # what a compact label leaves out: one GPU, bf16-mixed, adamw


def setup_label(s: TrainingSetup, compact: bool = False) -> str:
    """A set-up of a matrix in a few words: model, layout, precision, optimizer, batch×seq and what differs from
    the defaults (adapters, quantised base, checkpointing, attention, activation options). compact: without the
    layout, precision and optimizer where they are the defaults (single, bf16-mixed, adamw)."""
    spec = METHODS.get(s.method)
    layout = s.method if spec is None or spec.one_gpu else f"{s.method}×{s.gpus}" + (f" tp{s.tp}" if s.tp else "")
    optimizer = s.optimizer + ("-in-bwd" if s.optimizer_in_backward else "")
    words = [s.model]
    for word, default in ((layout, DEFAULT_LABEL.method), (s.precision, DEFAULT_LABEL.precision),
                          (optimizer, DEFAULT_LABEL.optimizer)):
        if not compact or word != default:
            words.append(word)
    words.append(f"{s.batch_size}×{s.seq_len}")
    if s.lora_rank:
        targets = "" if s.lora_targets == DEFAULT_LABEL.lora_targets else f":{s.lora_targets}"
        words.append(f"lora{s.lora_rank}{targets}")
    if s.lora_dropout:
        words.append(f"drop{s.lora_dropout:g}")
    if s.peft_config:
        words.append(f"peft:{Path(s.peft_config).name}")
    quant = s.quant_spec
    if quant.quantised:
        words.append(s.quant_base + ("-no-dq" if quant.double_quant_optional and not s.double_quant else "")
                     + ("-no-upcast" if quant.kbit_prep and not s.kbit_upcast else ""))
    if s.grad_ckpt:
        words.append("ckpt" + (f"/{s.ckpt_every}" if s.ckpt_every > 1 else "")
                     + (f"/{s.ac_policy}" if s.ac_policy != "full" else ""))
    if s.attn != DEFAULT_LABEL.attn:
        words.append(s.attn)
    words += [w for w, on in (("fused-ce", s.fused_ce), ("offload-act", s.offload_activations),
                              ("offload-opt", s.offload_optimizer), ("packing", s.packing),
                              ("expandable", s.expandable_segments),
                              (f"logits-{s.logits_dtype}", s.logits_dtype != "fp32"),
                              (f"liger:{s.liger}", s.liger != "none"),
                              (f"float8:{s.float8}" + ("+ag" if s.float8_all_gather else ""), s.float8 != "none"))
             if on]
    return " ".join(words)


_COUNTER_SHORT = {"peak_allocated_bytes": "alloc", "peak_reserved_bytes": "resv", "device_used_bytes": "used"}


def _validation_rows(rows: list[Row], against: str, counters: tuple[str, ...], max_error_pct: float,
                     wide: bool) -> tuple[list[tuple[str, str]], list[list[str]], list[str]]:
    unit, size = byte_unit(getattr(res, c) for r in rows for res in (r.estimate, r.truth) if res is not None
                           for c in counters)
    cols = [("configuration" if wide else f"set-up (memory in {unit})", "left")]
    for c in counters:
        if wide:
            name = c.replace("_bytes", "")
            cols += [(f"{name} est {unit}", "right"), (f"{name} {against} {unit}", "right"), ("err %", "right")]
        else:
            name = _COUNTER_SHORT.get(c, c.replace("_bytes", ""))
            cols += [(f"{name}\nest", "right"), (f"{name}\n{against}", "right"), ("err\n%", "right")]
    cols.append(("s", "right"))
    cells, footnotes = [], []
    for r in rows:
        label = setup_label(r.setup, compact=not wide)
        if r.truth is None:
            why = f"skipped: {r.skipped}" if r.skipped else f"error: {r.error}"
            footnotes.append(f"{len(footnotes) + 1}. {label}: {why}")
        row = [escape(label)]
        for c in counters:
            e = r.error_pct(c)
            colour = "yellow" if r.skipped else "red" if e is None or abs(e) > max_error_pct else "green"
            truth = _number(getattr(r.truth, c), size) if r.truth else \
                f"[{colour}]{'skip' if r.skipped else 'error'} {len(footnotes)}[/]"
            row += [_number(getattr(r.estimate, c), size), truth,
                    f"[{colour}]{e:+.2f}[/]" if e is not None else f"[{colour}]n/a[/]"]
        row.append(f"{r.seconds:.1f}")
        cells.append(row)
    if not wide:
        footnotes.insert(0, "set-ups on one GPU in bf16-mixed with adamw unless they say otherwise")
    return cols, cells, footnotes


def validation_table(rows: list[Row], against: str, matrix: str, counters: tuple[str, ...],
                     max_error_pct: float, wide: bool | None = None):
    """Estimate against the truth per set-up: the compact layout below WIDE_COLUMNS columns, the wide one from
    there (wide=True / False forces one). Rows without a truth (skipped, failed) say why under the table."""
    def build(w: bool) -> Group:
        cols, cells, footnotes = _validation_rows(rows, against, counters, max_error_pct, w)
        title = Title([f"estimate vs {against}", f"matrix {matrix} ({len(rows)} set-ups)",
                       "error = (estimate - truth) / truth", f"limit ±{max_error_pct:g}%"])
        parts: list[Any] = [title, _table(cols, cells, w)]
        parts += [Text(f) for f in footnotes]
        return Group(*parts)

    if wide is not None:
        return build(wide)
    return ByWidth(lambda: build(False), lambda: build(True))
