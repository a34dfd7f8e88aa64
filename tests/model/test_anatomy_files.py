"""Anatomies read from files instead of built: the catalog's shipped files equal a fresh build from transformers'
classes, the text gives back every value and type, other models are built once and kept in the cache folder, and a
process that finds its anatomy on disk answers without importing torch or transformers, with the same JSON as a
process that builds the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from llmem import TrainingSetup, estimate
from llmem.cache import CACHE_ENV
from llmem.model.anatomy import (
    ModelAnatomy,
    ParamInfo,
    PeftInfo,
    anatomy_from_text,
    anatomy_text,
    load_anatomy,
    read_anatomy,
    read_or_build,
)
from llmem.model.anatomy_cache import ANATOMY_CACHE_ENV, SHIPPED_FOLDER, anatomy_key, cached_text
from llmem.model.catalog.build_anatomies import differs, shipped_names
from llmem.model.config import config_source
from llmem.model.peft import peft_anatomy

REPO = Path(__file__).resolve().parents[2]
PEFT_IA3 = str(REPO / "llmem/model/catalog/peft/ia3-k-v-down")


@pytest.mark.parametrize("model", ["gpt2", "meta-llama/Llama-3.1-8B", "tiny-llama", "tiny-qwen3-moe"])
def test_shipped_anatomy_equals_a_fresh_build(model):
    assert differs(model) is None


@pytest.mark.slow
def test_every_shipped_anatomy_equals_a_fresh_build():
    problems = [p for p in map(differs, shipped_names()) if p]
    assert not problems, problems


def test_a_file_is_shipped_for_every_bundled_model():
    folder = REPO / "llmem/model/catalog" / SHIPPED_FOLDER
    assert len(shipped_names()) == len(list(folder.glob("*.json")))
    for model in shipped_names():
        assert (folder / config_source(model)[2]).is_file(), model


def _anatomy(config: dict, peft: PeftInfo | None = None, name: str = "m") -> ModelAnatomy:
    params = (ParamInfo("embed.weight", (10, 4), "float32", "Embedding", None, "lm_head.weight"),
              ParamInfo("layers.0.w", (4, 4), "bfloat16", "Linear", 0, None, False))
    return ModelAnatomy(name, "llama", "LlamaForCausalLM", "llama", 4, 1, 2, 1, 2, 8, 10, True, params,
                        tied_names=("lm_head.weight",), config=config, peft=peft, varied_layers=("heads",))


def test_text_gives_back_every_value_and_type():
    config = {"id2label": {0: "LABEL_0", 1: "LABEL_1"}, "pair": (1, 2), "rope": {"factor": 8.0, "low": 1},
              "layer_types": ["full", "sliding"], "none": None, "flag": True, "__tuple__": 3}
    a = _anatomy(config, PeftInfo("LORA", lora_dropout=0.1, notes=("a note",)))
    back = anatomy_from_text(anatomy_text(a, {}))
    assert back == a and back.peft == a.peft and back.config == config
    assert list(back.config["id2label"]) == [0, 1]           # int keys stay ints (JSON would make them strings)
    assert back.config["pair"] == (1, 2) and isinstance(back.config["pair"], tuple)
    assert isinstance(back.config["rope"]["factor"], float) and isinstance(back.config["rope"]["low"], int)
    assert back.params[0].shape == (10, 4) and back.params[1].trainable is False


def test_a_value_json_cannot_hold_is_never_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    model = str(_small_llama(tmp_path / "m"))
    key = anatomy_key(config_source(model), scalar_head=False)
    for odd in ({"odd": {1, 2}}, {"odd": 1 + 2j}):
        odd_anatomy = _anatomy(odd, name=model)
        assert read_or_build(model, False, lambda a=odd_anatomy: a, scalar_head=False) is odd_anatomy
        assert cached_text(key) is None                     # the build stands; nothing is written
    plain = _anatomy({"x": 1}, name=model)
    read_or_build(model, False, lambda: plain, scalar_head=False)
    assert read_anatomy(cached_text(key)) == plain
    assert read_or_build(model, False, lambda: None, scalar_head=False) == plain     # read, not built


def _small_llama(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}))
    return folder


def test_a_folder_model_is_built_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    model = str(_small_llama(tmp_path / "m"))
    load_anatomy.cache_clear()
    built = load_anatomy(model)
    key = anatomy_key(config_source(model), scalar_head=False)
    assert read_anatomy(cached_text(key)) == built
    assert read_anatomy(cached_text(key)).config == built.config
    # another config in the same folder is another key: the old file is not read for it
    (Path(model) / "config.json").write_text((Path(model) / "config.json").read_text().replace('"num_hidden_layers": 2',
                                                                                             '"num_hidden_layers": 3'))
    load_anatomy.cache_clear()
    assert load_anatomy(model).num_layers == 3


def test_a_corrupt_cache_file_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    model = str(_small_llama(tmp_path / "m"))
    load_anatomy.cache_clear()
    built = load_anatomy(model)
    path = tmp_path / "cache" / SHIPPED_FOLDER / f"{anatomy_key(config_source(model), scalar_head=False)}.json"
    for garbage in (b"", b"\xff\xfe not json", b'{"format": 1}', b"[1, 2]"):
        path.write_bytes(garbage)
        load_anatomy.cache_clear()
        assert load_anatomy(model) == built
        assert read_anatomy(cached_text(path.stem)) == built          # written again


def _cli(args: list[str], cache: Path, **env: str) -> tuple[int, dict | None, str, list[str]]:
    """`llmem ARGS` in a fresh process: exit code, its JSON, stderr, and which of torch / transformers it imported."""
    code = ("import sys, runpy; sys.argv = ['llmem'] + sys.argv[1:]\n"
            "try:\n    runpy.run_module('llmem.cli', run_name='__main__')\n"
            "except SystemExit as e:\n    rc = e.code\n"
            "print('IMPORTED', [m for m in ('torch', 'transformers') if m in sys.modules], file=sys.stderr)\n"
            "sys.exit(rc)")
    run_env = {**os.environ, CACHE_ENV: str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), **env}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=run_env,
                          timeout=300)
    imported = json.loads(done.stderr.rsplit("IMPORTED ", 1)[1].replace("'", '"'))
    return done.returncode, json.loads(done.stdout) if done.stdout.strip() else None, done.stderr, imported


def _fresh(setup: TrainingSetup, monkeypatch) -> dict:
    """The estimate's JSON with every anatomy built from transformers' classes."""
    monkeypatch.setenv(ANATOMY_CACHE_ENV, "off")
    load_anatomy.cache_clear()
    peft_anatomy.cache_clear()
    try:
        return json.loads(json.dumps(estimate(setup).to_dict()))
    finally:
        load_anatomy.cache_clear()
        peft_anatomy.cache_clear()
        monkeypatch.delenv(ANATOMY_CACHE_ENV)


@pytest.mark.parametrize("args, setup", [
    (["gpt2"], TrainingSetup("gpt2")),
    (["meta-llama/Llama-3.1-8B", "--gpus", "8", "--method", "fsdp"],
     TrainingSetup("meta-llama/Llama-3.1-8B", gpus=8, method="fsdp")),
    (["meta-llama/Llama-3.1-8B", "--lora-rank", "16", "--gpus", "2", "--method", "ddp"],
     TrainingSetup("meta-llama/Llama-3.1-8B", lora_rank=16, gpus=2, method="ddp")),
])
def test_a_catalog_estimate_imports_no_torch_and_equals_a_fresh_build(args, setup, tmp_path, monkeypatch):
    rc, out, err, imported = _cli(["estimate", *args, "--json"], tmp_path / "cold")
    assert rc == 0, err
    assert imported == []
    assert out == _fresh(setup, monkeypatch)


def test_peft_and_folder_models_once_cached_import_no_torch(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    model = str(_small_llama(tmp_path / "m"))
    cases = [(["estimate", "tiny-llama", "--peft-config", PEFT_IA3, "--json"],
              TrainingSetup("tiny-llama", peft_config=PEFT_IA3)),
             (["estimate", model, "--json"], TrainingSetup(model)),
             (["estimate", model, "--objective", "reward", "--seq-len", "512", "--json"],
              TrainingSetup(model, objective="reward", seq_len=512))]
    for args, setup in cases:
        expected = _fresh(setup, monkeypatch)
        estimate(setup)                                        # builds it and keeps it in the cache folder
        rc, out, err, imported = _cli(args, cache)
        assert rc == 0, err
        assert imported == [], args
        assert out == expected, args


def test_a_refusal_needs_no_model(tmp_path):
    model = str(_small_llama(tmp_path / "m"))                 # a folder never built: its anatomy is not on disk
    for flags, message in ((["--gpus", "0"], "--gpus must be >= 1, got 0"),
                           (["--gpu", "Z80"], "Z80"),
                           (["--gpus", "3", "--method", "tp", "--tp", "2"], "--tp 2")):
        rc, out, err, imported = _cli(["estimate", model, *flags], tmp_path / "cache")
        assert rc == 2 and message in err and err.startswith("llmem: error: "), err
        assert imported == [], flags
