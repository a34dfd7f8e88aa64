"""The real fine-tuning step that `trace` and `measure` both run.

One module builds it, so the two engines run the same PyTorch code: the HF model from its config (llmem.anatomy),
the distributed method through PyTorch's own APIs (DDP, FSDP2 `fully_shard`, `parallelize_module`) on a process
group of the target world size, the optimizer as PyTorch runs it on CUDA, and two iterations of
forward -> loss -> backward -> optimizer.step() -> optimizer.zero_grad(set_to_none=True).

The optimizers: torch.optim's AdamW (foreach, fused, for-loop), SGD and Adafactor; Lion is llmem's own code
(llmem.optimizers, the lion-pytorch update with foreach kernels); bitsandbytes' AdamW8bit / PagedAdamW8bit are
emulated (llmem.optimizers.EmulatedAdamW8bit: bnb's state tensors, paged ones counted as managed memory; its CUDA
kernels cannot run here). --optimizer-in-backward steps each parameter inside backward (post-accumulate-grad hooks,
one optimizer per parameter) and frees its gradient there. Activation options: --fused-ce replaces the lm_head's
forward by a fused linear cross-entropy (llmem.losses), so no [tokens, vocab] logits; --offload-activations packs
saved tensors to pinned host memory through saved-tensor hooks (ActivationOffload) until the lm_head.

Two ways of materialising the model:
- fake: under `FakeTensorMode`, every parameter is a fake *cpu* tensor (shapes and dtypes only, no memory). A fake
  'cuda' device cannot run backward on the CPU-only torch build (see docs/trace-notes §3.1), so the CUDA behaviour
  that matters for memory is emulated on the CPU keys by the context managers below.
- real: real random-initialised tensors on a device (cpu or cuda).

Multi-GPU methods run one rank (rank 0) on a fake process group (`init_process_group("fake", store=FakeStore())`):
collectives do nothing, but every buffer the method allocates (DDP buckets, FSDP all-gather / reduce-scatter buffers,
DTensor redistributions) is still a tensor. Under torchrun (WORLD_SIZE > 1) `measure` uses the real process group.

Every monkey-patch lives in a context manager that restores the original on exit.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from llmem.config import EIGHT_BIT_OPTIMIZERS, check_optimizer_method
from llmem.errors import LlmemError

PHASES = ("setup", "forward", "backward", "optimizer_step")

# --------------------------------------------------------------------------------------------------------------
# 1. CUDA's autocast op policy on the AutocastCPU dispatch key
# --------------------------------------------------------------------------------------------------------------
# The op lists of aten/src/ATen/autocast_mode.cpp for the CUDA key (torch 2.x). Only the ops whose policy differs
# between the two keys are re-registered on AutocastCPU; ops that both keys cast the same way keep the native kernel
# (linear, matmul, mm, bmm, addmm, baddbmm, conv*, sdpa -> lower precision; nll_loss, mse_loss, ... -> fp32).
# tests/test_tracer.py checks the result against the real AutocastCUDA kernels run on fake 'cuda' tensors.
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


class _CudaAutocastPolicy:
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
                            and _is_fake(args[0]):
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


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[_CudaAutocastPolicy]:
    """Make `torch.autocast("cpu")` cast ops the way `torch.autocast("cuda")` does (softmax, log_softmax, layer_norm,
    sum, exp, pow, ... come out fp32; CPU-only casts such as cross_entropy_loss are dropped)."""
    policy = _CudaAutocastPolicy()
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


# --------------------------------------------------------------------------------------------------------------
# 2. The kernels CUDA picks for dropout and scaled_dot_product_attention
# --------------------------------------------------------------------------------------------------------------

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
                 capability: tuple[int, int], gqa: bool = False) -> str:
    """The SDPA kernel PyTorch's CUDA dispatcher (sdp_utils.cpp) picks, with every backend enabled.

    As measured on torch 2.14 with a stand-in driver (docs/trace-notes §9): on sm90+ cuDNN attention takes
    no-dropout cases (with or without a mask), flash takes causal-with-dropout and mem-efficient masked-with-dropout;
    on sm80-89 flash takes unmasked half-precision cases and mem-efficient the rest; fp32 goes to mem-efficient.
    Grouped kv heads (enable_gqa, which transformers passes only without a mask): flash takes them natively,
    mem-efficient does not, and cuDNN is assumed not to (not measured), so fp32 GQA falls back to the math path."""
    half = dtype in (torch.float16, torch.bfloat16)
    flash_ok = half and capability >= (8, 0) and not has_mask and head_dim <= 256 and head_dim % 8 == 0
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
        backend = sdpa_backend(query.dtype, query.shape[-1], attn_mask is not None, dropout_p, capability, gqa)
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
            if bias.dtype == torch.bool:   # sdp::convert_boolean_attn_mask
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


@contextlib.contextmanager
def hf_untraced_masks(packed: bool = False) -> Iterator[None]:
    """transformers treats FakeTensors as "tracing" and then keeps data-dependent masks it would drop in a real run:
    with position ids of one sequence per row `find_packed_sequence_indices` returns None for real tensors, so the
    causal mask is skipped and SDPA runs with is_causal=True. Do the same ops and give the same answer for fake
    tensors. packed=True (--packing: position ids restart inside rows) returns the packed-sequence index, as the
    real run does, so the model builds its block-diagonal causal mask."""
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover
        yield
        return
    orig = getattr(masking_utils, "find_packed_sequence_indices", None)
    if orig is None:
        yield
        return

    def find_packed_sequence_indices(position_ids):
        if not _is_fake(position_ids):
            return orig(position_ids)
        first = position_ids[:, :1] - 1
        diff = torch.diff(position_ids, prepend=first, dim=-1)
        mask = (diff != 1).cumsum(-1)
        (mask[:, -1] == 0).all()     # the check the real run evaluates (True here unless packed)
        return mask if packed else None

    with _patched(masking_utils, "find_packed_sequence_indices", find_packed_sequence_indices):
        yield


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the deprecation / FSDP / config warnings the step triggers (restored on exit)."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.get_logger()   # configures the library's root logger now, not lazily inside the block
    loggers = [logging.getLogger(name) for name in ("transformers", "torch.distributed")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)


# --------------------------------------------------------------------------------------------------------------
# 3. Distributed plumbing on a fake process group
# --------------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise LlmemError("a process group is already initialised in this process: llmem emulates rank 0 on its own"
                         " fake process group")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _patched(obj, name: str, value) -> Iterator[None]:
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


@contextlib.contextmanager
def dtensor_propagation_untracked() -> Iterator[None]:
    """DTensor's sharding propagation builds global-shape shadow tensors in `detect_fake_mode() or FakeTensorMode()`.
    Under our fake mode those would be counted as real allocations: give them their own fake mode instead."""
    from torch.distributed.tensor import _sharding_prop

    with _patched(_sharding_prop, "detect_fake_mode", lambda *a, **k: None):
        yield


@contextlib.contextmanager
def device_mesh_outside_fake() -> Iterator[None]:
    """DeviceMesh bookkeeping (rank tensors) must run on real tensors, also when fully_shard slices a 2-D mesh
    inside the fake mode (FSDP2 over TP)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed import _mesh_layout, device_mesh

    DeviceMesh = device_mesh.DeviceMesh

    def outside(fn):
        def wrapper(*args, **kwargs):
            with unset_fake_temporarily():
                return fn(*args, **kwargs)
        return wrapper

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(DeviceMesh, "__init__", outside(DeviceMesh.__init__)))
        if hasattr(DeviceMesh, "_concatenate"):
            stack.enter_context(_patched(DeviceMesh, "_concatenate",
                                         staticmethod(outside(DeviceMesh._concatenate))))
        mesh_prop = DeviceMesh.__dict__.get("mesh")
        if isinstance(mesh_prop, property):
            stack.enter_context(_patched(DeviceMesh, "mesh", property(outside(mesh_prop.fget))))
        layout = getattr(_mesh_layout, "_MeshLayout", None)
        if layout is not None and hasattr(layout, "remap_to_tensor"):
            stack.enter_context(_patched(layout, "remap_to_tensor", outside(layout.remap_to_tensor)))
        yield


