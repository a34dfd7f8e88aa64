"""Images as a vision-language model's processor turns them into inputs: the resized size, the patch grid the vision
encoder sees (image_grid_thw, pixel_values' rows) and the visual tokens the language model sees.

The kinds of processor: Qwen2-VL's smart resize (any size, to multiples of patch x merge within its pixel bounds:
28 for Qwen2.5-VL, 32 for Qwen3-VL, which ships the same processor with 16-pixel patches; the tokens follow the
image) and Gemma 3's fixed size (every image resized to the vision tower's image_size, 896x896, its
projector pooling the patches to mm_tokens_per_image tokens: 256 whatever the image; pan-and-scan, which would add
crops, is off in the processor's defaults and the published preprocessor_config.json, and is not modelled) and
LLaVA-OneVision's anyres tiling (one image alone in its sample: the best of the grid pinpoints, its 384x384 tiles and
the whole image resized as a base crop, the tiles' features unpadded and pooled down past 9 tiles' worth, a newline
token closing each row; several images in a sample: each one padded square, one crop, no tiling) and Idefics3 /
SmolVLM's tiles (the longest side resized to a fixed multiple of the tower's image_size, both sides rounded up to
multiples of it, cut into image_size tiles plus the whole image resized to one: image_seq_len tokens a frame, the
<fake_token_around_image>, <row_r_col_c>, <global-img> and newline tokens around them) and Llama 3.2
Vision's canvas of tiles (MllamaImageProcessor: the image resized into the best canvas of up to max_image_tiles
tiles of the tower's image_size, 560x560, and always handed over as max_image_tiles tiles, the unused ones zero and
masked; one <|image|> token in the text, the features entering the language model through its cross-attention
layers) and InternVL's crops (GotOcr2ImageProcessor under InternVLProcessor's crop_to_patches: the image resized to
the grid of the tower's image_size tiles, min_patches..max_patches of them, whose aspect ratio is closest to its own,
and a thumbnail of the whole image where the grid has more than one tile; image_seq_length <IMG_CONTEXT> tokens a
tile between <img> and </img>) and Llama 4's tiles (Llama4ImageProcessor: get_best_fit's canvas of up to max_patches
tiles of the tower's image_size, 336, and a global tile where the canvas has more than one; (image_size /
patch_size)^2 x pixel_shuffle_ratio^2 <|patch|> tokens a tile, with the separators, <|image|>, <|image_start|> and
<|image_end|> around them).

One row per processor (`PROCESSORS`), named by the model's row (llmem.model.vision). Its pixel bounds are read from
the publisher's preprocessor_config.json, shipped in the catalog (catalog/processors/), so nothing is fetched. The
arithmetic is the installed transformers' own (tests/model/test_images.py checks it against the processor's output):
transformers' processor module imports torch and torchvision, which an estimate does not load.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from functools import cache

from llmem.errors import LlmemError
from llmem.model.catalog import catalog_file

IDEFICS3_MAX_SIDE = 4096     # Idefics3 / SmolVLM's MAX_IMAGE_SIZE: no side resized past it
MAX_ASPECT_RATIO = 200        # smart_resize raises ValueError beyond it ("absolute aspect ratio must be smaller than 200")


@dataclass(frozen=True)
class ImageProcessorSpec:
    """A processor family: its class (as transformers names it) and the shipped preprocessor_config.json."""
    name: str
    image_processor_type: str
    config_file: str          # in catalog/processors/
    # every image resized to the model's vision_config.image_size, one tensor [3, size, size] per image in
    # pixel_values (Gemma 3); False: smart resize, pixel_values' rows the patches (Qwen)
    fixed_size: bool = False
    # LLaVA-OneVision's anyres: crops of the tower's image_size, [images, crops, 3, size, size] in pixel_values
    anyres: bool = False
    # Idefics3 / SmolVLM's tiles of the tower's image_size and a global frame, [batch, frames, 3, size, size]
    tiled: bool = False
    # Llama 3.2 Vision's canvas of tiles: [batch, images, max_image_tiles, 3, size, size] in pixel_values, one token
    # an image
    canvas_tiled: bool = False
    # InternVL's crops (GotOcr2ImageProcessor.crop_image_to_patches): tiles of the tower's image_size and a thumbnail,
    # every image's stacked into one [tiles, 3, size, size] pixel_values for the batch
    crop_tiled: bool = False
    # Llama 4's tiles (Llama4ImageProcessor: get_best_fit's canvas of up to max_patches tiles and a global tile), every
    # image's stacked into one [tiles, 3, size, size] pixel_values for the batch, as InternVL's crops are
    best_fit_tiled: bool = False
    # pixel_values' dtype as the processor hands them over (torch's name): float32, or bfloat16 where it casts them
    # (Llama4ImageProcessor.rescale_and_normalize: `images.to(dtype=torch.bfloat16)`), which the patch embedding's
    # linear then takes as they are (autocast casts them; a step without it needs bf16 weights)
    pixel_dtype: str = "float32"

    @property
    def stacks_tiles(self) -> bool:
        """Every image's tiles concatenated into one [tiles, 3, size, size] pixel_values (InternVL, Llama 4)."""
        return self.crop_tiled or self.best_fit_tiled


