"""`llmem serve`: a local web page over the same API as the command line (a small FastAPI app, served by uvicorn).

The page (web/index.html: one file, vanilla JS, inline SVG charts, nothing fetched from elsewhere) asks for what
`llmem estimate` asks for: its form is built from the TrainingSetup fields' `Option`s (GET /api/form), as the
command line's flags are (options.py), so a new field appears on the page by itself. A query is the page's URL
query: one parameter per field name (`?model=gpt2&gpus=4&grad_ckpt=1`), `config` for an uploaded config.json
(base64url of its JSON, so that the link carries it). Each endpoint turns the query into the command line's flags and
reads them with the command line's own parser (`setup_from_args`, `plan_options_from_args`), then calls
`llmem.estimate` / `llmem.plan`: the page's answer is the CLI's answer, and the page shows the command line that gives
it (`setup_flags`). Refusals (LlmemError, argparse's usage errors) come back as HTTP 400 {"error": one line}.

    GET /                      the page
    GET /api/form              the fields, their groups and choices (GPUs, methods, ...), the models, the sweeps
    GET /api/estimate?QUERY    {"result": MemoryResult.to_dict(), "command", "title", "setup", "oom"}
    GET /api/sweep/AXIS?QUERY  the estimate at each batch size or sequence length (`points=1,2,4` to choose them)
    GET /api/plan?QUERY        {"plan": Plan.to_dict(), "command", "title"}: every method on the GPUs given
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import json
import logging
import math
import shlex
import socket
import tempfile
import threading
from dataclasses import fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request  # module-level: FastAPI reads the endpoints' annotations from here
from fastapi.responses import HTMLResponse, JSONResponse, Response

from llmem.cli.options import (
    GROUP_TITLES,
    add_plan_options,
    add_training_options,
    option_flags,
    plan_options_from_args,
    setup_flags,
    setup_from_args,
)
from llmem.errors import LlmemError
from llmem.setup.gpus import GPU_CATALOG
from llmem.setup.methods import METHODS
from llmem.setup.optimizers import OPTIMIZERS
from llmem.setup.precision import PRECISIONS
from llmem.setup.training import (
    ADAPTER_DTYPES,
    ATTENTIONS,
    MAX_BATCH_SIZE,
    MAX_SEQ_LEN,
    TrainingSetup,
)

log = logging.getLogger("llmem.serve")

CONFIG_KEY = "config"                 # the query's uploaded config.json (base64url of its JSON)
MAX_CONFIG_BYTES = 1 << 20            # a config.json is a few KiB; anything near this is not one
# The registries a field's value is one of (the page offers a list); a field without one gets a text box
CHOICES: dict[str, Any] = {"method": METHODS, "precision": PRECISIONS, "optimizer": OPTIMIZERS, "attn": ATTENTIONS,
                           "gpu": GPU_CATALOG, "adapter_dtype": ADAPTER_DTYPES}
# The sweeps' default points: powers of two around the usual sizes (the query's own value is added)
SWEEPS: dict[str, tuple[tuple[int, ...], int]] = {
    "batch_size": ((1, 2, 4, 8, 16, 32, 64), MAX_BATCH_SIZE),
    "seq_len": ((256, 512, 1024, 2048, 4096, 8192, 16384, 32768), MAX_SEQ_LEN),
}
MAX_SWEEP_POINTS = 16
# `llmem plan` on the page compares every method: the query's method and micro-batch are left to the search
PLAN_DROPS = ("method", "batch_size")
TRUE, FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no", "")


def _option(f):
    return f.metadata.get("option")


# ------------------------------------------------------------------------------------------------ the form


def form_schema() -> dict:
    """What the page builds its form from: every TrainingSetup field with an Option, in field order."""
    from llmem.model.catalog import catalog

    items = []
    for f in fields(TrainingSetup):
        opt = _option(f)
        if opt is None:
            continue
        default = f.default if opt.cli_default is ... else opt.cli_default
        items.append({
            "name": f.name, "group": opt.group, "kind": opt.kind, "help": opt.help.replace("%%", "%"),
            "flag": (option_flags({f.name: _shown_value(opt)}) or [None])[0],
            "type": {int: "int", float: "float"}.get(opt.type, "str") if opt.kind == "value" else "bool",
            "default": None if opt.kind == "positional" else default,
            "choices": list(CHOICES[f.name]) if f.name in CHOICES else None,
            "switches": [[flag, value, text] for flag, value, text in opt.switches],
        })
    models = [name for e in catalog().values() for name in (e.hub_id, *e.aliases)]
    tiny = sorted(p.name[:-5] for p in resources.files("llmem.model.catalog").joinpath("tiny").iterdir()
                  if p.name.endswith(".json"))
    return {"fields": items, "groups": [[k, t] for k, t in GROUP_TITLES.items()], "models": tiny + models,
            "sweeps": {axis: list(points) for axis, (points, _) in SWEEPS.items()}, "config_key": CONFIG_KEY}


def _shown_value(opt) -> Any:
    """A value that makes option_flags write the field's flag (for the form's labels)."""
    return {"switch": True, "negate": False, "switches": opt.switches[0][1] if opt.switches else None}.get(
        opt.kind, "X")


# ------------------------------------------------------------------------------------------------ a query


class _RaisingParser(argparse.ArgumentParser):
    """A parser whose usage errors are raised as LlmemError (a server must not exit)."""

    def error(self, message: str):
        raise LlmemError(message)

    def exit(self, status: int = 0, message: str | None = None):
        raise LlmemError((message or "").strip() or f"the command line ended with status {status}")


def _parser(command: str) -> argparse.ArgumentParser:
    """`llmem estimate`'s or `llmem plan`'s options, from the same builders as the command line's (options.py)."""
    parser = _RaisingParser(prog=f"llmem {command}", add_help=False)
    add_training_options(parser)
    if command == "plan":
        add_plan_options(parser)
    return parser


