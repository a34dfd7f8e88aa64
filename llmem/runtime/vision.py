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
Qwen3-VL reads the rotary positions and segments as Qwen2.5-VL does (no windows); its learned position table is
resampled to each grid by taps and weights (`get_vision_interpolation_indices_and_weights`) it never reads on the
host: computed on the real grid, they are made on the device (fake tensors of their shapes) when the model asks.
Its language model adds the deepstack features at the image tokens after each of its first layers
(`hidden_states[visual_pos_masks, :]`), whose true count fake tensors cannot know: the set-up fixes it
(`image_mask_counts`, llmem.runtime.known_masks).
Gemma 3 reads nothing on the host but the image tokens' count check (answered as above); its forward takes the
processor's token_type_ids (1 on the image tokens: their bidirectional attention mask), made from the real ids.
LLaVA-OneVision reads each image's size (image_sizes) and each sample's image count (batch_num_images) on the host,
to count each image's crops, cut its tiles' features and unpad them (get_image_features, pack_image_features): both
stay real, as Qwen's grid does, and so does what is computed from them alone.
Idefics3 / SmolVLM take the processor's pixel_attention_mask beside [batch, frames, 3, size, size] pixel values, drop
the all-zero padding frames by a bool mask and read each sample's count of real frames on the host: every frame the
set-up makes is real, which `_RealFrames` answers (llmem.runtime.known_masks).
Llama 3.2 Vision reads nothing on the host: its images' aspect-ratio ids and tile mask and the text's
cross-attention mask are made by transformers' own processor functions from the real ids (`_tile_inputs`) and handed
over as fake tensors of their shapes.
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

from llmem.model.images import PROCESSORS, pixel_values_shape
from llmem.model.sharding import linear_layer_class
from llmem.model.vision import VisionLanguageSpec, frozen_parts, part_of, vision_spec
from llmem.model.vision_inputs import VisionInputs
from llmem.runtime.cuda import is_fake_tensor
from llmem.runtime.known_masks import KnownMasks
from llmem.runtime.losses import IGNORE_INDEX
from llmem.runtime.patches import patched

