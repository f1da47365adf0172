"""The package installs three ways (wheel, `pip install .`, `pip install -e .`) and each one imports the
subpackages under their dtprof.* names, with nothing generic (collectors/, analyzers/, reports/) at top level.

A reader's install (the wheel with its dependencies, no torch) summarises, reports, compares, triages, imports and
exports a run that its own `dtprof run` recorded from a job which brings its torch."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

from conftest import REPO
from torch_abort import returncode

SUBPACKAGES = ("dtprof.collectors", "dtprof.analyzers", "dtprof.reports", "dtprof._inject", "dtprof.rundir")


def _pip(py: Path, *args: str) -> None:
    subprocess.run(_pip_install(py, "--no-deps", *args), check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE)


def _pip_install(py: Path, *args: str) -> list[str]:
    """`pip install ARGS` into the venv of ``py``, run by this Python's pip (``pip --python``): the venvs need no
    pip of their own, whose bootstrap (ensurepip) cost ~4.5 s of CPU for each of the four."""
    return [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", *args]


def _fresh_venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=False).create(path)
    return path / "bin" / "python"


def _imports(py: Path) -> list[str]:
    code = ("import importlib, json; mods = %r; "
            "print(json.dumps([importlib.import_module(m).__name__ for m in mods]))" % (SUBPACKAGES,))
    out = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True, cwd="/")
    return eval(out.stdout)  # a list of module names, printed by us


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    (whl,) = out.glob("dtprof-*.whl")
    return whl


def test_wheel_maps_subpackages_under_dtprof(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for sub in ("collectors", "analyzers", "reports"):
        assert f"dtprof/{sub}/__init__.py" in names
        assert not any(n.startswith(f"{sub}/") for n in names), f"generic top-level {sub}/ in the wheel"
    assert "dtprof/_inject/sitecustomize.py" in names
    assert not any(n.startswith("tests/") for n in names)


@pytest.mark.parametrize("how", ["wheel", "pip install .", "pip install -e ."])
def test_installed_package_imports_subpackages(how, wheel, tmp_path):
    py = _fresh_venv(tmp_path / "venv")
    target = {"wheel": [str(wheel)], "pip install .": [str(REPO)], "pip install -e .": ["-e", str(REPO)]}[how]
    _pip(py, *target)
    assert _imports(py) == list(SUBPACKAGES)


# ---- a reader's install: `pip install` of the package, no torch --------------------------------------------------

# A 2-rank DDP job on gloo that also writes what the importers read: a torch.profiler trace of steps 2..4 and a
# Flight Recorder dump per rank (the user's own tools, not dtprof's). 40 steps leave compare its 20 measured ones.
JOB = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace_json
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile, schedule
    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), sys.argv[1]
    model = DDP(torch.nn.Linear(64, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=0, active=3, repeat=1))
    for step in range(40):
        if step == 2:
            prof.start()
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        if 2 <= step <= 4:
            prof.step()
        if step == 4:
            prof.stop()
            prof.export_chrome_trace(os.path.join(out, f"trace_rank{rank}.json"))
    with open(os.path.join(out, f"fr_trace_rank_{rank}.json"), "wb") as f:
        f.write(_dump_fr_trace_json())
    dist.destroy_process_group()
""")


VERDICTS = {"hang", "crash", "mismatch", "straggler", "healthy"}


