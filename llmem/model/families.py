"""Model families: one row per transformers `model_type` llmem knows, the rule that finds a model's decoder layers,
and the rule that reads its head counts.

A row says which activation recipe describes its decoder layer (llmem.memory.activations.recipes.RECIPES, by
name; None: none written, the activations are learned from the real code (llmem.learn), Llama's recipe only
where learning is refused, with a note), the architectural details that recipe branches on, and
how the trace applies tensor parallelism to it (a Megatron-style plan of column- and row-parallel modules, or why
it cannot). Adding a family: docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.errors import LlmemError
from llmem.model.vision import language_layers_suffix


@dataclass(frozen=True, kw_only=True)
class TensorParallelPlan:
    """Megatron-style split per decoder layer: column-parallel and row-parallel module paths (within a layer)."""
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    local_heads: bool = False      # attention modules keep head counts as attributes: divide them by tp
    # torchtitan's sequence parallel (parallelize_llama): the norms within a layer run SequenceParallel, and the
    # TP regions with their residual-stream input (a keyword, or positional 0) gathered by PrepareModuleInput
    sp_norms: tuple[str, ...] = ()
    sp_regions: tuple[tuple[str, str | int], ...] = ()
    loss_parallel: bool = True     # the lm_head's vocab-sharded logits reach HF's cross-entropy as they are

    @property
    def sequence_parallel(self) -> bool:
        return bool(self.sp_norms)


_LLAMA_TP = TensorParallelPlan(
    colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    rowwise=("self_attn.o_proj", "mlp.down_proj"),
    sp_norms=("input_layernorm", "post_attention_layernorm"),
    sp_regions=(("self_attn", "hidden_states"), ("mlp", 0)))
# Gemma scales the embedding by a plain tensor and Gemma-2 adds post-norms and soft-caps the logits: no
# sequence parallel (and for Gemma-2 no loss parallel) modelled on them
_GEMMA_TP = TensorParallelPlan(colwise=_LLAMA_TP.colwise, rowwise=_LLAMA_TP.rowwise)
_GEMMA2_TP = TensorParallelPlan(colwise=_LLAMA_TP.colwise, rowwise=_LLAMA_TP.rowwise, loss_parallel=False)
_OPT_TP = TensorParallelPlan(colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1"),
                             rowwise=("self_attn.out_proj", "fc2"), local_heads=True)
_CONV1D_TP = ("tp is not supported for {model_type}: transformers has no TP plan for it (base_model_tp_plan is None) "
              "and its Conv1D c_attn/c_fc/c_proj layers cannot be split by torch's ColwiseParallel/RowwiseParallel "
              "(nn.Linear/nn.Embedding only); use ddp, fsdp or zero2")
_MOE_TP = ("tp is not supported for {model_type}: its experts are fused 3-D parameters (transformers' plan: "
           "packed_colwise / moe_tp_experts, no torch ParallelStyle), which llmem does not model; use ddp, fsdp or "
           "zero2")
_NO_TP = ("tp is not supported for model_type {model_type!r}: llmem has no TP plan for it (supported: Llama/Mistral/"
          "Qwen2/Qwen3/Gemma/Gemma-2 and OPT); use ddp, fsdp or zero2")


@dataclass(frozen=True, kw_only=True)
class FamilySpec:
    family: str                          # ModelAnatomy.family: the family whose conventions the model follows
    recipe: str | None                   # activation recipe name; None: learned from the real code
    norm: str = "rmsnorm"                # rmsnorm (HF Llama), rmsnorm_gemma (fp32 weight multiply), layernorm
    fused_projections: bool = False      # one qkv_proj and one gate_up_proj linear (Phi-3)
    post_norms: bool = False             # post-attention and post-feedforward norms (Gemma-2)
    experts: bool = False                # a routed MoE MLP (Mixtral: top-k experts, router logits)
    separate_qkv: bool = False           # GPT-Neo: q/k/v linears where GPT-2 has one c_attn
    parallel_attention: bool = False     # Falcon: attention and MLP from one LayerNorm, multi-query kv
    tp_plan: TensorParallelPlan | None = None
    tp_refusal: str = _NO_TP             # why no engine runs TP on it ({model_type}), when there is no plan
    # config values the learned copy (llmem.learn, 2 layers, layer 1 read) sets so that its layer 1 is a
    # routed MoE layer (DeepSeek-V3's first 3 layers are dense)
    learn_copy: tuple[tuple[str, object], ...] = ()
    flash_refusal: str | None = None     # why --attn flash is not modelled on it (one line), when it is not


FAMILIES: dict[str, FamilySpec] = {
    "llama": FamilySpec(family="llama", recipe="llama_like", tp_plan=_LLAMA_TP),
    "mistral": FamilySpec(family="llama", recipe="llama_like", tp_plan=_LLAMA_TP),
    "qwen2": FamilySpec(family="llama", recipe="llama_like", tp_plan=_LLAMA_TP),
    "qwen3": FamilySpec(family="llama", recipe=None, tp_plan=_LLAMA_TP),
    "gemma": FamilySpec(family="llama", recipe=None, tp_plan=_GEMMA_TP),
    "gemma2": FamilySpec(family="llama", recipe="llama_like", norm="rmsnorm_gemma", post_norms=True, tp_plan=_GEMMA2_TP),
    "phi3": FamilySpec(family="llama", recipe="llama_like", fused_projections=True,
                       tp_refusal="tp is not supported for phi3: transformers' own plan gathers the fused qkv_proj / "
                                  "gate_up_proj outputs on every rank (colwise_gather_output, rowwise_split_input), "
                                  "which llmem does not model (its TP splits heads); use ddp, fsdp or zero2"),
    # Mixtral: learned like the MoE rows below (transformers 5.24's grouped_mm experts run on the fp32 master weights
    # under autocast and keep the sorted T*k rows: Llama's recipe with experts was 4-5 % low in fp32 and bf16-mixed)
    "mixtral": FamilySpec(family="llama", recipe=None, experts=True,
                          tp_refusal="tp is not supported for mixtral: its experts are fused 3-D parameters "
                                     "(transformers' plan: packed_colwise / moe_tp_experts, no torch "
                                     "ParallelStyle), which llmem does not model; use ddp, fsdp or zero2"),
    # MoE families without a hand recipe: activations learned from the real code (the grouped_mm experts, router,
    # sort and gathers as transformers 5.24 runs them; llmem.model.moe). experts=True only where intermediate_size is
    # one expert's width (gpt-oss), for the fallback recipe; Qwen3-MoE's and DeepSeek's intermediate_size is the
    # dense MLP's (= top_k x moe_intermediate_size in the published configs), which the fallback then models
    "qwen3_moe": FamilySpec(family="llama", recipe=None, tp_refusal=_MOE_TP,
                            learn_copy=(("decoder_sparse_step", 1), ("mlp_only_layers", ()))),
    "gpt_oss": FamilySpec(family="llama", recipe=None, experts=True, tp_refusal=_MOE_TP),
    "deepseek_v3": FamilySpec(family="llama", recipe=None, tp_refusal=_MOE_TP,
                              learn_copy=(("first_k_dense_replace", 1),),
                              flash_refusal="--attn flash is not modelled for deepseek_v3: MLA's value heads (v_head_dim) "
                                            "are narrower than its query/key heads (qk_nope + qk_rope head dims), "
                                            "which transformers pads for flash-attn and PyTorch's flash kernel does "
                                            "not take; use --attn sdpa"),
    # Gemma-3's text model (Gemma3ForCausalLM; the catalog's gemma-3 entries are their text configs)
    "gemma3_text": FamilySpec(family="llama", recipe=None, norm="rmsnorm_gemma", post_norms=True, tp_plan=_GEMMA_TP),
    "gpt2": FamilySpec(family="gpt2", recipe="gpt2", norm="layernorm", tp_refusal=_CONV1D_TP),
    "gpt_bigcode": FamilySpec(family="gpt2", recipe="gpt2", norm="layernorm",
                              tp_refusal="tp is not supported for gpt_bigcode: transformers has no TP plan for it "
                                         "(base_model_tp_plan is None) and its fused c_attn holds the queries with "
                                         "the one multi-query key/value head, which a column split cuts across; "
                                         "use ddp, fsdp or zero2"),
    "gpt_neo": FamilySpec(family="gpt_neo", recipe="gpt2", norm="layernorm", separate_qkv=True),
    "opt": FamilySpec(family="opt", recipe="opt", norm="layernorm", tp_plan=_OPT_TP),
    "biogpt": FamilySpec(family="opt", recipe="opt", norm="layernorm"),
    "bloom": FamilySpec(family="bloom", recipe="bloom", norm="layernorm"),
    "falcon": FamilySpec(family="falcon", recipe="parallel_block", norm="layernorm", parallel_attention=True),
    "codegen": FamilySpec(family="codegen", recipe="parallel_block", norm="layernorm"),
}
UNKNOWN_FAMILY = FamilySpec(family="llama", recipe=None)   # model types without a row: activations learned from the real code


def family_of(model_type: str) -> FamilySpec:
    return FAMILIES.get(model_type, UNKNOWN_FAMILY)


def tp_refusal_of(model_type: str) -> str | None:
    """Why tensor parallelism cannot run on a model type (estimate, trace and measure refuse it alike), or None."""
    spec = family_of(model_type)
    return None if spec.tp_plan is not None else spec.tp_refusal.format(model_type=model_type)


def tp_style_refusal(model_type: str) -> dict[str, str]:
    """Why --sequence-parallel / --loss-parallel cannot run on a model type with a TP plan (by field name)."""
    plan = family_of(model_type).tp_plan
    if plan is None:
        return {}
    why = {}
    if not plan.sequence_parallel:
        why["sequence_parallel"] = (f"--sequence-parallel is not modelled for {model_type}: llmem's plan has no "
                                    "SequenceParallel norms for it (Llama, Mistral, Qwen2, Qwen3 only); drop it")
    if not plan.loss_parallel:
        why["loss_parallel"] = (f"--loss-parallel is not modelled for {model_type}: its logits are soft-capped "
                                "before the loss (not a plain cross-entropy on the lm_head's output); drop it")
    return why


def flash_refusal_of(model_type: str) -> str | None:
    """Why --attn flash is not modelled on a model type (estimate, trace and measure refuse it alike), or None."""
    return family_of(model_type).flash_refusal


def tp_plan_of(model_type: str) -> TensorParallelPlan:
    """The trace's tensor-parallel plan for a model type, or the reason it has none."""
    refusal = tp_refusal_of(model_type)
    if refusal is not None:
        raise LlmemError(refusal)
    return family_of(model_type).tp_plan