class Query:
    """A page's query (name -> text) read as the command line reads flags, an uploaded config written where the
    model loader can read it."""

    def __init__(self, params: dict[str, str], uploads: Path):
        self.params = dict(params)
        self.uploads = uploads
        known = {f.name for f in fields(TrainingSetup) if _option(f) is not None} | {CONFIG_KEY}
        unknown = sorted(set(self.params) - known)
        if unknown:
            raise LlmemError(f"unknown query field {unknown[0]!r}: the fields are {', '.join(sorted(known))}")
        self.model = self.params.get("model", "").strip()
        if not self.model:
            raise LlmemError("no model: give a catalog name (`llmem models`), a hub id, or upload a config.json")
        self.model_path = self._upload(self.params[CONFIG_KEY]) if self.params.get(CONFIG_KEY) else self.model

    def _upload(self, encoded: str) -> str:
        """The uploaded config.json, written once per content under `uploads`: its path."""
        try:
            raw = base64.b64decode(encoded + "=" * (-len(encoded) % 4), altchars=b"-_", validate=True)
        except (binascii.Error, ValueError):
            raise LlmemError("the uploaded config is not base64url text: upload the config.json again") from None
        if len(raw) > MAX_CONFIG_BYTES:
            raise LlmemError(f"the uploaded config is {len(raw):,} bytes; a config.json is a few KiB: upload the "
                             "model's config.json")
        try:
            if not isinstance(json.loads(raw), dict):
                raise ValueError
        except ValueError:
            raise LlmemError("the uploaded file is not a JSON object: upload the model's config.json") from None
        folder = self.uploads / hashlib.sha256(raw).hexdigest()[:16]
        path = folder / "config.json"
        if not path.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            path.write_bytes(raw)
        return str(path)

    def values(self, drop: tuple[str, ...] = ()) -> dict[str, Any]:
        """The fields given, switches as booleans, the rest as text (the parser types and checks them)."""
        out: dict[str, Any] = {}
        for f in fields(TrainingSetup):
            opt = _option(f)
            if opt is None or opt.kind == "positional" or f.name in drop or f.name not in self.params:
                continue
            text = self.params[f.name].strip()
            if opt.kind in ("switch", "negate"):
                if text.lower() not in TRUE + FALSE:
                    raise LlmemError(f"{f.name}={text!r}: give 1 (on) or 0 (off)")
                out[f.name] = text.lower() in TRUE
            elif text or opt.kind == "switches":
                out[f.name] = text or f.default
        return out

    def args(self, command: str, drop: tuple[str, ...] = ()) -> argparse.Namespace:
        """The query parsed by `llmem COMMAND`'s own parser (flags as --flag=VALUE, the model after '--')."""
        return _parser(command).parse_args([*option_flags(self.values(drop), attached=True), "--", self.model_path])

    def command(self, command: str, setup: TrainingSetup) -> str:
        """The command line that gives `setup`'s answer, the uploaded config named as the user's file."""
        argv = setup_flags(setup)
        argv[0] = self.model
        return shlex.join(["llmem", command, *argv])

    def shown(self, text: str) -> str:
        """A text naming the uploaded config's path, with the user's file name instead."""
        return text.replace(self.model_path, self.model) if self.model_path != self.model else text


def sweep_points(axis: str, setup: TrainingSetup, given: str | None) -> list[int]:
    if axis not in SWEEPS:
        raise LlmemError(f"unknown sweep {axis!r}: choose {' or '.join(SWEEPS)}")
    defaults, bound = SWEEPS[axis]
    if given:
        try:
            points = sorted({int(p) for p in given.split(",") if p.strip()})
        except ValueError:
            raise LlmemError(f"points={given!r}: give whole numbers separated by commas") from None
    else:
        points = sorted({*defaults, getattr(setup, axis)})
    if not points or len(points) > MAX_SWEEP_POINTS or not all(1 <= p <= bound for p in points):
        raise LlmemError(f"points: give 1 to {MAX_SWEEP_POINTS} sizes in [1, {bound:,}]")
    return points


# ------------------------------------------------------------------------------------------------ the app