@pytest.fixture(scope="module")
def reader(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel and its dependencies (from PyPI or pip's cache), and nothing else: no torch."""
    py = _fresh_venv(tmp_path_factory.mktemp("reader") / "venv")
    subprocess.run(_pip_install(py, "--no-compile", str(wheel)), check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE)
    return py


# The reader venv is installed without bytecode (--no-compile: compiling all of pandas, numpy and pyarrow at install
# costs more than it saves), so its processes write the bytecode of what they import, as a user's Python does
# by default: under a PYTHONDONTWRITEBYTECODE environment (CI) each of the test's ~12 dtprof processes compiled
# pandas, pyarrow and click afresh (~2 s of CPU each, measured side by side)
READER_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _dtprof(py: Path, *args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(py.parent / "dtprof"), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=READER_ENV)


@pytest.fixture(scope="module")
def recorded(reader, tmp_path_factory) -> Path:
    """The torch-less install's `dtprof run` records a job run by the test venv's torchrun (torch 2.13 CPU)."""
    d = tmp_path_factory.mktemp("job")
    (d / "job.py").write_text(JOB)
    (d / "out").mkdir()
    torchrun = Path(sys.executable).parent / "torchrun"
    r = _dtprof(reader, "run", "--out", "run", "--no-report", "-q", "--", torchrun, "--nproc_per_node=2",
                "--standalone", "job.py", "out", cwd=d)
    assert returncode(r) == 0, r.stderr[-3000:]     # torch's exit abort in a rank: rerun (tests/torch_abort.py)
    return d


def test_reader_install_has_no_torch(reader):
    r = subprocess.run([str(reader), "-c", "import torch"], capture_output=True, text=True)
    assert r.returncode != 0 and "No module named 'torch'" in r.stderr


@pytest.mark.slow
def test_run_uses_the_torch_of_the_job(recorded):
    from importlib.metadata import version

    (node,) = (recorded / "run").glob("node-*")
    info = json.loads((node / "node.json").read_text())
    assert info["status"] == "completed" and info["versions"]["torch"] == version("torch")
    assert sorted(p.name for p in node.glob("rank-*")) == ["rank-0", "rank-1"]


def test_run_refuses_a_job_python_without_torch(reader, tmp_path):
    r = _dtprof(reader, "run", "--out", "run", "--", reader, "-c", "print('ran')", cwd=tmp_path)
    assert r.returncode == 2 and "ran" not in r.stdout
    (line,) = r.stderr.strip().splitlines()
    assert str(reader) in line and "cannot import torch" in line
    assert not (tmp_path / "run").exists()


def test_calibrate_without_torch_is_one_line(reader, tmp_path):
    r = _dtprof(reader, "calibrate", "--device", "cpu", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "torch" in line


@pytest.mark.slow
def test_reader_install_reads_runs(reader, recorded):
    """summary, report, compare, triage, import kineto / fr and export perfetto, all without torch."""
    d = recorded
    r = _dtprof(reader, "summary", "run", cwd=d)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^\s+0 ", r.stdout, re.M) and re.search(r"^\s+1 ", r.stdout, re.M)   # one row per rank
    assert json.loads((d / "run" / "summary.json").read_text())["steps"]["count"] >= 20

    r = _dtprof(reader, "report", "run", "-o", "report.html", cwd=d)
    assert r.returncode == 0, r.stderr
    assert (d / "report.html").read_text().lstrip().lower().startswith("<!doctype html")

    r = _dtprof(reader, "compare", "run", "--head", "run", cwd=d)
    assert r.returncode == 0, r.stdout + r.stderr                     # a run against itself: no regression
    assert re.search(r"^steps\.time_s\.p50 .* pass\b", r.stdout, re.M)

    # the verdict itself depends on timing (two ranks on a busy 2-core machine can make one a straggler): healthy
    # exits 0, any found problem 1; unreadable input or a crash would exit 2 or with a traceback
    r = _dtprof(reader, "triage", "run", "--json", cwd=d)
    assert r.returncode in (0, 1) and json.loads(r.stdout)["verdict"] in VERDICTS, r.stdout + r.stderr

    r = _dtprof(reader, "import", "kineto", "out/trace_rank0.json", "out/trace_rank1.json", "-o", "kineto", cwd=d)
    assert r.returncode == 0, r.stderr
    r = _dtprof(reader, "summary", "kineto", "--json", cwd=d)
    assert r.returncode == 0, r.stderr
    assert [x["rank"] for x in json.loads(r.stdout)["ranks"]] == [0, 1]

    r = _dtprof(reader, "import", "fr", "out/fr_trace_rank_0.json", "out/fr_trace_rank_1.json", "-o", "fr", cwd=d)
    assert r.returncode == 0, r.stderr
    r = _dtprof(reader, "triage", "fr", "--json", cwd=d)
    assert r.returncode in (0, 1) and json.loads(r.stdout)["verdict"] in VERDICTS, r.stdout + r.stderr

    r = _dtprof(reader, "export", "perfetto", "run", "-o", "run.perfetto.json", cwd=d)
    assert r.returncode == 0, r.stderr
    events = json.loads((d / "run.perfetto.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X" and e.get("cat") == "step"} == {0, 1}
