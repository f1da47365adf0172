"""`dtprof run --hang-timeout` + `dtprof triage` end to end: the real launcher, rank runtime and watchdog on real
torchrun gloo jobs of an unmodified script (tests/triage_jobs/plain_train.py). Three ranks a job (two where the
case needs no bystander): the culprit, rank 1, has a peer on each side, neither the first nor the last rank, as
it had with four (a fourth rank was one more start-up of torch in each job, nothing more to tell apart).

Skipped only while the launcher (dtprof/launcher.py) or the rank runtime (collectors/runtime.py) is not in this
checkout; tests/jobs/test_triage.py proves the same logic with a stand-in runtime meanwhile.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, TESTS, dtprof, dtprof_popen
from torch_abort import returncode

PLAIN = TESTS / "triage_jobs" / "plain_train.py"
HANG_TIMEOUT_S = 15.0  # above the stalls a loaded 2-core CI machine shows in a healthy job (see test_triage.py)

missing = [name for name, path in (("dtprof.launcher", REPO / "dtprof" / "launcher.py"),
                                   ("collectors/runtime.py", REPO / "collectors" / "runtime.py"))
           if not path.exists()]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(missing), reason=f"{' and '.join(missing)} not in this checkout yet")]


def _run_args(out: Path, mode: str, *extra_run_opts, nproc: int = 3) -> tuple[list, dict]:
    """`dtprof run`'s arguments and environment for a job of plain_train.py in ``mode``."""
    cmd = ["run", "--out", str(out), "--no-report", "--hang-timeout", str(HANG_TIMEOUT_S), *extra_run_opts, "--",
           sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--monitor-interval=0.2",
           str(PLAIN), mode]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return cmd, env


def dtprof_run(out: Path, mode: str, *extra_run_opts, boot: str | None = None, nproc: int = 3) -> tuple:
    cmd, env = _run_args(out, mode, *extra_run_opts, nproc=nproc)
    t0 = time.monotonic()
    proc = dtprof(*cmd, env=env, boot=boot, cwd=None)
    return proc, time.monotonic() - t0


@pytest.fixture(scope="module")
def stalled(tmp_path_factory):
    """The two jobs that end by the hang timeout, run side by side: each spends HANG_TIMEOUT_S idle (its ranks
    blocked or stopped) before the watchdog fires, and that wait is the same alone or beside the other job (the
    clock starts once training has: dtprof/watchdog.py). ``hang``: 3 ranks, rank 1 stuck in its data loader;
    ``stop``: 3 ranks, rank 1 SIGSTOPped. {mode: (run dir, CompletedProcess)}."""
    jobs = {}
    for mode, nproc in (("hang", 3), ("stop", 3)):
        out = tmp_path_factory.mktemp(mode) / "r"
        cmd, env = _run_args(out, mode, nproc=nproc)
        jobs[mode] = out, cmd, dtprof_popen(*cmd, env=env, cwd=None)
    done = {}
    try:
        for mode, (out, cmd, p) in jobs.items():
            stdout, stderr = p.communicate(timeout=300)
            done[mode] = out, subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)
    finally:
        for _, _, p in jobs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def triage_json(run_dir: Path) -> dict:
    proc = dtprof("triage", run_dir, "--json", timeout=120, cwd=None)
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


def test_hang_exit_124_culprit_and_collective(stalled):
    run_dir, proc = stalled["hang"]
    assert proc.returncode == 124, proc.stderr[-2000:]
    out = triage_json(run_dir)
    assert out["verdict"] == "hang" and out["culprit_ranks"] == [1], out
    assert out["collective"]["op"] == "all_reduce"
    assert "plain_train.py" in out["message"] and "__next__" in out["message"]
    node = next(run_dir.glob("node-*"))
    hang = json.loads((node / "triage" / "hang.json").read_text())
    newest = max(v["last_progress_ns"] for v in hang["ranks"].values())
    assert (hang["stopped_ns"] - newest) / 1e9 <= HANG_TIMEOUT_S + 15


@pytest.mark.parametrize("mode, words", [("raise", "exited with code 1"), ("kill", "killed by SIGKILL")])
def test_crash_attributed(tmp_path, mode, words):
    proc, _ = dtprof_run(tmp_path / "r", mode)
    assert proc.returncode not in (0, 124), proc.stderr[-2000:]
    out = triage_json(tmp_path / "r")
    assert out["verdict"] == "crash" and out["culprit_ranks"] == [1] and words in out["message"], out
    if mode == "raise":   # the rank's own exception and where in the user's code it was raised
        assert "RuntimeError: loss is NaN at step" in out["message"], out["message"]
        assert "plain_train.py:" in out["message"] and "heartbeat.py" not in out["message"], out["message"]


def test_abort_in_teardown_is_told_apart_from_a_crash_in_training(tmp_path):
    # torch's own exit abort (tests/torch_abort.py) ends a finished job with SIGABRT: triage must not report it as a
    # crash "at step 8" of a training that in fact completed
    proc, _ = dtprof_run(tmp_path / "r", "abort_at_exit", nproc=2)
    assert proc.returncode not in (0, 124), proc.stderr[-2000:]
    out = triage_json(tmp_path / "r")
    assert out["verdict"] == "crash" and out["culprit_ranks"] == [1], out
    assert "killed by SIGABRT during its process's exit, after its last step (7): its training had ended" \
        in out["message"], out["message"]
    assert "at step" not in out["message"], out["message"]
    # the job's output shows libstdc++'s line, which torch's gloo teardown abort prints: its known cause is named
    assert "torch's own teardown abort" in out["message"] and "pytorch issue #190489" in out["message"], out["message"]


