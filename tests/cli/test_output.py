"""Output a person reads: titles that say what was estimated (adapters and their trainable count worked out by hand
here), layout labels as resolved (no "None"), plan and validate tables readable at 80 columns (no cut cell) with a
wide layout on wide terminals, and plots with a legend, the GPU's capacity and labels that do not collide (checked
on the matplotlib figure objects, not on pixels)."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from llmem import estimate
from llmem.cli.plots import plan_figure, timeline_figure, validation_figure
from llmem.cli.tables import plan_table, print_memory, print_plan, validation_table, wrap_phrases
from llmem.planner.options import PlanOptions
from llmem.planner.plan import plan
from llmem.runtime.trace import trace
from llmem.setup.training import TrainingSetup
from llmem.units import GIB
from llmem.validate.compare import Row, compared_counters
from llmem.validate.matrices import CI_MATRIX, bundled_peft_config

CUT = ("…", "...")
TINY_LLAMA = json.loads((Path(__file__).resolve().parents[2] / "llmem/model/catalog/tiny/tiny-llama.json").read_text())


def _render(renderable_printer, width: int) -> str:
    console = Console(width=width, record=True, color_system=None, force_terminal=False)
    renderable_printer(console)
    return console.export_text()


def _memory_text(result, width: int) -> str:
    return _render(lambda c: print_memory(result, c), width)


def _title_lines(text: str) -> list[str]:
    """The title: the lines above the table's top rule."""
    lines = text.splitlines()
    return lines[:next(i for i, line in enumerate(lines) if line.startswith("┏"))]


# ------------------------------------------------------------------------------------------------ titles


def test_wrap_phrases_breaks_between_phrases_only():
    parts = ["gpt2", "single on 1× A100-80GB", "batch 1 × seq 2048", "bf16-mixed", "adamw"]
    lines = wrap_phrases(parts, 40)
    assert all(len(line) <= 40 for line in lines)
    joined = " ".join(line.removesuffix(" ·") for line in lines)
    for p in parts:
        assert p in joined
    assert wrap_phrases(parts, 200) == [" · ".join(parts)]


@pytest.mark.parametrize("width", [80, 200])
def test_title_names_lora_and_its_trainable_count(width):
    """LoRA of rank r on GPT-2's c_attn (Conv1D 768 -> 2304) adds r * (768 + 2304) per layer, 12 layers."""
    r = 16
    expected = 12 * r * (768 + 2304)
    result = estimate(TrainingSetup("gpt2", lora_rank=r, lora_targets="c_attn", seq_len=256))
    assert result.setup.trainable_params == expected
    text = _memory_text(result, width)
    title = _title_lines(text)
    assert all(len(line) <= width for line in title)
    joined = " ".join(title)
    for phrase in ("gpt2", "single on 1× A100-80GB", "batch 1 × seq 256", "bf16-mixed", "adamw",
                   f"LoRA r{r} on c_attn", f"{expected:,} trainable params", "attn sdpa", "engine llmem"):
        assert phrase in joined, (phrase, title)
    if width == 200:
        assert len(title) == 1                 # wrapped to the terminal, not at ~58 columns
    else:
        assert len(title) >= 2 and max(len(line) for line in title) > 58
    record = result.to_dict()["setup"]
    assert record["adapter"] == "LoRA" and record["adapter_rank"] == r and record["adapter_targets"] == ["c_attn"]
    assert record["trainable_params"] == expected and record["layout"] == "single"
    assert record["attn_kernel"] == "sdpa" and record["description"] == result.setup.describe()


def test_title_names_dora_with_its_count_by_hand():
    """DoRA r8 on every linear of tiny-llama's decoder layers: A [r, in], B [out, r] and a magnitude [out] each."""
    h, m, layers, r = TINY_LLAMA["hidden_size"], TINY_LLAMA["intermediate_size"], TINY_LLAMA["num_hidden_layers"], 8
    shapes = [(h, h)] * 4 + [(h, m)] * 2 + [(m, h)]          # q k v o, gate up, down: (in, out)
    expected = layers * sum(r * i + o * r + o for i, o in shapes)
    result = estimate(TrainingSetup("tiny-llama", peft_config=bundled_peft_config("dora-r8-all-linear"), seq_len=128))
    assert result.setup.trainable_params == expected
    joined = " ".join(_title_lines(_memory_text(result, 80)))
    assert "DoRA r8 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in joined
    assert f"{expected:,} trainable params" in joined


