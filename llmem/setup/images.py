"""The images of a vision-language model's samples, as a set-up states them: how many per sample, their size before
the processor resizes them, the processor's pixel bound, and which of the model's parts are frozen. What the
processor makes of them (the patch grid, the visual tokens) is the model's business (llmem.model.images); here only
what needs no model is checked."""

from __future__ import annotations

import re
from typing import Any

from llmem.errors import LlmemError

# the switches naming a part of a vision-language model not trained (LLaMA-Factory's freeze_vision_tower,
# freeze_multi_modal_projector, freeze_language_model), field -> flag
FREEZE_FLAGS = {"freeze_vision_tower": "--freeze-vision-tower", "freeze_projector": "--freeze-projector",
                "freeze_language_model": "--freeze-language-model"}
_SIZE = re.compile(r"\s*(\d+)\s*[xX]\s*(\d+)\s*")


def parse_image_size(text: str) -> tuple[int, int]:
    """--image-size "1024x768" -> (1024, 768): height x width in pixels, both positive."""
    found = _SIZE.fullmatch(text)
    if found is None or not int(found[1]) or not int(found[2]):
        raise LlmemError(f"--image-size {text!r}: give the height and width in pixels as HxW, e.g. 1024x768")
    return int(found[1]), int(found[2])


def vision_options(setup: Any) -> tuple[str, ...]:
    """The vision-language flags a set-up gives (what a text-only model refuses)."""
    given = [("--images-per-sample", setup.images_per_sample), ("--image-size", setup.image_size),
             ("--max-pixels", setup.max_pixels), *((flag, getattr(setup, name)) for name, flag in FREEZE_FLAGS.items())]
    return tuple(flag for flag, value in given if value)


def check_images(setup: Any) -> None:
    """The counts and sizes stand alone: images per sample >= 0, an HxW size given with them (and only with them),
    a positive pixel bound."""
    if setup.images_per_sample < 0:
        raise LlmemError(f"--images-per-sample must be >= 0, got {setup.images_per_sample}")
    if setup.max_pixels is not None and setup.max_pixels < 1:
        raise LlmemError(f"--max-pixels must be a positive pixel count, got {setup.max_pixels}")
    if setup.image_size is not None:
        parse_image_size(setup.image_size)
    if setup.images_per_sample and setup.image_size is None:
        raise LlmemError("--images-per-sample needs --image-size HxW: the images' size before the processor "
                         "resizes them sets their visual tokens")
    if not setup.images_per_sample and (setup.image_size is not None or setup.max_pixels is not None):
        raise LlmemError("--image-size / --max-pixels describe the samples' images: give --images-per-sample N too")
