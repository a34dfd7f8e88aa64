"""Variants are decided by their registry rows, not by their names: no module compares a set-up's quantised base,
objective or attention kernel with a string (`setup.quant_base == "nf4"`, `objective != "sft"`, `attn in ("sdpa",
...)`) outside the registries that define them (llmem.setup.quant_bases, .objectives, .generation, .attention), the
`--from` readers' mapping tables (llmem.setup.sources) and the validation matrices' rows and their names
(llmem.validate.matrices, .labels).
Code asks the row instead: `setup.quant_spec.quantised`, `setup.objective_spec.runs_trainer`,
`setup.attention_spec.keeps_scores`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llmem"
VARIANT_FIELDS = ("quant_base", "objective", "attn", "ckpt_offload")      # TrainingSetup's fields named by registry rows
# where the names belong: the registries themselves, the readers' mapping tables, the matrices' rows
HOMES = ("llmem/setup/quant_bases.py", "llmem/setup/objectives.py", "llmem/setup/generation.py",
         "llmem/setup/attention.py", "llmem/setup/checkpointing.py", "llmem/setup/sources/", "llmem/validate/matrices.py", "llmem/validate/labels.py")
ALLOWED: tuple[str, ...] = ()    # modules allowed a check by name (none: every check reads its row)


def _names_variant(node: ast.AST) -> str | None:
    """The variant field an expression reads (`setup.attn`, `objective`, `values.get("quant_base", ...)`)."""
    if isinstance(node, ast.Attribute) and node.attr in VARIANT_FIELDS:
        return node.attr
    if isinstance(node, ast.Name) and node.id in VARIANT_FIELDS:
        return node.id
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
            and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in VARIANT_FIELDS:
        return node.args[0].value
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in VARIANT_FIELDS:
        return node.slice.value
    return None


def _is_string(node: ast.AST) -> bool:
    """A string literal, or a tuple / list / set of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)
    return False


def string_checks(source: str) -> list[tuple[int, str]]:
    """(line, field) of every comparison of a variant field with a string literal, and of every dict literal looked
    up by one (`{"nf4": 0.5}.get(setup.quant_base)`, `{"nf4": 0.5}[setup.quant_base]`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, sides[:-1], sides[1:], strict=True):
                if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                    continue
                for a, b in ((left, right), (right, left)):
                    name = _names_variant(a)
                    if name and _is_string(b):
                        found.append((node.lineno, name))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and isinstance(node.func.value, ast.Dict) and node.args:
            name = _names_variant(node.args[0])
            if name:
                found.append((node.lineno, name))
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict):
            name = _names_variant(node.slice)          # {"nf4": ..., "int8": ...}[q.name] / [setup.quant_base]
            if name:
                found.append((node.lineno, name))
    return found


def _module_checks() -> dict[str, list[tuple[int, str]]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(HOMES):
            continue
        found = string_checks(path.read_text())
        if found:
            out[rel] = found
    return out


def test_no_variant_decided_by_its_name_outside_the_registries():
    offences = [f"{rel}:{line}: {name} compared with a string (ask the row: quant_spec, objective_spec, "
                f"attention_spec)" for rel, found in _module_checks().items() if rel not in ALLOWED
                for line, name in found]
    assert not offences, "\n".join(offences)


def test_the_scan_finds_each_form_of_check():
    forms = ['if setup.quant_base == "nf4": pass',
             'if s.objective != "sft": pass',
             'x = attn in ("sdpa", "eager")',
             'x = "flash" == setup.attn',
             'x = objective not in ["dpo"]',
             'x = values.get("quant_base", "none") != "none"',
             'x = {"nf4": 0.5, "int8": 1}.get(setup.quant_base, 2)',
             'x = {"nf4": "NF4", "int8": "LLM.int8"}[setup.quant_base]',
             'x = a < b == setup.attn == "eager"']
    for form in forms:
        assert len(string_checks(form)) == 1, form
    allowed = ['x = setup.quant_spec.quantised', 'x = setup.attn != DEFAULT_LABEL.attn',
               'x = TrainingSetup("m", quant_base="nf4")', 'x = setup.objective in GENERATION_DEFAULTS',
               'x = spec.name == "sft"', 'x = {"nf4": 1}[name]']
    for form in allowed:
        assert not string_checks(form), form


def test_every_quantised_base_has_a_storage_row_and_an_emulation():
    from llmem.memory.quant import QUANT_LAYOUTS
    from llmem.runtime.quant_kernels import EMULATIONS
    from llmem.setup.quant_bases import QUANT_BASES, QUANTISED

    assert set(QUANTISED) == set(QUANT_LAYOUTS) == set(EMULATIONS) == {"nf4", "int8", "torchao-nf4"}
    for name in QUANTISED:
        spec, layout = QUANT_BASES[name], QUANT_LAYOUTS[name]
        assert spec.flag.startswith("--") and spec.library in ("bitsandbytes", "torchao")
        assert spec.fsdp_shards == (layout.sharded > 0)      # the set-up's support rule, the storage's shards
    assert not QUANT_BASES["none"].quantised and not QUANT_BASES["none"].flag


def test_attention_rows_point_at_rows():
    from llmem.setup.attention import ATTENTIONS

    for spec in ATTENTIONS.values():
        assert spec.recipe in ATTENTIONS and spec.without_sdpa in ATTENTIONS
        assert not ATTENTIONS[spec.recipe].flash_kernel            # the recipes model sdpa and eager only
        assert not (spec.keeps_scores and spec.calls_torch_sdpa)
        assert spec.packing_note
