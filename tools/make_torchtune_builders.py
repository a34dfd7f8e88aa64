"""torchtune's model builders as data (llmem/setup/sources/torchtune_builders.json): each builder's dimensions, read
from torchtune's own source (`torchtune/models/<family>/_model_builders.py`: every `def <builder>()` returning
`<component>(vocab_size=..., num_layers=..., ...)` with literal arguments), so the --from reader maps a recipe's
`model._component_` to the catalog model of the same architecture (matched here by its dimensions: `hub_id`)
without a hand list of names.

    python tools/make_torchtune_builders.py                       # downloads torchtune's wheel from PyPI (no deps)
    python tools/make_torchtune_builders.py --source DIR          # an unpacked torchtune (DIR/torchtune/models)

tests/setup/sources/test_torchtune_builders.py checks every row against the catalog, and (slow) that a fresh read equals the
committed table."""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "llmem" / "setup" / "sources" / "torchtune_builders.json"
VERSION = "0.6.1"
# torchtune's argument names -> the transformers config field of the same dimension
DIMS = {"vocab_size": "vocab_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
        "num_kv_heads": "num_key_value_heads", "embed_dim": "hidden_size", "intermediate_dim": "intermediate_size",
        "max_seq_len": "max_position_embeddings"}


def _literal(node: ast.expr):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def builders_of(source: str) -> dict[str, dict]:
    """builder name -> {component, dims} of each argument-free builder returning a component call."""
    out = {}
    for fn in ast.parse(source).body:
        if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_") or \
                len(fn.args.defaults) != len(fn.args.args):      # arguments with defaults only
            continue
        ret = next((s for s in fn.body if isinstance(s, ast.Return)), None)
        if ret is None or not isinstance(ret.value, ast.Call) or not isinstance(ret.value.func, ast.Name):
            continue
        kwargs = {k.arg: _literal(k.value) for k in ret.value.keywords if k.arg in DIMS}
        if "num_layers" in kwargs and "embed_dim" in kwargs:
            out[fn.name] = {"component": ret.value.func.id,
                            "dims": {DIMS[k]: v for k, v in sorted(kwargs.items()) if isinstance(v, int)}}
    return out


def aliases_of(source: str) -> dict[str, str]:
    """`new = old` assignments of one builder to another (llama3_3_70b = llama3_1_70b)."""
    return {node.targets[0].id: node.value.id for node in ast.parse(source).body
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Name)}


def read_torchtune(root: Path) -> dict[str, dict]:
    table, aliases = {}, {}
    for path in sorted((root / "torchtune" / "models").glob("*/_model_builders.py")):
        source = path.read_text()
        for name, row in builders_of(source).items():
            table[name] = {"family": path.parent.name, **row}
        aliases.update({new: (old, path.parent.name) for new, old in aliases_of(source).items()})
    for new, (old, family) in aliases.items():
        if old in table and new not in table:
            table[new] = {**table[old], "family": family}
    return table


def _downloaded(folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", f"torchtune=={VERSION}", "--no-deps", "-q", "-d",
                    str(folder)], check=True)
    wheel = next(folder.glob("torchtune-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(folder / "src")
    return folder / "src"


def catalog_match(dims: dict) -> str | None:
    """The first catalog model whose config has every dimension of `dims` (the positions table aside), preferring
    one whose max_position_embeddings agrees too; None: no catalog model has this architecture."""
    from llmem.model.catalog import catalog, load_config_dict

    shapes = [k for k in dims if k != "max_position_embeddings"]
    found = [e for e in catalog().values()
             if all(load_config_dict(e).get(k) == dims[k] for k in shapes)]
    same = [e for e in found if load_config_dict(e).get("max_position_embeddings") == dims.get("max_position_embeddings")]
    return (same or found)[0].hub_id if found else None


def with_matches(builders: dict[str, dict]) -> dict[str, dict]:
    return {name: {**row, "hub_id": catalog_match(row["dims"])} for name, row in builders.items()}


def table(source: Path | None = None) -> dict:
    if source is not None:
        return {"torchtune": VERSION, "builders": with_matches(read_torchtune(source))}
    with tempfile.TemporaryDirectory() as tmp:
        return {"torchtune": VERSION, "builders": with_matches(read_torchtune(_downloaded(Path(tmp))))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=None, help="an unpacked torchtune (default: download it)")
    args = parser.parse_args()
    OUT.write_text(json.dumps(table(args.source), indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
