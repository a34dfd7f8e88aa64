"""Activation recipes: one per family of decoder layer, registered by name (llmem.model.families names the recipe
of each model type). Each describes one decoder layer as blocks in forward order, plus what the embedding block,
the final norm and lm_head input, and the tensors shared by all layers keep."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from llmem.memory.activations.blocks import (
    Block,
    Dims,
    LayerRecipe,
    Sizes,
    config_value,
    dropout_saved,
    eager_attention_saved,
    events_peak_bytes,
    gathered_input,
    linear_inputs_saved,
    norm_block,
    norm_saved,
    packed_bias_saved,
    proj_block,
    rmsnorm_backward,
    sdpa_saved,
    sp_norm_transient,
)
from llmem.model.anatomy import ModelAnatomy
from llmem.model.families import family_of
from llmem.setup.attention import AttentionSpec
from llmem.setup.precision import F32, Regime


def _llama_like(a: ModelAnatomy, d: Dims, r: Regime, attn: AttentionSpec) -> LayerRecipe:
    """Llama, Mistral, Qwen2, Phi-3, Mixtral, Gemma-2: RMSNorm, RoPE, SwiGLU / GeGLU gated MLP, no dropout."""
    t = d.t
    spec = family_of(a.model_type)
    norm = spec.norm
    fused = spec.fused_projections
    n1, out1 = sp_norm_block("input_norm", norm, r, d, ("input_layernorm",))
    qkv = sp_proj_block("qkv_proj", r, d, 1 if fused else 3, out1, ("q_proj", "k_proj", "v_proj", "qkv_proj"),
                        ("qkv_proj",) if fused else ("q_proj", "k_proj", "v_proj"))
    # RoPE makes new q, k (fp32 under autocast: cos/sin follow the fp32 stream); SDPA/eager keep casts of them
    core: Sizes = (t * (d.qd + d.kvd) * r.mm,) if fused else ()   # phi3: v is a view of the fused qkv, kept
    if not attn.keeps_scores:
        kv = d.qd if d.masked else d.kvd    # a mask turns GQA off: repeat_kv's copies are what SDPA keeps
        core += sdpa_saved(r, d, (t * d.qd * r.mm,), (t * kv * r.mm,), (t * kv * r.mm,))
        core_transient = t * (d.qd + 2 * d.kvd) * r.mm
    else:
        p_attn = float(config_value(a, "attention_dropout"))
        core += eager_attention_saved(r, d, p_attn, repeat_kv=d.kvd != d.qd, softmax_fp32=True)
        if config_value(a, "attn_logit_softcapping", default=None):   # tanh(scores / cap) keeps its output
            core += (d.b * d.heads * d.s * d.s * r.mm,)
        core_transient = 2 * d.b * d.heads * d.s * d.s * F32
    # SDPA keeps v_proj's output as is (not behind a mask with GQA: then it keeps repeat_kv's copy)
    v_out = (("v_proj", 2),) if not attn.keeps_scores and not fused and not (d.masked and d.kvd != d.qd) else ()
    blocks = [n1, qkv, Block("attention", core, (), core_transient, outputs=v_out),
              Block("o_proj", (), ("o_proj",), t * d.qd * r.mm)]
    if spec.post_norms:  # post-attention and post-feedforward norms (Gemma-2)
        post, _ = norm_block("post_norms", norm, r, t, d.h, ("post_attention_layernorm", "post_feedforward"))
        blocks.append(Block(post.name, post.tensors * 2, post.params, post.transient))
    n2, out2 = sp_norm_block("mlp_norm", norm, r, d, ("post_attention_layernorm", "pre_feedforward_layernorm"))
    if spec.post_norms:
        n2 = Block(n2.name, n2.tensors, ("pre_feedforward_layernorm",), n2.transient)
    blocks.append(n2)
    blocks.append(sp_proj_block("gate_up_proj", r, d, 1 if fused else 2, out2,
                                ("gate_proj", "up_proj", "gate_up_proj", "w1", "w3", "gate.weight"),
                                ("gate_up_proj",) if fused else ("gate_proj", "up_proj")))
    experts = int(config_value(a, "num_experts_per_tok", default=1)) if spec.experts else 1
    mlp: Sizes = (t * d.i * r.mm * experts,) * 4       # gate, act(gate), up, act * up
    if spec.experts:                                    # router logits and softmax
        mlp += (t * int(config_value(a, "num_local_experts", default=8)) * F32,) * 2
    # gate (silu's input), act and up (the product's inputs), act * up (down_proj's input, for its weight only)
    gate_up_out = (("gate_proj", 0), ("up_proj", 2)) if not fused and experts == 1 else ()
    blocks.append(Block("mlp_act", mlp, (), 3 * t * d.i * r.mm * experts, ((3, ("down_proj",), False),),
                        outputs=gate_up_out))
    blocks.append(Block("down_proj", (), ("down_proj", "w2", "experts"), t * d.i * r.mm))
    head_kept, head_out = norm_saved(norm, r, d.ts, d.h)   # the final norm SequenceParallel under SP
    # the lm_head keeps its input: under SP the all-gathered [t, h] (ColwiseParallel(input_layouts=Shard(1)))
    head = head_kept + linear_inputs_saved(r, t, d.h, 1, gathered_input(d, head_out)[0] if d.sp else head_out)
    head_tags = ((len(head_kept) - 1, ("norm",), False), (len(head) - 1, ("lm_head",), r.autocast))
    # the embedding output is layer 0's input, counted there (fp32) or copied to fp32 there (lowp)
    return LayerRecipe(tuple(blocks), (), head, (d.pos_rows * d.s * a.head_dim * r.res,) * 2, head_tags,
                       rmsnorm_backward(r, d.ts, d.h) if norm == "rmsnorm" else ())


def sp_norm_block(name: str, kind: str, r: Regime, d: Dims, params: tuple[str, ...]) -> tuple[Block, int]:
    """A norm on the residual stream: under --sequence-parallel SequenceParallel (its tensors on the sequence
    shard, its backward's reduce-scatter of the incoming gradient); else on every token."""
    block, out = norm_block(name, kind, r, d.ts, d.h, params)
    extra = sp_norm_transient(r, d)
    if block.back_events and extra:    # the gradient and its rearranged copy live through the norm's backward
        half = extra // 2
        back = ((1, -2, half), (1, -3, extra - half), *block.back_events, (-1, -2, half), (-1, -3, extra - half))
        return replace(block, transient=events_peak_bytes(back), back_events=back), out
    return replace(block, transient=block.transient + extra), out


def sp_proj_block(name: str, r: Regime, d: Dims, consumers: int, norm_out_bytes: int, params: tuple[str, ...],
                  readers: tuple[str, ...]) -> Block:
    """The linears a norm feeds: under --sequence-parallel they read (and keep, or keep autocast's casts of) the
    all-gathered norm output, whose gather buffers are forward temporaries (and the gathered tensor itself, when
    the linears keep casts of it)."""
    if not d.sp:
        return proj_block(name, r, d.t, d.h, consumers, norm_out_bytes, params, readers)
    gathered, temps = gathered_input(d, norm_out_bytes)
    block = proj_block(name, r, d.t, d.h, consumers, gathered, params, readers)
    if block.tensors[0] != gathered:        # autocast's casts kept: the gathered fp32 input lives through the block
        temps += ((gathered, 0, len(block.tensors)),)
    return replace(block, temps=temps)


def _gpt2(a: ModelAnatomy, d: Dims, r: Regime, attn: AttentionSpec) -> LayerRecipe:
    """GPT-2, GPT-BigCode, GPT-Neo: LayerNorm, fused c_attn (GPT-Neo: q/k/v), dropouts, gelu_new MLP."""
    t = d.t
    p_resid = float(config_value(a, "resid_pdrop", "resid_dropout"))
    p_attn = float(config_value(a, "attn_pdrop", "attention_dropout"))
    p_embd = float(config_value(a, "embd_pdrop", "embed_dropout"))
    separate_qkv = family_of(a.model_type).separate_qkv
    n1, out1 = norm_block("ln_1", "layernorm", r, t, d.h, ("ln_1",))
    proj = proj_block("c_attn", r, t, d.h, 3 if separate_qkv else 1, out1,
                       ("attn.c_attn", "q_attn", "attention.q_proj", "attention.k_proj", "attention.v_proj"))
    qkv = t * (d.qd + 2 * d.kvd) * r.mm           # q, k, v (views of one c_attn output, kept whole)
    if not attn.keeps_scores:
        core: Sizes = (qkv, t * d.qd * r.mm, F32 * d.b * d.heads * d.s) + packed_bias_saved(r, d)
    else:
        core = eager_attention_saved(r, d, p_attn, repeat_kv=False, softmax_fp32=separate_qkv)
    core += dropout_saved(p_resid, t * d.h)
    n2, out2 = norm_block("ln_2", "layernorm", r, t, d.h, ("ln_2",))
    blocks = (n1, proj, Block("attention", core, (), t * (d.qd + 2 * d.kvd) * r.mm),
              Block("attn_out", (), ("attn.c_proj", "attention.out_proj"), t * d.qd * r.mm),
              n2, proj_block("c_fc", r, t, d.h, 1, out2, ("mlp.c_fc",)),
              Block("mlp_act", _mlp_act_saved(a, r, t * d.i) + dropout_saved(p_resid, t * d.h), (),
                    2 * t * d.i * (F32 if r.autocast else r.mm), _mlp_out_tag(a, r, ("mlp.c_proj",))),
              Block("mlp_out", (), ("mlp.c_proj",), t * d.i * r.mm))
    head, head_tags = _layernorm_head(r, t, d.h)
    return LayerRecipe(blocks, dropout_saved(p_embd, t * d.h), head, (), head_tags)


def _opt(a: ModelAnatomy, d: Dims, r: Regime, attn: AttentionSpec) -> LayerRecipe:
    """OPT and BioGPT: LayerNorm (pre-LN), separate q/k/v, dropout on residual branches, ReLU/GELU MLP."""
    t = d.t
    p = float(config_value(a, "dropout", "hidden_dropout_prob"))
    p_attn = float(config_value(a, "attention_dropout", "attention_probs_dropout_prob"))
    n1, out1 = norm_block("attn_norm", "layernorm", r, t, d.h, ("self_attn_layer_norm",))
    if not attn.keeps_scores:
        core = sdpa_saved(r, d, (t * d.qd * r.mm,), (t * d.kvd * r.mm,), (t * d.kvd * r.mm,))
    else:
        core = eager_attention_saved(r, d, p_attn, repeat_kv=False, softmax_fp32=False)
    core += dropout_saved(p, t * d.h)
    n2, out2 = norm_block("mlp_norm", "layernorm", r, t, d.h, ("final_layer_norm",))
    blocks = (n1, proj_block("qkv_proj", r, t, d.h, 3, out1, ("q_proj", "k_proj", "v_proj")),
              Block("attention", core, (), 3 * t * d.qd * r.mm),
              Block("out_proj", (), ("out_proj",), t * d.qd * r.mm),
              n2, proj_block("fc1", r, t, d.h, 1, out2, ("fc1",)),
              Block("mlp_act", _mlp_act_saved(a, r, t * d.i) + dropout_saved(p, t * d.h), (), t * d.i * r.mm,
                    _mlp_out_tag(a, r, ("fc2",))),
              Block("fc2", (), ("fc2",), t * d.i * r.mm))
    head, head_tags = _layernorm_head(r, t, d.h)
    return LayerRecipe(blocks, dropout_saved(p, t * d.h), head, (), head_tags)


def _bloom(a: ModelAnatomy, d: Dims, r: Regime, attn: AttentionSpec) -> LayerRecipe:
    """BLOOM: LayerNorm, fused query_key_value, ALiBi baddbmm eager attention, custom GeLU autograd function."""
    t = d.t
    p = float(config_value(a, "hidden_dropout"))
    p_attn = float(config_value(a, "attention_dropout"))
    n1, out1 = norm_block("input_norm", "layernorm", r, t, d.h, ("input_layernorm",))
    core = eager_attention_saved(r, d, p_attn, repeat_kv=False, softmax_fp32=True)
    core += dropout_saved(p, t * d.h)
    n2, out2 = norm_block("mlp_norm", "layernorm", r, t, d.h, ("post_attention_layernorm",))
    blocks = (n1, proj_block("query_key_value", r, t, d.h, 1, out1, ("query_key_value",)),
              Block("attention", core, (), 2 * d.b * d.heads * d.s * d.s * F32),
              Block("dense", (), ("self_attention.dense",), t * d.qd * r.mm),
              n2, proj_block("dense_h_to_4h", r, t, d.h, 1, out2, ("dense_h_to_4h",)),
              # GeLUFunction keeps its input; dense_4h_to_h keeps the output
              Block("gelu", (t * d.i * r.mm,) * 2 + dropout_saved(p, t * d.h), (), 5 * t * d.i * r.mm,
                    ((1, ("dense_4h_to_h",), False),)),
              Block("dense_4h_to_h", (), ("dense_4h_to_h",), t * d.i * r.mm))
    embed_norm, _ = norm_saved("layernorm", r, t, d.h)  # word_embeddings_layernorm
    head, head_tags = _layernorm_head(r, t, d.h)
    return LayerRecipe(blocks, embed_norm, head, (d.b * d.heads * d.s * r.res,), head_tags)   # shared: alibi


def _layernorm_head(r: Regime, t: int, h: int) -> tuple[Sizes, tuple]:
    """Final LayerNorm (input, mean, rstd) and the lm_head's input, which only the lm_head weight needs."""
    head_kept, head_out = norm_saved("layernorm", r, t, h)
    head = head_kept + linear_inputs_saved(r, t, h, 1, head_out)
    return head, ((len(head) - 1, ("lm_head",), head[-1] != head_out),)


def _mlp_out_tag(a: ModelAnatomy, r: Regime, out_linear: tuple[str, ...]) -> tuple:
    """The MLP activation's output, kept by the output linear for its weight gradient only (relu keeps its own
    output for its backward, so nothing to drop there)."""
    act = str(config_value(a, "activation_function", "hidden_act", "activation", default="gelu_new"))
    if act == "relu":
        return ()
    index = 4 if act == "gelu_new" else 1
    return ((index, out_linear, act == "gelu_new" and r.autocast),)


def _mlp_act_saved(a: ModelAnatomy, r: Regime, n: int) -> Sizes:
    """Bytes kept by the MLP activation of n = tokens x intermediate elements (fc output to fc2 input).

    gelu_new (GPT-2, CodeGen, GPT-Neo): the python tanh formula keeps x (fp32 under autocast: pow upcasts),
    tanh's output, 1 + tanh, 0.5 * x and the product (cast for c_proj under autocast).
    gelu / gelu_pytorch_tanh (F.gelu): keeps its input; the output is kept by the next linear.
    relu: keeps its output, which is also the next linear's input.
    """
    act = str(config_value(a, "activation_function", "hidden_act", "activation", default="gelu_new"))
    if act == "gelu_new":
        if r.autocast:
            return (n * F32, n * F32, n * F32, n * r.mm, n * r.mm)
        return (n * r.mm,) * 5
    if act == "relu":
        return (n * r.mm,)
    return (n * r.mm,) * 2


def _parallel_block(a: ModelAnatomy, d: Dims, r: Regime, attn: AttentionSpec) -> LayerRecipe:
    """Falcon (7B: multi-query, parallel attention + MLP from one LayerNorm) and CodeGen (GPT-J style).

    One LayerNorm feeds both the fused qkv projection and the MLP. Falcon with one kv head cannot use the flash /
    memory-efficient kernels (head counts differ), so SDPA takes the math path and keeps the S x S softmax.
    CodeGen splits its fused qkv with a reshape that copies q, k and v; gelu_new as in GPT-2.
    """
    t = d.t
    falcon = family_of(a.model_type).parallel_attention
    n1, out1 = norm_block("input_norm", "layernorm", r, t, d.h, ("input_layernorm", "ln_1"))
    proj = proj_block("qkv_and_fc_in", r, t, d.h, 2, out1,
                       ("query_key_value", "qkv_proj", "dense_h_to_4h", "fc_in"))
    if falcon:
        core: Sizes = (t * (d.qd + 2 * d.kvd) * r.mm, t * d.qd * r.mm, t * d.kvd * r.mm)  # fused qkv, roped q, k
        core += (d.b * d.heads * d.s * d.s * r.mm, t * d.qd * r.mm, t * d.qd * r.mm)      # softmax, out, merged
        mlp: Sizes = (t * d.i * r.mm,) * 2                                                 # F.gelu in, fc2 in
    else:
        if not attn.keeps_scores:                                            # q, k (roped), v copies, out, lse
            core = (t * d.qd * r.mm,) * 4 + (F32 * d.b * d.heads * d.s,) + packed_bias_saved(r, d)
        else:
            core = (t * d.qd * r.mm,) + eager_attention_saved(r, d, 0.0, repeat_kv=False, softmax_fp32=True)
        mlp = _mlp_act_saved(a, r, t * d.i)
    blocks = (n1, proj, Block("attention", core, (), 3 * t * d.qd * r.mm),
              Block("attn_out", (), ("self_attention.dense", "out_proj"), t * d.qd * r.mm),
              Block("mlp_act", mlp, (), 3 * t * d.i * r.mm,
                    ((len(mlp) - 1, ("dense_4h_to_h", "fc_out"), r.autocast and not falcon),)),
              Block("mlp_out", (), ("dense_4h_to_h", "fc_out"), t * d.i * r.mm))
    head, head_tags = _layernorm_head(r, t, d.h)
    return LayerRecipe(blocks, (), head, (d.pos_rows * d.s * a.head_dim * r.res,) * 2, head_tags)


Recipe = Callable[[ModelAnatomy, Dims, Regime, AttentionSpec], LayerRecipe]
RECIPES: dict[str, Recipe] = {
    "llama_like": _llama_like, "gpt2": _gpt2, "opt": _opt, "bloom": _bloom, "parallel_block": _parallel_block,
}
FALLBACK_RECIPE = "llama_like"     # model types without a recipe of their own (a note says so)


def recipe_for(anatomy: ModelAnatomy) -> Recipe:
    return RECIPES[family_of(anatomy.model_type).recipe or FALLBACK_RECIPE]