PROCESSORS: dict[str, ImageProcessorSpec] = {
    # Qwen2-VL's processor, which Qwen2.5-VL ships (its preprocessor_config.json: Qwen2VLImageProcessor)
    "qwen2_vl": ImageProcessorSpec("qwen2_vl", "Qwen2VLImageProcessor", "Qwen--Qwen2.5-VL-7B-Instruct.json"),
    # Qwen3-VL ships Qwen2-VL's processor with 16-pixel patches (its preprocessor_config.json: patch_size 16, merge 2:
    # sides multiples of 32; size {shortest_edge 65,536, longest_edge 16,777,216} as its pixel bounds)
    "qwen3_vl": ImageProcessorSpec("qwen3_vl", "Qwen2VLImageProcessorFast", "Qwen--Qwen3-VL-8B-Instruct.json"),
    # Gemma 3's (its preprocessor_config.json: size 896x896, image_seq_length 256, do_pan_and_scan null: off)
    "gemma3": ImageProcessorSpec("gemma3", "Gemma3ImageProcessor", "google--gemma-3-4b-it.json", fixed_size=True),
    # LLaVA-OneVision's (its preprocessor_config.json: size 384x384, the 36 grid pinpoints 384..2304 a side)
    "llava_onevision": ImageProcessorSpec("llava_onevision", "LlavaOnevisionImageProcessor",
                                          "llava-hf--llava-onevision-qwen2-0.5b-ov-hf.json", anyres=True),
    # Idefics3's (Idefics3-8B-Llama3's preprocessor_config.json: max_image_size 364, size longest_edge 1456 = 4 x 364);
    # SmolVLM v1 checkpoints (model_type idefics3) ship the same class at their tower's size (512 / 384, 4x that)
    "idefics3": ImageProcessorSpec("idefics3", "Idefics3ImageProcessor", "HuggingFaceM4--Idefics3-8B-Llama3.json",
                                   tiled=True),
    # SmolVLM2's (SmolVLM2-2.2B-Instruct's preprocessor_config.json: max_image_size 384, size longest_edge 1536)
    "smolvlm": ImageProcessorSpec("smolvlm", "SmolVLMImageProcessor", "HuggingFaceTB--SmolVLM2-2.2B-Instruct.json",
                                  tiled=True),
    # Llama 3.2 Vision's (its preprocessor_config.json: size 560x560, max_image_tiles 4, do_pad / do_resize true)
    "mllama": ImageProcessorSpec("mllama", "MllamaImageProcessor", "meta-llama--Llama-3.2-11B-Vision.json",
                                 canvas_tiled=True),
    # InternVL's (InternVL3-1B-hf's preprocessor_config.json: GotOcr2ImageProcessorFast, size 448x448, min_patches
    # 1, max_patches 12, crop_to_patches false there but set true by InternVLProcessor's images_kwargs)
    "internvl": ImageProcessorSpec("internvl", "GotOcr2ImageProcessorFast", "OpenGVLab--InternVL3-1B-hf.json",
                                   crop_tiled=True),
    # Llama 4's (Llama-4-Scout-17B-16E-Instruct's preprocessor_config.json: Llama4ImageProcessorFast, size 336x336,
    # max_patches 16, resize_to_max_canvas false)
    "llama4": ImageProcessorSpec("llama4", "Llama4ImageProcessorFast",
                                 "meta-llama--Llama-4-Scout-17B-16E-Instruct.json", best_fit_tiled=True,
                                 pixel_dtype="bfloat16"),
}


