"""Host and device on the one fake device: the copies between them that the job's loading and saving code makes.

The trace's tensors are all fake cpu tensors, so `t.to("cpu")` of a "GPU" tensor returns `t` itself and
`model.to("cuda")` cannot run. Inside `host_and_device(ledger)` the code runs with its own device arguments:
- `Tensor.to` / `Tensor.cpu` towards "cpu" of a tensor not born on the host is a real copy made inside the ledger's
  HOST region (torch/distributed/_state_dict_utils.py `_iterate_state_dict`'s `ret.to(cpu_device)`, safetensors'
  `_to_ndarray`, accelerate's offloads): host bytes, tallied apart from the device's events;
- `Tensor.to` / `Tensor.cuda` / `Module.to` towards "cuda" runs on the fake cpu device; from a host tensor it is a
  real copy (a device allocation), as `model.to(device)` and FSDP2's `_move_states_to_device` make one;
- a factory (`torch.empty`, `empty_like`, ...) given device "cuda" makes a device tensor, one given "cpu" a host
  tensor (to_empty's, DCP's read buffers); under DeepSpeed, whose CPU accelerator names the device "cpu", only
  `.cpu()` is a copy to the host.
Everything else runs as the step runs it. A new storage made by an op on host tensors (a host clone) is counted as
a device allocation: the paths traced here make none (their host tensors are copies and views only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from llmem.runtime.ledger import HOST, Ledger

CUDA = torch.device("cuda")       # the device argument the traced code is given (what `accelerator.device` is)
_FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.full, torch.empty_like, torch.zeros_like,
                        torch.ones_like, torch.full_like, torch.empty_strided})


def _device_type(value) -> str | None:
    """The device type an argument names (a str, a torch.device, an int: a CUDA ordinal), None where it is none."""
    if isinstance(value, torch.device):
        return value.type
    if isinstance(value, str):
        return torch.device(value).type
    if isinstance(value, int) and not isinstance(value, bool):
        return "cuda"
    return None


def _target(args: tuple, kwargs: dict) -> tuple[str | None, int | None]:
    """Tensor.to's target device type and where it is given (-1: the `device` keyword), from its arguments."""
    if "device" in kwargs:
        return _device_type(kwargs["device"]), -1
    for i, a in enumerate(args[1:], start=1):
        kind = _device_type(a)
        if kind is not None:
            return kind, i
    return None, None


def _on_cpu(args: tuple, kwargs: dict, where: int | None) -> tuple[tuple, dict]:
    """The arguments with the target device made the fake one (cpu)."""
    if where == -1:
        return args, {**kwargs, "device": "cpu"}
    if where is not None:
        return (*args[:where], "cpu", *args[where + 1:]), kwargs
    return args, kwargs


class HostAndDevice(TorchFunctionMode):
    """The copies between host and device on the one fake device (module docstring)."""

    def __init__(self, ledger: Ledger, device_named_cpu: bool = False) -> None:
        super().__init__()
        self.ledger = ledger
        self.device_named_cpu = device_named_cpu
        self.factories = frozenset() if device_named_cpu else _FACTORIES

    def _copy(self, func, args: tuple, kwargs: dict, to_host: bool):
        led = self.ledger
        ctx = led.region(HOST) if to_host else contextlib.nullcontext()
        with ctx:
            if func is torch.Tensor.to:
                return func(*args, **{**kwargs, "copy": True})
            return args[0].clone()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda) and args:
            t = args[0]
            if func is torch.Tensor.to:
                kind, where = _target(args, kwargs)
                if self.device_named_cpu and kind == "cpu":     # DeepSpeed's .to(its device's name)
                    kind = "cuda"
            else:
                kind, where = ("cpu" if func is torch.Tensor.cpu else "cuda"), None
                args, kwargs = (t,), {k: v for k, v in kwargs.items() if k == "memory_format"}
                func = torch.Tensor.to
                args = (t, "cpu")
                where = 1
            if kind in ("cpu", "cuda"):
                args, kwargs = _on_cpu(args, kwargs, where)
                host = self.ledger.on_host(t)
                if (kind == "cpu") != host:               # a copy across: host <- device, or device <- host
                    return self._copy(func, args, kwargs, to_host=kind == "cpu")
            return func(*args, **kwargs)
        if func in self.factories:
            kind = _device_type(kwargs.get("device"))
            if kind in ("cpu", "cuda"):
                kwargs = {**kwargs, "device": "cpu"}
                with self.ledger.region(HOST) if kind == "cpu" else contextlib.nullcontext():
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_and_device(ledger: Ledger, device_named_cpu: bool = False) -> Iterator[None]:
    """Run the block with the host <-> device copies made (module docstring). device_named_cpu: DeepSpeed's CPU
    accelerator names its device "cpu" (llmem.runtime.deepspeed), so a factory or a `.to` given "cpu" is the
    device's; only `.cpu()` copies to the host (what DeepSpeed's and transformers' ZeRO-3 code calls for it)."""
    with HostAndDevice(ledger, device_named_cpu):
        yield


def host_materialize(model: torch.nn.Module, ledger: Ledger) -> None:
    """Every parameter and buffer of a meta `model` made on the host (what from_pretrained leaves there: each
    checkpoint tensor materialised in the dtype the model keeps it), tied ones kept tied."""
    from llmem.runtime.build import materialize

    with ledger.region(HOST):
        materialize(model, "cpu")
