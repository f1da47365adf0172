"""The suite's shared set-up, paths, helpers and fixtures.

tests/unit/ reads synthetic or stored runs in this process (seconds); tests/jobs/ runs real processes: torchrun jobs
under `dtprof run`, the launcher, the rank side (minutes; marked ``slow``, ``pytest -m "not slow"`` leaves them out).
Helpers shared by several modules live here, imported as ``from conftest import ...``; helpers of one module stay
in it.

A CPU calibration for every recorded run: `dtprof run` times a ~1 s GEMM after each job on a device with no spec
peak (this VM's CPU), in a fresh Python that imports torch: ~4-5 s of each recording. A calibration stored by
`dtprof calibrate` ($XDG_CACHE_HOME/dtprof/calibration.json) takes its place, as it does for a user who ran that
command. So the suite runs `dtprof calibrate` once, with one thread (what `dtprof run` gives each rank of the suite's
two-rank jobs on two cores: cores // ranks), into a cache directory of its own, which also keeps the developer's own
cache out of the tests. The tests of the per-run calibration give their jobs an empty cache (test_frameworks.py).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
EXAMPLES = REPO / "examples"
ARTIFACTS = REPO / "test-artifacts"
# The shared real data (kept beside the checkout, each set with its README): $DTPROF_SHARED_DATA, else shared/data
# next to the checkout or next to its parent (a worktree one level further down). kineto/: torch.profiler traces;
# gpu-h100/: runs recorded on an H100.
SHARED_DATA = next((p for p in ([Path(os.environ["DTPROF_SHARED_DATA"])] if os.environ.get("DTPROF_SHARED_DATA")
                                else []) + [REPO.parent / "shared/data", REPO.parent.parent / "shared/data"]
                    if p.exists()), REPO.parent / "shared/data")
SHARED = SHARED_DATA / "kineto"
H100 = SHARED_DATA / "gpu-h100"
needs_shared = pytest.mark.skipif(not SHARED.exists(), reason=f"shared Kineto traces not found at {SHARED}")
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]

_CACHE = tempfile.mkdtemp(prefix="dtprof-test-cache-")
# A build lock of torch's C++ extensions older than this belongs to a killed session, not a build (minutes at most)
EXTENSION_LOCK_STALE_S = 1800


def _keep_torch_extensions() -> None:
    """The C++ extensions torch builds for a job (DeepSpeed's CPU shared-memory comm op: a g++ build of about a minute
    of CPU) stay in the machine's cache, built by the first session and loaded by the next ones: torch looks for them
    under $XDG_CACHE_HOME, which the suite points at a fresh folder. Set before that (the xdist workers inherit it);
    a TORCH_EXTENSIONS_DIR already set is kept. A build lock left by a killed session would make every later session
    wait forever (torch's FileBaton): one older than any build is removed."""
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        return
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    ext = cache / "torch_extensions" / "dtprof-tests"
    os.environ["TORCH_EXTENSIONS_DIR"] = str(ext)
    for lock in ext.glob("*/lock"):
        try:
            if time.time() - lock.stat().st_mtime > EXTENSION_LOCK_STALE_S:
                lock.unlink()
        except OSError:
            pass


def pytest_configure(config):
    _keep_torch_extensions()
    os.environ["XDG_CACHE_HOME"] = _CACHE
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return   # pytest-xdist's controller runs no test: each worker stores its own calibration (seconds each)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # no stored figure if it fails or runs past its time-out: each run then calibrates itself (slower, not wrong).
    # The time-out once ended a whole session in an INTERNALERROR on a machine loaded ~15x (subprocess.run raises)
    try:
        subprocess.run([sys.executable, "-m", "dtprof.cli", "calibrate", "--device", "cpu", "--dtype", "fp32",
                        "--seconds", "1"], env=env, capture_output=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        pass


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE, ignore_errors=True)


# Each file's time in the suite on the quiet 2-core CI VM (seconds, rounded: estimated from `make test`'s
# --durations and the jobs each file runs), for the order in which xdist hands the files out. Only their order
# matters; a file not listed counts as JOB_FILE_DEFAULT_S (a job file) or UNIT_FILE_DEFAULT_S (a unit file).
FILE_COST_S = {
    "test_deepspeed.py": 560, "test_chaos.py": 330, "test_compiled.py": 250, "test_frameworks.py": 240,
    "test_compare_real.py": 220, "test_rank_jobs.py": 190, "test_numerics.py": 180, "test_triage_e2e.py": 160,
    "test_metrics_export.py": 150, "test_memory.py": 150, "test_compiled_frameworks.py": 140, "test_ray.py": 125,
    "test_triage.py": 120, "test_analyzers_real.py": 100, "test_packaging.py": 100, "test_faults.py": 90,
    "test_hybrid.py": 70, "test_sampling.py": 70,
    # tests/unit (their --durations at load ~13, / 3.6: the ratio of that session's wall to CI's)
    "test_scale.py": 55, "test_report.py": 40, "test_analyzers.py": 25, "test_gpu_time.py": 13,
    "test_one_truth.py": 10, "test_whatif.py": 10,
}
JOB_FILE_DEFAULT_S = 50
UNIT_FILE_DEFAULT_S = 3


def _file_cost_s(path: Path) -> float:
    default = JOB_FILE_DEFAULT_S if TESTS / "jobs" in path.parents else UNIT_FILE_DEFAULT_S
    return FILE_COST_S.get(path.name, default)


def pytest_collection_modifyitems(config, items):
    jobs = TESTS / "jobs"
    for item in items:
        if jobs in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)
    # Under pytest-xdist (`make test`: --dist loadfile --no-loadscope-reorder) files are handed out in this order,
    # the longest first (FILE_COST_S): each worker takes the next file as it runs out of tests, so the long job
    # files run side by side from the start and the short ones (tests/unit's, seconds each) fill the end, where
    # the two workers then finish together. xdist's own order (most tests first) put job files of few but long
    # tests (test_compiled_frameworks.py, test_sampling.py, test_ray.py) at the end, one worker idle meanwhile; the
    # files' alphabetical order left test_ray.py and test_triage_e2e.py (minutes each) near the end.
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: -_file_cost_s(Path(str(item.fspath))))   # stable: a file's tests keep their order


