"""Write (or check) the catalog's shipped anatomies: each bundled config (configs/ and tiny/) built on the meta device
by the installed transformers' real class and written to anatomies/<the config's file name>.

    python -m llmem.model.catalog.build_anatomies            # rewrite every file
    python -m llmem.model.catalog.build_anatomies --check    # exit 1 naming each file that differs from a fresh build
    python -m llmem.model.catalog.build_anatomies gpt2 tiny-llama     # only these (catalog names or tiny names)
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources

from llmem.cache import installed_versions
from llmem.model.anatomy import ModelAnatomy, anatomy_text, exact_round_trip, inventory, read_anatomy
from llmem.model.anatomy_cache import SHIPPED_FOLDER, config_digest, shipped_text
from llmem.model.catalog import catalog, tiny_names
from llmem.model.config import build_meta_model, config_source, resolve_config


def shipped_names() -> list[str]:
    """Every bundled model a file is shipped for: the catalog's hub ids, then the tiny shapes."""
    return [*catalog(), *tiny_names()]


def fresh_anatomy(model: str) -> tuple[ModelAnatomy, str, str]:
    """(the anatomy built from the real class, its text as shipped, the shipped file's name)."""
    name, config_bytes, config_file = config_source(model)
    built_name, cfg = resolve_config(model)
    anatomy = inventory(build_meta_model(cfg), built_name)
    made_with = {"config_sha256": config_digest(config_bytes), **installed_versions("torch", "transformers")}
    return anatomy, anatomy_text(anatomy, made_with), config_file


def differs(model: str) -> str | None:
    """Why the shipped file of `model` is not what a fresh build gives, or None when it is."""
    anatomy, _, config_file = fresh_anatomy(model)
    source = config_source(model)
    text = shipped_text(source)
    if read_anatomy(text, {"config_sha256": config_digest(source[1])}) is None:
        return f"{model}: {SHIPPED_FOLDER}/{config_file} is missing, or was made from another config"
    if not exact_round_trip(anatomy, text):
        return f"{model}: {SHIPPED_FOLDER}/{config_file} differs from a fresh build"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmem.model.catalog.build_anatomies",
                                     description="write or check the catalog's shipped anatomies")
    parser.add_argument("models", nargs="*", help="catalog or tiny names (default: all)")
    parser.add_argument("--check", action="store_true", help="compare with a fresh build, write nothing")
    args = parser.parse_args(argv)
    models = args.models or shipped_names()
    if args.check:
        problems = [p for p in map(differs, models) if p]
        print("\n".join(problems) or f"{len(models)} shipped anatomies match a fresh build")
        return 1 if problems else 0
    folder = resources.files("llmem.model.catalog").joinpath(SHIPPED_FOLDER)
    for model in models:
        anatomy, text, config_file = fresh_anatomy(model)
        assert exact_round_trip(anatomy, text), model
        with resources.as_file(folder) as path:
            path.mkdir(exist_ok=True)
            (path / config_file).write_text(text, encoding="utf-8")
    print(f"wrote {len(models)} anatomies to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
