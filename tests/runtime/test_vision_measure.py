"""The vision-language step measured for real (llmem measure on the CPU: real tensors, the ledger counting each
storage) against its trace on fake tensors with the CPU's kernels: the same step, two independent paths (the trace
answers the model's index values from the real grid; measure runs them)."""

from __future__ import annotations

import pytest

from llmem.runtime.measure import measure
from llmem.runtime.trace import trace
from llmem.setup.training import TrainingSetup

FP32 = {"precision": "fp32"}   # the CPU's bf16 kernels are slow (Conv3d's backward 2 s a call, fp32's 0.2 s)


def _first_then_slow(first: dict, *rest: dict) -> list:
    """One variant per model in every run (a real CPU step of a tiny VLM takes 10-50 s here under bf16 autocast,
    a quarter of that in fp32); the rest, bf16-mixed among them, under `-m slow` (make test-slow)."""
    return [first, *(pytest.param(fields, marks=pytest.mark.slow) for fields in rest)]


@pytest.mark.parametrize("fields", _first_then_slow({"lora_rank": 8, "grad_ckpt": True, **FP32},
                                                    {"lora_rank": 8, "grad_ckpt": True}, {},
                                                    {"freeze_language_model": True}))
def test_measure_and_trace_agree(fields):
    setup = TrainingSetup("tiny-qwen2_5_vl", images_per_sample=1, image_size="224x224", batch_size=2, seq_len=32,
                          **fields)
    real, fake = measure(setup, device="cpu"), trace(setup, cuda_kernels=False)
    # the trace keeps the index tensors it computes from the grid real, uncounted: the windows' order and its
    # inverse (int64 per 4 patches), the segments' bounds; under 16 bytes a patch (2 x 256 patches here)
    assert 0 <= real.peak_allocated_bytes - fake.peak_allocated_bytes <= 16 * 2 * 256
    assert real.peak_reserved_bytes == fake.peak_reserved_bytes


# under slow: Gemma 3's CPU bf16 step is the slowest left (14 s on 2 cores, no faster in fp32); its estimate against
# the trace is in the CI matrix's sample and tests/estimator/test_vlm_fsdp.py
@pytest.mark.slow
@pytest.mark.parametrize("fields", [{}, {"lora_rank": 8, "grad_ckpt": True}])
def test_gemma3_measure_and_trace_agree(fields):
    """Gemma 3 (tiny): the real CPU step with the processor's token_type_ids (the image tokens' bidirectional mask)
    against the trace. The real step on the CPU never copies the collated ids to the device (`.to("cpu")` returns
    them), where the trace allocates them as on a GPU: the trace is higher by at most those two [2, 48] int64 in
    512-byte blocks; its reserved within one 2 MiB segment (the fake tensors' SigLIP backward makes a few
    [2, 256, 128] transients the CPU kernels do not)."""
    setup = TrainingSetup("tiny-gemma3", images_per_sample=1, image_size="224x224", batch_size=2, seq_len=32,
                          **fields)
    real, fake = measure(setup, device="cpu"), trace(setup, cuda_kernels=False)
    assert 0 <= fake.peak_allocated_bytes - real.peak_allocated_bytes <= 2 * 1024
    assert abs(real.peak_reserved_bytes - fake.peak_reserved_bytes) <= 2 * 1024 ** 2


@pytest.mark.parametrize("fields", _first_then_slow({"lora_rank": 8, "grad_ckpt": True, **FP32},
                                                    {"lora_rank": 8, "grad_ckpt": True}, {},
                                                    {"freeze_language_model": True}))
def test_qwen3_vl_measure_and_trace_agree(fields):
    """Qwen3-VL (tiny): the real CPU step (its position table's resampling taps, the deepstack features indexed into
    the first layers' hidden states) against the trace, which answers the image mask's true count and makes the
    resampling taps and weights on the device. The trace keeps the rotary positions and the segments' bounds it
    computes from the grid real, uncounted: under 16 bytes a patch (2 x 256 patches here: 224x224 is resized to
    256x256, 16 x 16 patches of 16 px)."""
    setup = TrainingSetup("tiny-qwen3_vl", images_per_sample=1, image_size="224x224", batch_size=2, seq_len=32,
                          **fields)
    real, fake = measure(setup, device="cpu"), trace(setup, cuda_kernels=False)
    assert 0 <= real.peak_allocated_bytes - fake.peak_allocated_bytes <= 16 * 2 * 256
    assert abs(real.peak_reserved_bytes - fake.peak_reserved_bytes) <= 2 * 1024 ** 2


@pytest.mark.parametrize("fields", _first_then_slow({"images_per_sample": 2, **FP32}, {"images_per_sample": 2}, {},
                                                    {"freeze_language_model": True},
                                                    {"lora_rank": 8, "grad_ckpt": True}))
def test_llava_onevision_measure_and_trace_agree(fields):
    """LLaVA-OneVision (tiny): the real CPU step (its anyres crops cut, unpadded and joined with newline features by
    the model from the real image_sizes and batch_num_images) against the trace, which keeps those two inputs real
    on the host. The real step moves them to its device as the trainer does ([2, 2] and [2] int64: two 512-byte
    blocks the trace does not count); its reserved within one 2 MiB segment."""
    setup = TrainingSetup("tiny-llava_onevision", **{"images_per_sample": 1, "image_size": "768x1152",
                                                     "batch_size": 2, "seq_len": 32, **fields})
    real, fake = measure(setup, device="cpu"), trace(setup, cuda_kernels=False)
    assert 0 <= real.peak_allocated_bytes - fake.peak_allocated_bytes <= 2 * 512
    assert abs(real.peak_reserved_bytes - fake.peak_reserved_bytes) <= 2 * 1024 ** 2


