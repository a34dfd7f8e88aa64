"""The bundled catalog: every config builds offline to exactly its publisher's parameter count."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from llmem.model.anatomy import load_anatomy
from llmem.model.catalog import catalog, find_entry, load_config_dict

ENTRIES = list(catalog().values())
IDS = [e.hub_id for e in ENTRIES]


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_config_builds_to_published_count(entry):
    assert load_anatomy(entry.hub_id).total_params == entry.published_params


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_names_resolve(entry):
    assert find_entry(entry.hub_id) is entry
    assert find_entry(entry.hub_id.upper()) is entry
    assert find_entry(entry.hub_id.split("/")[-1]) is entry
    for alias in entry.aliases:
        assert find_entry(alias) is entry, alias


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_entry_fields(entry):
    raw = load_config_dict(entry)
    assert "model_type" in raw and raw.get("architectures"), entry.config_file
    assert entry.published_params > 0
    assert entry.source


def test_names_are_unambiguous():
    owner: dict[str, str] = {}
    for entry in ENTRIES:
        names = {entry.hub_id.lower(), entry.hub_id.split("/")[-1].lower(), *(a.lower() for a in entry.aliases)}
        for name in names:
            assert owner.setdefault(name, entry.hub_id) == entry.hub_id, f"{name!r} names two entries"


def test_every_config_file_listed_exactly_once():
    configs = resources.files("llmem.model.catalog").joinpath("configs")
    on_disk = sorted(p.name for p in configs.iterdir() if p.name.endswith(".json"))
    raw = json.loads(resources.files("llmem.model.catalog").joinpath("models.json").read_text())
    listed = [m["config"] for m in raw["models"]]
    assert sorted(listed) == on_disk
    assert len(set(listed)) == len(listed)
    ids = [m["id"] for m in raw["models"]]
    assert len(set(ids)) == len(ids)


def test_config_file_names_follow_hub_ids():
    for entry in ENTRIES:
        assert entry.config_file == entry.hub_id.replace("/", "--") + ".json"


# --- independent hand counts, from the config dimensions only -------------------------------------------------


def _opt_count(c: dict) -> int:
    """OPT (pre-LN, tied lm_head): token + learned positions (offset 2) + layers + final LN."""
    h, f, V, L = c["hidden_size"], c["ffn_dim"], c["vocab_size"], c["num_hidden_layers"]
    assert c["word_embed_proj_dim"] == h and c["do_layer_norm_before"]
    positions = (c["max_position_embeddings"] + 2) * h
    attn = 4 * (h * h + h)                       # q, k, v, out_proj with bias
    mlp = (h * f + f) + (f * h + h)              # fc1, fc2 with bias
    norms = 2 * 2 * h                            # self_attn_layer_norm, final_layer_norm (weight + bias)
    return V * h + positions + L * (attn + mlp + norms) + 2 * h


def _llama_count(c: dict) -> int:
    """Llama (RMSNorm, no biases, SwiGLU, GQA): 2Vh (untied) + L(2h^2 + 2h*kv*d + 3hi + 2h) + h."""
    h, i, V, L = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads", heads)
    d = h // heads
    attn = 2 * h * h + 2 * h * kv * d
    embeddings = V * h if c.get("tie_word_embeddings", True) else 2 * V * h
    return embeddings + L * (attn + 3 * h * i + 2 * h) + h


def _falcon_mq_count(c: dict) -> int:
    """Falcon-7B (multi-query, parallel attn, no biases, tied): Vh + L(2h + h(h+2d) + h^2 + 8h^2) + 2h."""
    h, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    d = h // c["num_attention_heads"]
    assert c["multi_query"] and c["parallel_attn"] and not c["bias"]
    return V * h + L * (2 * h + h * (h + 2 * d) + h * h + 8 * h * h) + 2 * h


@pytest.mark.parametrize(("hub_id", "formula"), [
    ("facebook/opt-125m", _opt_count),
    ("meta-llama/Llama-2-7b-hf", _llama_count),
    ("meta-llama/Llama-3.1-8B", _llama_count),
    ("meta-llama/Llama-3.2-1B", _llama_count),
    ("tiiuae/falcon-7b", _falcon_mq_count),
])
def test_hand_formula_matches(hub_id, formula):
    entry = find_entry(hub_id)
    assert entry is not None
    expected = formula(load_config_dict(entry))
    assert expected == entry.published_params
    assert load_anatomy(hub_id).total_params == expected


def test_hand_formula_known_values():
    """Spelled-out arithmetic for two models, so a wrong dimension in a config cannot hide behind the formula."""
    # OPT-125m: h=768, ffn=3072, V=50272, 2048+2 positions, 12 layers
    assert 50272 * 768 + 2050 * 768 + 12 * (4 * (768**2 + 768) + 2 * 768 * 3072 + 3072 + 768 + 4 * 768) + 2 * 768 \
        == 125_239_296
    # Llama-2-7B: V=32000, h=4096, i=11008, 32 layers
    assert 2 * 32000 * 4096 + 32 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 4096 == 6_738_415_616


# --- the MoE and new dense models (issue 11): the build against the publishers' stated totals -----------------------
# (total, active) in billions as each publisher states them; active per token with top-k of the routed experts. gpt-oss's
# model card counts its active parameters without the embedding (3.61B / 5.13B), the others with it.
PUBLISHED_BILLIONS = {
    "Qwen/Qwen3-30B-A3B": (30.5, 3.3, True),
    "Qwen/Qwen3-235B-A22B": (235.0, 22.0, True),
    "openai/gpt-oss-20b": (20.91, 3.61, False),
    "openai/gpt-oss-120b": (116.83, 5.13, False),
    "deepseek-ai/DeepSeek-V3": (671.0, 37.0, True),
    "Qwen/Qwen3-8B": (8.2, None, True),
    "Qwen/Qwen3-32B": (32.8, None, True),
    "google/gemma-3-27b-pt": (27.0, None, True),
    "meta-llama/Llama-3.3-70B-Instruct": (70.6, None, True),
}


def _routed(c: dict) -> tuple[int, int]:
    """(routed experts, experts per token) under each family's spelling."""
    experts = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts")
    return experts, c["num_experts_per_tok"]


