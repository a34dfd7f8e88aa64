"""bitsandbytes' quantised linears emulated for the trace (its CUDA kernels cannot run on fake tensors).

`quantize_base` replaces the modules transformers' bitsandbytes integration would replace by modules that hold
exactly bitsandbytes' storage tensors (llmem.memory.quant) and whose autograd functions allocate what bitsandbytes' kernels
allocate (the dequantised weight, the absmax temporaries, LLM.int8's input quantisation buffers) and keep what
they keep. The values are not computed (fake tensors have none), so the emulation is for the trace only.

The modules subclass nn.Linear so that peft wraps them as it wraps any linear (its bitsandbytes dispatch needs the
real bnb classes); `wrap_quant_adapters` then gives those LoRA layers the forward of peft's own
`lora.bnb.Linear4bit` / `Linear8bitLt` (no cast of the input to the adapter dtype under autocast; the 4-bit one
clones the base output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmem.errors import LlmemError
from llmem.memory.quant import NESTED_BLOCK, NF4_BLOCK
from llmem.units import ceil_div


class _MatMul4Bit(torch.autograd.Function):
    """bitsandbytes.autograd._functions.MatMul4Bit through gemm_4bit's dequantise + F.linear path."""

    @staticmethod
    def forward(ctx, A, packed, bias, mod):
        if mod.double_quant:   # _dequant_linear_fallback: absmax_dq, then absmax_dq + offset, both live
            absmax_dq = torch.empty_like(mod.absmax, dtype=torch.float32)
            absmax = absmax_dq + mod.offset
        w = torch.empty((mod.out_features, mod.in_features), dtype=A.dtype, device=A.device)
        out = F.linear(A, w, bias)
        if mod.double_quant:
            del absmax, absmax_dq
        ctx.mod = mod          # the packed weight only (a parameter): nothing of A is kept
        return out

    @staticmethod
    def backward(ctx, grad_output):
        mod = ctx.mod
        grad_a = None
        if ctx.needs_input_grad[0]:
            if mod.double_quant:   # F.dequantize_4bit: dequantize_blockwise(absmax) += offset
                absmax = torch.empty_like(mod.absmax, dtype=torch.float32)
                absmax += mod.offset
            w = torch.empty((mod.out_features, mod.in_features), dtype=mod.quant_dtype, device=grad_output.device)
            grad_a = torch.matmul(grad_output, w.to(grad_output.dtype))
        return grad_a, None, None, None


