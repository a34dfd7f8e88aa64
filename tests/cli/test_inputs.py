"""Garbage a user can give as MODEL, in a config.json or as a size: one line on stderr and exit 2, never a
traceback. Every file of tests/data/malformed_configs/ runs through the CLI in-process; the
`ok_*` files are real-shaped configs of architectures that once crashed llmem and must be estimated.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")     # a garbage MODEL must not reach the network

import pytest

import llmem.model.config as config_module
from llmem.cli import main
from llmem.errors import LlmemError, first_line
from llmem.model.anatomy import load_anatomy
from llmem.model.catalog import tiny_config_dict
from llmem.model.config import resolve_config
from llmem.setup.training import MAX_BATCH_SIZE, MAX_SEQ_LEN, MAX_STEP_TOKENS, TrainingSetup
from llmem.units import MAX_BYTES, parse_bytes, parse_count

CORPUS = Path(__file__).parents[1] / "data" / "malformed_configs"

# each refused file -> what its one line must name (the field, or the cause when there is no field)
REFUSED = {
    "not_utf8.json": "not UTF-8",
    "not_json.json": "line 1",
    "empty.json": "Expecting value",
    "nested_thousands_deep.json": "nested thousands of levels deep",   # json's decoder would recurse out
    "top_level_list.json": "model_type",
    "top_level_null.json": "holds null, not a JSON object",
    "top_level_number.json": "holds 7, not a JSON object",
    "no_model_type.json": "model_type",
    "model_type_number.json": "model_type 7",
    "unknown_model_type.json": "model_type 'no-such-architecture'",
    "not_causal_lm.json": "not a causal language model",
    "hidden_size_string.json": "hidden_size",
    "hidden_size_null.json": "hidden_size",
    "hidden_size_zero.json": "hidden_size",
    "hidden_size_negative.json": "hidden_size",
    "heads_null.json": "num_attention_heads",
    "heads_zero.json": "num_attention_heads",
    "heads_negative.json": "num_attention_heads",
    "heads_float.json": "num_attention_heads",
    "hidden_not_divisible_by_heads.json": "hidden size (500)",
    "odd_head_dim_rope.json": "head_dim",
    "rope_scaling_string.json": "rope_parameters",
    "rope_scaling_unknown_type.json": "rope_type 'warp-drive'",
    "torch_dtype_garbage.json": "torch_dtype",
    "layers_zero.json": "num_hidden_layers",
    "layers_negative.json": "num_hidden_layers",
    "layers_string.json": "num_hidden_layers",
    "layers_huge.json": "num_hidden_layers",
    "vocab_zero.json": "vocab_size",
    "vocab_negative.json": "vocab_size",
    "vocab_bool.json": "vocab_size",
    "intermediate_size_zero.json": "intermediate_size",
    "kv_heads_more_than_heads.json": "num_key_value_heads",
    "kv_heads_not_dividing.json": "num_key_value_heads",
    "kv_heads_zero.json": "num_key_value_heads",
    "tie_word_embeddings_string.json": "tie_word_embeddings",
    "rms_norm_eps_string.json": "rms_norm_eps",
    "gpt2_n_embd_not_divisible_by_n_head.json": "n_embd 770 is not a multiple of n_head 12",
    "gpt2_n_layer_zero.json": "n_layer",
}
# transformers writes float("inf") as {"__float__": "Infinity"} (their time_step_limit's upper bound)
FLOAT_TAGGED = ("ok_mamba2.json", "ok_bamba.json", "ok_falcon_h1.json", "ok_granitemoehybrid.json",
                "ok_nemotron_h.json")
# per-layer attributes (heterogeneous configs) and gemma3n's list-valued intermediate_size
PER_LAYER = ("ok_gemma4_text.json", "ok_dots3_note_text.json", "ok_gemma3n_text.json")


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of one in-process command line; any exception escaping is a traceback."""
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_refusal(code: int, err: str, *names: str) -> str:
    assert code == 2, err
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    assert err.startswith("llmem: error: ") and "Traceback" not in err
    for name in names:
        assert name in err, f"{name!r} not named in {err!r}"
    return err


def test_the_corpus_is_complete():
    """Every file of the corpus has its expectation here, and the corpus covers at least 25 failure kinds."""
    on_disk = {p.name for p in CORPUS.iterdir()}
    assert on_disk == set(REFUSED) | set(FLOAT_TAGGED) | set(PER_LAYER)
    assert len(REFUSED) >= 25


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_malformed_config_is_one_line_naming_the_field(name, capsys):
    code, out, err = run_cli(["estimate", str(CORPUS / name), "--seq-len", "256"], capsys)
    assert_one_line_refusal(code, err, REFUSED[name])
    assert out == ""


def test_folder_whose_config_is_null(tmp_path, capsys):
    """A model folder whose config.json is `null` (transformers' loader raises TypeError on it)."""
    (tmp_path / "config.json").write_text("null\n")
    code, out, err = run_cli(["estimate", str(tmp_path)], capsys)
    assert_one_line_refusal(code, err, str(tmp_path / "config.json"), "not a JSON object")
    assert out == ""


