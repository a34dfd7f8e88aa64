"""A set-up's images on its model: the visual tokens each sample adds to the language model's sequence and the
patches its vision encoder runs, as the model's processor makes them (llmem.model.images), and the checks that tie
the vision-language flags to the model.

The language model's sequence is the sample's text tokens (--seq-len) plus its images' placeholder tokens: the
processor expands each image's one placeholder to as many image tokens as the merger makes (Qwen2.5-VL's processor:
image_grid_thw.prod() // merge_size**2 per image; Gemma 3's: image_seq_length, 256, per image, each image one
896x896 crop; LLaVA-OneVision's: its base crop's and tiles' features with a newline token a row; Idefics3 /
SmolVLM's: image_seq_len a frame, its tiles and the global frame; their <fake_token_around_image>, <row_r_col_c>,
<global-img> and newline tokens count among the text tokens, as Qwen's start and end tokens do; InternVL's:
image_seq_length <IMG_CONTEXT> a tile, its tiles and thumbnail, between <img> and </img>, two text tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmem.errors import LlmemError
from llmem.model.anatomy import ModelAnatomy
from llmem.model.images import PROCESSORS, ImageGrid, image_grid, pixel_values_shape
from llmem.model.vision import VisionLanguageSpec, vision_spec
from llmem.setup.images import parse_image_size, vision_options
from llmem.setup.liger import applied_kernels
from llmem.setup.methods import method_spec
from llmem.setup.training import TrainingSetup

PIXEL_BYTES = {"float32": 4, "bfloat16": 2}     # pixel_values' bytes an element, by the processor's pixel_dtype


@dataclass(frozen=True)
class VisionInputs:
    """One sample's images as its model sees them."""
    images_per_sample: int
    requested: tuple[int, int]     # --image-size, before the processor's resize (height, width)
    image: ImageGrid               # one image after it
    text_tokens: int               # --seq-len

    @property
    def visual_tokens(self) -> int:
        return self.images_per_sample * self.image.tokens

    @property
    def language_tokens(self) -> int:
        """The language model's sequence per sample: text and image tokens."""
        return self.text_tokens + self.visual_tokens

    @property
    def patches(self) -> int:
        """The vision encoder's rows per sample (pixel_values' rows)."""
        return self.images_per_sample * self.image.patches

    def batch_bytes(self, batch_size: int, spec: VisionLanguageSpec) -> tuple[int, ...]:
        """The micro-batch's tensors on the device, in bytes: the token ids [batch, tokens] int64, pixel_values
        in its processor's pixel_dtype (as the processor makes them, of pixel_values_shape: fp32, Llama 4's bf16; the
        patch embedding casts its own copy), the
        language model's position ids
        [rows, batch, tokens] int64 where the forward takes them (get_rope_index's 3-D positions for Qwen) and the
        token_type_ids [batch, tokens] int64 where it takes them (Gemma 3), the pixel_attention_mask int64 [batch,
        frames, height, width] where it takes it (Idefics3ImageProcessor.pad: one int64 a pixel)."""
        tokens = batch_size * self.language_tokens
        pixels = math.prod(pixel_values_shape(spec.processor, self.image, batch_size * self.images_per_sample,
                                              self.images_per_sample))
        return (tokens * 8, pixels * PIXEL_BYTES[PROCESSORS[spec.processor].pixel_dtype],
                *((spec.position_rows * tokens * 8,) if spec.position_rows else ()),
                *((tokens * 8,) if spec.token_types else ()),
                *((pixels // 3 * 8,) if spec.pixel_mask else ()))

    def mask_bytes(self, batch_size: int, spec: VisionLanguageSpec) -> int:
        """The bool [batch, 1, tokens, tokens] masks the model builds once per forward (spec.forward_masks), in
        bytes: live from the image features' scatter to the language model's return."""
        return spec.forward_masks * batch_size * self.language_tokens ** 2

    def describe(self) -> str:
        img = self.image
        crops = f" in {img.crops} crops" if img.crops > 1 else ""
        if img.canvas_tiles[0]:     # tiled (Llama 3.2 Vision): its canvas's tiles, padded to the model's maximum
            crops = (f" in a {img.canvas_tiles[0]}x{img.canvas_tiles[1]} canvas of tiles, handed over as "
                     f"{img.crops} tiles")
        return (f"{self.images_per_sample} x {self.requested[0]}x{self.requested[1]} image(s) per sample, resized to "
                f"{img.height}x{img.width}{crops}: {img.grid_h}x{img.grid_w} patches ({img.patches:,}) and {img.tokens:,} "
                f"visual tokens each; the language model runs {self.text_tokens:,} text + {self.visual_tokens:,} "
                f"visual = {self.language_tokens:,} tokens per sample")


def vision_inputs(setup: TrainingSetup, anatomy: ModelAnatomy) -> VisionInputs | None:
    """The set-up's images on `anatomy` (None without images); its processor's refusals raised (one line)."""
    spec = vision_spec(anatomy.model_type)
    if spec is None or not setup.images_per_sample:
        return None
    height, width = parse_image_size(setup.image_size)
    grid = image_grid(spec.processor, height, width, setup.max_pixels, config=anatomy.config,
                      images_per_sample=setup.images_per_sample)
    return VisionInputs(setup.images_per_sample, (height, width), grid, setup.seq_len)


def check_vision(setup: TrainingSetup, anatomy: ModelAnatomy) -> None:
    """Vision-language flags on a text-only model are refused; on a vision-language model the images are sized by
    its processor (its refusals raised) and what its step does not wire yet is refused (step_refusal), for every
    engine alike."""
    spec = vision_spec(anatomy.model_type)
    given = vision_options(setup)
    if spec is None:
        if given:
            raise LlmemError(f"{given[0]} is for vision-language models: {anatomy.name} ({anatomy.model_type}) takes "
                             "text only; drop it")
        return
    refusal = step_refusal(setup, anatomy.model_type, vision_inputs(setup, anatomy))
    if refusal is not None:
        raise LlmemError(f"a vision-language model's step ({anatomy.model_type}): {refusal}")


def step_refusal(setup: TrainingSetup, model_type: str, inputs: VisionInputs | None) -> str | None:
    """What the vision-language step does not wire yet, in words with the fix (None: it runs): unwired_options, then
    what the images need of the sequence."""
    if inputs is None:
        return "a text-only step is not wired: give --images-per-sample N and --image-size HxW"
    refusal = unwired_options(setup, model_type)
    if refusal is not None:
        return refusal
    wrap = max(vision_spec(model_type).wrap_tokens, inputs.image.marker_tokens) * inputs.images_per_sample
    if inputs.text_tokens < wrap + 1:
        return (f"--seq-len {inputs.text_tokens} cannot hold {inputs.images_per_sample} image(s)' start and end "
                f"tokens and a text token: give --seq-len >= {wrap + 1}")
    return None


def unwired_options(setup: TrainingSetup, model_type: str | None = None, any_method: bool = False) -> str | None:
    """The first of `setup`'s options the vision-language step does not wire yet, in words with the fix (None: it
    runs; `model_type` None: Liger's kernels refused whatever the model; `any_method`: its options alone, as a
    what-if's for every layout it may run on, FSDP2's own refusals included). Wired (traced, and estimated from what
    the trace learns: llmem.learn): one GPU, DDP (each rank's one-GPU step beside the reducer's buckets) or FSDP2
    (fsdp / zero2: the tower's blocks units of their own, as accelerate's auto-wrap makes them: the schedule's
    llmem.estimator.schedule.vision_units) or DeepSpeed's engine (ds-zero1/2/3: ZeRO-3 fetching the tower's
    pieces as its hooks do, llmem.estimator.deepspeed_tower), the SFT loss on
    samples with images, full fine-tuning (each part trained or frozen) or LoRA (--lora-rank) on the language
    model's layers, gradient checkpointing of every layer. The planner asks it of its what-ifs
    (llmem.planner.suggestions)."""
    spec = method_spec(setup.method)
    fsdp2 = spec.shards_model_states and not spec.has_tp
    kernels = applied_kernels(setup.liger, model_type) if model_type is not None else setup.liger != "none"
    method = [] if any_method else [
        (not (spec.one_gpu or spec.gradient_buckets or fsdp2 or spec.zero_stage is not None), f"--method {setup.method}",
         "--method single, ddp, fsdp, zero2 or ds-zero1/2/3"),
        (setup.gpus > 1 and spec.one_gpu, f"--gpus {setup.gpus}", "--gpus 1 or --method ddp / fsdp"),
        (spec.zero_stage is not None and model_type is not None and not vision_spec(model_type).deepspeed,
         f"--method {setup.method}", f"--method single, ddp, fsdp or zero2 ({model_type} under DeepSpeed's engine is "
                                     "not modelled)")]
    unwired = [*method, *_fsdp2_unwired(setup, any_method),
               (setup.offload_param and spec.zero_stage is not None, "--offload-param",
                "drop it (ZeRO-3's parameter offload of a vision tower is not modelled)"),
               (bool(setup.objective_spec.trainer), f"--objective {setup.objective}", "--objective sft"),
               (setup.packing, "--packing", "drop it"),
               (setup.quant_spec.quantised, f"--quant-base {setup.quant_base}", "drop it"),
               (bool(setup.peft_config), "--peft-config", "use --lora-rank R (adapters on the language model)"),
               (bool(kernels), f"--liger {setup.liger}", "drop it"),
               (setup.offload_activations, "--offload-activations", "drop it"),
               (setup.fused_ce, "--fused-ce", "drop it"),
               (setup.compile, "--compile", "drop it"),
               (setup.float8 != "none", f"--float8 {setup.float8}", "drop it"),
               (setup.grad_ckpt and setup.ckpt_every > 1, f"--grad-ckpt-every {setup.ckpt_every}",
                "checkpoint every layer (--grad-ckpt)"),
               (setup.grad_ckpt and setup.ac_policy != "full", f"--ac-policy {setup.ac_policy}", "--ac-policy full"),
               (setup.optimizer_in_backward, "--optimizer-in-backward", "drop it"),
               (setup.offload_optimizer, "--offload-optimizer", "drop it")]
    for bad, what, fix in unwired:
        if bad:
            return f"{what} is not wired for it yet: {fix}"
    if (model_type is not None and vision_spec(model_type).features_in_tower_dtype and setup.mixed
            and not setup.lora_rank and setup.freeze_vision_tower != setup.freeze_language_model):
        return (f"--precision {setup.precision} with only one of the tower and the language model frozen: "
                f"{model_type}'s forward casts the image features to the tower's dtype and masked_scatter refuses "
                "them in embeddings of the other (transformers' SmolVLMModel.forward); use --precision bf16 or "
                "freeze both or neither")
    pixels = PROCESSORS[vision_spec(model_type).processor].pixel_dtype if model_type is not None else "float32"
    if not setup.mixed and setup.precision_spec.compute_dtype != pixels != "float32":
        return (f"--precision {setup.precision}: {model_type}'s processor hands over "
                f"{pixels} pixel values, which its patch embedding's linear takes as they "
                "are (transformers' Llama4UnfoldConvolution; no autocast casts them): use --precision bf16-mixed, "
                "fp16-mixed or bf16")
    if setup.lora_rank and setup.freeze_language_model:
        return ("--freeze-language-model with --lora-rank leaves nothing to train (LoRA adapts the language "
                "model): drop one")
    return None


def _fsdp2_unwired(setup: TrainingSetup, any_method: bool = False) -> list[tuple[bool, str, str]]:
    """What FSDP2 (fsdp / zero2) does not wire yet for a vision-language step: HSDP, the other parallelisms, an int
    reshard_after_forward (post-forward shards of the tower's units), CPUOffloadPolicy (each as (bad, flag, fix))."""
    if not (any_method or method_spec(setup.method).shards_model_states):
        return []
    return [(setup.dp_replicate > 1, f"--dp-replicate {setup.dp_replicate}", "drop it (plain FSDP2)"),
            (setup.pp > 1, f"--pp {setup.pp}", "drop it"), (setup.cp > 1, f"--cp {setup.cp}", "drop it"),
            (setup.ep > 1, f"--ep {setup.ep}", "drop it"),
            (setup.reshard_after_forward is not None, f"--reshard-after-forward {setup.reshard_after_forward}",
             "drop it (fsdp reshards every unit, zero2 none)"),
            (setup.offload_param, "--offload-param", "drop it")]
