"""`llmem serve` tried as an attacker would: paths on the server (none read, and a refusal that tells nothing of the
file), references inside an upload that point out of it, Host and Origin checks (DNS rebinding, another site's
page), documents nested deeper than a parser recurses, oversized uploads, a huge model's plan stopped at its time
limit while a small estimate is answered within its own, a request's work stopped when its client leaves, SIGTERM,
and no upload left once its answer is sent. Worker processes run here with short limits set by option."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from llmem.cli import main  # noqa: E402
from llmem.cli.serve import ServeOptions, bind, hosts_of, make_app, server, url_of  # noqa: E402
from llmem.cli.serve_guard import Hosts  # noqa: E402
from llmem.cli.serve_query import MAX_REQUEST_BYTES  # noqa: E402

INLINE = ServeOptions(workers=0, allow_hosts=("testserver",))
# a 512-layer Llama 70B (the page's bound on layers): its plan searches far past any limit set here (minutes)
HUGE = {"model_type": "llama", "num_hidden_layers": 512, "hidden_size": 8192, "num_attention_heads": 64,
        "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256, "max_position_embeddings": 8192}
TINY = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 512}


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _config(obj: dict) -> str:
    return _b64(json.dumps(obj).encode())


def _from(name: str, text: str) -> str:
    return f"{name}:{_b64(text.encode())}"


def _leftovers(uploads: Path) -> list[Path]:
    return sorted(uploads.rglob("*"))


@pytest.fixture(scope="module")
def uploads(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("uploads")


@pytest.fixture(scope="module")
def client(uploads):
    return TestClient(make_app(uploads, INLINE))


def _error(r) -> str:
    error = r.json()["error"]
    assert "\n" not in error and "Traceback" not in error
    return error


# ------------------------------------------------------------------------------------------------ paths on the server


@pytest.mark.parametrize("field, value", [
    ("model", "/etc/passwd"), ("model", "/no/such/config.json"), ("model", "~/.bashrc"), ("model", "../x.json"),
    ("model", "./pyproject.toml"), ("model", "a/b/c"), ("model", "config.json"),
    ("peft_config", "/etc"), ("peft_config", "/no/such/adapter"),
])
def test_no_server_path_is_read_and_the_refusal_tells_nothing_of_it(client, uploads, field, value):
    """The same refusal whether the file exists, is a folder or is missing: only the value given is echoed."""
    params = {"model": "tiny-llama", field: value}
    r = client.post("/api/estimate", json=params)
    assert r.status_code == 400
    shown = "MODEL" if field == "model" else field
    assert _error(r) == f"{shown} {value!r} names a path on the server, which this server does not read (llmem " \
                        "serve --allow-local-paths ROOT allows the files below ROOT): upload the file instead, or " \
                        "give a catalog name or hub id"
    assert _leftovers(uploads) == []


def test_allowed_local_paths_are_read_below_their_roots_only(tmp_path):
    root, outside = tmp_path / "models", tmp_path / "private"
    root.mkdir()
    outside.mkdir()
    (root / "config.json").write_text(json.dumps(TINY))
    (outside / "config.json").write_text(json.dumps(TINY))
    (root / "link.json").symlink_to(outside / "config.json")          # a link out of the root is outside it
    app = make_app(tmp_path / "uploads", ServeOptions(workers=0, allow_hosts=("testserver",),
                                                      allow_local_paths=(root,)))
    client = TestClient(app)
    r = client.post("/api/estimate", json={"model": str(root / "config.json"), "seq_len": "64"})
    assert r.status_code == 200, r.text
    assert r.json()["result"]["setup"]["seq_len"] == 64
    for value in (str(outside / "config.json"), str(root / ".." / "private" / "config.json"),
                  str(root / "link.json"), "/etc/passwd"):
        r = client.post("/api/estimate", json={"model": value})
        assert r.status_code == 400
        assert _error(r) == f"MODEL {value!r} lies outside the folders this server reads (llmem serve " \
                            "--allow-local-paths): upload the file instead"


@pytest.mark.parametrize("reference", ["{outside}/zero1.json", "../../../../..{outside}/zero1.json",
                                       "~/zero1.json", "{outside}/missing.json"])
def test_a_reference_in_an_upload_resolves_only_to_other_uploads(client, uploads, tmp_path, reference):
    """A DeepSpeed JSON named by the uploaded YAML: outside the upload it is refused before it is read (the same
    refusal whether it exists; a real DeepSpeed JSON there would have been read as one before)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "zero1.json").write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    ref = reference.format(outside=outside)
    r = client.post("/api/estimate", json={"from": [_from("train.yaml", f"base_model: gpt2\ndeepspeed: {ref}\n")],
                                           "gpus": "2"})
    assert r.status_code == 400
    assert _error(r) == f"{ref} is not among the uploaded files: choose it too, with the config that names it (the " \
                        "page reads only the files it is given)"
    assert _leftovers(uploads) == []


