"""`llmem trace` under ds-zero1/2/3 runs DeepSpeed's own engine (llmem.runtime.deepspeed): the bytes a DeepSpeed
step must show, worked out by hand from tiny-llama's parameter counts (4 layers, hidden 512, MLP 1376, vocab 32000;
independent of the estimator), on rank 0 of 2 GPUs, bf16-mixed, AdamW, seq 256, DeepSpeed's default ZeRO block
(reduce_bucket_size 5e8 elements, overlap_comm off for stages 1-2, on for stage 3).

Slow: importing DeepSpeed costs ~8 s (its Muon module compiles with torch.compile at import), each traced step 2-4 s.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import pytest

from llmem.errors import LlmemError
from llmem.setup.training import TrainingSetup

# deepspeed is imported by the runs, not at collection (seconds the default suite, which deselects these, never pays)
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")]

BLOCK = 512                       # every allocation is rounded to the caching allocator's 512 B
DP = 2
BUCKET = 500_000_000              # DeepSpeedZeroConfig.reduce_bucket_size's default, in elements
H, I, L, V = 512, 1376, 4, 32000  # tiny-llama  # noqa: E741 (the intermediate size, as in the configs)
# model.parameters() order: embed, per layer q k v o gate up down + two norms, final norm, lm_head
LAYER = [H * H] * 4 + [H * I] * 3 + [H, H]
NUMELS = [V * H] + LAYER * L + [H, V * H]
P = sum(NUMELS)                   # 45,421,056
ROTARY = 2 * BLOCK                # LlamaRotaryEmbedding's inv_freq and original_inv_freq: 32 fp32 each, one block
IDS = 256 * 8                     # the batch's input ids (int64)


def blocks(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


@functools.cache
def traced(stage: int, **kw):
    from llmem.runtime.trace import trace_with_details

    setup = TrainingSetup(model="tiny-llama", method=f"ds-zero{stage}", gpus=DP, batch_size=1, seq_len=256,
                          precision="bf16-mixed", **kw)
    return trace_with_details(setup)


def events(details, phase: str | None = None, it: int | None = None, category: str | None = None):
    """(is_alloc, size, category, phase, iteration) of the ledger's events."""
    from llmem.runtime.ledger import PHASE_CODES

    led = details.ledger
    for is_alloc, key, size, ph, iteration, _mod, _s in led.events:
        cat = led.cat.get(key, "activations")
        if (phase is None or ph == PHASE_CODES[phase]) and (it is None or iteration == it) \
                and (category is None or cat == category):
            yield is_alloc, size, cat


