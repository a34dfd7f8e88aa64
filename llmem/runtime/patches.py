"""Patches the step needs and their restoration: each is a context manager that puts back what it replaced.

- `patched`: set an attribute for the duration of a block.
- `quiet`: the deprecation / FSDP / config warnings the step triggers.
- `hf_untraced_masks`: transformers' mask shortcuts, which it skips for fake tensors (it takes them for tracing).
- `fake_scalar_reads`: `.item()` of a fake tensor (Adafactor's host scalars) reads 1.0 while the optimizer steps.
- `collectives_waited_in_place`: funcol.wait_tensor returns the collective's output itself, as on CUDA.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from llmem.runtime.cuda import is_fake_tensor

_MISSING = object()


@contextlib.contextmanager
def patched(obj, name: str, value) -> Iterator[None]:
    """Set an attribute for the block (created when missing, removed again on exit)."""
    saved = getattr(obj, name, _MISSING)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if saved is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, saved)


def _waited_in_place(tensor):
    """funcol.wait_tensor as CUDA runs it: the collective's output itself, synchronised. The fake mode gives
    `_c10d_functional.wait_tensor`'s output a storage of its own, which would count a copy of every all-gathered
    K/V and all-to-all'd tensor that no GPU makes (the fake process group has nothing to wait for)."""
    return tensor


@contextlib.contextmanager
def collectives_waited_in_place() -> Iterator[None]:
    """funcol.wait_tensor without the fake mode's copy (ring attention's K/V gathers, EP's all-to-alls)."""
    import torch.distributed._functional_collectives as funcol

    with patched(funcol, "wait_tensor", _waited_in_place):
        yield


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



@contextlib.contextmanager
def grouped_mm_meta_any_float() -> Iterator[None]:
    """The fake (meta) kernel of `aten._grouped_mm` accepting the dtypes the real kernels run.

    torch's meta kernel copies the bf16 fast path's check ("Expected inputs of BF16 type"), but the real CPU kernel
    runs fp32 (and returns fp32), and autocast has no `_grouped_mm` entry on either key (AutocastCUDA and AutocastCPU
    let it through uncast), while transformers' MoE experts cast their input to the weight's dtype: under *-mixed
    the experts' matmuls run on the fp32 master weights. The trace's fake step runs them so, with the output shape
    and dtype of torch's own `_create_grouped_mm_output_tensor` (restored on exit)."""
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    def meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        torch._check(mat_a.dtype == mat_b.dtype and mat_a.is_floating_point(),
                     lambda: f"grouped_mm: mat_a {mat_a.dtype} and mat_b {mat_b.dtype} must be one floating dtype")
        torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3), lambda: "grouped_mm: 2-D or 3-D operands")
        return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)

    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lib.impl("_grouped_mm", meta, "Meta")
        yield
    finally:
        lib._destroy()


FLASH_KERNEL = "llmem_fused_kernel"   # the attention implementation --attn flash runs where a class has no SDPA one


def _flash_kernel_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF flash_attention_2's memory on a class with flash but no SDPA attention (Gemma-2): PyTorch's SDPA, causal
    and without a mask, which the trace's flash kernel (llmem.runtime.cuda) keeps q, k, v, out and logsumexp of,
    as flash-attn does. softcap and sliding_window change the scores, not what the kernel keeps."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for name in ("softcap", "sliding_window", "is_causal"):
        kwargs.pop(name, None)
    return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, is_causal=True,
                                  **kwargs)


@contextlib.contextmanager
def flash_kernel_attention() -> Iterator[str]:
    """Register FLASH_KERNEL in transformers' attention and mask interfaces (flash's: no mask without padding) for
    the block; both registries are put back as they were on exit."""
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    from transformers.modeling_utils import AttentionInterface

    saved = [(iface, dict(iface._global_mapping)) for iface in (AttentionInterface, AttentionMaskInterface)]
    AttentionInterface.register(FLASH_KERNEL, _flash_kernel_attention)
    AttentionMaskInterface.register(FLASH_KERNEL, flash_attention_mask)
    try:
        yield FLASH_KERNEL
    finally:
        for iface, mapping in saved:
            iface._global_mapping.clear()
            iface._global_mapping.update(mapping)


@contextlib.contextmanager
def accelerate_logging_without_state() -> Iterator[None]:
    """accelerate's fsdp_utils logs through its MultiProcessAdapter, which refuses to log before an Accelerator
    (its PartialState) exists; the trace runs those functions without one: a plain logger for the block."""
    import logging

    from accelerate.utils import fsdp_utils

    with patched(fsdp_utils, "logger", logging.getLogger("llmem.accelerate")):
        yield
