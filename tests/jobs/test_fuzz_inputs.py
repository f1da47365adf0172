"""Bad input, generated at test time from one small real run (issue 15).

One real 2-rank gloo torchrun job is recorded with ``dtprof run`` (with a torch.profiler capture and Flight
Recorder dumps, and ``dtprof.annotate(model_flops=2.4e19)``: a ~1T-parameter model's step, beyond int64). Each
case below copies that run (or its traces or dumps) and damages one thing the way disks, copies and other tools do.
Every read command that takes such input must answer with exit code 2 and ONE line naming the file and the
problem: no traceback, and nothing read silently wrong. Input dtprof deliberately tolerates (a torn last JSON
line) gives a warning naming the file and what was skipped.

The cases follow the issue's categories: "tb" cases raised a traceback before the fix, "silent" ones were read
or imported without a word (wrong numbers, a missing table, a rank imported twice, "healthy" for nothing).
"""
from __future__ import annotations

import gzip
import json
import shutil
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from conftest import dtprof
from dtprof.cli import main
from dtprof.rundir.writer import SUMMARY_DIR
from torch_abort import returncode

pytestmark = pytest.mark.slow

JOB = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    import dtprof
    from torch._C._distributed_c10d import _dump_fr_trace_json
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(6):
        dtprof.annotate(model_flops=2.4e19, tokens=64)   # a ~1T-parameter model's step: beyond int64
        model(torch.randn(16, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    open(os.path.join(sys.argv[1], f"fr_trace_rank_{rank}.json"), "wb").write(_dump_fr_trace_json())
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The real run, its captured torch.profiler traces and its Flight Recorder dumps."""
    d = tmp_path_factory.mktemp("fuzz-real")
    (d / "job.py").write_text(JOB)
    (d / "fr").mkdir()
    proc = dtprof("run", "--out", "run", "--no-nvml", "--no-report", "--trace-steps", "1:3", "--", sys.executable,
                  "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "job.py", "fr", cwd=d)
    assert returncode(proc) == 0, proc.stderr[-3000:]
    node = next((d / "run").glob("node-*"))
    assert json.loads((node / "node.json").read_text())["post"]["compacted"], proc.stderr[-3000:]
    traces = d / "traces"
    traces.mkdir()
    for r in (0, 1):
        shutil.copy(node / f"rank-{r}" / "kineto" / "trace.json", traces / f"rank{r}.trace.json")
    return {"run": d / "run", "node": node.name, "traces": traces, "fr": d / "fr"}


def invoke(args):
    return CliRunner().invoke(main, [str(a) for a in args])


# Progress lines some commands print before they read anything; everything else on stderr is the answer.
_PROGRESS = ("dtprof: reading ", "dtprof compare: analysing ")


def assert_one_line(res, names, cmd):
    """Exit 2, no traceback, and exactly one line (the error) that names the file."""
    assert res.exit_code == 2, (cmd, res.exit_code, res.output, res.exception)
    assert "Traceback" not in res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith(_PROGRESS)]
    assert len(lines) == 1, (cmd, res.stderr)
    assert any(n in lines[0] for n in names), (cmd, lines[0], names)


# ---- damaging a run --------------------------------------------------------------------------------------------

def _copy_run(real, tmp_path, raw: bool) -> tuple[Path, Path]:
    """A copy of the real run without its summary and node summary (so every command reads the tables: a node
    summary made before the damage stands for the tables it was made from); ``raw``: without the compacted Parquet
    tables, so the ranks' JSON-lines files are read, as for a crashed job."""
    run = tmp_path / "run"
    shutil.copytree(real["run"], run, symlinks=True)
    (run / "summary.json").unlink(missing_ok=True)
    node = run / real["node"]
    shutil.rmtree(node / SUMMARY_DIR, ignore_errors=True)
    if raw:
        shutil.rmtree(node / "tables")
    return run, node


def _parquet(node, table, fn):
    p = node / "tables" / f"{table}.parquet"
    df = pd.read_parquet(p)
    df = fn(df)
    df.to_parquet(p, index=False)
    return p.name


def _set(col, value, row=0, dtype=None):
    def fn(df):
        if dtype:   # "str": a text column (Parquet holds one type per column), as another tool could write
            df[col] = df[col].astype(dtype)
        df.loc[df.index[row], col] = value
        return df
    return fn


def _table_file(node, table, rank=0) -> Path:
    return node / f"rank-{rank}" / f"{table}.jsonl.gz"


def _lines(p: Path) -> list[str]:
    return gzip.decompress(p.read_bytes()).decode().splitlines()


def _write_lines(p: Path, lines: list[str]) -> None:
    p.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))


