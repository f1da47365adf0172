"""The job's own clock in benchmarks/device_check.sh's logs: each run's median step time, bare vs under dtprof.

    python benchmarks/step_clock.py LOG_DIR [--skip-steps 20]

A log holds rank 0's ``step N ... t CLOCK`` lines (examples/train_tiny.py and the HF Trainer example with
``--print-time``). A run's step time is the median of (t - previous t) / (N - previous N) over its lines after step
``--skip-steps`` (compilation, dtprof's FLOP-counting step and its kernel sample, steps 10-11, are before it). Runs
are grouped by their name less ``-bare-I`` / ``-dtprof-I``; for each group it prints every run's median, the pooled
medians and their ratio, and the Dynamo line each run printed (examples/compile_stats.py).
"""
from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict
from pathlib import Path

STEP = re.compile(r"^step (\d+) .*?\bt (\d+\.\d+)")
ARMS = "bare|bare_timing|bare_nvml|dtprof|dtprof_notiming|nonvml|nvml_1s|nosample|full-detail"
NAME = re.compile(rf"^(.*)-({ARMS})(?:-(\d+))?$")


def step_times(log: Path, skip: int) -> list[float]:
    """Seconds per step between consecutive step lines after step ``skip``."""
    points = [(int(m[1]), float(m[2])) for m in map(STEP.match, log.read_text(errors="replace").splitlines()) if m]
    return [(t - t0) / (n - n0) for (n0, t0), (n, t) in zip(points, points[1:]) if n0 >= skip and n > n0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log_dir", type=Path)
    ap.add_argument("--skip-steps", type=int, default=20)
    a = ap.parse_args()
    groups: dict[str, dict[str, list[tuple[str, float, str]]]] = defaultdict(lambda: defaultdict(list))
    for log in sorted(a.log_dir.glob("*.txt")):
        m = NAME.match(log.stem)
        times = step_times(log, a.skip_steps)
        if not m or not times:
            continue
        dynamo = next((line.split("dynamo: ", 1)[1] for line in log.read_text(errors="replace").splitlines()
                       if "dynamo: " in line), "")
        groups[m[1]][m[2]].append((log.stem, statistics.median(times), dynamo))
    for job, arms in groups.items():
        print(f"{job}:")
        for runs in arms.values():
            for name, median, dynamo in runs:
                print(f"  {name:28s} {median * 1e3:8.3f} ms/step  {dynamo}")
        pooled = {arm: statistics.median(m for _, m, _ in runs) for arm, runs in arms.items()}
        if "bare" in pooled:
            for arm, m in pooled.items():
                if arm != "bare":
                    print(f"  {arm} / bare: {m / pooled['bare']:.3f} ({m * 1e3:.3f} vs {pooled['bare'] * 1e3:.3f} ms, "
                          f"medians of the runs' medians)")


if __name__ == "__main__":
    main()
