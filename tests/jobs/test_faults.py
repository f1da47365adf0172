"""Faults users meet in production, with real torchrun jobs under `dtprof run` (issue 15).

- A hang with every rank blocked inside C++ (rank 1 in ``recv``, rank 0 in DDP's backward all-reduce):
  ``--hang-timeout`` must leave no process of the job running (checked by pid), and record the stop.
- A full disk under the run directory (a small tmpfs): all of the job's output still reaches the terminal, the
  job is not blocked, dtprof says "disk full" and leaves no temporary files.
- ``kill -9`` of ``dtprof run``: the job runs to its end unharmed (no BrokenPipeError), its records stay readable
  and summary and triage say "interrupted: the launcher was killed".
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import dtprof, dtprof_popen
from dtprof.cli import main
from torch_abort import returncode

pytestmark = pytest.mark.slow

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def rank_pids(node: Path) -> dict[int, int]:
    return {int(p.parent.name.split("-")[1]): json.loads(p.read_text())["pid"] for p in node.glob("rank-*/rank.json")}


def job_pids(node: Path) -> list[int]:
    """Every live process whose environment names this node directory: the ranks, torchrun, their children."""
    entry = f"DTPROF_NODE_DIR={node.resolve()}".encode()
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if entry in f.read().split(b"\0") and alive(int(name)):
                        out.append(int(name))
            except OSError:
                pass
    return out


def invoke(args):
    return CliRunner().invoke(main, [str(a) for a in args])


# ---- a hang inside C++ -------------------------------------------------------------------------------------------

HANG_JOB = textwrap.dedent("""
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1000):
        if step == 3 and rank == 1:
            dist.recv(torch.zeros(4), src=0)   # rank 0 never sends: blocked inside gloo (C++)
        model(torch.randn(8, 16)).sum().backward()   # rank 0: blocked in DDP's all-reduce
        opt.step()
        opt.zero_grad()
""")


def test_hang_in_cpp_leaves_no_process_running(tmp_path):
    (tmp_path / "job.py").write_text(HANG_JOB)
    t0 = time.monotonic()
    # 15 s: the suite's figure for a hang (test_triage.py: above the stalls of a healthy job on a loaded 2-core
    # machine). The ranks' start-up (a slow `import torch`) is not counted: the watchdog's clock starts once
    # training has (dtprof/watchdog.py); the ranks' own hang dumps below show it fired on the hang inside C++.
    proc = dtprof("run", "--out", "r", "--no-nvml", "--no-report", "--hang-timeout", "15", "--", *TORCHRUN,
                  "job.py", cwd=tmp_path)
    took = time.monotonic() - t0
    assert proc.returncode == 124, proc.stderr[-3000:]
    node = next((tmp_path / "r").glob("node-*"))
    pids = rank_pids(node)
    assert sorted(pids) == [0, 1]
    where = {r: " | ".join(f"{f['func']}:{f['code']}" for t in json.loads(
        (node / f"rank-{r}" / "dump-hang.json").read_text())["stacks"] if t["main"] for f in t["frames"])
        for r in (0, 1)}
    assert "dist.recv" in where[1] and "backward" in where[0], where   # both main threads inside C++ calls
    # No process of the job outlives `dtprof run`: not the ranks (in C++, in sessions of their own), not torchrun.
    assert [p for p in pids.values() if alive(p)] == [] and job_pids(node) == []
    info = json.loads((node / "node.json").read_text())
    stop = next(s for s in info["stops"] if s["reason"] == "hang-timeout")
    assert stop["survivors"] == [] and stop["sigterm_sent_to"] >= 3 and stop["grace_s"] == 10
    # SIGTERM alone stops the ranks (dtprof's heartbeat no longer swallows it): no SIGKILL was needed, and the
    # stop took a few seconds at most (the heartbeat's 2 s fallback plus its dump; not the 10 s grace).
    assert stop["sigkill_sent_to"] == 0 and stop["took_s"] < 10, stop
    assert "none left running" in proc.stderr and took < 200
    assert "forcefully exiting via SIGKILL" not in proc.stderr   # torchrun's SIGTERM stopped the ranks too
    res = invoke(["triage", tmp_path / "r"])
    assert res.exit_code == 1 and res.output.startswith("hang:"), res.output
    assert "(hang-timeout)" in res.output and "none left running" in res.output


def _wait_for_steps(node: Path, step: int, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        steps = []
        for p in node.glob("rank-*/heartbeat.json"):
            try:
                steps.append(json.loads(p.read_text()).get("step") or 0)
            except (OSError, ValueError):
                pass
        if len(steps) == 2 and min(steps) >= step:
            return
        time.sleep(0.5)
    raise AssertionError(f"the ranks never reached step {step}")


def test_sigterm_to_dtprof_run_stops_ranks_stuck_in_cpp(tmp_path):
    """SIGTERM to `dtprof run` while every rank is inside C++: SIGTERM alone stops them (torchrun need not fall
    back to SIGKILL after its 30 s), and no process of the job is left."""
    (tmp_path / "job.py").write_text(HANG_JOB)
    launcher = dtprof_popen("run", "--out", "r", "--no-nvml", "--no-report", "--", *TORCHRUN, "job.py",
                            cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "r").glob("node-*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        node = next((tmp_path / "r").glob("node-*"))
        _wait_for_steps(node, 3)
        time.sleep(2)   # rank 1 is in recv, rank 0 in the all-reduce of step 3's backward
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert "forcefully exiting via SIGKILL" not in err, err[-3000:]
    pids = rank_pids(node)
    assert sorted(pids) == [0, 1] and [p for p in pids.values() if alive(p)] == [] and job_pids(node) == []
    assert json.loads((node / "node.json").read_text())["signals_forwarded"] == ["SIGTERM"]


# ---- a full disk -------------------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs; skipped where mounting is not permitted."""
    d = tmp_path / "disk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


