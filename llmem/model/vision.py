"""Vision-language models: one row per transformers `model_type` llmem builds as a VLM, naming its three parts.

A VLM's class (transformers' AutoModelForImageTextToText) holds a vision encoder (a stack of blocks over image
patches), a projector (Qwen's patch merger: 2x2 patches -> one token of the language model's width; Gemma 3's
average pool of 4x4 patches, normed and projected; LLaVA-OneVision's two-layer MLP; Idefics3 / SmolVLM's connector,
a pixel shuffle of scale_factor^2 patches into one token and a linear; Llama 3.2 Vision's linear from the tower's
concatenated layers to the text width; InternVL's pixel shuffle of 2x2 patches, a LayerNorm and a two-layer MLP; Llama 4's linear after the tower's own
pixel shuffle and MLP; Qwen3-VL's deepstack mergers, which feed the language model's first layers,
count with the tower, as LLaMA-Factory counts them) and a language model (a decoder stack, whose layers are the
anatomy's decoder layers; Llama 3.2 Vision's are of two kinds, some attending the image features). Each parameter
belongs to one part, read from its name by the row's prefixes. Adding a family: a row here, its processor in llmem.model.images.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

VISION = "vision"          # the vision encoder: patch embedding and its blocks
PROJECTOR = "projector"    # the merger / multi-modal projector
LANGUAGE = "language"      # the language model: embeddings, decoder layers, final norm, lm_head
PARTS = (VISION, PROJECTOR, LANGUAGE)
PEFT_PREFIX = "base_model.model."   # peft's PeftModelForCausalLM names the base model's parameters under it


@dataclass(frozen=True, kw_only=True)
class VisionLanguageSpec:
    """Where a VLM class keeps each part (parameter-name prefixes of the built model)."""
    architecture: str            # the transformers class AutoModelForImageTextToText builds
    vision: str                  # the vision encoder's module (its patch embedding, blocks and rotary)
    vision_blocks: str           # the encoder's ModuleList of blocks
    projector: str               # the projector's module (inside the vision module for Qwen)
    language_layers: str         # the language model's decoder layers (the anatomy's decoder layers)
    processor: str               # the image processor's row (llmem.model.images.PROCESSORS)
    modeling: str                # transformers' modeling module of the class (its checks patched on fake tensors)
    special_tokens: tuple[str, ...]    # the config attributes of every multimodal token (no random text id is one)
    # the config attributes of the tokens around each image's placeholder tokens ("": none, LLaVA's bare <image> run)
    image_start: str = ""
    image_end: str = ""
    image_token: str = "image_token_id"    # the config field holding the image placeholder token's id
    # the language model's position ids per token, passed to the forward (Qwen's multimodal RoPE: 3, t/h/w, from
    # the model's get_rope_index); 0: the model makes its own (an arange, inside the forward)
    position_rows: int = 1
    grid_input: bool = False     # the forward takes the images' patch grid (Qwen's image_grid_thw)
    # transformers.vision_utils' functions of the images' grid its vision code calls (Qwen's): answered from the real
    # grid in the trace, where it reads their values on the host (llmem.runtime.vision)
    index_values: tuple[str, ...] = ()
    token_types: bool = False    # the forward takes token_type_ids (1 on image tokens: Gemma 3's bidirectional mask)
    # bool [batch, 1, tokens, tokens] masks the model builds once per forward from them (Gemma 3's full and sliding
    # ones, create_masks_for_vision_model), live until the language model returns
    forward_masks: int = 0
    # the language model indexes its hidden states by the image tokens' bool mask [batch, tokens] (Qwen3-VL's deepstack:
    # hidden_states[visual_pos_masks, :] in its first layers), a count the trace answers (llmem.runtime.vision)
    image_mask_indexing: bool = False
    # the forward takes each image's size as the processor read it (image_sizes [images, 2]) and each sample's image
    # count (batch_num_images [batch]), which it reads on the host to cut and unpad the tiles (LLaVA-OneVision's anyres)
    image_sizes: bool = False
    # the tower's modules besides its blocks that FSDP2 makes units of their own, run before the blocks: those whose
    # class the model names in `_no_split_modules` (SigLIP's SiglipVisionEmbeddings: Gemma 3, LLaVA-OneVision), as accelerate's auto-wrap
    # wraps them (llmem.runtime.distributed.vision_units; tests check the two against accelerate's policy)
    leading_units: tuple[str, ...] = ()
    # the forward takes the processor's pixel_attention_mask (int64 [batch, images, height, width], 1 on each frame's
    # real pixels) and drops all-zero padding frames by a bool mask over the frames, whose count it reads on the host
    # (Idefics3 / SmolVLM's get_image_features: `pixel_values[real_images_inds]`, `.tolist()` of the per-sample count)
    pixel_mask: bool = False
    # the module inside each block that the model's `_no_split_modules` names, which accelerate wraps as the block's
    # FSDP2 unit ("": the block itself; Idefics3 / SmolVLM name their blocks' attention, Idefics3VisionAttention:
    # "self_attn", the rest of each block in the root unit)
    unit_in_block: str = ""
    # the image features are cast to the model's dtype (PreTrainedModel.dtype: its first parameter's, the tower's patch
    # embedding) and masked_scatter'ed into the text embeddings uncast (SmolVLMModel.forward): under *-mixed, where a
    # frozen part is held in the compute dtype and a trained one in fp32, a tower frozen beside trained embeddings (or
    # the reverse) fails in transformers itself
    features_in_tower_dtype: bool = False
    # DeepSpeed's engine (ds-zero1/2/3) is modelled for the family (llmem.estimator.deepspeed_tower: the tower's blocks
    # fetched whole); False where it is not (Idefics3 / SmolVLM, whose units are the blocks' attention: +18 % to +34 %
    # over the trace under ds-zero2 / 3 on tiny-idefics3, refused)
    deepspeed: bool = True
    # the text config's list of the decoder layers that cross-attend to the image features instead of taking image
    # tokens in the sequence (Llama 3.2 Vision's MllamaCrossAttentionDecoderLayer); "": none. The forward then takes
    # the processor's aspect_ratio_ids [batch, images], aspect_ratio_mask [batch, images, tiles] and
    # cross_attention_mask [batch, tokens, images, tiles] (int64)
    cross_attention_layers: str = ""
    # a second ModuleList of encoder blocks the tower runs after vision_blocks, FSDP2 units too (Llama 3.2 Vision's
    # gated global transformer after its local one); "": none
    later_blocks: str = ""

    @property
    def wrap_tokens(self) -> int:
        """The tokens around each image's placeholder run (its start and end tokens)."""
        return 2 if self.image_start else 0


