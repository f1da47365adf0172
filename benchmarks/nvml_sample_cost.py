"""Per-tick cost of the NVML sampler's own Python work, with NVML faked at the pynvml boundary (8 GPUs).

Real NVML calls add the driver's cost on top (and nvmlDeviceGetPcieThroughput's 20 ms window, which is why PCIe is
read at most once per second). Prints the cost per tick and its ratio to the default 100 ms sampling period.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import fake_pynvml  # noqa: E402
from dtprof.collectors.nvml import NvmlSampler  # noqa: E402
from dtprof.rundir.writer import create_node_dir, create_run_dir  # noqa: E402

GPUS, TICKS, INTERVAL_S = 8, 2000, 0.1

with tempfile.TemporaryDirectory() as tmp:
    node = create_node_dir(create_run_dir(Path(tmp) / "run", {}), host="bench")
    s = NvmlSampler(node, interval_s=INTERVAL_S, nvml=fake_pynvml.make(gpus=GPUS), host="bench")
    s._loop = lambda: None          # drive the ticks here instead of in the thread
    s.start()
    t0 = time.perf_counter_ns()
    for _ in range(TICKS):
        s.sample_once()
    per_tick_us = (time.perf_counter_ns() - t0) / TICKS / 1000
    t0 = time.perf_counter_ns()
    s._writer.flush()
    flush_ms = (time.perf_counter_ns() - t0) / 1e6
    s.stop()
    print(f"sampler: {GPUS} fake GPUs, {TICKS} ticks: {per_tick_us:.0f} us/tick "
          f"({per_tick_us / GPUS:.1f} us/GPU), = {per_tick_us / (INTERVAL_S * 1e6):.2%} of a {INTERVAL_S:g} s period; "
          f"writing {TICKS * GPUS} rows took {flush_ms:.0f} ms ({flush_ms * 1000 / (TICKS * GPUS):.1f} us/row)")
