"""False-alarm rate and power of `dtprof compare`'s step-time gate on synthetic runs with realistic noise.

Each simulated run is 100 measured steps (warm-up already excluded) of a job whose step time carries
- multiplicative step jitter (lognormal, sigma 3 %),
- a slow drift (AR(1), phi 0.9, marginal sigma 1 %: thermal and data-dependent variation),
- outlier steps (2 % of steps take 1.5-3x as long: GC pauses, checkpoint writes, data stalls),
- a run-level offset (sigma 0.5 %: two runs of one configuration on different nodes or days differ a little).
Identical configurations draw base and head from the same model; a slowdown multiplies head by (1 + effect).

Prints, at the default settings (the gate DEFAULT_GATES[0], its test and confidence), the false-alarm rate over
identical configurations and the detection rate of a true 5 % slowdown, then a power curve over effect sizes for a
few tolerances and both tests, which is how the defaults were chosen (docs/compare.md). Deterministic (seeded).

    .venv/bin/python benchmarks/gate_power.py          # ~30-50 s on a 2-core machine
"""
from __future__ import annotations

import sys
import time

import numpy as np

from dtprof.analyzers import regression as rg

STEPS = 100
JITTER, DRIFT, DRIFT_PHI, RUN_SIGMA = 0.03, 0.01, 0.9, 0.005
OUTLIER_P, OUTLIER_LO, OUTLIER_HI = 0.02, 1.5, 3.0


def synth_steps(rng: np.random.Generator, n: int = STEPS, effect: float = 0.0, base_s: float = 0.25) -> np.ndarray:
    """One run's per-step times in seconds."""
    e = rng.normal(0.0, DRIFT * np.sqrt(1 - DRIFT_PHI ** 2), n)
    drift = np.empty(n)
    drift[0] = rng.normal(0.0, DRIFT)
    for i in range(1, n):
        drift[i] = DRIFT_PHI * drift[i - 1] + e[i]
    x = base_s * (1 + effect) * np.exp(rng.normal(0.0, RUN_SIGMA) + drift + rng.normal(0.0, JITTER, n))
    out = rng.random(n) < OUTLIER_P
    x[out] *= rng.uniform(OUTLIER_LO, OUTLIER_HI, out.sum())
    return x


def summary(x: np.ndarray) -> dict:
    return {"steps": {"per_step_time_s": x.tolist(), "time_s": {"p50": float(np.median(x))}}}


def fail_rate(gate: rg.Gate, effect: float, trials: int, seed: int, test: str = "bootstrap",
              n_boot: int = rg.DEFAULT_N_BOOT) -> float:
    rng = np.random.default_rng(seed)
    fails = 0
    for t in range(trials):
        base, head = summary(synth_steps(rng)), summary(synth_steps(rng, effect=effect))
        r = rg.evaluate_gate(gate, [base], [head], test=test, n_boot=n_boot, seed=t)
        fails += r.verdict == rg.FAIL
    return fails / trials


def main() -> int:
    t0 = time.perf_counter()
    gate = rg.parse_gate(rg.DEFAULT_GATES[0])
    print(f"noise model: jitter {JITTER:.0%}, AR(1) drift {DRIFT:.0%} (phi {DRIFT_PHI}), "
          f"outliers {OUTLIER_P:.0%} x{OUTLIER_LO}-{OUTLIER_HI}, run offset {RUN_SIGMA:.1%}; {STEPS} steps per side")
    print(f"default gate: {gate.expr!r}, block bootstrap, {rg.DEFAULT_CONFIDENCE:.0%} CI, "
          f"{rg.DEFAULT_N_BOOT} resamples")
    fa = fail_rate(gate, 0.0, 1000, seed=1)
    power = fail_rate(gate, 0.05, 400, seed=2)
    print(f"false-alarm rate (identical configurations, 1000 pairs): {fa:.2%}   (target <= 1 %)")
    print(f"detection rate   (true 5 % slowdown, 400 pairs):        {power:.2%}   (target >= 95 %)")

    print("\npower curve: share of pairs failing the gate, 100 pairs per cell, 300 resamples")
    effects = (0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.07)
    print(f"{'test':<10}{'tolerance':>10}  " + "".join(f"{e:>7.0%}" for e in effects))
    for test, tol in (("bootstrap", 0.01), ("bootstrap", 0.02), ("bootstrap", 0.03), ("rank", 0.02)):
        g = rg.parse_gate(f"steps.time_s.p50 < +{tol * 100:g}%")
        row = [fail_rate(g, e, 100, seed=100 + i, test=test, n_boot=300) for i, e in enumerate(effects)]
        print(f"{test:<10}{tol:>10.0%}  " + "".join(f"{r:>7.1%}" for r in row))
    print(f"\n(runtime {time.perf_counter() - t0:.1f} s)")
    ok = fa <= 0.01 and power >= 0.95
    print("PASS" if ok else "FAIL: the default settings miss a target")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
