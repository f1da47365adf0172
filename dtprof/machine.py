"""What identifies a run's configuration, and how fast the machine was: recorded by the launcher in node.json.

- ``config_identity``: the command, the training script and the SHA-256 of its file, so that `dtprof compare`
  can tell two runs of different code apart (world size, mesh, devices, FLOPs and versions are in the run
  already and are read from summary.json).
- ``cpu_probe``: a short fixed CPU micro-benchmark, timed before the job starts and after it ends, so that
  `dtprof compare` can tell a slower machine (a noisy neighbour, a throttled host) from slower code. Pure Python
  and hashlib, in the launcher.
- ``JobProbe``: a smaller fixed CPU work timed in the launcher every JOB_PROBE_INTERVAL_S *during* the job, in
  thread CPU time, so that a machine whose CPUs ran slower while the job ran (a VM slowed by its host: the before
  and after probes and the ranks' own wait for a CPU both missed one) is seen. A low-priority thread of the
  launcher, never the job's processes; a failure stops the samples, never the launcher.
- ``gpu_probe``: a short fixed matmul on each of the node's GPUs, timed with CUDA events right after the CPU probe.
  The launcher never imports torch, so it runs in a subprocess of the job's Python (as dtprof/calibrate.py's
  calibration does), and only where the node has a GPU device: a CPU-only node pays nothing and its node.json
  says why there is no GPU probe. A probe that fails or overruns is recorded as a reason; the job runs anyway.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import subprocess
import threading
import time
from pathlib import Path

# Each timing spans several scheduler time slices (~15-20 ms on an idle core), so that a loaded machine shows as a
# longer timing every time rather than as a mix of full-speed and preempted ones (3 ms timings were bimodal and
# their median's interval too wide to see a 3x slowdown).
PROBE_REPEATS = 5
PROBE_WORK = "sum of 360000 int squares in Python + SHA-256 of 1 MiB, timed 5 times (about 15-20 ms each)"
_BLOB = bytes(range(256)) * 4096   # 1 MiB


TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def option_value(args: list[str], *names: str) -> str | None:
    """The value of a launcher's option among its own arguments ``args`` (``--x=v`` or ``--x v``, the first of
    ``names`` found); None where none is given."""
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(n + "="):
                return a[len(n) + 1:]
    return None


def script_index(command: list[str]) -> int | None:
    """Index of the training script (first ``*.py`` argument, or the module after a non-torchrun ``-m``)."""
    for i, a in enumerate(command):
        if a.endswith(".py"):
            return i
        if a == "-m" and i + 1 < len(command) and command[i + 1] not in TORCHRUN_MODULES:
            return i + 1
    return None


def config_identity(command: list[str], cwd: Path) -> dict:
    """``{command, script, script_sha256}``; ``script_sha256`` is null (with a reason) when the script is a module
    or cannot be read."""
    i = script_index(command)
    script = command[i] if i is not None else None
    out: dict = {"command": " ".join(command), "script": script, "script_sha256": None}
    path = (cwd / script) if script and script.endswith(".py") else None
    try:
        if path is None:
            raise OSError("no .py script in the command")
        out["script_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        out["script_sha256_reason"] = str(e.strerror or e)
    return out


def _work(n: int = 360000, blob: bytes = _BLOB) -> int:
    s = 0
    for i in range(n):
        s += i * i
    return s + len(hashlib.sha256(blob).digest())


def cpu_probe(repeats: int = PROBE_REPEATS) -> list[float]:
    """Seconds of each of ``repeats`` runs of the fixed work (the first one warms caches and is dropped)."""
    _work()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _work()
        out.append(time.perf_counter() - t0)
    return out


# The probe during the job: a sixth of the work above (about 3 ms on an idle core) every half second, timed in the
# thread's own CPU time: the time it waited for a CPU (the job's ranks, other load) is not in it, so it measures how
# fast the CPU runs a fixed work (the host's frequency, a hypervisor's share, caches), a quantity the ranks' CPU wait
# (analyzers, from /proc schedstat) does not hold. Its thread runs at nice 19 (Linux: this thread only), so the
# job's ranks come first; its cost is its duty cycle, 0.4-0.9 % of one core in 2-rank runs (docs/compare.md). At
# JOB_PROBE_MAX samples every other one is dropped and the interval doubles: node.json stays small over a long job,
# the samples spread over all of it.
JOB_PROBE_INTERVAL_S = 0.5
JOB_PROBE_MAX = 2000
_JOB_N, _JOB_BLOB = 60000, _BLOB[: 160 * 1024]
JOB_PROBE_WORK = ("sum of 60000 int squares in Python + SHA-256 of 160 KiB, in the thread's CPU time, every "
                  f"{JOB_PROBE_INTERVAL_S:g} s during the job (about 3 ms each)")


class JobProbe:
    """The CPU probe during the job: ``start()`` as the job starts, ``stop()`` (node.json ``probe`` keys
    ``cpu_job_s``, ``job_work``, ``job_interval_s``) once it has exited."""

    def __init__(self, interval_s: float = JOB_PROBE_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dtprof-job-probe", daemon=True)

    def start(self) -> JobProbe:
        self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)   # the job's ranks first
        except (OSError, AttributeError):
            pass
        try:
            _work(_JOB_N, _JOB_BLOB)   # warms caches, not kept
            while not self._stop.wait(self.interval_s):
                c0 = time.thread_time()
                _work(_JOB_N, _JOB_BLOB)
                self.samples.append(time.thread_time() - c0)
                if len(self.samples) >= JOB_PROBE_MAX:
                    del self.samples[::2]
                    self.interval_s *= 2
        except Exception:  # noqa: BLE001  the probe is never worth a launcher's failure
            return

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=5.0)
        return {"cpu_job_s": list(self.samples), "job_work": JOB_PROBE_WORK, "job_interval_s": self.interval_s}


# The GPU probe: per timing, GPU_MATMULS fp16 matmuls of GPU_N x GPU_N (1.1 TFLOP): about 1.5 ms on an H100's
# ~700 dense TFLOP/s, 3.5 ms on an A100, 40 ms on a T4 (from their spec peaks; not measured here, no GPU), so the
# 7 works per device take 10-300 ms.
# CUDA events time the GPU alone: a busy host CPU shows in the CPU probe, a slow or throttled GPU here.
GPU_N, GPU_MATMULS, GPU_REPEATS = 4096, 8, 5
GPU_PROBE_WORK = (f"{GPU_MATMULS} fp16 matmuls of {GPU_N}x{GPU_N} on each GPU, timed {GPU_REPEATS} times with CUDA "
                  "events after 2 untimed")
# The subprocess also imports torch and initialises CUDA (seconds); a hung driver must not hold the job back longer.
GPU_PROBE_TIMEOUT_S = 30.0
_GPU_PROBE = ("import json, sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
              "from dtprof.machine import gpu_timings; print(json.dumps(gpu_timings()))")


def _matmuls(a, b) -> None:
    for _ in range(GPU_MATMULS):
        a @ b


def gpu_timings() -> dict:
    """Run by the job's Python (it has torch): ``{"devices": [{index, name, timings_s}]}`` for each visible GPU, or
    ``{"reason": ...}`` when torch sees none."""
    import torch

    if not torch.cuda.is_available():
        return {"reason": f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"}
    devices = []
    for i in range(torch.cuda.device_count()):
        with torch.cuda.device(i):
            a = torch.randn(GPU_N, GPU_N, device=f"cuda:{i}", dtype=torch.float16)
            b = torch.randn(GPU_N, GPU_N, device=f"cuda:{i}", dtype=torch.float16)
            _matmuls(a, b)
            _matmuls(a, b)
            timings = []
            for _ in range(GPU_REPEATS):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                _matmuls(a, b)
                e1.record()
                e1.synchronize()
                timings.append(e0.elapsed_time(e1) / 1e3)
            devices.append({"index": i, "name": torch.cuda.get_device_name(i), "timings_s": timings})
    return {"devices": devices}


def gpu_device_files() -> list[str]:
    """The node's GPU device files (NVIDIA, or AMD's /dev/kfd for ROCm torch): none means no GPU to probe."""
    return sorted(glob.glob("/dev/nvidia[0-9]*")) + sorted(glob.glob("/dev/kfd"))


def run_gpu_probe(python: str, env: dict) -> dict:
    """``gpu_timings()`` in a subprocess of the job's Python; ``{"reason": ...}`` when it fails or overruns."""
    env = {k: v for k, v in env.items() if k not in ("DTPROF_NODE_DIR", "DTPROF_CONFIG")}
    try:
        proc = subprocess.run([python, "-c", _GPU_PROBE], env=env, capture_output=True, text=True,
                              timeout=GPU_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"reason": f"the GPU probe took over {GPU_PROBE_TIMEOUT_S:.0f} s and was stopped"}
    except (OSError, ValueError) as e:   # ValueError: output that is not text
        return {"reason": f"the GPU probe could not run {python}: {getattr(e, 'strerror', None) or e}"}
    lines = proc.stdout.strip().splitlines()
    try:
        if proc.returncode != 0 or not lines:
            raise ValueError
        out = json.loads(lines[-1])
        if not isinstance(out, dict):
            raise ValueError
        return out
    except ValueError:
        err = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        return {"reason": f"the GPU probe failed: {err[:300]}"}


