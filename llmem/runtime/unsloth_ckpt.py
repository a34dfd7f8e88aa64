"""--ckpt-offload: Unsloth's offloaded checkpoints as the trace (and measure) run them, around each checkpointed
decoder layer (transformers' GradientCheckpointingLayer calls the layer's `_gradient_checkpointing_func`, which
Unsloth's patch_unsloth_smart_gradient_checkpointing, LLaMA-Factory's use_unsloth_gc and axolotl's legacy offload
all replace).

The autograd Functions below are copied from unsloth_zoo 2026.10.9 (unsloth_zoo/gradient_checkpointing.py, LGPLv3,
(c) the Unsloth team): `UnslothCheckpointFunction` with `unsloth_checkpoint`, and `Unsloth_Offloaded_Gradient_
Checkpointer` (LLaMA-Factory 0.9.5's `get_unsloth_gradient_checkpointing_func` and axolotl 0.19's
`CPU_Offloaded_Gradient_Checkpointer` are copies of it). What changes the device's memory is kept line for line: the
threshold, the first pass, the last layer kept, the staging buffers made at 2 MiB and grown, the second one from the
second step on, the fp32 input stored as bf16 and cast back, the inputs saved or not. What does not is left out and
said so: the side stream, events and prefetching (memory is counted on the compute stream), the RNG state (memory
-neutral), pinned-memory bookkeeping and the double-buffering headroom probe (more than 512 MiB free is assumed:
--ckpt-offload unsloth-single is the single buffer). The module-level globals are one `UnslothState` per step.

On fake tensors the host side is a meta tensor made outside the fake mode (no device memory, nothing for the tracer to
count), as llmem.runtime.offload's host copies are; a staging buffer's `resize_` is a new device tensor that replaces
the old (resize_ allocates the new block, copies, frees the old: the same two events); the host-to-device copies
into it allocate nothing and are not run.
"""

from __future__ import annotations

import torch
from torch import nn

from llmem.runtime.cuda import is_fake_tensor
from llmem.setup.checkpointing import UNSLOTH_INITIAL_GPU_BUFFER, CkptOffload, ckpt_offload

INITIAL_GPU_BUFFER_SIZE = UNSLOTH_INITIAL_GPU_BUFFER // 2   # elements of GPU_BUFFER_DTYPE (bf16)


def _host_empty(shape, dtype, like: torch.Tensor) -> torch.Tensor:
    """A host buffer: meta outside the fake mode for a fake tensor, pinned host memory for a real one."""
    if is_fake_tensor(like):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            return torch.empty(shape, dtype=dtype, device="meta")
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=like.device.type == "cuda")


def _autocast_state(device_type: str) -> dict:
    return {"enabled": torch.is_autocast_enabled(device_type), "dtype": torch.get_autocast_dtype(device_type),
            "cache_enabled": torch.is_autocast_cache_enabled()}


class UnslothState:
    """unsloth_zoo's globals (initialize_unsloth_gradient_checkpointing) for one step: GPU_BUFFERS[dev],
    GPU_BUFFERS_B[dev], FIRST_PASS, LAST_GC_INDEX, CURRENT_GC_INDEX, BACKWARD_PASS, USE_DOUBLE_BUFFER."""

    def __init__(self, row: CkptOffload) -> None:
        self.row = row
        self.gpu_a: torch.Tensor | None = None
        self.gpu_b: torch.Tensor | None = None
        self.double_buffer_off = row.staging < 2     # _double_buffer_disabled(): GPU_BUFFERS_B is None
        self.use_double_buffer = False
        self.first_pass, self.backward_pass = True, True
        self.last_gc_index = self.current_gc_index = 0
        self.next_slot = 0

    def ensure_device_buffers(self, arg: torch.Tensor) -> None:
        """_ensure_device_buffers: GPU_BUFFERS[dev] and GPU_BUFFERS_B[dev] made at INITIAL_GPU_BUFFER_SIZE."""
        if self.gpu_a is None:
            self.gpu_a = torch.empty(INITIAL_GPU_BUFFER_SIZE, dtype=torch.bfloat16, device=arg.device)
        if not self.double_buffer_off and self.gpu_b is None:
            self.gpu_b = torch.empty(INITIAL_GPU_BUFFER_SIZE, dtype=torch.bfloat16, device=arg.device)

    @staticmethod
    def grown(buffer: torch.Tensor, numel: int) -> torch.Tensor:
        """`buffer.resize_(numel)`: a new block of `numel` elements, the old one freed."""
        if numel <= buffer.numel():
            return buffer
        new = torch.empty(numel, dtype=buffer.dtype, device=buffer.device)
        del buffer
        return new


