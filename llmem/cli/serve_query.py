"""A page's query read as the command line reads its flags: the fields as `llmem estimate`'s options (its own
parser), an uploaded config.json and training configs written into the request's own folder (removed with the
request, serve_work.py), the uploads named by the user's file names in every answer and refusal, and the paths on
the server a query may name (none, unless llmem serve was given --allow-local-paths ROOT: then only below ROOT)."""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import os
import shlex
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from llmem.cli.options import (
    GROUP_TITLES,
    add_plan_options,
    add_training_options,
    option_flags,
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
from llmem.setup.sources.files import MAX_DEPTH, confined_to, depth, parse
from llmem.setup.training import (
    ADAPTER_DTYPES,
    LOGITS_DTYPES,
    MAX_BATCH_SIZE,
    MAX_SEQ_LEN,
    TrainingSetup,
    option_fields,
)

CONFIG_KEY = "config"                 # the query's uploaded config.json (base64url of its JSON)
MAX_CONFIG_BYTES = 1 << 20            # a config.json is a few KiB; anything near this is not one
FROM_KEY = "from"                     # each uploaded training config: NAME:BASE64URL, the key repeated per file
MAX_TRAINING_CONFIG_BYTES = 32 << 10   # training configs are a few KiB (the published ones: at most 4 KiB)
MAX_TRAINING_CONFIGS = 8              # a training config, the accelerate config it is launched with, their JSONs
OUTSIDE_UPLOAD = ("{path} is not among the uploaded files: choose it too, with the config that names it (the page "
                  "reads only the files it is given)")
MAX_REFERENCE_UPS = 4                 # a reference may climb this many folders ('../ds.json') inside the upload
# A request's body carries the uploads: room for every one at its limit (base64 adds a third), so that the app's own
# one-line refusal names the file that is too big
MAX_REQUEST_BYTES = 4 << 20
# The registries a field's value is one of (the page offers a list); a field without one gets a text box
CHOICES: dict[str, Any] = {"method": METHODS, "precision": PRECISIONS, "optimizer": OPTIMIZERS, "attn": ATTENTIONS,
                           "gpu": GPU_CATALOG, "adapter_dtype": ADAPTER_DTYPES, "logits_dtype": LOGITS_DTYPES}
# The sweeps' default points: powers of two around the usual sizes (the query's own value is added)
SWEEPS: dict[str, tuple[tuple[int, ...], int]] = {
    "batch_size": ((1, 2, 4, 8, 16, 32, 64), MAX_BATCH_SIZE),
    "seq_len": ((256, 512, 1024, 2048, 4096, 8192, 16384, 32768), MAX_SEQ_LEN),
}
MAX_SWEEP_POINTS = 16
# the page's bounds beyond any published model (405B: 126 decoder layers; DeepSeek-V3 61), so that no request builds
# a model only a plan of hours could search: the command line has none
MAX_PAGE_LAYERS = 512
MAX_PAGE_GPUS = 16384
# `llmem plan` on the page compares every method: the query's method and micro-batch are left to the search
PLAN_DROPS = ("method", "batch_size")
TRUE, FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no", "")


def _option(f):
    return f.metadata.get("option")


# ------------------------------------------------------------------------------------------------ the form


def form_schema() -> dict:
    """What the page builds its form from: every TrainingSetup field with an Option, in field order."""
    from llmem.model.catalog import catalog, tiny_names

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
    return {"fields": items, "groups": [[k, t] for k, t in GROUP_TITLES.items()], "models": tiny_names() + models,
            "sweeps": {axis: list(points) for axis, (points, _) in SWEEPS.items()}, "config_key": CONFIG_KEY,
            "from_key": FROM_KEY, "from_max_bytes": MAX_TRAINING_CONFIG_BYTES}


def _shown_value(opt) -> Any:
    """A value that makes option_flags write the field's flag (for the form's labels)."""
    return {"switch": True, "negate": False, "switches": opt.switches[0][1] if opt.switches else None}.get(
        opt.kind, "X")


# ------------------------------------------------------------------------------------------------ uploads


def _check_page_bounds(config: dict) -> None:
    """An uploaded config.json past the page's bounds (its decoder layers, under any name transformers' configs
    use for them): one line, the command line named for it."""
    from llmem.model.families import LAYERS_FIELDS

    layers = [config.get(k) for k in LAYERS_FIELDS if isinstance(config.get(k), int)]
    if layers and max(layers) > MAX_PAGE_LAYERS:
        raise LlmemError(f"the uploaded config has {max(layers):,} decoder layers; the page answers models of at "
                         f"most {MAX_PAGE_LAYERS} (every published one): run `llmem estimate` on the command line")


def _decoded(encoded: str, what: str) -> bytes:
    """base64url text (padding optional) as bytes."""
    try:
        return base64.b64decode(encoded + "=" * (-len(encoded) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise LlmemError(f"{what} is not base64url text: upload it again") from None


def _write(path: Path, raw: bytes) -> None:
    """`raw` at `path` (the request's own folder: no other request reads it)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
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
    """Training configs uploaded together, written side by side in the request's folder (their names as given) and
    again where another upload's relative reference looks for them."""
    folder: Path                        # every file written lies under it
    base: Path                          # the uploads under their names: `folder`, or a subfolder of it when a
    #                                     reference climbs ('../ds.json' lies in `folder`)
    read: tuple[Path, ...]              # the --from files: those no other upload references
    referenced: tuple[Path, ...]        # the others, which the reader finds by reference (read as --from if not)


def write_training(items: list[str], uploads: Path) -> TrainingUpload:
    """The `from` values written under `uploads` (the request's folder), and which of them are read as --from."""
    if len(items) > MAX_TRAINING_CONFIGS:
        raise LlmemError(f"{len(items)} training configs uploaded; give at most {MAX_TRAINING_CONFIGS} (a training "
                         "config, the accelerate config it is launched with, the DeepSpeed JSONs they name)")
    files = dict(_training_file(item) for item in items)
    if len(files) < len(items):
        raise LlmemError("two uploaded training configs have the same name: rename one (a config names the other "
                         "by its file name)")
    refs = {name: _references(name, raw, set(files)) for name, raw in files.items()}
    ups = max((_ups(r) for rs in refs.values() for r in rs), default=0)
    folder = uploads / "from"
    base = folder.joinpath(*["_"] * ups)
    for name, raw in files.items():
        _write(base / name, raw)
        for ref in refs[name]:
            if ref.parent != PurePosixPath("."):
                _write(Path(os.path.normpath(base / ref)), files[ref.name])
    referenced = {r.name for rs in refs.values() for r in rs}
    read = tuple(base / n for n in files if n not in referenced) or tuple(base / n for n in files)
    return TrainingUpload(folder, base, read, tuple(base / n for n in files if base / n not in read))


# ------------------------------------------------------------------------------------------------ a query


@dataclass(frozen=True)
class LocalPaths:
    """Which paths on the server a query may name (MODEL, --peft-config): none, or those below `roots`
    (--allow-local-paths), resolved from `cwd` (the server's working folder when it started). A path refused is
    refused before anything is looked at, so that the refusal tells nothing of the file."""
    roots: tuple[Path, ...] = ()        # resolved folders
    cwd: Path = Path("/")

    def model(self, model: str) -> str:
        """MODEL as the loader gets it: a catalog name or hub id as given (the workers' working folder is empty: no
        file answers to one), a path resolved (where allowed)."""
        return self.path("MODEL", model) if _path_like(model) or not _hub_id(model) else model

    def path(self, what: str, text: str) -> str:
        """A path the query names, resolved below a root, or refused in one line."""
        if self.roots:
            resolved = os.path.realpath(self.cwd / os.path.expanduser(text))
            if any(resolved == str(r) or resolved.startswith(str(r).rstrip(os.sep) + os.sep) for r in self.roots):
                return resolved
            raise LlmemError(f"{what} {text[:120]!r} lies outside the folders this server reads (llmem serve "
                             "--allow-local-paths): upload the file instead")
        raise LlmemError(f"{what} {text[:120]!r} names a path on the server, which this server does not read "
                         "(llmem serve --allow-local-paths ROOT allows the files below ROOT): upload the file "
                         "instead, or give a catalog name or hub id")


def _path_like(model: str) -> bool:
    """A MODEL that can only be a path (llmem.model.config reads it as one)."""
    return model.endswith(".json") or model.startswith(("/", ".", "~")) or "\\" in model or "\0" in model


def _hub_id(model: str) -> bool:
    """A catalog name or a hub id (org/name): no path parts of its own."""
    parts = model.split("/")
    return len(parts) <= 2 and all(p and p not in (".", "..") for p in parts)


def _check_remote_code(setup: TrainingSetup) -> None:
    """A hub model's own code (trust_remote_code: transformers imports the repository's configuration module) is
    never run by the server: the catalog's models, the tiny ones and uploaded configs need none."""
    from llmem.model.catalog import find_entry

    model = setup.model
    if setup.trust_remote_code and not (_path_like(model) or model.lower().startswith("tiny-") or find_entry(model)):
        raise LlmemError(f"trust_remote_code: this server runs no model's own code ({model[:80]} is not in llmem's "
                         "catalog); upload the model's config.json instead, or run llmem estimate on your machine")


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

    def __init__(self, params: dict[str, str], uploads: Path, training: list[str] | None = None,
                 paths: LocalPaths | None = None):
        self.params = dict(params)
        self.uploads = uploads
        self.paths = paths or LocalPaths()
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
        if self.params.get(CONFIG_KEY):
            self.model_path = self._upload(self.params[CONFIG_KEY])
        else:
            self.model_path = self.paths.model(self.model) if self.model else ""
        if self.params.get("peft_config", "").strip():
            self.params["peft_config"] = self.paths.path("peft_config", self.params["peft_config"].strip())

    def _upload(self, encoded: str) -> str:
        """The uploaded config.json, written in the request's folder: its path."""
        raw = _decoded(encoded, "the uploaded config")
        if len(raw) > MAX_CONFIG_BYTES:
            raise LlmemError(f"the uploaded config is {len(raw):,} bytes; a config.json is a few KiB: upload the "
                             "model's config.json")
        try:
            data = json.loads(raw)
            deep = depth(data) > MAX_DEPTH
        except RecursionError:
            data, deep = None, True
        except ValueError:
            data, deep = None, False
        if deep or not isinstance(data, dict):
            what = "nested too deeply" if deep else "not a JSON object"
            raise LlmemError(f"the uploaded file is {what}: upload the model's config.json")
        _check_page_bounds(data)
        path = self.uploads / "config" / "config.json"
        _write(path, raw)
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
        if str(out.get("gpus", "")).isdigit() and int(out["gpus"]) > MAX_PAGE_GPUS:
            raise LlmemError(f"gpus={out['gpus']}: the page plans at most {MAX_PAGE_GPUS:,} GPUs; run `llmem plan` on "
                             "the command line")
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
        with self.named(), self._reads_uploads_only():
            args = self.args(command, drop)
            setup, source = setup_and_source(args)
            unread = self._unread(source) if source is not None else ()
            if unread:                                           # a name in a value that is no reference: --from
                self.from_paths = (*self.from_paths, *unread)
                args = self.args(command, drop)
                setup, source = setup_and_source(args)
        _check_remote_code(setup)
        return args, setup, source

    def _unread(self, source: SourceRecord) -> tuple[Path, ...]:
        read = {os.path.normpath(p) for p, _ in source.files}
        return tuple(p for p in self.training.referenced if str(p) not in read
                     and not any(Path(r).name == p.name for r in read))

    def _reads_uploads_only(self):
        """What the files make llmem read lies in the upload (files.confined_to: the training configs' folder), so
        the answer is the link's, not the server's disk's."""
        return confined_to((self.training.folder,), OUTSIDE_UPLOAD) if self.training is not None else nullcontext()

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


