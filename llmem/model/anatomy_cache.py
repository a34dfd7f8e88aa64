"""Where anatomies are read from instead of built: the catalog's shipped files (llmem/model/catalog/anatomies/, made
by `python -m llmem.model.catalog.build_anatomies`), and every other anatomy built once (a hub model, a model
folder, a reward model's scalar head, a peft model) kept in $LLMEM_CACHE_DIR/anatomies/<key>.json, the key a digest
of the config file's bytes, the model's name, the variant and the versions of torch, transformers and peft. Texts
only (llmem.model.anatomy reads and writes them): no torch here. LLMEM_ANATOMY_CACHE=off builds every anatomy from
the real classes, as before the files existed.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from llmem.cache import cache_root, code_versions
from llmem.model.catalog import catalog_file

ANATOMY_FORMAT = 1                            # bump when the files' layout changes: older cache files are not read
ANATOMY_CACHE_ENV = "LLMEM_ANATOMY_CACHE"     # "off": neither the shipped files nor the cache are read or written
SHIPPED_FOLDER = "anatomies"
Source = tuple[str, bytes, "str | None"]      # (display name, config file bytes, the bundled config's file name)


def anatomy_cache_on() -> bool:
    return os.environ.get(ANATOMY_CACHE_ENV, "").strip().lower() not in ("off", "0", "no", "false")


def config_digest(config_bytes: bytes) -> str:
    return hashlib.sha256(config_bytes).hexdigest()


def shipped_text(source: Source) -> str | None:
    """The text the catalog ships for a bundled config file (configs/ or tiny/), or None."""
    try:
        return catalog_file(SHIPPED_FOLDER, source[2]).decode("utf-8") if source[2] is not None else None
    except (OSError, UnicodeDecodeError):
        return None


def anatomy_key(source: Source, **variant: object) -> str:
    """The cache key of the anatomy built from `source`'s config as `variant` says (scalar_head, a peft config)."""
    name, config_bytes, _ = source
    key = {"format": ANATOMY_FORMAT, "name": name, "config_sha256": config_digest(config_bytes),
           "versions": code_versions(), **variant}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def _path(key: str) -> Path:
    return cache_root() / SHIPPED_FOLDER / f"{key}.json"


def cached_text(key: str) -> str | None:
    """The text kept under `key`, or None."""
    try:
        return _path(key).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def keep_text(key: str, text: str) -> None:
    """Write `text` under `key` atomically (a reader never sees half a file); nothing when the cache folder cannot
    be written (the next run builds the anatomy again)."""
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
