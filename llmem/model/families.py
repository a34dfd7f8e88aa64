"""Model families: one row per transformers `model_type` llmem knows, the rule that finds a model's decoder layers,
and the rule that reads its head counts.

A row says which activation recipe describes its decoder layer (llmem.memory.activations.recipes.RECIPES, by
name; None: none written, Llama's is used with a note), the architectural details that recipe branches on, and
how the trace applies tensor parallelism to it (a Megatron-style plan of column- and row-parallel modules, or why
it cannot). Adding a family: docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmem.errors import LlmemError


@dataclass(frozen=True)
class TensorParallelPlan:
    """Megatron-style split per decoder layer: column-parallel and row-parallel module paths (within a layer)."""
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    local_heads: bool = False      # attention modules keep head counts as attributes: divide them by tp


_LLAMA_TP = TensorParallelPlan(
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    ("self_attn.o_proj", "mlp.down_proj"))
_OPT_TP = TensorParallelPlan(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1"),
                             ("self_attn.out_proj", "fc2"), local_heads=True)
_CONV1D_TP = ("tp is not supported in trace for {model_type}: its Conv1D c_attn/c_fc/c_proj layers cannot be split by "
              "torch's ColwiseParallel/RowwiseParallel (nn.Linear/nn.Embedding only)")
_NO_TP = ("tp is not supported in trace for model_type {model_type!r} (supported: Llama/Mistral/Qwen2 family and "
          "OPT)")


@dataclass(frozen=True)
class FamilySpec:
    family: str                          # ModelAnatomy.family: the family whose conventions the model follows
    recipe: str | None                   # activation recipe name; None: Llama's, with a note
    norm: str = "rmsnorm"                # rmsnorm (HF Llama), rmsnorm_gemma (fp32 weight multiply), layernorm
    fused_projections: bool = False      # one qkv_proj and one gate_up_proj linear (Phi-3)
    post_norms: bool = False             # post-attention and post-feedforward norms (Gemma-2)
    experts: bool = False                # a routed MoE MLP (Mixtral: top-k experts, router logits)
    separate_qkv: bool = False           # GPT-Neo: q/k/v linears where GPT-2 has one c_attn
    parallel_attention: bool = False     # Falcon: attention and MLP from one LayerNorm, multi-query kv
    tp_plan: TensorParallelPlan | None = None
    tp_refusal: str = _NO_TP             # why the trace cannot apply TP ({model_type}), when there is no plan


FAMILIES: dict[str, FamilySpec] = {
    "llama": FamilySpec("llama", "llama_like", tp_plan=_LLAMA_TP),
    "mistral": FamilySpec("llama", "llama_like", tp_plan=_LLAMA_TP),
    "qwen2": FamilySpec("llama", "llama_like", tp_plan=_LLAMA_TP),
    "qwen3": FamilySpec("llama", None, tp_plan=_LLAMA_TP),
    "gemma": FamilySpec("llama", None, tp_plan=_LLAMA_TP),
    "gemma2": FamilySpec("llama", "llama_like", norm="rmsnorm_gemma", post_norms=True, tp_plan=_LLAMA_TP),
    "phi3": FamilySpec("llama", "llama_like", fused_projections=True,
                       tp_refusal="tp is not supported in trace for phi3 (fused qkv_proj / gate_up_proj)"),
    "mixtral": FamilySpec("llama", "llama_like", experts=True,
                          tp_refusal="tp is not supported in trace for mixtral: its experts are fused 3-D parameters"),
    "gpt2": FamilySpec("gpt2", "gpt2", norm="layernorm", tp_refusal=_CONV1D_TP),
    "gpt_bigcode": FamilySpec("gpt2", "gpt2", norm="layernorm", tp_refusal=_CONV1D_TP),
    "gpt_neo": FamilySpec("gpt_neo", "gpt2", norm="layernorm", separate_qkv=True),
    "opt": FamilySpec("opt", "opt", norm="layernorm", tp_plan=_OPT_TP),
    "biogpt": FamilySpec("opt", "opt", norm="layernorm"),
    "bloom": FamilySpec("bloom", "bloom", norm="layernorm"),
    "falcon": FamilySpec("falcon", "parallel_block", norm="layernorm", parallel_attention=True),
    "codegen": FamilySpec("codegen", "parallel_block", norm="layernorm"),
}
UNKNOWN_FAMILY = FamilySpec("llama", None)   # model types without a row: Llama's conventions, with a note


def family_of(model_type: str) -> FamilySpec:
    return FAMILIES.get(model_type, UNKNOWN_FAMILY)


def tp_plan_of(model_type: str) -> TensorParallelPlan:
    """The trace's tensor-parallel plan for a model type, or the reason it has none."""
    spec = family_of(model_type)
    if spec.tp_plan is None:
        raise LlmemError(spec.tp_refusal.format(model_type=model_type))
    return spec.tp_plan


def decoder_layers(model) -> tuple[str, object] | None:
    """(name, module) of the ModuleList holding the decoder layers: the longest ModuleList (the first of equal
    length), or None when the model has none."""
    import torch

    best, best_len = None, 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > best_len:
            best, best_len = (name, module), len(module)
    return best


def _first(cfg, *names, default=...):
    for n in names:
        value = getattr(cfg, n, None)
        if value is not None:
            return value
    if default is ...:
        raise LlmemError(f"config of {cfg.model_type!r} lacks {names[0]}: llmem cannot read its dimensions")
    return default


def text_config(cfg):
    """The decoder's own config (multimodal configs hold it as their text config)."""
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def head_counts(cfg) -> tuple[int, int]:
    """(query heads, key/value heads) as the model's attention runs them. Falcon without the new decoder
    architecture ignores num_kv_heads: multi-query (one kv head) or multi-head."""
    text = text_config(cfg)
    heads = _first(text, "num_attention_heads", "n_head", "num_heads")
    if cfg.model_type == "falcon" and not getattr(text, "new_decoder_architecture", False):
        return heads, 1 if getattr(text, "multi_query", True) else heads
    kv_heads = _first(text, "num_key_value_heads", "num_kv_heads", default=None)
    if kv_heads is None:
        kv_heads = 1 if getattr(text, "multi_query", False) else heads
    return heads, kv_heads


def dimensions(cfg) -> dict[str, int]:
    """The sizes activations depend on, read from the config (the first of each field's spellings)."""
    text = text_config(cfg)
    hidden = _first(text, "hidden_size", "n_embd", "d_model")
    heads, kv_heads = head_counts(cfg)
    return {
        "hidden_size": hidden, "num_heads": heads, "num_kv_heads": kv_heads,
        "head_dim": getattr(text, "head_dim", None) or hidden // heads,
        "intermediate_size": _first(text, "intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size",
                                    default=None) or 4 * hidden,
        "num_layers": _first(text, "num_hidden_layers", "n_layer", "num_layers"),
        "vocab_size": text.vocab_size,
    }
