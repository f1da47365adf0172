"""Drive a real torchrun gloo job the way `dtprof run` does (tee'd logs, DTPROF_NODE_DIR, a Watchdog), without
the launcher: used by tests/jobs/test_triage.py until the launcher lands, and handy by hand:

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

from dtprof.rundir.writer import create_node_dir, create_run_dir
from dtprof.watchdog import HANG_EXIT_CODE, Watchdog

JOB = Path(__file__).with_name("job.py")
STOP_GRACE_S = 5.0


def _tee(src, path: Path):
    with open(path, "ab") as f:
        for line in iter(src.readline, b""):
            f.write(line)
            f.flush()


class Job:
    """One torchrun job of job.py, started in the background with its logs tee'd into the node directory."""

    def __init__(self, run_dir: Path, mode: str, nproc: int = 4, hang_timeout: float | None = 5.0, job_args=()):
        create_run_dir(run_dir, {"command": ["harness", mode]})
        self.run_dir = Path(run_dir)
        self.node_dir = create_node_dir(run_dir)
        env = dict(os.environ, DTPROF_NODE_DIR=str(self.node_dir), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--monitor-interval=0.2", str(JOB), mode, *job_args]
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        self.tees = [threading.Thread(target=_tee, args=(self.proc.stdout, self.node_dir / "stdout.log"), daemon=True),
                     threading.Thread(target=_tee, args=(self.proc.stderr, self.node_dir / "stderr.log"), daemon=True)]
        for t in self.tees:
            t.start()
        self.stopped_at: list[float] = []
        self.wd = Watchdog(self.node_dir, hang_timeout, self.stop_job) if hang_timeout else None
        if self.wd:
            self.wd.start()

    def stop_job(self):
        """What the launcher does: SIGTERM to torchrun's process group, SIGKILL after a grace period."""
        self.stopped_at.append(time.monotonic())
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, limit_s: float = 120.0) -> dict:
        try:
            rc = self.proc.wait(limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait()
        for t in self.tees:
            t.join(5)
        end = time.monotonic()
        if self.wd:
            self.wd.on_job_exit(rc)
        fired = bool(self.wd and self.wd.fired)
        return {"rc": HANG_EXIT_CODE if fired else rc, "job_rc": rc, "fired": fired, "end_s": end - self.t0,
                "stopped_s": (self.stopped_at[0] - self.t0) if self.stopped_at else None,
                "node_dir": self.node_dir, "run_dir": self.run_dir}


def run_job(run_dir: Path, mode: str, nproc: int = 4, hang_timeout: float | None = 5.0, job_args=(),
            limit_s: float = 120.0) -> dict:
    """Run job.py MODE under torchrun with a Watchdog until it ends; see Job.wait for the result."""
    return Job(run_dir, mode, nproc, hang_timeout, job_args).wait(limit_s)


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
