"""Liger-Kernel's RMSNorm, SwiGLU and RoPE (liger_kernel 0.8, ops/rms_norm.py, ops/swiglu.py, ops/rope.py) in pure
PyTorch, with the tensors their autograd Functions save and allocate (llmem.setup.liger), installed as Liger's
monkey_patch does: over the family's RMSNorm and MLP instances (its row names the classes), as LigerRMSNorm's and
LigerSwiGLUMLP's forwards, and for rope over the modeling module's apply_rotary_pos_emb (restored on exit).

Where Liger's Triton kernels work a row at a time in registers, these run over chunks of ROWS rows (their fp32
temporaries, at most ROWS x width x 4 bytes a few times over, are the only tensors Liger does not make)."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from llmem.errors import LlmemError
from llmem.memory.activations.liger import DW_PARTIAL_ROWS
from llmem.setup.liger import LIGER_FAMILIES

ROWS = 64     # rows per chunk of the emulation's arithmetic


def _chunks(n: int):
    return ((s, min(s + ROWS, n)) for s in range(0, n, ROWS))


class RMSNormFunction(torch.autograd.Function):
    """LigerRMSNormFunction, casting_mode "llama": y = w * (x * rstd).to(x.dtype), rstd in fp32; saves X and RSTD."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float):
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        for s, e in _chunks(x2.shape[0]):
            xc = x2[s:e].float()
            rstd[s:e] = torch.rsqrt(xc.pow(2).mean(-1) + eps)
            y[s:e] = w * (xc * rstd[s:e, None]).to(x.dtype)
        ctx.save_for_backward(x, w, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, rstd = ctx.saved_tensors
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        partial = torch.zeros(DW_PARTIAL_ROWS, x2.shape[1], dtype=torch.float32, device=x.device) \
            if ctx.needs_input_grad[1] else None
        for s, e in _chunks(x2.shape[0]):        # dX written over dY (in_place=True)
            xhat = x2[s:e].float() * rstd[s:e, None]
            g = dy2[s:e].float() * w.float()
            if partial is not None:
                partial[0] += (dy2[s:e].float() * xhat.to(x.dtype).float()).sum(0)
            dy2[s:e] = (rstd[s:e, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(dy.dtype)
        dw = partial.sum(0).to(w.dtype) if partial is not None else None
        return dy2.view(dy.shape), dw, None


class SiLUMulFunction(torch.autograd.Function):
    """LigerSiLUMulFunction: c = silu(a) * b (silu in fp32); saves a and b; backward writes da, db over them."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor):
        c = torch.empty_like(a)
        a2, b2, c2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), c.view(-1, a.shape[-1])
        for s, e in _chunks(a2.shape[0]):
            c2[s:e] = (F.silu(a2[s:e].float()) * b2[s:e].float()).to(c.dtype)
        ctx.save_for_backward(a, b)
        return c

    @staticmethod
    def backward(ctx, dc: torch.Tensor):
        a, b = ctx.saved_tensors
        a2, b2, dc2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), dc.reshape(-1, dc.shape[-1])
        for s, e in _chunks(a2.shape[0]):
            af, bf, g = a2[s:e].float(), b2[s:e].float(), dc2[s:e].float()
            sig = torch.sigmoid(af)
            silu = af * sig
            a2[s:e] = (g * bf * (sig * (1 + af * (1 - sig)))).to(a.dtype)
            b2[s:e] = (g * silu).to(b.dtype)
        return a, b


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x [b, s, heads, d] rotated in place, HF's x * cos + rotate_half(x) * sin (cos, sin [b or 1, s, d]), in
    chunks of ROWS positions."""
    half = x.shape[-1] // 2
    for s, e in _chunks(x.shape[1]):
        xc = x[:, s:e].float()
        c, sn = cos[:, s:e, None, :].float(), sin[:, s:e, None, :].float()
        rotated = torch.cat((-xc[..., half:], xc[..., :half]), dim=-1)
        x[:, s:e] = (xc * c + rotated * sn).to(x.dtype)


class RopeFunction(torch.autograd.Function):
    """LigerRopeFunction: q, k [b, heads, s, d] rotated in place in their [b, s, heads, d] storage; saves cos, sin;
    backward rotates dq, dk in place by -sin."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        cos, sin = (cos, sin) if cos.ndim == 3 else (cos[None], sin[None])
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        _rotate(q, cos, sin)
        _rotate(k, cos, sin)
        ctx.save_for_backward(cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor):
        cos, sin = ctx.saved_tensors
        dq, dk = dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous()
        _rotate(dq, cos, -sin)
        _rotate(dk, cos, -sin)
        return dq.transpose(1, 2), dk.transpose(1, 2), None, None


def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """liger_kernel.transformers.rope.liger_rotary_pos_emb: HF's apply_rotary_pos_emb signature."""
    return RopeFunction.apply(q, k, cos, sin)


@contextlib.contextmanager
def liger_rope(model_type: str) -> Iterator[None]:
    """Liger's rope patch (modeling_<family>.apply_rotary_pos_emb = liger_rotary_pos_emb), restored on exit."""
    module = importlib.import_module(LIGER_FAMILIES[model_type].modeling)
    original = module.apply_rotary_pos_emb
    module.apply_rotary_pos_emb = liger_rotary_pos_emb
    try:
        yield
    finally:
        module.apply_rotary_pos_emb = original


def install_liger(model: nn.Module, kernels: tuple[str, ...]) -> None:
    """Liger's apply_liger_kernel_to_<family>(model=...) for rms_norm / swiglu: the forward of every instance of the
    family's RMSNorm and MLP classes replaced (on the instance, as install_fused_ce does)."""
    config = getattr(model, "config", None)
    family = LIGER_FAMILIES.get(getattr(config, "model_type", None))
    if family is None:
        raise LlmemError(f"--liger: no Liger patch for {getattr(config, 'model_type', type(model).__name__)}")
    for module in model.modules():
        name = type(module).__name__
        if "rms_norm" in kernels and name == family.norm_class:
            module.forward = _norm_forward(module)
        elif "swiglu" in kernels and name == family.mlp_class:
            module.forward = _mlp_forward(module)


def _norm_forward(norm: nn.Module):
    """LigerRMSNorm.forward: the Function on the module's weight and eps."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    return lambda x: RMSNormFunction.apply(x, norm.weight, eps)


def _mlp_forward(mlp: nn.Module):
    """LigerSwiGLUMLP.forward: down_proj(SiLUMul(gate_proj(x), up_proj(x)))."""
    return lambda x: mlp.down_proj(SiLUMulFunction.apply(mlp.gate_proj(x), mlp.up_proj(x)))