# ------------------------------------------------------------------------------------------------ Host and Origin


def test_host_must_be_the_address_served():
    loopback = Hosts("127.0.0.1", 8000)
    assert loopback.accepts("127.0.0.1:8000") and loopback.accepts("localhost:8000")
    assert loopback.accepts("LOCALHOST:8000")
    for host in ("evil.example:8000", "127.0.0.1:8001", "localhost", "10.0.0.1:8000", "", "[::1]:8000",
                 "127.0.0.1.evil.example:8000", "a b"):
        assert not loopback.accepts(host), host
    everywhere = Hosts("0.0.0.0", 8000)                 # every interface: any address literal, never a name
    assert everywhere.accepts("192.168.1.7:8000") and not everywhere.accepts("rebound.example:8000")
    proxied = Hosts("127.0.0.1", 8000, ("llmem.example.org",))       # --allow-host
    assert proxied.accepts("llmem.example.org") and proxied.accepts("llmem.example.org:443")
    assert Hosts("::1", 8000).accepts("[::1]:8000") and Hosts("::1", 8000).accepts("localhost:8000")


def test_a_rebound_name_or_another_sites_page_is_refused(client):
    params = {"model": "tiny-llama", "seq_len": "64"}
    r = client.post("/api/estimate", json=params, headers={"host": "rebound.example:8000"})
    assert r.status_code == 421 and "is not this server's address" in _error(r)
    assert client.get("/", headers={"host": "rebound.example:8000"}).status_code == 421
    r = client.post("/api/estimate", json=params, headers={"origin": "http://evil.example"})
    assert r.status_code == 403 and "another site" in _error(r)
    r = client.post("/api/estimate", json=params, headers={"origin": "null"})
    assert r.status_code == 403
    r = client.post("/api/estimate", json=params, headers={"sec-fetch-site": "cross-site"})
    assert r.status_code == 403
    # a form post (no preflight) is not JSON; a GET does no work
    r = client.post("/api/estimate", content="model=tiny-llama", headers={"content-type": "text/plain"})
    assert r.status_code == 415
    assert client.get("/api/estimate", params=params).status_code == 405
    # the page's own requests pass
    r = client.post("/api/estimate", json=params, headers={"origin": "http://testserver",
                                                           "sec-fetch-site": "same-origin"})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------------------------ nested and oversized


