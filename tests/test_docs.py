"""The docs stay true to the code: every backticked dotted name `llmem.x.y` in README.md and docs/ resolves, every
relative link (and its #anchor) points at something that exists, the README stays short, and docs/options.md is
what docs/make_options.py renders from the parser today."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_WORDS = 1600

DOTTED = re.compile(r"`(llmem(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)


def resolves(dotted: str) -> bool:
    """Whether `dotted` names something: the longest importable module prefix, then attributes for the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):          # http(s):, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{target}: no heading #{fragment} in {dest.name}")
    return bad


def test_resolves_tells_real_names_from_wrong_ones():
    assert resolves("llmem.estimator.engine.estimate")
    assert resolves("llmem.setup.training.TrainingSetup")
    assert resolves("llmem.memory.activations.learned")          # a module
    assert not resolves("llmem.estimator.engine.no_such_function")
    assert not resolves("llmem.no_such_floor.anything")
    assert not resolves("llmem.setup.training.TrainingSetup.no_such_field")


def test_slug_is_githubs():
    assert slug("DeepSpeed ZeRO (ds-zero1/2/3)") == "deepspeed-zero-ds-zero123"
    assert slug("The web page (`llmem serve`)") == "the-web-page-llmem-serve"
    assert slug("objective (TRL's trainers)") == "objective-trls-trainers"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_dotted_names_resolve(page: Path):
    names = sorted(set(DOTTED.findall(page.read_text())))
    assert [n for n in names if not resolves(n)] == []


def test_walkthrough_names_real_code():
    names = set(DOTTED.findall((ROOT / "docs" / "walkthrough.md").read_text()))
    assert len(names) >= 30          # the walk-through names the code it walks through, and each must resolve
    assert {"llmem.model.resolved.resolve", "llmem.estimator.engine.estimate",
            "llmem.estimator.schedule.StepSchedule", "llmem.memory.allocator.CachingAllocator"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_exist(page: Path):
    assert broken_links(page) == []


def test_broken_link_is_caught(tmp_path: Path):
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a-heading) [gone](missing.md) [no anchor](there.md#b) [web](https://x.org)\n")
    assert broken_links(page) == ["missing.md: no such file", "there.md#b: no heading #b in there.md"]


def test_readme_is_short():
    words = len((ROOT / "README.md").read_text().split())
    assert words < README_MAX_WORDS, f"README.md has {words} words (at most {README_MAX_WORDS})"


def test_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(readme)}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md")}
    assert sorted(p.name for p in pages - linked) == []


def test_options_page_is_current():
    spec = importlib.util.spec_from_file_location("make_options", ROOT / "docs" / "make_options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "options.md").read_text() == module.render(), \
        "docs/options.md is stale: run python docs/make_options.py"