@dataclass(frozen=True)
class ProcessorSettings:
    """What the processor resizes and cuts with: its pixel bounds and patch sizes."""
    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of it: one merged token covers merge_size x merge_size patches."""
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class ImageGrid:
    """One image as the processor hands it to the model."""
    height: int               # resized, pixels
    width: int
    grid_t: int               # image_grid_thw's row: temporal, height and width in patches
    grid_h: int
    grid_w: int
    merge_size: int
    patch_values: int         # pixel_values' row width: 3 channels x temporal_patch_size x patch_size^2
    crops: int = 1            # the tower's images for this one (anyres: the base crop and the tiles)
    visual_tokens: int = 0    # its tokens where the patches do not give them (anyres); 0: patches // merge^2
    original: tuple[int, int] = (0, 0)    # (height, width) as the processor takes it (anyres: image_sizes' row)
    # the processor's text tokens around the image's placeholder tokens, counted in the sample's text (Idefics3's
    # <fake_token_around_image>, <row_r_col_c>, <global-img> and newlines; 0: none beyond the row's start / end)
    marker_tokens: int = 0
    # the tiles (high, wide) of the image's canvas, where the processor tiles it (Llama 3.2 Vision: its aspect ratio,
    # read into aspect_ratio_ids and aspect_ratio_mask; `crops` is then max_image_tiles, the padded ones included)
    canvas_tiles: tuple[int, int] = (0, 0)

    @property
    def patches(self) -> int:
        """The vision encoder's sequence for this image (pixel_values' rows; its crops' patches)."""
        return self.crops * self.grid_t * self.grid_h * self.grid_w

    @property
    def tokens(self) -> int:
        """The image's placeholder tokens in the language model's input: the merger joins merge_size^2 patches."""
        return self.visual_tokens or self.patches // (self.merge_size * self.merge_size)


@cache
def processor_settings(name: str) -> ProcessorSettings:
    """The shipped preprocessor_config.json's pixel bounds and patch sizes of a processor row."""
    raw = json.loads(catalog_file("processors", PROCESSORS[name].config_file))
    # the bounds as Qwen2VLImageProcessor.__init__ reads them: min_pixels / max_pixels where given (Qwen2.5-VL's
    # file), else its size's shortest_edge / longest_edge (Qwen3-VL's)
    size = raw.get("size", {})
    return ProcessorSettings(raw.get("min_pixels", size.get("shortest_edge")),
                             raw.get("max_pixels", size.get("longest_edge")), raw["patch_size"],
                             raw["temporal_patch_size"], raw["merge_size"])


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' qwen2_vl smart_resize: both sides multiples of `factor`, the area within [min_pixels,
    max_pixels], the aspect ratio kept as closely as that allows. An aspect ratio over 200 is refused (one line)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise LlmemError(f"--image-size {height}x{width}: the processor refuses an aspect ratio over "
                         f"{MAX_ASPECT_RATIO} (transformers' smart_resize); give a less elongated image")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def fixed_grid(config: dict) -> ImageGrid:
    """Any image as a fixed-size processor gives it to the model of `config` (its config.json): resized to
    vision_config.image_size square, image_size / patch_size patches a side, which the projector average-pools
    to mm_tokens_per_image tokens (Gemma3MultiModalProjector: a kernel of patches_per_side / tokens_per_side)."""
    vision = config["vision_config"]
    size, patch = vision["image_size"], vision["patch_size"]
    side = size // patch
    pool = side // math.isqrt(config.get("mm_tokens_per_image", 256))
    return ImageGrid(size, size, 1, side, side, pool, 3 * patch * patch)