def decoder_layers(model) -> tuple[str, object] | None:
    """(name, module) of the ModuleList holding the decoder layers: the longest ModuleList (the first of equal
    length), or None when the model has none. A vision-language model's are its language model's (its vision
    encoder's block list can be longer: Qwen2.5-VL-7B's 32 blocks beside 28 decoder layers)."""
    import torch

    suffix = language_layers_suffix(getattr(getattr(model, "config", None), "model_type", ""))
    best, best_len = None, 0
    for name, module in model.named_modules():
        if suffix is not None and not name.endswith(suffix):
            continue
        if isinstance(module, torch.nn.ModuleList) and len(module) > best_len:
            best, best_len = (name, module), len(module)
    return best


# the config's spellings of each size llmem reads, in the order tried
HIDDEN_FIELDS = ("hidden_size", "n_embd", "d_model")
HEADS_FIELDS = ("num_attention_heads", "n_head", "num_heads")
KV_HEADS_FIELDS = ("num_key_value_heads", "num_kv_heads")
INTERMEDIATE_FIELDS = ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size")
LAYERS_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
VARIED_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
MAX_LAYERS = 2048          # every decoder layer is built (on the meta device): beyond this no real model, only minutes


def _value(cfg, name: str):
    """A config attribute. A per-layer one (heterogeneous configs: the gemma4 family, dots3) or a list of per-layer
    values (gemma3n's intermediate_size) reads as its largest value: the largest layer sizes the peak."""
    try:
        value = getattr(cfg, name, None)
    except RuntimeError:       # transformers' AmbiguousGlobalPerLayerAttributeError: read it layer by layer
        if not getattr(cfg, "is_heterogeneous", False):
            raise
        value = [getattr(layer, name, None) for layer in cfg.per_layer_config]
    if isinstance(value, (list, tuple)) and value and all(_is_int(v) for v in value):
        return max(value)
    return value


