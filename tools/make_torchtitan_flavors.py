"""torchtitan's model flavors as data (llmem/setup/sources/torchtitan_flavors.json): each flavor's dimensions, read
from torchtitan's own source (`torchtitan/models/<name>/__init__.py`: the `<name>_configs` dict of flavor -> builder
function, each builder's local constants and the dimension keywords of the configs it returns, `hidden_dim` through
torchtitan's own compute_ffn_hidden_dim), with the catalog model that has the same dimensions, so the --from reader
maps `[model] name / flavor` without a hand list.

    python tools/make_torchtitan_flavors.py                      # downloads torchtitan's wheel from PyPI (no deps)
    python tools/make_torchtitan_flavors.py --source DIR         # an unpacked torchtitan (DIR/torchtitan/models)

tests/setup/sources/test_torchtitan_flavors.py checks every row against the catalog, and (slow) that a fresh read equals the
committed table."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import framework_tables  # noqa: E402  (the generators' shared parts)

OUT = Path(__file__).resolve().parents[1] / "llmem" / "setup" / "sources" / "torchtitan_flavors.json"
VERSION = "0.3.0"
# torchtitan's keywords -> the transformers config field of the same dimension (the first value met in a builder)
DIMS = {"vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
        "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "hidden_dim": "intermediate_size"}


def _helpers(root: Path) -> dict:
    """torchtitan's compute_ffn_hidden_dim, run from its own source (models/common/feed_forward.py)."""
    source = (root / "torchtitan" / "models" / "common" / "feed_forward.py").read_text()
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "compute_ffn_hidden_dim")
    scope: dict = {}
    exec(compile(ast.Module([fn], []), "feed_forward.py", "exec"), scope)   # a pure function of ints
    return {"compute_ffn_hidden_dim": scope["compute_ffn_hidden_dim"]}


def _value(node: ast.expr, names: dict):
    try:
        return eval(compile(ast.Expression(node), "<flavor>", "eval"), {"__builtins__": {}}, names)
    except Exception:        # noqa: BLE001 - an expression of names the builder does not define: not read
        return None


def flavor_dims(fn: ast.FunctionDef, helpers: dict) -> dict:
    names = dict(helpers)
    for stmt in fn.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            value = _value(stmt.value, names)
            if value is not None:
                names[stmt.targets[0].id] = value
    dims: dict = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            for k in node.keywords:
                if k.arg in DIMS and DIMS[k.arg] not in dims:
                    value = _value(k.value, names)
                    if isinstance(value, int) and not isinstance(value, bool):
                        dims[DIMS[k.arg]] = value
    return dims


def read_torchtitan(root: Path) -> dict[str, dict]:
    helpers, table = _helpers(root), {}
    for path in sorted((root / "torchtitan" / "models").glob("*/__init__.py")):
        tree = ast.parse(path.read_text())
        functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        for node in tree.body:
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                    and isinstance(node.targets[0], ast.Name) and node.targets[0].id.endswith("_configs")):
                continue
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(value, ast.Name) and value.id in functions:
                    dims = flavor_dims(functions[value.id], helpers)
                    if "num_hidden_layers" in dims and "hidden_size" in dims:
                        table[f"{path.parent.name}/{key.value}"] = {"dims": dict(sorted(dims.items()))}
    return table











def table(source: Path | None = None) -> dict:
    return framework_tables.table("torchtitan", VERSION, "flavors", read_torchtitan, source)


if __name__ == "__main__":
    sys.exit(framework_tables.main(__doc__.splitlines()[0], "torchtitan", OUT, table))
