"""`dtprof run`: start a training job with every rank profiled, sample the node's GPUs, analyse when it ends.

One launcher per node. It creates the run directory (or joins it, for the other nodes of a torchrun job with the
same ``--rdzv-id``), its own ``node-<host>-<pid>`` directory, starts the NVML sampler thread, and runs the command
in its own session with the environment the rank side reads (``DTPROF_NODE_DIR``, ``DTPROF_CONFIG``, and the
directory of ``dtprof/_inject/sitecustomize.py`` first on ``PYTHONPATH``). After the job it merges captured
Kineto traces, compacts the node to Parquet, writes summary.json and report.html, and exits with the job's code.

Decisions (documented in ``dtprof run --help`` and docs/cli-run.md)
- The job's stdout/stderr are pipes that two relay processes (dtprof/relay.py) copy through as bytes arrive (and
  tee to ``node_dir/stdout.log`` / ``stderr.log``, every 0.5 s); they outlive a killed launcher and put the
  terminal before the log, so neither a full disk nor ``kill -9`` of ``dtprof run`` blocks, silences or breaks the
  job.
  ``PYTHONUNBUFFERED=1`` is set unless the user set it, so Python output stays live through the pipe.
- The job runs in its own session. Its processes are tracked by parentage and by the ``DTPROF_NODE_DIR`` in their
  environment, whatever their process group (torchrun gives each worker its own). SIGINT/SIGTERM/SIGHUP to
  ``dtprof run`` are forwarded to the command's process group; a second one SIGKILLs every process of the job.
  When the hang watchdog fires, and whenever the command ends with processes of the job still running, they get
  SIGTERM, then SIGKILL after ``KILL_GRACE_S``, and a check; each such stop is recorded in node.json ("stops")
  and the events table. A command killed by a signal dtprof did not forward (torchrun's agent SIGKILLed) leaves
  its ranks training, as they would without dtprof: they are waited for while their heartbeats show progress
  (``ORPHAN_IDLE_S``), and only then stopped.
- Exit code: the job's own; 128+N if it died of signal N (the shell convention); 124 if the hang watchdog stopped
  it; 2 for dtprof's own usage errors (an existing run directory, bad options). Post-run analysis never changes it.
- This process never imports torch, and dtprof does not depend on it: the job brings its own. Before starting the
  job, the launcher asks the job's Python (``python`` in the command, or the interpreter in the shebang of
  ``torchrun`` / the script) whether it can import torch and dtprof, and refuses with exit 2 when it cannot.
"""
from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import click

from dtprof import launch_deepspeed, machine
from dtprof.cli import InputError
from dtprof.machine import TORCHRUN_MODULES, option_value, script_index
from dtprof.relay import DISK_FULL_EXIT, LOG_FAILED_EXIT
from dtprof.rundir.conform import RunFormatError
from dtprof.rundir.files import read_table_text
from dtprof.rundir.schema import table_files, unidentified_files
from dtprof.rundir.writer import (
    FAULT_EVENT,
    NODE_MANIFEST,
    RANK_PREFIX,
    NodeTableWriter,
    RunExistsError,
    create_node_dir,
    create_run_dir,
    stop_text,
    write_json_atomic,
)

DTYPES = ("bf16", "fp16", "tf32", "fp32", "fp8")
WATCHDOG_EXIT = 124
USAGE_EXIT = InputError.exit_code
DEFAULT_METRICS_INTERVAL_S = 10.0   # --metrics-interval: a week of 8 ranks' points stays in the tens of MB
# ranks left running by a killed command are waited for while they progress; this long without, they are stopped
ORPHAN_IDLE_S = 30.0
KILL_GRACE_S = 10.0    # a stop's SIGTERM, then SIGKILL to every process of the job still alive this much later
ENV_PREFIXES = ("NCCL_", "TORCH_", "PYTORCH_", "CUDA_", "NVIDIA_", "OMP_", "MKL_", "GLOO_", "PET_", "TORCHELASTIC_",
                "SLURM_JOB", "SLURM_NODE", "SLURM_PROCID", "SLURM_NTASKS", "DTPROF_")
ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
             "GROUP_RANK", "PYTHONPATH", "PYTHONUNBUFFERED", "LD_LIBRARY_PATH", "HOSTNAME")


# ---- small pure helpers (unit-tested) ------------------------------------------------------------------------

def utc_iso(ts: float | None = None) -> str:
    t = _dt.datetime.fromtimestamp(time.time() if ts is None else ts, tz=_dt.timezone.utc)
    return t.isoformat(timespec="microseconds").replace("+00:00", "Z")


def utc_stamp(ts: float | None = None) -> str:
    """Compact UTC timestamp for directory names: 20261122T101500Z."""
    t = _dt.datetime.fromtimestamp(time.time() if ts is None else ts, tz=_dt.timezone.utc)
    return t.strftime("%Y%m%dT%H%M%SZ")


def is_torchrun(command: list[str]) -> bool:
    head = Path(command[0]).name
    return head in ("torchrun", "torchrun.exe") or any(
        a == "-m" and i + 1 < len(command) and command[i + 1] in TORCHRUN_MODULES for i, a in enumerate(command))


def script_name(command: list[str]) -> str:
    """A short name for the job, used in the default run directory name."""
    i = script_index(command)
    if i is None:
        name = Path(command[0]).name
    elif command[i].endswith(".py"):
        name = Path(command[i]).stem
    else:  # a module run with -m: its last component
        name = command[i].rsplit(".", 1)[-1]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "job"
    return name[:60]


def torchrun_option(command: list[str], *names: str) -> str | None:
    """Value of a torchrun option (``--x=v`` or ``--x v``) among the launcher's own arguments (before the script)."""
    end = script_index(command)
    return option_value(command[:end] if end is not None else command, *names)