@pytest.mark.parametrize("hub_id", list(PUBLISHED_BILLIONS))
def test_published_totals_and_active(hub_id):
    """Total within 0.5 % of the publisher's figure, active per token within 2 % (their one or two digits)."""
    total_b, active_b, with_embedding = PUBLISHED_BILLIONS[hub_id]
    anatomy = load_anatomy(hub_id)
    assert anatomy.total_params == pytest.approx(total_b * 1e9, rel=5e-3)
    if active_b is None:
        return
    c = load_config_dict(find_entry(hub_id))
    experts, top_k = _routed(c)
    routed = sum(p.numel for p in anatomy.params if ".experts." in p.name)
    active = anatomy.total_params - routed + routed * top_k // experts
    if not with_embedding:
        active -= anatomy.embedding_params
    assert active == pytest.approx(active_b * 1e9, rel=2e-2)


def _qwen3_moe_count(c: dict) -> int:
    """Qwen3-MoE: untied embeddings, GQA attention with head_dim and per-head q/k RMSNorm, every layer sparse: E
    experts of 3 h*m matrices (gate_up fused, down) and a router E*h, two norms per layer, a final norm."""
    h, m, V, L, E, d = (c[k] for k in ("hidden_size", "moe_intermediate_size", "vocab_size", "num_hidden_layers",
                                        "num_experts", "head_dim"))
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    attn = 2 * h * heads * d + 2 * h * kv * d + 2 * d
    return 2 * V * h + L * (attn + E * 3 * h * m + E * h + 2 * h) + h


