"""`llmem serve`'s app through FastAPI's TestClient: its answers are the library's (the same set-up given to
`llmem.estimate` / `llmem.plan` as keywords), its command lines give the same answer through `llmem.cli.main`, its
refusals are one line (HTTP 400), the page is served whole with nothing fetched from elsewhere, and the form lists
every field the command line has."""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
from dataclasses import fields

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

import llmem  # noqa: E402
from llmem.cli import build_parser, main  # noqa: E402
from llmem.cli.options import setup_flags, setup_from_args  # noqa: E402
from llmem.cli.serve import bind, make_app  # noqa: E402
from llmem.errors import LlmemError  # noqa: E402
from llmem.setup.training import TrainingSetup, user_setup  # noqa: E402


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    return TestClient(make_app(tmp_path_factory.mktemp("uploads")))


def _plain(obj) -> dict:
    """As JSON carries it (tuples as lists)."""
    return json.loads(json.dumps(obj))


def _cli_json(command: str, capsys) -> dict:
    """The page's command line run by the command line itself, with --json."""
    argv = shlex.split(command)
    assert argv[0] == "llmem"
    capsys.readouterr()
    assert main(argv[1:] + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------------------------------------ answers


def test_estimate_is_the_librarys_and_its_command_line_gives_the_same(client, capsys):
    r = client.get("/api/estimate", params={"model": "gpt2", "gpus": "2", "method": "ddp", "batch_size": "2",
                                            "seq_len": "256", "lora_rank": "8", "lora_targets": "c_attn",
                                            "grad_ckpt": "1"})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = llmem.estimate("gpt2", gpus=2, method="ddp", batch_size=2, seq_len=256, lora_rank=8,
                              lora_targets="c_attn", grad_ckpt=True)
    assert body["result"] == _plain(expected.to_dict())           # every counter and component, byte for byte
    assert body["command"] == "llmem estimate gpt2 --method ddp --gpus 2 --batch-size 2 --seq-len 256 " \
                              "--grad-ckpt --lora-rank 8 --lora-targets c_attn"
    cli = _cli_json(body["command"], capsys)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes", "components", "fits"):
        assert cli[key] == body["result"][key]


def test_sweep_points_are_estimates_at_those_sizes(client):
    r = client.get("/api/sweep/batch_size", params={"model": "tiny-llama", "seq_len": "128", "points": "1,3,8"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["axis"] == "batch_size" and body["value"] == 1
    assert [p["value"] for p in body["points"]] == [1, 3, 8]
    for p in body["points"]:
        e = llmem.estimate("tiny-llama", seq_len=128, batch_size=p["value"])
        assert (p["peak_allocated_bytes"], p["peak_reserved_bytes"], p["device_used_bytes"], p["fits"]) == \
            (e.peak_allocated_bytes, e.peak_reserved_bytes, e.device_used_bytes, e.fits)


def test_sweep_default_points_include_the_querys_own_and_mark_what_cannot_run(client):
    body = client.get("/api/sweep/batch_size", params={"model": "tiny-llama", "seq_len": "128",
                                                       "batch_size": "3"}).json()
    values = [p["value"] for p in body["points"]]
    assert 3 in values and 1 in values and values == sorted(values)
    # a point past llmem's 2**28 tokens per micro-batch is refused alone, with the reason
    body = client.get("/api/sweep/batch_size", params={"model": "tiny-llama", "seq_len": str(2**24),
                                                       "points": "32"}).json()
    assert body["points"] == [{"value": 32, "error": "--batch-size x --seq-len is 536,870,912 tokens per "
                                                     "micro-batch; llmem takes at most 268,435,456 (2**28)"}]
    assert client.get("/api/sweep/heads", params={"model": "tiny-llama"}).status_code == 400
    assert client.get("/api/sweep/seq_len", params={"model": "tiny-llama", "points": "0"}).status_code == 400


def test_plan_is_the_librarys_over_every_method(client):
    r = client.get("/api/plan", params={"model": "tiny-llama", "seq_len": "128", "gpus": "2", "method": "ddp",
                                        "batch_size": "4"})
    assert r.status_code == 200, r.text
    body = r.json()
    # the page's plan compares every method: the query's method and micro-batch are left to the search
    expected = llmem.plan("tiny-llama", seq_len=128, gpus=2)
    assert body["plan"] == _plain(expected.to_dict())
    assert {m["method"] for m in body["plan"]["methods"]} == {"ddp", "fsdp", "zero2", "tp"}
    assert body["command"] == "llmem plan tiny-llama --gpus 2 --seq-len 128"


def test_an_uploaded_config_is_estimated_and_named_as_the_users_file(client, tmp_path):
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 512}
    encoded = base64.urlsafe_b64encode(json.dumps(config).encode()).decode().rstrip("=")
    r = client.get("/api/estimate", params={"model": "my-config.json", "config": encoded, "seq_len": "64"})
    assert r.status_code == 200, r.text
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    expected = llmem.estimate(str(path), seq_len=64)
    body = r.json()
    assert body["result"]["peak_reserved_bytes"] == expected.peak_reserved_bytes
    assert body["result"]["components"] == expected.components
    assert body["command"] == "llmem estimate my-config.json --seq-len 64"
    assert body["title"][0] == "my-config.json"


# ------------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("params, words", [
    ({"model": "tiny-llama", "batch_size": "abc"}, "argument --batch-size: invalid int value: 'abc'"),
    ({"model": "tiny-llama", "grad_ckpt": "maybe"}, "give 1 (on) or 0 (off)"),
    ({"model": "tiny-llama", "quant_base": "nf4"}, "--qlora quantises the frozen base"),
    ({"model": "tiny-llama", "double_quant": "0"}, "--no-double-quant applies to --qlora only"),
    ({"model": "tiny-llama", "precision": "fp8"}, "unknown precision 'fp8'"),
    ({"model": "tiny-llama", "batch_sise": "2"}, "unknown query field 'batch_sise'"),
    ({"gpus": "2"}, "no model"),
    ({"model": "--help"}, "unknown model '--help'"),          # a model, never a flag of the parser
    ({"model": "x.json", "config": "%%%"}, "not base64url"),
    ({"model": "x.json", "config": base64.urlsafe_b64encode(b"[1, 2]").decode()}, "not a JSON object"),
])
def test_a_refusal_is_http_400_with_one_line(client, params, words):
    r = client.get("/api/estimate", params=params)
    assert r.status_code == 400
    error = r.json()["error"]
    assert words in error and "\n" not in error and "Traceback" not in error