@pytest.mark.parametrize("name, text", [
    ("deep.yaml", "a: " + "[" * 3000 + "]" * 3000),
    ("deep.toml", "a = " + "[" * 3000 + "]" * 3000),
    ("deep.json", '{"a": ' + "[" * 3000 + "]" * 3000 + "}"),
    ("deep70.yaml", "a: " + "[" * 70 + "]" * 70),                # parses, but deeper than any training config
])
def test_a_nested_document_is_one_line_in_the_server_and_exit_2_in_the_cli(client, tmp_path, capsys, name, text):
    r = client.post("/api/estimate", json={"from": [_from(name, text)]})
    assert r.status_code == 400
    assert _error(r) == f"{name}: nested more than 64 levels deep, which no training config is; give the config file"
    path = tmp_path / name
    path.write_text(text)
    capsys.readouterr()
    assert main(["estimate", "--from", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"llmem: error: {path}: nested more than 64 levels deep, which no training config is; give the " \
                  "config file\n"


def test_a_nested_config_or_body_is_refused_in_one_line(client):
    deep = '{"model_type": "llama", "a": ' + "[" * 5000 + "]" * 5000 + "}"
    r = client.post("/api/estimate", json={"model": "x.json", "config": _b64(deep.encode())})
    assert r.status_code == 400 and _error(r) == "the uploaded file is nested too deeply: upload the model's config.json"
    r = client.post("/api/estimate", content="[" * 100_000 + "]" * 100_000,
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not JSON" in _error(r)


def test_oversized_uploads_are_refused_in_one_line(client, uploads):
    big = "#" * (MAX_REQUEST_BYTES + 1)
    r = client.post("/api/estimate", json={"model": "tiny-llama", "from": [_from("t.yaml", big)]})
    assert r.status_code == 413 and "uploads fit in" in _error(r)
    r = client.post("/api/estimate", json={"model": "x.json", "config": _b64(b'{"a": "' + b"x" * (1 << 20) + b'"}')})
    assert r.status_code == 400 and "a config.json is a few KiB" in _error(r)
    r = client.post("/api/estimate", json={"from": [_from("t.yaml", "#" * (32 * 1024 + 1))]})
    assert r.status_code == 400 and "a training config is a few KiB" in _error(r)
    assert _leftovers(uploads) == []


def test_no_upload_outlives_its_answer(client, uploads):
    r = client.post("/api/estimate", json={"model": "mine.json", "config": _config(TINY), "seq_len": "64",
                                           "from": [_from("t.yaml", "per_device_train_batch_size: 2\n")]})
    assert r.status_code == 200, r.text
    assert r.json()["command"] == "llmem estimate mine.json --seq-len 64 --from t.yaml"
    assert _leftovers(uploads) == []


# ------------------------------------------------------------------------------------------------ worker processes


@pytest.fixture(scope="module")
def pooled(tmp_path_factory):
    """Worker processes with a 3 s plan limit: one for estimates, one for plans."""
    uploads = tmp_path_factory.mktemp("pooled")
    app = make_app(uploads, ServeOptions(workers=1, plan_workers=1, estimate_timeout_s=10, plan_timeout_s=3,
                                         allow_hosts=("testserver",)))
    assert all(lane.wait_ready(120) for lane in app.state.lanes.values())
    yield TestClient(app), uploads
    app.state.close()


def test_a_huge_plan_is_stopped_at_its_limit_while_an_estimate_is_answered(pooled):
    client, uploads = pooled
    answers: dict[str, tuple[int, str, float]] = {}

    def plan() -> None:
        start = time.monotonic()
        r = client.post("/api/plan", json={"model": "huge.json", "config": _config(HUGE), "gpus": "8"})
        answers["plan"] = (r.status_code, r.json()["error"], time.monotonic() - start)

    thread = threading.Thread(target=plan)
    thread.start()
    time.sleep(0.5)
    start = time.monotonic()
    r = client.post("/api/estimate", json={"model": "tiny-llama", "seq_len": "96"})
    estimate_s = time.monotonic() - start
    assert r.status_code == 200 and estimate_s < 10, (r.text, estimate_s)
    thread.join(30)
    status, error, plan_s = answers["plan"]
    assert status == 504 and 3 <= plan_s < 8, answers
    assert error == "the plan of huge.json gpus=8 took longer than this server's 3 s limit (llmem serve " \
                    "--plan-timeout), so it was stopped: the set-up is too big to compute here; run the command " \
                    "line on your machine"
    # the killed worker was replaced: the next plan is answered
    r = client.post("/api/plan", json={"model": "tiny-llama", "seq_len": "64"})
    assert r.status_code == 200, r.text
    assert _leftovers(uploads) == []


def test_a_repeated_request_is_answered_from_the_cache(pooled):
    client, _ = pooled
    params = {"model": "tiny-llama", "seq_len": "80"}
    first = client.post("/api/estimate", json=params)
    start = time.monotonic()
    again = client.post("/api/estimate", json=params)
    assert again.content == first.content and time.monotonic() - start < 0.5


def _post_and_leave(url: str, body: dict) -> None:
    """A raw POST whose client leaves before the answer."""
    host, port = url.split("//")[1].strip("/").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST /api/plan HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(1.0)


def test_a_plan_is_stopped_when_its_client_leaves(tmp_path):
    """One plan worker, a 120 s limit: the huge plan's client leaves after a second; the next plan is answered
    within seconds (its worker was killed and replaced, not left computing)."""
    sock = bind("127.0.0.1", 0)
    options = ServeOptions(workers=1, plan_workers=1, plan_timeout_s=120)
    app = make_app(tmp_path, options, hosts_of(sock, options))
    srv = server(app, sock)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert all(lane.wait_ready(120) for lane in app.state.lanes.values())
        url = url_of(sock)
        _post_and_leave(url, {"model": "huge.json", "config": _config(HUGE), "gpus": "8"})
        import httpx

        start = time.monotonic()
        r = httpx.post(url + "api/plan", json={"model": "tiny-llama", "seq_len": "72"}, timeout=60)
        assert r.status_code == 200, r.text
        assert time.monotonic() - start < 20
    finally:
        srv.should_exit = True
        thread.join(10)
        app.state.close()
        sock.close()


def test_sigterm_stops_the_server_promptly(tmp_path):
    """`llmem serve` with a huge plan in flight: SIGTERM ends it within seconds, exit 0."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "llmem.cli", "serve", "--port", "0", "--plan-timeout", "300"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        assert line.startswith("llmem serve: http://127.0.0.1:"), line
        url = line.split()[2]
        threading.Thread(target=_post_and_leave, args=(url, {"model": "huge.json", "config": _config(HUGE)}),
                         daemon=True).start()
        time.sleep(1.0)
        proc.terminate()
        start = time.monotonic()
        rc = proc.wait(15)
        assert rc == 0, proc.stderr.read()[-2000:]      # the server's own account when it did not stop cleanly
        assert time.monotonic() - start < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("params", [
    {"model": "someone/custom-model", "trust_remote_code": "1"},
    {"from": [_from("train.yaml", "model_name_or_path: someone/custom-model\nstage: sft\nfinetuning_type: full\n"
                                  "trust_remote_code: true\n")]},                 # LLaMA-Factory's key
])
def test_no_models_own_code_is_run(client, params):
    """trust_remote_code (given, or set by an uploaded file) would import a hub repository's Python: refused for a
    model outside the catalog; a catalog model never runs its repository's code, so it is answered."""
    r = client.post("/api/estimate", json=params)
    assert r.status_code == 400
    assert _error(r) == "trust_remote_code: this server runs no model's own code (someone/custom-model is not in " \
                        "llmem's catalog); upload the model's config.json instead, or run llmem estimate on your " \
                        "machine"
    r = client.post("/api/estimate", json={"model": "gpt2", "trust_remote_code": "1", "seq_len": "64"})
    assert r.status_code == 200, r.text


def test_the_pages_bounds_on_layers_and_gpus(client, uploads):
    """Past any published model (405B: 126 layers) and any plan a page should run: one line, the command line named;
    at the bound, answered. The bound reads every name transformers' configs give the layer count."""
    for key in ("num_hidden_layers", "n_layer"):
        huge = {"model_type": "llama", key: 2048, "hidden_size": 64, "num_attention_heads": 4}
        r = client.post("/api/estimate", json={"model": "x.json", "config": _config(huge)})
        assert r.status_code == 400 and _error(r).startswith("the uploaded config has 2,048 decoder layers")
    r = client.post("/api/estimate", json={"model": "tiny-llama", "gpus": "16385", "method": "fsdp"})
    assert r.status_code == 400 and "at most 16,384 GPUs" in _error(r)
    r = client.post("/api/estimate", json={"model": "tiny-llama", "gpus": "2", "method": "fsdp", "seq_len": "64"})
    assert r.status_code == 200
    assert _leftovers(uploads) == []


def test_a_worker_killed_from_two_threads_at_once_closes_its_pipe_once():
    """A stop's close() (in the signal handler) and the request thread that sees its worker die both kill it, at
    the same moment: its pipe is closed once (two closes at once raised EBADF in CI's SIGTERM test)."""
    from llmem.cli.serve_pool import Worker

    class Pipe:
        closes = 0

        def close(self):
            Pipe.closes += 1
            time.sleep(0.05)

    class Process:
        def __init__(self, **kwargs):
            pass

        def start(self):
            pass

        def kill(self):
            pass

        def join(self, timeout):
            time.sleep(0.2)                 # both killers are inside kill() before either closes

    class Context:
        def Pipe(self):
            return Pipe(), Pipe()

        def Process(self, **kwargs):
            return Process(**kwargs)

    w = Worker(Context(), place=None)
    Pipe.closes = 0                         # the child end, closed by the parent once the worker started
    killers = [threading.Thread(target=w.kill) for _ in range(2)]
    for t in killers:
        t.start()
    for t in killers:
        t.join()
    assert Pipe.closes == 1
