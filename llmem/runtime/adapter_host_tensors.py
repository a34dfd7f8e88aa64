"""Index tensors peft's tuner layers keep on the host (llmem.model.peft.host_index_tensors: FourierFT's `indices`,
WaveFT's `waveft_indices`, SHiRA's `shira_indices`, torch.randperm's values made at get_peft_model), in the fake
step. They stay real, as the vision models' grids do (llmem.runtime.vision.index_tensors_stay_real: what is computed
from them alone stays real, and the fake mode takes them where they meet fake tensors), so that WaveFT's
`valid_mask` of the indices inside its padded spectrum (peft/tuners/waveft/layer.py `get_delta_weight`) has its
values; a real boolean mask indexing a tensor goes through its real positions, as at::index turns a mask into its
nonzero indices. Their device copies (the real step's `.to(spectrum.device)`, kept by index_put's backward or, for
SHiRA, in the dict) are allocated once, as the estimate counts them (buffers of their module)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._mode_utils import no_dispatch

from llmem.model.peft import host_index_tensors, host_offloaded_weights, host_read_buffers, valued_buffers
from llmem.runtime.build import materialize
from llmem.runtime.ledger import HOST
from llmem.runtime.patches import patched
from llmem.runtime.vision import index_tensors_stay_real

_aten = torch.ops.aten
_MASK_INDEX_OPS = frozenset({_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
                             _aten._index_put_impl_.default})


def _real_mask(ix) -> bool:
    return isinstance(ix, torch.Tensor) and ix.dtype == torch.bool and not isinstance(ix, FakeTensor)


@contextlib.contextmanager
def adapter_index_tensors(mode, model: nn.Module) -> Iterator[None]:
    """Under the fake mode `mode` (entered): the tuner layers' host index tensors (and what is computed from them
    alone) stay real, and a real boolean mask indexing a tensor is turned into its real positions first."""
    seeds = tuple(t for _name, t, _kind in host_index_tensors(model)) \
        + tuple(t for _module, _key, t in host_read_buffers(model))
    if not seeds:
        yield
        return
    with index_tensors_stay_real(mode, seeds):
        mode_type = type(mode)
        inner = mode_type.__torch_dispatch__

        def dispatch(self, func, types, args=(), kwargs=None):
            if func in _MASK_INDEX_OPS and any(_real_mask(ix) for ix in args[1]):
                with no_dispatch():
                    indices = [ix.nonzero().unbind(1) if _real_mask(ix) else (ix,) for ix in args[1]]
                args = (args[0], [i for group in indices for i in group], *args[2:])
            return inner(self, func, types, args, kwargs)

        with patched(mode_type, "__torch_dispatch__", dispatch):
            yield


def hold_index_copies(model: nn.Module, stack: contextlib.ExitStack) -> None:
    """The host index tensors' device copies, allocated with the model's parameters (fake, tracked) and held until
    the step's stack closes."""
    copies = [torch.empty(t.shape, dtype=t.dtype) for _name, t, _kind in host_index_tensors(model)]
    stack.callback(copies.clear)


def materialize_keeping_host_reads(model: nn.Module) -> None:
    """The model materialised on the fake device (llmem.runtime.build.materialize) but for the buffers whose values
    peft's forward reads on the host (llmem.model.peft.HOST_READ_BUFFERS: FRoD's sparse sizes), kept real: the
    ledger counts them with the weights as the GPU holds them."""
    kept = host_read_buffers(model)
    materialize(model, "cpu")
    for module, key, t in kept:
        module._buffers[key] = t


def offload_base_weights(model: nn.Module, region) -> None:
    """FRoD's runtime_offload_base_weight in the fake step: the adapted modules' base weights made again inside
    `region(HOST)` (host tensors, no device event), where peft's Linear._apply leaves them after model.to(device)
    (llmem.model.peft.host_offloaded_weights); the fake device is the host's type, so peft's own move is a no-op."""
    names = host_offloaded_weights(model)
    if not names or region is None:
        return
    with region(HOST):
        for name in names:
            module = model.get_submodule(name.rsplit(".", 1)[0])
            old = module.weight
            module._parameters["weight"] = nn.Parameter(torch.empty(old.shape, dtype=old.dtype), requires_grad=False)


@contextlib.contextmanager
def valued_buffers_kept(model: nn.Module) -> Iterator[None]:
    """Around model.to_empty(device) for a real step: the buffers whose values peft's forward depends on
    (llmem.model.peft.VALUED_BUFFERS: FRoD's sparse S's size and positions) get peft's values back."""
    kept = valued_buffers(model)
    yield
    with torch.no_grad():
        for module, key, t in kept:
            module._buffers[key].copy_(t)
