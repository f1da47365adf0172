"""dtprof/machine.py on this machine, which has no GPU: the GPU probe's route through the job's Python is run for
real and must say why it measured nothing; a probe that cannot run is a reason, never an exception. (The GPU
timings themselves need a GPU: compare's handling of recorded GPU probe rows is in test_compare_real.py.)"""
from __future__ import annotations

import os
import sys

import pytest

from dtprof import machine

NO_GPU = not machine.gpu_device_files()


def test_the_gpu_probe_in_the_jobs_python_times_each_gpu_or_says_torch_sees_none():
    # the launcher's own route: a subprocess of the job's Python imports torch and dtprof.machine.gpu_timings
    out = machine.run_gpu_probe(sys.executable, dict(os.environ))
    if NO_GPU:
        assert list(out) == ["reason"] and "sees no CUDA device" in out["reason"], out
    else:
        assert out["devices"] and all(len(d["timings_s"]) == machine.GPU_REPEATS and min(d["timings_s"]) > 0
                                      for d in out["devices"]), out


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU device file")
def test_a_node_without_gpu_device_files_runs_no_gpu_probe_and_says_so():
    rec = machine.start_record([sys.executable, "train.py"], machine.Path.cwd(), sys.executable, dict(os.environ))
    p = rec["probe"]
    assert p["gpu_start"] is None and p["gpu_work"] is None
    assert p["gpu_reason"] == "no GPU on this node (no /dev/nvidia* or /dev/kfd device)"
    assert len(p["cpu_start_s"]) == machine.PROBE_REPEATS      # the CPU probe runs regardless
    node = {"probe": p}
    machine.end_record(node, sys.executable, dict(os.environ))
    assert len(p["cpu_end_s"]) == machine.PROBE_REPEATS and p["gpu_end"] is None


def test_a_gpu_probe_that_cannot_run_is_a_reason_not_an_error(tmp_path):
    assert "could not run" in machine.run_gpu_probe(str(tmp_path / "no-such-python"), {})["reason"]
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'ImportError: no torch here' >&2\nexit 1\n")
    broken.chmod(0o755)
    assert machine.run_gpu_probe(str(broken), {}) == {"reason": "the GPU probe failed: ImportError: no torch here"}
