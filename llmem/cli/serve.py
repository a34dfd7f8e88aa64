"""`llmem serve`: a local web page over the same API as the command line (a small FastAPI app, served by uvicorn).

The page (web/index.html: one file, vanilla JS, inline SVG charts, nothing fetched from elsewhere) asks for what
`llmem estimate` asks for: its form is built from the TrainingSetup fields' `Option`s (GET /api/form), as the
command line's flags are (options.py), so a new field appears on the page by itself. A query is the page's URL
query: one parameter per field name (`?model=gpt2&gpus=4&grad_ckpt=1`), `config` for an uploaded config.json
(base64url of its JSON, so that the link carries it), `from` for each uploaded training config (`NAME:BASE64URL`,
repeated for several files: the command line's `--from FILE`). The page posts that query as a JSON object to each
endpoint, which reads it with the command line's own parser and calls `llmem.estimate` / `llmem.plan`
(serve_query.py, serve_work.py): the page's answer is the CLI's answer, and the page shows the command line that
gives it. Refusals come back as {"error": one line} (400; 504 past the time limit, with what was too big).

    GET  /                      the page
    GET  /api/form              the fields, their groups and choices (GPUs, methods, ...), the models, the sweeps
    POST /api/estimate  QUERY   {"result": MemoryResult.to_dict(), "command", "title", "setup", "oom", "from_file"}
    POST /api/sweep/AXIS QUERY  the estimate at each batch size or sequence length (`points: "1,2,4"` to choose)
    POST /api/plan      QUERY   {"plan": Plan.to_dict(), "command", "title", "from_file"}: every method on the GPUs
                                given (under `from`, the file's method when it names one, as `llmem plan --from`)

"from_file" is the SourceRecord (`--json`'s "from_file": the keys each file set, those ignored and why), or null.
Safe to leave running: only the served address's Host and the page's own origin are answered (serve_guard.py), no
path on the server is read unless --allow-local-paths names its folder, each request's uploads live in its own
folder until its answer is sent, and the work runs in worker processes with a time limit each (serve_pool.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request  # module-level: FastAPI reads the endpoints' annotations from here
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException

from llmem.cli.serve_guard import Guard, Hosts
from llmem.cli.serve_pool import Cache, InlineLane, Lane, Place, Refused
from llmem.cli.serve_query import MAX_REQUEST_BYTES, LocalPaths, form_schema
from llmem.cli.serve_work import Answer, Work, one_line, refusal, work_from_body
from llmem.errors import LlmemError

log = logging.getLogger("llmem.serve")

DISCONNECT_POLL_S = 0.25


@dataclass(frozen=True)
class ServeOptions:
    """`llmem serve`'s options (the command line's flags of the same names)."""
    allow_hosts: tuple[str, ...] = ()           # Host names accepted besides the served address (a reverse proxy)
    allow_local_paths: tuple[str | Path, ...] = ()   # folders whose files a query may name (MODEL, --peft-config)
    workers: int = 2                            # processes for estimates and sweeps; 0: in this process (tests)
    plan_workers: int = 1                       # processes for plans
    estimate_timeout_s: float = 10.0            # an estimate's or a sweep's time limit, waiting included
    plan_timeout_s: float = 60.0
    cache_entries: int = 512                    # answers kept (a repeated request is answered from them)


TOO_BIG = {504: "the {what} of {setup} took longer than this server's {limit:g} s limit (llmem serve "
                "--{what}-timeout), so it was stopped: the set-up is too big to compute here; run the command line "
                "on your machine",
           503: "the server is busy with other {what}s (more than {limit:g} s waiting); try again in a moment",
           499: "the {what} was cancelled: its page left"}


def _too_big(refused: Refused, work: Work, limit_s: float) -> Answer:
    what = "plan" if work.endpoint == "plan" else "estimate"
    text = TOO_BIG.get(refused.status, "the {what}'s worker process was lost (the server is stopping?); try again")
    return refusal(refused.status if refused.status in TOO_BIG else 503,
                   text.format(what=what, setup=work.described(), limit=limit_s))


def make_app(uploads: Path | None = None, options: ServeOptions = ServeOptions(), hosts: Hosts | None = None):
    """The app behind its guard, and its worker processes (.state.lanes; .state.close() kills them). `uploads` holds
    the requests' folders while they run; `hosts` is the address served (None: only the allow_hosts names)."""
    uploads = Path(os.path.realpath(uploads or tempfile.mkdtemp(prefix="llmem-serve-")))
    uploads.mkdir(parents=True, exist_ok=True)
    # the workers' working folder: empty, so that no relative name answers to a file (in this process: the tests')
    empty = Path(tempfile.mkdtemp(prefix="llmem-serve-cwd-")) if options.workers > 0 else Path.cwd()
    place = Place(uploads, empty, LocalPaths(tuple(Path(os.path.realpath(r)) for r in options.allow_local_paths),
                                             Path.cwd()))
    if options.workers > 0:
        lanes = {"estimate": Lane("estimate", options.workers, place),
                 "plan": Lane("plan", max(options.plan_workers, 1), place)}
    else:
        lanes = dict.fromkeys(("estimate", "plan"), InlineLane(place))
    limits = {"estimate": options.estimate_timeout_s, "plan": options.plan_timeout_s}
    cache = Cache(options.cache_entries)
    threads = ThreadPoolExecutor(max_workers=64, thread_name_prefix="llmem-serve-wait")
    page = resources.files("llmem.cli").joinpath("web", "index.html").read_text(encoding="utf-8")
    app = FastAPI(title="llmem", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(LlmemError)
    async def refused(request: Request, exc: LlmemError):
        return JSONResponse({"error": one_line(str(exc))}, status_code=400)

    @app.exception_handler(HTTPException)
    async def http_refused(request: Request, exc: HTTPException):
        return JSONResponse({"error": one_line(f"{request.method} {request.url.path}: {exc.detail}")},
                            status_code=exc.status_code)

    async def run(request: Request, endpoint: str, axis: str = "") -> Response:
        work = work_from_body(endpoint, await _body(request), axis)
        key = work.key()          # a digest of the whole body, uploads included: made once
        answer = cache.get(key)
        if answer is None:
            lane = "plan" if endpoint == "plan" else "estimate"
            answer = await _answered(request, lanes[lane], work, limits[lane], threads)
            cache.put(key, answer)
        return Response(answer.body, status_code=answer.status, media_type="application/json")

    @app.get("/", response_class=HTMLResponse)
    def index():
        return page

    @app.get("/api/form")
    def form():
        return Response(json.dumps(form_schema()), media_type="application/json")

    @app.post("/api/estimate")
    async def estimate(request: Request):
        return await run(request, "estimate")

    @app.post("/api/sweep/{axis}")
    async def sweep(axis: str, request: Request):
        return await run(request, "sweep", axis)

    @app.post("/api/plan")
    async def plan(request: Request):
        return await run(request, "plan")

    def close() -> None:
        for lane in set(lanes.values()):
            lane.close()
        threads.shutdown(wait=False, cancel_futures=True)
        if options.workers > 0:
            shutil.rmtree(empty, ignore_errors=True)

    app.state.lanes, app.state.close, app.state.uploads = lanes, close, uploads
    return Guard(app, hosts or Hosts("127.0.0.1", 0, tuple(h.lower() for h in options.allow_hosts)))


async def _body(request: Request):
    """The request's JSON body, read to at most MAX_REQUEST_BYTES."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_REQUEST_BYTES:
            raise LlmemError(f"the request is over {MAX_REQUEST_BYTES:,} bytes; uploads are a few KiB each: upload "
                             "the config files themselves")
    try:
        return json.loads(raw or b"{}")
    except (ValueError, RecursionError):
        raise LlmemError("the request's body is not JSON: post the query as a JSON object, as the page does") \
            from None


async def _answered(request: Request, lane, work: Work, limit_s: float, threads: ThreadPoolExecutor) -> Answer:
    """The lane's answer, waited for without holding the event loop; the work cancelled when the client leaves."""
    cancelled = threading.Event()
    future = asyncio.get_running_loop().run_in_executor(threads, lane.run, work, limit_s, cancelled)
    try:
        while True:
            done, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL_S)
            if done:
                return future.result()
            if await request.is_disconnected():
                cancelled.set()
    except Refused as exc:
        return _too_big(exc, work, limit_s)
    finally:
        cancelled.set()


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


