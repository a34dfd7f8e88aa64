"""Plots for people: the traced step's memory timeline, a plan's memory against batch size per layout, and a
validation's estimates against the truth.

Each plot is a matplotlib Figure built without pyplot's global state (`*_figure`, which tests inspect) and written
by `plot_*`. Every plot's title names the set-up (SetupRecord.describe, wrapped), memory is in GiB, and the memory
plots draw the GPU's capacity (and the planner's limit where a headroom is kept)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from llmem.cli.tables import setup_label, wrap_phrases
from llmem.planner.search import layout_setup
from llmem.result import MemoryResult
from llmem.units import GIB

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from llmem.planner.plan import Plan
    from llmem.validate.compare import Row

PHASE_COLOURS = {"setup": "#e6e6e6", "forward": "#dbe9f6", "backward": "#fde2cf", "optimizer_step": "#dff2dc"}
CAPACITY_STYLE = {"color": "red", "linestyle": "--", "lw": 1.2}
OFF_SCALE = 4      # a capacity more than this many times the plotted peak is named above the axis, not drawn to


def _figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def _save(fig: Figure, path: str, dpi: int) -> str:
    fig.savefig(path, dpi=dpi)
    return path


def _title(parts: list[str], chars: int) -> str:
    return "\n".join(wrap_phrases(parts, chars))


def _capacity(ax, capacity_gib: float, name: str, peak_gib: float) -> float:
    """The GPU's capacity as a line (in the legend); the y-axis top it leaves. A capacity far above the plotted
    peak keeps the axis on the data and says where the capacity lies."""
    label = f"{name} capacity {capacity_gib:.1f} GiB"
    if peak_gib > 0 and capacity_gib > OFF_SCALE * peak_gib:
        top = peak_gib * 1.25
        label += " (above the axis)"
        ax.annotate(f"↑ capacity {capacity_gib:.1f} GiB ({100 * peak_gib / capacity_gib:.1f}% used at the peak)",
                    xy=(0.99, 0.98), xycoords="axes fraction", ha="right", va="top", fontsize=8, color="red")
    else:
        top = max(capacity_gib, peak_gib) * 1.08
    ax.axhline(capacity_gib, label=label, **CAPACITY_STYLE)
    return top


# ------------------------------------------------------------------------------------------------ trace


def timeline_figure(result: MemoryResult) -> Figure:
    """Allocated and reserved memory over the traced allocator events; the phases shaded (in the legend), the peak
    device used and the GPU's capacity as lines."""
    from matplotlib.patches import Patch

    fig = _figure(10, 5)
    ax = fig.add_subplot()
    tl = result.timeline or []
    peak = max(result.device_used_bytes, result.peak_reserved_bytes) / GIB
    phases: list[str] = []
    if tl:
        ts = [p["t"] for p in tl]
        start = 0
        for i in range(1, len(tl) + 1):
            if i == len(tl) or tl[i]["phase"] != tl[start]["phase"]:
                phase = tl[start]["phase"]
                end = ts[i] if i < len(tl) else ts[-1]
                ax.axvspan(ts[start], end, color=PHASE_COLOURS.get(phase, "#ffffff"), lw=0, zorder=0)
                if phase not in phases:
                    phases.append(phase)
                start = i
        ax.plot(ts, [p["allocated"] / GIB for p in tl], label="allocated", lw=1.2, color="tab:blue")
        ax.plot(ts, [p["reserved"] / GIB for p in tl], label="reserved", lw=1.2, color="tab:orange")
        ax.set_xlim(ts[0], ts[-1])
    ax.axhline(result.device_used_bytes / GIB, color="k", ls=":", lw=0.9,
               label=f"device used at peak {result.device_used_bytes / GIB:.2f} GiB (reserved + context)")
    top = _capacity(ax, result.gpu_memory_bytes / GIB, result.setup.gpu if result.setup else "GPU", peak)
    ax.set_ylim(0, top)
    ax.set_xlabel("allocator event (rank 0)")
    ax.set_ylabel("memory per GPU (GiB)")
    parts = (result.setup.describe() if result.setup else []) + [f"engine {result.engine}"]
    summary = (f"peak {result.peak_allocated_bytes / GIB:.2f} GiB allocated, {result.peak_reserved_bytes / GIB:.2f}"
               f" GiB reserved" + (f" (in {result.peak_phase})" if result.peak_phase else ""))
    ax.set_title(_title(parts, 120) + "\n" + summary, fontsize=8, loc="left")
    handles, _ = ax.get_legend_handles_labels()
    handles += [Patch(facecolor=PHASE_COLOURS.get(ph, "#ffffff"), edgecolor="#999999", lw=0.5,
                      label=ph.replace("_", " ")) for ph in phases]
    ax.legend(handles=handles, loc="upper left", fontsize=7, ncol=2, framealpha=0.9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_timeline(result: MemoryResult, path_png: str) -> str:
    """The memory timeline of a traced step, as a PNG."""
    return _save(timeline_figure(result), path_png, 110)


# ------------------------------------------------------------------------------------------------ plan


def _needed_bytes(m: MemoryResult) -> int:
    """What a step takes of the device at this batch: device_used where it fits (the allocator may release its
    cache and retry, so that is what nvidia-smi shows), else what it asks for: the uncapped reserved peak plus what
    lies outside the allocator (CUDA context, managed memory)."""
    if m.fits:
        return m.device_used_bytes
    outside = m.components.get("cuda_context", 0) + m.components.get("managed_memory", 0)
    return max(m.peak_reserved_bytes + outside, m.device_used_bytes)


def plan_batches(p: Plan, points: int = 40) -> list[int]:
    """The micro-batches a plan's plot evaluates: every one up to `points`, log-spaced beyond, and each candidate's
    largest batch that fits and the next (its fit boundary)."""
    top = max([c.max_batch_size for c in p.candidates] + [4])
    top = min(max(int(top * 1.3) + 1, 8), p.options.batch_cap)
    if top <= points:
        xs = set(range(1, top + 1))
    else:
        xs = {max(1, round(top ** (i / (points - 1)))) for i in range(points)}
    for c in p.candidates:
        xs |= {b for b in (c.max_batch_size, c.max_batch_size + 1) if 1 <= b <= top}
    return sorted(xs)


def plan_figure(p: Plan, points: int = 40) -> Figure:
    """Per layout, the memory a step needs per GPU against the micro-batch (non-decreasing: at each batch the
    most any batch up to it needs, so the allocator's segment reuse does not make the curve jag), its largest batch
    that fits marked, the GPU's capacity, the headroom limit, and the region that does not fit shaded."""
    fig = _figure(9, 5.5)
    ax = fig.add_subplot()
    xs = plan_batches(p, points)
    capacity = p.gpu.memory_bytes / GIB
    limit = p.limit_bytes / GIB
    peak = 0.0
    for i, c in enumerate(p.candidates):
        running, ys = 0.0, []
        for b in xs:
            running = max(running, _needed_bytes(p.engine.full(layout_setup(p.setup, c.layout, b), c.layout)) / GIB)
            ys.append(running)
        peak = max([peak] + [y for y in ys if y <= capacity * 1.2])
        # earlier layouts drawn wider, so that curves lying on each other (fsdp and zero2 often do) stay visible
        line, = ax.plot(xs, ys, lw=max(3.2 - 0.5 * i, 1.0), alpha=0.85,
                        label=f"{c.layout.label}: max batch {c.max_batch_size}")
        if c.fits:
            at = xs.index(c.max_batch_size)
            ax.plot([c.max_batch_size], [ys[at]], marker="*", ms=11, color=line.get_color(), mec="k", mew=0.5,
                    ls="none")
    ax.plot([], [], marker="*", ms=11, color="grey", mec="k", mew=0.5, ls="none",
            label="largest batch that fits (fit boundary)")
    top = _capacity(ax, capacity, p.gpu.name, peak)
    if p.options.headroom:
        ax.axhline(limit, color="orange", linestyle=":", lw=1.2,
                   label=f"limit with {100 * p.options.headroom:g}% headroom {limit:.1f} GiB")
    ax.axhspan(limit, max(top, limit) * 2, color="red", alpha=0.06, lw=0, label="does not fit")
    ax.set_ylim(0, top)
    ax.set_xlim(xs[0], xs[-1])
    if xs[-1] > 64:
        ax.set_xscale("log", base=2)
        from matplotlib.ticker import FuncFormatter

        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("micro-batch size per GPU")
    ax.set_ylabel("device memory per GPU (GiB)\ndevice used where it fits, else reserved + context asked;"
                  " max over smaller batches", fontsize=8)
    record = next((c.memory.setup for c in p.candidates if c.memory.setup is not None), None)
    words = record.describe(layout=False, shape=False) if record else [p.anatomy.name]
    parts = [words[0], f"{p.setup.gpus}× {p.gpu.name}", f"seq {p.setup.seq_len}"] + words[1:] \
        + [f"engine {p.options.engine}"]
    ax.set_title(_title(parts, 105), fontsize=8, loc="left")
    ax.legend(fontsize=8, loc="lower right", framealpha=0.9)     # the curves rise from the lower left
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig


def plot_plan(p: Plan, path: str, points: int = 40) -> str:
    """A plan's memory against the micro-batch per layout, as a PNG."""
    return _save(plan_figure(p, points), path, 120)


# ------------------------------------------------------------------------------------------------ validate


def validation_figure(rows: list[Row], counters: tuple[str, ...], max_error_pct: float | None = None) -> Figure:
    """Left: estimate against truth per counter (log-log, GiB, one label per decade). Right: the error of each
    set-up per counter, set-ups named on their own rows (the limit band where given)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    compared = [r for r in rows if r.truth is not None]
    n = max(len(compared), 1)
    height = max(6.0, 0.19 * n + 2.0)
    fig = _figure(14, height)
    grid = fig.add_gridspec(2, 2, width_ratios=(1, 1.25), height_ratios=(6.0, max(height - 6.0, 0.01)))
    ax = fig.add_subplot(grid[0, 0])
    err_ax = fig.add_subplot(grid[:, 1])
    markers = "osd"
    values = [getattr(res, c) / GIB for r in compared for res in (r.estimate, r.truth) for c in counters]
    low, high = (min(values), max(values)) if values else (0.01, 1.0)
    low, high = 10 ** math.floor(math.log10(max(low, 1e-4))), 10 ** math.ceil(math.log10(max(high, 1e-3)))
    for c, marker in zip(counters, markers, strict=False):
        ax.scatter([getattr(r.truth, c) / GIB for r in compared], [getattr(r.estimate, c) / GIB for r in compared],
                   marker=marker, label=c.replace("_bytes", ""), alpha=0.7, s=22)
    ax.plot([low, high], [low, high], "k--", lw=0.8, label="estimate = truth")
    decade = FuncFormatter(lambda v, _: f"{v:g}")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(LogLocator(base=10, numticks=12))
        axis.set_major_formatter(decade)
        axis.set_minor_formatter(NullFormatter())
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):      # set_*scale resets the locators
        axis.set_major_locator(LogLocator(base=10, numticks=12))
        axis.set_major_formatter(decade)
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_aspect("equal")
    truth_engine = compared[0].truth.engine if compared else "truth"
    ax.set_xlabel(f"{truth_engine} (GiB)")
    ax.set_ylabel("estimate (GiB)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="major", alpha=0.3)

    names = [setup_label(r.setup) for r in compared]
    ys = list(range(len(compared)))
    for k, (c, marker) in enumerate(zip(counters, markers, strict=False)):
        offset = (k - (len(counters) - 1) / 2) * 0.25
        err_ax.scatter([r.error_pct(c) or 0.0 for r in compared], [y + offset for y in ys], marker=marker, s=16,
                       label=c.replace("_bytes", ""), alpha=0.8)
    err_ax.axvline(0, color="k", lw=0.8)
    if max_error_pct is not None:
        err_ax.axvspan(-max_error_pct, max_error_pct, color="green", alpha=0.08, lw=0,
                       label=f"within ±{max_error_pct:g}%")
    err_ax.set_yticks(ys)
    err_ax.set_yticklabels(names, fontsize=6.5)
    err_ax.set_ylim(len(compared) - 0.5, -0.5)
    err_ax.set_xlabel("error % = (estimate - truth) / truth")
    err_ax.legend(fontsize=8, loc="lower right")
    err_ax.grid(True, axis="x", alpha=0.3)
    summary = []
    for c in counters:
        errors = [(abs(e), e, name) for r, name in zip(compared, names, strict=True)
                  if (e := r.error_pct(c)) is not None]
        if errors:
            worst = max(errors)
            summary.append(f"{c.replace('_bytes', '')}: mean |error| {sum(a for a, _, _ in errors) / len(errors):.2f}%,"
                           f" worst {worst[1]:+.2f}%\n    ({worst[2]})")
    if summary:
        note_ax = fig.add_subplot(grid[1, 0])
        note_ax.axis("off")
        note_ax.text(0.0, 1.0, "\n".join(summary), va="top", ha="left", fontsize=8, family="monospace",
                     transform=note_ax.transAxes)
    skipped = len(rows) - len(compared)
    fig.suptitle(f"llmem estimate vs {truth_engine}: {len(compared)} set-ups"
                 + (f" ({skipped} without a truth: skipped or failed)" if skipped else ""), fontsize=10)
    fig.tight_layout()
    return fig


def plot_validation(rows: list[Row], counters: tuple[str, ...], path: str, max_error_pct: float | None = None) -> str:
    """A validation's estimates against the truth, as a PNG."""
    return _save(validation_figure(rows, counters, max_error_pct), path, 120)
