"""`llmem serve`: a local web page over the same API as the command line (a small FastAPI app, served by uvicorn).

The page (web/index.html: one file, vanilla JS, inline SVG charts, nothing fetched from elsewhere) asks for what
`llmem estimate` asks for: its form is built from the TrainingSetup fields' `Option`s (GET /api/form), as the
command line's flags are (options.py), so a new field appears on the page by itself. A query is the page's URL
query: one parameter per field name (`?model=gpt2&gpus=4&grad_ckpt=1`), `config` for an uploaded config.json
(base64url of its JSON, so that the link carries it), `from` for each uploaded training config (`NAME:BASE64URL`,
repeated for several files: the command line's `--from FILE`). Each endpoint turns the query into the command line's
flags and reads them with the command line's own parser (`setup_and_source`, `plan_options_from_args`), then calls
`llmem.estimate` / `llmem.plan`: the page's answer is the CLI's answer, and the page shows the command line that gives
it (`setup_flags`; under `from`, the flags given and `--from NAME`). Refusals (LlmemError, argparse's usage errors)
come back as HTTP 400 {"error": one line}, with the uploads' names for the server's paths.

    GET /                      the page
    GET /api/form              the fields, their groups and choices (GPUs, methods, ...), the models, the sweeps
    GET /api/estimate?QUERY    {"result": MemoryResult.to_dict(), "command", "title", "setup", "oom", "from_file"}
    GET /api/sweep/AXIS?QUERY  the estimate at each batch size or sequence length (`points=1,2,4` to choose them)
    GET /api/plan?QUERY        {"plan": Plan.to_dict(), "command", "title", "from_file"}: every method on the GPUs
                               given (under `from`, the file's method when it names one, as `llmem plan --from`)

"from_file" is the SourceRecord (`--json`'s "from_file": the keys each file set, those ignored and why), or null.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import json
import logging
import math
import os
import shlex
import socket
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

from fastapi import FastAPI, Request  # module-level: FastAPI reads the endpoints' annotations from here
from fastapi.responses import HTMLResponse, JSONResponse, Response

from llmem.cli.options import (
    GROUP_TITLES,
    add_plan_options,
    add_training_options,
    file_model,
    option_flags,
    plan_options_from_args,
    setup_and_source,
    setup_flags,
)
from llmem.errors import LlmemError
from llmem.setup.attention import ATTENTIONS
from llmem.setup.gpus import GPU_CATALOG
from llmem.setup.methods import METHODS
from llmem.setup.optimizers import OPTIMIZERS
from llmem.setup.precision import PRECISIONS
from llmem.setup.sources import SourceRecord
from llmem.setup.sources.files import parse
from llmem.setup.training import (
    ADAPTER_DTYPES,
    MAX_BATCH_SIZE,
    MAX_SEQ_LEN,
    TrainingSetup,
    option_fields,
)

log = logging.getLogger("llmem.serve")

CONFIG_KEY = "config"                 # the query's uploaded config.json (base64url of its JSON)
MAX_CONFIG_BYTES = 1 << 20            # a config.json is a few KiB; anything near this is not one
FROM_KEY = "from"                     # each uploaded training config: NAME:BASE64URL, the key repeated per file
MAX_TRAINING_CONFIG_BYTES = 32 << 10   # training configs are a few KiB (the published ones: at most 4 KiB)
MAX_TRAINING_CONFIGS = 8              # a training config, the accelerate config it is launched with, their JSONs
MAX_REFERENCE_UPS = 4                 # a reference may climb this many folders ('../ds.json') inside the upload
# The request line carries the uploads: h11 (uvicorn's HTTP parser) refuses one over 16 KiB by default, before the
# app could answer; room for every upload at its limit, so that the app's own one-line refusal answers instead
MAX_REQUEST_BYTES = 8 << 20
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
    for f in option_fields():
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
            "sweeps": {axis: list(points) for axis, (points, _) in SWEEPS.items()}, "config_key": CONFIG_KEY,
            "from_key": FROM_KEY, "from_max_bytes": MAX_TRAINING_CONFIG_BYTES}


def _shown_value(opt) -> Any:
    """A value that makes option_flags write the field's flag (for the form's labels)."""
    return {"switch": True, "negate": False, "switches": opt.switches[0][1] if opt.switches else None}.get(
        opt.kind, "X")


# ------------------------------------------------------------------------------------------------ uploads


def _decoded(encoded: str, what: str) -> bytes:
    """base64url text (padding optional) as bytes."""
    try:
        return base64.b64decode(encoded + "=" * (-len(encoded) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise LlmemError(f"{what} is not base64url text: upload it again") from None


def _write_once(path: Path, raw: bytes) -> None:
    """`raw` at `path` unless it is there (a folder is named by its content): written whole, then renamed, so that
    a concurrent request never reads half a file."""
    if path.is_file():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        part.write_bytes(raw)
        os.replace(part, path)
    except OSError as exc:
        raise LlmemError(f"cannot write the upload {path.name} ({exc.strerror or exc}); upload the files again, "
                         "or restart llmem serve") from None


def _training_file(item: str) -> tuple[str, bytes]:
    """One `from` value, NAME:BASE64URL (base64url has no ':', so the last one separates), as (name, bytes)."""
    name, sep, encoded = item.rpartition(":")
    if not sep or not name:
        raise LlmemError(f"{FROM_KEY}={item[:40]!r}: give NAME:BASE64URL (the file's name, then its content)")
    if name in (".", "..") or any(c in name for c in "/\\\0") or len(name.encode()) > 255:
        raise LlmemError(f"{FROM_KEY}: {name[:60]!r} is not a file name; upload the training config again")
    raw = _decoded(encoded, f"the uploaded training config {name}")
    if len(raw) > MAX_TRAINING_CONFIG_BYTES:
        raise LlmemError(f"the uploaded {name} is {len(raw):,} bytes; a training config is a few KiB (at most "
                         f"{MAX_TRAINING_CONFIG_BYTES:,}): upload the config file")
    return name, raw


def _strings(data: Any) -> list[str]:
    """Every string value in a parsed config, each mapping or list walked once (YAML aliases share one: a file
    of nested aliases is small however many times they repeat)."""
    out, seen, todo = [], set(), [data]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            out.append(item.strip())
        elif isinstance(item, (dict, list)) and id(item) not in seen:
            seen.add(id(item))
            todo += list(item.values() if isinstance(item, dict) else item)
    return out


def _references(name: str, raw: bytes, names: set[str]) -> list[PurePosixPath]:
    """The relative paths in an uploaded config that end in another upload's name (`deepspeed:
    deepspeed_configs/zero3.json`, `deepspeed_config_file: ../ds.json`): where that upload must lie for the reader's
    lookup beside the file (files.find_reference) to find it. A file that does not parse has none (the reader names
    what is wrong with it)."""
    try:
        data = parse(Path(name), raw.decode("utf-8"))
    except (LlmemError, UnicodeDecodeError, ValueError, TypeError, RecursionError):
        return []
    out = []
    for text in _strings(data):
        ref = PurePosixPath(text)
        if ref.name not in names or ref.name == name or ref.is_absolute() or text.startswith("~") or "\\" in text:
            continue                        # a path the reader looks for elsewhere (~ is the server's home)
        if _ups(ref) <= MAX_REFERENCE_UPS and ".." not in ref.parts[_ups(ref):]:
            out.append(ref)
    return out


def _ups(ref: PurePosixPath) -> int:
    """How many folders a relative path climbs first ('../../ds.json': 2)."""
    n = 0
    while n < len(ref.parts) and ref.parts[n] == "..":
        n += 1
    return n


@dataclass(frozen=True)
class TrainingUpload:
    """Training configs uploaded together, written side by side under one folder per content (their names as given)
    and again where another upload's relative reference looks for them."""
    folder: Path                        # every file written lies under it
    base: Path                          # the uploads under their names: `folder`, or a subfolder of it when a
    #                                     reference climbs ('../ds.json' lies in `folder`)
    read: tuple[Path, ...]              # the --from files: those no other upload references
    referenced: tuple[Path, ...]        # the others, which the reader finds by reference (read as --from if not)


def write_training(items: list[str], uploads: Path) -> TrainingUpload:
    """The `from` values written under `uploads` (once per content), and which of them are read as --from."""
    if len(items) > MAX_TRAINING_CONFIGS:
        raise LlmemError(f"{len(items)} training configs uploaded; give at most {MAX_TRAINING_CONFIGS} (a training "
                         "config, the accelerate config it is launched with, the DeepSpeed JSONs they name)")
    files = dict(_training_file(item) for item in items)
    if len(files) < len(items):
        raise LlmemError("two uploaded training configs have the same name: rename one (a config names the other "
                         "by its file name)")
    refs = {name: _references(name, raw, set(files)) for name, raw in files.items()}
    ups = max((_ups(r) for rs in refs.values() for r in rs), default=0)
    digest = hashlib.sha256()
    for name, raw in sorted(files.items()):
        digest.update(hashlib.sha256(name.encode()).digest() + hashlib.sha256(raw).digest())
    folder = uploads / f"from-{digest.hexdigest()[:16]}"
    base = folder.joinpath(*["_"] * ups)
    for name, raw in files.items():
        _write_once(base / name, raw)
        for ref in refs[name]:
            if ref.parent != PurePosixPath("."):
                _write_once(Path(os.path.normpath(base / ref)), files[ref.name])
    referenced = {r.name for rs in refs.values() for r in rs}
    read = tuple(base / n for n in files if n not in referenced) or tuple(base / n for n in files)
    return TrainingUpload(folder, base, read, tuple(base / n for n in files if base / n not in read))


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
    """A page's query (name -> text, and the `from` values) read as the command line reads flags, an uploaded
    config.json written where the model loader can read it, uploaded training configs where --from can."""

    def __init__(self, params: dict[str, str], uploads: Path, training: list[str] | None = None):
        self.params = dict(params)
        self.uploads = uploads
        known = {f.name for f in option_fields() if _option(f) is not None} | {CONFIG_KEY}
        unknown = sorted(set(self.params) - known)
        if unknown:
            names = ", ".join(sorted(known | {FROM_KEY}))
            raise LlmemError(f"unknown query field {unknown[0]!r}: the fields are {names}")
        self.training = write_training(training, uploads) if training else None
        self.from_paths = self.training.read if self.training else ()
        self.model = self.params.get("model", "").strip()
        if not self.model and self.training is None:
            raise LlmemError("no model: give a catalog name (`llmem models`), a hub id, or upload a config.json "
                             "or a training config that names it")
        self.model_path = self._upload(self.params[CONFIG_KEY]) if self.params.get(CONFIG_KEY) else self.model

    def _upload(self, encoded: str) -> str:
        """The uploaded config.json, written once per content under `uploads`: its path."""
        raw = _decoded(encoded, "the uploaded config")
        if len(raw) > MAX_CONFIG_BYTES:
            raise LlmemError(f"the uploaded config is {len(raw):,} bytes; a config.json is a few KiB: upload the "
                             "model's config.json")
        try:
            if not isinstance(json.loads(raw), dict):
                raise ValueError
        except ValueError:
            raise LlmemError("the uploaded file is not a JSON object: upload the model's config.json") from None
        path = self.uploads / hashlib.sha256(raw).hexdigest()[:16] / "config.json"
        _write_once(path, raw)
        return str(path)

    def values(self, drop: tuple[str, ...] = ()) -> dict[str, Any]:
        """The fields given, switches as booleans, the rest as text (the parser types and checks them)."""
        out: dict[str, Any] = {}
        for f in option_fields():
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
        return _parser(command).parse_args([*option_flags(self.values(drop), attached=True),
                                            *(f"--from={p}" for p in self.from_paths),
                                            *(["--", self.model_path] if self.model else [])])

    def setup(self, command: str, drop: tuple[str, ...] = ()) -> tuple[argparse.Namespace, TrainingSetup,
                                                                      SourceRecord | None]:
        """The parsed query, its set-up and, under `from`, how the files were read (the fields given override
        theirs, as the command line's flags do)."""
        with self.named():
            args = self.args(command, drop)
            setup, source = setup_and_source(args)
            if source is not None and self._unread(source):      # a name in a value that is no reference: --from
                self.from_paths = (*self.from_paths, *self._unread(source))
                args = self.args(command, drop)
                setup, source = setup_and_source(args)
            if source is not None:
                self._check_read(source)
        return args, setup, source

    def _unread(self, source: SourceRecord) -> tuple[Path, ...]:
        read = {os.path.normpath(p) for p, _ in source.files}
        return tuple(p for p in self.training.referenced if str(p) not in read
                     and not any(Path(r).name == p.name for r in read))

    def _check_read(self, source: SourceRecord) -> None:
        """What the files made llmem read lies in the upload: the answer is the link's, not the server's disk's."""
        inside = str(self.training.folder) + os.sep
        for path, _ in source.files:
            if not os.path.normpath(path).startswith(inside):
                raise LlmemError(f"{self.shown(path)} is not among the uploaded files: choose it too, with the config "
                                 "that names it (the page reads only the files it is given)")

    def command(self, command: str, setup: TrainingSetup, source: SourceRecord | None = None,
                drop: tuple[str, ...] = ()) -> str:
        """The command line that gives `setup`'s answer, the uploaded files named as the user's files: the set-up's
        flags, or under `from` the fields given and --from per file read."""
        if source is None:
            argv = setup_flags(setup)
            argv[0] = self.model
        else:
            argv = [*([self.model] if self.model else []), *option_flags(self.values(drop))]
            argv += [a for p in self.from_paths for a in ("--from", p.name)]
        return shlex.join(["llmem", command, *argv])

    def shown(self, text: str) -> str:
        """A text naming the uploads' paths, with the user's file names instead (a referenced upload by the path
        its referrer gives: deepspeed_configs/zero3.json)."""
        if self.model_path != self.model:
            text = text.replace(self.model_path, self.model)
        if self.training is not None:
            for folder in (self.training.base, self.training.folder):
                text = text.replace(str(folder) + os.sep, "")
        return text

    def shown_all(self, obj: Any) -> Any:
        """shown() over every string of a JSON-like value (a SourceRecord's to_dict)."""
        if isinstance(obj, str):
            return self.shown(obj)
        if isinstance(obj, dict):
            return {k: self.shown_all(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.shown_all(v) for v in obj]
        return obj

    def record(self, source: SourceRecord | None) -> dict | None:
        return self.shown_all(source.to_dict()) if source is not None else None

    @contextmanager
    def named(self) -> Iterator[None]:
        """Refusals naming the uploads by the user's file names."""
        try:
            yield
        except LlmemError as exc:
            text = self.shown(str(exc))
            if self.training is not None and " not found (looked beside the file" in text:   # files.find_reference
                text += "; on this page: choose that file too (with the config, or after it)"
            raise LlmemError(text) from None


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

    # resolved: the readers name a referenced file by its resolved folder (files.find_reference)
    uploads = (uploads or Path(tempfile.mkdtemp(prefix="llmem-serve-"))).resolve()
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
        params = {k: v for k, v in request.query_params.items() if k not in extra and k != FROM_KEY}
        return Query(params, uploads, request.query_params.getlist(FROM_KEY))

    @app.get("/", response_class=HTMLResponse)
    def index():
        return page

    @app.get("/api/form")
    def form():
        return answer(form_schema())

    @app.get("/api/estimate")
    def estimate(request: Request):
        q = query(request)
        _, setup, source = q.setup("estimate")
        with lock, q.named(), file_model(source):
            result = llmem.estimate(setup)
        return answer({"result": result.to_dict(), "command": q.command("estimate", setup, source),
                       "title": [q.shown(t) for t in memory_title(result)], "setup": setup.to_dict(),
                       "oom": result.oom.describe() if result.oom is not None else None,
                       "from_file": q.record(source)})

    @app.get("/api/sweep/{axis}")
    def sweep(axis: str, request: Request):
        q = query(request, "points")
        _, setup, source = q.setup("estimate")
        out = []
        for value in sweep_points(axis, setup, request.query_params.get("points")):
            try:
                with lock, q.named(), file_model(source):
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
        args, setup, source = q.setup("plan", drop=PLAN_DROPS)
        with q.named():
            options = plan_options_from_args(args, setup, source)
        with lock, q.named(), file_model(source):
            p = llmem.plan(setup, plan_options=options)
        return answer({"plan": p.to_dict(), "command": q.command("plan", setup, source, drop=PLAN_DROPS),
                       "title": [q.shown(t) for t in plan_title(p)], "from_file": q.record(source)})

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

    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                         h11_max_incomplete_event_size=MAX_REQUEST_BYTES))


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