# ------------------------------------------------------------------------------------------------ running dtprof

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def torchrun(script, *args, nproc: int = 2) -> list[str]:
    """The command line of a one-node torchrun job of ``script`` (a path, or a name under examples/)."""
    path = script if os.path.isabs(str(script)) else EXAMPLES / script
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(path),
            *map(str, args)]


def _dtprof_command(args, boot: str | None) -> list[str]:
    code = ["-c", boot] if boot else ["-m", "dtprof.cli"]
    return [sys.executable, *code, *map(str, args)]


def dtprof(*args, cwd=REPO, env=None, timeout: float = 300, boot: str | None = None) -> subprocess.CompletedProcess:
    """``dtprof ARGS`` in a fresh Python, output captured; ``boot`` replaces the entry point's code (a test that
    patches something before the CLI starts)."""
    return subprocess.run(_dtprof_command(args, boot), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def dtprof_popen(*args, cwd=REPO, env=None, boot: str | None = None, **popen) -> subprocess.Popen:
    """``dtprof ARGS`` started in a fresh Python for a test that acts while it runs (signals it, reads its output
    as it comes): stdout and stderr piped as text unless ``popen`` says otherwise (passed to ``subprocess.Popen``)."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen}
    return subprocess.Popen(_dtprof_command(args, boot), cwd=cwd, env=env, **popen)


# Recordings of one test in a row that may hit torch's exit abort before the test itself is rerun: a module fixture
# of many recordings (test_compare_real's eleven) would otherwise record them all again for one abort
RECORD_ATTEMPTS = 3


def dtprof_run(out: Path, *run_args, cwd=REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    """``dtprof run --out OUT RUN_ARGS``, which must succeed; a run whose rank hit torch's exit abort
    (torch_abort.py) is recorded again into a fresh OUT, up to RECORD_ATTEMPTS times, then the test is rerun."""
    from torch_abort import aborted_at_exit, returncode

    for attempt in range(RECORD_ATTEMPTS):
        p = dtprof("run", "--out", out, *run_args, cwd=cwd, timeout=timeout)
        if not aborted_at_exit(p) or attempt == RECORD_ATTEMPTS - 1:
            break
        shutil.rmtree(out, ignore_errors=True)
    assert returncode(p) == 0, f"dtprof run --out {out} exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return p


def record(out: Path, script, *args, opts=(), nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """The one way the suite records a job: ``dtprof run --out OUT --no-report OPTS -- torchrun SCRIPT ARGS``;
    fails the test unless the job and dtprof exit 0 (torch's exit abort is retried: dtprof_run)."""
    return dtprof_run(out, "--no-report", *opts, "--", *torchrun(script, *args, nproc=nproc), timeout=timeout)


def bare_job(folder: Path, code: str, out: str, nproc: int = 2, timeout: float = 180) -> Path:
    """A job without dtprof: ``code`` written to FOLDER/job.py and run by torchrun with one argument, the empty
    folder FOLDER/OUT that it writes into (traces, dumps); fails the test unless it exits 0 (torch's exit abort
    is retried: torch_abort.py). Returns FOLDER/OUT."""
    from torch_abort import bare_returncode

    (folder / "job.py").write_text(code)
    (folder / out).mkdir()
    r = subprocess.run(torchrun(folder / "job.py", folder / out, nproc=nproc), capture_output=True, text=True,
                       timeout=timeout)
    assert bare_returncode(r) == 0, r.stderr[-2000:]
    return folder / out


def import_kineto(out: Path, *traces) -> Path:
    """``dtprof import kineto TRACES -o OUT`` in this process; fails the test unless it exits 0. Returns OUT."""
    from click.testing import CliRunner

    from dtprof.cli import main

    res = CliRunner().invoke(main, ["import", "kineto", *map(str, traces), "-o", str(out)])
    assert res.exit_code == 0, res.output
    return out


# ------------------------------------------------------------------------------------------------ dtprof compare

def write_json(folder: Path, name: str, data: dict) -> str:
    """FOLDER/NAME.json holding ``data`` (a summary.json written by a test); its path as a string."""
    p = folder / f"{name}.json"
    p.write_text(json.dumps(data))
    return str(p)


def compare_cli(*args) -> tuple[int, str]:
    """``dtprof compare ARGS`` in this process: (exit code, output)."""
    from click.testing import CliRunner

    from dtprof.compare import compare_command

    r = CliRunner().invoke(compare_command, list(map(str, args)))
    return r.exit_code, r.output


# ------------------------------------------------------------------------------------------ compiled jobs

@pytest.fixture(scope="module")
def compile_env():
    """The environment of a compiled job, bare or profiled: no dtprof settings inherited, one thread per rank, no
    warnings. Inductor keeps its compiled kernels where torch keeps them for a user (its own cache on this machine,
    keyed by the graph, the torch version and the settings), so bare and profiled runs build a form's kernels once,
    and later sessions none: a fresh cache per session rebuilt the inductor form's C++ every time (its bare job
    43.2 CPU-s with a cold cache, 10.6 with a warm one; the same Dynamo counters and no eager op either way)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("DTPROF_")}
    e.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return e


def bare_and_profiled(job: list, env: dict, cwd: Path) -> tuple[str, str]:
    """The job's stdout bare and under `dtprof run` (its run in ``cwd/run``); fails the test unless both exit 0
    (torch's exit abort is retried: torch_abort.py)."""
    from torch_abort import bare_returncode, returncode

    bare = subprocess.run(job, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert bare_returncode(bare) == 0, bare.stderr[-3000:]
    prof = dtprof("run", "--out", cwd / "run", "--no-report", "--no-nvml", "--", *job, cwd=cwd, env=env, timeout=600)
    assert returncode(prof) == 0, prof.stderr[-3000:]
    return bare.stdout, prof.stdout


# ------------------------------------------------------------------------------------------------ the browser

@pytest.fixture(scope="session")
def browser():
    """Headless Chromium through Playwright, one for the whole session."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Loaded:
    def __init__(self, page, requests, errors):
        self.page, self.requests, self.errors = page, requests, errors


def load(browser, path: Path, name: str) -> Loaded:
    """A report page loaded offline, every chart drawn, a screenshot in test-artifacts/; the requests it made and
    its console errors kept."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    requests, errors = [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.goto(path.as_uri())
    # charts draw lazily (first viewport, then on scroll or when idle); the first screen must come first and on its
    # own, then every chart is forced (the documented drawAll) and must draw
    page.wait_for_selector("body[data-first-screen=done]", state="attached", timeout=60_000)
    page.evaluate("window.dtprofReport.drawAll()")
    page.wait_for_selector("body[data-charts=done]", state="attached", timeout=60_000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"report-{name}.png"), full_page=True)
    return Loaded(page, requests, errors)
