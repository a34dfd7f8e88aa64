"""Vision-language rows llmem.validate.matrices imports: the vlm matrix (every family at real sizes, one GPU), and
the CI rows of the families added once matrices.py was full (InternVL, Llama 3.2 Vision, Llama 4).

- INTERNVL_CI_ROWS: tiny-internvl (112 px tiles of 8 x 8 patches and a class token, pixel-shuffled to 16 tokens a
  tile); 448x448 takes 3 x 3 tiles and the thumbnail (160 image tokens), 300x500 3 x 2 and the thumbnail. Each part
  frozen, LoRA, the frozen tower under checkpointing, two images a sample, DDP, FSDP2 (each InternVLVisionLayer a
  unit: the model's _no_split_modules), DeepSpeed ZeRO-3 with HF's "auto" sizes.
- INTERNVL_VLM_ROWS: InternVL3-1B / 2B / 8B at 1024x768 (4 x 3 tiles and the thumbnail: 3,328 tokens).
- MLLAMA_CI_ROWS: tiny-mllama (Llama 3.2 Vision's two kinds of decoder layer: layers 1 and 3 of 4 cross-attend to
  the image features; 112 px tiles of 8 x 8 patches and a class token); 448x448 takes 2 x 2 tiles, one <|image|>
  token. The full step, the tower or the language model frozen (the layers below the first cross-attention layer
  then run without a graph), LoRA, the frozen tower under checkpointing, two images a sample, DDP, FSDP2 (each
  encoder block of the local and the global transformer a unit), DeepSpeed ZeRO-3.
- LLAMA4_CI_ROWS: tiny-llama4 (4 MoE decoder layers of 4 experts, chunked attention of 128 and a full-attention
  NoPE layer; 112 px tiles of 8 x 8 patches and a class token, pixel-shuffled to 16 tokens a tile); 224x224 takes
  2 x 2 tiles and the global one (80 image tokens, 144 a sample with the text: past the chunk). The full step, the
  tower frozen, LoRA, and FSDP2 with LoRA (each Llama4VisionEncoderLayer a unit).
- LLAMA4_VLM_ROWS: Llama-4-Scout-17B-16E-Instruct at 1024x768 (4 x 3 tiles and the global one: 1,872 tokens).
- MLLAMA_VLM_ROWS: Llama-3.2-11B-Vision at 560x560 (one tile of 40 x 40 patches and a class token, padded to 4
  tiles: 6,404 vision tokens a cross-attention layer reads, 1 <|image|> token), and two 1120x1120 images a sample.
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

MLLAMA_CI_ROWS: list[TrainingSetup] = [
    *(_s("tiny-mllama", **{**_TINY, **kw}) for kw in (
        {}, {"freeze_vision_tower": True}, {"freeze_language_model": True}, {"lora_rank": 8},
        {"freeze_vision_tower": True, "grad_ckpt": True}, {"images_per_sample": 2, "image_size": "300x500"})),
    _s("tiny-mllama", "ddp", 2, **_TINY, freeze_vision_tower=True, grad_ckpt=True),
    _s("tiny-mllama", "ddp", 2, **_TINY),     # everything trained: one bucket per dtype (llmem.estimator.ddp_buckets)
    _s("tiny-mllama", "fsdp", 2, **_TINY),
    _s("tiny-mllama", "fsdp", 2, **_TINY, lora_rank=8),
    _s("tiny-mllama", "ds-zero3", 2, **_TINY),
]

_TINY_L4 = {**_TINY, "image_size": "224x224"}
LLAMA4_CI_ROWS: list[TrainingSetup] = [
    *(_s("tiny-llama4", **{**_TINY_L4, **kw}) for kw in ({}, {"freeze_vision_tower": True}, {"lora_rank": 8})),
    _s("tiny-llama4", "fsdp", 2, **_TINY_L4, lora_rank=8),
]

_VL = {"precision": "bf16-mixed", "seq_len": 512, "images_per_sample": 1, "image_size": "1024x768", "batch_size": 1}
INTERNVL_VLM_ROWS: list[TrainingSetup] = [
    _s(f"OpenGVLab/InternVL3-{size}-hf", **{**_VL, **kw}) for size, kw in (
        ("1B", {}), ("1B", {"lora_rank": 16}), ("2B", {"lora_rank": 16, "grad_ckpt": True}),
        ("2B", {"freeze_language_model": True, "grad_ckpt": True}),
        ("8B", {"lora_rank": 16, "grad_ckpt": True}), ("8B", {"freeze_vision_tower": True, "grad_ckpt": True}))]

_MLLAMA = {"precision": "bf16-mixed", "seq_len": 512, "images_per_sample": 1, "image_size": "560x560", "batch_size": 1}
MLLAMA_VLM_ROWS: list[TrainingSetup] = [
    _s("meta-llama/Llama-3.2-11B-Vision", **{**_MLLAMA, **kw}) for kw in (
        {"lora_rank": 16}, {"lora_rank": 16, "grad_ckpt": True}, {"freeze_vision_tower": True, "grad_ckpt": True},
        {"freeze_language_model": True, "grad_ckpt": True},
        {"lora_rank": 16, "grad_ckpt": True, "images_per_sample": 2, "image_size": "1120x1120", "batch_size": 2})]

LLAMA4_VLM_ROWS: list[TrainingSetup] = [
    _s("meta-llama/Llama-4-Scout-17B-16E-Instruct", **{**_VL, **kw}) for kw in (
        {"lora_rank": 16, "grad_ckpt": True}, {"freeze_language_model": True, "grad_ckpt": True})]

# Vision-language steps at real sizes, one GPU: the vlm matrix (benchmarks/vlm_estimate.md; images at and above
# LLaMA-Factory's image_max_pixels 768 x 768)
VL_SHAPE = {"precision": "bf16-mixed", "seq_len": 512, "images_per_sample": 1, "image_size": "1024x768"}
VLM_MATRIX: list[TrainingSetup] = [
    *(_s("Qwen/Qwen2.5-VL-7B-Instruct", batch_size=1, **VL_SHAPE, **kw) for kw in (
        {"lora_rank": 16}, {"lora_rank": 16, "grad_ckpt": True}, {"freeze_language_model": True, "grad_ckpt": True},
        {"freeze_vision_tower": True, "grad_ckpt": True})),
    *(_s("Qwen/Qwen2.5-VL-3B-Instruct", batch_size=2, **{**VL_SHAPE, "seq_len": 256, "images_per_sample": 2,
                                                          "image_size": "1280x720"}, grad_ckpt=True, **kw)
      for kw in ({}, {"lora_rank": 16})),
    # Gemma 3 (every image one 896x896 crop: 4,096 patches, 256 tokens)
    *(_s(f"google/gemma-3-{size}-it", **{**VL_SHAPE, **kw}) for size, kw in (
        ("4b", {"batch_size": 1, "lora_rank": 16}), ("4b", {"batch_size": 1, "lora_rank": 16, "grad_ckpt": True}),
        ("4b", {"batch_size": 1, "freeze_vision_tower": True, "grad_ckpt": True}),
        ("4b", {"batch_size": 2, "images_per_sample": 2, "freeze_language_model": True, "grad_ckpt": True}),
        ("12b", {"batch_size": 1, "lora_rank": 16, "grad_ckpt": True}),
        ("27b", {"batch_size": 1, "images_per_sample": 2, "lora_rank": 16, "grad_ckpt": True}))),
    *(_s(f"Qwen/Qwen3-VL-{size}-Instruct", **{**VL_SHAPE, "batch_size": 1, **kw}) for size, kw in (   # Qwen3-VL
        ("2B", {}), ("2B", {"lora_rank": 16}), ("4B", {"freeze_vision_tower": True, "grad_ckpt": True}),
        ("2B", {"batch_size": 2, "images_per_sample": 2, "freeze_language_model": True, "grad_ckpt": True}),
        *((z, {"lora_rank": 16, "grad_ckpt": True, "images_per_sample": n}) for z, n in (("4B", 1), ("8B", 1), ("32B", 2))))),
    # LLaVA-OneVision (a 1024x768 image alone: 6 tiles and the base crop, 4,744 tokens; two a sample: 730 each)
    *(_s(f"llava-hf/llava-onevision-qwen2-{size}-ov-hf", **{**VL_SHAPE, "batch_size": 1, **kw}) for size, kw in (
        ("0.5b", {}), ("0.5b", {"lora_rank": 16}),
        ("0.5b", {"batch_size": 2, "images_per_sample": 2, "freeze_language_model": True, "grad_ckpt": True}),
        ("7b", {"lora_rank": 16, "grad_ckpt": True}), ("7b", {"freeze_vision_tower": True, "grad_ckpt": True}))),
    # Idefics3 / SmolVLM (a 1024x768 image: 4 x 3 tiles and the global frame; 832 tokens on SmolVLM-256M's 512 px
    # tiles, 1,053 on SmolVLM's 384 px, 2,197 on Idefics3's 364 px)
    *(_s(model, **{**VL_SHAPE, "batch_size": 1, **kw}) for model, kw in (
        ("HuggingFaceTB/SmolVLM-256M-Instruct", {}), ("HuggingFaceTB/SmolVLM-256M-Instruct", {"lora_rank": 16}),
        ("HuggingFaceTB/SmolVLM-Instruct", {"lora_rank": 16, "grad_ckpt": True}),
        ("HuggingFaceTB/SmolVLM-Instruct", {"freeze_vision_tower": True, "grad_ckpt": True}),
        ("HuggingFaceTB/SmolVLM2-2.2B-Instruct", {"lora_rank": 16, "grad_ckpt": True}),
        ("HuggingFaceM4/Idefics3-8B-Llama3", {"lora_rank": 16, "grad_ckpt": True}),
        ("HuggingFaceM4/Idefics3-8B-Llama3", {"freeze_vision_tower": True, "grad_ckpt": True}))),
    *INTERNVL_VLM_ROWS, *MLLAMA_VLM_ROWS, *LLAMA4_VLM_ROWS]