def join_id_for(command: list[str], env: dict) -> str | None:
    """The id that lets the other nodes of one job join this run directory: torchrun's rendezvous id, or DeepSpeed's
    master address and port when its launcher runs on each node (dtprof/launch_deepspeed.py)."""
    deepspeed_id = launch_deepspeed.join_id(command, env)
    if deepspeed_id:
        return deepspeed_id
    if not is_torchrun(command):
        return None
    rid = torchrun_option(command, "--rdzv-id", "--rdzv_id") or env.get("PET_RDZV_ID")
    return rid if rid and rid != "none" else None


# the default kernel sample of a GPU job: steps 10 and 11, after warm-up (step 0, FlopCounterMode's step 1, a
# torch.compile job's first recompilations), short enough to cost about two steps plus the export
KERNEL_SAMPLE_STEPS = "10:12"


def parse_trace_steps(value: str | None) -> str | None:
    if value is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", value)
    if not m or int(m.group(1)) >= int(m.group(2)):
        raise InputError(f"--trace-steps {value!r}: expected A:B with integers 0 <= A < B (steps A..B-1 are traced)")
    return f"{int(m.group(1))}:{int(m.group(2))}"


def env_subset(env: dict) -> dict:
    return {k: v for k, v in sorted(env.items()) if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}


PYTHON_NAME = re.compile(r"python(\d+(\.\d+)?)?(\.exe)?")

# Run by the job's Python: can it import torch and dtprof (not from the cwd, which the ranks do not see), and
# which versions. find_spec and package metadata only: importing torch would cost seconds.
_PROBE = """
import importlib.util, json, platform, sys
sys.path[:] = [p for p in sys.path if p not in ("", ".")]
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
print(json.dumps({"python": platform.python_version(), "torch": importlib.util.find_spec("torch") is not None,
                  "torch_version": version("torch"), "dtprof": importlib.util.find_spec("dtprof") is not None}))
"""
# pip's entry-point scripts for interpreters on long paths: "#!/bin/sh" then "'''exec' "/path/python" "$0" ..."
_PIP_SH_EXEC = re.compile(r"""'''exec' "?([^"\s]+)""")


def job_python(command: list[str], env: dict) -> str | None:
    """The Python interpreter that will run the job: ``python…`` itself, or the interpreter in the shebang of the
    command (torchrun's entry-point script, an executable train.py). None when it cannot be told (a shell script,
    srun, a missing command): then nothing is checked."""
    exe = shutil.which(command[0], path=env.get("PATH"))
    if exe is None:
        return None
    if PYTHON_NAME.fullmatch(Path(exe).name):
        return exe
    try:
        with open(exe, "rb") as f:
            head = f.read(512).decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    words = head[0][2:].split() if head and head[0].startswith("#!") else []
    interp: str | None = None
    if words and Path(words[0]).name == "env":            # #!/usr/bin/env [-S] python3
        args = [w for w in words[1:] if not w.startswith("-")]
        interp = shutil.which(args[0], path=env.get("PATH")) if args else None
    elif words and Path(words[0]).name == "sh" and len(head) > 1:
        m = _PIP_SH_EXEC.match(head[1])
        interp = m.group(1) if m else None
    elif words:
        interp = words[0]
    return interp if interp and PYTHON_NAME.fullmatch(Path(interp).name) else None


def probe_python(python: str, env: dict) -> dict | None:
    """What the job's Python has (see _PROBE); None if it could not be asked."""
    env = {k: v for k, v in env.items() if k not in ("DTPROF_NODE_DIR", "DTPROF_CONFIG")}
    try:
        out = subprocess.run([python, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=60)
        return json.loads(out.stdout) if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def check_job_python(command: list[str], env: dict) -> dict | None:
    """Refuse (exit 2, one line) a job whose Python cannot import torch or dtprof; else return what it has
    (``executable``, ``python``, ``torch_version``), or None when the job's Python cannot be told."""
    python = job_python(command, env)
    probe = probe_python(python, env) if python else None
    if probe is None:
        return None
    probe["executable"] = python
    if not probe["torch"]:
        raise InputError(f"the job's Python ({python}) cannot import torch; dtprof uses the torch of the job it "
                        "launches: install torch there, or run the job with a Python that has it")
    if not probe["dtprof"]:
        raise InputError(f"the job's Python ({python}) cannot import dtprof, so its ranks could not be recorded; "
                        "install dtprof there")
    return probe


def versions(job: dict | None) -> dict:
    """dtprof, torch, python and NCCL versions from package metadata; torch and python are the job's (``job`` is
    check_job_python's answer): the launcher never imports torch, and the torch that matters is the job's."""
    from importlib import metadata

    import dtprof

    def dist_version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    out = {"dtprof": dtprof.__version__, "torch": job["torch_version"] if job else None,
           "python": job["python"] if job else None, "nccl": None, "nccl_reason": None}
    for name in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"):
        v = dist_version(name)
        if v:
            out["nccl"], out["nccl_source"] = v, f"{name} wheel"
            break
    else:
        out["nccl_reason"] = ("no nvidia-nccl wheel installed (CPU torch build, or NCCL bundled in torch); "
                              "ranks record torch.cuda.nccl.version() when they use NCCL")
    if job is None:
        out["torch_reason"] = ("the job's Python could not be told from the command; each rank records its "
                               "torch_version and python in rank.json")
    return out


def git_info(cwd: Path) -> dict | None:
    """Commit and dirty flag of ``cwd`` if it is in a git work tree, else None."""
    def git(*args):
        return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return None
        status = git("status", "--porcelain", "--untracked-files=no")
        return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip()) if status.returncode == 0
                else None}
    except (OSError, subprocess.TimeoutExpired):
        return None


def inject_dir() -> Path:
    import dtprof._inject

    return Path(dtprof._inject.__file__).resolve().parent


