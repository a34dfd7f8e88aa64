"""The installed transformers' Qwen2-VL image processor (its PIL backend: no torchvision), which Qwen2.5-VL and
Qwen3-VL ship, built from llmem's shipped preprocessor config of a PROCESSORS row, and what it makes of an image:
the independent path the visual token counts are checked against (tests/model/test_images.py, test_qwen3_vlm.py)."""

from __future__ import annotations

import json
import warnings

import numpy as np

from llmem.model.catalog import catalog_file
from llmem.model.images import PROCESSORS


def qwen_processor(row: str):
    """The processor of PROCESSORS[row], from its shipped preprocessor_config.json."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    raw = json.loads(catalog_file("processors", PROCESSORS[row].config_file))
    assert raw["image_processor_type"] == PROCESSORS[row].image_processor_type
    return Qwen2VLImageProcessorPil(**{k: v for k, v in raw.items()
                                       if k not in ("image_processor_type", "processor_class")})


def processed(processor, height: int, width: int, **kwargs) -> tuple[tuple[int, ...], tuple[int, int, int]]:
    """(pixel_values' shape, the image's (t, h, w) patch grid) of one blank height x width image."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = processor(images=[np.zeros((height, width, 3), dtype=np.uint8)], input_data_format="channels_last",
                        return_tensors="np", **kwargs)
    return out["pixel_values"].shape, tuple(int(v) for v in out["image_grid_thw"][0])
