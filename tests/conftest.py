"""The suite's one shared set-up: a CPU calibration for every recorded run.

`dtprof run` times a ~1 s GEMM after each job on a device with no spec peak (this VM's CPU), in a fresh Python that
imports torch: ~4-5 s of each recording here, 87 times in a full run. A calibration stored by `dtprof calibrate`
($XDG_CACHE_HOME/dtprof/calibration.json) takes its place, as it does for a user who ran that command. So the
suite runs `dtprof calibrate` once, with one thread (what `dtprof run` gives each rank of the suite's two-rank jobs
on two cores: cores // ranks), into a cache directory of its own, which also keeps the developer's own cache out of
the tests. The tests of the per-run calibration give their jobs an empty cache (tests/test_frameworks.py).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

_CACHE = tempfile.mkdtemp(prefix="dtprof-test-cache-")


def pytest_configure(config):
    os.environ["XDG_CACHE_HOME"] = _CACHE
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # no stored figure if it fails: each run then calibrates itself, as before (slower, not wrong)
    subprocess.run([sys.executable, "-m", "dtprof.cli", "calibrate", "--device", "cpu", "--dtype", "fp32",
                    "--seconds", "1"], env=env, capture_output=True, timeout=120, check=False)


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE, ignore_errors=True)
