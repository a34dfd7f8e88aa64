"""`llmem plan`'s progress: told by the plan as each layout and what-if is searched, drawn on stderr once the plan has run
past a second, never on stdout."""

from __future__ import annotations

from llmem.cli.progress import LazyProgress
from llmem.planner.options import PlanOptions
from llmem.planner.plan import plan
from llmem.setup.training import TrainingSetup


def test_plan_tells_each_layout_and_what_if_then_done():
    """tiny-llama on 2 GPUs of 64 KiB: nothing fits, so the layouts' searches and then the what-ifs are told, each
    step within its total, ending at done."""
    told: list[tuple[str, int, int]] = []
    p = plan(TrainingSetup(model="tiny-llama", gpus=2, seq_len=64, gpu_memory="64MiB"),
             PlanOptions(layouts="dp-tp"), progress=lambda *a: told.append(a))
    assert p.recommended is None
    what = [t[0] for t in told]
    assert any(w.startswith(("searching ", "searched ")) for w in what)
    assert any(w.startswith("what would fit: ") for w in what)
    assert told[-1][0] == "done" and told[-1][1] == told[-1][2]
    assert all(0 <= done <= total for _, done, total in told)


def test_bar_draws_on_stderr_only(capsys):
    bar = LazyProgress(enabled=True, delay_s=0.0)
    bar("searching fsdp (2)", 0, 3)
    assert bar.bar is not None and bar.bar.console.stderr
    bar("done", 3, 3)
    bar.close()
    assert capsys.readouterr().out == ""


def test_no_bar_before_the_delay_nor_when_disabled():
    quick = LazyProgress(enabled=True, delay_s=60.0)
    quick("searching fsdp (2)", 0, 3)
    assert quick.bar is None
    off = LazyProgress(enabled=False, delay_s=0.0)      # --json
    off("searching fsdp (2)", 0, 3)
    assert off.bar is None