class UnslothCheckpointFunction(torch.autograd.Function):
    """unsloth_zoo 2026.10.9's UnslothCheckpointFunction (All Unsloth Zoo code licensed under LGPLv3): the memory."""

    @staticmethod
    def forward(ctx, run_function, state: UnslothState, *args):
        ctx.run_function, ctx.state = run_function, state
        ctx.inputs, ctx.tensor_indices, tensor_inputs = [], [], []
        ctx._requires_gradient, ctx._saved = False, None
        for i, arg in enumerate(args):
            if torch.is_tensor(arg):
                if arg.requires_grad:
                    ctx._requires_gradient = True
                if i == 0 and arg.requires_grad:
                    if state.first_pass:           # the last layer's index, counted in the first forward
                        state.last_gc_index += 1
                    state.current_gc_index += 1
                    store_dtype = torch.bfloat16 if arg.dtype == torch.float32 else arg.dtype
                    new_size = arg.numel() * store_dtype.itemsize
                    if new_size > state.row.min_bytes and (state.current_gc_index != state.last_gc_index
                                                           or state.first_pass):
                        _offload(ctx, state, arg, store_dtype, new_size)
                        tensor_inputs.append(None)
                    else:
                        tensor_inputs.append(arg)
                else:
                    tensor_inputs.append(arg)
                ctx.tensor_indices.append(i)
                ctx.inputs.append(None)
            else:
                ctx.inputs.append(arg)
        if ctx._requires_gradient:
            ctx.save_for_backward(*tensor_inputs)
        ctx.device_type = args[0].device.type if args and torch.is_tensor(args[0]) else "cpu"
        ctx.autocast = _autocast_state(ctx.device_type)
        with torch.no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx, *grads):
        if not ctx._requires_gradient:
            return None
        state: UnslothState = ctx.state
        inputs, tensors = list(ctx.inputs), ctx.saved_tensors
        for i, idx in enumerate(ctx.tensor_indices):
            inputs[idx] = tensors[i]
        reloaded = None
        if ctx._saved is not None:                  # back from the host, into the staging buffer
            new_size, shape, buffer_slot, saved_dtype, store_dtype = ctx._saved
            staging = state.gpu_b if (state.use_double_buffer and buffer_slot == 1) else state.gpu_a
            buffer = staging.view(torch.uint8)[:new_size].view(store_dtype).view(shape)
            if getattr(ctx, "_host", None) is not None:
                buffer.copy_(ctx._host, non_blocking=True)
            reloaded = buffer.detach() if store_dtype == saved_dtype else buffer.to(saved_dtype)
        state.backward_pass, state.first_pass, state.current_gc_index = True, False, 0
        detached = []
        for inp in inputs:
            if not isinstance(inp, torch.Tensor):
                detached.append(inp)
                continue
            x = inp.detach()
            x.requires_grad = inp.requires_grad
            detached.append(x)
        if reloaded is not None:
            reloaded.requires_grad_(True)
            detached[0] = reloaded
        with torch.enable_grad(), torch.autocast(ctx.device_type, **ctx.autocast):
            outputs = ctx.run_function(*detached)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=False) if torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(inp.grad if isinstance(inp, torch.Tensor) else None for inp in detached)


