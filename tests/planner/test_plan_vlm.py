"""`llmem plan` of a vision-language set-up: its layouts searched on one GPU, DDP and FSDP2 (the vision side learned
at each micro-batch), those the step does not wire skipped with the reason, and the what-ifs it does not model told,
not searched."""

from __future__ import annotations

import pytest

from llmem.cli import main
from llmem.memory.activations.learned import LEARN_ENV
from llmem.model.anatomy import load_anatomy
from llmem.planner.options import PlanOptions
from llmem.planner.plan import plan
from llmem.setup.training import TrainingSetup
from llmem.units import parse_bytes

VL = dict(model="tiny-qwen2_5_vl", gpus=2, precision="bf16-mixed", seq_len=64, images_per_sample=1,
          image_size="448x448")


@pytest.fixture(autouse=True)
def _learning(monkeypatch):
    """The vision side is learned from the trace (llmem.learn); the suite turns learning off by default."""
    monkeypatch.setenv(LEARN_ENV, "auto")


def test_a_plan_that_only_fsdp2_fits():
    """On 1,300 MiB GPUs (about 600 MiB past the CUDA context), DDP's whole fp32 model states (16 bytes a parameter:
    weights, gradients, Adam's two states, 29.1 M parameters = 466 MB, and the reducer's 4-byte bucket copy) with
    the activations do not fit at batch 1; FSDP2 halves the states over 2 ranks and fits."""
    p = plan(TrainingSetup(**VL, gpu_memory=parse_bytes("1300MiB")), PlanOptions(batch_cap=4, layouts="dp-tp"))
    by = {c.layout.method: c for c in p.candidates}
    total = load_anatomy("tiny-qwen2_5_vl").total_params
    assert by["ddp"].max_batch_size == 0 and by["ddp"].memory.components["weights"] == 4 * total
    assert by["fsdp"].fits and abs(by["fsdp"].memory.components["weights"] - 2 * total) <= 256
    assert p.recommended is not None and p.recommended.layout.shards_model_states
    assert any("tp (2) skipped" in n and "--method tp is not wired" in n for n in p.notes)
    assert any("a vision-language step" in n for n in p.notes)


@pytest.mark.slow     # every what-if of a vision-language plan, learned: 20-25 s on 2 cores
def test_the_what_ifs_it_does_not_model_are_told():
    # nothing fits at 1,000 MiB: the what-ifs run, and those a vision-language step does not wire are told apart
    p = plan(TrainingSetup(**VL, gpu_memory=parse_bytes("1000MiB")), PlanOptions(batch_cap=2, layouts="dp-tp"))
    told = {s["kind"]: s["text"] for s in p.suggestions if s.get("modelled") is False}
    assert {"fused_ce", "offload_activations", "offload_optimizer", "offload_param", "qlora"} <= set(told)
    assert "not modelled for a vision-language model (--fused-ce is not wired for it yet" in told["fused_ce"]
    searched = {s["kind"] for s in p.suggestions if s.get("modelled") is not False}
    assert "lora" in searched and not searched & set(told)


def test_a_plan_every_layout_refuses_says_why_in_one_line(capsys):
    args = ["plan", "tiny-qwen2_5_vl", "--gpus", "2", "--images-per-sample", "1", "--image-size", "448x448",
            "--seq-len", "64", "--packing"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--packing is not wired" in err, err


def test_the_batch_search_of_a_vision_step_stops_at_64_images():
    """The vision side is learned at each micro-batch searched, and that run's host memory grows faster than its
    images (a tiny VLM's plan searching to the 4,096 cap was killed at 24 GB): the search stops at 64 images a GPU,
    said in a note, unless --max-batch is given; a text model keeps the cap."""
    from llmem.planner.plan import VISION_BATCH_IMAGES, vision_batch_cap
    from llmem.search import BATCH_CAP

    vlm = load_anatomy("tiny-qwen2_5_vl")
    two = TrainingSetup("tiny-qwen2_5_vl", images_per_sample=2, image_size="448x448", seq_len=64)
    options, note = vision_batch_cap(two, vlm, PlanOptions())
    assert VISION_BATCH_IMAGES == 64 and options.batch_cap == 32 and "stops at 32 sample(s)" in note
    assert vision_batch_cap(two, vlm, PlanOptions(batch_cap=8)) == (PlanOptions(batch_cap=8), None)
    text = TrainingSetup("tiny-llama", seq_len=64)
    assert vision_batch_cap(text, load_anatomy("tiny-llama"), PlanOptions())[0].batch_cap == BATCH_CAP
