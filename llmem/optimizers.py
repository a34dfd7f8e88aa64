"""Optimizers the step needs that torch does not ship, or whose kernels cannot run on fake tensors.

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
"""

from __future__ import annotations

import torch

# bitsandbytes/optim/optimizer.py (0.50)
BNB_BLOCK_SIZE = 256            # Optimizer2State.init_state: blocksize = 256 for the blockwise 8-bit states
BNB_MIN_8BIT_SIZE = 4096        # AdamW8bit(min_8bit_size=4096): smaller parameters keep 32-bit states
BNB_PAGED_MIN_NUMEL = 100_000   # get_state_buffer: paged only when p.numel() >= 1e5
BNB_QMAP_ENTRIES = 256          # F.create_dynamic_map(signed=...): 2**8 fp32 values


def bnb_blocks(numel: int) -> int:
    """Blocks of the blockwise quantisation: (n // blocksize) + bool(n % blocksize)."""
    return numel // BNB_BLOCK_SIZE + bool(numel % BNB_BLOCK_SIZE)


class Lion(torch.optim.Optimizer):
    """Lion with foreach kernels. State per parameter: exp_avg (the parameter's shape and dtype)."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        if lr < 0.0:
            raise ValueError(f"invalid learning rate {lr}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
                 min_8bit_size: int = BNB_MIN_8BIT_SIZE) -> None:
        super().__init__(params, {"lr": lr})
        self.paged = paged
        self.min_8bit_size = min_8bit_size
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
        if p.numel() < self.min_8bit_size:
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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self._init_state(p)
                self.state[p]["step"] += 1
                p.add_(p.grad, alpha=-group["lr"])   # in place, like the fused kernel: no temporaries
        return loss
