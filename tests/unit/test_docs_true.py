"""docs/architecture.md says where things live, and is true: every file it names exists, every document it links
exists, and every output module of reports/ (one with ``render``) is named in it (issue 46 point 6)."""
from __future__ import annotations

import re

from conftest import REPO

ARCH = (REPO / "docs" / "architecture.md").read_text()


def test_every_file_the_architecture_names_exists():
    named = set(re.findall(r"\b((?:collectors|analyzers|reports|dtprof|benchmarks|tests)/[\w./]+\.py)\b", ARCH))
    assert len(named) > 40   # the table of where things live
    assert sorted(f for f in named if not (REPO / f).is_file()) == []


def test_every_document_the_architecture_links_exists():
    links = set(re.findall(r"\]\(([\w-]+\.md)\)", ARCH))
    assert links and sorted(d for d in links if not (REPO / "docs" / d).is_file()) == []


def test_every_renderer_is_named_in_the_architecture():
    renderers = [f.name for f in sorted((REPO / "reports").glob("*.py")) if "\ndef render(" in f.read_text()]
    assert len(renderers) >= 6
    assert [r for r in renderers if f"reports/{r}" not in ARCH and f"`{r}`" not in ARCH] == []


README = (REPO / "README.md").read_text()
# words that tell a figure's history rather than its current value (issue 46 point 6: a diary belongs in the
# issue notes and commit messages)
HISTORY = re.compile(r"\b(was|earlier|previously|before (?:it|the \w+ (?:hook|change|fix))|at [0-9a-f]{7})\b", re.I)


def test_readme_cost_is_short_and_both_tables_hold_current_figures_only():
    cost = README.split("\n## Cost\n", 1)[1].split("\n## ", 1)[0]
    assert len([line for line in cost.splitlines() if line.strip()]) <= 10
    validation = (REPO / "docs" / "validation.md").read_text()
    rows = [line for text in (cost, validation) for line in text.splitlines() if line.startswith("|")]
    assert len(rows) > 10
    assert [r[:80] for r in rows if HISTORY.search(r)] == []
