"""How much disk a run takes per rank and step, and how long a long run's analysis takes (issue 37, point 4: "a week
without filling the disk": <= 50 MB per rank per day at 10 steps a second, every step's time kept; a 1,000,000-step
run analysed within a minute).

1. A real job: `dtprof run -- torchrun --nproc_per_node=2 examples/train_ddp.py --steps N` (with a TensorBoard sink
   at --metrics-interval 0, so the sink's bytes per point are measured too). Bytes per rank and step of what grows
   while the job runs (each rank's JSON-lines files, the node's nvml/events files) and of what the launcher writes
   after it (tables/*.parquet, the node summary), each extrapolated to MB per rank per day at 10 steps/s; the
   TensorBoard sink's bytes per point, extrapolated to a day at the default --metrics-interval (one point per rank
   every 10 s).
2. A synthetic DDP run (tests/synth.py ``build_ddp_node``: 8 ranks, per rank-step 5 spans and 8 all-reduces, every
   step in full detail) of STEPS steps, its node summary made as the launcher does, then the global analysis timed
   in a fresh process (benchmarks/analyze_scale.py ``measure``), and the time per step extrapolated to 1,000,000.

    .venv/bin/python benchmarks/footprint.py [--job-steps 200] [--synthetic-steps 20000] [--skip-job|--skip-synthetic]
                                             [--check]     # exit 1 when a target is missed (make bench: report only)

Every step in full detail (the figures of a job recorded before the rank side sampled steps; 2-core development
VM, shared and busy, torch 2.13 CPU): the job's rank files grow by 577 bytes per rank-step (498 MB per rank per day
at 10 steps/s; 1,145 MB with the Parquet tables and node summary written after the job) against the 50 MB target;
the TensorBoard sink 1,239 bytes a point (10.7 MB per rank per day at the default interval); the synthetic
8 x 20,000-step run analysed in 16.2 s at 2.15 GiB peak (0.81 ms a step: ~810 s and far more memory for 1,000,000
steps in full detail, against 60 s).

In full detail every step keeps its spans and collectives; the rank side's step sampling (docs/cli-run.md,
"Sampling") keeps only blocks of steps in detail, and this benchmark is how to check what a run then costs.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

STEPS_PER_DAY = 10 * 86_400          # 10 steps a second
TARGET_MB_PER_RANK_DAY = 50.0
TARGET_ANALYSIS_S = 60.0
TARGET_STEPS = 1_000_000
POINTS_PER_DAY = 86_400 // 10        # the trackers' default --metrics-interval: one point per rank every 10 s


def size(paths) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def real_job(steps: int, tmp: Path) -> dict:
    bin_dir = Path(sys.executable).parent
    run = tmp / "run"
    cmd = [sys.executable, "-m", "dtprof.cli", "run", "--out", str(run), "--no-report", "--quiet",
           "--metrics", f"tensorboard:{tmp / 'tb'}", "--metrics-interval", "0", "--",
           str(bin_dir / "torchrun"), "--nproc_per_node=2", str(ROOT / "examples" / "train_ddp.py"),
           "--steps", str(steps), "--dim", "64", "--seq", "32"]
    p = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=600)
    if p.returncode:
        raise SystemExit(f"the job failed ({p.returncode}):\n{p.stderr[-3000:]}")
    (node,) = run.glob("node-*")
    ranks = sorted(node.glob("rank-*"))
    n = len(ranks) * steps
    per = {
        "rank files (JSON lines, grow while the job runs)": size(f for r in ranks for f in r.glob("*.jsonl")),
        "node files (nvml, events; JSON lines)": size(node.glob("*.jsonl")),
        "tables/*.parquet (written after the job)": size((node / "tables").glob("*")),
        "node summary (written after the job)": size((node / "summary").glob("*")),
    }
    tb_files = list((tmp / "tb").rglob("*"))
    tb_points = steps * len(ranks)
    return {"rank_steps": n, "bytes": per, "tb_bytes": size(tb_files), "tb_points": tb_points}


def synthetic(steps: int, tmp: Path) -> dict:
    from analyze_scale import RANKS_PER_NODE, SLOW_FACTOR, SLOW_RANK, measure

    from dtprof.runformat import create_run_dir
    from dtprof.summarize import summarize_node
    from synth import build_ddp_node

    run = tmp / "synthetic"
    create_run_dir(run, {"command": ["synthetic"], "created": "benchmarks/footprint.py"})
    t0 = time.perf_counter()
    node = build_ddp_node(run, 0, RANKS_PER_NODE, RANKS_PER_NODE, steps, slow_rank=SLOW_RANK,
                          slow_factor=SLOW_FACTOR, seed=1)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    summarize_node(str(node))
    t_summary = time.perf_counter() - t0
    glob = measure("global", run, cap_gib=8.0)
    return {"steps": steps, "ranks": RANKS_PER_NODE, "build_s": t_build, "summary_s": t_summary,
            "analysis_s": glob["seconds"], "peak_gib": glob["peak_gib"], "stopped": bool(glob.get("stopped")),
            "disk_bytes": size(run.rglob("*"))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job-steps", type=int, default=200)
    ap.add_argument("--synthetic-steps", type=int, default=20_000)
    ap.add_argument("--skip-job", action="store_true")
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--dir", default=None, help="where to build (default: the system's temp directory)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dtprof-footprint-", dir=args.dir))
    ok = True
    try:
        if not args.skip_job:
            j = real_job(args.job_steps, tmp)
            print(f"real job: 2-rank DDP (examples/train_ddp.py --dim 64 --seq 32), {args.job_steps} steps a rank")
            print("| what | bytes per rank-step | MB per rank per day at 10 steps/s |\n|---|---|---|")
            for what, b in j["bytes"].items():
                per = b / j["rank_steps"]
                print(f"| {what} | {per:,.0f} | {per * STEPS_PER_DAY / 1e6:,.0f} |")
            grow = sum(list(j["bytes"].values())[:2]) / j["rank_steps"] * STEPS_PER_DAY / 1e6
            total = sum(j["bytes"].values()) / j["rank_steps"] * STEPS_PER_DAY / 1e6
            tb = j["tb_bytes"] / j["tb_points"]
            print(f"| TensorBoard sink, per point (~14 values) | {tb:,.0f} | {tb * POINTS_PER_DAY / 1e6:,.1f} at the "
                  f"default --metrics-interval 10 |")
            print(f"while the job runs: {grow:,.0f} MB per rank per day; with the files written after it: "
                  f"{total:,.0f} MB (target <= {TARGET_MB_PER_RANK_DAY:.0f})")
            ok &= total <= TARGET_MB_PER_RANK_DAY
        if not args.skip_synthetic:
            s = synthetic(args.synthetic_steps, tmp)
            per_step = s["analysis_s"] / s["steps"]
            print(f"synthetic run: {s['ranks']} ranks x {s['steps']:,} steps (every step in full detail), "
                  f"{s['disk_bytes'] / 2**20:,.0f} MiB on disk; built in {s['build_s']:.0f} s, node summary "
                  f"{s['summary_s']:.1f} s")
            if s["stopped"]:
                print(f"global analysis: STOPPED at {s['peak_gib']:.1f} GiB after {s['analysis_s']:.0f} s")
                ok = False
            else:
                est = per_step * TARGET_STEPS
                print(f"global analysis (fresh process): {s['analysis_s']:.1f} s, peak RSS {s['peak_gib']:.2f} GiB; "
                      f"{per_step * 1e3:.2f} ms a step, so ~{est:,.0f} s for {TARGET_STEPS:,} steps if it scales "
                      f"linearly (target <= {TARGET_ANALYSIS_S:.0f} s)")
                ok &= est <= TARGET_ANALYSIS_S
        print("PASS" if ok else "FAIL (see above: without rank-side step sampling, every step keeps its detail)")
        return 0 if ok or not args.check else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
