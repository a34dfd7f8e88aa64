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

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import framework_tables  # noqa: E402  (the generators' shared parts)

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









def table(source: Path | None = None) -> dict:
    return framework_tables.table("torchtune", VERSION, "builders", read_torchtune, source)


if __name__ == "__main__":
    sys.exit(framework_tables.main(__doc__.splitlines()[0], "torchtune", OUT, table))
