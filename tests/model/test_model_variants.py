"""Offline, a community mirror or a chat-tuned variant of a catalog model reads the catalog model's config (the same
architecture: the name says whose), while a hub that answers still gives the hub's own config."""

from __future__ import annotations

import pytest

import llmem.model.config as config_module
from llmem.errors import LlmemError
from llmem.model.catalog.variants import variant_entry
from llmem.model.config import resolve_config


@pytest.mark.parametrize("model, base", [
    ("NousResearch/Meta-Llama-3.1-8B", "meta-llama/Llama-3.1-8B"),       # a mirror: another org, the same name
    ("Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-1.5B"),
    ("google/gemma-2-2b-it", "google/gemma-2-2b"),
    ("mistralai/Mistral-7B-Instruct-v0.1", "mistralai/Mistral-7B-v0.1"),  # the variant word inside the name
    ("meta-llama/Llama-2-7b-chat-hf", "meta-llama/Llama-2-7b-hf"),
    ("meta-llama/Meta-Llama-3-8B-Instruct", "meta-llama/Meta-Llama-3-8B"),
    ("unsloth/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B"),
])
def test_variants_read_their_base_config_offline(monkeypatch, model, base):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert variant_entry(model).hub_id == base
    name, cfg = resolve_config(model)
    assert name == f"{model} (read as {base}: the same shapes)"
    _, base_cfg = resolve_config(base)
    assert cfg.to_dict() == base_cfg.to_dict()


def test_an_unknown_name_is_still_refused(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert variant_entry("nobody/unknown-7b") is None
    with pytest.raises(LlmemError, match="unknown model 'nobody/unknown-7b'"):
        resolve_config("nobody/unknown-7b")


def test_a_hub_that_answers_wins(monkeypatch):
    """The hub's config.json of the variant itself where it can be read (its own vocab or context, if any)."""
    from transformers import LlamaConfig

    own = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=1000)
    monkeypatch.setattr(config_module, "_hub_config", lambda model, trust_remote_code: own)
    name, cfg = resolve_config("NousResearch/Meta-Llama-3.1-8B")
    assert name == "NousResearch/Meta-Llama-3.1-8B" and cfg.vocab_size == 1000
