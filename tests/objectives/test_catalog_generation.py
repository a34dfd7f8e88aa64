"""The generation objectives (GRPO, RLOO) on every catalog model: an estimate or a one-line refusal, never a
traceback, whatever the family calls its head count (GPT-2's n_head, BLOOM's n_head, GPTBigCode's multi_query) or its
output layer (BioGPT's output_projection)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from llmem import TrainingSetup
from llmem.cli import main
from llmem.estimator.generation import attention_dims, generation_kv_bytes
from llmem.estimator.objectives import lm_head_param
from llmem.model.catalog import catalog
from llmem.model.resolved import resolve

SMALL = ["--seq-len", "96", "--max-completion-length", "32", "--num-generations", "2", "--batch-size", "2"]


@pytest.mark.parametrize("objective", ["grpo", "rloo"])
@pytest.mark.parametrize("model", list(catalog()))    # every model: ~25 s in all
def test_generation_objective_answers_or_refuses_in_one_line(model, objective, capsys):
    code = main(["estimate", model, "--objective", objective, *SMALL, "--json"])
    captured = capsys.readouterr()
    if code == 0:
        result = json.loads(captured.out)
        assert result["peak_allocated_bytes"] > 0
    else:
        assert code == 2, captured.err
        assert captured.err.startswith("llmem: error: ") and captured.err.count("\n") == 1, captured.err


def _grpo(model: str) -> TrainingSetup:
    return TrainingSetup(model, objective="grpo", batch_size=4, seq_len=32, num_generations=4,
                         max_completion_length=8)


@pytest.mark.parametrize(("model", "kv_heads", "head_dim", "layers"), [
    ("gpt2", 12, 64, 12),                                  # n_head 12, n_embd 768, n_layer 12: multi-head
    ("bigscience/bloom-560m", 16, 64, 24),                 # n_head 16, hidden_size 1024, n_layer 24
    ("bigcode/gpt_bigcode-santacoder", 1, 128, 24),        # multi_query: one K/V head; n_embd 2048 / n_head 16
])
def test_kv_cache_of_families_naming_heads_otherwise(model, kv_heads, head_dim, layers):
    """The DynamicCache by hand from each config.json's own fields: 2 x layers x B 4 x kv_heads x head_dim x
    31 tokens (24 prompt + 8 completion - 1) x 2 B (bf16)."""
    r = resolve(_grpo(model))
    assert attention_dims(r.anatomy) == (kv_heads, head_dim)
    assert generation_kv_bytes(r) == 2 * layers * 4 * kv_heads * head_dim * 31 * 2


@pytest.mark.parametrize(("model", "vocab", "hidden"), [
    ("microsoft/biogpt", 42384, 1024),
    ("microsoft/BioGPT-Large", 57717, 1600),
])
def test_biogpt_head_is_its_output_projection(model, vocab, hidden):
    """BioGPT's output layer is output_projection, tied to biogpt.embed_tokens (its config's vocab_size and
    hidden_size): the fused head reads that [vocab, hidden] matrix."""
    p = lm_head_param(resolve(_grpo(model)))
    assert p.name == "biogpt.embed_tokens.weight" and p.tied_to == "output_projection.weight"
    assert p.shape == (vocab, hidden)


def test_plan_of_grpo_on_gpt2(capsys):
    """`llmem plan gpt2 --objective grpo` lays out GPT-2 (n_head) under GRPO: a recommendation, not a KeyError."""
    code = main(["plan", "gpt2", "--objective", "grpo", "--gpu", "A100-80GB", *SMALL, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["setup"]["model"] == "gpt2"
