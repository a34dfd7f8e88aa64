"""Plots for people: the traced step's memory timeline, a plan's memory against batch size per method, and a
validation's estimates against the truth."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmem.model.resolved import setup_for
from llmem.result import MemoryResult
from llmem.units import GIB

if TYPE_CHECKING:
    from llmem.planner.plan import Plan
    from llmem.validate.compare import Row


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(result: MemoryResult, path_png: str) -> str:
    """Allocated and reserved memory over the traced events, phases shaded."""
    plt = _pyplot()
    tl = result.timeline or []
    fig, ax = plt.subplots(figsize=(10, 4.5))
    if tl:
        ts = [p["t"] for p in tl]
        ax.plot(ts, [p["allocated"] / GIB for p in tl], label="allocated", lw=1.2)
        ax.plot(ts, [p["reserved"] / GIB for p in tl], label="reserved", lw=1.2)
        colors = {"setup": "#eeeeee", "forward": "#dbe9f6", "backward": "#fde2cf", "optimizer_step": "#dff2dc"}
        start = 0
        for i in range(1, len(tl) + 1):
            if i == len(tl) or tl[i]["phase"] != tl[start]["phase"]:
                end = ts[i] if i < len(tl) else ts[-1]
                ax.axvspan(ts[start], end, color=colors.get(tl[start]["phase"], "#ffffff"), lw=0)
                start = i
        ax.axhline(result.device_used_bytes / GIB, color="k", ls=":", lw=0.8, label="device used (peak)")
    ax.set_xlabel("allocator event")
    ax.set_ylabel("GiB")
    s = result.setup
    ax.set_title(f"{s.model} {s.method} x{s.gpus} {s.precision} "
                 f"b{s.batch_size} s{s.seq_len}: peak {result.peak_allocated_bytes / GIB:.2f}"
                 f" GiB allocated ({result.peak_phase})", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)
    plt.close(fig)
    return path_png


def plot_plan(p: Plan, path: str, points: int = 40) -> None:
    """Memory (device used) vs micro-batch per candidate, with the GPU's capacity and the headroom limit."""
    plt = _pyplot()
    top = max([c.max_batch_size for c in p.candidates] + [4])
    top = min(max(int(top * 1.3) + 1, 8), p.options.batch_cap)
    xs = sorted({max(1, round(top ** (i / (points - 1)))) for i in range(points)})
    fig, ax = plt.subplots(figsize=(8, 5))
    for c in p.candidates:
        ys = [p.engine.full(setup_for(p.setup, c.layout, b)).device_used_bytes / GIB for b in xs]
        ax.plot(xs, ys, marker=".", label=c.layout.label)
    ax.axhline(p.gpu.memory_bytes / GIB, color="red", linestyle="--", label=f"{p.gpu.name} memory")
    if p.options.headroom:
        ax.axhline(p.limit_bytes / GIB, color="orange", linestyle=":", label="limit with headroom")
    if top > 64:
        ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batch size per GPU")
    ax.set_ylabel("device used per GPU (GiB)")
    ax.set_title(f"{p.anatomy.name} on {p.setup.gpus}x {p.gpu.name}, seq {p.setup.seq_len}")
    ax.legend(fontsize="small")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_validation(rows: list[Row], counters: tuple[str, ...], path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 6))
    for c, marker in zip(counters, "osd", strict=False):
        xs = [getattr(r.truth, c) / GIB for r in rows if r.truth]
        ys = [getattr(r.estimate, c) / GIB for r in rows if r.truth]
        ax.scatter(xs, ys, marker=marker, label=c.replace("_bytes", ""), alpha=0.7)
    top = max([getattr(r.truth, c) / GIB for r in rows if r.truth for c in counters] + [1])
    ax.plot([0, top], [0, top], "k--", lw=0.8, label="estimate = truth")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("truth (GiB)")
    ax.set_ylabel("estimate (GiB)")
    ax.legend()
    ax.set_title("llmem estimate vs truth")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