def test_a_job_that_fails_before_its_first_step_is_analysed_without_error(tmp_path):
    # the first thing a user meets when their script is broken: every command still answers (a run with no step
    # once crashed the node summary, the summary and the report with an IndexError)
    proc, _ = dtprof_run(tmp_path / "r", "raise_at_start")
    assert proc.returncode not in (0, 124) and "failed:" not in proc.stderr, proc.stderr[-2000:]
    out = triage_json(tmp_path / "r")
    assert out["verdict"] == "crash" and "RuntimeError: no such dataset" in out["message"], out
    summary = dtprof("summary", tmp_path / "r", timeout=120, cwd=None)
    assert summary.returncode == 0 and "steps: 0 measured" in summary.stdout, summary.stderr[-2000:]
    report = dtprof("report", tmp_path / "r", "-o", tmp_path / "report.html", timeout=120, cwd=None)
    assert report.returncode == 0 and "no such dataset" in (tmp_path / "report.html").read_text(), report.stderr


def test_mismatch_named(tmp_path):
    dtprof_run(tmp_path / "r", "mismatch")
    out = triage_json(tmp_path / "r")
    assert out["verdict"] == "mismatch" and out["culprit_ranks"] == [1], out
    assert out["collective"]["op"] == "broadcast"


def test_straggler_with_throttled_gpu_at_the_pynvml_boundary(tmp_path):
    if not (TESTS / "fake_pynvml.py").exists():
        pytest.skip("tests/fake_pynvml.py (launcher helper) not in this checkout yet")
    boot = ("import sys, fake_pynvml; sys.modules['pynvml'] = fake_pynvml.make(gpus=4, values={1: "
            "{'throttle': 0x40, 'sm_mhz': 900, 'temp_c': 92, 'power_mw': 180000}});"
            "from dtprof.cli import main; main()")
    proc, _ = dtprof_run(tmp_path / "r", "slow", "--nvml-interval", "0.05", boot=boot)
    assert returncode(proc) == 0, proc.stderr[-2000:]
    out = triage_json(tmp_path / "r")
    assert out["verdict"] == "straggler" and out["culprit_ranks"] == [1], out
    nv = next(e for e in out["evidence"] if e["kind"] == "nvml")
    assert nv["gpu"] == 1 and "hw_thermal_slowdown" in nv["throttle_reasons"] and nv["sm_clock_mhz_mean"] == 900


def test_healthy(tmp_path):
    proc, _ = dtprof_run(tmp_path / "r", "healthy")
    assert returncode(proc) == 0, proc.stderr[-2000:]
    assert triage_json(tmp_path / "r")["verdict"] == "healthy"


def _left_running(node: Path) -> list[int]:
    """Live processes whose environment names this node directory (the ranks, torchrun)."""
    entry = f"DTPROF_NODE_DIR={node.resolve()}".encode()
    out = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if entry in env and state not in ("Z", "X"):
            out.append(int(name))
    return out


def test_frozen_rank_is_named_by_its_stopped_heartbeat(stalled):
    # issue 50: a rank SIGSTOPped (a process frozen, as one stuck in the kernel or on a dead device is) gave "hang"
    # with no culprit; its heartbeat is the one that stopped while the others beat on inside the all-reduce
    run_dir, proc = stalled["stop"]
    assert proc.returncode == 124, proc.stderr[-2000:]
    out = triage_json(run_dir)
    assert out["verdict"] == "hang" and out["culprit_ranks"] == [1], out
    assert "rank 1 (host " in out["message"] and "its process is stopped (SIGSTOP)" in out["message"], out["message"]
    node = next(run_dir.glob("node-*"))
    hang = json.loads((node / "triage" / "hang.json").read_text())["ranks"]
    assert hang["1"]["process_state"] == "T" and hang["1"]["heartbeat_age_s"] >= 5, hang
    assert max(hang[r]["heartbeat_age_s"] for r in ("0", "2")) < 2.5, hang   # the others beat on
    assert _left_running(node) == []   # the stopped rank too (SIGKILL reaches a stopped process)


def test_killed_agent_is_named_not_a_rank(tmp_path):
    # issue 50: torchrun's agent SIGKILLed gave "crash: rank 1 exited at step 6", blaming a rank for its launcher's
    # death; the launcher saw its command die first, and the ranks only lost their parent
    proc, _ = dtprof_run(tmp_path / "r", "kill_agent", nproc=3)
    assert proc.returncode == 128 + 9, proc.stderr[-2000:]
    out = triage_json(tmp_path / "r")
    assert out["verdict"] == "crash" and out["culprit_ranks"] == [], out
    assert out["message"].startswith("crash: torchrun's agent (pid ") and "was killed by SIGKILL" in out["message"]
    assert "no rank failed" in out["message"] and "trained on to their end" in out["message"], out["message"]
    node = next((tmp_path / "r").glob("node-*"))
    info = json.loads((node / "node.json").read_text())
    assert f"pid {info['command_pid']}," in out["message"]
    assert _left_running(node) == []
    # as without dtprof, the ranks trained on without their agent, to the script's last step (8 steps)
    from dtprof.reader import open_run
    steps = open_run(tmp_path / "r").steps
    assert steps.groupby("rank")["step"].nunique().to_dict() == {0: 8, 1: 8, 2: 8}, steps
