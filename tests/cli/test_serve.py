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
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402
from published_configs import CONFIGS, SKIP_REASON, present  # noqa: E402

import llmem  # noqa: E402
from llmem.cli import build_parser, main  # noqa: E402
from llmem.cli.options import setup_flags, setup_from_args  # noqa: E402
from llmem.cli.serve import ServeOptions, bind, make_app  # noqa: E402
from llmem.errors import LlmemError  # noqa: E402
from llmem.planner.options import PlanOptions  # noqa: E402
from llmem.setup.sources import setup_from_file  # noqa: E402
from llmem.setup.training import option_fields, user_setup  # noqa: E402

# the work in this process (tests patch the library; the worker processes: tests/cli/test_serve_security.py)
INLINE = ServeOptions(workers=0, allow_hosts=("testserver",))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    return TestClient(make_app(tmp_path_factory.mktemp("uploads"), INLINE))


def _plain(obj) -> dict:
    """As JSON carries it (tuples as lists)."""
    return json.loads(json.dumps(obj))


def _upload(path: Path, name: str | None = None, raw: bytes | None = None) -> str:
    """A `from` value as the page writes it: the file's name, ':', base64url of its bytes."""
    data = path.read_bytes() if raw is None else raw
    return f"{name or path.name}:" + base64.urlsafe_b64encode(data).decode().rstrip("=")


def _config(rel: str) -> Path:
    if not present():
        pytest.skip(SKIP_REASON)
    return CONFIGS / rel


