"""The preference objectives at scale: the planner's micro-batch search in the objective's units (KTO: an even
micro-batch, at least 2: KTOTrainer refuses per_device_train_batch_size <= 1 for its KL term, kto_trainer.py, and
llmem lays out half desirable, half undesirable completions), and the CLI's defaults for them."""

from __future__ import annotations

import types

import pytest

from llmem.cli import build_parser
from llmem.cli.options import setup_from_args
from llmem.planner.search import search_candidate
from llmem.planner.timing import accumulation_for
from llmem.setup.layout import Layout
from llmem.setup.objectives import objective_spec
from llmem.setup.training import TrainingSetup

GIB = 1 << 30


class LinearEngine:
    """Device-used = 10 GiB + 1 GiB per sample: the largest fitting batch under a limit is worked out by hand."""
    name, has_quick = "linear", False

    def __init__(self) -> None:
        self.batches: list[int] = []

    def full(self, setup: TrainingSetup, layout=None):
        self.batches.append(setup.batch_size)
        return types.SimpleNamespace(capacity_bytes=0, device_used_bytes=(10 + setup.batch_size) * GIB)

    draft = full


def test_kto_searches_even_micro_batches():
    base = TrainingSetup(model="tiny-llama", objective="kto", batch_size=2, seq_len=128)
    engine = LinearEngine()
    # 10 + b <= 25.5 -> b <= 15; the largest even one is 14
    c = search_candidate(base, Layout("single", 1, 1, 1), engine, int(25.5 * GIB))
    assert c.max_batch_size == 14
    assert engine.batches and all(b % 2 == 0 for b in engine.batches)      # never an odd (refused) micro-batch
    # 10 + b <= 11.5: only b = 1 would fit, which KTO refuses: nothing fits
    assert search_candidate(base, Layout("single", 1, 1, 1), LinearEngine(), int(11.5 * GIB)).max_batch_size == 0


def test_sft_still_searches_every_micro_batch():
    c = search_candidate(TrainingSetup(model="tiny-llama", seq_len=128), Layout("single", 1, 1, 1), LinearEngine(),
                         int(25.5 * GIB))
    assert c.max_batch_size == 15


@pytest.mark.parametrize(("global_batch", "max_micro", "dp", "multiple", "expected"), [
    (6, 576, 2, 2, (4, 1)),       # 3 per rank, rounded up to an even 4
    (10, 4, 1, 2, (4, 3)),        # ceil(10 / 4) = 3 steps, ceil(10 / 3) = 4 per step
    (10, 4, 1, 1, (4, 3)),
    (9, 8, 1, 1, (5, 2)),         # ceil(9 / 8) = 2 steps, ceil(9 / 2) = 5 per step
    (9, 8, 1, 2, (6, 2)),         # the same, 5 rounded up to an even 6
])
def test_accumulation_in_the_objectives_units(global_batch, max_micro, dp, multiple, expected):
    assert accumulation_for(global_batch, max_micro, dp, multiple) == expected


def test_cli_defaults_follow_the_objective():
    """`llmem plan tiny-llama --objective kto` answers: the default micro-batch is KTO's smallest (2) and the
    default sequence TRL's max_length (1024; llmem's own default 2048 is longer than TRL truncates to)."""
    args = build_parser().parse_args(["estimate", "tiny-llama", "--objective", "kto"])
    s = setup_from_args(args)
    assert (s.batch_size, s.seq_len) == (objective_spec("kto").batch_multiple, 1024) == (2, 1024)
    s = setup_from_args(build_parser().parse_args(["estimate", "tiny-llama", "--objective", "kto", "--seq-len",
                                                   "256", "--batch-size", "4"]))
    assert (s.batch_size, s.seq_len) == (4, 256)
    s = setup_from_args(build_parser().parse_args(["estimate", "tiny-llama"]))
    assert (s.batch_size, s.seq_len) == (1, 2048)