_aten = torch.ops.aten


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
    counts them (llmem.model.peft.with_lora: the decoder layers' linears); a linear layer as
    llmem.model.sharding.linear_layer_class says (not Llama 4's router)."""
    prefix = vision_spec(model.config.model_type).language_layers + "."
    return {name for name, module in model.named_modules()
            if name.startswith(prefix) and isinstance(module, nn.Linear) and linear_layer_class(type(module).__name__)
            and (all_linear in names or name.rsplit(".", 1)[-1] in names)}


@dataclass(frozen=True)
class VisionBatch:
    """One micro-batch's inputs beside its token ids, on real tensors (built before the fake mode)."""
    input_ids: torch.Tensor        # [batch, text + visual tokens]: each image's start, image tokens, end
    pixel_shape: tuple[int, ...]   # pixel_values' (llmem.model.images.pixel_values_shape)
    patches: int                   # the vision encoder's patches (every image of the batch)
    image_grid_thw: torch.Tensor | None = None   # [batch x images, 3], where the forward takes it (Qwen)
    # the forward's other inputs from the ids, by keyword: Qwen's 3-D rope positions [3, batch, tokens], Gemma 3's
    # token_type_ids [batch, tokens] (1 on image tokens)
    extra: tuple[tuple[str, torch.Tensor], ...] = ()
    # the forward's inputs it reads on the host, by keyword, kept real (LLaVA-OneVision's image_sizes, batch_num_images)
    host: tuple[tuple[str, torch.Tensor], ...] = ()
    visual_tokens: int = 0         # the image tokens of the whole micro-batch
    pixel_dtype: torch.dtype = torch.float32    # pixel_values' as the processor makes them (its pixel_dtype)


def _token_ids(cfg, spec: VisionLanguageSpec, batch_size: int, inputs: VisionInputs) -> torch.Tensor:
    """Random text ids (none a special token) with each image's tokens placed after the first text token, as the
    chat template writes them: the image's start token (Qwen's <|vision_start|>, Gemma's <start_of_image>; LLaVA has
    none), the image token repeated the image's visual tokens, the end token (start and end count among the text
    tokens: llmem.model.vision_inputs.step_refusal checks they fit)."""
    image = getattr(cfg, spec.image_token)
    special = torch.tensor([getattr(cfg, name) for name in spec.special_tokens])
    ids = torch.randint(0, cfg.get_text_config().vocab_size, (batch_size, inputs.language_tokens))
    ids[torch.isin(ids, special)] = 0
    cursor, tokens, wrap = 1, inputs.image.tokens, spec.wrap_tokens // 2
    for _ in range(inputs.images_per_sample):
        if wrap:
            ids[:, cursor] = getattr(cfg, spec.image_start)
            ids[:, cursor + 1 + tokens] = getattr(cfg, spec.image_end)
        ids[:, cursor + wrap:cursor + wrap + tokens] = image
        cursor += tokens + 2 * wrap
    return ids


def vision_batch(hf_model: nn.Module, batch_size: int, inputs: VisionInputs) -> VisionBatch:
    """The micro-batch's ids, grid and 3-D positions (or token types) as the processor and the model make them (real
    tensors)."""
    cfg = hf_model.config
    spec = vision_spec(cfg.model_type)
    ids = _token_ids(cfg, spec, batch_size, inputs)
    img = inputs.image
    images = batch_size * inputs.images_per_sample
    is_image = ids == getattr(cfg, spec.image_token)
    grid = torch.tensor([[img.grid_t, img.grid_h, img.grid_w]] * images) if spec.grid_input else None
    extra: list[tuple[str, torch.Tensor]] = []
    if spec.position_rows:
        positions, _ = hf_model.model.get_rope_index(ids, mm_token_type_ids=is_image.int(), image_grid_thw=grid)
        extra.append(("position_ids", positions))
    if spec.token_types:           # the processor's mm_token_type_ids, int64, handed over as token_type_ids
        extra.append(("token_type_ids", is_image.long()))
    if spec.cross_attention_layers:
        extra.extend(_tile_inputs(ids, getattr(cfg, spec.image_token), inputs))
    if getattr(cfg, spec.image_token) >= cfg.get_text_config().vocab_size:
        # an image token the lm_head has no row for (Llama 3.2 Vision's <|image|>, 128256 = its vocab_size):
        # labels of their own with it ignored, as the collators make them (LLaMA-Factory's IGNORE_INDEX on the
        # prompt; the loss's bound check would refuse it)
        extra.append(("labels", ids.masked_fill(is_image, IGNORE_INDEX)))
    # LlavaOnevisionImageProcessor's image_sizes (each image's (height, width), int64) and batch_num_images
    host = (("image_sizes", torch.tensor([img.original] * images)),
            ("batch_num_images", torch.tensor([inputs.images_per_sample] * batch_size))) if spec.image_sizes else ()
    shape = pixel_values_shape(spec.processor, img, images, inputs.images_per_sample)
    if spec.pixel_mask:
        # Idefics3ImageProcessor pads each sample's frames into [batch, frames, 3, size, size] and writes its
        # pixel_attention_mask [batch, frames, size, size] int64 (1 on every pixel of a whole tile)
        shape = (batch_size, images // batch_size * img.crops, *shape[2:])
        extra.append(("pixel_attention_mask", torch.ones((*shape[:2], *shape[3:]), dtype=torch.int64)))
    return VisionBatch(ids, shape, batch_size * inputs.patches, grid, tuple(extra), host,
                       batch_size * inputs.visual_tokens,
                       getattr(torch, PROCESSORS[spec.processor].pixel_dtype))


def _tile_inputs(ids: torch.Tensor, image_token: int, inputs: VisionInputs) -> list[tuple[str, torch.Tensor]]:
    """Llama 3.2 Vision's per-image inputs as its processor makes them (int64): aspect_ratio_ids [batch, images] and
    aspect_ratio_mask [batch, images, max tiles] (MllamaImageProcessorPil's convert_aspect_ratios_to_ids_np /
    build_aspect_ratio_mask_np of each image's canvas tiles: the torchvision processor's twins, which need no
    torchvision) and cross_attention_mask [batch, tokens, images, max tiles]
    (MllamaProcessor's get_cross_attention_token_mask / convert_sparse_cross_attention_mask_to_dense: each image's
    tiles seen from its <|image|> token on)."""
    from transformers.models.mllama.image_processing_pil_mllama import (
        build_aspect_ratio_mask_np,
        convert_aspect_ratios_to_ids_np,
    )
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    img, batch = inputs.image, ids.shape[0]
    ratios = [[img.canvas_tiles] * inputs.images_per_sample] * batch
    tiles = [[img.canvas_tiles[0] * img.canvas_tiles[1]] * inputs.images_per_sample] * batch
    token_masks = [get_cross_attention_token_mask(row.tolist(), image_token) for row in ids]
    cross = convert_sparse_cross_attention_mask_to_dense(token_masks, tiles, img.crops, ids.shape[1])
    return [("aspect_ratio_ids", torch.from_numpy(convert_aspect_ratios_to_ids_np(ratios, img.crops)).long()),
            ("aspect_ratio_mask", torch.from_numpy(build_aspect_ratio_mask_np(ratios, img.crops)).long()),
            ("cross_attention_mask", torch.from_numpy(cross))]


def model_inputs(batch: VisionBatch, device: torch.device | None = None) -> tuple[torch.Tensor, dict]:
    """(token ids, the forward's other inputs). Under the fake mode (`device` None): the ids, pixel values and
    positions as fake tensors (allocated as on the device), the grid and the host inputs real. A real step (llmem measure): all of
    them on `device`, as the trainer moves the collated batch there."""
    if device is None:
        def place(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype)
        grid, host = batch.image_grid_thw, dict(batch.host)
    else:
        def place(t: torch.Tensor) -> torch.Tensor:
            return t.to(device)
        grid = place(batch.image_grid_thw) if batch.image_grid_thw is not None else None
        host = {name: place(t) for name, t in batch.host}
    pixel_values = torch.randn(batch.pixel_shape, device=device, dtype=batch.pixel_dtype)
    ids = place(batch.input_ids)
    return ids, {"pixel_values": pixel_values, **({"image_grid_thw": grid} if grid is not None else {}),
                 **{name: place(t) for name, t in batch.extra}, **host}


class _ImageMaskCounts(KnownMasks):
    """Boolean indexing by the image tokens' mask [batch, tokens] (Qwen3-VL's deepstack: `hidden_states[mask, :]`, its
    index_put and their backward): the mask's true count is the images' tokens per row, which the set-up fixes; the
    index CUDA's nonzero makes is allocated as at::index makes it (llmem.runtime.objectives.KnownMasks). Nothing
    else is answered: a host read of a fake scalar, or a mask of another shape, goes on to the fake mode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masks = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor) and t.dtype == torch.bool
                 and t.dim() and (t.dim(), t.shape[-1]) in self.valid]
        if not masks or func is _aten._local_scalar_dense.default:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _RealFrames(KnownMasks):
    """Idefics3 / SmolVLM's get_image_features drops the padding frames (all-zero pixel values) by a bool mask over
    the batch's frames (`pixel_values[real_images_inds]`, the pixel mask likewise) and splits the features by each
    sample's count of real frames (`num_real_images_per_batch.tolist()`): every frame the set-up makes is real (its
    samples hold the same images, none padded), so the mask is all true and each sample's count is its frames. Host
    reads of a fake int answer the frames per sample, of a fake bool True (every patch of a whole tile is real)."""

    def __init__(self, frames: int, per_sample: int) -> None:
        super().__init__({(1, frames): frames})
        self.per_sample = per_sample

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (func is _aten._local_scalar_dense.default and is_fake_tensor(args[0])
                and not args[0].is_floating_point() and args[0].dtype != torch.bool):
            return self.per_sample
        return super().__torch_dispatch__(func, types, args, kwargs)


def image_mask_counts(hf_model: nn.Module, batch: VisionBatch) -> contextlib.AbstractContextManager:
    """The trace's answer to indexing by the image tokens' mask, where the model does it (its row's
    image_mask_indexing), or by the real frames' mask (its row's pixel_mask: _RealFrames), to enter inside the fake
    mode; a no-op elsewhere."""
    spec = vision_spec(hf_model.config.model_type)
    if spec.pixel_mask:
        batch_size, per_sample = batch.pixel_shape[:2]
        return _RealFrames(batch_size * per_sample, per_sample)
    if not spec.image_mask_indexing:
        return contextlib.nullcontext()
    ids = batch.input_ids
    with no_dispatch():           # the real ids, counted outside the fake mode
        per_row = int((ids[0] == getattr(hf_model.config, spec.image_token)).sum())
    return _ImageMaskCounts({(2, ids.shape[1]): per_row})


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
    """The checks the model makes on fake values answered: the image tokens' count against the features' rows (a
    fake sum; equal by construction, checked here on the real ids); where the vision code reads the grid's index
    values on the host (Qwen2.5-VL), those computed on the real grid and returned where the model asks; where it
    reads its host inputs (LLaVA-OneVision's image sizes), those and what is computed from them alone kept real."""
    import importlib

    spec = vision_spec(hf_model.config.model_type)
    modeling = importlib.import_module(spec.modeling)
    image_tokens = int((batch.input_ids == getattr(hf_model.config, spec.image_token)).sum())
    if image_tokens != batch.visual_tokens:
        raise AssertionError(f"{image_tokens} image tokens for {batch.visual_tokens} visual tokens")
    with contextlib.ExitStack() as stack:
        if spec.index_values:
            stack.enter_context(_qwen_index_values(modeling, hf_model, spec.index_values, batch, mode))
        if batch.host:
            stack.enter_context(index_tensors_stay_real(mode, tuple(t for _, t in batch.host)))
        stack.enter_context(patched(modeling, "torch_compilable_check", lambda *a, **k: None))
        yield


# transformers.vision_utils' functions of the images' grid, called as the Qwen vision encoders call them (grid, the
# vision config, the encoder module) -> (the value, whether the model reads it on the host: kept real; else made on
# the device, a fake tensor of each of its shapes)
_GRID_VALUES = {
    # Qwen2_5_VisionTransformerPretrainedModel.forward / Qwen3VLVisionModel.forward: the rotary's (h, w) positions
    "get_vision_position_ids": (lambda vu, grid, vc, visual: vu.get_vision_position_ids(grid, vc.spatial_merge_size),
                                True),
    # the attention segments' bounds (their lengths read by .tolist() outside flash attention)
    "get_vision_attention_seqlens": (lambda vu, grid, vc, visual: vu.get_vision_attention_seqlens(grid, vc), True),
    # Qwen2.5-VL's windows' reordering (indices into the hidden states)
    "get_vision_window_index": (lambda vu, grid, vc, visual: vu.get_vision_window_index(
        grid, vc.spatial_merge_size, vc.window_size, vc.patch_size), True),
    # Qwen3-VL's learned position table resampled to each grid: [patches, 4] taps and weights the pos_embed gathers
    # and weighs on the device (never read on the host)
    "get_vision_interpolation_indices_and_weights": (lambda vu, grid, vc, visual: (
        vu.get_vision_interpolation_indices_and_weights(
            grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=vc.spatial_merge_size)), False),
}


def _on_device(value):
    """A fresh tensor of each tensor's shape and dtype in `value` (made under the fake mode: allocated as on the
    device)."""
    return tree_map_only(torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype), value)


@contextlib.contextmanager
def _qwen_index_values(qwen, hf_model: nn.Module, names: tuple[str, ...], batch: VisionBatch, mode) -> Iterator[None]:
    """transformers 5's Qwen2.5-VL / Qwen3-VL: the grid's functions the vision encoder calls (`names`:
    _GRID_VALUES) computed on the real grid by transformers' own functions, returned where the modeling module calls
    them; the index tensors kept real (those the model reads on the host), the rest made on the device when
    called."""
    from transformers import vision_utils as vu

    grid, vc, visual = batch.image_grid_thw, hf_model.config.vision_config, hf_model.model.visual
    values = {name: _GRID_VALUES[name][0](vu, grid, vc, visual) for name in names}
    real = [value for name, value in values.items() if _GRID_VALUES[name][1]]
    seeds = (grid, *(t for t in tree_leaves(real) if isinstance(t, torch.Tensor)))
    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            answer = (lambda *a, _v=value, **k: _v) if _GRID_VALUES[name][1] else \
                (lambda *a, _v=value, **k: _on_device(_v))
            stack.enter_context(patched(qwen, name, answer))
        stack.enter_context(index_tensors_stay_real(mode, seeds))
        yield