def pixel_values_shape(processor: str, image: ImageGrid, images: int, per_sample: int = 1) -> tuple[int, ...]:
    """pixel_values' shape for `images` images alike, `per_sample` of them a sample: [images, 3, height, width] (a
    fixed-size processor), [images, crops, 3, height, width] (anyres: LlavaOnevisionImageProcessor stacks each
    image's crops; tiled: Idefics3's frames), [samples, per_sample, tiles, 3, height, width] (a canvas of tiles:
    MllamaImageProcessor's pad_batches_and_tiles), [images x tiles, 3, height, width] (InternVLProcessor's crops,
    concatenated over the batch's images) or [patches, patch values] (Qwen's flattened patches)."""
    if PROCESSORS[processor].stacks_tiles:
        return (images * image.crops, 3, image.height, image.width)
    if PROCESSORS[processor].canvas_tiled:
        return (images // per_sample, per_sample, image.crops, 3, image.height, image.width)
    if PROCESSORS[processor].anyres or PROCESSORS[processor].tiled:
        return (images, image.crops, 3, image.height, image.width)
    if PROCESSORS[processor].fixed_size:
        return (images, 3, image.height, image.width)
    return (images * image.patches, image.patch_values)


def image_grid(processor: str, height: int, width: int, max_pixels: int | None = None,
               min_pixels: int | None = None, config: dict | None = None, images_per_sample: int = 1) -> ImageGrid:
    """One image of `height` x `width` pixels as processor row `processor` gives it (max_pixels / min_pixels: the
    processor's bounds overridden, as its max_pixels / min_pixels keywords do; None: the shipped config's). A
    fixed-size processor sizes it by the model's `config` (its config.json) whatever its size (fixed_grid): a pixel
    bound changes nothing there (LLaMA-Factory's image_max_pixels scales the image down first, which the processor
    then resizes to its one size all the same). Anyres tiles it by the model's config (anyres_grid), the
    pixel bounds scaling the image first as LLaMA-Factory does; a sample of several images takes one crop each."""
    if PROCESSORS[processor].anyres:
        return anyres_grid(config or {}, height, width, images_per_sample, max_pixels, min_pixels)
    if PROCESSORS[processor].tiled:
        return tiled_grid(config or {}, height, width, resize_ratio(processor), max_pixels, min_pixels)
    if PROCESSORS[processor].canvas_tiled:
        return canvas_grid(config or {}, height, width, max_pixels, min_pixels)
    if PROCESSORS[processor].crop_tiled:
        return crop_grid(config or {}, height, width, tile_bounds(processor), max_pixels, min_pixels)
    if PROCESSORS[processor].best_fit_tiled:
        return best_fit_grid(config or {}, height, width, max_tiles(processor), max_pixels, min_pixels)
    if PROCESSORS[processor].fixed_size:
        return fixed_grid(config or {})
    s = processor_settings(processor)
    h, w = smart_resize(height, width, s.factor, s.min_pixels if min_pixels is None else min_pixels,
                        s.max_pixels if max_pixels is None else max_pixels)
    # an image is one temporal patch: the processor repeats the frame temporal_patch_size times
    return ImageGrid(h, w, 1, h // s.patch_size, w // s.patch_size, s.merge_size,
                     3 * s.temporal_patch_size * s.patch_size * s.patch_size)


def select_best_resolution(height: int, width: int, pinpoints: list) -> tuple[int, int]:
    """transformers' image_processing_utils.select_best_resolution: the (height, width) pinpoint keeping the most of
    the image's pixels once it is scaled to fit, the least padding among equals."""
    best, most, least_wasted = (0, 0), 0, math.inf
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > most or (effective == most and wasted < least_wasted):
            best, most, least_wasted = (h, w), effective, wasted
    return best


def prescaled(height: int, width: int, max_pixels: int | None, min_pixels: int | None) -> tuple[int, int]:
    """The image as LLaMA-Factory's mm_plugin._preprocess_image hands it to the processor: scaled to fit
    image_max_pixels (image_min_pixels), each side truncated (int(side * sqrt(bound / area)))."""
    for bound, over in ((max_pixels, True), (min_pixels, False)):
        if bound and (height * width > bound if over else height * width < bound):
            factor = math.sqrt(bound / (height * width))
            height, width = int(height * factor), int(width * factor)
    return height, width


def _unpadded_tokens(height: int, width: int, side: int, tiles_h: int, tiles_w: int, max_tiles: int) -> int:
    """The tiles' tokens with a newline closing each row (LlavaOnevisionProcessor._get_unpadded_features, as the
    model's pack_image_features makes them): the tiles' feature grid less the padding rows (columns) of the image's
    letterbox, pooled bilinearly down to about max_tiles tiles' worth when over 1.1 times that."""
    current_h, current_w = side * tiles_h, side * tiles_w
    if width / height > current_w / current_h:
        padding = (current_h - int(round(height * (current_w / width), 7))) // 2
        current_h -= padding * 2
    else:
        padding = (current_w - int(round(width * (current_h / height), 7))) // 2
        current_w -= padding * 2
    ratio = math.sqrt(current_h * current_w / (max_tiles * side ** 2))
    if ratio > 1.1:
        current_h, current_w = int(current_h // ratio), int(current_w // ratio)
    return current_h * current_w + current_h


def anyres_grid(config: dict, height: int, width: int, images_per_sample: int = 1, max_pixels: int | None = None,
                min_pixels: int | None = None) -> ImageGrid:
    """One image as LLaVA-OneVision's processor gives it to the model of `config` (its config.json). Alone in its
    sample (LlavaOnevisionImageProcessor._get_image_patches): the best grid pinpoint's tiles of the tower's
    image_size and the whole image resized as a base crop (the model's image_size_to_num_patches), its tokens the base
    crop's patches and the tiles' unpadded ones (LlavaOnevisionProcessor._get_number_of_features); beside other images
    (batch_num_images > 1): padded square, one crop, its patches and one newline token (replace_image_token). The
    "default" feature strategy drops one token an image, as the processor does."""
    vision = config["vision_config"]
    size, patch = vision["image_size"], vision["patch_size"]
    side = size // patch                        # the processor's sqrt(num_image_tokens): 729 tokens, 27 a side
    height, width = prescaled(height, width, max_pixels, min_pixels)
    if images_per_sample > 1:
        crops, tokens = 1, side * side + 1
    else:
        best_h, best_w = select_best_resolution(height, width, config["image_grid_pinpoints"])
        tiles_h, tiles_w = -(-best_h // size), -(-best_w // size)
        # (transformers reads it with .strip("anyres_max_"), which leaves the same digits)
        max_tiles = int(config.get("vision_aspect_ratio", "anyres_max_9").removeprefix("anyres_max_"))
        crops = tiles_h * tiles_w + 1
        tokens = side * side + _unpadded_tokens(height, width, side, best_h // size, best_w // size, max_tiles)
    if config.get("vision_feature_select_strategy", "full") == "default":
        tokens -= 1
    return ImageGrid(size, size, 1, side, side, 1, 3 * patch * patch, crops, tokens, (height, width))


@cache
def resize_ratio(processor: str) -> int:
    """A tiled processor's resize target over its tile: size.longest_edge / max_image_size.longest_edge of the shipped
    preprocessor_config.json (4: every image's longest side becomes 4 tiles)."""
    raw = json.loads(catalog_file("processors", PROCESSORS[processor].config_file))
    return raw["size"]["longest_edge"] // raw["max_image_size"]["longest_edge"]


def _rescaled_to_longest(height: int, width: int, longest: int) -> tuple[int, int]:
    """Idefics3ImageProcessor's resize (_resize_output_size_rescale_to_max_len, then the 4096 bound of
    _resize_output_size_scale_below_upper_bound): the longest side set to `longest`, up or down, the other kept in
    ratio and rounded up to even."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    if max(height, width) > IDEFICS3_MAX_SIDE:
        aspect = width / height
        if width >= height:
            width, height = IDEFICS3_MAX_SIDE, int(IDEFICS3_MAX_SIDE / aspect)
        else:
            height, width = IDEFICS3_MAX_SIDE, int(IDEFICS3_MAX_SIDE * aspect)
    return max(height, 1), max(width, 1)


def tiled_grid(config: dict, height: int, width: int, ratio: int, max_pixels: int | None = None,
               min_pixels: int | None = None) -> ImageGrid:
    """One image as Idefics3 / SmolVLM's processor gives it to the model of `config` (its config.json): resized to a
    longest side of `ratio` tiles (resize), its sides rounded up to whole tiles of the tower's image_size
    (resize_for_vision_encoder: the short side through int(long / aspect) first), cut into rows x cols tiles plus
    the whole image resized to one tile (split_images; no split when it fits one tile); image_seq_len = (image_size /
    patch_size)^2 / scale_factor^2 <image> tokens a frame (the model's image_seq_len), and around them a
    <fake_token_around_image> and a <row_r_col_c> a tile, a newline a row, then a newline, <fake_token_around_image>,
    <global-img> before the global frame and <fake_token_around_image> after it (Idefics3Processor.
    replace_image_token; a lone frame: fake, global, fake). The pixel bounds scale the image first as
    LLaMA-Factory does. Each newline is counted as one token (a BPE vocabulary may merge the last two)."""
    vision = config["vision_config"]
    tile, patch, scale = vision["image_size"], vision["patch_size"], config.get("scale_factor", 2)
    height, width = _rescaled_to_longest(*prescaled(height, width, max_pixels, min_pixels), ratio * tile)
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    rows, cols = (height // tile, width // tile) if height > tile or width > tile else (0, 0)
    frames = rows * cols + 1
    side = tile // patch
    markers = 2 * rows * cols + rows + 4 if rows else 3
    return ImageGrid(tile, tile, 1, side, side, scale, 3 * patch * patch, frames,
                     frames * side * side // (scale * scale), (height, width), markers)


def supported_aspect_ratios(max_tiles: int) -> list[tuple[int, int]]:
    """transformers' mllama get_all_supported_aspect_ratios: every (a, b) of tiles with a * b <= max_tiles, in its
    order (aspect_ratio_ids are 1 + an index into it)."""
    return [(a, b) for a in range(1, max_tiles + 1) for b in range(1, max_tiles + 1) if a * b <= max_tiles]


def optimal_canvas(height: int, width: int, max_tiles: int, tile: int) -> tuple[int, int]:
    """transformers' mllama get_optimal_tiled_canvas: the (height, width) canvas of whole tiles the image is resized
    into: the smallest upscale (scale >= 1) if any canvas allows one, else the largest downscale, the smallest area
    among equals (scale: the smaller of the canvas's height and width ratios)."""
    canvases = [(a * tile, b * tile) for a, b in supported_aspect_ratios(max_tiles)]
    scales = [min(h / height, w / width) for h, w in canvases]
    up = [x for x in scales if x >= 1]
    chosen = min(up) if up else max(x for x in scales if x < 1)
    return min((c for c, x in zip(canvases, scales, strict=True) if x == chosen), key=lambda c: c[0] * c[1])


def canvas_grid(config: dict, height: int, width: int, max_pixels: int | None = None,
               min_pixels: int | None = None) -> ImageGrid:
    """One image as Llama 3.2 Vision's processor gives it to the model of `config` (its config.json):
    MllamaImageProcessor.resize into optimal_canvas's tiles of the tower's image_size (the processor's size, 560),
    then pad_batches_and_tiles stacks max_image_tiles tiles whatever the canvas (the model's
    vision_config.max_num_tiles; the unused tiles zero, masked by aspect_ratio_mask). Each tile runs image_size /
    patch_size patches a side through the tower (with its class token); the text holds one <|image|> token for it.
    The pixel bounds scale the image first, as LLaMA-Factory's _preprocess_image does."""
    vision = config["vision_config"]
    size, patch, max_tiles = vision["image_size"], vision["patch_size"], vision.get("max_num_tiles", 4)
    height, width = prescaled(height, width, max_pixels, min_pixels)
    canvas_h, canvas_w = optimal_canvas(height, width, max_tiles, size)
    side = size // patch
    return ImageGrid(size, size, 1, side, side, 1, 3 * patch * patch, max_tiles, 1, (height, width),
                     canvas_tiles=(canvas_h // size, canvas_w // size))


@cache
def tile_bounds(processor: str) -> tuple[int, int]:
    """A crop-tiling processor's (min_patches, max_patches) from its shipped preprocessor_config.json."""
    raw = json.loads(catalog_file("processors", PROCESSORS[processor].config_file))
    return raw["min_patches"], raw["max_patches"]


def closest_tile_grid(height: int, width: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """transformers' got_ocr2 get_optimal_tiled_canvas: the (columns, rows) grid of min_tiles..max_tiles tiles
    (get_all_supported_aspect_ratios' order: by tile count, stably) whose columns / rows is closest to width / height;
    among equals the later (more tiles) while the image's area exceeds half the grid's."""
    grids = sorted(((c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
                    if min_tiles <= c * r <= max_tiles), key=lambda g: g[0] * g[1])
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), math.inf
    for cols, rows in grids:
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    return best


def crop_grid(config: dict, height: int, width: int, bounds: tuple[int, int], max_pixels: int | None = None,
              min_pixels: int | None = None) -> ImageGrid:
    """One image as InternVL's processor gives it to the model of `config` (its config.json): GotOcr2ImageProcessor's
    crop_image_to_patches (InternVLProcessor sets crop_to_patches) resizes it to closest_tile_grid's tiles of the
    tower's image_size and adds a thumbnail (the whole image resized to one tile) where the grid has more than one
    (get_number_of_image_patches); bounds are (min_patches, max_patches), max_patches 1 taking one resized tile. Each
    tile runs (image_size / patch_size)^2 patches and the class token through the tower, whose patches the model's
    pixel_shuffle joins by (1 / downsample_ratio)^2 into image_seq_length tokens; the processor writes <img>, those
    <IMG_CONTEXT> tokens for every tile, </img> (InternVLProcessor.replace_image_token: two text tokens an image).
    The pixel bounds scale the image first, as LLaMA-Factory's _preprocess_image does."""
    vision = config["vision_config"]
    size, patch = vision["image_size"], vision["patch_size"]
    # (a [height, width] pair in InternVLVisionConfig; square in every published config)
    size, patch = (v[0] if isinstance(v, (list, tuple)) else v for v in (size, patch))
    height, width = prescaled(height, width, max_pixels, min_pixels)
    min_tiles, max_tiles = bounds
    cols, rows = closest_tile_grid(height, width, size, min_tiles, max_tiles) if max_tiles > 1 else (1, 1)
    tiles = cols * rows + 1 if cols * rows > 1 else 1
    side, merge = size // patch, round(1 / config.get("downsample_ratio", 0.5))
    return ImageGrid(size, size, 1, side, side, merge, 3 * patch * patch, tiles, 0, (height, width), marker_tokens=2)


@cache
def max_tiles(processor: str) -> int:
    """A best-fit tiling processor's max_patches (the tiles of its canvas) from its shipped preprocessor_config.json."""
    return json.loads(catalog_file("processors", PROCESSORS[processor].config_file))["max_patches"]


def _f32(x: float) -> float:
    """x rounded to float32, as get_best_fit's int64 / int division makes it (torch's true division of an int64
    tensor gives float32; the float64 quotient rounded once more is the same: 53 >= 2 x 24 + 2 bits)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def best_fit_resolutions(max_chunks: int) -> list[tuple[int, int]]:
    """transformers' llama4 find_supported_resolutions in tiles: every (high, wide) of max_chunks down to 1 tiles,
    grouped by aspect ratio in the order each ratio first appears, its pairs in their order within it."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for chunks in range(max_chunks, 0, -1):
        for factor in sorted(f for f in range(1, chunks + 1) if chunks % f == 0):
            by_ratio.setdefault(factor / (chunks // factor), []).append((factor, chunks // factor))
    return [pair for pairs in by_ratio.values() for pair in pairs]


def best_fit_tiles(height: int, width: int, tile: int, max_chunks: int) -> tuple[int, int]:
    """transformers' llama4 get_best_fit (resize_to_max_canvas false), in tiles (high, wide): the smallest upscale
    (scale >= 1) if any canvas allows one, else the largest downscale; among canvases of that scale the first of the
    smallest area (torch.argmin). Scales in float32, as its tensors hold them."""
    pairs = best_fit_resolutions(max_chunks)
    scales = [min(_f32(h * tile / height), _f32(w * tile / width)) for h, w in pairs]
    up = [x for x in scales if x >= 1]
    chosen = min(up) if up else max(x for x in scales if x < 1)
    return min((p for p, x in zip(pairs, scales, strict=True) if x == chosen), key=lambda p: p[0] * p[1])


def best_fit_grid(config: dict, height: int, width: int, max_chunks: int, max_pixels: int | None = None,
                  min_pixels: int | None = None) -> ImageGrid:
    """One image as Llama 4's processor gives it to the model of `config` (its config.json): Llama4ImageProcessor
    resizes it into best_fit_tiles' canvas of the tower's image_size tiles (the processor's size, 336), split into
    them, and adds a global tile (the whole image resized to one) where the canvas has more than one
    (get_number_of_image_patches). Each tile runs (image_size / patch_size)^2 patches (and the class token) through
    the tower, whose pixel shuffle joins (1 / pixel_shuffle_ratio)^2 of them into one <|patch|> token; the processor
    (Llama4Processor._prompt_split_image) writes <|image_start|>, each canvas tile's tokens followed by a
    <|tile_x_separator|> or, closing its row, a <|tile_y_separator|> (where there is more than one tile), <|image|>,
    the global (or only) tile's tokens, <|image_end|>: 3 marker tokens, plus one a tile of a canvas of several.
    The pixel bounds scale the image first, as LLaMA-Factory's _preprocess_image does."""
    vision = config["vision_config"]
    size, patch = vision["image_size"], vision["patch_size"]
    height, width = prescaled(height, width, max_pixels, min_pixels)
    high, wide = best_fit_tiles(height, width, size, max_chunks)
    canvas = high * wide
    tiles = canvas + 1 if canvas > 1 else 1
    side, merge = size // patch, round(1 / vision.get("pixel_shuffle_ratio", 0.5))
    markers = 3 + (canvas if canvas > 1 else 0)
    return ImageGrid(size, size, 1, side, side, merge, 3 * patch * patch, tiles, 0, (height, width),
                     marker_tokens=markers)
