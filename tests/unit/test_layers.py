"""The layering holds (docs/architecture.md): drawn from the imports as installed (dtprof.analyzers is analyzers/,
and so on), every import counted, also those inside functions. The analysis side (dtprof/, analyzers/, reports/)
has no import circle; analyzers import neither collectors nor reports (but reports/fmt.py, the formatters); reports
import no collector and not the launcher; no module of reports/ but fmt.py formats a number itself. Nor has the rank
side (collectors/): its hook objects and parts are given the rank's RankContext, never the runtime's Recorder, and
never import the runtime. No function in any of the four folders is over 120 lines."""
from __future__ import annotations

import ast
import re

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
        for f in sorted((REPO / folder).rglob("*.py")):
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
    """...but reports/fmt.py, the one place numbers become text: the analyzers' sentences (a finding's message, a
    triage verdict) use its formatters too; it imports nothing of dtprof."""
    graph = imports()
    assert graph["reports/fmt.py"] == set()
    bad = [(f, t) for f, ts in graph.items() for t in ts
           if (f.startswith("analyzers/") and t.startswith(("collectors/", "reports/")) and t != "reports/fmt.py")
           or (f.startswith("reports/") and (t.startswith("collectors/") or t == "dtprof/launcher.py"))]
    assert bad == []


# dtprof/ modules that run or import foreign data and so may use collectors/: the launcher (NVML sampling, merging
# the ranks' traces), the public rank API, `dtprof import kineto` and the job's start-up hook (dtprof/_inject: it
# starts the rank side). Reading, analysing, reporting, comparing and triaging a run never does (issue 46 point 4):
# the run format and its readers live in dtprof/ (dtprof/rundir/, walked with the rest).
MAY_IMPORT_COLLECTORS = {"dtprof/launcher.py", "dtprof/__init__.py", "dtprof/interop.py",
                         "dtprof/_inject/sitecustomize.py"}


def test_nothing_that_reads_runs_imports_collectors():
    graph = imports()
    bad = sorted((f, t) for f, ts in graph.items() for t in ts
                 if f.startswith("dtprof/") and t.startswith("collectors/") and f not in MAY_IMPORT_COLLECTORS)
    assert bad == []


# what opens, reads, writes or names a run's files, by its name (the run reader's functions, the writers, paths)
FILE_IO = re.compile(r"^(open_|read_|write_|create_|compact_|save_|load_)|(_file|_files|_dir|Writer|Tail)$")
# the run reader's module of files: the analyzers never import it (a node summary's files come as rundir/rows.py's
# Rows, handed out by Run.summary_rows)
READER_FILES = "dtprof.rundir.files"
# debts, each with its reason: analyze(run) still opens a path it is given (many callers pass one)
FILE_IO_ALLOWED = {("analyzers/summary.py", "dtprof.rundir.run.open_run")}


def _analyzer_file_imports() -> list[tuple[str, str]]:
    found = []
    for f in sorted((REPO / "analyzers").rglob("*.py")):
        name = str(f.relative_to(REPO))
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                got = [a.name for a in node.names if a.name == READER_FILES or a.name.startswith(READER_FILES + ".")]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.startswith("dtprof.") \
                    and not node.module.startswith(("dtprof.analyzers", "dtprof.reports")):
                got = [f"{node.module}.{a.name}" for a in node.names
                       if node.module == READER_FILES or FILE_IO.search(a.name)]
            else:
                continue
            found += [(name, g) for g in got if (name, g) not in FILE_IO_ALLOWED]
    return found


def test_analyzers_read_a_run_only_through_what_they_are_handed():
    """Analyzers are functions of the run's tables (issue 46 point 4): they import no function that opens, reads,
    writes or names a run's files, nor the reader's module of files; they read through the ``Run`` and the
    ``Rows`` handed to them. (summary.json is written by dtprof/rundir/writer.py ``save_summary``.)"""
    assert _analyzer_file_imports() == []
    # the rule finds what it guards against: the reader's own modules are full of such names
    assert FILE_IO.search("open_run") and FILE_IO.search("summary_file") and FILE_IO.search("RankWriter")


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


# A memo of a pure function of torch's dtypes (the same for any recorder): the one module-level table allowed
MODULE_TABLES_ALLOWED = {("collectors/collective_rows.py", "DTYPE_NAMES")}
MUTATORS = {"append", "add", "setdefault", "update", "pop", "popitem", "clear", "extend", "insert", "remove",
            "discard"}


def _module_state(f) -> list[str]:
    """Where a function of a module rebinds a global or changes the contents of one of the module's names (a table
    built while the module is imported is a constant)."""
    tree = ast.parse(f.read_text())
    names = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    in_functions = {n for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for n in ast.walk(fn)}
    found = []
    for n in sorted(in_functions, key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
        if isinstance(n, ast.Global):
            found += [f"{n.lineno} global {g}" for g in n.names]
        elif isinstance(n, ast.Subscript) and isinstance(n.ctx, (ast.Store, ast.Del)) \
                and isinstance(n.value, ast.Name) and n.value.id in names:
            found.append(f"{n.lineno} {n.value.id}[...] =")
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in MUTATORS \
                and isinstance(n.func.value, ast.Name) and n.func.value.id in names:
            found.append(f"{n.lineno} {n.func.value.id}.{n.func.attr}()")
    return found


def test_rank_side_keeps_no_state_in_module_globals():
    """The rank side's hooks keep their state in objects the Recorder owns (issue 39): no module of collectors/
    rebinds a global or changes a module-level table, but the memo above."""
    found = []
    for f in sorted((REPO / "collectors").glob("*.py")):
        name = str(f.relative_to(REPO))
        found += [f"{name}:{where}" for where in _module_state(f)
                  if not any(where.split()[1].startswith(table) for n, table in MODULE_TABLES_ALLOWED if n == name)]
    assert found == []


def _format_specs(f) -> list[str]:
    """Where a module formats a number itself: an f-string's format spec (``{x:.1f}``, ``{x:>8}``), ``str.format``
    or ``format()``, or ``%`` formatting of a string."""
    found = []
    for n in ast.walk(ast.parse(f.read_text())):
        if isinstance(n, ast.FormattedValue) and n.format_spec is not None:
            found.append(f"{n.lineno} {{...:{ast.unparse(n.format_spec)[2:-1]}}}")
        elif isinstance(n, ast.Call) and ((isinstance(n.func, ast.Attribute) and n.func.attr == "format")
                                          or (isinstance(n.func, ast.Name) and n.func.id == "format")):
            found.append(f"{n.lineno} {ast.unparse(n.func)}()")
        elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) and (isinstance(n.left, ast.JoinedStr) or (
                isinstance(n.left, ast.Constant) and isinstance(n.left.value, str))):
            found.append(f"{n.lineno} '...' % ...")
    return found


def test_reports_format_numbers_only_in_fmt():
    """Numbers are formatted in one place (issue 46 point 5): no module of reports/ but fmt.py holds a format spec;
    the others call fmt.py's formatters (a missing value is fmt.MISSING everywhere)."""
    found = [f"{f.relative_to(REPO)}:{where}" for f in sorted((REPO / "reports").glob("*.py")) if f.name != "fmt.py"
             for where in _format_specs(f)]
    assert found == []
    # the test finds what it guards against: fmt.py itself holds them
    assert len(_format_specs(REPO / "reports" / "fmt.py")) > 10
