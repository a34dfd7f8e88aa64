"""peft adapters whose initialisation reads the base weights' values, built from shapes alone. llmem builds the
model on the meta device, where those values do not exist; the memory of the step depends on the adapters' shapes,
dtypes and trainable set, which these paths keep:

- peft's own `get_peft_model(..., low_cpu_mem_usage=True)` (peft/mapping_func.py; the adapters are made under
  `init_empty_weights`, on the meta device, and the inits that read the base weight skip or run on shapes: LoRA's
  MiCA (`LoraLayer.mica_init` returns on a meta lora_B), PiSSA / OLoRA's SVD and QR on meta tensors);
- SHiRA's mask (`ShiraConfig.mask_fn`, peft's documented hook for a custom mask; its `random_mask` puts the mask on
  the base weight's device, where `torch.where` cannot count it): a mask with the same number of entries,
  r * (in + out), made on the host. Which entries are chosen does not change the memory: the adapter keeps that
  many values and their indices whatever they are;
- FRoD's projections (peft/tuners/frod/model.py `FrodModel._init_frod_projections`: a QR / SVD of each target
  category's stacked base weights copied to the host, run before the adapters exist, which low_cpu_mem_usage does
  not skip; `FrodLayer._calculate_frod_u_and_lambda`: a solve against the base weight): peft's own code runs, its
  two value computations give meta tensors of their shapes (V [in, in]; U [out, in] and lambda_l [in]) and a meta
  tensor's copy to the host stays on meta (frod_on_meta). The sparse pattern (a seeded randperm of the
  off-diagonal positions) reads no weight: it is peft's own, real.

The estimate says so in its notes (DATA_FREE_NOTE)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

DATA_FREE_ATTR = "llmem_data_free"       # set on a peft model built by this path: the note
DATA_FREE_NOTE = ("built data-free: its initialisation reads the base weights' values, which a model built from "
                  "shapes (the meta device) has not; the adapters have peft's shapes, dtypes and trainable set, "
                  "their initial values are not computed")


def host_mask(base_layer, r: int, **_kwargs):
    """A SHiRA mask (peft/tuners/shira/mask_functions.py's contract: [out, in], r * (in + out) ones) on the host."""
    import torch  # (an estimate from a cached anatomy imports no torch)
    from peft.tuners.tuners_utils import _get_in_out_features

    in_features, out_features = _get_in_out_features(base_layer)
    mask = torch.zeros(out_features * in_features, dtype=torch.bool)
    mask[: r * (in_features + out_features)] = True
    return mask.view(out_features, in_features)


def frod_projection(matrices, _regularization_alpha):
    """FRoD's shared basis V of one category ([in, in], float32 as peft's `_projection_from_weights` returns it:
    vh.T of the stacked weights' full SVD, or R.T @ eigenvectors of their QR), on meta."""
    import torch

    in_features = matrices[0].shape[1]
    return torch.empty((in_features, in_features), dtype=torch.float32, device="meta")


def frod_u_and_lambda(_layer, v, w):
    """FRoD's U [out, in] and lambda_l [in] of one module (`FrodLayer._calculate_frod_u_and_lambda`: bi = solve(V,
    W.T).T, its column norms and its normalised columns, float32), on meta."""
    import torch

    return (torch.empty((w.shape[0], v.shape[0]), dtype=torch.float32, device="meta"),
            torch.empty((v.shape[0],), dtype=torch.float32, device="meta"))


@contextlib.contextmanager
def frod_on_meta() -> Iterator[None]:
    """peft's FRoD built on the meta model: its value computations on meta (frod_projection, frod_u_and_lambda),
    and `.cpu()` / `.to("cpu")` of a meta tensor the meta tensor (in the dtype asked)."""
    import peft.tuners.frod.model as frod_model
    import torch
    from peft.tuners.frod.layer import FrodLayer
    from torch.overrides import TorchFunctionMode

    class MetaStaysMeta(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in (torch.Tensor.cpu, torch.Tensor.to) and args and getattr(args[0], "is_meta", False):
                if func is torch.Tensor.cpu:
                    return args[0]
                args = tuple("meta" if isinstance(a, (str, torch.device)) else a for a in args)
                kwargs = {k: ("meta" if k == "device" else v) for k, v in kwargs.items()}
            return func(*args, **kwargs)

    saved = frod_model._projection_from_weights, FrodLayer._calculate_frod_u_and_lambda
    frod_model._projection_from_weights, FrodLayer._calculate_frod_u_and_lambda = frod_projection, frod_u_and_lambda
    try:
        with MetaStaysMeta():
            yield
    finally:
        frod_model._projection_from_weights, FrodLayer._calculate_frod_u_and_lambda = saved


# peft types whose build needs more than low_cpu_mem_usage: the context it is built in
DATA_FREE_BUILDS = {"FROD": frod_on_meta}


def data_free_build(peft_type: str):
    """The context a data-free build of `peft_type` runs in (a null context for those peft's own path covers)."""
    return DATA_FREE_BUILDS.get(peft_type, contextlib.nullcontext)()


def data_free_config(config) -> None:
    """The config's value-reading hooks replaced by their data-free stand-ins (in place)."""
    if callable(getattr(config, "mask_fn", None)):
        config.mask_fn = host_mask


def data_free_note(peft_model) -> str | None:
    """DATA_FREE_NOTE when `peft_model` was built by this path, else None."""
    return getattr(peft_model, DATA_FREE_ATTR, None)