CHATTY_JOB = textwrap.dedent("""
    import os, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for i in range(20000):
        print(f"rank {rank} line {i:05d} " + "x" * 60)
    dist.barrier()
    dist.destroy_process_group()
""")

QUIET_JOB = textwrap.dedent("""
    import os, time, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:   # something else fills the disk the run directory is on
        try:
            with open(os.path.join(os.environ["DTPROF_NODE_DIR"], "..", "..", "filler"), "wb") as f:
                while True:
                    f.write(b"0" * 65536)
                    f.flush()
        except OSError:
            pass
    dist.barrier()
    for i in range(15):
        print(f"rank {rank} loss {i}", flush=True)
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()
""")


def test_full_disk_never_blocks_a_chatty_job(small_disk, tmp_path):
    (tmp_path / "job.py").write_text(CHATTY_JOB)
    proc = dtprof("run", "--out", small_disk / "r", "--no-nvml", "--", *TORCHRUN, "job.py", cwd=tmp_path,
                  timeout=240)
    assert returncode(proc) == 0, proc.stderr[-3000:]
    # Two ranks share the pipe and Python writes a line's text and its newline separately, so lines can
    # interleave: count each rank's numbered lines wherever they are.
    seen = set(re.findall(r"rank (\d) line (\d{5})", proc.stdout))
    assert len(seen) == 40000, len(seen)
    assert "disk full" in proc.stderr and "Traceback" not in proc.stderr
    assert not list(small_disk.rglob("*.tmp"))   # no half-written report, manifest or table left behind


def test_full_disk_never_silences_a_quiet_job(small_disk, tmp_path):
    (tmp_path / "job.py").write_text(QUIET_JOB)
    proc = dtprof("run", "--out", small_disk / "r", "--no-nvml", "--", *TORCHRUN, "job.py", cwd=tmp_path,
                  timeout=240)
    assert returncode(proc) == 0, proc.stderr[-3000:]
    assert len(set(re.findall(r"rank (\d) loss (\d+)", proc.stdout))) == 30, proc.stdout[-2000:]
    assert "disk full" in proc.stderr and "Traceback" not in proc.stderr
    assert not list(small_disk.rglob("*.tmp"))
    # the job's end is recorded in the room dtprof kept for it: the run is not read as its launcher killed
    node = json.loads(next((small_disk / "r").glob("node-*/node.json")).read_text())
    assert node["status"] == "completed" and node["disk_full"], node
    tri = dtprof("triage", small_disk / "r", "--json", cwd=tmp_path)
    assert json.loads(tri.stdout)["verdict"] == "healthy", tri.stdout[-2000:]


# ---- the launcher killed -----------------------------------------------------------------------------------------

LONG_JOB = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(40):
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 or step % 10 == 0:   # rank 0 prints every step, rank 1 now and then
            print(f"rank {rank} step {step}", flush=True)
            print(f"rank {rank} err {step}", file=sys.stderr, flush=True)
        time.sleep(0.25)
    dist.destroy_process_group()
    open(f"done-{rank}", "w").write("ok")
""")


def test_killed_launcher_does_not_harm_the_job(tmp_path):
    (tmp_path / "job.py").write_text(LONG_JOB)
    launcher = dtprof_popen("run", "--out", "r", "--no-nvml", "--", *TORCHRUN, "job.py", cwd=tmp_path)
    # the job is running and printing. Read its first line byte by byte: readline() would buffer the lines behind
    # it, which communicate() (reading the raw pipe) then never sees -- "rank 0 step 0" went missing that way once
    first = ""
    while not first.endswith("\n"):
        byte = os.read(launcher.stdout.fileno(), 1)
        if not byte:
            break
        first += byte.decode()
    assert first.startswith("rank "), first
    launcher.kill()
    launcher.wait()
    out, err = launcher.communicate(timeout=120)   # the relays keep our pipes open until the job ends
    for rank in (0, 1):
        deadline = time.monotonic() + 120
        while not (tmp_path / f"done-{rank}").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert (tmp_path / f"done-{rank}").exists(), (rank, err[-3000:])
    assert "BrokenPipeError" not in err and "Traceback" not in err, err[-3000:]
    # every line reached the terminal, after the kill too
    assert len(set(re.findall(r"rank 0 step (\d+)", first + out))) == 40, out[-2000:]
    node = next((tmp_path / "r").glob("node-*"))
    deadline = time.monotonic() + 30
    while job_pids(node) and time.monotonic() < deadline:   # torchrun's own teardown after the ranks' end
        time.sleep(0.5)
    res = invoke(["summary", tmp_path / "r", "--no-write"])
    assert res.exit_code == 0, res.output
    assert "status interrupted" in res.output and "interrupted: the launcher was killed" in res.output
    res = invoke(["triage", tmp_path / "r"])
    assert res.exit_code == 1 and res.output.startswith("interrupted: the launcher was killed"), res.output
    assert json.loads(invoke(["triage", tmp_path / "r", "--json"]).output)["verdict"] == "interrupted"
