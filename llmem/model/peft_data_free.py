"""peft adapters whose initialisation reads the base weights' values, built from shapes alone. llmem builds the
model on the meta device, where those values do not exist; the memory of the step depends on the adapters' shapes,
dtypes and trainable set, which these paths keep:

- peft's own `get_peft_model(..., low_cpu_mem_usage=True)` (peft/mapping_func.py; the adapters are made under
  `init_empty_weights`, on the meta device, and the inits that read the base weight skip or run on shapes: LoRA's
  MiCA (`LoraLayer.mica_init` returns on a meta lora_B), PiSSA / OLoRA's SVD and QR on meta tensors);
- SHiRA's mask (`ShiraConfig.mask_fn`, peft's documented hook for a custom mask; its `random_mask` puts the mask on
  the base weight's device, where `torch.where` cannot count it): a mask with the same number of entries,
  r * (in + out), made on the host. Which entries are chosen does not change the memory: the adapter keeps that
  many values and their indices whatever they are.

The estimate says so in its notes (DATA_FREE_NOTE)."""

from __future__ import annotations

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


def data_free_config(config) -> None:
    """The config's value-reading hooks replaced by their data-free stand-ins (in place)."""
    if callable(getattr(config, "mask_fn", None)):
        config.mask_fn = host_mask


def data_free_note(peft_model) -> str | None:
    """DATA_FREE_NOTE when `peft_model` was built by this path, else None."""
    return getattr(peft_model, DATA_FREE_ATTR, None)
