"""phase_tensor_peak (llmem.runtime.replay): the running sum the traced eval reads its peak from must give
replay_ledger's phase peak of tensor bytes, on a traced ledger and on the event stream's odd cases."""

from __future__ import annotations

import pytest

from llmem.runtime.ledger import PHASE_CODES, Ledger
from llmem.runtime.replay import phase_tensor_peak, replay_ledger
from llmem.runtime.trace import trace_with_details
from llmem.setup.training import TrainingSetup


def _events(*events) -> Ledger:
    ledger = Ledger(workspace_bytes=0, round_to=1)
    ledger.events = [(a, key, size, PHASE_CODES[phase], 0, 0, 0) for a, key, size, phase in events]
    return ledger


def test_it_gives_every_phase_peak_of_a_traced_step():
    _, details = trace_with_details(TrainingSetup(model="tiny-llama", seq_len=128))
    peaks = replay_ledger(details.ledger)["phase_peaks"]
    assert {p: phase_tensor_peak(details.ledger, p) for p in peaks} == {p: v["tensor_bytes"]
                                                                         for p, v in peaks.items()}


def test_it_follows_the_replay_on_odd_events():
    ledger = _events((True, 1, 4096, "forward"),
                     (False, 9, 1024, "forward"),      # a free of a key never allocated: skipped
                     (True, 2, 0, "eval"),             # the phase's first allocation sets its peak, 0 bytes or not
                     (False, 1, 4096, "eval"),
                     (False, 1, 4096, "eval"),         # freed twice: the second skipped
                     (True, 3, 1024, "eval"),
                     (True, 3, 512, "eval"),           # a live key allocated again: both count, one free
                     (False, 3, 512, "eval"),
                     (True, 4, 8192, "backward"))
    peaks = replay_ledger(ledger)["phase_peaks"]
    for phase in ("forward", "eval", "backward"):
        assert phase_tensor_peak(ledger, phase) == peaks[phase]["tensor_bytes"]
    assert phase_tensor_peak(ledger, "eval") == 4096
    with pytest.raises(KeyError):
        phase_tensor_peak(ledger, "optimizer_step")
    with pytest.raises(KeyError):
        replay_ledger(ledger)["phase_peaks"]["optimizer_step"]
