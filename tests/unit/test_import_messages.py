"""`dtprof import kineto` says what it did: per file the rank, steps, rows kept and window; per skipped file why.

On the shared real traces (the kineto data set beside the checkout, see its README; conftest.SHARED finds it);
expected counts are read from the trace files themselves with plain json, not copied from dtprof's output.
"""
from __future__ import annotations

import gzip
import json
import re

import pytest
from click.testing import CliRunner

from conftest import SHARED, needs_shared
from dtprof.cli import main

pytestmark = needs_shared
NCCL = SHARED / "nccl_single_rank.json.gz"
AMD = SHARED / "amd_mi250_minitoy.json.gz"


def _import(tmp_path, *paths):
    res = CliRunner().invoke(main, ["import", "kineto", *map(str, paths), "-o", str(tmp_path / "run")])
    return res, [line for line in res.output.splitlines() if line]


def _expected(path):
    """Rank, ProfilerStep numbers, GPU kernel count and the window of ProfilerSteps and kept events, from json."""
    t = json.loads(gzip.decompress(path.read_bytes()))
    ev = [e for e in t["traceEvents"] if e.get("ph") == "X"]
    steps = sorted(int(e["name"].split("#")[1]) for e in ev if e["name"].startswith("ProfilerStep#"))
    kernels = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return t.get("distributedInfo", {}).get("rank", 0), steps, len(kernels)


def test_one_line_per_file_with_rank_steps_counts_and_window(tmp_path):
    rank, steps, n_kernels = _expected(NCCL)
    res, lines = _import(tmp_path, NCCL)
    assert res.exit_code == 0, res.output
    line = next(x for x in lines if NCCL.name in x)
    assert f"rank {rank}," in line
    assert f"steps {steps[0]}-{steps[-1]} ({len(steps)} ProfilerSteps)" in line
    assert f"kept {n_kernels} GPU kernels" in line
    from dtprof.reader import open_run
    run = open_run(tmp_path / "run")
    assert f"{len(run.collectives)} collectives" in line and len(run.collectives) > 0
    n_user = int((run.spans["kind"] == "user").sum())
    assert f"{n_user} annotations" in line and n_user > 0
    window = float(re.search(r"window ([\d.]+) s", line).group(1))
    s = run.spans
    assert window == pytest.approx((max(s["end_ns"].max(), run.steps["end_ns"].max())
                                    - min(s["start_ns"].min(), run.steps["start_ns"].min())) / 1e9, abs=1e-3)
    assert lines[0] == "dtprof: reading 1 trace file(s)"


@pytest.mark.parametrize("content, why", [
    (b"", "empty file"),
    (gzip.compress(b"", mtime=0), "empty file"),
    (b'{"name": "not a trace"}', 'no "traceEvents"'),
])
def test_bad_single_file_is_one_clear_line(tmp_path, content, why):
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    res, lines = _import(tmp_path, bad)
    assert res.exit_code == 2
    errors = [x for x in lines if "Error" in x or "warning" in x]
    assert len(errors) == 1 and str(bad) in errors[0] and why in errors[0], res.output
    assert "Traceback" not in res.output and not (tmp_path / "run").exists()


def test_mixed_folder_skips_each_bad_file_with_its_reason(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "rank0.json.gz").write_bytes(NCCL.read_bytes())
    (d / "amd.json.gz").write_bytes(AMD.read_bytes())   # another job: no distributedInfo, no rank in the name
    (d / "empty.json").write_bytes(b"")
    (d / "other.json").write_text('{"a": 1}')
    (d / "notes.txt").write_text("not a trace")
    res, lines = _import(tmp_path, d)
    assert res.exit_code == 0, res.output
    assert lines[0] == "dtprof: reading 4 trace file(s) (1 other file(s) in the folder(s) ignored: not .json/.json.gz)"
    skipped = {name: [x for x in lines if "skipped" in x and name in x] for name in ("amd", "empty", "other")}
    assert all(len(v) == 1 for v in skipped.values()), res.output
    assert "missing rank" in skipped["amd"][0] and "empty file" in skipped["empty"][0]
    assert "traceEvents" in skipped["other"][0]
    assert sum("rank0.json.gz: rank 0," in x for x in lines) == 1


def test_amd_trace_alone_imports_as_rank_0_and_says_so(tmp_path):
    res, lines = _import(tmp_path, AMD)
    assert res.exit_code == 0, res.output
    assert any("warning" in x and "imported as rank 0" in x for x in lines), res.output
    assert any(AMD.name + ": rank 0," in x and "GPU kernels" in x for x in lines), res.output