def _jsonl(node, table, col, value, rank=0, line=1):
    """Set one value of one row of a rank's JSON-lines table file (written as JSON text: NaN, Infinity allowed)."""
    p = _table_file(node, table, rank)
    lines = _lines(p)
    cols = json.loads(lines[0])["columns"]
    row = json.loads(lines[line])
    row[cols.index(col)] = value
    lines[line] = json.dumps(row)
    _write_lines(p, lines)
    return p.name


def _deep(n=200_000):
    return "[" * n + "]" * n


def _loop(p: Path) -> str:
    p.unlink()
    p.symlink_to(p.name)   # a link to itself: ELOOP
    return p.name


def _copied_node(run, node):
    shutil.copytree(node, run / (node.name + "-copy"), symlinks=True)
    return "rank 0"


def _other_table(node, raw):
    if raw:
        shutil.copy(_table_file(node, "spans"), _table_file(node, "steps"))
        return "steps.jsonl.gz"
    shutil.copy(node / "tables" / "spans.parquet", node / "tables" / "steps.parquet")
    return "steps.parquet"


I64 = 2**63 - 1
RUN_CASES = {
    # -- tracebacks before the fix: NaN/inf/strings in integer time columns, Parquet and JSON lines
    "tb-parquet-nan-step-start": lambda run, node: _parquet(node, "steps", _set("start_ns", float("nan"),
                                                                                dtype="float64")),
    "tb-parquet-inf-span-end": lambda run, node: _parquet(node, "spans", _set("end_ns", float("inf"),
                                                                              dtype="float64")),
    "tb-parquet-str-coll-issue": lambda run, node: _parquet(node, "collectives", _set("issue_ns", "soon",
                                                                                      dtype="str")),
    "tb-parquet-nan-clock": lambda run, node: _parquet(node, "clock", _set("wall_ns", float("nan"),
                                                                           dtype="float64")),
    "tb-parquet-str-events-t": lambda run, node: _parquet(node, "events", _set("t_ns", "x", dtype="str")),
    "tb-parquet-nan-group-size": lambda run, node: _parquet(node, "groups", _set("size", float("nan"),
                                                                                 dtype="float64")),
    # -- manifests that are valid JSON but not objects, or nested beyond Python's recursion limit
    "tb-run-json-list": lambda run, node: (run / "run.json").write_text("[1, 2]") and "run.json",
    "tb-run-json-number": lambda run, node: (run / "run.json").write_text("42") and "run.json",
    "tb-run-json-deep": lambda run, node: (run / "run.json").write_text(_deep()) and "run.json",
    "tb-node-json-list": lambda run, node: (node / "node.json").write_text("[]") and "node.json",
    "tb-node-json-deep": lambda run, node: (node / "node.json").write_text(_deep()) and "node.json",
    # -- a copied node directory: the same ranks twice
    "tb-duplicate-ranks": lambda run, node: _copied_node(run, node),
    # -- a symbolic-link loop where a table file should be
    "tb-parquet-link-loop": lambda run, node: _loop(node / "tables" / "steps.parquet"),
    # -- silently wrong before the fix: impossible times read as ordinary numbers
    "silent-parquet-negative-step": lambda run, node: _parquet(node, "steps", _set("end_ns", 0)),
    "silent-parquet-int64max-step": lambda run, node: _parquet(node, "steps", _set("end_ns", I64)),
    "silent-parquet-negative-span": lambda run, node: _parquet(node, "spans", _set("end_ns", -5)),
    "silent-parquet-coll-return-before-issue": lambda run, node: _parquet(node, "collectives",
                                                                          _set("return_ns", 1)),
    "silent-parquet-fraction-in-int": lambda run, node: _parquet(node, "steps", _set("start_ns", 1.5,
                                                                                     dtype="float64")),
    "silent-parquet-other-table": lambda run, node: _other_table(node, raw=False),
    "silent-parquet-missing-ranks": lambda run, node: (node / "tables" / "ranks.parquet").unlink() or
    "ranks.parquet",
    "silent-parquet-str-in-float": lambda run, node: _parquet(node, "steps", _set("model_flops", "many",
                                                                                  dtype="str")),
}
RAW_CASES = {
    "tb-jsonl-nan-step-end": lambda run, node: _jsonl(node, "steps", "end_ns", float("nan")),
    "tb-jsonl-inf-span-start": lambda run, node: _jsonl(node, "spans", "start_ns", float("inf")),
    "tb-jsonl-str-step-start": lambda run, node: _jsonl(node, "steps", "start_ns", "12:00"),
    "tb-jsonl-str-coll-return": lambda run, node: _jsonl(node, "collectives", "return_ns", "later"),
    "tb-jsonl-null-rank": lambda run, node: _jsonl(node, "spans", "rank", None),
    "tb-jsonl-list-in-time": lambda run, node: _jsonl(node, "steps", "end_ns", [1, 2]),
    "tb-jsonl-link-loop": lambda run, node: _loop(_table_file(node, "steps")),
    "tb-rank-json-list": lambda run, node: (node / "rank-0" / "rank.json").write_text("[0]") and "rank.json",
    "tb-jsonl-header-deep": lambda run, node: _replace_header(node, _deep()),
    "tb-jsonl-header-columns-number": lambda run, node: _replace_header(node, '{"dtprof_table": "steps", '
                                                                                '"columns": 5}'),
    "tb-jsonl-bytes-beyond-int64": lambda run, node: _jsonl(node, "collectives", "in_bytes", 2**64),
    "tb-duplicate-ranks-raw": lambda run, node: _copied_node(run, node),
    "silent-jsonl-negative-step": lambda run, node: _jsonl(node, "steps", "end_ns", -1),
    "silent-jsonl-int64max-span": lambda run, node: _jsonl(node, "spans", "end_ns", I64),
    "silent-jsonl-other-table": lambda run, node: _other_table(node, raw=True),
    "silent-jsonl-coll-end-before-issue": lambda run, node: _jsonl(node, "collectives", "end_ns", 0),
}