def test_title_names_prompt_tuning_qlora_and_the_options():
    h = TINY_LLAMA["hidden_size"]
    prompt = estimate(TrainingSetup("tiny-llama", peft_config=bundled_peft_config("prompt-tuning-20"), seq_len=128))
    joined = " ".join(_title_lines(_memory_text(prompt, 80)))
    assert "prompt tuning (20 virtual tokens)" in joined and f"{20 * h:,} trainable params" in joined

    setup = TrainingSetup("tiny-llama", lora_rank=4, lora_targets="q_proj", quant_base="nf4", grad_ckpt=True,
                          ckpt_every=2, fused_ce=True, offload_activations=True, seq_len=128)
    result = estimate(setup)
    expected = TINY_LLAMA["num_hidden_layers"] * 4 * (h + h)
    joined = " ".join(_title_lines(_memory_text(result, 80)))
    for phrase in ("QLoRA (nf4 base, double quant) r4 on q_proj", f"{expected:,} trainable params",
                   "grad-ckpt every 2 layers", "fused CE", "activations offloaded to CPU"):
        assert phrase in joined, phrase

    full = estimate(TrainingSetup("tiny-llama", offload_optimizer=True, seq_len=128))
    joined = " ".join(_title_lines(_memory_text(full, 80)))
    assert "adamw offloaded to CPU" in joined and "full fine-tuning" in joined
    assert f"{full.setup.total_params:,} trainable params" in joined


# ------------------------------------------------------------------------------------------------ layout labels


def test_paper_engine_layout_is_the_resolved_one():
    setup = TrainingSetup("facebook/opt-1.3b", method="fsdp", gpus=4)
    result = estimate(setup, engine="paper")
    text = _memory_text(result, 120)
    assert "None" not in " ".join(_title_lines(text))
    assert "fsdp on 4× A100-80GB" in text
    out = result.to_dict()["setup"]
    assert out["layout"] == "fsdp (4)" and out["dp"] == 4 and out["tp"] == 1 and out["gpus"] == 4


@pytest.fixture(scope="module")
def traced():
    return trace(TrainingSetup("tiny-llama", method="fsdp", gpus=2, batch_size=1, seq_len=64, optimizer="sgd"),
                 iterations=1)


def test_trace_layout_is_the_resolved_one(traced):
    text = _memory_text(traced, 120)
    assert "None" not in " ".join(_title_lines(text))
    assert "fsdp on 2× A100-80GB" in text and "engine trace" in text
    out = traced.to_dict()["setup"]
    assert out["layout"] == "fsdp (2)" and out["dp"] == 2 and out["tp"] == 1
    assert "None" not in json.dumps(out["description"])


# ------------------------------------------------------------------------------------------------ tables


@pytest.fixture(scope="module")
def planned():
    """Every column the plan table has: accumulation (--global-batch) and Algorithm 1's eval (--ranking paper), the
    longest layout label (fsdp+tp), and a headroom."""
    setup = TrainingSetup("tiny-llama", method="fsdp", gpus=4, seq_len=256, gpu="A100-40GB")
    return plan(setup, PlanOptions(global_batch=64, ranking="paper", headroom=0.05))


def _assert_uncut(text: str, width: int) -> None:
    for mark in CUT:
        assert mark not in text, text
    assert all(len(line) <= width for line in text.splitlines()), text