@contextlib.contextmanager
def ddp_on_fake_pg() -> Iterator[None]:
    """DDP's constructor checks and broadcasts module states across ranks (nothing to do for one emulated rank, and
    impossible on fake tensors)."""
    from torch.nn.parallel import distributed as pd

    noop = lambda *a, **k: None  # noqa: E731
    with _patched(pd, "_verify_param_shape_across_processes", noop), _patched(pd, "_sync_module_states", noop):
        yield


class _ReducerProxy:
    """DDP reducer whose `_rebuild_buckets` does nothing (it reads tensor data, which fake tensors lack).
    The buckets keep their first-iteration layout: the same total size (4 B x P for fp32 grads)."""

    def __init__(self, reducer) -> None:
        object.__setattr__(self, "_reducer", reducer)

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._reducer, name)

    def __setattr__(self, name, value):
        setattr(self._reducer, name, value)


def _completed_future_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# --------------------------------------------------------------------------------------------------------------
# 4. Model, method, optimizer
# --------------------------------------------------------------------------------------------------------------

def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    best: nn.ModuleList | None = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and (best is None or len(module) > len(best)):
            best = module
    if best is None:
        raise LlmemError(f"{type(model).__name__} has no list of decoder layers")
    return best


def build_meta_model(setup):
    """The HF causal LM on the meta device, with the setup's attention implementation, no KV cache, train mode."""
    from llmem.anatomy import build_meta_model as _build
    from llmem.anatomy import resolve_config

    # --attn flash: HF's flash_attention_2 needs the flash-attn package; its kernel is modelled by PyTorch's flash
    # SDPA kernel (same saved tensors: q, k, v, out, logsumexp), so the model runs its SDPA implementation
    attn = "sdpa" if setup.attn == "flash" else setup.attn
    _, cfg = resolve_config(setup.model, setup.trust_remote_code)
    cfg = cfg.__class__.from_dict(cfg.to_dict())
    cfg.use_cache = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cfg._attn_implementation = attn
        except Exception:  # noqa: BLE001 - some configs validate lazily; set_attn_implementation below decides
            pass
        model = _build(cfg, setup.trust_remote_code)
        if getattr(model.config, "_attn_implementation", None) != attn:
            try:
                model.set_attn_implementation(attn)
            except Exception as exc:  # noqa: BLE001
                raise LlmemError(f"{type(model).__name__} does not support attn={setup.attn!r}: {exc}") from None
    model.config.use_cache = False
    # from_config follows the config's torch_dtype (often fp16/bf16): training keeps fp32 parameters unless the
    # setup says pure bf16/fp16 (cast by the caller)
    model.to(torch.float32)
    model.train()
    return model


