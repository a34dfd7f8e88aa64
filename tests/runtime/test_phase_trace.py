"""`llmem trace` of the job's loading and saving phases (llmem.runtime.loading, saving, ds_saving: the frameworks'
own code on fake tensors) against the estimate's analytic phases (llmem.estimator.job_phases), per phase and on
both counters (device tensor bytes per GPU, host bytes per node), and against bytes worked out by hand from
tiny-llama's config (hidden 512, intermediate 1376, 4 layers, vocab 32000, untied: tests/estimator/test_job_phases.py
derives P = 45,421,056 parameters)."""

from __future__ import annotations

import pytest

from llmem import estimate, trace
from llmem.setup.training import TrainingSetup

H, V = 512, 32000
EMBED = V * H
P = 45_421_056
GPUS = 8
FP32_SHARD = P * 4 // GPUS
SETUPS = [
    {},                                                                      # one GPU: model.to, save_pretrained
    {"method": "ddp", "gpus": 2, "lora_rank": 8, "load_path": "device-map"},  # device map; peft's adapters
    {"method": "fsdp", "gpus": GPUS},                                         # fsdp2_prepare_model; sharded save
    {"method": "fsdp", "gpus": GPUS, "load_path": "meta-init", "save_kind": "full"},   # torchtitan; FULL
    {"method": "ds-zero3", "gpus": GPUS, "save_kind": "gather-16bit"},        # zero.Init; the 16-bit consolidation
    {"method": "ds-zero3", "gpus": GPUS, "lora_rank": 8},                     # the adapters consolidated
    {"method": "ds-zero2", "gpus": GPUS},                                     # ZeRO-2's full save on every rank
    {"model": "tiny-qwen3", "method": "fsdp", "gpus": GPUS, "optimizer": "sgd"},   # tied; a stateless optimizer
    {"model": "tiny-qwen3", "method": "ds-zero3", "gpus": GPUS},              # zero.Init of a tied model
]
LORA = 4 * 2 * (8 * H + H * 8)      # LoRA r=8 on q_proj and v_proj of 4 layers: 65,536 parameters


def by_name(result) -> dict:
    return {p.name: p for p in result.job_phases}


@pytest.fixture(scope="module", params=SETUPS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "single")
def pair(request):
    setup = TrainingSetup(**{"model": "tiny-llama", "seq_len": 64, **request.param})
    return request.param, trace(setup), estimate(setup)


def test_each_traced_phase_agrees_with_the_estimate(pair):
    """Within 0.05 % on both counters: the trace's 512-byte rounding and the rotary inv_freq buffer are all that
    the estimate leaves out."""
    kw, traced, estimated = pair
    phases, expected = by_name(traced), by_name(estimated)
    assert "save" in phases and phases.keys() <= expected.keys()
    for name, p in phases.items():
        e = expected[name]
        assert p.kind == e.kind
        assert abs(e.device_bytes - p.device_bytes) <= 0.0005 * p.device_bytes, (name, e.device_bytes, p.device_bytes)
        assert abs(e.host_bytes - p.host_bytes) <= 0.0005 * max(p.host_bytes, 1) + 512 * GPUS, \
            (name, e.host_bytes, p.host_bytes)