@pytest.mark.parametrize("fields", _first_then_slow({"freeze_vision_tower": True, "grad_ckpt": True, **FP32},
                                                    {"freeze_vision_tower": True, "grad_ckpt": True},
                                                    {"images_per_sample": 2}))
def test_idefics3_measure_and_trace_agree(fields):
    """Idefics3 (tiny): the real CPU step (the model drops padding frames by a real bool mask and splits the features
    by the real per-sample counts it reads) against the trace, which answers them as every frame real
    (llmem.runtime.vision._RealFrames). The real step on the CPU never copies the collated batch to the device
    (`.to("cpu")` returns it) where the trace allocates it as on a GPU: the trace is higher by at most the
    pixel_attention_mask, [2, frames, 128, 128] int64 (13 frames an image at 256x384). The reserved peaks are within
    one small-pool segment (2 MiB): the live tensors at the second step's start are the same (frozen tower under
    checkpointing: 195 tensors, 153,214,976 B), but the trace's batch on the device places the blocks otherwise; once
    the trace's ModTracker leak was fixed, the real step opens a 2 MiB segment for a 704,512 B optimizer temporary in
    its second step that the trace's fits in a freed block (396,361,728 / 394,264,576 B; both 396,361,728 B with the
    leak)."""
    setup = TrainingSetup("tiny-idefics3", **{"images_per_sample": 1, **fields}, image_size="256x384", batch_size=2,
                          seq_len=64)
    real, fake = measure(setup, device="cpu"), trace(setup, cuda_kernels=False)
    mask_bytes = 2 * setup.images_per_sample * 13 * 128 * 128 * 8
    assert 0 < fake.peak_allocated_bytes - real.peak_allocated_bytes <= mask_bytes
    assert abs(real.peak_reserved_bytes - fake.peak_reserved_bytes) <= 2 * 1024 ** 2


@pytest.mark.parametrize("fields", _first_then_slow({"freeze_vision_tower": True}, {},
                                                    {"lora_rank": 8, "grad_ckpt": True}, {"images_per_sample": 2}))
def test_mllama_measure_and_trace_agree(fields):
    """Llama 3.2 Vision (tiny): the real CPU step (its tiles through the local and global encoders, the projected
    states read by the cross-attention layers under the processor's cross_attention_mask, labels with the <|image|>
    token ignored) against the trace, which hands the tile and mask inputs over as fake tensors. The real step on the
    CPU never copies the collated ids and labels to the device, where the trace allocates them as on a GPU: the
    trace is higher by at most those [2, 33] int64 (two 1 KiB blocks); its reserved within one 2 MiB segment."""
    setup = TrainingSetup("tiny-mllama", **{"images_per_sample": 1, "image_size": "560x840", "batch_size": 2,
                                            "seq_len": 32, **fields})
    real, fake = measure(setup, device="cpu"), trace(setup, cuda_kernels=False)
    assert 0 <= fake.peak_allocated_bytes - real.peak_allocated_bytes <= 2 * 1024
    assert abs(real.peak_reserved_bytes - fake.peak_reserved_bytes) <= 2 * 1024 ** 2


@pytest.mark.parametrize("fields", _first_then_slow({"lora_rank": 8, **FP32}, {"lora_rank": 8}, {},
                                                    {"freeze_vision_tower": True, "grad_ckpt": True},
                                                    {"images_per_sample": 2, "image_size": "300x500"}))
def test_internvl_measure_and_trace_agree(fields):
    """InternVL (tiny): the real CPU step (every image's tiles stacked into one pixel_values, the class token dropped
    and the patches pixel-shuffled) against the trace: the model reads nothing on the host, and the two agree to the
    byte on both counters."""
    setup = TrainingSetup("tiny-internvl", **{"images_per_sample": 1, "image_size": "448x448", **fields},
                          batch_size=2, seq_len=64)
    real, fake = measure(setup, device="cpu"), trace(setup, cuda_kernels=False)
    assert (real.peak_allocated_bytes, real.peak_reserved_bytes) == (fake.peak_allocated_bytes,
                                                                     fake.peak_reserved_bytes)


# all under slow: even LoRA's real step takes 30-36 s on 2 cores (bf16 pixels, MoE layers); Llama 4's estimate
# against the trace is in the CI matrix's sample (tests/validate/test_validate.py) and in tests/estimator/test_vlm_fsdp.py
@pytest.mark.slow
@pytest.mark.parametrize("fields", [{"lora_rank": 8}, {}, {"freeze_vision_tower": True, "grad_ckpt": True},
                                    {"images_per_sample": 2, "image_size": "300x500"}])
def test_llama4_measure_and_trace_agree(fields):
    """Llama 4 (tiny): the real CPU step (every image's tiles stacked into one bf16 pixel_values, as the processor
    casts them; the tower's complex rotary, its pixel shuffle and MLP; MoE decoder layers, chunked attention of 128
    over 144 tokens and a full-attention NoPE layer) against the trace on fake tensors."""
    setup = TrainingSetup("tiny-llama4", **{"images_per_sample": 1, "image_size": "224x224", **fields},
                          batch_size=2, seq_len=64)
    real, fake = measure(setup, device="cpu"), trace(setup, cuda_kernels=False)
    assert (real.peak_allocated_bytes, real.peak_reserved_bytes) == (fake.peak_allocated_bytes,
                                                                     fake.peak_reserved_bytes)