def _finite(obj: Any) -> Any:
    """JSON as the CLI's --json writes it, with nan / inf (which a browser's JSON.parse refuses) as null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _one_line(text: str) -> str:
    return " ".join(str(text).split()) or "error"


def make_app(uploads: Path | None = None):
    """The FastAPI app. One estimate or plan at a time (the engines' caches are shared): a lock around them."""
    import llmem
    from llmem.cli.tables import memory_title, plan_title, to_json

    uploads = uploads or Path(tempfile.mkdtemp(prefix="llmem-serve-"))
    lock = threading.Lock()
    page = resources.files("llmem.cli").joinpath("web", "index.html").read_text(encoding="utf-8")
    app = FastAPI(title="llmem", docs_url=None, redoc_url=None, openapi_url=None)

    def answer(obj: Any) -> Response:
        return Response(json.dumps(_finite(json.loads(to_json(obj)))), media_type="application/json")

    @app.exception_handler(LlmemError)
    async def refused(request: Request, exc: LlmemError):
        return JSONResponse({"error": _one_line(str(exc))}, status_code=400)

    @app.exception_handler(Exception)       # uvicorn logs the traceback (Starlette re-raises after answering)
    async def failed(request: Request, exc: Exception):
        return JSONResponse({"error": _one_line(f"internal error: {type(exc).__name__}: {exc} (the server's log "
                                                "has the traceback)")}, status_code=500)

    def query(request: Request, *extra: str) -> Query:
        return Query({k: v for k, v in request.query_params.items() if k not in extra}, uploads)

    @app.get("/", response_class=HTMLResponse)
    def index():
        return page

    @app.get("/api/form")
    def form():
        return answer(form_schema())

    @app.get("/api/estimate")
    def estimate(request: Request):
        q = query(request)
        setup = setup_from_args(q.args("estimate"))
        with lock:
            result = llmem.estimate(setup)
        return answer({"result": result.to_dict(), "command": q.command("estimate", setup),
                       "title": [q.shown(t) for t in memory_title(result)], "setup": setup.to_dict(),
                       "oom": result.oom.describe() if result.oom is not None else None})

    @app.get("/api/sweep/{axis}")
    def sweep(axis: str, request: Request):
        q = query(request, "points")
        setup = setup_from_args(q.args("estimate"))
        out = []
        for value in sweep_points(axis, setup, request.query_params.get("points")):
            try:
                with lock:
                    r = llmem.estimate(replace(setup, **{axis: value}))
            except LlmemError as exc:         # a point past what the set-up allows (too many tokens, positions)
                out.append({"value": value, "error": _one_line(str(exc))})
                continue
            out.append({"value": value, "peak_allocated_bytes": r.peak_allocated_bytes,
                        "peak_reserved_bytes": r.peak_reserved_bytes, "device_used_bytes": r.device_used_bytes,
                        "fits": r.fits})
        return answer({"axis": axis, "value": getattr(setup, axis), "points": out})

    @app.get("/api/plan")
    def plan(request: Request):
        q = query(request)
        args = q.args("plan", drop=PLAN_DROPS)
        setup = setup_from_args(args)
        options = plan_options_from_args(args, setup)
        with lock:
            p = llmem.plan(setup, plan_options=options)
        return answer({"plan": p.to_dict(), "command": q.command("plan", setup),
                       "title": [q.shown(t) for t in plan_title(p)]})

    app.state.lock = lock
    return app


# ------------------------------------------------------------------------------------------------ the server


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one), refused as one line before the server starts."""
    if not 0 <= port <= 65535:
        raise LlmemError(f"--port must lie in [0, 65535] (0: any free port), got {port}")
    # an IP address (no name lookup: a local server needs none) or localhost
    numeric = 0 if host == "localhost" else socket.AI_NUMERICHOST
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=numeric)[0]
    except (socket.gaierror, UnicodeError, ValueError):
        raise LlmemError(f"--host {host!r}: give an IP address of this machine (127.0.0.1, ::1, 0.0.0.0 for every "
                         "interface) or localhost") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise LlmemError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc}); choose another "
                         "--port (0: any free one) or an address of this machine") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/"


def server(app, sock: socket.socket):
    """A uvicorn server for `app` on `sock` (run it with .run(sockets=[sock]); .should_exit stops it)."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))


def warm_up(app) -> None:
    """Import torch and transformers and run a small estimate before the first request (seconds of imports; the
    first request waits on the lock meanwhile)."""
    import llmem

    try:
        with app.state.lock:
            llmem.estimate("tiny-llama", seq_len=128)
    except Exception:                      # only a head start: the first request reports what fails
        log.debug("warm-up failed", exc_info=True)


def serve(host: str, port: int) -> None:
    """`llmem serve`: the page on host:port until Ctrl-C."""
    sock = bind(host, port)
    app = make_app()
    threading.Thread(target=warm_up, args=(app,), daemon=True).start()
    print(f"llmem serve: {url_of(sock)} (Ctrl-C to stop)", flush=True)
    server(app, sock).run(sockets=[sock])
