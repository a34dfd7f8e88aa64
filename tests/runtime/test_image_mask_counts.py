"""The trace's answer to indexing by the image tokens' mask (Qwen3-VL's deepstack: hidden_states[visual_pos_masks, :]
and its index_put): fake tensors cannot know a mask's true count; the set-up fixes it (the image tokens of each row)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from llmem.runtime.vision import VisionBatch, image_mask_counts


class _Model:
    class config:              # noqa: N801 - a stand-in for the HF config the function reads
        model_type = "qwen3_vl"
        image_token_id = 7


def test_the_masks_count_is_the_rows_image_tokens():
    ids = torch.zeros(3, 10, dtype=torch.int64)
    ids[:, 2:6] = 7                                            # 4 image tokens a row
    batch = VisionBatch(ids, (48, 1536), 48)
    with FakeTensorMode():
        hidden = torch.empty(3, 10, 16)
        mask = torch.empty(3, 10, dtype=torch.bool)
        with image_mask_counts(_Model(), batch):
            picked = hidden[mask, :]
            hidden[mask, :] = picked + 1
        assert picked.shape == (12, 16)                        # 3 rows x 4 image tokens
        other = torch.empty(3, 9, dtype=torch.bool)            # a mask of another shape: the fake mode's refusal
        with image_mask_counts(_Model(), batch), pytest.raises(DynamicOutputShapeException):
            hidden[:, :9][other]
        with image_mask_counts(_Model(), batch), pytest.raises(DataDependentOutputException):
            mask.sum().item()                                  # a host read is not answered