def _replace_header(node, text):
    p = _table_file(node, "steps")
    _write_lines(p, [text] + _lines(p)[1:])
    return "steps.jsonl.gz"


def _read_commands(run: Path, good: Path, tmp: Path):
    return {"summary": ["summary", run],
            "report": ["report", run, "-o", tmp / "out" / "report.html"],
            "compare": ["compare", good, "--head", run],
            "triage": ["triage", run],
            "export": ["export", "perfetto", run, "-o", tmp / "out" / "trace.json"]}


def _check_run_case(real, tmp_path, make, raw):
    run, node = _copy_run(real, tmp_path, raw)
    name = make(run, node)
    names = [name] if isinstance(name, str) else list(name)
    if name == "rank 0":   # duplicate ranks: the message names the run and the rank
        names = [str(run)]
    for cmd, args in _read_commands(run, real["run"], tmp_path).items():
        assert_one_line(invoke(args), names, cmd)
    assert not (tmp_path / "out" / "report.html").exists()


@pytest.mark.parametrize("case", sorted(RUN_CASES))
def test_damaged_compacted_run(real, tmp_path, case):
    _check_run_case(real, tmp_path, RUN_CASES[case], raw=False)


@pytest.mark.parametrize("case", sorted(RAW_CASES) + sorted(k for k in RUN_CASES if "json-" in k))
def test_damaged_raw_run(real, tmp_path, case):
    """The same damage where the ranks' JSON-lines files are read (a crashed job, before compaction)."""
    _check_run_case(real, tmp_path, RAW_CASES.get(case) or RUN_CASES[case], raw=True)


