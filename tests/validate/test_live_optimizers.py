"""The callback names a live torchao or bitsandbytes optimizer by its module and class (torchao's AdamW8bit shares
bitsandbytes' class name) and, for torchao, its `block_size` attribute (torchao 0.18's _AdamBase keeps it)."""

from __future__ import annotations

import pytest

from llmem.errors import LlmemError
from llmem.validate.live import _optimizer_name


def _live(module: str, cls: str, **attrs):
    return type(cls, (), {"__module__": module, **attrs})()


@pytest.mark.parametrize("module, cls, attrs, row", [
    ("torchao.optim.adam", "AdamW8bit", {"block_size": 256}, "torchao-adamw-8bit"),
    ("torchao.optim.adam", "AdamW4bit", {"block_size": 128}, "torchao-adamw-4bit"),
    ("torchao.optim.adam", "AdamW4bit", {"block_size": 256}, "torchao-adamw-4bit-b256"),   # transformers' choice
    ("torchao.optim.adam", "AdamWFp8", {"block_size": 256}, "torchao-adamw-fp8"),
    ("bitsandbytes.optim.adamw", "AdamW8bit", {}, "adamw-8bit"),
    ("bitsandbytes.optim.adamw", "PagedAdamW", {}, "paged-adamw-32bit"),
    ("bitsandbytes.optim.adamw", "PagedAdamW32bit", {}, "paged-adamw-32bit"),
])
def test_live_optimizer_rows(module, cls, attrs, row):
    assert _optimizer_name(_live(module, cls, **attrs), on_cuda=True) == row


def test_torchao_block_size_without_a_row_is_refused():
    with pytest.raises(LlmemError, match="torchao.optim.adam.AdamW8bit is not one llmem models"):
        _optimizer_name(_live("torchao.optim.adam", "AdamW8bit", block_size=64), on_cuda=True)