def _cli_json(command: str, capsys) -> dict:
    """The page's command line run by the command line itself, with --json."""
    argv = shlex.split(command)
    assert argv[0] == "llmem"
    capsys.readouterr()
    assert main(argv[1:] + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------------------------------------ answers


def test_estimate_is_the_librarys_and_its_command_line_gives_the_same(client, capsys):
    r = client.post("/api/estimate", json={"model": "gpt2", "gpus": "2", "method": "ddp", "batch_size": "2",
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
    r = client.post("/api/sweep/batch_size", json={"model": "tiny-llama", "seq_len": "128", "points": "1,3,8"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["axis"] == "batch_size" and body["value"] == 1
    assert [p["value"] for p in body["points"]] == [1, 3, 8]
    for p in body["points"]:
        e = llmem.estimate("tiny-llama", seq_len=128, batch_size=p["value"])
        assert (p["peak_allocated_bytes"], p["peak_reserved_bytes"], p["device_used_bytes"], p["fits"]) == \
            (e.peak_allocated_bytes, e.peak_reserved_bytes, e.device_used_bytes, e.fits)


def test_sweep_default_points_include_the_querys_own_and_mark_what_cannot_run(client):
    body = client.post("/api/sweep/batch_size", json={"model": "tiny-llama", "seq_len": "128",
                                                       "batch_size": "3"}).json()
    values = [p["value"] for p in body["points"]]
    assert 3 in values and 1 in values and values == sorted(values)
    # a point past llmem's 2**28 tokens per micro-batch is refused alone, with the reason
    body = client.post("/api/sweep/batch_size", json={"model": "tiny-llama", "seq_len": str(2**24),
                                                       "points": "32"}).json()
    assert body["points"] == [{"value": 32, "error": "--batch-size x --seq-len is 536,870,912 tokens per "
                                                     "micro-batch; llmem takes at most 268,435,456 (2**28)"}]
    assert client.post("/api/sweep/heads", json={"model": "tiny-llama"}).status_code == 400
    assert client.post("/api/sweep/seq_len", json={"model": "tiny-llama", "points": "0"}).status_code == 400


def test_plan_is_the_librarys_over_every_method(client):
    r = client.post("/api/plan", json={"model": "tiny-llama", "seq_len": "128", "gpus": "2", "method": "ddp",
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
    r = client.post("/api/estimate", json={"model": "my-config.json", "config": encoded, "seq_len": "64"})
    assert r.status_code == 200, r.text
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    expected = llmem.estimate(str(path), seq_len=64)
    body = r.json()
    assert body["result"]["peak_reserved_bytes"] == expected.peak_reserved_bytes
    assert body["result"]["components"] == expected.components
    assert body["command"] == "llmem estimate my-config.json --seq-len 64"
    assert body["title"][0] == "my-config.json"


def test_a_training_config_is_read_as_setup_from_file_reads_it(client, capsys, monkeypatch):
    """A torchtune recipe (batch_size 4 in the file) with batch size 1 set on the page: a field given at its default
    still overrides the file, as a flag given does. The answer is llmem.estimate of setup_from_file's set-up; the
    command line shown, run beside the user's file, gives it too."""
    path = _config("torchtune/recipes/configs/llama3_2/3B_full_single_device.yaml")
    r = client.post("/api/estimate", json={"from": _upload(path), "batch_size": "1"})
    assert r.status_code == 200, r.text
    body = r.json()
    read = setup_from_file(path, batch_size=1)
    assert read.setup.model == "meta-llama/Llama-3.2-3B" and read.setup.batch_size == 1
    assert body["result"] == _plain(llmem.estimate(read.setup).to_dict())
    assert body["command"] == "llmem estimate --batch-size 1 --from 3B_full_single_device.yaml"
    record = _plain(read.record.to_dict())
    assert body["from_file"] == record | {"files": [{"path": path.name, "format": "torchtune"}]}
    assert body["from_file"]["overridden_by_command_line"] == ["batch_size"]
    assert {"key": "batch_size", "raw": 4, "field": "batch_size"}.items() <= next(
        u for u in body["from_file"]["used"] if u["key"] == "batch_size").items()
    monkeypatch.chdir(path.parent)
    assert _cli_json(body["command"], capsys)["peak_reserved_bytes"] == body["result"]["peak_reserved_bytes"]


@pytest.mark.parametrize("config, reference", [
    ("llamafactory/examples/train_full/llama3_full_sft.yaml",                                  # examples/deepspeed/
     "llamafactory/examples/deepspeed/ds_z3_config.json"),
    ("accelerate/examples/config_yaml_templates/deepspeed.yaml",                              # ../deepspeed_config_...
     "accelerate/examples/deepspeed_config_templates/zero_stage1_config.json"),
])
def test_a_config_and_the_deepspeed_json_it_names_upload_together(client, config, reference):
    """Uploaded side by side, the JSON is found where the config's relative path names it; the estimate, a sweep
    point and the plan are the library's over setup_from_file of the files in place (../shared keeps the upstream
    layout); the command line names the config alone (it finds the JSON itself)."""
    path, ds = _config(config), _config(reference)
    params = {"from": [_upload(path), _upload(ds)], "model": "tiny-llama", "gpus": "2", "seq_len": "256"}
    read = setup_from_file(path, model="tiny-llama", gpus=2, seq_len=256)
    assert read.record.states_method and read.setup.gpus == 2        # the JSON's ZeRO stage, as llmem models it
    body = client.post("/api/estimate", json=params).json()
    assert body["result"] == _plain(llmem.estimate(read.setup).to_dict()), body
    assert body["command"] == f"llmem estimate tiny-llama --gpus 2 --seq-len 256 --from {path.name}"
    assert [f["format"] for f in body["from_file"]["files"]] == [config.split("/")[0], "deepspeed"]
    # the JSON named by the path the config gives (its `read` entry), as the files in place read it
    ref = next(u.raw for u in read.record.used if u.note.startswith("read "))
    assert body["from_file"]["files"][1]["path"] == ref and Path(read.record.files[1][0]).name == Path(ref).name
    fields_set = [(u["file"], u["key"], u["field"], u["value"]) for u in _plain(read.record.to_dict())["used"]]
    assert [(u["file"], u["key"], u["field"], u["value"]) for u in body["from_file"]["used"]] == fields_set
    sweep = client.post("/api/sweep/batch_size", json=params | {"points": "3"}).json()
    assert sweep["points"][0]["peak_reserved_bytes"] == \
        llmem.estimate(replace(read.setup, batch_size=3)).peak_reserved_bytes
    plan = client.post("/api/plan", json=params).json()
    # the files name the method (a ZeRO stage): `llmem plan --from` plans that method only
    options = PlanOptions(methods=(read.setup.method,))
    assert plan["plan"] == _plain(llmem.plan(read.setup, plan_options=options).to_dict())
    assert {m["method"] for m in plan["plan"]["methods"]} == {read.setup.method}
    assert plan["command"] == f"llmem plan tiny-llama --gpus 2 --seq-len 256 --from {path.name}"


def test_uploads_no_file_reads_by_reference_are_each_a_from_file(client, tmp_path):
    """A Trainer YAML that only mentions the JSON's name (output_dir) and the DeepSpeed JSON: two --from files, in
    the order uploaded, as `llmem estimate --from train.yaml --from zero1.json` reads them."""
    ds = _config("axolotl/deepspeed_configs/zero1.json")
    trainer = tmp_path / "train.yaml"
    trainer.write_text("model_name_or_path: tiny-llama\noutput_dir: zero1.json\nper_device_train_batch_size: 2\n")
    body = client.post("/api/estimate", json={"from": [_upload(trainer), _upload(ds)], "gpus": "2"}).json()
    read = setup_from_file([trainer, ds], gpus=2)
    assert read.setup.batch_size == 2 and read.record.states_method
    assert body["result"] == _plain(llmem.estimate(read.setup).to_dict()), body
    assert body["command"] == "llmem estimate --gpus 2 --from train.yaml --from zero1.json"
    assert body["from_file"]["files"] == [{"path": "train.yaml", "format": "trl"},
                                          {"path": "zero1.json", "format": "deepspeed"}]


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
    r = client.post("/api/estimate", json=params)
    assert r.status_code == 400
    error = r.json()["error"]
    assert words in error and "\n" not in error and "Traceback" not in error


def _yaml(text: str, name: str = "train.yaml") -> str:
    return _upload(Path(name), name=name, raw=text.encode())


@pytest.mark.parametrize("uploads, words", [
    (["train.yaml:%%%"], "the uploaded training config train.yaml is not base64url text"),
    (["train.yaml"], "give NAME:BASE64URL"),
    ([_yaml("a: 1", name="../train.yaml")], "'../train.yaml' is not a file name"),
    ([_yaml("#" * (32 * 1024 + 1))], "the uploaded train.yaml is 32,769 bytes; a training config is a few KiB"),
    ([_yaml("foo: 1\nbar: 2\n")], "train.yaml: not a training config llmem reads (its keys: foo, bar)"),
    ([_yaml("model_name_or_path: gpt2\nper_device_train_batch_size: many\n")],
     "train.yaml: per_device_train_batch_size = 'many' is not a micro-batch"),
    ([_yaml("base_model: gpt2\ndeepspeed: ds_config.json\n")],
     "train.yaml: deepspeed = 'ds_config.json' not found (looked beside the file, in the folders above it and in the "
     "working folder); give the path to the file, or copy it there; on this page: choose that file too"),
    ([_yaml("a: 1"), _yaml("b: 2")], "two uploaded training configs have the same name"),
])
def test_a_bad_training_config_is_refused_in_one_line_naming_the_users_file(client, uploads, words):
    for endpoint in ("/api/estimate", "/api/sweep/seq_len", "/api/plan"):
        r = client.post(endpoint, json={"from": uploads})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert words in error and "\n" not in error and "llmem-serve" not in error and "from-" not in error, error


def test_a_reference_outside_the_upload_is_refused(client):
    """An absolute path to a file on the server's disk: the page's answer comes from the link's files only."""
    on_disk = _config("axolotl/deepspeed_configs/zero1.json")
    r = client.post("/api/estimate", json={"from": _yaml(f"base_model: gpt2\ndeepspeed: {on_disk}\n"),
                                            "gpus": "2"})
    assert r.status_code == 400
    assert r.json()["error"] == f"{on_disk} is not among the uploaded files: choose it too, with the config that " \
                                "names it (the page reads only the files it is given)"


def test_an_unexpected_failure_is_one_line_too(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(llmem, "estimate", broken)
    r = TestClient(make_app(tmp_path, INLINE), raise_server_exceptions=False).post(
        "/api/estimate", json={"model": "tiny-llama"})
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
    assert "<script>" in html and "/api/estimate" in html and "/api/plan" in html
    # offline: no script, style, font or image from another host
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|@import|url\(\s*["']?(https?:)?//""", html)


def test_the_form_has_every_field_the_command_line_has(client):
    form = client.get("/api/form").json()
    names = [f.name for f in option_fields() if "option" in f.metadata]
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
