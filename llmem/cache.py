"""llmem's one cache folder on disk: $LLMEM_CACHE_DIR, else $XDG_CACHE_HOME/llmem, else ~/.cache/llmem. Learned
activations (llmem.memory.activations.learned) and the peft configs `--from FILE` writes (llmem.setup.sources) keep
their files in sub-folders of it, and so do the built anatomies (llmem.model.anatomy_cache)."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

CACHE_ENV = "LLMEM_CACHE_DIR"


def cache_root() -> Path:
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(os.path.expanduser(root))
    return Path(os.path.expanduser(os.environ.get("XDG_CACHE_HOME") or "~/.cache")) / "llmem"


def code_versions() -> dict[str, str]:
    """The versions of the code a cached result is built by (torch, transformers, peft): read once per process."""
    return dict(_code_versions())


@cache
def _code_versions() -> tuple[tuple[str, str], ...]:
    return tuple(installed_versions("torch", "transformers", "peft").items())


def installed_versions(*names: str) -> dict[str, str]:
    """The installed versions of packages ("" when one is not installed), read from their metadata without
    importing them: what a cached result built by their code is keyed by."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = ""
    return out
