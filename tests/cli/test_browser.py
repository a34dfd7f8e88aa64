"""`llmem serve`'s page in a real headless browser: Debian's Chromium (`apt-get install chromium`; .ci/run installs it)
driven by Playwright (no browser download: `executable_path` points at the system's). The server runs as `llmem serve`
runs it (uvicorn on a bound socket), in a thread on a free port. The page is opened with a query URL, then a model is
typed into its form; each answer read from the page equals the library's and the CLI's `--json` for the command line
the page shows. A screenshot is written to the test's folder, and to $LLMEM_SCREENSHOT when set
(docs/screens/make.sh regenerates docs/screens/serve.png that way)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
sync_api = pytest.importorskip("playwright.sync_api",
                               reason="playwright is not installed: pip install -e '.[dev]' (no browser download "
                                      "needed: the test runs the system's chromium)")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH: apt-get install chromium (Debian's "
                                                         "package; .ci/run installs it)")

from published_configs import CONFIGS, SKIP_REASON, present  # noqa: E402

import llmem  # noqa: E402
from llmem.cli import main  # noqa: E402
from llmem.cli.serve import ServeOptions, bind, hosts_of, make_app, server, url_of  # noqa: E402
from llmem.setup.sources import setup_from_file  # noqa: E402

COUNTERS = {"peak_allocated": "peak_allocated_bytes", "peak_reserved": "peak_reserved_bytes",
            "device_used": "device_used_bytes"}
ANSWERED = "document.getElementById('status').dataset.state === 'done'"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    sock = bind("127.0.0.1", 0)
    options = ServeOptions(workers=0)             # in this process: the worker processes are test_serve_security's
    srv = server(make_app(tmp_path_factory.mktemp("uploads"), options, hosts_of(sock, options)), sock)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.started, "uvicorn did not start"
    yield url_of(sock)
    srv.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--disable-dev-shm-usage"])
        yield b
        b.close()


def _page_answer(page) -> tuple[dict[str, int], bool, str]:
    """The counters (bytes), fits and the command line, as the page shows them."""
    counters = {key: int(page.get_attribute(f"#{cid}", "data-bytes")) for cid, key in COUNTERS.items()}
    return counters, page.get_attribute("#fits", "data-fits") == "true", page.text_content("#command")


def _cli(command: str, capsys) -> dict:
    argv = shlex.split(command)
    assert argv[:2] == ["llmem", "estimate"]
    capsys.readouterr()
    assert main(argv[1:] + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _same_as_cli(page, capsys) -> str:
    counters, fits, command = _page_answer(page)
    cli = _cli(command, capsys)
    assert counters == {key: cli[key] for key in COUNTERS.values()}
    assert fits == cli["fits"]
    return command


def test_the_page_answers_a_query_url_and_a_typed_model_as_the_cli_does(served, browser, tmp_path, capsys):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    # 1. a shared link: the URL's query fills the form and answers
    page.goto(served + "?model=tiny-llama&batch_size=2&seq_len=128")
    page.wait_for_function(ANSWERED, timeout=120_000)
    assert page.input_value("#f-batch_size") == "2" and page.input_value("#f-seq_len") == "128"
    command = _same_as_cli(page, capsys)
    assert command == "llmem estimate tiny-llama --batch-size 2 --seq-len 128"
    counters, _, _ = _page_answer(page)
    expected = llmem.estimate("tiny-llama", batch_size=2, seq_len=128)
    assert counters == {key: getattr(expected, key) for key in COUNTERS.values()}

    # 2. a model typed into the form, two GPUs and an option ticked: the page answers it, the URL carries the query
    page.fill("#f-model", "gpt2")
    page.fill("#f-gpus", "2")
    page.click("details[data-group=activations] > summary")      # a closed section of the form, opened
    page.check("#f-grad_ckpt")
    page.click("#run")
    page.wait_for_function("document.getElementById('command').textContent.includes('gpt2') && " + ANSWERED,
                           timeout=60_000)
    command = _same_as_cli(page, capsys)
    assert command == "llmem estimate gpt2 --gpus 2 --batch-size 2 --seq-len 128 --grad-ckpt"   # fsdp: 2 GPUs' default
    assert "model=gpt2" in page.url and "gpus=2" in page.url and "grad_ckpt=1" in page.url

    # the breakdown, both sweeps and the plan are drawn from the same answer
    shown = page.eval_on_selector_all("#breakdown [data-component]",
                                      "gs => Object.fromEntries(gs.map(g => [g.dataset.component, +g.dataset.bytes]))")
    result = llmem.estimate("gpt2", gpus=2, method="fsdp", batch_size=2, seq_len=128, grad_ckpt=True)
    assert shown == {k: v for k, v in result.components.items() if v > 0}
    for axis in ("batch_size", "seq_len"):
        assert page.locator(f"#chart-{axis} circle").count() >= 3 * 5
    # (the plan's numbers are the library's: tests/cli/test_serve.py; here, that the page lays them out)
    labels = page.eval_on_selector_all("#plan-table tr[data-label]", "rs => rs.map(r => r.dataset.label)")
    assert {"ddp (2)", "fsdp (2)", "zero2 (2)"} <= set(labels)
    recommended = page.get_attribute("#plan-table tr.recommended", "data-label")
    assert page.text_content("#recommendation").startswith(f"recommended: {recommended} — ")
    assert page.text_content("#plan-command") == "llmem plan gpt2 --gpus 2 --seq-len 128 --grad-ckpt"
    assert not errors, errors

    shot = tmp_path / "serve.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("LLMEM_SCREENSHOT"):
        shutil.copyfile(shot, Path(os.environ["LLMEM_SCREENSHOT"]))
    page.close()


def test_a_refusal_shows_one_line_on_the_page(served, browser):
    page = browser.new_page()
    page.goto(served + "?model=tiny-llama&batch_size=0")
    page.wait_for_function("document.getElementById('status').dataset.state === 'error'", timeout=60_000)
    assert page.text_content("#error") == "--batch-size must lie in [1, 1,048,576], got 0"
    page.close()


def test_an_uploaded_config_answers_and_its_link_reopens_it(served, browser, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                                  "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256,
                                  "max_position_embeddings": 512}))
    expected = llmem.estimate(str(config), seq_len=64)
    page = browser.new_page()
    page.goto(served + "?seq_len=64")                # no model yet: the form waits for one
    page.wait_for_function("document.getElementById('status').dataset.state === 'idle'", timeout=60_000)
    page.set_input_files("#upload", str(config))
    page.wait_for_function("document.getElementById('command').textContent.startsWith('llmem estimate config.json') "
                           "&& " + ANSWERED, timeout=60_000)
    counters, _, command = _page_answer(page)
    assert command == "llmem estimate config.json --seq-len 64"
    assert counters == {key: getattr(expected, key) for key in COUNTERS.values()}
    link = page.url
    assert "config=" in link
    again = browser.new_page()                       # the link carries the config: a new page answers the same
    again.goto(link)
    again.wait_for_function(ANSWERED, timeout=60_000)
    assert _page_answer(again)[0] == counters
    again.close()
    page.close()


def test_a_training_config_and_its_deepspeed_json_answer_as_setup_from_file(served, browser):
    """Both files chosen at once in the training-config input: the answer is the library's for setup_from_file of
    the files in place, the fields set on the page override the file's, the page lists what the files set."""
    if not present():
        pytest.skip(SKIP_REASON)
    config = CONFIGS / "llamafactory/examples/train_full/llama3_full_sft.yaml"
    ds = CONFIGS / "llamafactory/examples/deepspeed/ds_z3_config.json"
    expected = llmem.estimate(setup_from_file(config, model="tiny-llama", gpus=2, seq_len=128).setup)
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(served + "?gpus=2&seq_len=128")        # no model yet: the form waits for one
    page.wait_for_function("document.getElementById('status').dataset.state === 'idle'", timeout=60_000)
    page.fill("#f-model", "tiny-llama")
    page.set_input_files("#from-upload", [str(config), str(ds)])
    page.wait_for_function("document.getElementById('command').textContent.includes('--from') && " + ANSWERED,
                           timeout=60_000)
    counters, fits, command = _page_answer(page)
    assert command == "llmem estimate tiny-llama --gpus 2 --seq-len 128 --from llama3_full_sft.yaml"
    assert counters == {key: getattr(expected, key) for key in COUNTERS.values()} and fits == expected.fits
    assert page.text_content("#from-files") == \
        "llama3_full_sft.yaml (llamafactory) · examples/deepspeed/ds_z3_config.json (deepspeed)"
    assert page.text_content("#from-table tr[data-kind=used][data-key='zero_optimization.stage'] td:nth-child(3)") \
        == "zero_optimization.stage = 3"                   # the JSON's stage: it was found where the YAML names it
    assert "from=llama3_full_sft.yaml%3A" in page.url and "from=ds_z3_config.json%3A" in page.url
    # the form shows what the file set (the fields not given on the page), marked, and leaves them out of the query
    read = setup_from_file(config, model="tiny-llama", gpus=2, seq_len=128)
    shown = {u.field: u.value for u in read.record.used if u.field and u.field not in ("model", "gpus", "seq_len")}
    assert shown, read.record.used
    marked = page.eval_on_selector_all(".field.from-file", "rs => rs.map(r => r.dataset.field)")
    assert set(marked) == set(shown)
    for name in marked:
        value = page.eval_on_selector(f"#f-{name}", "e => e.type === 'checkbox' ? String(e.checked) : e.value")
        assert value == (str(shown[name]).lower() if isinstance(shown[name], bool) else str(shown[name])), name
        assert f"&{name}=" not in page.url and f"?{name}=" not in page.url, name
    assert not errors, errors
    page.close()


