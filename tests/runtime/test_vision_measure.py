"""The vision-language step measured for real (llmem measure on the CPU: real tensors, the ledger counting each
storage) against its trace on fake tensors with the CPU's kernels: the same step, two independent paths (the trace
answers the model's index values from the real grid; measure runs them)."""

from __future__ import annotations

import pytest

from llmem.runtime.measure import measure
from llmem.runtime.trace import trace
from llmem.setup.training import TrainingSetup


@pytest.mark.parametrize("fields", [{}, {"freeze_language_model": True}, {"lora_rank": 8, "grad_ckpt": True}])
def test_measure_and_trace_agree(fields):
    setup = TrainingSetup("tiny-qwen2_5_vl", images_per_sample=1, image_size="224x224", batch_size=2, seq_len=32,
                          **fields)
    real, fake = measure(setup, device="cpu"), trace(setup, cuda_kernels=False)
    # the trace keeps the index tensors it computes from the grid real, uncounted: the windows' order and its
    # inverse (int64 per 4 patches), the segments' bounds; under 16 bytes a patch (2 x 256 patches here)
    assert 0 <= real.peak_allocated_bytes - fake.peak_allocated_bytes <= 16 * 2 * 256
    assert real.peak_reserved_bytes == fake.peak_reserved_bytes
