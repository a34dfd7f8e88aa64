"""The bundled model catalog: real `config.json` values of popular models, so llmem runs offline.

`models.json` lists each entry: its hub id, short aliases, the config file in `configs/`, and the parameter count the
model's publisher states (tests check that building the config on the meta device gives exactly that count).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources


@dataclass(frozen=True)
class CatalogEntry:
    hub_id: str
    config_file: str
    published_params: int
    aliases: tuple[str, ...] = ()
    source: str = ""


@cache
def catalog() -> dict[str, CatalogEntry]:
    """hub id -> entry, in file order."""
    raw = json.loads(resources.files(__package__).joinpath("models.json").read_text())
    return {
        item["id"]: CatalogEntry(item["id"], item["config"], int(item["published_params"]),
                                 tuple(item.get("aliases", ())), item.get("source", ""))
        for item in raw["models"]
    }


@cache
def _by_name() -> dict[str, CatalogEntry]:
    """Every name an entry answers to, lower-cased: its hub id, the part after the org, its aliases and theirs (the
    first entry in file order keeps a name two could share)."""
    index: dict[str, CatalogEntry] = {}
    for entry in catalog().values():
        for name in (entry.hub_id, *entry.aliases):
            index.setdefault(name.lower(), entry)
            index.setdefault(name.split("/")[-1].lower(), entry)
    return index


def find_entry(name: str) -> CatalogEntry | None:
    """Match a hub id, the part after the org, or an alias, case-insensitively."""
    return _by_name().get(name.strip().lower())


def tiny_names() -> list[str]:
    """The bundled small shapes (tiny/*.json), by name, sorted."""
    return sorted(p.name.removesuffix(".json") for p in resources.files(__package__).joinpath("tiny").iterdir()
                  if p.name.endswith(".json"))


def tiny_file(name: str) -> str | None:
    """The bundled file (in tiny/) of a small shape's name, or None: a name, never a path out of tiny/."""
    key = name.strip().lower()
    if not re.fullmatch(r"tiny-[a-z0-9_-]+", key):
        return None
    return f"{key}.json" if resources.files(__package__).joinpath("tiny", f"{key}.json").is_file() else None


def tiny_config_dict(name: str) -> dict | None:
    """Small shapes of real families (tiny-llama, tiny-mistral, tiny-qwen2, tiny-bloom; tiny-pythia, tiny-phi,
    tiny-qwen3 and the MoE tiny-qwen3-moe, tiny-gpt-oss, tiny-deepseek-v3 (8 experts, top-2): families without a hand
    recipe, whose activations are learned; the vision-language tiny-qwen2_5_vl) for fast validation."""
    file = tiny_file(name)
    return json.loads(catalog_file("tiny", file)) if file is not None else None


def load_config_dict(entry: CatalogEntry) -> dict:
    return json.loads(catalog_file("configs", entry.config_file))


def catalog_file(folder: str, name: str) -> bytes:
    """A bundled file's bytes (configs/, tiny/, anatomies/)."""
    return resources.files(__package__).joinpath(folder, name).read_bytes()