def test_an_unexpected_failure_is_one_line_too(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(llmem, "estimate", broken)
    r = TestClient(make_app(tmp_path), raise_server_exceptions=False).get("/api/estimate",
                                                                          params={"model": "tiny-llama"})
    assert r.status_code == 500
    assert r.json() == {"error": "internal error: RuntimeError: boom second line (the server's log has the "
                                 "traceback)"}


def test_serve_refuses_an_address_it_cannot_listen_on(capsys):
    taken = bind("127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        with pytest.raises(LlmemError, match="Address already in use"):
            bind("127.0.0.1", port)
    finally:
        taken.close()
    assert main(["serve", "--port", "70000"]) == 2
    assert main(["serve", "--host", "example.org"]) == 2           # no name lookup: an address or localhost
    err = capsys.readouterr().err
    assert "--port must lie in [0, 65535]" in err and "give an IP address" in err and err.count("\n") == 2


# ------------------------------------------------------------------------------------------------ the page and form


def test_the_page_is_served_whole_and_fetches_nothing_from_elsewhere(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    assert "<script>" in html and "/api/estimate?" in html and "/api/plan?" in html
    # offline: no script, style, font or image from another host
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|@import|url\(\s*["']?(https?:)?//""", html)


def test_the_form_has_every_field_the_command_line_has(client):
    form = client.get("/api/form").json()
    names = [f.name for f in fields(TrainingSetup) if "option" in f.metadata]
    assert [f["name"] for f in form["fields"]] == names
    by_name = {f["name"]: f for f in form["fields"]}
    assert by_name["batch_size"]["flag"] == "--batch-size" and by_name["batch_size"]["default"] == 1
    assert by_name["kbit_upcast"]["flag"] == "--no-kbit-upcast"
    assert [s[0] for s in by_name["quant_base"]["switches"]] == ["--qlora", "--load-in-8bit", "--qlora-torchao"]
    assert "fsdp" in by_name["method"]["choices"] and "A100-80GB" in by_name["gpu"]["choices"]
    assert "tiny-llama" in form["models"] and "meta-llama/Llama-3.1-8B" in form["models"]


@pytest.mark.parametrize("setup", [
    user_setup(model="tiny-llama"),
    user_setup(model="gpt2", gpus=4, batch_size=3, seq_len=512, precision="bf16", ckpt_every=2, grad_ckpt=True),
    user_setup(model="gpt2", gpus=4, method="single"),
    user_setup(model="tiny-llama", lora_rank=8, lora_targets="all-linear", lora_dropout=0.05, quant_base="nf4",
               double_quant=False, kbit_upcast=False, fused_ce=True, gpu="RTX4090", cuda_context="500MiB"),
    user_setup(model="tiny-llama", gpus=8, method="fsdp+tp", tp=2, gpus_per_node=4, offload_activations=True,
               attn="flash", precision="bf16-mixed", optimizer="adamw-fused", expandable_segments=True),
])
def test_setup_flags_read_back_as_the_same_setup(setup):
    """The flags writer is setup_from_args' inverse: its command line parses back to the set-up it was written
    from."""
    args = build_parser().parse_args(["estimate", *setup_flags(setup)])
    assert setup_from_args(args) == setup