def test_plan_table_at_80_columns_cuts_nothing(planned):
    text = _render(lambda c: c.print(plan_table(planned)), 80)
    _assert_uncut(text, 80)
    assert "reserved GiB" in text and "used GiB" in text           # the unit once, in the header
    lines = text.splitlines()
    body = lines[next(i for i, line in enumerate(lines) if line.startswith("───")) + 1:]
    assert "GiB" not in "".join(body)                                # bare numbers in the cells
    labels = [c.layout.label for c in planned.candidates]
    assert "fsdp+tp (2dp x 2tp)" in labels
    flat = re.sub(r"\s+", " ", text)
    for c in planned.candidates:
        assert f"{c.memory.device_used_bytes / GIB:.2f}" in text                # a number on one line
        assert c.layout.label.split(" (")[0] in flat
    # no cell but the layout's wraps, and that one to two lines at most
    assert len([line for line in body if line.strip()]) <= 2 * len(planned.candidates)


def test_plan_table_goes_wide_on_a_wide_terminal(planned):
    wide = _render(lambda c: print_plan(planned, c), 200)
    _assert_uncut(wide, 200)
    assert "reserved on GPU GiB" in wide and "unlimited reserved GiB" in wide and "dp×tp" in wide and "┏" in wide
    narrow = _render(lambda c: print_plan(planned, c), 80)
    assert "peak reserved GiB" not in narrow and "┏" not in narrow
    title = narrow.splitlines()[0]
    assert title.startswith("tiny-llama · 4× A100-40GB · seq 256")


def _validation_rows() -> list[Row]:
    """Estimates as both sides (a truth 1 % off) over the CI rows with the longest labels, and a skipped row."""
    wanted = (lambda s: s.tp, lambda s: s.quant_base == "nf4" and s.grad_ckpt, lambda s: s.quant_base == "int8",
              lambda s: s.fused_ce and s.method != "single", lambda s: s.peft_config and "dora" in s.peft_config,
              lambda s: s.lora_dropout, lambda s: s.optimizer_in_backward, lambda s: s.attn == "eager")
    picks = [next(s for s in CI_MATRIX if w(s)) for w in wanted]
    rnd = random.Random(0)
    rows = []
    for s in picks:
        e = estimate(s)
        truth = replace(e, engine="trace", peak_allocated_bytes=int(e.peak_allocated_bytes * (1 + rnd.uniform(-.01, .01))),
                        peak_reserved_bytes=int(e.peak_reserved_bytes * (1 + rnd.uniform(-.02, .02))))
        rows.append(Row(s, e, truth, 1.5))
    rows.append(Row(picks[0], rows[0].estimate, None, 0.0, skipped="offloaded activations need a CUDA device"))
    return rows


@pytest.fixture(scope="module")
def validation_rows():
    return _validation_rows()


def test_validation_table_at_80_columns_cuts_nothing(validation_rows):
    counters = compared_counters("trace")
    table = validation_table(validation_rows, "trace", "ci", counters, 2.0)
    text = _render(lambda c: c.print(table), 80)
    _assert_uncut(text, 80)
    header = " ".join(text.splitlines()[2:4])
    assert "alloc" in header and "resv" in header and "trace" in header and "err" in header
    unit = "GiB" if "memory in GiB" in header else "MiB"
    assert f"memory in {unit}" in header
    size = GIB if unit == "GiB" else 1024**2
    for r in validation_rows:
        assert f"{r.estimate.peak_reserved_bytes / size:.2f}" in text
    flat = re.sub(r"\s+", " ", text)
    assert "offloaded activations need a CUDA device" in flat                  # the reason, whole
    assert "peft:dora-r8-all-linear" in flat
    wide = _render(lambda c: c.print(validation_table(validation_rows, "trace", "ci", counters, 2.0)), 200)
    _assert_uncut(wide, 200)
    assert "peak_allocated est" in wide


# ------------------------------------------------------------------------------------------------ plots


def _labels(ax) -> list[str]:
    legend = ax.get_legend()
    assert legend is not None
    return [t.get_text() for t in legend.get_texts()]