def test_tiny_llama_count():
    assert P == 45_421_056


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_setup_is_the_bf16_flat_buffer_and_the_fp32_partition(stage):
    """Stages 1-2 (stage_1_and_2.py): the engine casts the model to bf16, ZeRO flattens the trained parameters into
    one bf16 buffer padded to a multiple of 2 x dp elements (the parameters become views of it), and keeps this
    rank's fp32 master partition: 2 P + 4 P / dp bytes, nothing else but the rotary buffers and the inputs."""
    result, details = traced(stage)
    aligned = math.ceil(P / (2 * DP)) * 2 * DP
    setup = details.phase_peaks["setup"]
    assert setup["components"]["weights"] == blocks(2 * aligned) + blocks(4 * aligned // DP) + ROTARY
    assert setup["tensor_bytes"] == blocks(2 * aligned) + blocks(4 * aligned // DP) + ROTARY + IDS
    assert result.engine == "trace" and "DeepSpeed" in result.notes[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_adam_states_are_over_the_fp32_partition(stage):
    """AdamW's exp_avg and exp_avg_sq over this rank's flat fp32 partition, made at the first step: 8 P / dp,
    live through the second iteration."""
    _, details = traced(stage)
    assert details.phase_peaks["forward"]["components"]["optimizer_states"] == 2 * blocks(4 * P // DP)
    step0 = [size for a, size, _ in events(details, "optimizer_step", 0, "optimizer_states") if a]
    assert sorted(step0)[-2:] == [blocks(4 * P // DP)] * 2


@pytest.mark.parametrize("stage", [1, 2])
def test_ipg_buffer_is_reduce_bucket_size_elements_in_each_backward(stage):
    """contiguous_gradients: setup_buckets allocates one IPG buffer of reduce_bucket_size bf16 elements when the
    backward's first gradient arrives (setup_buckets), whatever the model's size, and frees it at the end of backward;
    overlap_comm off: one buffer."""
    _, details = traced(stage)
    for it in (0, 1):
        comm = [(a, size) for a, size, _ in events(details, "backward", it, "communication_buffers")]
        assert comm.count((True, 2 * BUCKET)) == 1
        assert comm.count((False, 2 * BUCKET)) == 1


def test_overlap_comm_doubles_the_ipg_buffer():
    _, details = traced(2, overlap_comm=True)
    comm = [size for a, size, _ in events(details, "backward", 1, "communication_buffers") if a]
    assert comm.count(2 * BUCKET) == 2


def test_zero1_holds_the_full_bf16_gradients_until_backward_ends():
    """Stage 1 reduces after backward (engine.backward -> reduce_gradients): autograd's bf16 gradients of every
    parameter (2 P) live together with the IPG buffer."""
    _, details = traced(1)
    backward = details.phase_peaks["backward"]["components"]
    assert backward["gradients"] == sum(blocks(2 * n) for n in NUMELS)
    assert backward["communication_buffers"] == 2 * BUCKET


def test_zero2_reduces_the_bucket_through_a_flat_copy_and_keeps_the_partition_grads():
    """Stage 2 copies each gradient into the IPG buffer as it arrives (no full gradients); the reduction flattens the
    bucket (2 P bytes: the whole model fits in one bucket) and copies this rank's part into grads_in_partition,
    bf16 of every parameter that overlaps rank 0's half of the flat buffer, in full."""
    _, details = traced(2)
    backward = details.phase_peaks["backward"]["components"]
    assert backward["communication_buffers"] == 2 * BUCKET + blocks(2 * P)
    assert "gradients" not in backward or backward["gradients"] == 0
    overlapping, start = 0, 0
    for n in NUMELS:
        if start < P // DP:
            overlapping += n
        start += n
    grads = [size for a, size, _ in events(details, "backward", 1, "gradients") if a]
    assert blocks(2 * overlapping) in grads


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_step_makes_the_fp32_gradient_partition(stage):
    """The step (stage_1_and_2.py step): the partition's bf16 gradients flattened, then converted to an fp32
    gradient of the fp32 partition (4 P / dp), stepped, dropped."""
    _, details = traced(stage)
    step = [(a, size) for a, size, _ in events(details, "optimizer_step", 1, "gradients")]
    assert (True, blocks(4 * P // DP)) in step and (False, blocks(4 * P // DP)) in step


def test_zero3_setup_is_the_partitions_the_grad_buffer_and_the_ipg_buffer():
    """Stage 3 (stage3.py): every parameter split in dp partitions of ceil(numel / dp) elements, this rank's bf16
    partitions in one flat buffer, its fp32 master partition, a bf16 gradient partition buffer, the IPG bucket of
    reduce_bucket_size elements (allocated at init) and the 1-element inf_or_nan_tracker (bool)."""
    _, details = traced(3)
    part = sum(math.ceil(n / DP) for n in NUMELS)
    setup = details.phase_peaks["setup"]["components"]
    assert setup["weights"] == blocks(2 * part) + blocks(4 * part) + ROTARY + BLOCK
    assert setup["gradients"] == blocks(2 * part)
    assert setup["communication_buffers"] == 2 * BUCKET


def test_zero3_second_forward_fetches_the_model_in_one_coalesced_all_gather():
    """Once the first iteration has recorded the module order, ZeRO-3 prefetches (stage3_prefetch_bucket_size 5e7 >
    P): the non-persistent parameters (numel > stage3_param_persistence_threshold 1e5: all but the norms, which stay
    gathered after their first use) come in one flat all-gather buffer of dp x their partitions, from which each
    parameter is copied whole (torch.cat of its pieces: partition_parameters.py AllGatherCoalescedHandle.wait)."""
    _, details = traced(3)
    fetched = [n for n in NUMELS if n > 100_000]
    gathered = [size for a, size, _ in events(details, "forward", 1, "gathered_weights") if a]
    assert gathered[0] == blocks(2 * DP * sum(math.ceil(n / DP) for n in fetched))
    assert sorted(gathered[1:]) == sorted(blocks(2 * n) for n in fetched)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_both_iterations_run_and_checkpointing_only_cuts_activations(stage):
    _, details = traced(stage)
    _, ckpt = traced(stage, grad_ckpt=True)
    for d in (details, ckpt):
        for phase in ("forward", "backward", "optimizer_step"):
            assert any(True for _ in events(d, phase, 1))
    plain, cut = details.phase_peaks["forward"]["components"], ckpt.phase_peaks["forward"]["components"]
    assert cut["activations"] < plain["activations"]
    assert cut["weights"] == plain["weights"] and cut["optimizer_states"] == plain["optimizer_states"]


@pytest.mark.parametrize("stage", [2, 3])
def test_fake_tensors_allocate_as_real_cpu_tensors(small_llama, stage):
    """The fake run's patches (scalar reads of 0, no rank checks) change no allocation: the same step on real CPU
    tensors (CPU kernels on both sides) has the same peaks in every phase."""
    from llmem.runtime.deepspeed import deepspeed_step

    setup = TrainingSetup(model=small_llama, method=f"ds-zero{stage}", gpus=DP, batch_size=1, seq_len=64,
                          precision="bf16-mixed", reduce_bucket_size=200_000)
    fake, fake_d = deepspeed_step(setup, cuda_kernels=False)
    real, real_d = deepspeed_step(setup, fake=False)
    assert fake.peak_allocated_bytes == real.peak_allocated_bytes
    assert {p: v["tensor_bytes"] for p, v in fake_d.phase_peaks.items()} == \
        {p: v["tensor_bytes"] for p, v in real_d.phase_peaks.items()}


def test_offload_is_refused():
    from llmem.runtime.trace import trace

    setup = TrainingSetup(model="tiny-llama", method="ds-zero2", gpus=DP, offload_optimizer=True)
    with pytest.raises(LlmemError, match="offload"):
        trace(setup)
