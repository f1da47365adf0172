"""Drive a real torchrun gloo job the way `dtprof run` does (tee'd logs, DTPROF_NODE_DIR, a Watchdog), without
the launcher: used by tests/test_triage.py until the launcher lands, and handy by hand:

    python tests/triage_jobs/harness.py OUT MODE [--nproc 4] [--hang-timeout 5] [job args...]
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from dtprof.runformat import create_node_dir, create_run_dir
from dtprof.watchdog import HANG_EXIT_CODE, Watchdog

JOB = Path(__file__).with_name("job.py")
STOP_GRACE_S = 5.0


def _tee(src, path: Path):
    with open(path, "ab") as f:
        for line in iter(src.readline, b""):
            f.write(line)
            f.flush()


def run_job(run_dir: Path, mode: str, nproc: int = 4, hang_timeout: float | None = 5.0, job_args=(),
            limit_s: float = 120.0) -> dict:
    """Run job.py MODE under torchrun with a Watchdog; return exit code, timings and the node dir."""
    create_run_dir(run_dir, {"command": ["harness", mode]})
    node_dir = create_node_dir(run_dir)
    env = dict(os.environ, DTPROF_NODE_DIR=str(node_dir), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--monitor-interval=0.2",
           str(JOB), mode, *job_args]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    tees = [threading.Thread(target=_tee, args=(proc.stdout, node_dir / "stdout.log"), daemon=True),
            threading.Thread(target=_tee, args=(proc.stderr, node_dir / "stderr.log"), daemon=True)]
    for t in tees:
        t.start()
    stopped_at = []

    def stop_job():
        """What the launcher does: SIGTERM to torchrun's process group, SIGKILL after a grace period."""
        stopped_at.append(time.monotonic())
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    wd = Watchdog(node_dir, hang_timeout, stop_job) if hang_timeout else None
    if wd:
        wd.start()
    try:
        rc = proc.wait(limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    for t in tees:
        t.join(5)
    end = time.monotonic()
    if wd:
        wd.on_job_exit(rc)
    fired = bool(wd and wd.fired)
    return {"rc": HANG_EXIT_CODE if fired else rc, "job_rc": rc, "fired": fired, "elapsed_s": end - t0,
            "stopped_s": (stopped_at[0] - t0) if stopped_at else None, "end_s": end - t0, "node_dir": node_dir,
            "run_dir": run_dir}


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("mode")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--hang-timeout", type=float, default=5.0)
    a, rest = p.parse_known_args()
    r = run_job(Path(a.out), a.mode, a.nproc, a.hang_timeout, rest)
    print(r)
    sys.exit(r["rc"])
