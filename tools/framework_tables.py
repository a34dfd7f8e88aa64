"""What the framework-table generators share (tools/make_torchtune_builders.py, tools/make_torchtitan_flavors.py):
a framework's wheel fetched from PyPI without its dependencies and unpacked (its source is read, never imported),
the catalog model with a row's dimensions, and the command line that writes a table."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

# the dimensions a row must share with a catalog config to be that model (max_position_embeddings: a preference)
POSITIONS = "max_position_embeddings"


def catalog_match(dims: dict) -> str | None:
    """The first catalog model whose config has every dimension of `dims` (the positions table aside), preferring
    one whose max_position_embeddings agrees too; None: no catalog model has this architecture."""
    from llmem.model.catalog import catalog, load_config_dict

    shapes = [k for k in dims if k != POSITIONS]
    found = [e for e in catalog().values() if all(load_config_dict(e).get(k) == dims[k] for k in shapes)]
    same = [e for e in found if load_config_dict(e).get(POSITIONS) == dims.get(POSITIONS)]
    return (same or found)[0].hub_id if found else None


def with_matches(rows: dict[str, dict]) -> dict[str, dict]:
    return {name: {**row, "hub_id": catalog_match(row["dims"])} for name, row in rows.items()}


def unpacked(package: str, version: str, folder: Path) -> Path:
    """`package==version`'s wheel from PyPI (no dependencies), unpacked under `folder`."""
    subprocess.run([sys.executable, "-m", "pip", "download", f"{package}=={version}", "--no-deps", "-q", "-d",
                    str(folder)], check=True)
    with zipfile.ZipFile(next(folder.glob(f"{package}-*.whl"))) as z:
        z.extractall(folder / "src")
    return folder / "src"


def table(package: str, version: str, key: str, read: Callable[[Path], dict], source: Path | None) -> dict:
    """{package: version, key: rows}: read from `source` (an unpacked package), else from its downloaded wheel."""
    if source is not None:
        return {package: version, key: with_matches(read(source))}
    with tempfile.TemporaryDirectory() as tmp:
        return {package: version, key: with_matches(read(unpacked(package, version, Path(tmp))))}


def main(description: str, package: str, out: Path, make: Callable[[Path | None], dict]) -> int:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--source", type=Path, default=None, help=f"an unpacked {package} (default: download it)")
    args = parser.parse_args()
    out.write_text(json.dumps(make(args.source), indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")
    return 0