VISION_LANGUAGE: dict[str, VisionLanguageSpec] = {
    # transformers 5's Qwen2_5_VLForConditionalGeneration: model.visual (Qwen2_5_VisionTransformerPretrainedModel:
    # patch_embed, blocks, merger) and model.language_model (Qwen2_5_VLTextModel), lm_head beside them
    "qwen2_5_vl": VisionLanguageSpec(architecture="Qwen2_5_VLForConditionalGeneration", vision="model.visual",
                                     vision_blocks="model.visual.blocks", projector="model.visual.merger",
                                     language_layers="model.language_model.layers", processor="qwen2_vl",
                                     modeling="transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
                                     image_start="vision_start_token_id", image_end="vision_end_token_id",
                                     special_tokens=("image_token_id", "video_token_id", "vision_start_token_id",
                                                     "vision_end_token_id"),
                                     position_rows=3, grid_input=True,
                                     index_values=("get_vision_position_ids", "get_vision_attention_seqlens",
                                                   "get_vision_window_index")),
    # transformers 5's Qwen3VLForConditionalGeneration: model.visual (Qwen3VLVisionModel: patch_embed, a learned
    # pos_embed resampled to each image's grid, blocks, merger, and the deepstack_merger_list whose features are added
    # to the hidden states of the language model's first layers) and model.language_model (Qwen3VLTextModel). The
    # projector is the merger alone: LLaMA-Factory's qwen3_vl row (projector_keys visual.merger) counts the deepstack
    # mergers with the vision tower (vision_model_keys ... visual.deepstack_merger_list)
    "qwen3_vl": VisionLanguageSpec(architecture="Qwen3VLForConditionalGeneration", vision="model.visual",
                                   vision_blocks="model.visual.blocks", projector="model.visual.merger",
                                   language_layers="model.language_model.layers", processor="qwen3_vl",
                                   modeling="transformers.models.qwen3_vl.modeling_qwen3_vl",
                                   image_start="vision_start_token_id", image_end="vision_end_token_id",
                                   special_tokens=("image_token_id", "video_token_id", "vision_start_token_id",
                                                   "vision_end_token_id"),
                                   position_rows=3, grid_input=True,
                                   index_values=("get_vision_position_ids", "get_vision_attention_seqlens",
                                                 "get_vision_interpolation_indices_and_weights"),
                                   image_mask_indexing=True),
    # transformers 5's Gemma3ForConditionalGeneration: model.vision_tower (SiglipVisionModel: embeddings, encoder
    # layers, post_layernorm), model.multi_modal_projector (Gemma3MultiModalProjector: average pool to
    # mm_tokens_per_image, RMSNorm, a [vision, text] matrix) beside it, model.language_model (Gemma3TextModel), lm_head
    # tied to the embeddings; the processor's token_type_ids make the image tokens attend each other both ways
    "gemma3": VisionLanguageSpec(architecture="Gemma3ForConditionalGeneration", vision="model.vision_tower",
                                 vision_blocks="model.vision_tower.encoder.layers",
                                 projector="model.multi_modal_projector",
                                 language_layers="model.language_model.layers", processor="gemma3",
                                 modeling="transformers.models.gemma3.modeling_gemma3",
                                 image_start="boi_token_id", image_end="eoi_token_id",
                                 special_tokens=("image_token_id", "boi_token_id", "eoi_token_id"),
                                 position_rows=0, token_types=True, forward_masks=2,
                                 leading_units=("model.vision_tower.embeddings",)),
    # transformers 5's LlavaOnevisionForConditionalGeneration: model.vision_tower (SiglipVisionModel: embeddings,
    # encoder layers, post_layernorm, whose output the model never reads: it takes the last layer's hidden states),
    # model.multi_modal_projector (LlavaOnevisionMultiModalProjector: linear, GELU, linear), model.image_newline (one
    # vector closing each row of tiles: with the language model, as LLaVA-NeXT's train.py tunes it with
    # mm_language_model), model.language_model (Qwen2Model), lm_head; no tokens around an image's <image> run
    "llava_onevision": VisionLanguageSpec(architecture="LlavaOnevisionForConditionalGeneration",
                                          vision="model.vision_tower", vision_blocks="model.vision_tower.encoder.layers",
                                          projector="model.multi_modal_projector",
                                          language_layers="model.language_model.layers", processor="llava_onevision",
                                          modeling="transformers.models.llava_onevision.modeling_llava_onevision",
                                          special_tokens=("image_token_id", "video_token_id"), position_rows=0,
                                          image_sizes=True, leading_units=("model.vision_tower.embeddings",)),
    # transformers 5's Idefics3ForConditionalGeneration (Idefics3-8B-Llama3, SmolVLM v1): model.vision_model
    # (Idefics3VisionTransformer: SigLIP embeddings over any frame size, encoder layers, post_layernorm),
    # model.connector (Idefics3Connector: pixel_shuffle by scale_factor, one bias-free linear), model.text_model (a
    # Llama), lm_head; the processor writes <fake_token_around_image>, <row_r_col_c> / <global-img> and image_seq_len
    # <image> tokens a frame: only <image> is in the config, the rest are text tokens to the model
    "idefics3": VisionLanguageSpec(architecture="Idefics3ForConditionalGeneration", vision="model.vision_model",
                                   vision_blocks="model.vision_model.encoder.layers", projector="model.connector",
                                   language_layers="model.text_model.layers", processor="idefics3",
                                   modeling="transformers.models.idefics3.modeling_idefics3",
                                   special_tokens=("image_token_id",), position_rows=0, pixel_mask=True,
                                   unit_in_block="self_attn", deepspeed=False),
    # transformers 5's SmolVLMForConditionalGeneration (SmolVLM2): Idefics3's modules under SmolVLM's names
    "smolvlm": VisionLanguageSpec(architecture="SmolVLMForConditionalGeneration", vision="model.vision_model",
                                  vision_blocks="model.vision_model.encoder.layers", projector="model.connector",
                                  language_layers="model.text_model.layers", processor="smolvlm",
                                  modeling="transformers.models.smolvlm.modeling_smolvlm",
                                  special_tokens=("image_token_id",), position_rows=0, pixel_mask=True,
                                  unit_in_block="self_attn", deepspeed=False, features_in_tower_dtype=True),
    # transformers 5's MllamaForConditionalGeneration (Llama 3.2 Vision): model.vision_model (MllamaVisionModel: the
    # tiles' patch embedding, a local transformer of 32 layers and a gated global one of 8, whose output is
    # concatenated with 5 intermediate local layers' hidden states), model.multi_modal_projector (one biased linear
    # 7680 -> text width), model.language_model (MllamaTextModel: self-attention layers and, at
    # cross_attention_layers, gated cross-attention layers reading the projected tiles' states), lm_head untied.
    # LLaMA-Factory's mllama row: vision_model_keys vision_model, projector_key multi_modal_projector
    "mllama": VisionLanguageSpec(architecture="MllamaForConditionalGeneration", vision="model.vision_model",
                                 vision_blocks="model.vision_model.transformer.layers",
                                 projector="model.multi_modal_projector",
                                 language_layers="model.language_model.layers", processor="mllama",
                                 modeling="transformers.models.mllama.modeling_mllama",
                                 special_tokens=("image_token_id",), position_rows=0,
                                 later_blocks="model.vision_model.global_transformer.layers",
                                 cross_attention_layers="cross_attention_layers"),
    # transformers 5's InternVLForConditionalGeneration (InternVL3 -hf): model.vision_tower (InternVLVisionModel:
    # embeddings with a class token, encoder.layer of InternVLVisionLayer, its final layernorm an Identity under
    # use_mean_pooling), model.multi_modal_projector (InternVLMultiModalProjector: a LayerNorm over the pixel-shuffled
    # patches, linear, GELU, linear), model.language_model (Qwen2Model), lm_head; every image's tiles stacked into
    # one pixel_values; the processor writes <img>, image_seq_length <IMG_CONTEXT> a tile, </img>: only
    # <IMG_CONTEXT> is in the config, <img> and </img> are text tokens to the model. LLaMA-Factory's internvl row:
    # vision_model_keys vision_tower, projector_key multi_modal_projector
    "internvl": VisionLanguageSpec(architecture="InternVLForConditionalGeneration", vision="model.vision_tower",
                                   vision_blocks="model.vision_tower.encoder.layer",
                                   projector="model.multi_modal_projector",
                                   language_layers="model.language_model.layers", processor="internvl",
                                   modeling="transformers.models.internvl.modeling_internvl",
                                   special_tokens=("image_token_id",), position_rows=0),
    # transformers 5's Llama4ForConditionalGeneration (Llama 4 Scout / Maverick): vision_model (Llama4VisionModel:
    # an unfolded-patch linear, a class token and learned positions, model.layers of Llama4VisionEncoderLayer with a
    # 2-D complex rotary, layernorm_post, then vision_adapter: pixel_shuffle by pixel_shuffle_ratio and a two-layer
    # MLP), multi_modal_projector (one bias-free linear to the text width), language_model (Llama4ForCausalLM: MoE
    # layers, chunked attention with every 4th layer full and without RoPE, its own lm_head), at the model's top
    # level (no `model.` prefix); the processor writes <|image_start|>, the tiles' <|patch|> tokens (the config's
    # image_token_index) with <|tile_x_separator|> / <|tile_y_separator|> between them, <|image|> and the global
    # tile's, <|image_end|>: only <|patch|> takes features, the rest are text tokens to the model. LLaMA-Factory's
    # llama4 row: vision_model_keys vision_model, projector_key multi_modal_projector
    "llama4": VisionLanguageSpec(architecture="Llama4ForConditionalGeneration", vision="vision_model",
                                 vision_blocks="vision_model.model.layers", projector="multi_modal_projector",
                                 language_layers="language_model.model.layers", processor="llama4",
                                 modeling="transformers.models.llama4.modeling_llama4",
                                 special_tokens=("image_token_id", "boi_token_id", "eoi_token_id"), position_rows=0),
}