def hosts_of(sock: socket.socket, options: ServeOptions) -> Hosts:
    """The Host values the server on `sock` answers."""
    host, port = sock.getsockname()[:2]
    return Hosts(host, port, tuple(h.lower() for h in options.allow_hosts))


def server(app, sock: socket.socket):
    """A uvicorn server for `app` on `sock` (run it with .run(sockets=[sock]); .should_exit stops it). A stop
    (SIGTERM, Ctrl-C) kills the workers at once, waits a moment for the answers being sent, then returns (uvicorn
    would re-raise the signal, ending the process before serve() removes the uploads)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            super().handle_exit(sig, frame)
            close = getattr(app.state, "close", None)
            if close is not None:           # the work in flight stops now: its requests are answered at once
                close()

        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    # h11_max_incomplete_event_size: a shared link's URL carries its uploads (GET /?from=...); h11 refuses a request
    # line over 16 KiB by default
    return Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                 h11_max_incomplete_event_size=MAX_REQUEST_BYTES, timeout_graceful_shutdown=2))


def serve(host: str, port: int, options: ServeOptions = ServeOptions()) -> None:
    """`llmem serve`: the page on host:port until Ctrl-C or SIGTERM."""
    for root in options.allow_local_paths:
        if not Path(root).is_dir():
            raise LlmemError(f"--allow-local-paths {root}: no such folder; give the folders whose files the page "
                             "may name")
    sock = bind(host, port)
    app = make_app(options=options, hosts=hosts_of(sock, options))
    print(f"llmem serve: {url_of(sock)} (Ctrl-C to stop)", flush=True)
    try:
        server(app, sock).run(sockets=[sock])
    finally:
        app.state.close()
        shutil.rmtree(app.state.uploads, ignore_errors=True)
