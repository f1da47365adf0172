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
