"""torchtitan's model flavors as data (llmem/setup/sources/torchtitan_flavors.json, written by
tools/make_torchtitan_flavors.py from torchtitan 0.3's own source): each matched flavor has its catalog model's
dimensions (read here from the catalog's config.json), and a TOML naming a flavor reads that model."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from llmem.model.catalog import find_entry, load_config_dict
from llmem.setup.sources import setup_from_file
from llmem.setup.sources.torchtitan import FLAVOR_LAYERS, FLAVORS, flavors

ROOT = Path(__file__).resolve().parents[3]


def test_every_matched_flavor_has_its_catalog_models_dimensions():
    rows = flavors()
    assert {("llama3", "8b"), ("qwen3", "32b"), ("qwen3", "30b-a3b"), ("gpt_oss", "20b"),
            ("deepseek_v3", "671b")} <= set(rows)
    for key, row in rows.items():
        if row["hub_id"] is None:
            continue
        config = load_config_dict(find_entry(row["hub_id"]))
        for dim, value in row["dims"].items():
            if dim != "max_position_embeddings":
                assert config[dim] == value, (key, dim)


def test_llama3_8b_hidden_dim_is_torchtitans_own_formula():
    """compute_ffn_hidden_dim(4096, multiple_of=1024, ffn_dim_multiplier=1.3): int(8 * 4096 / 3) = 10922,
    int(1.3 * 10922) = 14198, rounded up to a multiple of 1024: 14336 (Llama-3.1-8B's intermediate_size)."""
    assert flavors()[("llama3", "8b")]["dims"]["intermediate_size"] == 14336


def test_the_export_keeps_its_families_and_the_pipeline_split_knows_every_layer_count():
    assert {key[0] for key in FLAVORS} == {"llama3", "llama2"}
    assert FLAVOR_LAYERS["Qwen/Qwen3-32B"] == 64 and FLAVOR_LAYERS["meta-llama/Llama-3.1-405B"] == 126


@pytest.mark.parametrize("name, flavor, hub_id", [("qwen3", "32B", "Qwen/Qwen3-32B"),
                                                   ("gpt_oss", "20b", "openai/gpt-oss-20b"),
                                                   ("llama3", "70B", "meta-llama/Llama-3.1-70B")])
def test_a_toml_reads_its_flavors_model(tmp_path, name, flavor, hub_id):
    path = tmp_path / "train.toml"
    path.write_text(f'[model]\nname = "{name}"\nflavor = "{flavor}"\n\n[training]\nlocal_batch_size = 1\n'
                    'seq_len = 2048\n\n[parallelism]\ndata_parallel_shard_degree = 8\n')
    assert setup_from_file(path).setup.model == hub_id


@pytest.mark.slow
def test_the_committed_table_is_a_fresh_read_of_torchtitan():
    """Downloads torchtitan's wheel (no dependencies) and reads its flavors again."""
    sys.path.insert(0, str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location("make_titan", ROOT / "tools" / "make_torchtitan_flavors.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.table() == json.loads((ROOT / "llmem/setup/sources/torchtitan_flavors.json").read_text())