def job_env(base: dict, node_dir: Path, rank_config: dict) -> dict:
    """The job's environment: what the rank side reads (docs/cli-run.md, step 4) plus live output."""
    env = dict(base)
    env["DTPROF_NODE_DIR"] = str(Path(node_dir).resolve())
    env["DTPROF_CONFIG"] = json.dumps(rank_config)
    user_path = base.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(inject_dir()) + (os.pathsep + user_path if user_path else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # NCCL records start/end CUDA events per collective, so the rank side can read GPU-side durations
    # (Work._get_duration); harmless on gloo. A user's own setting wins.
    env.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    return env


def exit_code_for(returncode: int) -> int:
    """Shell convention: a death by signal N reads as 128+N."""
    return 128 - returncode if returncode < 0 else returncode


# ---- the job's processes ---------------------------------------------------------------------------------------

def _proc_table() -> dict[int, int]:
    """Live (non-zombie) processes of this host: pid -> parent pid, from /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1 and fields[0] not in (b"Z", b"X"):
            out[int(name)] = int(fields[1])
    return out


def _has_env(pid: int, entry: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry in f.read().split(b"\0")
    except OSError:
        return False


def job_processes(root_pid: int, node_dir: Path) -> set[int]:
    """Every live process of the job: the command's process and all its descendants, whatever their process group
    or session (torchrun starts each worker in a session of its own), plus any that outlived their parent and
    were re-parented (found by the ``DTPROF_NODE_DIR`` of this node in their environment)."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, ppid in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root_pid] if root_pid in table else []
    entry = f"DTPROF_NODE_DIR={Path(node_dir).resolve()}".encode()
    todo += [pid for pid in table if pid != os.getpid() and _has_env(pid, entry)]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    found.discard(os.getpid())
    return found


def _kill(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_processes(root_pid: int, node_dir: Path, reason: str, grace_s: float = KILL_GRACE_S) -> dict | None:
    """SIGTERM every process of the job, SIGKILL those still alive after ``grace_s``, then check that none is left.
    Returns the record of the stop (for node.json), or None when no process of the job was running."""
    pids = job_processes(root_pid, node_dir)
    if not pids:
        return None
    t0, started = time.monotonic(), utc_iso()
    termed = set(pids)
    _kill(pids, signal.SIGTERM)
    while pids and time.monotonic() - t0 < grace_s:
        time.sleep(0.1)
        pids = job_processes(root_pid, node_dir)
        _kill(pids - termed, signal.SIGTERM)   # one started meanwhile (a restarted worker) gets its SIGTERM too
        termed |= pids
    killed = set()
    deadline = time.monotonic() + 5.0
    while pids and time.monotonic() < deadline:
        _kill(pids, signal.SIGKILL)
        killed |= pids
        time.sleep(0.1)
        pids = job_processes(root_pid, node_dir)
    return {"reason": reason, "started": started, "grace_s": grace_s, "sigterm_sent_to": len(termed),
            "sigkill_sent_to": len(killed), "took_s": round(time.monotonic() - t0, 3), "survivors": sorted(pids)}


# ---- the job ---------------------------------------------------------------------------------------------------

def _start_relay(pipe, out_fd: int, log_path: Path) -> subprocess.Popen:
    """The relay process that copies one of the job's pipes to our terminal and its log (dtprof/relay.py)."""
    return subprocess.Popen([sys.executable, "-m", "dtprof.relay", str(out_fd), str(log_path)], stdin=pipe,
                            close_fds=True)


class Job:
    """The user's command in its own session, its output relayed, signals forwarded, all its processes tracked."""

    def __init__(self, command: list[str], env: dict, node_dir: Path, say: Callable[[str], None]):
        self.command, self.env, self.node_dir, self.say = command, env, node_dir, say
        self.forwarded: list[str] = []   # names of the signals forwarded to the job
        self.stopped_by_watchdog = False
        self.stops: list[dict] = []      # records of stop_processes() (node.json "stops")
        self.log_problems: list[str] = []
        self.proc: subprocess.Popen | None = None
        self.command_end_ns: int | None = None
        self._stopper: threading.Thread | None = None
        self._old_handlers: dict = {}

    def start(self) -> None:
        proc = self.proc = subprocess.Popen(self.command, env=self.env, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, start_new_session=True)
        assert proc.stdout is not None and proc.stderr is not None
        self._relays = [(_start_relay(proc.stdout, 1, self.node_dir / "stdout.log"), "stdout.log"),
                        (_start_relay(proc.stderr, 2, self.node_dir / "stderr.log"), "stderr.log")]
        proc.stdout.close()   # the relays hold the read ends now
        proc.stderr.close()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        assert self.proc is not None, "start() first"
        if self.forwarded:   # second signal: escalate
            self.say(f"dtprof: {signal.Signals(signum).name} again: killing every process of the job (SIGKILL)")
            self.forwarded.append("SIGKILL")
            _kill(job_processes(self.proc.pid, self.node_dir), signal.SIGKILL)
            return
        name = signal.Signals(signum).name
        self.forwarded.append(name)
        self.say(f"dtprof: forwarding {name} to the job; send it again to kill the job")
        # To the command's process group, as a terminal would: torchrun passes it on to its workers itself.
        # Whatever is still running when the command has ended is stopped by wait().
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def _stop(self, reason: str) -> None:
        assert self.proc is not None, "start() first"
        rec = stop_processes(self.proc.pid, self.node_dir, reason)
        if rec is not None:
            self.stops.append(rec)

    def _wait_for_orphans(self) -> None:
        """The command died of a signal from outside (torchrun's agent killed): the ranks it left running train
        on, as they would without dtprof. Wait while they make progress (their heartbeats' ``last_progress_ns``),
        for at most ``ORPHAN_IDLE_S`` without; wait() stops what is left after that."""
        from dtprof.rundir.incident import read_heartbeats

        assert self.proc is not None, "start() first"
        last, since = None, time.monotonic()
        while job_processes(self.proc.pid, self.node_dir):
            beats = read_heartbeats(self.node_dir).values()
            newest = max((hb.get("last_progress_ns") or 0 for hb in beats if hb.get("exit") is None), default=0)
            if newest != last:
                last, since = newest, time.monotonic()
            elif time.monotonic() - since > ORPHAN_IDLE_S:
                return
            time.sleep(0.5)

    def stop_by_watchdog(self) -> None:
        """Called by the hang watchdog (from its thread): SIGTERM every process of the job, SIGKILL after a
        grace period, check (in a thread of its own; wait() waits for it)."""
        self.stopped_by_watchdog = True
        self._stopper = threading.Thread(target=self._stop, args=("hang-timeout",), name="dtprof-stop",
                                         daemon=True)
        self._stopper.start()

    def wait(self) -> int:
        assert self.proc is not None, "start() first"
        rc = self.proc.wait()
        self.command_end_ns = time.monotonic_ns()   # before any leftover is stopped: triage orders deaths by it
        if self._stopper is not None:
            self._stopper.join()
        if rc < 0 and not self.forwarded and not self.stopped_by_watchdog:
            self._wait_for_orphans()
        # The command ended (its own failure, a signal, the watchdog): none of its processes may outlive it.
        self._stop("left running after the job's command ended")
        for relay, name in self._relays:
            try:
                code = relay.wait(timeout=10)   # a process outside the job still holding the pipe must not
            except subprocess.TimeoutExpired:   # keep us here forever; the relay keeps copying its output
                continue
            if code == DISK_FULL_EXIT:
                self.log_problems.append(f"{name}: disk full; the job's output from then on reached only the "
                                         f"terminal")
            elif code == LOG_FAILED_EXIT:
                self.log_problems.append(f"{name}: could not be written; the job's output reached only the "
                                         f"terminal")
        for sig, h in self._old_handlers.items():
            signal.signal(sig, h)
        return rc


# ---- post-run steps: each guarded, none changes the exit code ---------------------------------------------------

def warn(msg: str) -> None:
    """dtprof's own problems: printed even with --quiet."""
    click.echo(msg, err=True)


def _guarded(label: str, say: Callable[[str], None], fn: Callable, *args, **kw):
    """Run one post step; any failure becomes one line, never an exception (the run and the job's exit code
    matter more than this step)."""
    try:
        return fn(*args, **kw)
    except Exception as e:  # noqa: BLE001
        say(f"{label}: failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return None


def has_captured_traces(node_dir: Path) -> bool:
    return any(p.is_file() for p in Path(node_dir).glob(f"{RANK_PREFIX}*/**/*trace*.json*"))


def merge_traces(node_dir: Path):
    from dtprof.collectors.kineto import merge_captured_traces

    return merge_captured_traces(node_dir)


def compact(node_dir: Path, say: Callable[[str], None]):
    from dtprof.rundir.writer import compact_node

    files = [p for p in Path(node_dir).rglob("*.jsonl*")]
    size = sum(p.stat().st_size for p in files)
    ranks = len(list(Path(node_dir).glob(f"{RANK_PREFIX}*")))
    say(f"compacting {Path(node_dir).name}: {ranks} rank(s), {len(files)} files, {size / 2**20:.1f} MiB ...")
    t0 = time.monotonic()
    out = compact_node(node_dir)
    say(f"compacted in {time.monotonic() - t0:.1f} s -> {out}")
    return out


def report(run, analysis):
    from dtprof.report import save_report

    return save_report(analysis)


# ---- the command -----------------------------------------------------------------------------------------------

HELP = f"""Run COMMAND with every rank profiled; analyse and report when it ends.

\b
  dtprof run -- torchrun --nproc_per_node=8 train.py --lr 3e-4
  dtprof run --out /shared/runs/exp1 -- torchrun --nnodes=2 --rdzv-id=exp1 \\
        --rdzv-backend=c10d --rdzv-endpoint=host0:29500 --nproc_per_node=8 train.py
  dtprof run --trace-steps 10:12 --hang-timeout 600 -- python train.py

\b
The run goes to ./dtprof-runs/<UTC time>-<script> unless --out is given; an existing run is never overwritten.
Multi-node: run one `dtprof run --out SAME_DIR` per node on a shared file system; nodes of one torchrun job
(same --rdzv-id) join one run, each in its own node-<host>-<pid> directory.

\b
The job runs in its own process group; its output passes through (and is saved in the node directory).
Ctrl-C/SIGTERM are forwarded to the job; a second one kills every process of the job. When the hang watchdog
fires or the command ends, processes of the job still running get SIGTERM, then SIGKILL after a
{KILL_GRACE_S:g} s grace; dtprof checks that none is left and records the stop in node.json.

\b
Exit codes:
  the job's own exit code (128+N if the job died of signal N)
  {WATCHDOG_EXIT}  the hang watchdog (--hang-timeout) found the job stuck and stopped it
  {USAGE_EXIT}    dtprof usage error (bad option, --out already holds a run); nothing was run
"""


@click.command("run", help=HELP, context_settings={"ignore_unknown_options": True,
                                                   "allow_interspersed_args": False,
                                                   "help_option_names": ["-h", "--help"]})
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Run directory (default ./dtprof-runs/<UTC time>-<script>).")
@click.option("--nvml-interval", type=click.FloatRange(min=0.001), default=0.1, show_default=True,
              help="GPU sampling period in seconds.")
@click.option("--no-nvml", is_flag=True, help="Do not sample GPUs with NVML.")
@click.option("--flops-per-step", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Model FLOPs of one training step over all ranks, for MFU.")
@click.option("--peak-tflops", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Peak TFLOP/s of one device at --dtype (default: looked up from the device name).")
@click.option("--dtype", type=click.Choice(DTYPES), default=None,
              help="Math precision used for the peak in MFU (default: bf16 on GPUs, fp32 on CPUs).")
@click.option("--count-flops/--no-count-flops", default=True, show_default=True,
              help="Count executed FLOPs on one measured step per rank (FlopCounterMode; that step is left out of "
                   "the step statistics).")
@click.option("--trace-steps", default=None, metavar="A:B",
              help="Capture a torch.profiler trace of steps A..B-1 on every rank.")
@click.option("--kernel-sample/--no-kernel-sample", default=True, show_default=True,
              help="On a GPU job, capture a torch.profiler kernel trace of steps 10 and 11 (kept out of the step "
                   "statistics, its cost reported) so the analysis says why the GPU is slow. A CPU job captures "
                   "nothing; --trace-steps replaces it.")
@click.option("--hang-timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
              help=f"Stop the job (exit {WATCHDOG_EXIT}) with a diagnosis when no rank progresses for this long.")
@click.option("--metrics", "metrics", multiple=True, metavar="SINK",
              help="Publish per-step metrics while the job runs (repeatable): prometheus:[HOST:]PORT, "
                   "tensorboard:DIR, wandb[:PROJECT], mlflow[:URI] (docs/metrics-export.md).")
@click.option("--metrics-interval", type=click.FloatRange(min=0), default=DEFAULT_METRICS_INTERVAL_S,
              show_default=True, metavar="SECONDS",
              help="At most one TensorBoard/W&B/MLflow point per rank and GPU this often (the mean of its steps; "
                   "Prometheus counts every step).")
@click.option("--full-detail", is_flag=True,
              help="Record every step in full detail. By default, when dtprof's measured cost of a detailed step is "
                   "over 1 % of the step, only blocks of steps are detailed and the others record their times "
                   "(docs/cli-run.md, \"Sampling\").")
@click.option("--sample-every", type=click.IntRange(min=8), default=None, metavar="P",
              help="Detail blocks of 4 steps every P steps (P a power of two) from step 32 on, the other steps' "
                   "times only, whatever dtprof's measured cost (default: chosen from it).")
@click.option("--memory-history", type=click.IntRange(min=1), default=None, metavar="N",
              help="On a GPU, keep the CUDA allocator's last N allocation events (a bounded ring, "
                   "torch.cuda.memory._record_memory_history) and write them to rank-<r>/memory_snapshot.pickle when "
                   "the rank runs out of memory (pytorch.org/memory_viz). Each allocation then records its stack: "
                   "off by default.")
@click.option("--no-report", is_flag=True, help="Do not write report.html.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the job's output and dtprof's errors.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run_command(out, nvml_interval, no_nvml, flops_per_step, peak_tflops, dtype, count_flops, trace_steps,
                kernel_sample, hang_timeout, metrics, metrics_interval, full_detail, sample_every, memory_history,
                no_report, quiet, command):
    command, trace_steps, sink_specs = _check_options(command, trace_steps, sample_every, full_detail, metrics)

    def say(msg: str) -> None:
        if not quiet:
            click.echo(msg, err=True)

    config, rank_config = _configs(
        flops_per_step=flops_per_step, peak_tflops=peak_tflops, dtype=dtype, count_flops=count_flops,
        trace_steps=trace_steps, hang_timeout=hang_timeout, nvml_interval=None if no_nvml else nvml_interval,
        sink_specs=sink_specs, metrics_interval=metrics_interval, full_detail=full_detail,
        sample_every=sample_every, kernel_sample=kernel_sample, memory_history=memory_history)
    host = socket.gethostname()
    cwd = Path.cwd()
    env = dict(os.environ)
    join_id = join_id_for(command, env)
    _check_command_starts(command)
    job_python_info = check_job_python(command, env)
    job_python_exe = job_python_info["executable"] if job_python_info else None
    run_dir, node_dir = _set_up_run_dir(out, command, cwd, join_id, host, say)
    node_info, start_wall = _start_node_info(node_dir, host, command, cwd, env, join_id, job_python_info, config,
                                             no_nvml)
    say(f"dtprof: recording to {node_dir}")

    events = NodeTableWriter(node_dir, "events")
    sampler = None if no_nvml else _start_sampler(node_dir, nvml_interval, events, host, node_info)
    job_environment = job_env(env, node_dir, rank_config)
    _deepspeed_hosts(command, cwd, env, job_environment, run_dir, node_dir, say)
    job = _start_job(command, job_environment, node_dir, say, events, host, node_info, sampler)
    job_probe = _guarded("probe", warn, machine.JobProbe().start)   # the CPU's speed during the job
    publisher = _guarded("metrics", warn, _start_publisher, sink_specs, run_dir, node_dir, host, config,
                         metrics_interval, say) if sink_specs else None
    watchdog = None
    if hang_timeout is not None:
        from dtprof.watchdog import Watchdog

        watchdog = _guarded("watchdog", warn, _start_watchdog, Watchdog, node_dir, hang_timeout,
                            job.stop_by_watchdog)
    returncode = job.wait()
    end_wall, end_mono = time.time(), time.monotonic_ns()
    if job_probe is not None:
        _guarded("probe", warn, lambda: node_info["probe"].update(job_probe.stop()))
    _guarded("probe", warn, machine.end_record, node_info, job_python_exe, env)
    fired = _stop_watchdog(watchdog, job, returncode)
    exit_code = WATCHDOG_EXIT if fired else exit_code_for(returncode)
    if publisher is not None:   # before the sampler stops: its last samples are published too
        _guarded("metrics", warn, publisher.stop, exit_code)
        node_info["metrics"] = publisher.record()
    if sampler is not None:
        node_info["nvml"] = sampler.stop()

    status, died_of = _job_status(returncode, fired, job)
    node_info.update(end_time=utc_iso(end_wall), end_mono_ns=end_mono, duration_s=round(end_wall - start_wall, 3),
                     exit_code=exit_code, job_returncode=returncode, status=status,
                     command_pid=job.proc.pid if job.proc else None, command_end_mono_ns=job.command_end_ns,
                     signal=died_of, signals_forwarded=job.forwarded or None, stops=job.stops or None,
                     log_problems=job.log_problems or None)
    _close_events(events, host, job, status, exit_code, died_of)
    _write_manifest(node_dir, node_info)
    faults = _guarded("events", warn, own_faults_line, node_dir)
    if faults:
        warn(faults)

    _post_run(run_dir, node_dir, node_info, config, no_report, say, quiet, job_python_exe)
    sys.exit(exit_code)


# ---- run_command's steps, in the order it takes them --------------------------------------------------------

def _check_options(command: tuple[str, ...], trace_steps: str | None, sample_every: int | None, full_detail: bool,
                   metrics: tuple[str, ...]) -> tuple[list[str], str | None, list]:
    """The options and the command, checked before anything runs (InputError: one line, exit 2): the command
    without a leading ``--``, the normalised --trace-steps and the parsed --metrics sinks."""
    command_list = list(command)
    if command_list and command_list[0] == "--":
        command_list = command_list[1:]
    if not command_list:
        raise InputError("no command given: dtprof run [OPTIONS] -- COMMAND...")
    trace_steps = parse_trace_steps(trace_steps)
    if sample_every is not None and (sample_every & (sample_every - 1) or full_detail):
        raise InputError(f"--sample-every {sample_every}: " + ("not with --full-detail" if full_detail
                                                               else "must be a power of two (8, 16, 32, ...)"))
    return command_list, trace_steps, _check_sinks(metrics)


def _configs(*, flops_per_step: float | None, peak_tflops: float | None, dtype: str | None, count_flops: bool,
             trace_steps: str | None, hang_timeout: float | None, nvml_interval: float | None, sink_specs: list,
             metrics_interval: float, full_detail: bool, sample_every: int | None,
             kernel_sample: bool, memory_history: int | None = None) -> tuple[dict, dict]:
    """node.json's ``config`` (the options as asked) and the ranks' DTPROF_CONFIG (what the ranks act on)."""
    config: dict[str, object] = {
        "flops_per_step": flops_per_step, "peak_tflops": peak_tflops, "dtype": dtype, "count_flops": count_flops,
        "trace_steps": trace_steps, "hang_timeout_s": hang_timeout, "nvml_interval_s": nvml_interval}
    if sink_specs:
        config.update(metrics=[m.text for m in sink_specs], metrics_interval_s=metrics_interval)
    rank_config: dict[str, object] = {"trace_steps": trace_steps, "count_flops": count_flops,
                                      "hang_timeout_s": hang_timeout, "flush_interval_s": 1.0}
    if full_detail or sample_every:     # sampling's defaults need no word to the ranks
        config.update(full_detail=full_detail, sample_every=sample_every)
        rank_config.update(full_detail=full_detail, sample_every=sample_every)
    if memory_history:                      # the memory ledger part (collectors/memory.py) keeps the ring
        config["memory_history"] = rank_config["memory_history"] = memory_history
    if kernel_sample and not trace_steps:   # the rank decides: only a process that uses a GPU captures
        config["kernel_sample"] = KERNEL_SAMPLE_STEPS
        rank_config["kernel_sample"] = {"steps": KERNEL_SAMPLE_STEPS, "gpu_only": True}
    return config, rank_config


def _check_command_starts(command: list[str]) -> None:
    """Exit 2 for a dtprof option given after the command's start, 127 for a command not found: before any
    directory exists, so nothing is recorded and nothing left behind."""
    if command[0].startswith("-"):         # an option click passed on as the command (ignore_unknown_options)
        click.echo(f"dtprof run: no such option {command[0]!r} (dtprof's options go before the job's command; "
                   "`dtprof run --help` lists them; nothing was run or recorded)", err=True)
        sys.exit(2)
    if shutil.which(command[0]) is None:
        click.echo(f"dtprof: cannot start {command[0]!r}: command not found (nothing was run or recorded)",
                   err=True)
        sys.exit(127)


def _set_up_run_dir(out: Path | None, command: list[str], cwd: Path, join_id: str | None, host: str,
                    say: Callable[[str], None]) -> tuple[Path, Path]:
    """The run directory (created, or joined by the other nodes of one torchrun job) and this launcher's node
    directory in it."""
    run_dir = _create_run_dir(out, command, cwd, join_id)
    try:
        node_dir = create_node_dir(run_dir, host)
    except OSError as e:
        raise InputError(f"{run_dir}: cannot create the node directory ({e.strerror or e})") from None
    nnodes = torchrun_option(command, "--nnodes") or "1"
    if out is None and (nnodes not in ("1", "1:1") or launch_deepspeed.join_id(command, {})):
        say("dtprof: multi-node job without --out: each node records a separate run; pass the same --out on a "
            "shared file system to get one run")
    return run_dir, node_dir


def _deepspeed_hosts(command: list[str], cwd: Path, base_env: dict, job_environment: dict, run_dir: Path,
                     node_dir: Path, say: Callable[[str], None]) -> None:
    """DeepSpeed's launcher starting ranks on several hosts from this one (dtprof/launch_deepspeed.py): through pdsh
    they get dtprof's settings from an environment file (``DS_ENV_FILE`` set in ``job_environment``); through a
    launcher that drops them, one line says the other hosts' ranks will not be recorded."""
    remote = launch_deepspeed.remote_launch(command, cwd)
    if remote is None or remote[0] in launch_deepspeed.WHOLE_ENV:
        return
    env_file = None
    if remote[0] == launch_deepspeed.THROUGH_PDSH:
        env_file = _guarded("DeepSpeed's environment file", warn, launch_deepspeed.write_env_file, node_dir,
                            base_env, job_environment, cwd)
        if env_file is not None:
            job_environment["DS_ENV_FILE"] = str(env_file)
    (say if env_file is not None else warn)(launch_deepspeed.start_line(*remote, run_dir, env_file))


def _start_node_info(node_dir: Path, host: str, command: list[str], cwd: Path, env: dict, join_id: str | None,
                     job_python_info: dict | None, config: dict, no_nvml: bool) -> tuple[dict, float]:
    """node.json as the job starts (written), and the wall time of the start."""
    job_python_exe = job_python_info["executable"] if job_python_info else None
    # identity and the start probes (dtprof/machine.py; the GPU one in the job's Python)
    machine_info = machine.start_record(command, cwd, job_python_exe, env)
    start_wall, start_mono = time.time(), time.monotonic_ns()
    node_info = {
        "node": node_dir.name, "host": host, "pid": os.getpid(), "command": command, "cwd": str(cwd),
        "join_id": join_id, "start_time": utc_iso(start_wall), "start_mono_ns": start_mono,
        "end_time": None, "end_mono_ns": None, "exit_code": None, "status": "running", "signal": None,
        "versions": versions(job_python_info), "env": env_subset(env), "git": git_info(cwd), "config": config,
        "nvml": {"available": False, "reason": "disabled with --no-nvml"} if no_nvml else None, **machine_info,
    }
    _write_manifest(node_dir, node_info)
    _keep_reserve(node_dir)
    return node_info, start_wall


def _start_sampler(node_dir: Path, interval_s: float, events: NodeTableWriter, host: str, node_info: dict):
    """The NVML sampler thread; what it found goes into node.json at once."""
    from dtprof.collectors.nvml import NvmlSampler

    sampler = NvmlSampler(node_dir, interval_s=interval_s, events=events, host=host)
    node_info["nvml"] = sampler.start()
    _write_manifest(node_dir, node_info)
    return sampler


def _start_job(command: list[str], env: dict, node_dir: Path, say: Callable[[str], None], events: NodeTableWriter,
               host: str, node_info: dict, sampler) -> Job:
    """The job, started; when it cannot start, the record is closed as failed and dtprof exits 127."""
    job = Job(command, env, node_dir, say)
    try:
        job.start()
    except OSError as e:
        if sampler is not None:
            node_info["nvml"] = sampler.stop()
        _event(events, host, "error", f"could not start the job: {e}")
        _guarded("events", warn, events.close)
        node_info.update(end_time=utc_iso(), end_mono_ns=time.monotonic_ns(), exit_code=127, status="failed")
        _write_manifest(node_dir, node_info)
        _drop_reserve(node_dir)
        click.echo(f"dtprof: cannot start {command[0]!r}: {e.strerror or e}", err=True)
        sys.exit(127)
    return job


def _stop_watchdog(watchdog, job: Job, returncode: int) -> bool:
    """Tell the watchdog (if any) how the job ended and stop it; True when it fired (stopped a hung job)."""
    if watchdog is None:
        return False
    _guarded("watchdog", warn, watchdog.on_job_exit, exit_code_for(returncode))
    _guarded("watchdog", warn, watchdog.stop)
    for line in getattr(watchdog, "beat_faults", []):
        warn(line)
    return bool(getattr(watchdog, "fired", False)) or job.stopped_by_watchdog


def _job_status(returncode: int, fired: bool, job: Job) -> tuple[str, str | None]:
    """node.json's ``status`` (hung, completed, killed or failed) and the name of the signal the job died of."""
    died_of = signal.Signals(-returncode).name if returncode < 0 and -returncode in signal.valid_signals() else None
    if fired:
        status = "hung"
    elif returncode == 0:
        status = "completed"
    elif died_of or job.forwarded:
        status = "killed"
    else:
        status = "failed"
    return status, died_of


def _close_events(events: NodeTableWriter, host: str, job: Job, status: str, exit_code: int,
                  died_of: str | None) -> None:
    """The launcher's last events (how the job ended, each stop, each log problem), then the table closed."""
    _event(events, host, "info" if status == "completed" else "warning",
           f"job {status} with exit code {exit_code}" + (f" (signal {died_of})" if died_of else ""))
    for stop in job.stops:
        warn(f"dtprof: {stop_text(stop)}")
        _event(events, host, "error" if stop["survivors"] else "warning", stop_text(stop))
    for problem in job.log_problems:
        _event(events, host, "error", problem)
    _guarded("events", warn, events.close)


def _create_run_dir(out: Path | None, command: list[str], cwd: Path, join_id: str | None) -> Path:
    info = {"command": command, "cwd": str(cwd), "created": utc_iso()}
    if out is not None:
        try:
            return create_run_dir(out.resolve(), info, join_id=join_id)
        except RunExistsError as e:
            raise InputError(str(e)) from None
        except OSError as e:
            raise InputError(f"{out}: cannot create the run directory ({e.strerror or e})") from None
    base = cwd / "dtprof-runs" / f"{utc_stamp()}-{script_name(command)}"
    for i in range(100):   # two jobs started in the same second get -1, -2, ...
        cand = base if i == 0 else base.with_name(f"{base.name}-{i}")
        if cand.exists():
            continue
        try:
            return create_run_dir(cand, info, join_id=None)
        except RunExistsError:
            continue
    raise InputError(f"{base}: could not find a free run directory name")


def _check_sinks(metrics) -> list:
    """--metrics, checked before anything runs: a missing library is one line and exit 2."""
    if not metrics:
        return []
    from dtprof.sinks import check_sinks

    return check_sinks(metrics)


def _start_publisher(specs: list, run_dir: Path, node_dir: Path, host: str, config: dict, interval_s: float,
                     say: Callable[[str], None]):
    """The live metrics publisher (dtprof/sinks.py): a thread of this launcher reading what the ranks flush."""
    from dtprof.sinks import Context, Publisher

    ctx = Context(run_dir, node_dir, host, config, interval_s, say)
    return Publisher(specs, ctx, warn).start()


def _start_watchdog(cls, node_dir: Path, timeout_s: float, stop_job: Callable[[], None]):
    wd = cls(node_dir, timeout_s, stop_job)
    wd.start()
    return wd


# Room kept on the run directory's disk for node.json's last writes: a disk that fills up during the job would
# otherwise leave node.json "running" and the run read as its launcher killed ("interrupted").
RESERVE, RESERVE_BYTES = ".node-json-reserve", 256 << 10


def _keep_reserve(node_dir: Path) -> None:
    try:
        with open(node_dir / RESERVE, "wb") as f:
            f.write(b"\0" * RESERVE_BYTES)
    except OSError:
        _drop_reserve(node_dir)


def _drop_reserve(node_dir: Path) -> None:
    try:
        (node_dir / RESERVE).unlink(missing_ok=True)
    except OSError:   # a read-only run directory keeps it, as it keeps everything
        pass


def _write_manifest(node_dir: Path, node_info: dict) -> None:
    """node.json; a failing disk costs the record, never the job (one line, the job runs on). On a full disk the
    room kept for it (RESERVE) is given back first."""
    try:
        write_json_atomic(node_dir / NODE_MANIFEST, node_info)
        return
    except OSError as e:
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        why = "disk full" if full else (e.strerror or str(e))
    if full and (node_dir / RESERVE).exists():
        _drop_reserve(node_dir)
        node_info["disk_full"] = True
        try:
            write_json_atomic(node_dir / NODE_MANIFEST, node_info)
            warn(f"dtprof: {node_dir}: disk full; node.json written in the room dtprof kept for it (rows the ranks "
                 f"wrote after the disk filled are lost)")
            return
        except OSError:
            pass
    warn(f"dtprof: {node_dir / NODE_MANIFEST}: not written ({why})")


def _event(events: NodeTableWriter, host: str, level: str, message: str) -> None:
    events.append((-1, host, time.monotonic_ns(), level, "launcher", message))


def own_faults_line(node_dir: Path) -> str | None:
    """One line naming the faults dtprof had in the job's processes (their ``FAULT_EVENT`` events rows, and the
    heartbeat threads' own, kept in heartbeat.json), or None.
    The ranks record them and print nothing into the job's output, so this is the only place a user hears of them
    at once."""
    faults = []
    files = [*(p for d in sorted(node_dir.glob(f"{RANK_PREFIX}*")) for p in table_files(d, "events")),
             *unidentified_files(node_dir)]
    for path in files:
        try:
            lines = read_table_text(path, []).splitlines()[1:]     # after the header
        except RunFormatError:
            continue                             # unreadable: the reader names it
        for line in lines:
            try:
                rank, _host, _t, level, _source, message = json.loads(line)
            except ValueError:
                continue                         # a torn last line (the reader reports it)
            if level == "error" and str(message).startswith(FAULT_EVENT):
                faults.append((rank, str(message)))
    for path in sorted(node_dir.glob(f"{RANK_PREFIX}*/heartbeat.json")):   # the heartbeat thread's own (it never
        try:                                                                # raises: it keeps them in its file)
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        faults += [(-2, f"dtprof's heartbeat thread on rank {beat.get('rank')}: {f}") for f in beat.get("faults") or []]
    if not faults:
        return None
    rank, message = faults[0]
    first = message.replace("on this rank", f"on rank {rank}") if rank >= 0 else message
    more = f" (and {len(faults) - 1} more)" if len(faults) > 1 else ""
    if rank == -2:   # the heartbeat switches off only its failing part
        return f"{first}{more}; that part of the heartbeat is off, the job and its recording ran on ({node_dir})"
    return f"{first}{more}; the job ran on unprofiled there; see the events in {node_dir}"


def _all_cpu(node_dir: Path) -> bool:
    types = {json.loads(p.read_text()).get("device_type") for p in Path(node_dir).glob(f"{RANK_PREFIX}*/rank.json")}
    return types == {"cpu"}


def _post_run(run_dir: Path, node_dir: Path, node_info: dict, config: dict, no_report: bool,
              say: Callable[[str], None], quiet: bool, job_python: str | None) -> None:
    """Calibrate (with the job's Python, which has torch: the launcher never imports it; skipped when the job's
    Python cannot be told), merge traces, compact, summarise, report. Each step: one line on failure, and the run
    is kept."""
    post: dict[str, object] = {}
    if config["peak_tflops"] is None and job_python is not None:
        from dtprof.calibrate import calibrate_for_run

        dtype = config["dtype"] or ("fp32" if _all_cpu(node_dir) else "bf16")
        cal = _guarded("calibration", warn, calibrate_for_run, node_dir, dtype, job_python)
        if cal:
            config["peak_calibration"] = cal
            peaks = ", ".join(f"{c['device_name']} {c['tflops']:.3g}" for c in cal)
            say(f"dtprof: calibrated for MFU ({peaks} TFLOP/s {dtype}, ~1 s each)")
            _guarded("manifest", warn, write_json_atomic, node_dir / NODE_MANIFEST, node_info)
    if config["trace_steps"] or has_captured_traces(node_dir):
        post["kineto"] = _guarded("kineto", warn, merge_traces, node_dir) is not None
    post["compacted"] = _guarded("compact", warn, compact, node_dir, say) is not None
    if post["compacted"]:   # the node's summary, made here where its data is (docs/scale.md)
        from dtprof.summarize import summarize_node

        post["node_summary"] = _guarded("node summary", warn, summarize_node, str(node_dir)) is not None
    # analysed once (options from node.json's config: dtprof/options.py); summary.json, the terminal summary and
    # the report all come from this one analysis
    from dtprof.options import open_and_analyze
    from dtprof.rundir.writer import save_summary

    run, analysis = _guarded("summary", warn, open_and_analyze, run_dir, check_tables=False) or (None, None)
    post["summary"] = analysis is not None and _guarded("summary", warn, save_summary, run_dir,
                                                        analysis.summary) is not None
    if analysis is not None and not quiet:
        from dtprof.reports import terminal

        click.echo(terminal.render(analysis))
    if not no_report:
        path = _guarded("report", warn, report, run, analysis) if analysis is not None else None
        post["report"] = str(path) if path is not None else None
    node_info["post"] = post
    _write_manifest(node_dir, node_info)
    _drop_reserve(node_dir)
    say(f"run: {run_dir}")
    if post["summary"]:
        say(f"summary: {run_dir / 'summary.json'}")
    if post.get("report"):
        say(f"report: {post['report']}")