def vision_spec(model_type: str) -> VisionLanguageSpec | None:
    """The VLM row of a model type, or None for a text-only model."""
    return VISION_LANGUAGE.get(model_type)


def text_section(config: dict) -> dict:
    """The decoder's own part of a config as a dict: a multimodal config's text_config, else the config itself
    (llmem.model.families.text_config reads a transformers config object so)."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def cross_attention_layers(anatomy) -> frozenset[int]:
    """The decoder layers of a ModelAnatomy that cross-attend to the image features (its row's cross_attention_layers,
    a list in the text config: Llama 3.2 Vision's MllamaCrossAttentionDecoderLayer); empty for one layer kind."""
    spec = vision_spec(anatomy.model_type)
    if spec is None or not spec.cross_attention_layers:
        return frozenset()
    return frozenset(int(i) for i in text_section(anatomy.config).get(spec.cross_attention_layers) or ())


def under(name: str, prefix: str) -> bool:
    """A module or parameter name at `prefix` or inside it (never under an empty prefix)."""
    return bool(prefix) and (name == prefix or name.startswith(prefix + "."))


def part_of(spec: VisionLanguageSpec, name: str) -> str:
    """The part a parameter (by its name in the built model, peft's `base_model.model.` prefix dropped) belongs to."""
    name = name.removeprefix(PEFT_PREFIX)
    if under(name, spec.projector):
        return PROJECTOR
    if under(name, spec.vision):
        return VISION
    return LANGUAGE


def part_params(anatomy) -> dict[str, int]:
    """Parameters of each part of a VLM anatomy (ModelAnatomy), by part name; {} for a text-only model."""
    spec = vision_spec(anatomy.model_type)
    if spec is None:
        return {}
    counts = dict.fromkeys(PARTS, 0)
    for p in anatomy.params:
        counts[part_of(spec, p.name)] += p.numel
    return counts


def vision_modules(model_type: str) -> tuple[str, ...]:
    """The modules holding a VLM's vision encoder and projector (one when the projector is inside the encoder's, as
    Qwen's merger is); () for a text-only model."""
    spec = vision_spec(model_type)
    if spec is None:
        return ()
    return (spec.vision,) if under(spec.projector, spec.vision) else (spec.vision, spec.projector)


def tower_units(anatomy) -> tuple[str, ...]:
    """A VLM's FSDP2 units in its vision tower (module paths, in forward order): its row's leading units, then each
    encoder block, or the module in it its row names (unit_in_block), then each later block (the class of every block,
    or of that module, is in the model's `_no_split_modules`, which accelerate's fsdp2_prepare_auto_wrap_policy
    wraps); () for a text-only model. The rest of the tower and the projector are in the root unit."""
    spec = vision_spec(anatomy.model_type)
    if spec is None:
        return ()
    return (*spec.leading_units, *_blocks(anatomy, spec.vision_blocks, spec.unit_in_block),
            *_blocks(anatomy, spec.later_blocks, spec.unit_in_block))


def _blocks(anatomy, blocks: str, inner: str = "") -> tuple[str, ...]:
    """The module paths of the blocks in the ModuleList `blocks` ("" none) that own parameters, in order (each one's
    `inner` module where it names one)."""
    if not blocks:
        return ()
    prefix = blocks + "."
    found = {int(name[len(prefix):].split(".")[0]) for p in anatomy.params
             if (name := p.name.removeprefix(PEFT_PREFIX)).startswith(prefix)}
    tail = f".{inner}" if inner else ""
    return tuple(f"{blocks}.{i}{tail}" for i in sorted(found))


def vision_root(model_type: str) -> str:
    """The module the vision side's pieces are named from: the vision module itself when it holds the projector
    (Qwen's visual), else the parent the two share (Gemma 3's model; the model itself, "", where both are at its top:
    Llama 4); "" for a text-only model too."""
    modules = vision_modules(model_type)
    if len(modules) < 2:
        return modules[0] if modules else ""
    return ".".join(os.path.commonprefix([m.split(".") for m in modules]))


def language_layers_suffix(model_type: str) -> str | None:
    """The end of the language model's layer list's module name (peft's wrapper puts prefixes before it), or None
    for a text-only model (whose decoder layers are its longest ModuleList)."""
    spec = vision_spec(model_type)
    return None if spec is None else spec.language_layers.removeprefix("model.")


# the parts each freeze switch leaves untrained (LLaMA-Factory's forbidden modules: vision_model_keys,
# projector_key, language_model_keys), set-up field -> part
FROZEN_PART = {"freeze_vision_tower": VISION, "freeze_projector": PROJECTOR, "freeze_language_model": LANGUAGE}


def frozen_parts(setup) -> tuple[str, ...]:
    """The parts a set-up's switches freeze (none on a text-only set-up)."""
    return tuple(part for name, part in FROZEN_PART.items() if getattr(setup, name, False))


def with_parts_frozen(anatomy, parts: tuple[str, ...]):
    """The anatomy (ModelAnatomy) with `parts`' parameters untrained; the anatomy itself when none is frozen."""
    spec = vision_spec(anatomy.model_type)
    if not parts or spec is None:
        return anatomy
    params = tuple(replace(p, trainable=False) if part_of(spec, p.name) in parts else p for p in anatomy.params)
    return replace(anatomy, params=params)