def apply_peft(model: nn.Module, setup) -> nn.Module:
    """peft on the meta model (adapters, prompts and the trainable set from peft itself): --lora-rank builds a
    LoraConfig, --peft-config loads the user's adapter_config.json. The frozen base is kept in the compute dtype, as
    fine-tuning scripts load it; adapters are fp32 under mixed precision (peft's autocast_adapter_dtype) and in the
    model dtype under pure bf16/fp16."""
    from peft import LoraConfig, get_peft_model

    from llmem.anatomy import apply_peft_config, read_peft_config

    if setup.peft_config:
        text, fields = read_peft_config(setup.peft_config)
        if fields.get("use_dora") and setup.quant_base != "none":
            raise LlmemError("DoRA on a bitsandbytes-quantised base is not emulated in trace (peft dequantises the "
                             "weight every forward); llmem estimate models it analytically")
        with quiet():
            peft_model = apply_peft_config(model, text, setup.mixed)
    else:
        targets = (setup.lora_targets if setup.lora_targets == "all-linear"
                   else [t.strip() for t in setup.lora_targets.split(",") if t.strip()])
        config = LoraConfig(r=setup.lora_rank, lora_alpha=setup.lora_alpha, lora_dropout=setup.lora_dropout,
                            target_modules=targets, task_type="CAUSAL_LM")
        with quiet():
            try:
                peft_model = get_peft_model(model, config, autocast_adapter_dtype=setup.mixed)
            except ValueError as exc:
                raise LlmemError(f"LoRA targets {setup.lora_targets!r}: {exc}") from None
    low = _low_dtype(setup)
    if setup.mixed and low is not None:
        cast: dict[int, nn.Parameter] = {}      # by identity, so tied weights stay one tensor
        for module in peft_model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and not p.requires_grad and p.is_floating_point():
                    if id(p) not in cast:
                        cast[id(p)] = nn.Parameter(p.to(low), requires_grad=False)
                    module._parameters[name] = cast[id(p)]
    return peft_model


def _collect_after_dora(model: nn.Module, stack: contextlib.ExitStack) -> None:
    """DoRA builds lora_weight = lora_B(lora_A(eye)) every forward and drops its graph unused. On CUDA those
    tensors die by reference counting when DoraLinearLayer.forward returns; under a Python dispatch mode (the
    trace's FakeTensorMode, measure's tracker) they sit in a reference cycle until the garbage collector runs,
    which made both depend on GC timing (checked: an untracked real run frees them at once). Collect right after each DoRA forward, where CUDA frees them. The objects alive at
    the first collection are frozen (gc.freeze), so the later full collections only scan the step's new objects."""
    import gc

    if not any(type(m).__name__ == "DoraLinearLayer" for m in model.modules()):
        return
    frozen: list[bool] = []

    def collect(*_) -> None:
        gc.collect()
        if not frozen:
            gc.freeze()
            frozen.append(True)
            stack.callback(gc.unfreeze)

    for module in model.modules():
        if type(module).__name__ == "DoraLinearLayer":
            stack.callback(module.register_forward_hook(collect).remove)


