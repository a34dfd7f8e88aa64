"""Vision-language rows of the families added once llmem.validate.matrices was full (it imports them into its ci and
vlm matrices): InternVL's.

- INTERNVL_CI_ROWS: tiny-internvl (112 px tiles of 8 x 8 patches and a class token, pixel-shuffled to 16 tokens a
  tile); 448x448 takes 3 x 3 tiles and the thumbnail (160 image tokens), 300x500 3 x 2 and the thumbnail. Each part
  frozen, LoRA, the frozen tower under checkpointing, two images a sample, DDP, FSDP2 (each InternVLVisionLayer a
  unit: the model's _no_split_modules), DeepSpeed ZeRO-3 with HF's "auto" sizes.
- INTERNVL_VLM_ROWS: InternVL3-1B / 2B / 8B at 1024x768 (4 x 3 tiles and the thumbnail: 3,328 tokens).
"""

from __future__ import annotations

from llmem.setup.training import TrainingSetup
from llmem.validate.rows import row as _s

_TINY = dict(precision="bf16-mixed", batch_size=4, seq_len=64, images_per_sample=1, image_size="448x448")
_ZERO3_AUTO = dict(reduce_bucket_size="auto", prefetch_bucket_size="auto", param_persistence_threshold="auto")

INTERNVL_CI_ROWS: list[TrainingSetup] = [
    *(_s("tiny-internvl", **{**_TINY, **kw}) for kw in (
        {}, {"freeze_vision_tower": True}, {"freeze_projector": True}, {"freeze_language_model": True},
        {"lora_rank": 8}, {"freeze_vision_tower": True, "grad_ckpt": True},
        {"images_per_sample": 2, "image_size": "300x500"})),
    _s("tiny-internvl", "ddp", 2, **_TINY),
    _s("tiny-internvl", "fsdp", 2, **_TINY, lora_rank=8),
    _s("tiny-internvl", "zero2", 2, **_TINY),
    _s("tiny-internvl", "ds-zero3", 2, **_TINY, **_ZERO3_AUTO),
]

_VL = {"precision": "bf16-mixed", "seq_len": 512, "images_per_sample": 1, "image_size": "1024x768", "batch_size": 1}
INTERNVL_VLM_ROWS: list[TrainingSetup] = [
    _s(f"OpenGVLab/InternVL3-{size}-hf", **{**_VL, **kw}) for size, kw in (
        ("1B", {}), ("1B", {"lora_rank": 16}), ("2B", {"lora_rank": 16, "grad_ckpt": True}),
        ("2B", {"freeze_language_model": True, "grad_ckpt": True}),
        ("8B", {"lora_rank": 16, "grad_ckpt": True}), ("8B", {"freeze_vision_tower": True, "grad_ckpt": True}))]
