"""What the CPU probe during the job (dtprof/machine.py JobProbe) costs a job's step time.

A stand-in job of two processes ("ranks", as many as this 2-core VM has cores) runs steps of fixed pure-Python work,
meeting at a barrier after each step as DDP ranks meet in their all-reduce, so that a rank delayed by the probe
delays the step. Rounds of STEPS steps alternate without and with a JobProbe running in this (the launcher's)
process; each pair's ratio of median steps is one observation, and the median ratio over the pairs with a
bootstrap interval is the cost. At dtprof's interval (0.5 s) the duty cycle (~0.6 % of one core) is below what
paired rounds on a shared machine resolve, so the probe is also run at 10x and 40x its rate (0.05 s, 0.0125 s):
the cost grows with the duty cycle, and the small interval's figure divided by its factor bounds dtprof's.

    .venv/bin/python benchmarks/job_probe_cost.py [--pairs 10]

Prints, per interval: the probe's duty cycle (its CPU seconds over the round's wall time) and the step's change.
Write the load average beside the figures: timing on a shared machine.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

import numpy as np

from dtprof import machine

STEPS = 150
WORK = 40000   # int squares per step per rank: ~5-10 ms on this VM


def _rank(barrier, n_steps: int, out) -> None:
    times = []
    for _ in range(n_steps):
        t0 = time.perf_counter()
        s = 0
        for i in range(WORK):
            s += i * i
        barrier.wait()
        times.append(time.perf_counter() - t0)
    out.put(times)


def round_median(probe_interval: float | None) -> tuple[float, float]:
    """(median step seconds of rank 0, the probe's duty cycle: its CPU seconds / the round's wall seconds)."""
    ranks = os.cpu_count() or 2
    barrier, out = mp.Barrier(ranks), mp.Queue()
    probe = machine.JobProbe(probe_interval).start() if probe_interval else None
    t0 = time.perf_counter()
    procs = [mp.Process(target=_rank, args=(barrier, STEPS, out)) for _ in range(ranks)]
    for p in procs:
        p.start()
    steps = [out.get() for _ in procs]
    for p in procs:
        p.join()
    wall = time.perf_counter() - t0
    duty = sum(probe.stop()["cpu_job_s"]) / wall if probe else 0.0
    return float(np.median(steps[0][5:])), duty


def main() -> int:
    pairs = int(sys.argv[sys.argv.index("--pairs") + 1]) if "--pairs" in sys.argv else 10
    rng = np.random.default_rng(0)
    print(f"load average {os.getloadavg()[0]:.1f}; {os.cpu_count()} ranks x {STEPS} steps a round, {pairs} pairs "
          "of rounds (without, with the probe) per interval")
    print(f"{'interval':>9}  {'duty (1 core)':>13}  {'step change, median of pairs [90% CI]':>38}")
    for interval in (machine.JOB_PROBE_INTERVAL_S, 0.05, 0.0125):
        ratios, duties = [], []
        for k in range(pairs):
            order = (None, interval) if k % 2 == 0 else (interval, None)   # neither always first
            got = {iv: round_median(iv) for iv in order}
            ratios.append(got[interval][0] / got[None][0])
            duties.append(got[interval][1])
        r = np.asarray(ratios)
        boot = np.median(r[rng.integers(0, len(r), (2000, len(r)))], axis=1)
        lo, hi = np.quantile(boot, [0.05, 0.95])
        print(f"{interval:>8g}s  {np.median(duties):>12.2%}  {np.median(r) - 1:>+24.2%} [{lo - 1:+.2%}, {hi - 1:+.2%}]")
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