def _materialize_prompt_tokens(model: nn.Module, device) -> None:
    """peft's prompt learning keeps its virtual token ids in a plain dict (`prompt_tokens`, torch.arange made at
    get_peft_model): make them on the step's device (fake ones under FakeTensorMode)."""
    tokens = getattr(model, "__dict__", {}).get("prompt_tokens")
    if isinstance(tokens, dict):
        for name, ids in list(tokens.items()):
            tokens[name] = torch.arange(ids.numel(), dtype=ids.dtype, device=device)


def materialize(model: nn.Module, device: torch.device | str, dtype: torch.dtype | None = None) -> None:
    """Replace every meta parameter / buffer by an uninitialised tensor on `device` (a fake one when called under
    FakeTensorMode), keeping tied parameters tied and floating parameters in `dtype` when given."""
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            new = memo.get(id(p))
            if new is None:
                dt = dtype if (dtype is not None and p.is_floating_point()) else p.dtype
                new = nn.Parameter(torch.empty(p.shape, dtype=dt, device=device), requires_grad=p.requires_grad)
                memo[id(p)] = new
            module._parameters[name] = new
        for name, b in list(module._buffers.items()):
            if b is None:
                continue
            new = memo.get(id(b))
            if new is None:
                new = torch.zeros(b.shape, dtype=b.dtype, device=device)
                memo[id(b)] = new
            module._buffers[name] = new


def init_real_weights(model: nn.Module) -> None:
    """Random initialisation the HF way (normal(0, std) weights, unit norms, recomputed rotary frequencies)."""
    for module in model.modules():
        if hasattr(module, "_is_hf_initialized"):
            module._is_hf_initialized = False
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if hasattr(t, "_is_hf_initialized"):
                t._is_hf_initialized = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.initialize_weights()


def _tie_if_needed(model: nn.Module) -> None:
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if out is not None and inp is not None and getattr(model.config, "tie_word_embeddings", False) \
            and out.weight is not inp.weight and tuple(out.weight.shape) == tuple(inp.weight.shape):
        out.weight = inp.weight


# Megatron-style split per decoder layer: (column-parallel modules, row-parallel modules)
_TP_LAYER_PLANS = {
    "llama": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
              ("self_attn.o_proj", "mlp.down_proj")),
    "opt": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1"), ("self_attn.out_proj", "fc2")),
}