def test_torn_last_line_is_a_warning_naming_the_file(real, tmp_path):
    run, node = _copy_run(real, tmp_path, raw=True)
    p = _table_file(node, "steps")
    text = gzip.decompress(p.read_bytes()) + b'[0,99,17'   # a rank killed in the middle of a write
    p.write_bytes(gzip.compress(text)[:-8])                # ... before its gzip stream's end
    res = invoke(["export", "perfetto", run, "-o", tmp_path / "t.json"])
    assert res.exit_code == 0, res.output
    assert "steps.jsonl.gz" in res.stderr and "skipped 1 unreadable line" in res.stderr


def test_damaged_compressed_file_is_read_up_to_the_damage(real, tmp_path):
    """A rank's gzip table damaged in its middle (a bad disk block): the rows before the damage are read and the
    file is named in one warning; the run is not lost."""
    run, node = _copy_run(real, tmp_path, raw=True)
    p = _table_file(node, "spans")
    data = bytearray(p.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = b"\xff" * 64
    p.write_bytes(bytes(data))
    res = invoke(["export", "perfetto", run, "-o", tmp_path / "t.json"])
    assert res.exit_code == 0, res.output
    assert "spans.jsonl.gz: damaged from about byte" in res.stderr and "the rows before it were read" in res.stderr


def test_compare_with_a_damaged_summary(real, tmp_path):
    for i, text in enumerate(["[]", _deep(), '{"steps": 3}']):
        p = tmp_path / f"s{i}" / "summary.json"
        p.parent.mkdir()
        p.write_text(text)
        assert_one_line(invoke(["compare", real["run"], "--head", p]), ["summary.json"], f"compare {i}")


# ---- the real run itself: a ~1T-parameter model's FLOPs ------------------------------------------------------

def test_model_flops_beyond_int64_keep_the_run_readable(real, tmp_path):
    """dtprof.annotate(model_flops=2.4e19) made compaction, summary and report fail."""
    from dtprof.reader import open_run

    run = open_run(real["run"])
    assert (run.steps["model_flops"] == 2.4e19).all() and len(run.steps) == 12
    res = invoke(["summary", real["run"], "--json", "--no-write"])
    assert res.exit_code == 0, res.output
    res = invoke(["report", real["run"], "-o", tmp_path / "r.html"])
    assert res.exit_code == 0, res.output


# ---- torch.profiler traces -----------------------------------------------------------------------------------

def _trace_events(real, fn):
    """The real rank-0 trace with ``fn`` applied to its first kernel or CPU event that dtprof keeps."""
    doc = json.loads((real["traces"] / "rank0.trace.json").read_text())
    ev = next(e for e in doc["traceEvents"] if e.get("ph") == "X" and (
        e.get("cat") in ("kernel", "gpu_user_annotation", "user_annotation") or
        str(e.get("name", "")).startswith("c10d::")))
    fn(ev, doc)
    return doc


def _setter(key, value):
    def fn(ev, doc):
        ev[key] = value
    return fn


KINETO_CASES = {
    "silent-ts-nan": _setter("ts", float("nan")),
    "silent-ts-inf": _setter("ts", float("inf")),
    "silent-ts-negative": _setter("ts", -1e6),
    "silent-dur-negative": _setter("dur", -3),
    "silent-dur-nan": _setter("dur", float("nan")),
    "silent-dur-inf": _setter("dur", float("-inf")),
    "silent-ts-string": _setter("ts", "yesterday"),
    "silent-ts-missing": lambda ev, doc: ev.pop("ts"),
    "tb-args-string": _setter("args", "not a dict"),
    "tb-rank-not-a-number": lambda ev, doc: doc.setdefault("distributedInfo", {}).update(rank="zero"),
}


@pytest.mark.parametrize("case", sorted(KINETO_CASES))
def test_damaged_kineto_trace(real, tmp_path, case):
    doc = _trace_events(real, KINETO_CASES[case])
    p = tmp_path / "rank0.trace.json"
    p.write_text(json.dumps(doc))
    assert_one_line(invoke(["import", "kineto", p, "-o", tmp_path / "r"]), [str(p)], "import kineto")
    assert not (tmp_path / "r").exists()


def test_deeply_nested_kineto_trace(tmp_path):
    p = tmp_path / "rank0.trace.json"
    p.write_text('{"traceEvents": [' + _deep() + "]}")
    assert_one_line(invoke(["import", "kineto", p, "-o", tmp_path / "r"]), [str(p)], "import kineto")


def test_one_damaged_trace_among_good_ones_is_skipped_with_a_warning(real, tmp_path):
    doc = _trace_events(real, _setter("dur", -3))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "rank0.trace.json").write_text(json.dumps(doc))
    shutil.copy(real["traces"] / "rank1.trace.json", tmp_path / "t")
    res = invoke(["import", "kineto", tmp_path / "t", "-o", tmp_path / "r"])
    assert res.exit_code == 0, res.output
    warned = [ln for ln in res.stderr.splitlines() if "warning" in ln]
    assert len(warned) == 1 and "rank0.trace.json" in warned[0] and "impossible dur" in warned[0]


