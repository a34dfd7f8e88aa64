"""Quantised linears emulated for the trace: bitsandbytes' (its CUDA kernels cannot run on fake tensors) and torchao's
NF4Tensor (kept out of llmem's dependencies; its eager dequantisation is re-run here op for op).

`quantize_base` replaces the modules the quantising library would replace by modules that hold exactly its storage
tensors (llmem.memory.quant) and whose autograd functions allocate what its kernels allocate (the dequantised weight,
the absmax temporaries, LLM.int8's input quantisation buffers, torchao's int64 nibble planes) and keep what they keep.
The values are not computed (fake tensors have none), so the emulation is for the trace only.

The modules subclass nn.Linear so that peft wraps them as it wraps any linear (its bitsandbytes dispatch needs the
real bnb classes); `wrap_quant_adapters` then gives those LoRA layers the forward of peft's own
`lora.bnb.Linear4bit` / `Linear8bitLt` (no cast of the input to the adapter dtype under autocast; the 4-bit one
clones the base output). torchtune's LoRALinear over an NF4 weight computes what peft's lora.Linear does
(base output + lora_b(lora_a(dropout(x))) * scaling, adapters in the model dtype), so its forward stays peft's.
Under FSDP2 the tensors the library lets FSDP shard are parameters (bitsandbytes' packed weight in the compute
dtype, bnb_4bit_quant_storage; NF4Tensor's three inner tensors FSDP2 all-gathers), the rest buffers (replicated).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmem.errors import LlmemError
from llmem.memory.quant import AO_QUANT_UNIT, NESTED_BLOCK, NF4_BLOCK, check_quantisable, quant_layout
from llmem.model.anatomy import ParamInfo
from llmem.setup.methods import METHODS
from llmem.setup.objectives import CAST_EXEMPT, QUANTISED_ADAPTER_DTYPE
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

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype, double_quant: bool,
                 quant_storage: torch.dtype = torch.uint8) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        dev = linear.weight.device
        n = self.in_features * self.out_features
        blocks = ceil_div(n, NF4_BLOCK)
        # _quantize_4bit: out [(n + 1) // (itemsize * 2), 1] in quant_storage (the compute dtype for FSDP-QLoRA)
        packed = (n + 1) // (quant_storage.itemsize * 2)
        self.weight = nn.Parameter(torch.empty((packed, 1), dtype=quant_storage, device=dev), requires_grad=False)
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


def nf4_original_weight(mod: LinearNF4Emulated) -> torch.Tensor:
    """torchao NF4Tensor.get_original_weight (0.18), op for op on the module's (gathered) inner tensors."""
    first_elements = (mod.weight >> 4).to(torch.long)
    second_elements = (mod.weight & 0b1111).to(torch.long)
    dequantized_first = mod.nf4[first_elements]
    dequantized_second = mod.nf4[second_elements]
    # dequantize_scalers: int8 scalers over their per-256 factor, in the weight's dtype, plus the mean
    n_scaler_blocks = mod.quantized_scalers.numel() // NESTED_BLOCK
    scalers = (mod.quantized_scalers.view(n_scaler_blocks, NESTED_BLOCK)
               / mod.quantization_factor.unsqueeze(-1)).flatten().to(mod.compute_dtype) + mod.scaler_mean
    repeated = scalers.unsqueeze(-1).expand(scalers.size(0), NF4_BLOCK // 2)
    scaled_first = dequantized_first * repeated.flatten()
    scaled_second = dequantized_second * repeated.flatten()
    scaled_first = scaled_first.unsqueeze(-1).transpose(0, 1)
    scaled_second = scaled_second.unsqueeze(-1).transpose(0, 1)
    return torch.stack([scaled_first, scaled_second], dim=-1).reshape(mod.out_features, mod.in_features)


class _LinearNF4(torch.autograd.Function):
    """torchao's LinearNF4: F.linear(x, w.to(x.dtype)); it saves only the NF4 weight (a parameter) and dequantises
    it again in backward for grad_output @ w."""

    @staticmethod
    def forward(ctx, x, packed, mod):
        ctx.mod = mod
        return F.linear(x, nf4_original_weight(mod).to(x.dtype))

    @staticmethod
    def backward(ctx, grad_output):
        grad_x = grad_output @ nf4_original_weight(ctx.mod).to(grad_output.dtype) if ctx.needs_input_grad[0] \
            else None
        return grad_x, None, None


class LinearNF4Emulated(nn.Linear):
    """torchtune's FrozenNF4Linear / LoRALinear(quantize_base=True) base: a torchao NF4Tensor weight (to_nf4 with
    block_size 64, scaler_block_size 256) as its inner tensors. `weight` is quantized_data; quantized_scalers and
    quantization_factor are parameters too (FSDP2 shards and all-gathers the three), scaler_mean and the nf4 table
    buffers. `compute_dtype` stands for the NF4Tensor's dtype (the model's), which peft reads as the base layer's
    dtype when it places the adapters."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        dev = linear.weight.device
        n = self.in_features * self.out_features
        self.compute_dtype = dtype

        def frozen(numel: int, dt: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(numel, dtype=dt, device=dev), requires_grad=False)

        self.weight = frozen(n // 2, torch.uint8)                             # quantized_data
        self.quantized_scalers = frozen(n // NF4_BLOCK, torch.int8)
        self.quantization_factor = frozen(n // AO_QUANT_UNIT, dtype)
        self.register_buffer("scaler_mean", torch.empty((), dtype=dtype, device=dev), persistent=False)
        self.register_buffer("nf4", torch.empty(16, dtype=dtype, device=dev), persistent=False)
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _LinearNF4.apply(x, self.weight, self)
        return out if self.bias is None else out + self.bias


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


# the emulated module per quantised base (llmem.setup.quant_bases' rows): (the nn.Linear, its compute dtype, the
# set-up, whether FSDP2 shards it) -> the module holding the library's storage
EMULATIONS: dict[str, Callable[[nn.Linear, torch.dtype, Any, bool], nn.Module]] = {
    "nf4": lambda child, dtype, setup, sharded: Linear4bitEmulated(child, dtype, setup.double_quant,
                                                                   dtype if sharded else torch.uint8),
    "int8": lambda child, dtype, setup, sharded: Linear8bitLtEmulated(child),
    "torchao-nf4": lambda child, dtype, setup, sharded: LinearNF4Emulated(child, dtype),
}


def quantize_base(model: nn.Module, setup, fake: bool) -> int:
    """Replace every linear the quantising library replaces (all nn.Linear but the output embedding and tied
    weights: transformers' bitsandbytes integration, torchtune's QLoRA builders) by its emulation, in place on the
    meta model. Returns how many were replaced."""
    if not setup.quant_spec.quantised:
        return 0
    if not fake:
        raise LlmemError("a quantised base runs only in the trace (its kernels are emulated there): llmem measure "
                         "runs neither bitsandbytes nor torchao")
    from transformers.pytorch_utils import Conv1D

    sharded = METHODS[setup.method].shards_model_states
    shards = setup.gpus if sharded else 1            # FSDP2 over every GPU (no TP with a quantised base)
    dtype = getattr(torch, setup.compute_dtype)
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inp_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = {id(inp_emb.weight)} if inp_emb is not None else set()
    replaced = 0
    for prefix, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                raise LlmemError("a quantised base is traced for nn.Linear models only (GPT-2's Conv1D is not "
                                 "emulated); llmem estimate models it")
            if type(child) is not nn.Linear or child is out_emb or id(child.weight) in tied:
                continue
            name = f"{prefix}.{child_name}.weight" if prefix else f"{child_name}.weight"
            check_quantisable(ParamInfo(name, tuple(child.weight.shape), "float32", "Linear", None, None),
                              setup.quant_base, shards)
            setattr(module, child_name, EMULATIONS[setup.quant_base](child, dtype, setup, sharded))
            replaced += 1
    return replaced


def _lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft.tuners.lora.bnb.Linear4bit / Linear8bitLt.forward (vanilla LoRA, never merged here). Under peft's
    disable_adapter() (TRL's reference forward of a LoRA policy: trl.trainer.utils.use_adapter(model, None)) it is
    the base layer alone: no clone, no adapters."""
    result = self.base_layer(x, *args, **kwargs)
    if self.disable_adapters:
        return result
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
    quantised weight (its class is not Params4bit: bitsandbytes' packed weight in a float quant_storage stays) becomes
    fp32, by identity so tied weights stay tied. It runs before get_peft_model, so peft's adapters (the trainable
    parameters here) are not touched. Its other steps: the base is frozen already; gradient checkpointing is the
    set-up's --grad-ckpt (non-reentrant, so no input-grad hook)."""
    packed = {id(m.weight) for m in model.modules() if isinstance(m, Linear4bitEmulated)}
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.dtype in (torch.float16, torch.bfloat16) and not p.requires_grad \
                    and id(p) not in packed:
                if id(p) not in cast:
                    cast[id(p)] = nn.Parameter(p.to(torch.float32), requires_grad=False)
                module._parameters[name] = cast[id(p)]


def wrap_quant_adapters(model: nn.Module, setup=None) -> int:
    """After peft: the kbit upcast where the set-up runs it (TrainingSetup.kbit_upcasts), its LoRA layers around
    emulated bitsandbytes linears given the forward of peft's bitsandbytes LoRA layers, and the quantisation constants
    hidden from DDP's buffer broadcast (the libraries keep them in a QuantState / the NF4Tensor, not as module
    buffers)."""
    from peft.tuners.lora import Linear as LoraLinear

    if setup is None or setup.kbit_upcasts:
        prepare_for_kbit_training(model)
    emulated = (Linear4bitEmulated, Linear8bitLtEmulated, LinearNF4Emulated)
    ignored = [f"{name}.{b}" for name, m in model.named_modules()
               if isinstance(m, emulated) for b, _ in m.named_buffers()]
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


def trainer_adapter_cast(model: nn.Module) -> int:
    """TRL's QLoRA cast, as the trainers' __init__ runs it after get_peft_model (trl/trainer/sft_trainer.py,
    dpo_trainer.py, kto_trainer.py, ...: `if _is_quantized_model: for name, param in model.named_parameters(): if
    param.requires_grad and "lora_magnitude_vector" not in name: param.data = param.data.to(torch.bfloat16)`;
    llmem.setup.objectives.cast_by_trainer says where). The Parameter objects stay, so the optimizer built after
    holds bf16 parameters and keeps bf16 states; returns how many were cast."""
    cast = 0
    for name, param in model.named_parameters():
        if param.requires_grad and CAST_EXEMPT not in name:
            param.data = param.data.to(getattr(torch, QUANTISED_ADAPTER_DTYPE))
            cast += 1
    return cast


def emulation_note(setup) -> str:
    """What the trace says about the quantised base it emulates."""
    if not setup.quant_spec.bitsandbytes:
        return ("torchao NF4Tensor base (torchtune's QLoRA): its inner tensors and the eager dequantisation "
                "(get_original_weight) re-run op for op on fake tensors; torchao itself is not imported")
    sharded = (", the packed weights in the compute dtype (bnb_4bit_quant_storage) sharded by FSDP2"
               if quant_layout(setup.quant_base).sharded and METHODS[setup.method].shards_model_states else "")
    return (f"bitsandbytes {setup.quant_base} base: its CUDA kernels are emulated (storage tensors, dequantisation / "
            f"int8 buffers as bitsandbytes allocates them), not run{sharded}")
