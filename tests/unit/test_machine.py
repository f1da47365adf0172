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


def test_the_probe_during_the_job_times_its_work_in_cpu_time_at_low_priority(monkeypatch):
    # a thread of the launcher, at nice 19 (the job's ranks first), timing the fixed work in the thread's own CPU
    # time; past JOB_PROBE_MAX samples every other one goes and the interval doubles (node.json stays small)
    monkeypatch.setattr(machine, "JOB_PROBE_MAX", 6)
    probe = machine.JobProbe(interval_s=0.02).start()
    nice = None
    for _ in range(200):
        try:
            nice = os.getpriority(os.PRIO_PROCESS, probe._thread.native_id or 0)
            break
        except OSError:
            machine.time.sleep(0.005)
    t0, c0 = machine.time.perf_counter(), machine.time.thread_time()
    machine.time.sleep(1.0)
    wall, own_cpu = machine.time.perf_counter() - t0, machine.time.thread_time() - c0
    rec = probe.stop()
    assert nice == 19
    assert 1 <= len(rec["cpu_job_s"]) < 6 and rec["job_interval_s"] > 0.02, rec   # decimated at least once
    assert all(0 < t < wall for t in rec["cpu_job_s"]) and own_cpu < 0.05        # this thread did none of it
    assert rec["job_work"] == machine.JOB_PROBE_WORK
    assert not probe._thread.is_alive()