def test_timeline_plot_has_phase_legend_and_capacity(traced):
    fig = timeline_figure(traced)
    ax = fig.axes[0]
    labels = _labels(ax)
    assert {"forward", "backward"} <= set(labels)
    capacity = traced.gpu_memory_bytes / GIB
    lines = [ln for ln in ax.get_lines() if "capacity" in ln.get_label()]
    assert lines and lines[0].get_ydata()[0] == pytest.approx(capacity)
    assert any("capacity" in t for t in labels)
    title = ax.get_title(loc="left")
    assert "tiny-llama" in title and "fsdp on 2× A100-80GB" in title and "None" not in title
    assert "GiB" in ax.get_ylabel()


def test_plan_plot_monotone_curves_capacity_and_fit_boundary(planned):
    fig = plan_figure(planned, points=12)
    ax = fig.axes[0]
    labels = _labels(ax)
    assert any("capacity" in t for t in labels) and any("fit boundary" in t for t in labels)
    assert any("headroom" in t for t in labels)
    capacity = planned.gpu.memory_bytes / GIB
    assert any("capacity" in ln.get_label() and ln.get_ydata()[0] == pytest.approx(capacity) for ln in ax.get_lines())
    curves = [ln for ln in ax.get_lines() if "max batch" in ln.get_label()]
    assert len(curves) == len(planned.candidates)
    for ln in curves:
        ys = list(ln.get_ydata())
        assert ys == sorted(ys)                     # no jag
    stars = [ln for ln in ax.get_lines() if ln.get_marker() == "*" and len(ln.get_xdata())]
    assert sorted(int(s.get_xdata()[0]) for s in stars) == sorted(c.max_batch_size for c in planned.candidates
                                                                  if c.fits)
    assert "GiB" in ax.get_ylabel() and "tiny-llama" in ax.get_title(loc="left")


def _overlaps(boxes) -> bool:
    boxes = sorted(boxes, key=lambda b: (b.y0, b.x0))
    return any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def test_validation_plot_ticks_do_not_collide(validation_rows):
    fig = validation_figure(validation_rows, compared_counters("trace"), 2.0)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    for ax in fig.axes:
        if not ax.axison:
            continue
        for ticks in (ax.get_xticklabels(), ax.get_yticklabels()):
            boxes = [t.get_window_extent(renderer) for t in ticks if t.get_visible() and t.get_text()]
            assert not _overlaps(boxes), [t.get_text() for t in ticks]
        assert ax.get_legend() is not None
    assert "(GiB)" in fig.axes[0].get_xlabel()


def test_wrapped_titles_keep_their_separator_within_the_width():
    # a line broken before a phrase ends with " ·": at 80 columns the validate title once left a lone "·" line
    from llmem.cli.tables import SEPARATOR, wrap_phrases

    parts = ["estimate vs trace", "matrix ci (67 set-ups)", "error = (estimate - truth) / truth", "limit ±2%"]
    for width in range(20, 120):
        lines = wrap_phrases(parts, width)
        assert SEPARATOR.join(parts) == " ".join(lines).replace(SEPARATOR.rstrip() + " ", SEPARATOR)
        for line in lines:
            assert len(line) <= width or any(len(p) > width - len(SEPARATOR.rstrip()) for p in parts), (width, line)


def test_phase_reserved_is_capped_as_the_steps_reserved_is():
    """At capacity the allocator releases its cache and retries: a phase's uncapped reserved (here 90 GiB on a
    device whose capped step reserves 78 GiB) is shown at the capped figure, marked *; one below it as it is."""
    from rich.console import Console

    from llmem.cli.tables import phases_table
    from llmem.result import MemoryResult, PhaseMemory

    gib = 1 << 30
    result = MemoryResult("llmem", 70 * gib, 90 * gib, 80 * gib, 80 * gib, {}, capped_reserved_bytes=78 * gib,
                          phases=[PhaseMemory("generation", 10 * gib, 12 * gib, {}),
                                  PhaseMemory("training", 70 * gib, 90 * gib, {}, True)])
    console = Console(width=120, record=True)
    console.print(phases_table(result))
    text = console.export_text()
    assert "12.00 GiB" in text and "78.00 GiB*" in text and "90.00 GiB" not in text
