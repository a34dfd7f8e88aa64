"""Loading a training config (YAML, JSON or TOML, told from the content when the extension does not say) and finding
the files it references (a DeepSpeed JSON): beside the referencing file, then in each folder above it (a framework's
examples name their configs from the repository root: axolotl's `deepspeed: deepspeed_configs/zero3.json`), then in
the working folder. A caller may confine the reads to some folders (`confined_to`: llmem serve reads only the
files a request uploaded): a path outside them is refused before anything is read, so that the refusal says nothing
of the file."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmem.errors import LlmemError

if sys.version_info >= (3, 11):
    import tomllib
else:                                   # pragma: no cover - Python 3.10
    import tomli as tomllib

CONFIG_MAX_BYTES = 4 << 20       # training configs are a few KiB
# Training configs nest a few levels (a DeepSpeed JSON's zero_optimization.offload_param.device: 3); the parsers
# recurse once per level (json, tomllib, PyYAML's composer), so a deeper document would end in a RecursionError
MAX_DEPTH = 64


@dataclass(frozen=True)
class Confinement:
    """The folders reads are confined to, and the refusal of a path outside them ({path}: the path as given)."""
    roots: tuple[Path, ...]
    refusal: str

    def allows(self, path: Path) -> bool:
        """`path` lies below a root, told from the names alone (nothing on disk is looked at)."""
        absolute = os.path.normpath(os.path.join(os.getcwd(), os.path.expanduser(str(path))))
        return any(absolute == str(r) or absolute.startswith(str(r).rstrip(os.sep) + os.sep) for r in self.roots)


_CONFINEMENT: ContextVar[Confinement | None] = ContextVar("llmem_read_confinement", default=None)


@contextmanager
def confined_to(roots: tuple[Path, ...], refusal: str) -> Iterator[None]:
    """Within the block, load() and find_reference() read only below `roots` (absolute, normalised folders)."""
    token = _CONFINEMENT.set(Confinement(tuple(Path(os.path.normpath(r)) for r in roots), refusal))
    try:
        yield
    finally:
        _CONFINEMENT.reset(token)


def _check_confined(path: str | os.PathLike) -> None:
    confinement = _CONFINEMENT.get()
    if confinement is not None and not confinement.allows(Path(path)):
        raise LlmemError(confinement.refusal.format(path=path))


def load(path: str | os.PathLike) -> tuple[Path, dict]:
    """The file's mapping (LlmemError naming the file when it cannot be read or parsed, or is not a mapping)."""
    _check_confined(path)
    p = Path(os.path.expanduser(str(path)))
    try:
        if p.is_dir():
            raise LlmemError(f"--from {path}: is a folder; give the training config file in it")
        if not p.is_file():
            raise LlmemError(f"--from {path}: no such file; give the path to a training config (axolotl, "
                             "LLaMA-Factory, TRL, torchtune, accelerate YAML, DeepSpeed JSON, torchtitan TOML)")
        if p.stat().st_size > CONFIG_MAX_BYTES:
            raise LlmemError(f"--from {path}: {p.stat().st_size:,} bytes is not a training config (those are a few "
                             "KiB); give the config file")
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise LlmemError(f"--from {path}: cannot read it ({exc.strerror or exc}); give a readable file") from None
    except UnicodeDecodeError as exc:
        raise LlmemError(f"--from {path}: not UTF-8 text (byte {exc.start}); give a YAML, JSON or TOML config") \
            from None
    data = parse(p, text)
    if not isinstance(data, dict) or not data:
        kind = "empty" if not data else f"a {type(data).__name__}, not a mapping of keys"
        raise LlmemError(f"{p}: the file is {kind}; expected a training config (keys such as base_model, "
                         "model_name_or_path, zero_optimization, distributed_type)")
    return p, data


def parse(p: Path, text: str) -> Any:
    """JSON, TOML or YAML by the extension, else by the content (JSON first: it is YAML too, but its errors read
    better as JSON's); a document nested deeper than MAX_DEPTH is refused."""
    try:
        data = _parse(p, text)
    except RecursionError:
        data = None
    else:
        if depth(data) <= MAX_DEPTH:
            return data
    raise LlmemError(f"{p}: nested more than {MAX_DEPTH} levels deep, which no training config is; give the "
                     "config file")


def depth(data: Any) -> int:
    """How many mappings and lists deep `data` nests (a scalar: 0), walked without recursion; each mapping or list
    walked once (YAML aliases share one)."""
    deepest, seen, todo = 0, set(), [(data, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, (dict, list)) and id(item) not in seen:
            seen.add(id(item))
            deepest = max(deepest, level)
            if deepest > MAX_DEPTH:
                return deepest
            todo += [(v, level + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


def _parse(p: Path, text: str) -> Any:
    ext = p.suffix.lower()
    if ext == ".toml" or (ext not in (".json", ".yaml", ".yml") and _looks_toml(text)):
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise LlmemError(f"{p}: not valid TOML ({exc}); fix the file") from None
    if ext == ".json" or text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            if ext == ".json":
                raise LlmemError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno}); fix the file") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise LlmemError(f"{p}: not valid YAML{where} ({getattr(exc, 'problem', None) or 'parse error'}); fix the "
                         "file") from None


def _looks_toml(text: str) -> bool:
    return any(line.strip().startswith("[") and line.strip().endswith("]") and "=" not in line
               for line in text.splitlines()[:200]) and "=" in text


def find_reference(ref: str, referrer: Path, key: str) -> Path:
    """The file `ref` names, beside `referrer`, in a folder above it, or in the working folder."""
    target = Path(os.path.expanduser(ref))
    if target.is_absolute():
        candidates = [target]
    else:
        candidates = [folder / target for folder in referrer.resolve().parents] + [Path.cwd() / target]
    confinement = _CONFINEMENT.get()
    if confinement is not None:           # the folders outside are not looked in: a refusal tells nothing of them
        candidates = [c for c in candidates if confinement.allows(c)]
        if not candidates:
            raise LlmemError(confinement.refusal.format(path=ref))
    for c in candidates:
        if c.is_file():
            return c
    raise LlmemError(f"{referrer}: {key} = {ref!r} not found (looked beside the file, in the folders above it and "
                     "in the working folder); give the path to the file, or copy it there")