def gpu_probe(python: str | None, env: dict) -> dict:
    """The GPU probe of this node, or why there is none."""
    if not gpu_device_files():
        return {"reason": "no GPU on this node (no /dev/nvidia* or /dev/kfd device)"}
    if python is None:
        return {"reason": "the job's Python could not be told from the command, so no GPU probe ran"}
    return run_gpu_probe(python, env)


def start_record(command: list[str], cwd: Path, python: str | None, env: dict) -> dict:
    """node.json keys written before the job starts: ``identity`` and ``probe`` (its ``start`` timings).
    ``python``: the job's Python (the GPU probe runs there), ``env``: the launcher's environment."""
    cpu = cpu_probe()
    gpu = gpu_probe(python, env)        # after the CPU one: its torch import would load the CPU probe's cores
    return {"identity": config_identity(command, cwd),
            "probe": {"work": PROBE_WORK, "cpu_start_s": cpu, "cpu_end_s": None,
                      "gpu_work": GPU_PROBE_WORK if "devices" in gpu else None,
                      "gpu_start": gpu.get("devices"), "gpu_end": None, "gpu_reason": gpu.get("reason")}}


def end_record(node_info: dict, python: str | None, env: dict) -> None:
    """Adds the end probes' timings to node.json's ``probe`` (after the job has exited); the GPU one only where
    the start one ran."""
    probe = node_info["probe"]
    probe["cpu_end_s"] = cpu_probe()
    if probe.get("gpu_start"):
        gpu = gpu_probe(python, env)
        probe["gpu_end"] = gpu.get("devices")
        if "reason" in gpu:
            probe["gpu_end_reason"] = gpu["reason"]