def test_the_traced_bytes_match_the_hand_count(pair):
    """The trace's own numbers against the config, independently of the estimate."""
    kw, traced, _ = pair
    phases = by_name(traced)
    if kw.get("model") == "tiny-qwen3" and kw["method"] == "ds-zero3":
        # zero.Init: its 20,780,032 parameters' 16-bit partitions, the embedding gathered whole, and the lm_head's
        # own partition, made before tie_weights replaced it and not freed by the load (a reference cycle)
        # (the trace rounds each of its 48 partitions up to 512 bytes)
        assert 0 <= phases["load"].device_bytes - (20_780_032 * 2 // GPUS + 16000 * 512 * 2 * (1 + 1 / GPUS)) \
            < 48 * 512
    elif kw.get("model") == "tiny-qwen3":
        # its 20,780,032 parameters' fp32 shards, the tied embedding's twice (one per name), copied to each host
        assert phases["save"].host_bytes == GPUS * (20_780_032 + 16000 * 512) * 4 // GPUS
    elif kw == {}:
        # the fp32 model on the host, then moved whole; save_pretrained's one shard copied to the host
        assert abs(phases["load"].device_bytes - P * 4) < 4096 and abs(phases["load"].host_bytes - P * 4) < 4096
        assert phases["save"].host_bytes == P * 4
    elif kw.get("load_path") == "meta-init":
        # to_empty: this rank's shards only; DCP reads one chunk (1/8 of the 65.5 MB embedding) at a time per rank
        assert abs(phases["load"].device_bytes - FP32_SHARD) < 4096
        assert phases["load"].host_bytes == GPUS * EMBED * 4 // GPUS
        # FULL: rank 0 keeps the whole fp32 optimizer (2 x P x 4) on its host, more than the model; with AdamW's
        # 39 step counters (4-byte scalars)
        assert phases["save"].host_bytes == 2 * P * 4 + 39 * 4
    elif kw.get("method") == "fsdp":
        # accelerate's fsdp2_prepare_model: the embedding held whole by its input_weight local while the tail
        # [norm, lm_head] is moved whole: two 65.5 MB tensors beside this rank's shards
        assert abs(phases["load"].device_bytes - (FP32_SHARD + 2 * EMBED * 4 + H * 4)) < 8192
        assert abs(phases["load"].host_bytes - GPUS * P * 4) < 8192
    elif kw.get("method") == "ds-zero3" and kw.get("lora_rank"):
        # every rank's fp32 flat partition of the adapters in the engine's checkpoint (the frozen base left out,
        # exclude_frozen_parameters) is more than rank 0's consolidated 16-bit adapters (131 kB)
        assert phases["save"].host_bytes == GPUS * (LORA // GPUS * 4) == 262_144
        assert "load" not in phases          # zero.Init under peft is not traced (the notes say so)
    elif kw.get("method") == "ds-zero2":
        # accelerate's get_state_dict on every rank: the replicated 16-bit module copied to each rank's host
        assert phases["save"].host_bytes == GPUS * P * 2
    elif kw.get("method") == "ds-zero3":
        # zero.Init: this rank's 16-bit partitions, one module (the embedding) gathered whole in 16 bits to be
        # copied into; rank 0 holds the 16-bit checkpoint on its host
        assert abs(phases["load"].device_bytes - (P * 2 // GPUS + EMBED * 2)) < 8192
        assert phases["load"].host_bytes == P * 2
        # the checkpoint's fp32 flat partition copied to every rank's host (8 x 22.7 MB) is more than rank 0's
        # consolidated 16-bit model (90.8 MB)
        assert phases["save"].host_bytes == GPUS * FP32_SHARD
    else:
        # peft's adapters only, fp32
        assert phases["save"].host_bytes == LORA * 4


def test_the_notes_say_what_was_traced(pair):
    kw, traced, _ = pair
    notes = [n for n in traced.job_notes if n.startswith(("load", "save"))]
    assert any(n.startswith("save (") and " traced: " in n for n in notes)
    if "load" in by_name(traced):
        assert any(n.startswith("load (") and " traced: " in n for n in notes)
    else:
        assert any(n.startswith("load (") and " is not traced: " in n for n in notes)


def test_a_set_up_outside_the_traced_paths_says_so():
    result = trace(TrainingSetup(model="tiny-llama", seq_len=64, method="fsdp", gpus=2,
                                 load_path="cpu-ram-efficient"))
    assert [p.name for p in result.job_phases] == ["save"]
    assert any(n.startswith("load (cpu-ram-efficient) is not traced: accelerate's fsdp2_prepare_model moves")
               for n in result.job_notes)


@pytest.mark.slow      # three traces, one of ZeRO-3's engine (13 s on 2 cores)
def test_a_trace_after_the_deepspeed_phases_is_unchanged():
    """zero.Init's global state, DeepSpeed's comm and the functions the phases patch are all restored: a trace run
    after ZeRO-3's traced loading and saving gives the numbers it gave before."""
    single = TrainingSetup(model="tiny-llama", seq_len=64)
    before = trace(single)
    trace(TrainingSetup(model="tiny-llama", seq_len=64, method="ds-zero3", gpus=2, save_kind="gather-16bit"))
    after = trace(single)
    assert (after.peak_allocated_bytes, after.peak_reserved_bytes, after.components, after.job_phases) == \
        (before.peak_allocated_bytes, before.peak_reserved_bytes, before.components, before.job_phases)


@pytest.mark.parametrize("kw", [{"method": "fsdp", "gpus": 2},
                                pytest.param({"method": "ds-zero3", "gpus": 2}, marks=pytest.mark.slow)], ids=str)
def test_the_step_is_the_same_without_the_phases(kw):
    """job_phases=False (the validation matrix's) runs no loading or saving code: the same step, no phases."""
    setup = TrainingSetup(model="tiny-llama", seq_len=64, **kw)
    plain, phased = trace(setup, job_phases=False), trace(setup)
    assert not plain.job_phases and {p.name for p in phased.job_phases} == {"load", "save"}
    assert (plain.peak_allocated_bytes, plain.peak_reserved_bytes, plain.components) == \
        (phased.peak_allocated_bytes, phased.peak_reserved_bytes, phased.components)


def test_an_optimizer_without_a_state_dict_leaves_the_save_untraced():
    """llmem's optimizer in backward (per-parameter optimizers in hooks) has no torch state_dict to save."""
    result = trace(TrainingSetup(model="tiny-llama", seq_len=64, optimizer_in_backward=True))
    assert [p.name for p in result.job_phases] == ["load"]
    assert "save (full) is not traced: its optimizer (InBackwardOptimizer, llmem's wrapper) has no torch " \
           "state_dict; the estimate's phase is analytic" in result.job_notes