@pytest.mark.parametrize("name", FLOAT_TAGGED + PER_LAYER)
def test_real_shaped_configs_are_estimated(name, capsys):
    code, out, err = run_cli(["estimate", str(CORPUS / name), "--seq-len", "256", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["setup"]["model_type"] == json.loads((CORPUS / name).read_text())["model_type"]
    assert result["setup"]["total_params"] == load_anatomy(str(CORPUS / name)).total_params > 10**9
    assert result["peak_allocated_bytes"] > 2 * result["setup"]["total_params"]    # at least its bf16 weights


@pytest.mark.parametrize("name", FLOAT_TAGGED)
def test_float_tags_decode_to_floats(name):
    """transformers' own loader reads {"__float__": "Infinity"}: the config holds inf, not a dict."""
    _, cfg = resolve_config(str(CORPUS / name))
    assert cfg.time_step_limit[1] == math.inf


def test_per_layer_sizes_read_as_the_largest_layer():
    """gemma4's head_dim is a per-layer attribute: the anatomy reads the largest layer's, and says the layers
    differ; the parameters are counted layer by layer from the built modules."""
    _, cfg = resolve_config(str(CORPUS / "ok_gemma4_text.json"))
    per_layer = [layer.head_dim for layer in cfg.per_layer_config]
    assert len(set(per_layer)) > 1
    anatomy = load_anatomy(str(CORPUS / "ok_gemma4_text.json"))
    assert anatomy.head_dim == max(per_layer)
    assert "head_dim" in anatomy.varied_layers and "head_dim" in anatomy.varied_layers_note
    assert sum(anatomy.layer_params(i) for i in range(anatomy.num_layers)) + anatomy.root_params \
        == anatomy.total_params


def test_per_layer_heads_of_dots3():
    _, cfg = resolve_config(str(CORPUS / "ok_dots3_note_text.json"))
    anatomy = load_anatomy(str(CORPUS / "ok_dots3_note_text.json"))
    assert anatomy.num_heads == max(layer.num_attention_heads for layer in cfg.per_layer_config)
    assert anatomy.varied_layers


def test_list_valued_intermediate_size_of_gemma3n():
    raw = json.loads((CORPUS / "ok_gemma3n_text.json").read_text())
    assert isinstance(raw["intermediate_size"], list)
    assert load_anatomy(str(CORPUS / "ok_gemma3n_text.json")).intermediate_size == max(raw["intermediate_size"])


# ---------------------------------------------------------------------- MODEL itself
def test_a_300_character_name(capsys):
    code, _, err = run_cli(["estimate", "a" * 300], capsys)
    assert_one_line_refusal(code, err, "not a hub id")
    assert len(err) < 400                              # the name is quoted cut short


def test_a_300_character_path(capsys):
    code, _, err = run_cli(["estimate", "/" + "a" * 300 + "/config.json"], capsys)
    assert_one_line_refusal(code, err, "File name too long")


def test_a_folder_without_config_json(tmp_path, capsys):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    code, _, err = run_cli(["estimate", str(tmp_path)], capsys)
    assert_one_line_refusal(code, err, "has no config.json")


def test_a_folder_with_a_non_utf8_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_bytes(b'{"model_type": "\xff"}')
    code, _, err = run_cli(["estimate", str(tmp_path)], capsys)
    assert_one_line_refusal(code, err, "not UTF-8", "byte 16")


def test_a_weights_file_given_as_config(tmp_path, capsys):
    big = tmp_path / "model.json"
    with big.open("wb") as f:                          # sparse: no 17 MiB written
        f.truncate(config_module.CONFIG_MAX_BYTES + 1)
    code, _, err = run_cli(["estimate", str(big)], capsys)
    assert_one_line_refusal(code, err, "not a config.json")


@pytest.mark.parametrize("model, says", [
    ("", "MODEL is empty"), ("   ", "MODEL is empty"), ("missing/config.json", "does not exist"),
    ("./nowhere", "does not exist"), ("/dev/null", "not a regular file"), ("caf\udce9", "not a hub id"),
    ("bad\x00name", "not a hub id"), ("a/b/c", "not a hub id"), ("tiny-../models", "not a hub id")])
def test_garbage_model_names(model, says, capsys):
    code, _, err = run_cli(["estimate", model], capsys)
    assert_one_line_refusal(code, err, says)


def test_tiny_names_cannot_leave_their_folder():
    assert tiny_config_dict("tiny-llama") is not None
    assert tiny_config_dict("tiny-../models") is None


# ---------------------------------------------------------------------- the hub, without network
def test_no_network_fails_fast_and_says_how_to_run_offline(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(config_module, "hub_reachable", lambda *a, **k: False)
    start = time.perf_counter()
    with pytest.raises(LlmemError) as info:
        resolve_config("someorg/no-such-model")
    assert time.perf_counter() - start < 5
    message = str(info.value)
    assert "cannot be reached" in message and "HF_HUB_OFFLINE=1" in message and "config.json" in message


def test_offline_mode_does_not_probe_the_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def probe(*args, **kwargs):
        raise AssertionError("probed the hub under HF_HUB_OFFLINE")

    monkeypatch.setattr(config_module, "hub_reachable", probe)
    with pytest.raises(LlmemError, match="HF_HUB_OFFLINE is set"):
        resolve_config("someorg/no-such-model")


def test_the_probe_tries_once_with_a_timeout(monkeypatch):
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    with socket.socket() as server:                     # a port that listens, then one that does not
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert config_module.hub_reachable(f"http://127.0.0.1:{port}", timeout_s=2.0)
    start = time.perf_counter()
    assert not config_module.hub_reachable(f"http://127.0.0.1:{port}", timeout_s=0.5)
    assert not config_module.hub_reachable("https://no-such-host.invalid", timeout_s=0.5)
    assert time.perf_counter() - start < 2


# ---------------------------------------------------------------------- degenerate, but not wrong: a note
def test_seq_len_beyond_max_position_embeddings_is_a_note(capsys):
    code, out, err = run_cli(["estimate", "gpt2", "--seq-len", "4096", "--json"], capsys)
    assert code == 0, err
    notes = json.loads(out)["notes"]
    assert any("max_position_embeddings (1024)" in n and "4096" in n for n in notes), notes
    code, out, _ = run_cli(["estimate", "gpt2", "--seq-len", "1024", "--json"], capsys)
    assert not any("max_position_embeddings" in n for n in json.loads(out)["notes"])


# ---------------------------------------------------------------------- sizes on the command line
def test_a_huge_batch_is_refused_at_set_up(capsys):
    code, _, err = run_cli(["estimate", "gpt2", "--batch-size", str(10**10)], capsys)
    assert_one_line_refusal(code, err, "--batch-size", f"{MAX_BATCH_SIZE:,}")
    code, _, err = run_cli(["estimate", "gpt2", "--seq-len", str(MAX_SEQ_LEN + 1)], capsys)
    assert_one_line_refusal(code, err, "--seq-len", f"{MAX_SEQ_LEN:,}")
    code, _, err = run_cli(["estimate", "gpt2", "--batch-size", str(MAX_BATCH_SIZE), "--seq-len", "2048"], capsys)
    assert_one_line_refusal(code, err, "tokens per micro-batch", f"{MAX_STEP_TOKENS:,}")


def test_the_largest_step_allowed_is_estimated(capsys):
    """At the bounds the allocator model still answers (sizes stay below 2**64): a number, not a KeyError."""
    code, out, err = run_cli(["estimate", "gpt2", "--batch-size", str(MAX_STEP_TOKENS // 1024), "--seq-len",
                              "1024", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["fits"] is False


def test_set_up_bounds_in_the_api():
    with pytest.raises(LlmemError, match="--batch-size"):
        TrainingSetup(model="gpt2", batch_size=10**10)
    with pytest.raises(LlmemError, match="--seq-len"):
        TrainingSetup(model="gpt2", seq_len=0)


@pytest.mark.parametrize("tokens", ["inf", "nan", "-inf", "1e400", "1e19", "0", "-5"])
def test_dataset_tokens_out_of_range(tokens, capsys):
    code, _, err = run_cli(["plan", "gpt2", f"--dataset-tokens={tokens}"], capsys)
    assert_one_line_refusal(code, err, "1e18")


def test_counts_and_sizes_parse_within_bounds():
    assert parse_count("1.5B") == 1_500_000_000 and parse_count(10**18) == 10**18
    for bad in ("inf", "nan", 10**19, 0):
        with pytest.raises(LlmemError):
            parse_count(bad)
    assert parse_bytes("80GiB") == 80 * 1024**3
    for bad in (math.inf, math.nan, MAX_BYTES * 2, "2000000TiB"):
        with pytest.raises(LlmemError):
            parse_bytes(bad)


# ---------------------------------------------------------------------- the quoting of others' errors
def test_first_line_joins_an_introduction_with_its_reason():
    exc = ValueError("Validation error for field 'hidden_size':\n    TypeError: expected int, got str")
    assert first_line(exc) == "Validation error for field 'hidden_size': TypeError: expected int, got str"
    assert first_line(ValueError("one\ntwo")) == "one"
    assert first_line(KeyError()) == "KeyError"
    assert len(first_line(ValueError("x" * 1000))) == 300


def test_a_peft_config_name_too_long_for_the_file_system(capsys):
    # found by tests/cli/test_cli_fuzz.py: OSError [Errno 36] escaped from read_peft_config
    code, _out, err = run_cli(["estimate", "tiny-llama", "--peft-config", "x" * 300], capsys)
    assert_one_line_refusal(code, err, "--peft-config")


def test_a_binary_file_as_peft_config(tmp_path, capsys):
    # found by tests/cli/test_cli_fuzz.py: UnicodeDecodeError escaped from read_peft_config
    binary = tmp_path / "out.pdf"
    binary.write_bytes(b"%PDF-1.4\n\xff\xfe\x00\x81binary")
    code, _out, err = run_cli(["estimate", "tiny-llama", "--peft-config", str(binary)], capsys)
    assert "UTF-8" in assert_one_line_refusal(code, err, "--peft-config")