def _field(cfg, *names: str) -> tuple[str, object]:
    """(the config.json's spelling, its value) of the first of `names` the config sets; (names[0], None) when none.
    The spelling is the file's (GPT-2's n_embd, not the hidden_size transformers' attribute_map reads it as)."""
    spelling = getattr(cfg, "attribute_map", None) or {}
    for n in names:
        value = _value(cfg, n)
        if value is not None:
            return spelling.get(n, n), value
    return names[0], None


def _first(cfg, *names, default=...):
    name, value = _field(cfg, *names)
    if value is None and default is ...:
        raise LlmemError(f"config of {cfg.model_type!r} lacks {name}: llmem cannot read its dimensions")
    return default if value is None else value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def text_config(cfg):
    """The decoder's own config (multimodal configs hold it as their text config)."""
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def head_counts(cfg) -> tuple[int, int]:
    """(query heads, key/value heads) as the model's attention runs them. Falcon without the new decoder
    architecture ignores num_kv_heads: multi-query (one kv head) or multi-head."""
    text = text_config(cfg)
    heads = _first(text, *HEADS_FIELDS)
    if cfg.model_type == "falcon" and not getattr(text, "new_decoder_architecture", False):
        return heads, 1 if getattr(text, "multi_query", True) else heads
    kv_heads = _first(text, *KV_HEADS_FIELDS, default=None)
    if kv_heads is None:
        kv_heads = 1 if getattr(text, "multi_query", False) else heads
    return heads, kv_heads