NO_OVERFLOW = "document.documentElement.scrollWidth <= document.documentElement.clientWidth"


@pytest.mark.parametrize("width, height", [(390, 844), (1280, 900)])
def test_the_page_fits_a_phone_and_a_desktop_screen(served, browser, tmp_path, width, height):
    """No sideways scrolling at a phone's 390 px or a laptop's 1280 px, before and after an estimate with its plan
    and an uploaded config.json (wide tables scroll inside their card); a refusal after an answer clears that answer
    and marks the field it names. Screenshots go to $LLMEM_SCREENSHOTS (a folder) when set (docs/screens/make.sh)."""
    shots = Path(os.environ.get("LLMEM_SCREENSHOTS") or tmp_path)
    page = browser.new_page(viewport={"width": width, "height": height})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(served)
    page.wait_for_function("document.getElementById('status').dataset.state === 'idle'", timeout=60_000)
    assert page.evaluate(NO_OVERFLOW)
    page.screenshot(path=str(shots / f"serve-{width}-initial.png"), full_page=True)

    page.fill("#f-model", "gpt2")
    page.fill("#f-gpus", "2")
    page.fill("#f-seq_len", "128")
    page.click("#run")
    page.wait_for_function(ANSWERED + " && document.querySelectorAll('#plan-table tr[data-label]').length >= 3",
                           timeout=120_000)
    assert page.evaluate(NO_OVERFLOW), page.evaluate("document.documentElement.scrollWidth")
    # the plan's table is wider than a phone: it scrolls inside its card, the page does not
    page.screenshot(path=str(shots / f"serve-{width}-plan.png"), full_page=True)

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                                  "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256,
                                  "max_position_embeddings": 512}))
    page.set_input_files("#upload", str(config))
    page.wait_for_function("document.getElementById('command').textContent.startsWith('llmem estimate config.json') "
                           "&& " + ANSWERED, timeout=60_000)
    assert page.evaluate(NO_OVERFLOW)
    page.screenshot(path=str(shots / f"serve-{width}-upload.png"), full_page=True)

    page.fill("#f-batch_size", "0")                  # refused: the old answer goes, the field is marked
    page.click("#run")
    page.wait_for_function("document.getElementById('status').dataset.state === 'error'", timeout=60_000)
    assert page.text_content("#error") == "--batch-size must lie in [1, 1,048,576], got 0"
    assert page.get_attribute("#peak_reserved", "data-bytes") is None
    assert page.text_content("#peak_reserved .value") == "–" and page.locator("#plan-table").count() == 0
    assert "invalid" in page.get_attribute("[data-field=batch_size]", "class")
    assert page.evaluate(NO_OVERFLOW)
    assert not errors, errors
    page.close()


def test_quick_edits_make_one_query(served, browser):
    """Six edits in quick succession post one estimate (the form waits for the edits to pause), for the last
    value."""
    page = browser.new_page()
    page.goto(served + "?model=tiny-llama&seq_len=64")
    page.wait_for_function(ANSWERED, timeout=60_000)
    posted: list[str] = []
    page.on("request", lambda r: posted.append(r.post_data or "") if r.url.endswith("/api/estimate") else None)
    for seq_len in (70, 71, 72, 73, 74, 75):
        page.fill("#f-seq_len", str(seq_len))
        page.press("#f-seq_len", "Tab")                # the field's change event
    page.wait_for_function("document.getElementById('command').textContent.includes('--seq-len 75') && " + ANSWERED,
                           timeout=60_000)
    assert [json.loads(p)["seq_len"] for p in posted] == ["75"]
    page.close()
