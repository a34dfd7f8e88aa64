"""CUDA's behaviour on the CPU keys, where it changes memory: the autocast op policy, the fused dropout kernel's
bool mask, and the SDPA kernel CUDA's dispatcher picks (fake tensors: their meta kernels give the memory).

A fake 'cuda' device cannot run backward on the CPU-only torch build, so the step runs on fake *cpu* tensors and
these context managers make the CPU dispatch keys behave as CUDA's do. Each restores what it replaced on exit.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from llmem.errors import LlmemError

# --------------------------------------------------------------------------------------------------------------
# 1. CUDA's autocast op policy on the AutocastCPU dispatch key
# --------------------------------------------------------------------------------------------------------------
# The op lists of aten/src/ATen/autocast_mode.cpp for the CUDA key (torch 2.x). Only the ops whose policy differs
# between the two keys are re-registered on AutocastCPU; ops that both keys cast the same way keep the native kernel
# (linear, matmul, mm, bmm, addmm, baddbmm, conv*, sdpa -> lower precision; nll_loss, mse_loss, ... -> fp32).
# tests/runtime/test_tracer.py checks the result against the real AutocastCUDA kernels run on fake 'cuda' tensors.
_CUDA_LOWER_PRECISION = (
    "_convolution", "convolution", "cudnn_convolution", "cudnn_convolution_transpose", "addmv", "addr", "mv",
    "einsum", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell",
    "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
)

_CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "rms_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "dist",
    "pdist", "renorm", "logsumexp", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
    "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d",
    "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)

_CUDA_FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)

_CUDA_FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}

_CUDA_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "index_put", "scatter_add",
                 "tensordot")


# Registered on AutocastCPU only: CUDA lets them through uncast. cat/stack "promote" on CPU, which is what they do
# without autocast anyway, so they keep the native kernel.
_CPU_ONLY_KEEP = {"cat", "stack"}


def _op(name: str):
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base)
    return getattr(packet, overload or "default")


def _registered(name: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", key)


def _is_eligible(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 \
        and t.device.type == "cpu"


class CudaAutocastPolicy:
    """Python kernels for the AutocastCPU key that apply CUDA's casting policy."""

    def __init__(self) -> None:
        self.cache: dict[int, tuple[weakref.ref, torch.Tensor]] = {}   # lower-precision casts of leaf weights
        self.exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    # cached_cast(to_type, arg) of autocast_mode.h
    def _cast(self, value, dtype, cache_ok: bool):
        if isinstance(value, (list, tuple)):
            return type(value)(self._cast(v, dtype, cache_ok) for v in value)
        if not _is_eligible(value) or value.dtype == dtype:
            return value
        if cache_ok and value.dtype == torch.float32 and value.requires_grad and value.is_leaf \
                and not value._is_view() and torch.is_autocast_cache_enabled():
            hit = self.cache.get(id(value))
            if hit is not None and hit[0]() is value:
                return hit[1]
            out = value.to(dtype)
            self.cache[id(value)] = (weakref.ref(value), out)
            return out
        return value.to(dtype)

    def lower(self, op):
        def kernel(*args, **kwargs):
            dtype = torch.get_autocast_dtype("cpu")
            with torch._C._ExcludeDispatchKeyGuard(self.exclude):
                args = self._cast(args, dtype, True)
                kwargs = {k: self._cast(v, dtype, True) for k, v in kwargs.items()}
                return op(*args, **kwargs)
        return kernel

    def fp32(self, op):
        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(self.exclude):
                args = self._cast(args, torch.float32, False)
                kwargs = {k: self._cast(v, torch.float32, False) for k, v in kwargs.items()}
                return op(*args, **kwargs)
        return kernel

    def set_opt_dtype(self, op):
        names = [a.name for a in op._schema.arguments]
        idx = names.index("dtype")
        half_to_float = {"softmax": torch.ops.aten._softmax.default,
                         "log_softmax": torch.ops.aten._log_softmax.default}.get(op._schema.name.split("::")[1])

        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(self.exclude):
                if not (args and _is_eligible(args[0])):
                    return op(*args, **kwargs)
                args = list(args)
                current = args[idx] if idx < len(args) else kwargs.get("dtype")
                if current is None:
                    if idx < len(args):
                        args[idx] = torch.float32
                    else:
                        kwargs["dtype"] = torch.float32
                    # at::native::softmax on CUDA: fp16 input + dtype=float runs _softmax(half_to_float=True), with no
                    # fp32 copy of the input. Only the fake (meta) kernel accepts that on the cpu device.
                    if half_to_float is not None and args[0].dtype == torch.float16 \
                            and is_fake_tensor(args[0]):
                        return half_to_float(args[0], args[1], True)
                return op(*args, **kwargs)
        return kernel

    def append_dtype(self, op, target):
        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(self.exclude):
                if args and _is_eligible(args[0]):
                    return target(*args, **kwargs, dtype=torch.float32)
                return op(*args, **kwargs)
        return kernel

    def promote(self, op):
        def kernel(*args, **kwargs):
            dtype = torch.get_autocast_dtype("cpu")
            for t in _flat_tensors((args, kwargs)):
                if _is_eligible(t) and t.dtype == torch.float32:
                    dtype = torch.float32
            with torch._C._ExcludeDispatchKeyGuard(self.exclude):
                args = self._cast(args, dtype, dtype != torch.float32)
                kwargs = {k: self._cast(v, dtype, dtype != torch.float32) for k, v in kwargs.items()}
                return op(*args, **kwargs)
        return kernel


