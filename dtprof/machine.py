"""What identifies a run's configuration, and how fast the machine was: recorded by the launcher in node.json.

- ``config_identity``: the command, the training script and the SHA-256 of its file, so that `dtprof compare`
  can tell two runs of different code apart (world size, mesh, devices, FLOPs and versions are in the run
  already and are read from summary.json).
- ``cpu_probe``: a short fixed CPU micro-benchmark, timed before the job starts and after it ends, so that
  `dtprof compare` can tell a slower machine (a noisy neighbour, a throttled host) from slower code. Pure Python
  and hashlib: the launcher never imports torch, so a GPU probe would cost a torch import (seconds) and is not
  run here.
"""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

# Each timing spans several scheduler time slices (~15-20 ms on an idle core), so that a loaded machine shows as a
# longer timing every time rather than as a mix of full-speed and preempted ones (3 ms timings were bimodal and
# their median's interval too wide to see a 3x slowdown).
PROBE_REPEATS = 5
PROBE_WORK = "sum of 360000 int squares in Python + SHA-256 of 1 MiB, timed 5 times (about 15-20 ms each)"
_BLOB = bytes(range(256)) * 4096   # 1 MiB


def config_identity(command: list[str], cwd: Path) -> dict:
    """``{command, script, script_sha256}``; ``script_sha256`` is null (with a reason) when the script is a module
    or cannot be read."""
    from dtprof.launcher import script_index

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


def _work() -> int:
    s = 0
    for i in range(360000):
        s += i * i
    return s + len(hashlib.sha256(_BLOB).digest())


def cpu_probe(repeats: int = PROBE_REPEATS) -> list[float]:
    """Seconds of each of ``repeats`` runs of the fixed work (the first one warms caches and is dropped)."""
    _work()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _work()
        out.append(time.perf_counter() - t0)
    return out


def start_record(command: list[str], cwd: Path) -> dict:
    """node.json keys written before the job starts: ``identity`` and ``probe`` (its ``start`` timings)."""
    return {"identity": config_identity(command, cwd),
            "probe": {"work": PROBE_WORK, "cpu_start_s": cpu_probe(), "cpu_end_s": None,
                      "gpu_reason": "no GPU probe: the launcher does not import torch"}}


def end_record(node_info: dict) -> None:
    """Adds the end probe's timings to node.json's ``probe`` (after the job has exited)."""
    node_info["probe"]["cpu_end_s"] = cpu_probe()