def _offload(ctx, state: UnslothState, arg: torch.Tensor, store_dtype: torch.dtype, new_size: int) -> None:
    """The offload branch of UnslothCheckpointFunction.forward: the staging buffers made and grown, a CPU_BUFFERS
    slot grown to `new_size` bytes, the input copied there (an fp32 input converted to bf16 on the device first)."""
    state.ensure_device_buffers(arg)
    if state.backward_pass:                         # a new graph: double buffering decided after the first pass
        state.backward_pass = False
        if not state.first_pass and not state.use_double_buffer and state.gpu_b is not None:
            state.use_double_buffer = True          # (mem_get_info above DOUBLE_BUFFER_HEADROOM assumed)
    gpu_numel = -(-new_size // state.gpu_a.element_size())
    state.gpu_a = state.grown(state.gpu_a, gpu_numel)
    if state.use_double_buffer:
        state.gpu_b = state.grown(state.gpu_b, gpu_numel)
    host = _host_empty(arg.shape, store_dtype, arg)
    if store_dtype != arg.dtype:                    # the non-blocking copy's conversion, on the device
        converted = arg.to(store_dtype)
        if not is_fake_tensor(arg):
            host.copy_(converted, non_blocking=True)
        del converted
    elif not is_fake_tensor(arg):
        host.copy_(arg, non_blocking=True)
    buffer_slot, state.next_slot = state.next_slot, state.next_slot ^ 1
    ctx._saved = (new_size, arg.shape, buffer_slot, arg.dtype, store_dtype)
    if not is_fake_tensor(arg):                     # the real step: the bytes come back through the staging buffer
        ctx._host = host


class OffloadedGradientCheckpointer(torch.autograd.Function):
    """unsloth_zoo's Unsloth_Offloaded_Gradient_Checkpointer (LLaMA-Factory's UnslothGradientCheckpointing,
    axolotl's CPU_Offloaded_Gradient_Checkpointer): the input to the host, back as a new device tensor."""

    @staticmethod
    def forward(ctx, forward_function, hidden_states, *args):
        ctx.device = hidden_states.device
        if is_fake_tensor(hidden_states):
            saved = _host_empty(hidden_states.shape, hidden_states.dtype, hidden_states)
        else:
            saved = hidden_states.to("cpu", non_blocking=True)
        ctx.device_type = hidden_states.device.type
        ctx.autocast = _autocast_state(ctx.device_type)
        with torch.no_grad():
            output = forward_function(hidden_states, *args)
        ctx.host = saved                            # (a meta tensor: not a saved tensor of this graph)
        ctx.forward_function, ctx.args = forward_function, args
        return output

    @staticmethod
    def backward(ctx, dY):
        host = ctx.host
        if host.device.type == "meta":
            hidden_states = torch.empty(host.shape, dtype=host.dtype, device=ctx.device)
        else:
            hidden_states = host.to(ctx.device, non_blocking=True)
        hidden_states = hidden_states.detach()
        hidden_states.requires_grad_(True)
        with torch.enable_grad(), torch.autocast(ctx.device_type, **ctx.autocast):
            output = ctx.forward_function(hidden_states, *ctx.args)
        if isinstance(output, tuple):
            (output,) = output
        torch.autograd.backward(output, dY)
        return (None, hidden_states.grad) + (None,) * len(ctx.args)


def install_ckpt_offload(model: nn.Module, name: str) -> None:
    """Each checkpointed GradientCheckpointingLayer's checkpoint function becomes --ckpt-offload NAME's Function
    (unsloth_checkpoint's call: the layer's keywords bound in transformers' partial, the hidden states positional)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    row = ckpt_offload(name)
    state = UnslothState(row)

    def unsloth_checkpoint(function, *args, **_kwargs):
        return UnslothCheckpointFunction.apply(function, state, *args)

    def offloaded_checkpoint(function, *args, **_kwargs):
        return OffloadedGradientCheckpointer.apply(function, *args)

    func = offloaded_checkpoint if row.staging == 0 else unsloth_checkpoint
    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing:
            m._gradient_checkpointing_func = func
