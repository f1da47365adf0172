"""The layering holds (docs/architecture.md): drawn from the imports as installed (dtprof.analyzers is analyzers/,
and so on), every import counted, also those inside functions. The analysis side (dtprof/, analyzers/, reports/)
has no import circle; analyzers import neither collectors nor reports; reports import no collector and not the
launcher. Nor has the rank side (collectors/): its hook modules are given the runtime's Recorder at install and never
import the runtime. No function in any of the four folders is over 120 lines."""
from __future__ import annotations

import ast

from conftest import REPO

PACKAGES = {"dtprof.collectors": "collectors", "dtprof.analyzers": "analyzers", "dtprof.reports": "reports",
            "dtprof": "dtprof"}


def _file_of(module: str) -> str | None:
    for prefix, folder in sorted(PACKAGES.items(), key=lambda kv: -len(kv[0])):
        if module == prefix or module.startswith(prefix + "."):
            rest = module[len(prefix):].lstrip(".").split(".") if module != prefix else []
            path = REPO / folder / "/".join(rest)
            if path.with_suffix(".py").is_file():
                return str(path.with_suffix(".py").relative_to(REPO))
            return None
    return None


def imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for folder in PACKAGES.values():
        for f in sorted((REPO / folder).glob("*.py")):
            name = str(f.relative_to(REPO))
            graph[name] = set()
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                else:
                    continue
                graph[name] |= {t for t in map(_file_of, mods) if t and t != name and not t.endswith("__init__.py")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert circles(imports()) == []


def test_analyzers_import_neither_collectors_nor_reports_and_reports_no_collector():
    graph = imports()
    bad = [(f, t) for f, ts in graph.items() for t in ts
           if (f.startswith("analyzers/") and t.startswith(("collectors/", "reports/")))
           or (f.startswith("reports/") and (t.startswith("collectors/") or t == "dtprof/launcher.py"))]
    assert bad == []


MAX_FUNCTION_LINES = 120


def test_no_function_over_120_lines():
    """Functions along their seams (issue 39): none in the package's folders is over 120 lines, from its ``def``
    to its last line (decorators not counted; a nested function counts in its parent too)."""
    long = []
    for folder in PACKAGES.values():
        for f in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{f.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []
