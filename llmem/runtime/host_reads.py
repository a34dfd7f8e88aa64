"""Host reads of values a fake tensor does not hold, answered as the real step's usual run answers them. peft's
adapters branch on two kinds in training:

- a host draw against a probability: LyCORIS' module dropout (peft/tuners/loha/layer.py and lokr/layer.py
  `forward`: `torch.rand(1) > module_dropout` decides whether the adapter runs): the more likely outcome (with
  peft's default module_dropout 0.0, always: the adapter runs);
- a validity check: VB-LoRA's `vblora_logits_A[0, 0].isinf().any()` (peft/tuners/vblora/layer.py
  `_get_lora_matrices`, raising when training resumes from a top-k-only save): the values of a healthy run are
  finite.

The op's output is given the answer as its `item_memo` (the value FakeTensor's `.item()` returns,
torch/_subclasses/fake_impls.py `local_scalar_dense`); any other read stays data-dependent and fails as before."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

_aten = torch.ops.aten
DRAW_TAG = "_llmem_uniform_draw"      # a torch.rand tensor: uniform on [0, 1)
ALL_TAG = "_llmem_every_element"      # a boolean tensor whose every element the usual run knows

_DRAWS = frozenset({_aten.rand.default, _aten.uniform_.default})
# P(draw op p) for a draw uniform on [0, 1) against a number p
_ABOVE = frozenset({_aten.gt.Scalar, _aten.ge.Scalar})
_BELOW = frozenset({_aten.lt.Scalar, _aten.le.Scalar})
_CHECKS = {_aten.isinf.default: False, _aten.isnan.default: False}     # every element False
_REDUCTIONS = frozenset({_aten.any.default, _aten.all.default})


def answer_host_reads(func, args, out) -> None:
    """Tag `out` (the output of `func` on fake tensors) with what the usual run's host read of it gives."""
    if not isinstance(out, torch.Tensor):
        return
    if func in _DRAWS:
        setattr(out, DRAW_TAG, True)
        return
    if func in _CHECKS:
        setattr(out, ALL_TAG, _CHECKS[func])
        return
    first = args[0] if args else None
    if func in _REDUCTIONS and getattr(first, ALL_TAG, None) is not None:
        _memo(out, getattr(first, ALL_TAG))
    elif (func in _ABOVE or func in _BELOW) and getattr(first, DRAW_TAG, False) and isinstance(args[1], (int, float)):
        above = 1.0 - min(max(float(args[1]), 0.0), 1.0)       # P(draw > p)
        _memo(out, above > 0.5 if func in _ABOVE else above < 0.5)


def _memo(out: torch.Tensor, value: bool) -> None:
    """The host read's answer, where FakeTensor keeps one (not under inference mode)."""
    if out.numel() == 1 and isinstance(out, FakeTensor) and not out.is_inference():
        out.item_memo = value
