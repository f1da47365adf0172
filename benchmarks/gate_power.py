"""False-alarm rate and power of `dtprof compare`'s step-time gate on synthetic runs with realistic noise.

Each simulated run is 100 measured steps (warm-up already excluded) of a job whose step time carries
- multiplicative step jitter (lognormal, sigma 3 %),
- a slow drift (AR(1), phi 0.9, marginal sigma 1 %: thermal and data-dependent variation),
- outlier steps (2 % of steps take 1.5-3x as long: GC pauses, checkpoint writes, data stalls),
- a run-level offset (sigma 0.5 %: two runs of one configuration on different nodes or days differ a little).
Identical configurations draw base and head from the same model; a slowdown multiplies head by (1 + effect).

Prints, at the default settings (the gate DEFAULT_GATES[0], its test and confidence), the false-alarm rate over
identical configurations and the detection rate of a true 5 % slowdown, then a power curve over effect sizes for a
few tolerances and both tests, which is how the defaults were chosen (docs/compare.md); then several runs a side
with a large run-to-run spread, with and without the run-level t interval; then the same for the rows
beside the gate: how often identical configurations show a "what moved" part row or a machine-probe change, and
how often a 5 % slowdown placed in backward lists backward first; last the whole decision as `dtprof compare`
makes it (exit 0/1/3 with every row beside the gate) for identical configurations and a 5 % slowdown.
Deterministic (seeded).

    .venv/bin/python benchmarks/gate_power.py          # ~2-3 min on a 2-core machine
    .venv/bin/python benchmarks/gate_power.py --real DIR [--reps 3]   # real runs beside CPU hogs (8 runs a rep)
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


# The step split into parts (shares of the step), each part with its own extra jitter; the parts sum to the step.
PART_SHARES = {"forward": 0.30, "backward": 0.50, "optimizer": 0.05, "exposed_comm": 0.10, "data_wait": 0.0,
               "bubble": 0.0, "other": 0.05}
PART_JITTER = 0.05
PROBE_SPREAD, PROBE_TIMINGS = 0.30, 10   # the probe on a busy machine: ±30 % per timing, 5 before + 5 after
# The GPU probe (CUDA-event timings of a fixed matmul, 5 before + 5 after on each of 2 GPUs): ±5 % per timing is an
# assumption, not a measurement (no GPU here); the GPU's own clock changes, not host load, are what spread them.
GPU_PROBE_SPREAD, GPU_PROBE_TIMINGS = 0.05, 20


def synth_parts(rng: np.random.Generator, backward_effect: float = 0.0) -> dict:
    """A summary with per-step parts: the step (synth_steps) split by PART_SHARES with per-part jitter, plus
    ``backward_effect`` × the base step added to backward, and a probe of this machine (no change)."""
    x = synth_steps(rng)
    w = {p: s * np.exp(rng.normal(0.0, PART_JITTER, len(x))) for p, s in PART_SHARES.items()}
    tot = sum(w.values())
    parts = {p: x * v / tot for p, v in w.items()}
    parts["backward"] = parts["backward"] + backward_effect * 0.25
    step = sum(parts.values())
    probe = 0.01 * np.exp(rng.normal(0.0, PROBE_SPREAD, PROBE_TIMINGS))
    gpu = 0.0015 * np.exp(rng.normal(0.0, GPU_PROBE_SPREAD, GPU_PROBE_TIMINGS))
    return {"steps": {"per_step_time_s": step.tolist(), "time_s": {"p50": float(np.median(step))}},
            "breakdown": {"per_step": {"step": list(range(len(x))),
                                       "parts": {p: v.tolist() for p, v in parts.items()}}},
            "run": {"world_size": 2, "identity": {"command": "torchrun train.py", "script_sha256": "same"},
                    "model": {"parameters": 1234567},
                    "probe": {"cpu_start_s": probe.tolist(), "cpu_end_s": [],
                              "gpu_start_s": gpu[:10].tolist(), "gpu_end_s": gpu[10:].tolist()}},
            "stragglers": []}


def pooled_fail_rate(run_sigma: float, runs: int, effect: float, trials: int, seed: int, confidence: float,
                     run_level: bool = True) -> float:
    """Share of comparisons of ``runs`` 40-step runs a side (this VM's fixture: tests/jobs/test_compare_real.py) failing
    the default gate when identical configurations differ by ``run_sigma`` from run to run; ``run_level=False``
    decides on the hierarchical bootstrap alone (without regression.run_level_interval), as before it existed."""
    global RUN_SIGMA
    saved, saved_fn = RUN_SIGMA, rg.run_level_interval
    RUN_SIGMA = run_sigma
    if not run_level:
        rg.run_level_interval = lambda *a, **k: None   # the ablation: the bootstrap's own interval
    try:
        rng = np.random.default_rng(seed)
        gate = rg.parse_gate(rg.DEFAULT_GATES[0])
        fails = 0
        for t in range(trials):
            b = [summary(synth_steps(rng, n=40)) for _ in range(runs)]
            h = [summary(synth_steps(rng, n=40, effect=effect)) for _ in range(runs)]
            fails += rg.evaluate_gate(gate, b, h, confidence=confidence, n_boot=500, seed=t).verdict == rg.FAIL
        return fails / trials
    finally:
        RUN_SIGMA, rg.run_level_interval = saved, saved_fn


def part_rates(effect: float, trials: int, seed: int) -> tuple[float, float, float]:
    """(share of pairs with any part row, share whose first row is backward, share with the probe 'moved')."""
    rng = np.random.default_rng(seed)
    any_row = first_bw = probe_moved = 0
    for t in range(trials):
        base, head = synth_parts(rng), synth_parts(rng, backward_effect=effect)
        rows = rg.part_changes([base], [head], n_boot=500, seed=t)["rows"]
        any_row += bool(rows)
        first_bw += bool(rows) and rows[0]["part"] == "backward"
        pc = rg.probe_change([base], [head], n_boot=500, seed=t)
        probe_moved += bool(pc and pc["moved"])
    return any_row / trials, first_bw / trials, probe_moved / trials


def verdict_rates(effect: float, trials: int, seed: int) -> dict[int, float]:
    """Share of pairs per exit code of the whole decision, as `dtprof compare` makes it with its defaults: the step
    gate plus the rows beside it (parts, stragglers, identity, CPU and GPU probes; regression.verdict)."""
    rng = np.random.default_rng(seed)
    gate = rg.parse_gate(rg.DEFAULT_GATES[0])
    codes = {0: 0, 1: 0, 3: 0}
    for t in range(trials):
        base, head = synth_parts(rng), synth_parts(rng, backward_effect=effect)
        r = rg.evaluate_gate(gate, [base], [head], seed=t)
        code = rg.verdict([r], [base], [head], seed=t)["exit_code"]
        codes[code] += 1
    return {c: n / trials for c, n in codes.items()}


# ---- real runs beside a CPU hog (issue 50) ------------------------------------------------------------------------
# `--real DIR [--reps R]`: records R repetitions of a pool of real 2-rank runs of examples/train_ddp.py with
# `dtprof run` into DIR (kept: a second call only adds what is missing), then decides every pair of a cell with
# `dtprof compare`'s whole decision. Cells: identical configurations and regressions of 10 % and 25 % of the step
# (every rank sleeps that share of a base step more per step: a part no faster machine shortens), each with CPU
# hogs (2 x cores + 1 busy loops) beside the base or beside the head recordings.
REAL_STEPS = 40
REAL_HOGS = 2 * (__import__("os").cpu_count() or 2) + 1
REAL_RUNS = {"base": (0, False), "base_hog": (0, True), "same": (0, False), "same_hog": (0, True),
             "reg10": (0.10, False), "reg10_hog": (0.10, True), "reg25": (0.25, False), "reg25_hog": (0.25, True)}
REAL_CELLS = (("identical, hog beside base", "base_hog", "same", 0),
              ("identical, hog beside head", "base", "same_hog", 0), ("identical, no hog", "base", "same", 0),
              ("+10 %, hog beside base", "base_hog", "reg10", 1), ("+10 %, hog beside head", "base", "reg10_hog", 1),
              ("+25 %, hog beside base", "base_hog", "reg25", 1), ("+25 %, hog beside head", "base", "reg25_hog", 1))


def record_real(out, sleep_ms: float, hog: bool) -> None:
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    binp = Path(sys.executable).parent
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(REAL_HOGS if hog else 0)]
    try:
        subprocess.run([str(binp / "dtprof"), "run", "--out", str(out), "--no-report", "--no-nvml", "--quiet", "--",
                        str(binp / "torchrun"), "--nproc_per_node=2", str(repo / "examples" / "train_ddp.py"),
                        "--steps", str(REAL_STEPS), "--dim", "128", "--seq", "64",
                        *(["--sleep-ms", f"{sleep_ms:.1f}"] if sleep_ms else [])], check=True, capture_output=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def real_runs(folder, reps: int) -> dict[str, list]:
    """The pool, recorded in an interleaved order (each repetition records every kind once) so that the machine's
    other load is spread over the kinds alike. The regressions' sleep is a share of the first base run's median
    step."""
    from pathlib import Path

    from dtprof.compare import load_summary

    folder = Path(folder)
    out: dict[str, list] = {k: [] for k in REAL_RUNS}
    step_ms = 0.0
    for rep in range(reps):
        for kind, (share, hog) in REAL_RUNS.items():
            run = folder / f"{kind}-{rep}"
            if not (run / "summary.json").exists():
                import shutil

                shutil.rmtree(run, ignore_errors=True)
                record_real(run, share * step_ms, hog)
                (folder / f"{run.name}.load").write_text(f"{__import__('os').getloadavg()[0]:.1f}\n")
                print(f"  recorded {run.name}", file=sys.stderr, flush=True)
            out[kind].append(load_summary(run)[1])
            if kind == "base" and rep == 0:
                step_ms = out[kind][0]["steps"]["time_s"]["p50"] * 1e3
    return out


def real_rates(pool: dict[str, list]) -> list[tuple[str, int, dict[int, int], list[str]]]:
    """Per cell: (name, pairs, {exit code: count}, a line for each pair that missed its target: an identical
    configuration that failed, a regression that passed) over every base run x head run of the cell."""
    gate = rg.parse_gate(rg.DEFAULT_GATES[0])
    out = []
    for name, b_kind, h_kind, regression in REAL_CELLS:
        codes = {0: 0, 1: 0, 3: 0}
        misses = []
        for i, b in enumerate(pool[b_kind]):
            for j, h in enumerate(pool[h_kind]):
                r = rg.evaluate_gate(gate, [b], [h], seed=i * 100 + j)
                v = rg.verdict([r], [b], [h], seed=i * 100 + j, allow_different=True)
                codes[v["exit_code"]] += 1
                if v["exit_code"] == (0 if regression else 1):
                    probes = "; ".join(p["line"] for p in (v["job_probe"], v["probe"]) if p)
                    busy = (v["drift"] or {}).get("busy") or {}
                    lo, hi = r.ci or (float("nan"), float("nan"))
                    misses.append(f"  {b_kind}-{i} -> {h_kind}-{j}: step p50 {(r.change or 0) * 100:+.1f} % "
                                  f"[{lo * 100:+.1f}, {hi * 100:+.1f}]; CPU wait {busy.get('base', float('nan')):.0%}"
                                  f" -> {busy.get('head', float('nan')):.0%}; {probes}")
        out.append((name, sum(codes.values()), codes, misses))
    return out


def real_main(folder, reps: int) -> int:
    pool = real_runs(folder, reps)
    print(f"real runs: 2-rank examples/train_ddp.py, {REAL_STEPS} steps, {reps} run(s) of each kind, {REAL_HOGS} "
          f"CPU hogs beside the hogged ones; every base x head pair of a cell decided as `dtprof compare` does")
    print(f"{'cell':<30}{'pairs':>6}{'exit 0':>8}{'exit 1':>8}{'exit 3':>8}")
    ok = True
    misses = []
    for (name, n, codes, missed), (_, _, _, regression) in zip(real_rates(pool), REAL_CELLS):
        print(f"{name:<30}{n:>6}" + "".join(f"{codes[c] / n:>8.0%}" for c in (0, 1, 3)))
        ok = ok and (codes[0] / n <= 0.05 if regression else codes[1] / n <= 0.01)
        misses += missed
    loads = [float(p.read_text()) for p in __import__("pathlib").Path(folder).glob("*.load")]
    if loads:
        print(f"load average (1 min) as each run ended: {min(loads):.1f}-{max(loads):.1f}, median "
              f"{np.median(loads):.1f}")
    if misses:
        print("pairs that missed their target:\n" + "\n".join(misses))
    print("PASS" if ok else "FAIL: a real-run target missed (regressions caught >= 95 %, identical failing <= 1 %)")
    return 0 if ok else 1


def main() -> int:
    if "--real" in sys.argv:
        i = sys.argv.index("--real")
        reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 3
        return real_main(sys.argv[i + 1], reps)
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
    print("\nseveral runs a side on a machine whose runs differ a lot (run offset sigma 6 %, as this shared VM's "
          "tests/jobs/test_compare_real.py runs), 40 steps a run, 400 comparisons per cell, 500 resamples")
    print(f"{'runs a side':<12}{'confidence':>11}  {'identical: bootstrap alone':>27}  {'+ run-level t':>14}  "
          f"{'+20 % caught':>13}")
    pooled = {}
    for k, conf in ((2, 0.90), (3, 0.90), (3, 0.99)):
        pooled[k, conf] = [pooled_fail_rate(0.06, k, 0.0, 400, 11, conf, run_level=False),
                           pooled_fail_rate(0.06, k, 0.0, 400, 11, conf),
                           pooled_fail_rate(0.06, k, 0.20, 400, 12, conf)]
        print(f"{k:<12}{conf:>11.0%}  " + "".join(f"{r:>{w}.1%}" for r, w in zip(pooled[k, conf], (27, 16, 15))))
    print(f"\nwhat-moved rows (parts beyond ±1 % of the step) and the machine probe (±{rg.PROBE_TOLERANCE:.0%}), "
          f"300 pairs, 500 resamples")
    null_rows, _, null_probe = part_rates(0.0, 300, seed=7)
    _, bw_first, _ = part_rates(0.05, 300, seed=8)
    print(f"identical configurations: a part row in {null_rows:.1%} of pairs; probe 'machine changed' in "
          f"{null_probe:.1%} (the probe's spread alone: ±{PROBE_SPREAD:.0%} per timing, {PROBE_TIMINGS} timings)")
    print(f"true 5 % slowdown, all in backward: backward is the first row in {bw_first:.1%} of pairs")
    print(f"\nthe whole decision (gate + parts, stragglers, identity, CPU and GPU probes; GPU probe spread "
          f"±{GPU_PROBE_SPREAD:.0%} assumed), 150 pairs, {rg.DEFAULT_N_BOOT} resamples")
    null, slow = verdict_rates(0.0, 150, seed=9), verdict_rates(0.05, 150, seed=10)
    print(f"identical configurations: exit 1 (false alarm) {null[1]:.1%}, exit 3 (inconclusive) {null[3]:.1%}")
    print(f"true 5 % slowdown:        exit 1 (caught) {slow[1]:.1%}, exit 3 (inconclusive) {slow[3]:.1%}")
    print(f"\n(runtime {time.perf_counter() - t0:.1f} s)")
    ok = (fa <= 0.01 and power >= 0.95 and null_rows <= 0.05 and null_probe <= 0.01 and bw_first >= 0.95
          and null[1] <= 0.01 and null[3] <= 0.02 and slow[1] + slow[3] >= 0.95)
    ok = ok and all(after <= before for before, after, _ in pooled.values()) and pooled[3, 0.99][1] <= 0.01
    print("PASS" if ok else "FAIL: the default settings miss a target")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