def tp_plan(model: nn.Module, family_type: str):
    """Column/row plans for parallelize_module, per architecture family."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    mt = family_type
    layers = _decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers)
    plan: dict[str, object] = {}
    family = "llama" if mt in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2") else mt
    if mt == "phi3":
        raise LlmemError("tp is not supported in trace for phi3 (fused qkv_proj / gate_up_proj)")
    if family in _TP_LAYER_PLANS:
        colwise, rowwise = _TP_LAYER_PLANS[family]
        for i in range(len(layers)):
            plan.update({f"{prefix}.{i}.{n}": ColwiseParallel() for n in colwise})
            plan.update({f"{prefix}.{i}.{n}": RowwiseParallel() for n in rowwise})
        embed = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    elif mt == "mixtral":
        raise LlmemError("tp is not supported in trace for mixtral: its experts are fused 3-D parameters")
    elif mt in ("gpt2", "gpt_bigcode"):
        raise LlmemError(f"tp is not supported in trace for {mt}: its Conv1D c_attn/c_fc/c_proj layers cannot be "
                         "split by torch's ColwiseParallel/RowwiseParallel (nn.Linear/nn.Embedding only)")
    else:
        raise LlmemError(f"tp is not supported in trace for model_type {mt!r} (supported: Llama/Mistral/Qwen2 "
                         "family and OPT)")
    plan[embed] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    head = next((n for n, m in model.named_modules() if m is model.get_output_embeddings()), None)
    if head is not None:
        plan[head] = ColwiseParallel(output_layouts=Replicate())
    return plan


def _fix_local_heads(model: nn.Module, tp: int) -> None:
    """Attention modules that view q/k/v with their configured head count need the per-rank count under TP."""
    for module in model.modules():
        for attr in ("num_heads", "num_key_value_heads"):
            value = module.__dict__.get(attr)
            if isinstance(value, int) and value % tp == 0 and hasattr(module, "head_dim"):
                setattr(module, attr, value // tp)


def apply_tensor_parallel(model: nn.Module, tp_mesh, tp: int) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tp_plan(model, model.config.model_type)
    tied = getattr(model.config, "tie_word_embeddings", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parallelize_module(model, tp_mesh, plan)
    if model.config.model_type == "opt":
        _fix_local_heads(model, tp)
    if tied:
        # embed (rowwise: Shard(0) over vocab) and lm_head (colwise: Shard(0) over vocab) shard the same way
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        if out is not None and out.weight is not inp.weight and out.weight.placements == inp.weight.placements:
            out.weight = inp.weight


def apply_fsdp(model: nn.Module, mesh, setup, reshard: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict = {"mesh": mesh, "reshard_after_forward": reshard}
    if setup.mixed:
        low = torch.bfloat16 if setup.precision.startswith("bf16") else torch.float16
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    for layer in _decoder_layers(model):
        fully_shard(layer, **kw)
    # the root as users write it: fully_shard's default (None) keeps the root gathered from forward to backward
    fully_shard(model, **{**kw, "reshard_after_forward": None if reshard else False})


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


def make_optimizer(model: nn.Module, optimizer: str, groups: list[dict] | None = None) -> torch.optim.Optimizer:
    """The optimizer as PyTorch runs it on CUDA. Under FakeTensorMode the default would be the for-loop
    implementation (FakeTensor is not a "foreach-supported" type), so the CUDA default (foreach) is explicit.
    Adafactor is the exception: torch defaults it to the for-loop implementation on CUDA too (foreach=None runs
    _single_tensor_adafactor, "as Adafactor is commonly used when memory is prohibitive"), so that is what runs.
    bitsandbytes' 8-bit AdamW is emulated (llmem.optimizers.EmulatedAdamW8bit: its exact state tensors)."""
    from llmem.optimizers import EmulatedAdamW8bit, Lion

    groups = param_groups(model) if groups is None else groups
    lr = 1e-5
    if optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, foreach=True)
    if optimizer == "adamw-fused":
        return torch.optim.AdamW(groups, lr=lr, fused=True)
    if optimizer == "adamw-forloop":
        return torch.optim.AdamW(groups, lr=lr, foreach=False)
    if optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.0, foreach=True)
    if optimizer == "sgd-momentum":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, foreach=True)
    if optimizer == "adafactor":
        return _Adafactor(groups, lr=lr, foreach=None)
    if optimizer == "lion":
        return Lion(groups, lr=lr)
    if optimizer in EIGHT_BIT_OPTIMIZERS:
        return EmulatedAdamW8bit(groups, lr=lr, paged=optimizer.startswith("paged"))
    raise LlmemError(f"unknown optimizer {optimizer!r}")


class _Adafactor(torch.optim.Adafactor):
    """torch.optim.Adafactor whose host-scalar reads work on fake tensors (fake_scalar_reads, only while it steps:
    the model's own code keeps the fake mode's usual errors)."""

    def step(self, closure=None):
        with fake_scalar_reads():
            return super().step(closure)


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
        out = {}
        for opt in self.optimizers.values():
            out.update(opt.state)
        return out

    @property
    def outside_allocator_bytes(self) -> int:
        return sum(getattr(o, "outside_allocator_bytes", 0) for o in self.optimizers.values())

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


@contextlib.contextmanager
def fake_scalar_reads() -> Iterator[None]:
    """Adafactor reads host scalars with `.item()` (the step count, param.norm(2), update.norm(2)), which a
    FakeTensor cannot answer (data-dependent). The reduction still runs (its output tensor is allocated as on
    CUDA); only the read of a fake tensor returns 1.0. Restored on exit."""
    from torch._subclasses.fake_tensor import is_fake

    orig = torch.Tensor.item

    def item(self):
        if is_fake(self):
            return 1.0
        return orig(self)

    torch.Tensor.item = item
    try:
        yield
    finally:
        torch.Tensor.item = orig


# --------------------------------------------------------------------------------------------------------------
# 5. The step
# --------------------------------------------------------------------------------------------------------------

OFFLOAD_MIN_BYTES = 1024   # torchtune's OffloadActivations(min_offload_size=1024)


