"""torchtune's model builders as data (llmem/setup/sources/torchtune_builders.json, written by
tools/make_torchtune_builders.py from torchtune's own source): each row's catalog model has the builder's
dimensions (read here from the catalog's config.json, independently of the tool), and a recipe naming a builder
reads that model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from llmem.model.catalog import find_entry, load_config_dict
from llmem.setup.sources import setup_from_file
from llmem.setup.sources.torchtune import builders

ROOT = Path(__file__).resolve().parents[3]
SHAPES = ("vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
          "intermediate_size")


def test_every_matched_builder_has_its_catalog_models_dimensions():
    rows = builders()
    assert {"llama3_1_8b", "qwen2_5_7b_instruct", "qwen2_5_32b_instruct", "phi3_mini", "gemma2_2b",
            "llama3_3_70b"} <= set(rows)
    for name, row in rows.items():
        if row["hub_id"] is None:
            continue
        config = load_config_dict(find_entry(row["hub_id"]))
        for dim in SHAPES:
            if dim in row["dims"]:
                assert config[dim] == row["dims"][dim], (name, dim)


def test_qwen2_5_7b_instruct_is_qwen2_5_7b():
    """torchtune's qwen2_5_7b_instruct: vocab 152064, 28 layers, 28 heads, 4 KV heads, embed 3584, MLP 18944."""
    row = builders()["qwen2_5_7b_instruct"]
    assert row["dims"]["hidden_size"] == 3584 and row["dims"]["intermediate_size"] == 18944
    assert row["hub_id"] == "Qwen/Qwen2.5-7B"


@pytest.mark.parametrize("component, hub_id, adapters", [
    ("torchtune.models.qwen2_5.lora_qwen2_5_32b_instruct", "Qwen/Qwen2.5-32B", True),
    ("torchtune.models.llama3_3.qlora_llama3_3_70b", "meta-llama/Llama-3.1-70B", True),
    ("torchtune.models.phi3.phi3_mini", "microsoft/Phi-3-mini-4k-instruct", False),
])
def test_a_recipe_reads_its_builders_model(tmp_path, component, hub_id, adapters):
    lora = "  lora_attn_modules: ['q_proj', 'v_proj']\n  lora_rank: 8\n  lora_alpha: 16\n" if adapters else ""
    path = tmp_path / "recipe.yaml"
    path.write_text(f"model:\n  _component_: {component}\n{lora}batch_size: 2\ndtype: bf16\n"
                    "tokenizer:\n  max_seq_len: 1024\n")
    setup = setup_from_file(path).setup
    assert setup.model == hub_id and (setup.lora_rank == 8) == adapters


def test_phi3s_split_projections_stand_on_transformers_fused_ones(tmp_path):
    """torchtune's phi3 keeps q / k / v and w1 / w3 apart where transformers' Phi-3 fuses them (qkv_proj,
    gate_up_proj): LoRA on the fused modules stands in, and the answer says it is approximate. Adapters by hand
    (hidden 3072, q / k / v 3072 wide each, MLP 8192, 32 layers, r8): qkv r x (3072 + 9216), o r x (3072 + 3072),
    gate_up r x (3072 + 16384), down r x (8192 + 3072)."""
    from llmem.model.resolved import resolve

    path = tmp_path / "mini_qlora.yaml"
    path.write_text("model:\n  _component_: torchtune.models.phi3.qlora_phi3_mini\n"
                    "  lora_attn_modules: ['q_proj', 'v_proj', 'k_proj', 'output_proj']\n  apply_lora_to_mlp: True\n"
                    "  lora_rank: 8\n  lora_alpha: 16\nbatch_size: 2\ndtype: bf16\ntokenizer:\n  max_seq_len: 1024\n")
    read = setup_from_file(path)
    assert read.setup.lora_targets == "qkv_proj,o_proj,gate_up_proj,down_proj"
    assert read.setup.quant_base == "torchao-nf4" and not read.record.exact
    assert any("qkv_proj, gate_up_proj stands in" in i.why for i in read.record.ignored)
    per_layer = 8 * ((3072 + 9216) + (3072 + 3072) + (3072 + 16384) + (8192 + 3072))
    assert resolve(read.setup).anatomy.trainable_params == 32 * per_layer


def test_an_unknown_builder_asks_for_the_model(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("model:\n  _component_: torchtune.models.qwen3.qwen3_8b_instruct\nbatch_size: 1\n")
    record = setup_from_file(path, model="Qwen/Qwen3-8B").record
    assert any(i.key == "model._component_" and "give MODEL" in i.why for i in record.ignored)


@pytest.mark.slow
def test_the_committed_table_is_a_fresh_read_of_torchtune():
    """Downloads torchtune's wheel (no dependencies) and reads its builders again."""
    spec = importlib.util.spec_from_file_location("make_tt", ROOT / "tools" / "make_torchtune_builders.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    import json

    assert module.table() == json.loads((ROOT / "llmem/setup/sources/torchtune_builders.json").read_text())
