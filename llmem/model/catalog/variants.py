"""Names the catalog answers for a model it does not list by that name: a community mirror (another org's copy of
the same checkpoint, e.g. NousResearch/Meta-Llama-3.1-8B) and a chat-tuned variant (-Instruct, -it, -Chat, -Base:
the same architecture fine-tuned, e.g. Qwen/Qwen2.5-7B-Instruct, google/gemma-2-2b-it, mistralai/Mistral-7B-Instruct-
v0.1, meta-llama/Llama-2-7b-chat-hf). They are read with the catalog model's config (their shapes are the base
model's) where the hub cannot be asked, and the answer names the model whose config was used."""

from __future__ import annotations

from llmem.model.catalog import CatalogEntry, find_entry

# the dash-separated words a chat-tuned release adds to its base model's name (Qwen, Llama, Gemma, Mistral, Phi)
VARIANT_WORDS = frozenset({"instruct", "it", "chat", "base"})


def _without_variant_words(name: str) -> str:
    return "-".join(w for w in name.split("-") if w.lower() not in VARIANT_WORDS)


def variant_entry(model: str) -> CatalogEntry | None:
    """The catalog entry whose config `model` shares: the name without its org (a mirror), then without the words
    a chat-tuned variant adds; None when neither names a catalog model."""
    name = model.strip().split("/")[-1]
    for candidate in (name, _without_variant_words(name)):
        entry = find_entry(candidate) if candidate else None
        if entry is not None:
            return entry
    return None