# ---- Flight Recorder dumps -----------------------------------------------------------------------------------

def _dump(real, fn):
    doc = json.loads((real["fr"] / "fr_trace_rank_0.json").read_text())
    assert doc["entries"], "the real job's dump has entries"
    fn(doc)
    return doc


def _entry(key, value):
    def fn(doc):
        doc["entries"][0][key] = value
    return fn


FR_CASES = {
    "tb-entries-string": lambda doc: doc.update(entries="many"),
    "tb-entries-of-strings": lambda doc: doc.update(entries=["a", "b"]),
    "tb-process-group-int": _entry("process_group", 7),
    "tb-input-sizes-string": _entry("input_sizes", "[[4]]"),
    "tb-input-size-float": _entry("input_sizes", [[4.5]]),
    "tb-output-sizes-dict": _entry("output_sizes", {"a": 1}),
    "tb-frames-string": _entry("frames", "main.py:3"),
    "tb-dtypes-int": _entry("input_dtypes", [7]),
    "tb-profiling-name-list": _entry("profiling_name", ["gloo", "all_reduce"]),
    "silent-seq-string": _entry("collective_seq_id", "three"),
    "silent-time-negative": _entry("time_created_ns", -5),
    "silent-time-nan": _entry("time_created_ns", float("nan")),
}


@pytest.mark.parametrize("case", sorted(FR_CASES))
def test_damaged_fr_dump(real, tmp_path, case):
    p = tmp_path / "fr_trace_rank_0.json"
    p.write_text(json.dumps(_dump(real, FR_CASES[case])))
    assert_one_line(invoke(["import", "fr", p, "-o", tmp_path / "r"]), [str(p)], "import fr")
    assert_one_line(invoke(["triage", "--fr", p]), [str(p)], "triage --fr")
    assert not (tmp_path / "r").exists()


def test_deeply_nested_fr_dump(tmp_path):
    p = tmp_path / "fr_trace_rank_0.json"
    p.write_text('{"entries": ' + _deep() + "}")
    for args in (["import", "fr", p, "-o", tmp_path / "r"], ["triage", "--fr", p]):
        assert_one_line(invoke(args), [str(p)], args[0])


def test_two_dumps_of_one_rank_are_refused(real, tmp_path):
    """Imported twice before the fix (the Kineto importer already refused duplicate ranks)."""
    d = tmp_path / "dumps"
    d.mkdir()
    shutil.copy(real["fr"] / "fr_trace_rank_0.json", d / "fr_trace_rank_0.json")
    doc = json.loads((real["fr"] / "fr_trace_rank_0.json").read_text())
    doc["rank"] = 0
    (d / "again_rank_5.json").write_text(json.dumps(doc))
    assert_one_line(invoke(["import", "fr", d, "-o", tmp_path / "r"]), ["duplicate rank 0"], "import fr")
    assert not (tmp_path / "r").exists()


def test_triage_fr_on_an_empty_folder_is_not_healthy(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line(invoke(["triage", "--fr", tmp_path / "empty"]), [str(tmp_path / "empty")], "triage --fr")
    assert_one_line(invoke(["import", "fr", tmp_path / "empty", "-o", tmp_path / "r"]), [str(tmp_path / "empty")],
                    "import fr")
