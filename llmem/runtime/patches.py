"""Patches the step needs and their restoration: each is a context manager that puts back what it replaced.

- `patched`: set an attribute for the duration of a block.
- `quiet`: the deprecation / FSDP / config warnings the step triggers.
- `hf_untraced_masks`: transformers' mask shortcuts, which it skips for fake tensors (it takes them for tracing).
- `fake_scalar_reads`: `.item()` of a fake tensor (Adafactor's host scalars) reads 1.0 while the optimizer steps.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from llmem.runtime.cuda import is_fake_tensor


@contextlib.contextmanager
def patched(obj, name: str, value) -> Iterator[None]:
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the deprecation / FSDP / config warnings the step triggers (restored on exit)."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.get_logger()   # configures the library's root logger now, not lazily inside the block
    loggers = [logging.getLogger(name) for name in ("transformers", "torch.distributed")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)


@contextlib.contextmanager
def hf_untraced_masks(packed: bool = False) -> Iterator[None]:
    """transformers treats FakeTensors as "tracing" and then keeps data-dependent masks it would drop in a real run:
    with position ids of one sequence per row `find_packed_sequence_indices` returns None for real tensors, so the
    causal mask is skipped and SDPA runs with is_causal=True. Do the same ops and give the same answer for fake
    tensors. packed=True (--packing: position ids restart inside rows) returns the packed-sequence index, as the
    real run does, so the model builds its block-diagonal causal mask."""
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover
        yield
        return
    orig = getattr(masking_utils, "find_packed_sequence_indices", None)
    if orig is None:
        yield
        return

    def find_packed_sequence_indices(position_ids):
        if not is_fake_tensor(position_ids):
            return orig(position_ids)
        first = position_ids[:, :1] - 1
        diff = torch.diff(position_ids, prepend=first, dim=-1)
        mask = (diff != 1).cumsum(-1)
        (mask[:, -1] == 0).all()     # the check the real run evaluates (True here unless packed)
        return mask if packed else None

    with patched(masking_utils, "find_packed_sequence_indices", find_packed_sequence_indices):
        yield


@contextlib.contextmanager
def fake_scalar_reads() -> Iterator[None]:
    """Adafactor reads host scalars with `.item()` (the step count, param.norm(2), update.norm(2)), which a
    FakeTensor cannot answer (data-dependent). The reduction still runs (its output tensor is allocated as on
    CUDA); only the read of a fake tensor returns 1.0. Restored on exit."""
    from torch._subclasses.fake_tensor import is_fake

    orig = torch.Tensor.item

    def item(self):
        if is_fake(self):
            return 1.0
        return orig(self)

    with patched(torch.Tensor, "item", item):
        yield

