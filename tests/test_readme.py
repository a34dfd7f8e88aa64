"""The README's commands, run: each example exits as the README shows (0: it shows an answer) and prints its sample
output, numbers included (the table borders, column widths and line wrapping aside: a sample line must appear as the
same run of words, in the order shown; "..." marks a cut). So the examples and their outputs cannot go stale.

Covered: every `$ llmem ...` example of README.md and of docs/plan.md's "When nothing fits", the README's other
`llmem` lines (run, exit 0), the figures its prose gives for a variant of an example, and its Python snippet. Not
run: the set-up commands (make, source); `.venv/bin/llmem` is run as `llmem` (the same entry point, llmem.cli:main).
A `| jq '{a, b}'` after a command picks those keys of its JSON, as jq would."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmem.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/plan.md")
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)
BOX = re.compile(r"[\u2500-\u257f]")          # rich's table borders
CUT = "..."
SET_UP = ("make ", "source ")
WIDTH = 110                                    # the README's samples were printed at about this many columns
# the examples that take over 10 s on a 2-core machine: the trace of gpt2 at seq 512 (20 s; the plans of the 8B model
# take 2-6 s once the catalog's anatomy is built)
SLOW = ("llmem trace ",)


@dataclass(frozen=True)
class Example:
    page: str
    command: str                 # as shown, continuation lines joined
    sample: tuple[str, ...]      # the lines shown under it (empty: none shown)

    @property
    def id(self) -> str:
        return f"{self.page}: {self.command[:70]}"


def _examples(page: str) -> list[Example]:
    out: list[Example] = []
    for block in FENCE.findall((ROOT / page).read_text()):
        lines = block.splitlines()
        if not any(line.startswith("$ ") for line in lines):        # a list of commands, no output shown
            out += [Example(page, line.split("  #")[0].strip(), ()) for line in lines
                    if line.split()[:1] and line.split()[0].endswith("llmem")]
            continue
        i = 0
        while i < len(lines):
            if not lines[i].startswith("$ "):
                i += 1
                continue
            command = lines[i][2:]
            while command.endswith("\\"):
                i += 1
                command = command[:-1].rstrip() + " " + lines[i].strip()
            j = i + 1
            while j < len(lines) and not lines[j].startswith("$ "):
                j += 1
            out.append(Example(page, command, tuple(lines[i + 1:j])))
            i = j
    return out


EXAMPLES = [e for page in PAGES for e in _examples(page)]


def _words(text: str) -> list[str]:
    return BOX.sub(" ", text).split()


def _jq(filter_: str, text: str) -> str:
    """jq's `{a, b}`: the object of those keys."""
    keys = [k.strip() for k in filter_.strip().removeprefix("{").removesuffix("}").split(",")]
    doc = json.loads(text)
    return json.dumps({k: doc[k] for k in keys}, indent=2)


def run(command: str, capsys, monkeypatch) -> tuple[int, str]:
    """The command line run as the shell would (in the checkout, offline, at WIDTH columns): exit code, stdout."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    command, _, jq = command.partition(" | jq ")
    argv = shlex.split(command)
    assert Path(argv[0]).name == "llmem", argv
    capsys.readouterr()
    code = main(argv[1:])
    out = capsys.readouterr().out
    return code, _jq(shlex.split(jq)[0], out) if jq else out


def check_sample(sample: tuple[str, ...], out: str) -> None:
    """Each shown line's words appear, as one run, in the output's words, in the order shown."""
    words = _words(out)
    at = 0
    for line in sample:
        want = _words(line)
        if not want or line.strip() == CUT:
            continue
        if want[-1] == CUT:          # a line cut short
            want = want[:-1]
        hit = next((k for k in range(at, len(words) - len(want) + 1) if words[k:k + len(want)] == want), None)
        assert hit is not None, f"not in the output (after word {at}): {line!r}\n--- output ---\n{out}"
        at = hit + len(want)


def _param(e: Example):
    slow = any(e.command.startswith(s) for s in SLOW)
    return pytest.param(e, id=e.id, marks=pytest.mark.slow if slow else ())


def test_the_pages_have_their_examples():
    """The parser finds what the pages show (a parse that found nothing would check nothing)."""
    readme = [e for e in EXAMPLES if e.page == "README.md"]
    assert sum(bool(e.sample) for e in readme) == 5 and len(readme) >= 9
    assert any(e.sample and e.command.startswith("llmem plan") for e in EXAMPLES if e.page == "docs/plan.md")
    assert not [e for e in EXAMPLES if e.command.startswith(SET_UP)]


@pytest.mark.parametrize("example", [_param(e) for e in EXAMPLES])
def test_example_exits_and_prints_as_shown(example, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)                 # files a command writes (--plot) land here
    (tmp_path / "docs").symlink_to(ROOT / "docs")     # and the ones it reads are found as in the checkout
    code, out = run(example.command, capsys, monkeypatch)
    assert code == 0, (example.command, out)
    check_sample(example.sample, out)


# the README's prose about a variant of an example: (its words, the variant's command, the counter and figure)
PROSE = [
    ("The same with `--precision bf16` and no `--qlora` (plain LoRA) reserves 20.58 GiB.",
     "llmem estimate meta-llama/Llama-3.1-8B --gpu RTX4090 --seq-len 2048 --precision bf16 --lora-rank 16 "
     "--lora-targets all-linear --grad-ckpt", "peak_reserved", "20.58 GiB", True),
    ("Without `--fused-ce` it does not fit: 30.04 GiB reserved",
     "llmem estimate --from docs/examples/axolotl-qlora.yml --gpu RTX4090", "peak_reserved", "30.04 GiB", False),
]


@pytest.mark.parametrize("words, command, counter, figure, fits", PROSE, ids=["lora-bf16", "without-fused-ce"])
def test_prose_figures_are_the_commands(words, command, counter, figure, fits, capsys, monkeypatch):
    assert words in " ".join((ROOT / "README.md").read_text().split())
    monkeypatch.chdir(ROOT)
    code, out = run(command + " --json", capsys, monkeypatch)
    result = json.loads(out)
    assert code == 0 and result["fits"] is fits
    gib = result[f"{counter}_bytes"] / 2**30
    assert f"{gib:.2f} GiB" == figure


def test_the_ci_matrix_and_its_sample_are_as_large_as_the_readme_says():
    from llmem.validate.matrices import MATRICES

    text = " ".join((ROOT / "README.md").read_text().split())
    assert f"The CI matrix holds {len(MATRICES['ci'])} set-ups" in text
    assert f"checks a covering sample of {len(MATRICES['ci-sample'])} of them" in text


def test_python_snippet_runs():
    block = next(b for b in FENCE.findall((ROOT / "README.md").read_text()) if b.startswith("import llmem"))
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)          # noqa: S102 - the README's own snippet
    r = scope["r"]
    assert r.peak_reserved_bytes >= r.peak_allocated_bytes > 0 and isinstance(r.fits, bool)


def test_a_changed_figure_or_order_is_caught(capsys, monkeypatch):
    """The comparison fails on one digit changed, and on two shown lines swapped."""
    example = next(e for e in EXAMPLES if "--method fsdp" in e.command and e.sample and "jq" not in e.command)
    _, out = run(example.command, capsys, monkeypatch)
    check_sample(example.sample, out)
    changed = tuple(line.replace("53.06 GiB", "53.07 GiB") for line in example.sample)
    assert changed != example.sample
    with pytest.raises(AssertionError, match="53.07 GiB"):
        check_sample(changed, out)
    with pytest.raises(AssertionError, match="weights"):
        check_sample(example.sample[1:2] + example.sample[:1], out)
