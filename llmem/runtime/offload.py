"""`--offload-activations`: saved tensors in pinned host memory between their layer's forward and backward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from llmem.runtime.cuda import is_fake_tensor

OFFLOAD_MIN_BYTES = 1024   # torchtune's OffloadActivations(min_offload_size=1024)


class ActivationOffload:
    """Saved tensors go to pinned host memory in forward and come back in backward (torch.autograd.graph.
    save_on_cpu / torchtune's OffloadActivations, synchronous). As torchtune does, parameters and tensors under
    1 KiB stay where they are, and the output layer and the loss are not offloaded (torchtune's NoOpManager on the
    output projection; its loss runs outside the context): offloading stops at the lm_head's forward pre-hook.
    Unlike torchtune (which tests isinstance(Parameter) only), views of parameters - the transposed weight a linear
    saves - stay too: copying a weight that stays on the device anyway would only add weight-sized transients.

    The host copy keeps the saved tensor's layout (torchtune's `torch.empty_like(activation, device="cpu")`, then
    `.to("cuda")`: the strides of a dense tensor preserved): a compiled layer's backward views its saved tensors as
    the partitioned forward laid them out (SDPA's output in [b, s, heads, d] strides, llmem.runtime.compile).
    On fake tensors the host copy is a meta tensor made outside the fake mode (no device memory, nothing for the
    tracer to count) and the unpacked copy is a new device tensor (counted)."""

    def __init__(self, head: nn.Module | None) -> None:
        self.active = False
        if head is not None:
            head.register_forward_pre_hook(lambda *_: self._stop())

    def _stop(self) -> None:
        self.active = False

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        self.active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self.active = False

    def offloads(self, t: torch.Tensor) -> bool:
        if not self.active or isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return False
        return t.numel() * t.element_size() >= OFFLOAD_MIN_BYTES and (t.device.type != "cpu" or is_fake_tensor(t))

    def pack(self, t: torch.Tensor):
        if not self.offloads(t):
            return t
        if is_fake_tensor(t):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():     # empty_like's layout: the strides kept where dense
                host = torch.empty_like(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"))
        else:
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
        return (t.device, host)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        if host.device.type == "meta":
            return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        return host.to(device, non_blocking=True)

