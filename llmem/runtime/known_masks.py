"""Boolean-mask ops on fake tensors whose true count the set-up knows: a TRL objective's completion masks
(llmem.runtime.objectives), a vision-language model's image-token mask (llmem.runtime.vision). Fake tensors cannot
know how many entries of a mask are true (`x[mask]`, `masked_select`, `nonzero` have data-dependent shapes); the
count is given by the mask's shape, and the index CUDA's nonzero makes is allocated as at::index makes it."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmem.errors import LlmemError
from llmem.runtime.cuda import is_fake_tensor

_aten = torch.ops.aten


class KnownMasks(TorchDispatchMode):
    """Boolean-mask ops on the batch's masks, whose true count fake tensors cannot know: `valid[(dims, last dim)]`
    true entries per row (rows = the product of the other dims): completion masks, KTO's desirable labels. The
    index CUDA's nonzero makes ([count, dims] int64) is allocated, then the op runs on it, as at::index does. Host
    scalar reads (only the trainers' metrics read any) return 1."""

    def __init__(self, valid: dict[tuple[int, int], int]) -> None:
        super().__init__()
        self.valid = valid

    def count(self, mask: torch.Tensor) -> int:
        per = self.valid.get((mask.dim(), mask.shape[-1])) if mask.dim() else None
        if per is None:
            raise LlmemError(f"trace: a boolean mask of shape {tuple(mask.shape)} the preference step does not "
                             "know (its true count is data-dependent)")
        return mask.numel() // mask.shape[-1] * per

    def nonzero(self, mask: torch.Tensor) -> torch.Tensor:
        return torch.empty((self.count(mask), mask.dim()), dtype=torch.int64, device=mask.device)

    def long_indices(self, indices) -> list:
        out = []
        for ix in indices:
            if isinstance(ix, torch.Tensor) and ix.dtype == torch.bool:
                out.extend(self.nonzero(ix).unbind(1))
            else:
                out.append(ix)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default and is_fake_tensor(args[0]):
            t = args[0]
            return True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1
        if func is _aten.nonzero.default and is_fake_tensor(args[0]):
            return self.nonzero(args[0])
        if func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
                    _aten._index_put_impl_.default) and any(
                isinstance(ix, torch.Tensor) and ix.dtype == torch.bool for ix in args[1]):
            return func(args[0], self.long_indices(args[1]), *args[2:], **kwargs)
        if func is _aten.masked_select.default and is_fake_tensor(args[1]):
            index = self.nonzero(args[1])
            return args[0].expand(args[1].shape)[tuple(index.unbind(1))]
        return func(*args, **kwargs)
