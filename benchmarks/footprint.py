"""How fast a long job's run directory grows, and how long a long run's analysis takes (issue 37, point 4: "a week
without filling the disk": <= 50 MB per rank per day at 10 steps a second, every step's time kept; a 1,000,000-step
run analysed within a minute).

1. A real job at 10 steps a second: `dtprof run -- torchrun --nproc_per_node=2 examples/train_ddp.py --data-ms 90`
   (each step waits 90 ms for its batch, ~100 ms steps), with a TensorBoard sink (--metrics-interval 0, so the
   sink's bytes per point are measured too), for --job-seconds. The ranks' files are measured every few seconds
   while it runs: their growth in the first minute (every step in full detail) and over the last third of the run
   (after the footprint check, collectors/sampling.py check_footprint, has sampled the detail), as MB per rank per
   day; then what the launcher writes after the job (tables/*.parquet, the node summary) per rank-step.
2. A synthetic sampled DDP run (tests/synth.py ``build_ddp_node``: 8 ranks, per detailed rank-step 5 spans and 8
   all-reduces, blocks of 4 detailed steps every --detail-period, the others boundary-only) of --synthetic-steps
   steps: its node summary made as the launcher does, then the global analysis (`dtprof summary`'s) timed in a
   fresh process (benchmarks/analyze_scale.py ``measure``). Both are checked against the minute (the user waits for
   the node summary after the job, then for `dtprof summary`): on the 2-core development VM at 1,000,000 steps the
   node summary takes 25-35 s and 6.0 GiB, the global analysis 20-25 s and 6.9 GiB (docs/validation.md).

    .venv/bin/python benchmarks/footprint.py [--job-seconds 360] [--synthetic-steps 1000000] [--detail-period 16]
                                             [--skip-job|--skip-synthetic] [--check]   # --check: exit 1 on a miss
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

DAY_S = 86_400
TARGET_MB_PER_RANK_DAY = 50.0
TARGET_ANALYSIS_S = 60.0
POINTS_PER_DAY = DAY_S // 10        # the trackers' default --metrics-interval: one point per rank every 10 s
POLL_S = 5.0


def size(paths) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def rank_files(run: Path) -> list[Path]:
    return [f for f in run.glob("node-*/rank-*/*") if f.name.endswith(".jsonl.gz")]


def real_job(seconds: int, tmp: Path) -> dict:
    bin_dir = Path(sys.executable).parent
    run = tmp / "run"
    cmd = [sys.executable, "-m", "dtprof.cli", "run", "--out", str(run), "--no-report", "--quiet",
           "--metrics", f"tensorboard:{tmp / 'tb'}", "--metrics-interval", "0", "--",
           str(bin_dir / "torchrun"), "--nproc_per_node=2", str(ROOT / "examples" / "train_ddp.py"),
           "--steps", str(seconds * 10), "--dim", "64", "--seq", "32", "--data-ms", "90"]
    p = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    t0, grown = time.monotonic(), []        # (seconds since start, bytes of the ranks' files)
    while p.poll() is None:
        grown.append((time.monotonic() - t0, size(rank_files(run))))
        time.sleep(POLL_S)
    err = p.stderr.read() if p.stderr else ""
    if p.returncode:
        raise SystemExit(f"the job failed ({p.returncode}):\n{err[-3000:]}")
    (node,) = run.glob("node-*")
    ranks = len(list(node.glob("rank-*")))
    from dtprof.reader import open_run

    r = open_run(run)
    steps = len(r.steps)
    periods = sorted({int(v.get("period") or 0) for k, v in zip(r.meta["kind"].astype(str), r.meta["value"])
                      if k == "sampling" and isinstance(v, dict)})

    def rate(a: float, b: float) -> float:      # bytes a second a rank, between a and b seconds in
        pts = [(t, n) for t, n in grown if a <= t <= b]
        return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]) / ranks if len(pts) > 1 else float("nan")

    end = grown[-1][0]
    return {"ranks": ranks, "rank_steps": steps, "seconds": end, "periods": periods,
            "first_minute": rate(5, 65), "last_third": rate(end * 2 / 3, end),
            "after_job": size((node / "tables").glob("*")) + size((node / "summary").glob("*")),
            "rank_files": size(rank_files(run)), "tb_bytes": size((tmp / "tb").rglob("*")), "tb_points": steps}


def synthetic(steps: int, period: int, tmp: Path) -> dict:
    from analyze_scale import RANKS_PER_NODE, SLOW_FACTOR, SLOW_RANK, measure

    from dtprof.rundir.writer import create_run_dir
    from synth import build_ddp_node

    run = tmp / "synthetic"
    create_run_dir(run, {"command": ["synthetic"], "created": "benchmarks/footprint.py"})
    t0 = time.perf_counter()
    node = build_ddp_node(run, 0, RANKS_PER_NODE, RANKS_PER_NODE, steps, slow_rank=SLOW_RANK,
                          slow_factor=SLOW_FACTOR, seed=1, detail_period=period)
    t_build = time.perf_counter() - t0
    summary = measure("node", node, cap_gib=20.0)
    glob = measure("global", run, cap_gib=20.0)
    return {"steps": steps, "ranks": RANKS_PER_NODE, "build_s": t_build, "summary_s": summary["seconds"],
            "summary_gib": summary["peak_gib"], "analysis_s": glob["seconds"], "peak_gib": glob["peak_gib"],
            "stopped": bool(glob.get("stopped") or summary.get("stopped")), "stragglers": glob.get("stragglers"),
            "disk_bytes": size(run.rglob("*"))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job-seconds", type=int, default=360)
    ap.add_argument("--synthetic-steps", type=int, default=1_000_000)
    ap.add_argument("--detail-period", type=int, default=16)
    ap.add_argument("--skip-job", action="store_true")
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--dir", default=None, help="where to build (default: the system's temp directory)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dtprof-footprint-", dir=args.dir))
    ok = True
    try:
        if not args.skip_job:
            j = real_job(args.job_seconds, tmp)
            first, last = (j[k] * DAY_S / 1e6 for k in ("first_minute", "last_third"))
            after = j["after_job"] / j["rank_steps"]
            tb = j["tb_bytes"] / j["tb_points"]
            rate = j["rank_steps"] / j["ranks"] / j["seconds"]
            print(f"real job: 2-rank DDP (examples/train_ddp.py --data-ms 90), {j['seconds']:.0f} s at {rate:.1f} "
                  f"steps/s, {j['rank_steps']:,} rank-steps, detail periods {j['periods']}")
            print("| what | per rank |\n|---|---|")
            print(f"| rank files, first minute (every step in full detail) | {first:,.1f} MB a day |")
            print(f"| rank files, last third of the run (sampled) | {last:,.1f} MB a day |")
            print(f"| rank files in all | {j['rank_files'] / j['rank_steps']:,.0f} bytes a step |")
            print(f"| tables/*.parquet and node summary, written after the job | {after:,.0f} bytes a step "
                  f"({after * 10 * DAY_S / 1e6:,.0f} MB per day of job at 10 steps/s) |")
            print(f"| TensorBoard sink, per point (~14 values) | {tb:,.0f} bytes ({tb * POINTS_PER_DAY / 1e6:,.1f} MB "
                  f"a day at the default --metrics-interval 10) |")
            print(f"growth while the job runs, sampled: {last:,.1f} MB per rank per day (target <= "
                  f"{TARGET_MB_PER_RANK_DAY:.0f})")
            ok &= last <= TARGET_MB_PER_RANK_DAY
        if not args.skip_synthetic:
            s = synthetic(args.synthetic_steps, args.detail_period, tmp)
            print(f"synthetic run: {s['ranks']} ranks x {s['steps']:,} steps (blocks of 4 detailed steps every "
                  f"{args.detail_period}), {s['disk_bytes'] / 2**20:,.0f} MiB on disk; built in {s['build_s']:.0f} s")
            if s["stopped"]:
                print(f"STOPPED at {s['peak_gib']:.1f} GiB")
                ok = False
            else:
                print(f"node summary (the launcher, after the job): {s['summary_s']:.1f} s, peak RSS "
                      f"{s['summary_gib']:.2f} GiB; global analysis (fresh process): {s['analysis_s']:.1f} s, peak "
                      f"RSS {s['peak_gib']:.2f} GiB (target <= {TARGET_ANALYSIS_S:.0f} s each); stragglers named "
                      f"{s['stragglers']}")
                # the user waits for both: the launcher's node summary after the job, then `dtprof summary`
                ok &= s["summary_s"] <= TARGET_ANALYSIS_S and s["analysis_s"] <= TARGET_ANALYSIS_S
        print("PASS" if ok else "FAIL")
        return 0 if ok or not args.check else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