def _gpt_oss_count(c: dict) -> int:
    """gpt-oss: attention with biases and a sink per head, E experts of gate_up [h, 2i] and down [i, h] with biases,
    a router with bias, two norms per layer, untied embeddings, a final norm."""
    h, i, V, L, E, d = (c[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers",
                                        "num_local_experts", "head_dim"))
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    attn = (h * heads * d + heads * d) + 2 * (h * kv * d + kv * d) + (heads * d * h + h) + heads
    experts = E * (h * 2 * i + 2 * i + i * h + h)
    return 2 * V * h + L * (attn + experts + E * h + E + 2 * h) + h


def _deepseek_v3_count(c: dict) -> int:
    """DeepSeek-V3 (MLA): q down/up projections with a norm, the joint kv down projection (+ the rope key) with a
    norm, kv up projection, o_proj; the first k layers dense, the rest 256 routed experts of 3 h*m, one shared expert
    of 3 h*m and an fp32 router E*h; the multi-token-prediction module is not part of the model transformers builds."""
    h, V, L, H = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], c["num_attention_heads"]
    qr, kvr, nope, rope, vd = (c[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                               "v_head_dim"))
    attn = h * qr + qr + qr * H * (nope + rope) + h * (kvr + rope) + kvr + kvr * H * (nope + vd) + H * vd * h
    dense = 3 * h * c["intermediate_size"]
    m, E = c["moe_intermediate_size"], c["n_routed_experts"]
    moe = E * 3 * h * m + c["n_shared_experts"] * 3 * h * m + E * h
    k = c["first_k_dense_replace"]
    return 2 * V * h + k * (attn + dense + 2 * h) + (L - k) * (attn + moe + 2 * h) + h


def _gemma3_text_count(c: dict) -> int:
    """Gemma-3's text model: tied embeddings, GQA with head_dim and q/k norms, GeGLU MLP, four norms per layer."""
    h, i, V, L, d = (c[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers", "head_dim"))
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    attn = 2 * h * heads * d + 2 * h * kv * d + 2 * d
    return V * h + L * (attn + 3 * h * i + 4 * h) + h


def _qwen3_count(c: dict) -> int:
    """Qwen3 dense: Llama's count with head_dim and the per-head q/k norms."""
    h, i, V, L, d = (c[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers", "head_dim"))
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    return 2 * V * h + L * (2 * h * heads * d + 2 * h * kv * d + 2 * d + 3 * h * i + 2 * h) + h


@pytest.mark.parametrize(("hub_id", "formula"), [
    ("Qwen/Qwen3-30B-A3B", _qwen3_moe_count),
    ("Qwen/Qwen3-235B-A22B", _qwen3_moe_count),
    ("openai/gpt-oss-20b", _gpt_oss_count),
    ("openai/gpt-oss-120b", _gpt_oss_count),
    ("deepseek-ai/DeepSeek-V3", _deepseek_v3_count),
    ("Qwen/Qwen3-8B", _qwen3_count),
    ("Qwen/Qwen3-32B", _qwen3_count),
    ("google/gemma-3-27b-pt", _gemma3_text_count),
    ("meta-llama/Llama-3.3-70B-Instruct", _llama_count),
])
def test_new_models_hand_formula(hub_id, formula):
    entry = find_entry(hub_id)
    expected = formula(load_config_dict(entry))
    assert expected == entry.published_params
    assert load_anatomy(hub_id).total_params == expected


def test_gemma3_is_its_text_model():
    """gemma-3-27b-pt is multimodal in transformers (Gemma3ForConditionalGeneration); llmem builds its text config
    as Gemma3ForCausalLM, the language model a text fine-tune trains."""
    anatomy = load_anatomy("google/gemma-3-27b-pt")
    assert anatomy.model_type == "gemma3_text" and anatomy.architecture == "Gemma3ForCausalLM"
    assert anatomy.num_layers == 62 and anatomy.tie_word_embeddings
