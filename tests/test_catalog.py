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
