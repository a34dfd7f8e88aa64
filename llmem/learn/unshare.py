"""peft's cross-layer adapters (VeRA's and RandLoRA's shared projections, VB-LoRA's vector bank, Lily's shared
A and B, PVeRA's) are one module object reached from several decoder layers. The module tracker names a module once
(its first path), so the read layer's allocations in a shared module would be told as another layer's. The read
layer is given its own module objects over the same parameters and buffers: the step computes and allocates exactly
as before (the same tensors, autograd accumulating into the same leaves), and the read layer's modules carry its
own names."""

from __future__ import annotations

import copy

from torch import nn


def own_copy(module: nn.Module) -> nn.Module:
    """A new module object (and new children) over the same Parameter and buffer tensors, hooks and settings."""
    twin = copy.copy(module)            # the same __dict__ values: hooks, flags, the adapters' scalings
    twin._parameters = dict(module._parameters)
    twin._buffers = dict(module._buffers)
    twin._modules = {n: own_copy(c) if c is not None else None for n, c in module._modules.items()}
    return twin


def unshare_layer(layers: list[nn.Module], index: int) -> list[str]:
    """Give layer `index` its own objects for the modules it shares with the other layers (the names replaced)."""
    others = {id(m) for i, other in enumerate(layers) if i != index for m in other.modules()}
    replaced: list[str] = []

    def walk(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            path = f"{prefix}{name}"
            if id(child) in others:
                parent._modules[name] = own_copy(child)
                replaced.append(path)
            else:
                walk(child, path + ".")

    walk(layers[index], "")
    return replaced