class Linear4bitEmulated(nn.Linear):
    """bitsandbytes.nn.Linear4bit (NF4, blocksize 64) with its Params4bit storage and QuantState tensors."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype, double_quant: bool) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        dev = linear.weight.device
        n = self.in_features * self.out_features
        blocks = ceil_div(n, NF4_BLOCK)
        self.weight = nn.Parameter(torch.empty((ceil_div(n, 2), 1), dtype=torch.uint8, device=dev),
                                   requires_grad=False)
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.double_quant = double_quant
        self.compute_dtype = compute_dtype
        self.quant_dtype = compute_dtype     # QuantState.dtype: the weight was loaded in the compute dtype
        f32 = torch.float32
        if double_quant:
            self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8, device=dev), persistent=False)
            self.register_buffer("nested_absmax", torch.empty(ceil_div(blocks, NESTED_BLOCK), dtype=f32,
                                                              device=dev), persistent=False)
            self.register_buffer("nested_code", torch.empty(256, dtype=f32, device=dev), persistent=False)
            self.register_buffer("offset", torch.empty((), dtype=f32, device=dev), persistent=False)
        else:
            self.register_buffer("absmax", torch.empty(blocks, dtype=f32, device=dev), persistent=False)
        self.register_buffer("code", torch.empty(16, dtype=f32, device=dev), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp_dtype = x.dtype              # Linear4bit.forward: compute in compute_dtype, return in the input dtype
        x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        return _MatMul4Bit.apply(x, self.weight, bias, self).to(inp_dtype)


class _MatMul8bitLt(torch.autograd.Function):
    """bitsandbytes.autograd._functions.MatMul8bitLt (CUDA, frozen int8 weight, no outlier columns)."""

    @staticmethod
    def forward(ctx, A, weight, bias, mod):
        a2 = A.reshape(-1, A.shape[-1])
        a16 = a2.to(torch.float16)                                    # int8_vectorwise_quant(A.to(fp16))
        ca = torch.empty(a2.shape, dtype=torch.int8, device=A.device)
        sca = torch.empty(a2.shape[0], dtype=torch.float32, device=A.device)
        del a16
        acc = torch.empty((a2.shape[0], mod.out_features), dtype=torch.int32, device=A.device)  # int8 matmul
        out = torch.empty((a2.shape[0], mod.out_features), dtype=A.dtype, device=A.device)     # mm_dequant
        if bias is not None:
            out.add_(bias)
        del acc, ca, sca
        ctx.mod = mod
        ctx.grad_shape = A.shape
        ctx.dtype_a = A.dtype
        ctx.a = a2 if ctx.needs_input_grad[0] else None              # ctx.tensors = (CAt, subA, A)
        return out.reshape(*A.shape[:-1], mod.out_features)

    @staticmethod
    def backward(ctx, grad_output):
        mod = ctx.mod
        grad_a = None
        if ctx.needs_input_grad[0]:
            g = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
            cb = mod.weight.to(ctx.dtype_a, copy=True).mul_(mod.SCB.unsqueeze(1).mul(1.0 / 127.0))
            grad_a = torch.matmul(g.to(ctx.dtype_a), cb).view(ctx.grad_shape)
        ctx.a = None
        return grad_a, None, None, None


class Linear8bitLtEmulated(nn.Linear):
    """bitsandbytes.nn.Linear8bitLt (has_fp16_weights=False): Int8Params int8 [out, in] and SCB fp32 [out]."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        dev = linear.weight.device
        self.weight = nn.Parameter(torch.empty((self.out_features, self.in_features), dtype=torch.int8,
                                               device=dev), requires_grad=False)
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.register_buffer("SCB", torch.empty(self.out_features, dtype=torch.float32, device=dev),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return _MatMul8bitLt.apply(x, self.weight, bias, self)


def quantize_base(model: nn.Module, setup, fake: bool) -> int:
    """Replace every linear transformers' bitsandbytes integration quantises (all nn.Linear but the output
    embedding and tied weights) by its emulation, in place on the meta model. Returns how many were replaced."""
    if setup.quant_base == "none":
        return 0
    if not fake:
        raise LlmemError("a bitsandbytes-quantised base runs only in the trace (its kernels are emulated there): "
                         "llmem measure does not run bitsandbytes")
    from transformers.pytorch_utils import Conv1D

    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inp_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = {id(inp_emb.weight)} if inp_emb is not None else set()
    replaced = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                raise LlmemError("a quantised base is traced for nn.Linear models only (GPT-2's Conv1D is not "
                                 "emulated); llmem estimate models it")
            if type(child) is not nn.Linear or child is out_emb or id(child.weight) in tied:
                continue
            if setup.quant_base == "nf4":
                new = Linear4bitEmulated(child, getattr(torch, setup.compute_dtype), setup.double_quant)
            else:
                new = Linear8bitLtEmulated(child)
            setattr(module, child_name, new)
            replaced += 1
    return replaced


def _lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft.tuners.lora.bnb.Linear4bit / Linear8bitLt.forward (vanilla LoRA, adapters active)."""
    result = self.base_layer(x, *args, **kwargs)
    if isinstance(self.base_layer, Linear4bitEmulated):
        result = result.clone()          # "defensively clone" (peft, for 4-bit)
    for active in self.active_adapters:
        if active not in self.lora_A.keys():
            continue
        lora_a, lora_b = self.lora_A[active], self.lora_B[active]
        # peft tests torch.is_autocast_enabled() (CUDA); the trace runs CUDA's autocast policy on the cpu key
        requires_conversion = not torch.is_autocast_enabled(x.device.type)
        xa = x
        if requires_conversion:
            expected = result.dtype
            xa = self._cast_input_dtype(x, lora_a.weight.dtype)
        output = lora_b(lora_a(self.lora_dropout[active](xa))) * self.scaling[active]
        if requires_conversion:
            output = output.to(expected)
        result = result + output
    return result


def prepare_for_kbit_training(model: nn.Module) -> None:
    """peft.prepare_model_for_kbit_training's upcast (the QLoRA recipe): every fp16/bf16 parameter that is not a
    quantised weight becomes fp32 (by identity, so tied weights stay tied). Its other steps: the base is frozen
    already; gradient checkpointing is the set-up's --grad-ckpt (non-reentrant, so no input-grad hook)."""
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.dtype in (torch.float16, torch.bfloat16):
                if id(p) not in cast:
                    cast[id(p)] = nn.Parameter(p.to(torch.float32), requires_grad=p.requires_grad)
                module._parameters[name] = cast[id(p)]


def wrap_quant_adapters(model: nn.Module) -> int:
    """After peft: give its LoRA layers around emulated quantised linears the forward of peft's bitsandbytes LoRA
    layers, and hide the quantisation constants from DDP's buffer broadcast (bitsandbytes keeps them in its
    QuantState, not as module buffers)."""
    from peft.tuners.lora import Linear as LoraLinear

    prepare_for_kbit_training(model)
    ignored = [f"{name}.{b}" for name, m in model.named_modules()
               if isinstance(m, (Linear4bitEmulated, Linear8bitLtEmulated)) for b, _ in m.named_buffers()]
    if ignored:
        model._ddp_params_and_buffers_to_ignore = ignored
    cls = None
    swapped = 0
    for module in model.modules():
        if isinstance(module, LoraLinear) and isinstance(module.base_layer,
                                                         (Linear4bitEmulated, Linear8bitLtEmulated)):
            if module.lora_variant:
                continue                 # DoRA & co. keep peft's own forward
            if cls is None:
                cls = type("QuantLoraLinear", (LoraLinear,), {"forward": _lora_forward})
            module.__class__ = cls
            swapped += 1
    return swapped
