"""Optimizers on the runtime floor: one builder per registry row, the optimizers the traced step runs.

The optimizers the step runs, one builder per registry row (llmem.setup.optimizers), as PyTorch runs them on
CUDA, and the ones torch does not ship or whose kernels cannot run on fake tensors.

- torch.optim's AdamW (foreach, fused, for-loop), SGD and Adafactor. Under FakeTensorMode torch would pick the
  for-loop implementation (FakeTensor is not a "foreach-supported" type), so the CUDA default (foreach) is
  explicit. Adafactor is the exception: torch defaults it to the for-loop implementation on CUDA too
  (foreach=None runs _single_tensor_adafactor, "as Adafactor is commonly used when memory is prohibitive").
- `Lion` (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), the update of lucidrains/lion-pytorch:
  one state (exp_avg); update = sign(beta1 * m + (1 - beta1) * g); p -= lr * (update + wd * p);
  m = beta2 * m + (1 - beta2) * g. Written with foreach kernels (one group-sized temporary: the update), as torch's
  own optimizers run on CUDA.
- `EmulatedAdamW8bit`: the memory of bitsandbytes' AdamW8bit / PagedAdamW8bit (bitsandbytes 0.50,
  optim/optimizer.py Optimizer2State.init_state): per parameter of at least `min_8bit_size` (4096) elements,
  state1 and state2 as uint8 tensors of the parameter's shape, absmax1 and absmax2 as fp32 tensors of one value per
  block of 256 elements; smaller parameters keep fp32 state1/state2; the two 256-entry quantisation maps (signed and
  unsigned dynamic maps, fp32) are shared by all parameters. The update is one fused CUDA kernel per parameter
  (optimizer_update_8bit_blockwise): no temporaries. bitsandbytes' kernels cannot run on fake tensors, so this
  optimizer allocates exactly those tensors and updates the parameter in place (plain SGD numerics: the trace and
  measure care about memory, not values).
  Paged (PagedAdamW8bit): state buffers of >= 1e5 elements come from cudaMallocManaged (F.get_paged), which the
  caching allocator never sees; they are made on the meta device here (no allocator event) and their bytes are
  reported in `outside_allocator_bytes`.
  PagedAdamW (32-bit): the same emulation with optim_bits=32: fp32 state1/state2 for every parameter, paged when
  >= 1e5 elements, no quantisation maps.
- `EmulatedTorchaoAdamW`: the memory of torchao's AdamW8bit / AdamW4bit / AdamWFp8 (torchao 0.18.0, optim/adam.py
  _AdamBase): per parameter, at its first step, exp_avg then exp_avg_sq, each the tensors of its subclass's
  `zeros` (codes, fp32 scale per block, its own fp32 qmap: llmem.setup.optimizers.TorchaoStateFormat) when the
  local tensor (a DTensor's shard) has >= 4096 elements and a multiple of the block size, else zeros_like of the
  local tensor; the step counter and the learning rate are CPU tensors. The update is torch.compile of
  single_param_adam, one fused kernel per parameter, which cannot run on fake tensors: here the parameter is
  updated in place (plain SGD numerics) and nothing else is allocated; inductor's own buffers are not modelled
  (the row's notes bound them).
- `InBackwardOptimizer`: --optimizer-in-backward, one optimizer per parameter stepped in its post-accumulate-grad
  hook.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from llmem.errors import LlmemError
from llmem.runtime.distributed import layer_list
from llmem.runtime.patches import fake_scalar_reads
from llmem.setup.optimizers import (
    BNB_MIN_8BIT_SIZE,
    BNB_PAGED_MIN_NUMEL,
    BNB_QMAP_ENTRIES,
    OPTIMIZERS,
    TORCHAO_FORMATS,
    TorchaoStateFormat,
    bnb_blocks,
)

LEARNING_RATE = 1e-5   # any: memory does not depend on it


def _closure_loss(closure):
    """torch.optim.Optimizer.step's closure: re-evaluate the loss with gradients enabled."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _stepped(optimizer: torch.optim.Optimizer) -> Iterator[tuple[dict, torch.Tensor]]:
    """(group, parameter) for every parameter with a gradient, in the optimizer's order (a step's loop)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                yield group, p


class Lion(torch.optim.Optimizer):
    """Lion with foreach kernels. State per parameter: exp_avg (the parameter's shape and dtype)."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        if lr < 0.0:
            raise ValueError(f"invalid learning rate {lr}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            params, grads, exp_avgs = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
            if not params:
                continue
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            if wd:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            updates = torch._foreach_mul(exp_avgs, beta1)            # the step's one temporary (group-sized)
            torch._foreach_add_(updates, grads, alpha=1.0 - beta1)
            torch._foreach_sign_(updates)
            torch._foreach_add_(params, updates, alpha=-lr)
            del updates
            torch._foreach_mul_(exp_avgs, beta2)
            torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta2)
        return loss


class EmulatedAdamW8bit(torch.optim.Optimizer):
    """bitsandbytes' AdamW8bit (paged=False) or PagedAdamW8bit (paged=True), memory-exact, see the module doc."""

    def __init__(self, params, lr: float = 1e-3, paged: bool = False,
                 min_8bit_size: int = BNB_MIN_8BIT_SIZE, optim_bits: int = 8) -> None:
        super().__init__(params, {"lr": lr})
        self.paged = paged
        self.min_8bit_size = min_8bit_size
        self.optim_bits = optim_bits
        self.qmaps: tuple[torch.Tensor, torch.Tensor] | None = None
        self.outside_allocator_bytes = 0      # paged (cudaMallocManaged) state bytes

    def _buffer(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """get_state_buffer: zeros_like(p, dtype) from the caching allocator, or a managed (paged) buffer."""
        if self.paged and p.numel() >= BNB_PAGED_MIN_NUMEL:
            self.outside_allocator_bytes += p.numel() * dtype.itemsize
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                return torch.zeros(p.shape, dtype=dtype, device="meta")
        return torch.zeros_like(p, dtype=dtype)

    def _init_state(self, p: torch.Tensor) -> None:
        state = self.state[p]
        state["step"] = 0
        if self.optim_bits == 32 or p.numel() < self.min_8bit_size:
            state["state1"] = self._buffer(p, torch.float32)
            state["state2"] = self._buffer(p, torch.float32)
            return
        if self.qmaps is None:   # name2qmap["dynamic"/"udynamic"].to(p.device): made once, shared
            self.qmaps = (torch.zeros(BNB_QMAP_ENTRIES, dtype=torch.float32, device=p.device),
                          torch.zeros(BNB_QMAP_ENTRIES, dtype=torch.float32, device=p.device))
        state["state1"] = self._buffer(p, torch.uint8)
        state["qmap1"] = self.qmaps[0]
        state["state2"] = self._buffer(p, torch.uint8)
        state["qmap2"] = self.qmaps[1]
        blocks = bnb_blocks(p.numel())
        state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
        state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group, p in _stepped(self):
            if not self.state[p]:
                self._init_state(p)
            self.state[p]["step"] += 1
            p.add_(p.grad, alpha=-group["lr"])   # in place, like the fused kernel: no temporaries
        return loss


Builder = Callable[[nn.Module, list[dict], float], "torch.optim.Optimizer | MuonWithAdamW"]


class EmulatedTorchaoAdamW(torch.optim.Optimizer):
    """torchao's AdamW8bit / AdamW4bit / AdamWFp8 (`fmt`: the row's state format), memory-exact for the states, see
    the module doc."""

    def __init__(self, params, fmt: TorchaoStateFormat, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})
        self.fmt = fmt

    def _new_buffer(self, local: torch.Tensor, name: str, qmap_entries: int) -> dict[str, torch.Tensor]:
        """_AdamBase._new_buffer on the local tensor: the subclass's codes, scale and qmap (in that order), or
        zeros_like; one state-dict entry per device tensor (the trace labels them optimizer states)."""
        n, fmt = local.numel(), self.fmt
        if not fmt.quantised(n):
            return {name: torch.zeros_like(local)}
        shape = (n // 2,) if fmt.code_bits == 4 else local.shape     # OptimState4bit: flattened, two per byte
        out = {f"{name}.codes": torch.zeros(shape, dtype=getattr(torch, fmt.codes_dtype), device=local.device),
               f"{name}.scale": torch.zeros(n // fmt.block_size, dtype=torch.float32, device=local.device)}
        if qmap_entries:
            out[f"{name}.qmap"] = torch.zeros(qmap_entries, dtype=torch.float32, device=local.device)
        return out

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group, p in _stepped(self):
            local = p.to_local() if hasattr(p, "to_local") else p
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            state = self.state[p]
            if not state:
                state["step"] = 0              # torch.tensor(0.0): a CPU tensor
                state.update(self._new_buffer(local, "exp_avg", self.fmt.signed_qmap_entries))
                state.update(self._new_buffer(local, "exp_avg_sq", self.fmt.unsigned_qmap_entries))
            state["step"] += 1
            local.add_(grad, alpha=-group["lr"])   # in place, like the compiled kernel's p.copy_
        return loss


def _torchao(name: str) -> Builder:
    return lambda model, groups, lr: EmulatedTorchaoAdamW(groups, TORCHAO_FORMATS[name], lr=lr)


class _Adafactor(torch.optim.Adafactor):
    """torch.optim.Adafactor whose host-scalar reads work on fake tensors (fake_scalar_reads, only while it steps:
    the model's own code keeps the fake mode's usual errors)."""

    def step(self, closure=None):
        with fake_scalar_reads():
            return super().step(closure)


def param_groups(model: nn.Module) -> list[dict]:
    """One group, unless plain tensors and DTensors on different meshes mix (TP leaves norms plain; FSDP2 over TP
    gives 1-D and 2-D DTensors): foreach kernels need one kind per group, as a real run would have to do too."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list] = {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        key = (("dtensor", p.device_mesh.ndim, tuple(p.device_mesh.mesh_dim_names or ()))
               if isinstance(p, DTensor) else ("plain",))
        groups.setdefault(key, []).append(p)
    return [{"params": ps} for ps in groups.values()]


def _merged_state(optimizers) -> dict:
    """The `state` of several optimizers that step disjoint parameters, as one optimizer's would read."""
    out: dict = {}
    for opt in optimizers:
        out.update(opt.state)
    return out


class MuonWithAdamW:
    """torch.optim.Muon over the decoder layers' 2-D weights and torch.optim.AdamW (foreach) over the rest, stepped
    one after the other (Muon first), as torch's documentation pairs them (llmem.setup.optimizers' "muon" row)."""

    def __init__(self, model: nn.Module, groups: list[dict], lr: float) -> None:
        hidden = {id(p) for p in layer_list(model).parameters()}
        params = [p for g in groups for p in g["params"]]
        matrices = [p for p in params if p.ndim == 2 and id(p) in hidden]
        chosen = {id(p) for p in matrices}
        others = [g_ for g_ in ({"params": [p for p in g["params"] if id(p) not in chosen]} for g in groups)
                  if g_["params"]]
        self.optimizers = ([torch.optim.Muon(matrices, lr=lr)] if matrices else []) + \
            ([torch.optim.AdamW(others, lr=lr, foreach=True)] if others else [])

    @property
    def state(self) -> dict:
        return _merged_state(self.optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self, closure=None):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


BUILDERS: dict[str, Builder] = {
    "adamw": lambda model, groups, lr: torch.optim.AdamW(groups, lr=lr, foreach=True),
    "adamw-fused": lambda model, groups, lr: torch.optim.AdamW(groups, lr=lr, fused=True),
    "adamw-forloop": lambda model, groups, lr: torch.optim.AdamW(groups, lr=lr, foreach=False),
    "sgd": lambda model, groups, lr: torch.optim.SGD(groups, lr=lr, momentum=0.0, foreach=True),
    "sgd-momentum": lambda model, groups, lr: torch.optim.SGD(groups, lr=lr, momentum=0.9, foreach=True),
    "adafactor": lambda model, groups, lr: _Adafactor(groups, lr=lr, foreach=None),
    "lion": lambda model, groups, lr: Lion(groups, lr=lr),
    "muon": MuonWithAdamW,
    "adamw-8bit": lambda model, groups, lr: EmulatedAdamW8bit(groups, lr=lr, paged=False),
    "paged-adamw-8bit": lambda model, groups, lr: EmulatedAdamW8bit(groups, lr=lr, paged=True),
    "paged-adamw-32bit": lambda model, groups, lr: EmulatedAdamW8bit(groups, lr=lr, paged=True, optim_bits=32),
    **{name: _torchao(name) for name in TORCHAO_FORMATS},
}


def make_optimizer(model: nn.Module, optimizer: str, groups: list[dict] | None = None) -> torch.optim.Optimizer:
    """The optimizer of the registry row `optimizer` over `model`'s trainable parameters (or `groups`)."""
    if optimizer not in OPTIMIZERS or optimizer not in BUILDERS:
        raise LlmemError(f"unknown optimizer {optimizer!r}")
    return BUILDERS[optimizer](model, param_groups(model) if groups is None else groups, LEARNING_RATE)


class InBackwardOptimizer:
    """--optimizer-in-backward (torch tutorial "How to save memory by fusing the optimizer step into the backward
    pass"): one optimizer per parameter, stepped in the parameter's post-accumulate-grad hook, which then frees the
    gradient (zero_grad(set_to_none=True)), so gradients never all live at once. States appear lazily, per
    parameter, at its first step. `step` / `zero_grad` of the training loop have nothing left to do."""

    def __init__(self, model: nn.Module, optimizer: str, region=None) -> None:
        self.optimizers: dict[nn.Parameter, torch.optim.Optimizer] = {}
        self.handles = []
        region = region or (lambda _c: contextlib.nullcontext())
        for p in model.parameters():
            if not p.requires_grad or p in self.optimizers:
                continue
            opt = make_optimizer(model, optimizer, groups=[{"params": [p]}])
            self.optimizers[p] = opt

            def hook(param, opt=opt):
                with region("optimizer_temporaries"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)

            self.handles.append(p.register_post_accumulate_grad_hook(hook))

    @property
    def state(self) -> dict:
        return _merged_state(self.optimizers.values())

    @property
    def outside_allocator_bytes(self) -> int:
        return sum(getattr(o, "outside_allocator_bytes", 0) for o in self.optimizers.values())

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


class HostOffloadedOptimizer:
    """--offload-optimizer as ZeRO-Offload and FSDP's optimizer offload run it: the optimizer steps fp32 master
    copies of the trained parameters (this rank's shards) in host memory, its states live there too. On the device
    the gradients stay until zero_grad (they are copied to the host for the step) and the parameters are updated
    in place by the copy back: the step allocates nothing on the GPU. Under FSDP2's CPUOffloadPolicy the sharded
    parameters and gradients are host tensors already (llmem.runtime.distributed): the same step, nothing on the
    device either.

    The host side is made on the meta device, outside the fake mode (as ActivationOffload makes its host copies):
    its tensors are not device memory and reach no allocator. The step runs the registry row's own optimizer on
    them, so a composite or a for-loop implementation behaves as it would on the host."""

    outside_allocator_bytes = 0

    def __init__(self, model: nn.Module, optimizer: str) -> None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        with unset_fake_temporarily():
            groups = []
            for g in param_groups(model):
                hosts = []
                for p in g["params"]:
                    local = p.to_local() if hasattr(p, "to_local") else p
                    host = nn.Parameter(torch.empty(local.shape, dtype=torch.float32, device="meta"))
                    self.pairs.append((p, host))
                    hosts.append(host)
                groups.append({**g, "params": hosts})
            holder = nn.Module()
            holder.params = nn.ParameterList([h for _, h in self.pairs])
            self.host = make_optimizer(holder, optimizer, groups)
            for g in self.host.param_groups:
                # torch's fused kernels refuse meta tensors (optimizer.py's _device_dtype_check_for_fused); the host
                # step reaches no device allocator either way, so on the meta host it runs the for-loop update
                if g.get("fused"):
                    g["fused"] = g["foreach"] = False

    @property
    def state(self) -> dict:
        return {}          # on the host: no device tensor is an optimizer state

    def step(self) -> None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily(), fake_scalar_reads():
            for p, host in self.pairs:      # the gradient's device -> host copy lands in host memory
                host.grad = torch.empty(host.shape, dtype=host.dtype, device="meta") if p.grad is not None else None
            self.host.step()
            for _, host in self.pairs:
                host.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, _ in self.pairs:
            p.grad = None