class ActivationOffload:
    """Saved tensors go to pinned host memory in forward and come back in backward (torch.autograd.graph.
    save_on_cpu / torchtune's OffloadActivations, synchronous). As torchtune does, parameters and tensors under
    1 KiB stay where they are, and the output layer and the loss are not offloaded (torchtune's NoOpManager on the
    output projection; its loss runs outside the context): offloading stops at the lm_head's forward pre-hook.
    Unlike torchtune (which tests isinstance(Parameter) only), views of parameters - the transposed weight a linear
    saves - stay too: copying a weight that stays on the device anyway would only add weight-sized transients.

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
        return t.numel() * t.element_size() >= OFFLOAD_MIN_BYTES and (t.device.type != "cpu" or _is_fake(t))

    def pack(self, t: torch.Tensor):
        if not self.offloads(t):
            return t
        if _is_fake(t):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                host = torch.empty(t.shape, dtype=t.dtype, device="meta")
        else:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
        return (t.device, host)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        if host.device.type == "meta":
            return torch.empty(host.shape, dtype=host.dtype, device=device)
        return host.to(device, non_blocking=True)


@dataclass
class StepHooks:
    """Callbacks the engines plug in. All optional."""
    on_phase: Callable[[str, int], None] | None = None          # (phase, iteration)
    region: Callable[[str | None], contextlib.AbstractContextManager] | None = None  # category override


@dataclass
class TrainingStep:
    setup: object
    model: nn.Module            # the HF model (sharded in place under FSDP / TP)
    runner: nn.Module           # what the step calls: the model, or its DDP wrapper
    optimizer: torch.optim.Optimizer | InBackwardOptimizer
    input_ids: torch.Tensor
    layout: object
    device_type: str
    autocast_dtype: torch.dtype | None
    total_params: int
    hooks: StepHooks = field(default_factory=StepHooks)
    autocast_policy: _CudaAutocastPolicy | None = None
    offload: ActivationOffload | None = None
    position_ids: torch.Tensor | None = None   # --packing: positions restart at each packed sample

    def _phase(self, name: str, it: int) -> None:
        if self.hooks.on_phase is not None:
            self.hooks.on_phase(name, it)

    def iteration(self, it: int) -> None:
        ids = self.input_ids
        self._phase("forward", it)
        if self.autocast_dtype is not None:
            ctx = torch.autocast(self.device_type, dtype=self.autocast_dtype)
        else:
            ctx = contextlib.nullcontext()
        offload = self.offload
        with ctx, (offload.forward() if offload is not None else contextlib.nullcontext()):
            extra = {} if self.position_ids is None else {"position_ids": self.position_ids}
            loss = self.runner(input_ids=ids, labels=ids, **extra).loss   # the output (and its logits) dies here
        if self.autocast_policy is not None:
            self.autocast_policy.cache.clear()
        self._phase("backward", it)
        loss.backward()
        del loss
        self._phase("optimizer_step", it)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def run(self, iterations: int = 2, progress: Callable[[str], None] | None = None) -> None:
        for it in range(iterations):
            if progress:
                progress(f"iteration {it + 1}/{iterations}")
            self.iteration(it)


def _family_heads(model: nn.Module) -> tuple[int, int]:
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = next(getattr(text, n) for n in ("num_attention_heads", "n_head", "num_heads") if hasattr(text, n))
    kv = getattr(text, "num_key_value_heads", None) or getattr(text, "num_kv_heads", None) or heads
    return heads, kv


def _low_dtype(setup) -> torch.dtype | None:
    return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16, "bf16": torch.bfloat16,
            "fp16": torch.float16}.get(setup.precision)


@contextlib.contextmanager
def prepared_step(setup, *, fake: bool, device: str | torch.device = "cpu", cuda_kernels: bool = True,
                  fake_mode=None, hooks: StepHooks | None = None,
                  before_model: Callable[[], None] | None = None,
                  progress: Callable[[str], None] | None = None) -> Iterator[TrainingStep]:
    """Set up (patches, process group, model, method, optimizer, inputs), yield the step, tear down on exit.

    fake: materialise under `fake_mode` (a FakeTensorMode the caller owns; entered here) on the fake cpu device.
    cuda_kernels: with fake tensors, run the ops of CUDA's fused SDPA kernels (their meta kernels); real CPU cannot.
    before_model: called once the fake mode is entered, before any parameter exists (trackers start there).
    """
    from llmem.hardware import resolve_gpu
    from llmem.methods import resolve_layout

    hooks = hooks or StepHooks()
    device = torch.device(device)
    say = progress or (lambda msg: None)
    gpu = resolve_gpu(setup.gpu, setup.gpu_memory, setup.cuda_context)

    with quiet():
        model = build_meta_model(setup)
    if setup.precision in ("bf16", "fp16"):
        model.to(_low_dtype(setup))   # still on meta: dtype only
    if setup.quant_base != "none":    # bitsandbytes' quantised linears, emulated (llmem.quant_emulation)
        from llmem.quant_emulation import quantize_base

        quantize_base(model, setup, fake=fake)
    if setup.peft:
        model = apply_peft(model, setup)
    if setup.quant_base != "none":
        from llmem.quant_emulation import wrap_quant_adapters

        wrap_quant_adapters(model)
    total_params = sum(p.numel() for p in model.parameters())
    heads, kv_heads = _family_heads(model)
    layout = resolve_layout(setup.method, setup.gpus, setup.tp, setup.gpus_per_node, heads, kv_heads)
    check_optimizer_method(setup, layout.method)
    low = _low_dtype(setup)
    autocast_dtype = low if (setup.mixed and layout.method in ("single", "ddp", "tp")) else None
    on_cuda = device.type == "cuda"
    sharded = layout.method in ("fsdp", "zero2", "tp", "fsdp+tp")

    with contextlib.ExitStack() as stack:
        stack.enter_context(quiet())
        real_pg = False
        if layout.method != "single":
            import torch.distributed as dist
            env_ws = int(os.environ.get("WORLD_SIZE", "1"))
            if not fake and env_ws > 1:
                if env_ws != layout.world_size:
                    raise LlmemError(f"torchrun started {env_ws} processes but the setup needs {layout.world_size}")
                if not dist.is_initialized():
                    dist.init_process_group("nccl" if on_cuda else "gloo")
                    stack.callback(dist.destroy_process_group)
                real_pg = True
            else:
                stack.enter_context(fake_process_group(layout.world_size))
        policy = None
        if not on_cuda:
            if autocast_dtype is not None:
                policy = stack.enter_context(cuda_autocast_policy())
            stack.enter_context(cuda_like_dropout())
            if fake and cuda_kernels:
                stack.enter_context(cuda_like_sdpa(gpu.compute_capability,
                                                   "flash" if setup.attn == "flash" else None))
        elif setup.attn == "flash":   # a real GPU: PyTorch's flash SDPA kernel only
            from torch.nn.attention import SDPBackend, sdpa_kernel
            stack.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION]))
        mesh = None
        if sharded:
            from torch.distributed.device_mesh import init_device_mesh
            stack.enter_context(dtensor_propagation_untracked())
            stack.enter_context(device_mesh_outside_fake())
            dims = {"fsdp": ((layout.dp,), ("dp",)), "zero2": ((layout.dp,), ("dp",)),
                    "tp": ((layout.tp,), ("tp",)), "fsdp+tp": ((layout.dp, layout.tp), ("dp", "tp"))}
            shape, names = dims[layout.method]
            mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        if layout.method == "ddp" and not real_pg:
            stack.enter_context(ddp_on_fake_pg())
        packing = setup.packing
        if packing and setup.attn == "flash" and not fake:
            raise LlmemError("--packing with --attn flash needs the flash-attn package's varlen kernel (HF "
                             "flash_attention_2); llmem models it but cannot run it")
        if fake:
            # flash attention packs through cu_seqlens (varlen kernel, no mask): the same saved tensors as unpacked
            # rows, so the traced flash step gets no packed mask
            stack.enter_context(hf_untraced_masks(packed=packing and setup.attn != "flash"))
            stack.enter_context(fake_mode)
        if before_model is not None:
            before_model()

        if setup.grad_ckpt:
            enable_checkpointing(model, setup.ckpt_every)
        if setup.fused_ce:
            install_fused_ce(model, layout)

        say("materialising the model")
        if fake:
            materialize(model, "cpu")
            _materialize_prompt_tokens(model, "cpu")
            _collect_after_dora(model, stack)
            runner = _apply_method(model, layout, mesh, setup, hooks, fake_pg=True)
        else:
            if sharded:   # shard on meta, then allocate only the local shards
                _apply_method(model, layout, mesh, setup, hooks, fake_pg=not real_pg)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model.to_empty(device=device)
            _tie_if_needed(model)
            init_real_weights(model)
            _collect_after_dora(model, stack)       # measure's tracker makes the same cycle as fake tensors
            runner = model
            if not sharded:
                runner = _apply_method(model, layout, mesh, setup, hooks, fake_pg=not real_pg)
        if setup.optimizer_in_backward:
            optimizer = InBackwardOptimizer(model, setup.optimizer, hooks.region)
        else:
            optimizer = make_optimizer(model, setup.optimizer)
        ids = torch.randint(0, _vocab_size(model), (setup.batch_size, setup.seq_len), dtype=torch.int64,
                            device="cpu" if fake else device)
        positions = packed_position_ids(setup.batch_size, setup.seq_len, ids.device) if packing else None
        offload = None
        if setup.offload_activations:
            lm = _causal_lm(model)
            offload = ActivationOffload(lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None)
        step = TrainingStep(setup, model, runner, optimizer, ids, layout, "cpu" if fake else device.type,
                            autocast_dtype, total_params, hooks, policy, offload, positions)
        say("running the step")
        yield step


def enable_checkpointing(model: nn.Module, every: int = 1) -> list[int]:
    """HF activation checkpointing (non-reentrant), then switched off on the decoder layers not checkpointed:
    layer i keeps it when i % every == 0, as transformers' `_set_gradient_checkpointing(every_n_layers=...)`
    counts (torchtune's selective option counts from 1: (i + 1) % every == 0). Returns the checkpointed indices."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if every > 1 and not layers:
        raise LlmemError(f"{type(model).__name__} has no GradientCheckpointingLayer: --grad-ckpt-every needs "
                         "transformers' per-layer checkpointing")
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i % every == 0
    return [i for i, layer in enumerate(layers) if layer.gradient_checkpointing]


def _causal_lm(model: nn.Module) -> nn.Module:
    """The HF *ForCausalLM module inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def install_fused_ce(model: nn.Module, layout) -> None:
    """The step's loss becomes llmem.losses' fused linear cross-entropy: the causal LM's forward runs its base
    model for the final hidden states and calls the lm_head module, whose forward is the fused loss (so module
    hooks - FSDP2's root unshard, DDP's reducer, the tracer's module tracker - fire as with the plain head).
    The forward is replaced on the instance: peft, DDP and FSDP2 all reach it through `module.forward`."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from llmem.losses import fused_linear_cross_entropy

    lm = _causal_lm(model)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    base = getattr(lm, "base_model", None)
    if head is None or base is None or base is lm or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise LlmemError(f"--fused-ce needs a causal LM with a base model and a linear lm_head; "
                         f"{type(lm).__name__} has none")
    text = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    if getattr(text, "final_logit_softcapping", None):
        raise LlmemError("--fused-ce does not model final_logit_softcapping (Gemma-2)")

    def head_forward(hidden, labels):
        return fused_linear_cross_entropy(hidden, head.weight, getattr(head, "bias", None), labels)

    def lm_forward(input_ids=None, labels=None, **kwargs):
        kwargs.pop("logits_to_keep", None)
        kwargs.pop("return_dict", None)
        out = base(input_ids=input_ids, **kwargs)
        hidden = out[0]
        del out
        if labels is None:
            raise LlmemError("--fused-ce computes the loss only: the step must pass labels")
        return CausalLMOutputWithPast(loss=head(hidden, labels))

    head.forward = head_forward
    lm.forward = lm_forward


PACKED_SAMPLES = 2   # --packing: samples per row in the traced step (the mask's size does not depend on it)


def packed_position_ids(batch: int, seq: int, device) -> torch.Tensor:
    """Position ids of rows holding PACKED_SAMPLES samples each (DataCollatorWithFlattening's layout)."""
    per = -(-seq // PACKED_SAMPLES)
    return (torch.arange(seq, device=device) % per).expand(batch, seq).contiguous()


def _vocab_size(model: nn.Module) -> int:
    emb = model.get_input_embeddings()
    return int(getattr(emb, "num_embeddings", None) or model.config.get_text_config().vocab_size)


def _apply_method(model: nn.Module, layout, mesh, setup, hooks: StepHooks, fake_pg: bool) -> nn.Module:
    """Apply the distributed method in place (FSDP2, TP) or wrap (DDP). Returns the module the step calls."""
    method = layout.method
    if method == "single":
        return model
    if method == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        region = hooks.region("communication_buffers") if hooks.region else contextlib.nullcontext()
        dev = next(model.parameters()).device
        with region:
            ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
        if fake_pg:
            ddp.register_comm_hook(None, _completed_future_hook)
            ddp.reducer = _ReducerProxy(ddp.reducer)
        return ddp
    if method in ("fsdp", "zero2"):
        apply_fsdp(model, mesh, setup, reshard=(method == "fsdp"))
        return model
    if method == "tp":
        apply_tensor_parallel(model, mesh, layout.tp)
        return model
    if method == "fsdp+tp":
        apply_tensor_parallel(model, mesh["tp"], layout.tp)
        apply_fsdp(model, mesh["dp"], setup, reshard=True)
        return model
    raise LlmemError(f"unknown method {method!r}")
