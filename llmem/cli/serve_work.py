"""What each endpoint of `llmem serve` computes, as one function of the request (`Work`) that a worker process runs:
the query read as the command line reads it (serve_query.py), then `llmem.estimate` / `llmem.plan`; the answer as
JSON bytes with its HTTP status (a refusal: 400 and one line). The request's uploads lie in its own folder, which the
reads of training configs are confined to; the caller removes the folder when the answer is sent."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llmem.cli.options import file_model, plan_options_from_args
from llmem.cli.serve_query import FROM_KEY, OUTSIDE_UPLOAD, PLAN_DROPS, LocalPaths, Query, sweep_points
from llmem.errors import LlmemError
from llmem.setup.sources.files import confined_to

log = logging.getLogger("llmem.serve")

ENDPOINTS = ("estimate", "sweep", "plan")


@dataclass(frozen=True)
class Work:
    """One request: the endpoint, the query's fields (name -> text), the uploaded training configs
    (NAME:BASE64URL), and a sweep's axis and points."""
    endpoint: str
    params: tuple[tuple[str, str], ...]
    training: tuple[str, ...] = ()
    axis: str = ""
    points: str | None = None

    def key(self) -> str:
        """The request's digest: equal requests, equal answers (the cache's key; uploads make a request long)."""
        text = json.dumps([self.endpoint, sorted(self.params), list(self.training), self.axis, self.points])
        return hashlib.sha256(text.encode()).hexdigest()

    def described(self) -> str:
        """The set-up in a few words, for a refusal that names what was too big."""
        given = dict(self.params)
        model = given.get("model") or ", ".join(t.rpartition(":")[0] for t in self.training) or "?"
        extra = [f"{k}={given[k]}" for k in ("gpus", "seq_len", "batch_size", "method") if given.get(k)]
        return " ".join([model, *extra])


def work_from_body(endpoint: str, body: Any, axis: str = "") -> Work:
    """The request's JSON body: {field: text, ..., "from": [NAME:BASE64URL, ...], "points": "1,2,4"}."""
    if not isinstance(body, dict):
        raise LlmemError("the request's body must be a JSON object {field: value}; reload the page")
    training = body.get(FROM_KEY, [])
    training = [training] if isinstance(training, str) else training
    params = {k: v for k, v in body.items() if k not in (FROM_KEY, "points")}
    if not isinstance(training, list) or not all(isinstance(t, str) for t in training) or \
            not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in params.values()):
        raise LlmemError("each field's value must be text (and `from` a list of NAME:BASE64URL); reload the page")
    points = body.get("points")
    return Work(endpoint, tuple((str(k), str(v)) for k, v in params.items()), tuple(training), axis,
                None if points is None else str(points))


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes


def refusal(status: int, text: str) -> Answer:
    return Answer(status, json.dumps({"error": one_line(text)}).encode())


def one_line(text: str) -> str:
    return " ".join(str(text).split()) or "error"


def perform(work: Work, folder: Path, paths: LocalPaths) -> Answer:
    """The request's answer, its uploads written in `folder` (which the caller creates empty and removes)."""
    try:
        with confined_to((folder,), OUTSIDE_UPLOAD):
            return Answer(200, _json(_COMPUTE[work.endpoint](work, Query(dict(work.params), folder,
                                                                         list(work.training), paths))))
    except LlmemError as exc:
        return refusal(400, str(exc))
    except RecursionError:                    # a document nested past what a parser can read, found elsewhere
        return refusal(400, "a file given is nested too deeply to read; give the config file itself")
    except Exception as exc:                  # the traceback goes to the server's log, one line to the page
        log.exception("llmem serve: %s failed", work.endpoint)
        return refusal(500, f"internal error: {type(exc).__name__}: {exc} (the server's log has the traceback)")


def _estimate(work: Work, q: Query) -> dict:
    import llmem
    from llmem.cli.tables import memory_title

    _, setup, source = q.setup("estimate")
    with q.named(), file_model(source):
        result = llmem.estimate(setup)
    return {"result": result.to_dict(), "command": q.command("estimate", setup, source),
            "title": [q.shown(t) for t in memory_title(result)], "setup": setup.to_dict(),
            "oom": result.oom.describe() if result.oom is not None else None, "from_file": q.record(source)}


def _sweep(work: Work, q: Query) -> dict:
    import llmem

    _, setup, source = q.setup("estimate")
    out = []
    for value in sweep_points(work.axis, setup, work.points):
        try:
            with q.named(), file_model(source):
                r = llmem.estimate(replace(setup, **{work.axis: value}))
        except LlmemError as exc:             # a point past what the set-up allows (too many tokens, positions)
            out.append({"value": value, "error": one_line(str(exc))})
            continue
        out.append({"value": value, "peak_allocated_bytes": r.peak_allocated_bytes,
                    "peak_reserved_bytes": r.peak_reserved_bytes, "device_used_bytes": r.device_used_bytes,
                    "fits": r.fits})
    return {"axis": work.axis, "value": getattr(setup, work.axis), "points": out}


def _plan(work: Work, q: Query) -> dict:
    import llmem
    from llmem.cli.tables import plan_title

    args, setup, source = q.setup("plan", drop=PLAN_DROPS)
    with q.named():
        # one process per plan: the server's plan lane bounds its processes and kills one past its time limit
        options = replace(plan_options_from_args(args, setup, source), workers=1)
    with q.named(), file_model(source):
        p = llmem.plan(setup, plan_options=options)
    return {"plan": p.to_dict(), "command": q.command("plan", setup, source, drop=PLAN_DROPS),
            "title": [q.shown(t) for t in plan_title(p)], "from_file": q.record(source)}


_COMPUTE = {"estimate": _estimate, "sweep": _sweep, "plan": _plan}


def _json(obj: Any) -> bytes:
    """JSON as the CLI's --json writes it, with nan / inf (which a browser's JSON.parse refuses) as null."""
    from llmem.cli.tables import to_json

    return json.dumps(_finite(json.loads(to_json(obj)))).encode()


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
