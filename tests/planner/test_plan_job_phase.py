"""A plan whose steps fit but whose job does not: the eval phase's tensors alone pass what the allocator may use on
every layout (tiny-llama, loss-only eval at 64 samples per GPU; the bytes worked out by hand in
tests/estimator/test_eval_phase.py). No layout is recommended, each is shown as blocked by the eval, and the one
suggestion is the eval's own remedy, not the step-side what-ifs."""

from __future__ import annotations

from eval_bytes import SEQ, loss_only_eval_bytes

from llmem.planner.plan import plan
from llmem.setup.training import TrainingSetup

CONTEXT = 1 << 30


def planned(extra_bytes: int):
    memory = f"{CONTEXT + loss_only_eval_bytes(64) + extra_bytes}B"
    return plan(TrainingSetup(model="tiny-llama", seq_len=SEQ, eval_batch_size=64, gpus=1, gpu="A100-80GB",
                              gpu_memory=memory, cuda_context="1GiB"))


def test_plan_blocked_by_the_eval_names_it_and_its_remedy():
    p = planned(-(1 << 20))
    (c,) = p.candidates
    assert c.max_batch_size >= 1 and not c.fits and c.blocked_by == "eval"
    assert c.memory.job_over.device_bytes == loss_only_eval_bytes(64)
    assert p.recommended is None and "eval phase" in p.reason
    (s,) = p.suggestions
    assert s["kind"] == "job-phase" and "--eval-accumulation-steps" in s["text"] and not s["fits"]
    out = p.to_dict()
    assert out["methods"][0]["blocked_by"]["name"] == "eval"


def test_plan_with_room_for_the_eval_recommends_the_layout():
    p = planned(1 << 20)
    (c,) = p.candidates
    assert c.fits and c.blocked_by == "" and p.recommended is c and p.suggestions == []
    assert "blocked_by" not in p.to_dict()["methods"][0]