def dimensions(cfg) -> dict[str, int]:
    """The sizes activations depend on, read from the config (the first of each field's spellings)."""
    text = text_config(cfg)
    hidden = _first(text, *HIDDEN_FIELDS)
    heads, kv_heads = head_counts(cfg)
    return {
        "hidden_size": hidden, "num_heads": heads, "num_kv_heads": kv_heads,
        "head_dim": _value(text, "head_dim") or hidden // heads,
        "intermediate_size": _first(text, *INTERMEDIATE_FIELDS, default=None) or 4 * hidden,
        "num_layers": _first(text, *LAYERS_FIELDS),
        "vocab_size": _value(text, "vocab_size"),
        "max_positions": _positions(text),
        "varied_layers": tuple(n for n in VARIED_FIELDS if _varies(text, n)),
    }


def _varies(cfg, name: str) -> bool:
    """Whether a size differs between decoder layers (a per-layer attribute, or a list of unequal values)."""
    try:
        value = getattr(cfg, name, None)
    except RuntimeError:       # AmbiguousGlobalPerLayerAttributeError
        return True
    return isinstance(value, (list, tuple)) and len(set(value)) > 1


def _positions(text) -> int | None:
    """The longest sequence the model's position table or rope scaling was made for (None: not stated)."""
    value = _value(text, "max_position_embeddings")
    return value if _is_int(value) and value > 0 else None


# ---------------------------------------------------------------------- degenerate configs, refused before a build
def _positive(where: str, cfg, names: tuple[str, ...], required: bool = True) -> tuple[str, int | None]:
    """(spelling, value) of the first of `names` the config sets, checked to be a positive integer (or absent, when
    not required)."""
    name, value = _field(cfg, *names)
    if value is None and required:
        raise LlmemError(f"config {where} lacks {name}: llmem cannot read its dimensions")
    if value is not None and (not _is_int(value) or value < 1):
        raise LlmemError(f"config {where}: {name} is {value!r}; it must be a positive integer")
    return name, value


def check_raw_sizes(raw: dict, where: str) -> None:
    """A config.json's sizes that are integers but not positive, refused before transformers divides by them (its
    ZeroDivisionError names no field)."""
    for name in (*LAYERS_FIELDS, "vocab_size", *HIDDEN_FIELDS, *INTERMEDIATE_FIELDS, *HEADS_FIELDS,
                 *KV_HEADS_FIELDS, "head_dim"):
        value = raw.get(name)
        if _is_int(value) and value < 1:
            raise LlmemError(f"config {where}: {name} is {value!r}; it must be a positive integer")


def check_dimensions(cfg, where: str) -> None:
    """Refuse what transformers lets through but no model is: no layers, no vocabulary, sizes that are not positive
    integers, more layers than a real model has, heads that do not split, a rope type transformers cannot build."""
    text = text_config(cfg)
    layers_name, layers = _positive(where, text, LAYERS_FIELDS)
    if layers > MAX_LAYERS:
        raise LlmemError(f"config {where}: {layers_name} is {layers}; llmem builds every layer and takes at most "
                         f"{MAX_LAYERS}")
    _positive(where, text, ("vocab_size",))
    for names in (INTERMEDIATE_FIELDS, KV_HEADS_FIELDS, ("head_dim",)):
        _positive(where, text, names, required=False)
    _check_heads(cfg, text, where)
    _check_rope(text, where)


def _check_heads(cfg, text, where: str) -> None:
    """Key/value heads divide the query heads; without a head_dim, the hidden size splits into whole heads."""
    hidden_name, hidden = _positive(where, text, HIDDEN_FIELDS)
    heads_name, _ = _positive(where, text, HEADS_FIELDS)
    kv_name, _ = _field(text, *KV_HEADS_FIELDS)
    heads, kv_heads = head_counts(cfg)
    if heads % kv_heads:
        raise LlmemError(f"config {where}: {kv_name} is {kv_heads}, which does not divide {heads_name} ({heads}): "
                         "each key/value head serves a whole group of query heads")
    if _value(text, "head_dim") is None and hidden % heads:
        raise LlmemError(f"config {where}: {hidden_name} {hidden} is not a multiple of {heads_name} {heads}: set "
                         "head_dim, or give sizes that split into whole heads")


def _check_rope(text, where: str) -> None:
    """The rope type(s) of rope_parameters (transformers' name for rope_scaling) must be ones it can build."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = _value(text, "rope_parameters")
    if not isinstance(params, dict):
        return
    groups = list(params.values()) if params and all(isinstance(v, dict) for v in params.values()) else [params]
    for group in groups:
        rope_type = group.get("rope_type", group.get("type", "default"))
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            raise LlmemError(f"config {where}: rope_scaling's rope_type {rope_type!r} is not one transformers builds "
                             f"(default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))})")
