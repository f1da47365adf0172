"""Ray Train, for real (issue 38): examples/frameworks/train_ray.py, a TorchTrainer with 2 CPU workers (DDP over
gloo through ``prepare_model``, ``prepare_data_loader``), three ways:

- bare, on a Ray cluster started apart from the job (``ray start --head``), its driver connecting with
  ``ray.init(address=...)``: the reference weights;
- on that cluster, profiled by the documented line (``dtprof.ray_train(train_func, run_dir=...)``), with rank 1
  raising once at step 3 so that Ray restarts the worker group (``FailureConfig(max_failures=1)``);
- ``dtprof run -- python train_ray.py``: the script starts a local cluster of its own, which inherits dtprof.

What a user checks: every worker is a rank with its steps, spans, DDP's all-reduces and data wait, and no other
process is; the final weights equal the bare job's; the restart shows as rank 1 failing at step 3 with its exception
(and rank 0 stopped with it), both restarted, the statistics covering the second attempt; summary, report, compare
and triage read the run. The cluster is started once for the module (a 100 MB object store, no dashboard)
and stopped at its end (only its own processes: those naming its temporary directory, and their children); the
jobs run once each, side by side, and are shared. The cluster counts 4 CPUs so that its two jobs of 2 workers run
at once (a scheduling label: the machine's cores are shared either way, one thread per process).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.train.torch")
torch = pytest.importorskip("torch")

from conftest import EXAMPLES, free_port  # noqa: E402
from dtprof.reader import open_run  # noqa: E402

SCRIPT = EXAMPLES / "frameworks" / "train_ray.py"
BIN = Path(sys.executable).parent
STEPS = 8
# A token file left in ~/.ray by another cluster would switch this one to token authentication. Ray Train's
# controller polls its workers every 2 s by default and watches for preemption: polled every 0.2 s here and not
# watched, the jobs' orchestration takes seconds less (what the workers compute is the same).
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
       "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
       "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
# A hang guard, not a speed target: the three jobs take 60-70 s together on a quiet 2-core VM and ~180 s on one ~3x
# slower (other load), where CI once ran the restart job past 300 s
JOB_TIMEOUT_S = 600
# the module's jobs run in the first test's setup, which pytest-timeout counts: its guard is above the jobs' own
pytestmark = pytest.mark.timeout(1200)


def _processes_of(temp_dir: str) -> set[int]:
    """Every process of the cluster whose Ray files are under ``temp_dir`` (its command line names them), and
    their descendants (the raylet's workers and agents): only this test's cluster, whatever else runs Ray here."""
    parents, found = {}, set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        state, ppid = stat[stat.rfind(b")") + 2:].split()[:2]
        if state in (b"Z", b"X"):      # exited, not yet reaped
            continue
        parents[int(name)] = int(ppid)
        if temp_dir.encode() in cmd and int(name) != os.getpid():
            found.add(int(name))
    grew = True
    while grew:
        more = {p for p, pp in parents.items() if pp in found} - found
        found |= more
        grew = bool(more)
    return found


def _stop_cluster(temp_dir: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _processes_of(temp_dir)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + 1
        while pids and time.monotonic() < deadline and _processes_of(temp_dir):
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster():
    temp_dir = tempfile.mkdtemp(prefix="dtprof-ray-", dir="/tmp")   # Ray's socket paths must stay short
    port = free_port()
    start = subprocess.run([str(BIN / "ray"), "start", "--head", f"--port={port}", "--num-cpus=4",
                            "--object-store-memory=100000000", "--include-dashboard=false",
                            f"--temp-dir={temp_dir}", "--disable-usage-stats"],
                           env=ENV, capture_output=True, text=True, timeout=120)
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        yield f"127.0.0.1:{port}"
    finally:
        _stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _job(args, cwd, timeout=JOB_TIMEOUT_S):
    t0 = time.monotonic()
    p = subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    print(f"{' '.join(args[-6:])}: {time.monotonic() - t0:.1f} s")
    return p


def _dtprof(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "dtprof.cli", *args], env=ENV, capture_output=True, text=True,
                       timeout=120)
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    d = tmp_path_factory.mktemp("ray")
    job = [sys.executable, str(SCRIPT), "--steps", str(STEPS), "--storage", str(d / "storage")]
    t0 = time.monotonic()
    # the local-cluster job under `dtprof run` runs beside the cluster's jobs (its own cluster, its own 2 CPUs)
    local = subprocess.Popen([sys.executable, "-m", "dtprof.cli", "run", "--out", str(d / "local"), "--",
                              *job, "--weights", str(d / "local.pt")], cwd=d, env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    on_cluster = [*job, "--address", cluster]
    bare = subprocess.Popen([*on_cluster, "--weights", str(d / "bare.pt")], cwd=d, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        restart = _job([*on_cluster, "--weights", str(d / "restart.pt"), "--run-dir", str(d / "cluster"),
                        "--fail-once", str(d / "failed-once")], cwd=d)
        bare_out, _ = bare.communicate(timeout=JOB_TIMEOUT_S)
        assert bare.returncode == 0, bare_out[-5000:]
        out, _ = local.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        for p in (local, bare):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert local.returncode == 0, out[-5000:]
    print(f"ray jobs: {time.monotonic() - t0:.1f} s")
    summary = _dtprof("summary", str(d / "cluster"))
    return {"dir": d, "cluster": d / "cluster", "local": d / "local", "restart_output": restart.stdout +
            restart.stderr, "summary_text": summary.stdout, "local_output": out}


def _weights(path):
    return torch.load(path)


def test_same_final_weights_as_bare(jobs):
    d = jobs["dir"]
    bare = _weights(d / "bare.pt")
    for name in ("restart.pt", "local.pt"):
        other = _weights(d / name)
        assert set(other) == set(bare)
        assert all(torch.equal(bare[k], other[k]) for k in bare), name


@pytest.mark.parametrize("which", ["cluster", "local"])
def test_each_worker_is_a_rank(jobs, which):
    run = open_run(jobs[which])
    s = json.loads((jobs[which] / "summary.json").read_text())["run"]
    assert sorted(run.ranks["rank"]) == [0, 1] and run.world_size == 2
    assert s["ranks_missing"] == [] and s["unidentified_processes"] == [] and s["status"] == "completed"
    assert set(run.ranks["backend"].astype(str)) == {"gloo"}
    steps = run.steps.groupby("rank")["step"].agg(["min", "max", "count"])
    assert steps.to_dict("index") == {r: {"min": 0, "max": STEPS - 1, "count": STEPS} for r in (0, 1)}
    kinds = run.spans.groupby("rank")["kind"].agg(lambda k: set(k.astype(str)))
    for r in (0, 1):
        assert {"forward", "backward", "optimizer", "data_wait"} <= kinds[r]
    ddp = run.collectives[run.collectives["api"].astype(str) == "ddp_bucket"]
    params = 64 * 64 + 64 + 64 * 4 + 4
    assert (ddp.groupby(["rank", "op"], observed=True)["in_bytes"].sum() == params * 4 * STEPS).all()
    assert sorted(ddp["rank"].unique()) == [0, 1]


def test_cluster_run_is_one_run_of_the_workers(jobs):
    run = open_run(jobs["cluster"])
    assert run.manifest["created_by"] == "dtprof.ray_train"
    # one node directory per worker process: the two of the second attempt are the run's ranks
    assert [(n["attempt_rank"], n["attempt"], n["status"]) for n in sorted(run.nodes, key=lambda n: n["attempt_rank"])
            ] == [(0, 2, "completed"), (1, 2, "completed")]
    assert len(list(jobs["cluster"].glob("node-*"))) == 4


def test_restart_is_one_rank_failed_and_restarted(jobs):
    s = json.loads((jobs["cluster"] / "summary.json").read_text())["run"]
    (r0, r1) = s["restarts"]
    assert (r1["rank"], r1["attempt"], r1["status"], r1["step"]) == (1, 1, "failed", 3)
    assert r1["exception"] == "RuntimeError: injected failure at step 3"
    assert r1["restarted"] and r1["restart_s"] > 0
    assert (r0["rank"], r0["attempt"], r0["status"]) == (0, 1, "stopped") and r0["restarted"]
    assert s["attempts"] == {"0": 2, "1": 2}
    text = jobs["summary_text"]
    assert ("[restart] rank 1 attempt 1 failed at step 3 (RuntimeError: injected failure at step 3); restarted at "
            in text)
    assert "statistics cover each rank's last attempt (rank 0: attempt 2, rank 1: attempt 2)" in text
    tri = _dtprof("triage", str(jobs["cluster"]), "--json")
    verdict = json.loads(tri.stdout)
    assert verdict["verdict"] == "healthy", verdict
    assert "failed at step 3 (RuntimeError: injected failure at step 3) and was restarted" in verdict["message"]
    assert [e["kind"] for e in verdict["evidence"]].count("restart") == 3


def test_report_and_compare_read_the_runs(jobs):
    rep = _dtprof("report", str(jobs["cluster"]))
    page = (jobs["cluster"] / "report.html").read_text()
    assert "rank 1 attempt 1 failed at step 3 (RuntimeError: injected failure at step 3)" in page, rep.stderr
    cmp = _dtprof("compare", str(jobs["local"]), "--head", str(jobs["cluster"]), check=False)
    assert cmp.returncode in (0, 1, 3), cmp.stdout + cmp.stderr
    assert "step-time gates" in cmp.stdout


def test_run_dir_of_another_job_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """A run directory holding another job's run: the worker says so in one line and trains unprofiled."""
    import ray.train

    from dtprof.collectors import raytrain
    from dtprof.rundir.writer import create_run_dir

    create_run_dir(tmp_path / "run", {}, join_id="another job")

    class Context:
        def get_world_rank(self):
            return 0

        def get_experiment_name(self):
            return "exp"

    monkeypatch.setattr(ray.train, "get_context", Context)
    monkeypatch.delenv("DTPROF_NODE_DIR", raising=False)
    assert raytrain._Worker.start(str(tmp_path / "run"), {}) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dtprof: ") and "not recorded" in err[0]
    assert raytrain.ray_train(lambda: 7, tmp_path / "run")() == 7     # the training function's result, unchanged