def _flat_tensors(tree) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _flat_tensors(v)
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _flat_tensors(v)


def is_fake_tensor(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[CudaAutocastPolicy]:
    """Make `torch.autocast("cpu")` cast ops the way `torch.autocast("cuda")` does (softmax, log_softmax, layer_norm,
    sum, exp, pow, ... come out fp32; CPU-only casts such as cross_entropy_loss are dropped)."""
    policy = CudaAutocastPolicy()
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in _CUDA_LOWER_PRECISION:
                if _registered(name, "AutocastCUDA"):
                    lib.impl(name, policy.lower(_op(name)), "AutocastCPU")
            for name in _CUDA_FP32:
                if _registered(name, "AutocastCUDA"):
                    lib.impl(name, policy.fp32(_op(name)), "AutocastCPU")
            for name in _CUDA_FP32_SET_OPT_DTYPE:
                if _registered(name, "AutocastCUDA"):
                    lib.impl(name, policy.set_opt_dtype(_op(name)), "AutocastCPU")
            for name, target in _CUDA_FP32_APPEND_DTYPE.items():
                if _registered(name, "AutocastCUDA"):
                    lib.impl(name, policy.append_dtype(_op(name), _op(target)), "AutocastCPU")
            for name in _CUDA_PROMOTE:
                if _registered(name, "AutocastCUDA"):
                    lib.impl(name, policy.promote(_op(name)), "AutocastCPU")
            cuda = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
            for full in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"):
                name = full.split("::", 1)[1]
                if full not in cuda and name not in _CPU_ONLY_KEEP:
                    lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
        yield policy
    finally:
        lib._destroy()
        policy.cache.clear()


def _cuda_dropout(input, p=0.5, training=True, inplace=False):
    """F.dropout as CUDA runs it: the fused `native_dropout`, which saves a bool mask (1 B/elem); CPU's
    bernoulli_ + mul saves a mask in the input dtype."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0 or input.numel() == 0 or p == 1.0 or not input.is_floating_point():
        return _ORIG_DROPOUT(input, p, training, inplace)
    out = torch.ops.aten.native_dropout(input, p, True)[0]
    if inplace:
        return input.copy_(out)
    return out


_ORIG_DROPOUT = F.dropout


@contextlib.contextmanager
def cuda_like_dropout() -> Iterator[None]:
    saved = F.dropout
    F.dropout = _cuda_dropout
    try:
        yield
    finally:
        F.dropout = saved


def sdpa_backend(dtype: torch.dtype, head_dim: int, has_mask: bool, dropout_p: float,
                 capability: tuple[int, int], gqa: bool = False, value_head_dim: int | None = None) -> str:
    """The SDPA kernel PyTorch's CUDA dispatcher (sdp_utils.cpp) picks, with every backend enabled.

    As measured on torch 2.14 with a stand-in CUDA driver (a CUDA build of torch on a machine without a GPU,
    asking the dispatcher for its choice per capability): on sm90+ cuDNN attention takes
    no-dropout cases (with or without a mask), flash takes causal-with-dropout and mem-efficient masked-with-dropout;
    on sm80-89 flash takes unmasked half-precision cases and mem-efficient the rest; fp32 goes to mem-efficient.
    Grouped kv heads (enable_gqa, which transformers passes only without a mask): flash takes them natively,
    mem-efficient does not, and cuDNN is assumed not to (not measured), so fp32 GQA falls back to the math path."""
    half = dtype in (torch.float16, torch.bfloat16)
    # flash needs one head dim for q, k and v (sdp_utils.cpp check_head_dim_size_flash): MLA's 192 / 128 does not
    flash_ok = half and capability >= (8, 0) and not has_mask and head_dim <= 256 and head_dim % 8 == 0 \
        and value_head_dim in (None, head_dim)
    cudnn_ok = half and capability >= (9, 0) and dropout_p == 0.0 and head_dim <= 128 and head_dim % 8 == 0 \
        and not gqa
    if cudnn_ok:
        return "cudnn"
    if flash_ok:
        return "flash"
    return "math" if gqa else "efficient"


def _make_cuda_sdpa(capability: tuple[int, int], force: str | None = None):
    aten = torch.ops.aten

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if torch.is_autocast_enabled("cpu"):
            # aten::scaled_dot_product_attention is on CUDA's lower-precision autocast list: its inputs are cast
            # before the kernel choice (HF's rotary embedding can hand over fp32 q/k)
            low = torch.get_autocast_dtype("cpu")
            query, key, value = (t.to(low) if _is_eligible(t) else t for t in (query, key, value))
            if attn_mask is not None and _is_eligible(attn_mask):
                attn_mask = attn_mask.to(low)
        gqa = bool(enable_gqa) and key.shape[-3] != query.shape[-3]
        backend = sdpa_backend(query.dtype, query.shape[-1], attn_mask is not None, dropout_p, capability, gqa,
                               value.shape[-1])
        if force == "flash":   # --attn flash: the flash kernel whatever the dispatcher would pick
            if attn_mask is not None or query.dtype not in (torch.float16, torch.bfloat16):
                raise LlmemError("--attn flash: flash attention takes no mask and needs fp16/bf16 inputs "
                                 f"(got a {'mask' if attn_mask is not None else query.dtype})")
            backend = "flash"
        if backend == "math":
            return aten._scaled_dot_product_attention_math(
                query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=True)[0]
        need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        bias = None
        if attn_mask is not None:
            bias = attn_mask
            if bias.dtype == torch.bool:
                # sdp::convert_boolean_attn_mask: where(!mask, -inf, scalar_tensor(0, query dtype)), no fp32 copy
                bias = torch.where(bias.logical_not(), -math.inf,
                                   torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device))
            bias = bias.expand(*query.shape[:-1], key.shape[-2])
        if backend == "flash":
            return aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if backend == "cudnn":
            return aten._scaled_dot_product_cudnn_attention(
                query, key, value, bias, need_lse, dropout_p, is_causal, False, scale=scale)[0]
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, need_lse, dropout_p, is_causal, scale=scale)[0]

    return sdpa


@contextlib.contextmanager
def cuda_like_sdpa(capability: tuple[int, int], force: str | None = None) -> Iterator[None]:
    """F.scaled_dot_product_attention runs the CUDA fused kernel's op (fake tensors only: their meta kernels give
    the memory). With dropout the CPU dispatcher falls back to the math path, which keeps the B*H*S^2 matrix.
    force="flash" runs PyTorch's flash kernel always (--attn flash)."""
    saved = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _make_cuda_sdpa(capability, force)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = saved

