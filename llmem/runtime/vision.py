"""A vision-language model's training step on fake tensors: its images' inputs, the index values its vision code
reads on the host, and the parts a set-up leaves frozen.

transformers' Qwen2.5-VL reads index values on the host (the patch grid's `.tolist()`, the attention segments'
lengths, the windows' reordering), which a FakeTensorMode cannot answer. They depend only on image_grid_thw and the
token ids, which the set-up fixes, so they stay real:
- the images' grid (image_grid_thw) is a real tensor, and so is every tensor computed from real index tensors alone
  (`index_tensors_stay_real`: their values are read with `.tolist()` where the model reads them); their bytes are a
  few per patch, not traced;
- the window reordering and the vision rotary positions are computed before the fake mode by transformers' own
  functions (`get_vision_window_index`, `get_vision_position_ids`, `get_vision_attention_seqlens`) and returned
  where the model calls them (they build their tensors with factories, which the fake mode would make fake);
- the image tokens' count check reads a fake sum: the set-up made the count equal to the features' rows (checked
  on the real ids here), so it passes;
- the language model's 3-D rope positions come from the model's own get_rope_index on the real ids, handed to the
  forward as position_ids (a fake copy, allocated as the model allocates them).
The step itself is the real HF forward and backward (benchmarks/vlm_fake_step.py shows it bare).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_leaves, tree_map_only

from llmem.model.vision import frozen_parts, part_of, vision_spec
from llmem.model.vision_inputs import VisionInputs
from llmem.runtime.patches import patched


def freeze_parts(model: nn.Module, setup) -> None:
    """requires_grad_(False) on the frozen parts' parameters, as LLaMA-Factory's full fine-tuning does
    (_setup_full_tuning: a parameter whose name holds a forbidden module's key is not trained)."""
    parts = frozen_parts(setup)
    if not parts:
        return
    spec = vision_spec(model.config.model_type)
    for name, param in model.named_parameters():
        if part_of(spec, name) in parts:
            param.requires_grad_(False)


def language_lora_targets(model: nn.Module, names: list[str], all_linear: str) -> set[str]:
    """--lora-targets on a vision-language model as peft's target_modules: the full names of the language model's
    layers' linears so named (every one for all-linear), as LLaMA-Factory targets them with the vision tower and
    projector frozen (its defaults: patch_target_modules leaves out their modules) and as the trained anatomy
    counts them (llmem.model.peft.with_lora: the decoder layers' linears)."""
    prefix = vision_spec(model.config.model_type).language_layers + "."
    return {name for name, module in model.named_modules()
            if name.startswith(prefix) and isinstance(module, nn.Linear)
            and (all_linear in names or name.rsplit(".", 1)[-1] in names)}


@dataclass(frozen=True)
class VisionBatch:
    """One micro-batch's inputs beside its token ids, on real tensors (built before the fake mode)."""
    input_ids: torch.Tensor        # [batch, text + visual tokens]: each image's start, image tokens, end
    image_grid_thw: torch.Tensor   # [batch x images, 3]
    position_ids: torch.Tensor     # [3, batch, tokens]: the language model's 3-D rope positions
    patches: int                   # pixel_values' rows (every image of the batch)
    patch_values: int              # pixel_values' columns: channels x temporal x patch x patch


def _token_ids(cfg, batch_size: int, inputs: VisionInputs) -> torch.Tensor:
    """Random text ids (none a special token) with each image's tokens placed after the first text token, as the
    chat template writes them: <|vision_start|>, the image token repeated the image's visual tokens, <|vision_end|>
    (start and end count among the text tokens: llmem.model.vision_inputs.step_refusal checks they fit)."""
    special = torch.tensor([cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id,
                            cfg.vision_end_token_id])
    ids = torch.randint(0, cfg.get_text_config().vocab_size, (batch_size, inputs.language_tokens))
    ids[torch.isin(ids, special)] = 0
    cursor, tokens = 1, inputs.image.tokens
    for _ in range(inputs.images_per_sample):
        ids[:, cursor] = cfg.vision_start_token_id
        ids[:, cursor + 1:cursor + 1 + tokens] = cfg.image_token_id
        ids[:, cursor + 1 + tokens] = cfg.vision_end_token_id
        cursor += tokens + 2
    return ids


def vision_batch(hf_model: nn.Module, batch_size: int, inputs: VisionInputs) -> VisionBatch:
    """The micro-batch's ids, grid and 3-D positions as the processor and the model make them (real tensors)."""
    cfg = hf_model.config
    ids = _token_ids(cfg, batch_size, inputs)
    img = inputs.image
    grid = torch.tensor([[img.grid_t, img.grid_h, img.grid_w]] * (batch_size * inputs.images_per_sample))
    mm_types = (ids == cfg.image_token_id).int()
    positions, _ = hf_model.model.get_rope_index(ids, mm_token_type_ids=mm_types, image_grid_thw=grid)
    return VisionBatch(ids, grid, positions, batch_size * inputs.patches, img.patch_values)


def model_inputs(batch: VisionBatch, device: torch.device | None = None) -> tuple[torch.Tensor, dict]:
    """(token ids, the forward's other inputs). Under the fake mode (`device` None): the ids, pixel values and
    positions as fake tensors (allocated as on the device), the grid real. A real step (llmem measure): all of
    them on `device`, as the trainer moves the collated batch there."""
    if device is None:
        def place(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype)
        grid = batch.image_grid_thw
    else:
        def place(t: torch.Tensor) -> torch.Tensor:
            return t.to(device)
        grid = place(batch.image_grid_thw)
    pixel_values = torch.randn(batch.patches, batch.patch_values, device=device)
    return place(batch.input_ids), {"pixel_values": pixel_values, "image_grid_thw": grid,
                                    "position_ids": place(batch.position_ids)}


@contextlib.contextmanager
def index_tensors_stay_real(mode, seeds: tuple[torch.Tensor, ...]) -> Iterator[None]:
    """Under the fake mode `mode` (a FakeTensorMode), an op whose tensor arguments are all index tensors (the seeds, or computed
    from them alone) runs on the real values and its outputs join them: the values the model reads on the host
    (`lengths.tolist()`, `grid.prod(-1).tolist()`) are there when it reads them. Where they meet fake tensors
    (the windows' reordering of the hidden states) the mode takes them as inputs (allow_non_fake_inputs)."""
    known: dict[int, torch.Tensor] = {id(t): t for t in seeds}   # held, so no id is reused while the block runs
    mode_type = type(mode)
    original = mode_type.__torch_dispatch__

    def dispatch(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        if tensors and all(id(t) in known for t in tensors):
            with no_dispatch():
                out = func(*args, **(kwargs or {}))
            tree_map_only(torch.Tensor, lambda t: known.setdefault(id(t), t), out)
            return out
        return original(self, func, types, args, kwargs)

    with patched(mode_type, "__torch_dispatch__", dispatch), patched(mode, "allow_non_fake_inputs", True):
        yield


@contextlib.contextmanager
def known_vision_values(hf_model: nn.Module, batch: VisionBatch, mode) -> Iterator[None]:
    """The vision encoder's index values computed on the real grid and returned where the model asks
    (transformers 5's Qwen2.5-VL: module-level names of its modeling file), the index tensors kept real."""
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl as qwen
    from transformers import vision_utils as vu

    vc = hf_model.config.vision_config
    grid = batch.image_grid_thw
    image_tokens = int((batch.input_ids == hf_model.config.image_token_id).sum())
    if image_tokens * vc.spatial_merge_size ** 2 != batch.patches:
        raise AssertionError(f"{image_tokens} image tokens for {batch.patches} patches")
    positions = vu.get_vision_position_ids(grid, vc.spatial_merge_size)
    seqlens = vu.get_vision_attention_seqlens(grid, vc)
    windows = vu.get_vision_window_index(grid, vc.spatial_merge_size, vc.window_size, vc.patch_size)
    seeds = (grid, positions, *(t for t in (*seqlens, *windows) if isinstance(t, torch.Tensor)))
    with contextlib.ExitStack() as stack:
        for name, value in (("get_vision_position_ids", positions), ("get_vision_attention_seqlens", seqlens),
                            ("get_vision_window_index", windows)):
            stack.enter_context(patched(qwen, name, lambda *a, _v=value, **k: _v))
        # the image tokens' count against the features' rows (a fake sum): equal by construction, checked above
        stack.enter_context(patched(qwen, "torch_compilable_check", lambda *a, **k: None))
        stack.enter_context(index_tensors_stay_real(mode, seeds))
        yield
