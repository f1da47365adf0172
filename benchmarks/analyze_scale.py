"""Analyse a synthetic DDP-like run of RANKS × STEPS from its node summaries (docs/scale.md) and check the targets.

The run is built node by node (8 ranks a node; per rank-step data_wait, forward, backward, comm_wait and optimizer
spans and 8 all-reduces; rank 7 slowed 1.3×), never held whole: a process pool writes each node's tables and then
its node summary, as each node's launcher does in a real job. Then, each in a fresh process so its peak memory is
its own: one node's summary again (what one node pays), and the global analysis from the summaries.

Targets (issue 19): global analysis <= 60 s and <= 8 GiB peak on the 2-core development machine, one node's
summary <= 2 s, the injected straggler named alone. `make bench` runs the 1,024 × 200 default; the issue's
target run is `--ranks 16384 --steps 1000` (2,048 nodes; build it where there is disk: --dir).

    .venv/bin/python benchmarks/analyze_scale.py [--ranks 1024] [--steps 200] [--dir /tmp] [--keep]
    .venv/bin/python benchmarks/analyze_scale.py --ranks 16384 --steps 100 --reuse RUN   # a run kept by --keep

``--reuse RUN`` skips the build: it remakes the node summaries that are missing or stale (written in another
summary layout, e.g. after a change of dtprof/schema.py SUMMARY_LAYOUT) with a local pool, then measures.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

RANKS_PER_NODE = 8
SLOW_RANK, SLOW_FACTOR = 7, 1.3
TARGET_GLOBAL_S, TARGET_GLOBAL_GIB, TARGET_NODE_S = 60.0, 8.0, 2.0

# run in a fresh interpreter: time and peak RSS of one step alone (ru_maxrss: KiB on Linux)
MEASURE = """
import json, resource, sys, time
from dtprof.allocator import keep_freed_memory
from dtprof.analyzers.summary import analyze
from dtprof.reader import open_run
from dtprof.summarize import summarize_node
what, path = sys.argv[1], sys.argv[2]
keep_freed_memory()   # as every dtprof command's process does (dtprof/cli.py)
t0 = time.perf_counter()   # after the imports: a launcher or a worker has them loaded already
if what == "node":
    summarize_node(path)
    out = {}
else:
    s = analyze(open_run(path)).summary
    out = {"stragglers": [x["rank"] for x in s["stragglers"]], "step_p50_s": s["steps"]["time_s"]["p50"],
           "what_if": [w["scenario"] for w in s["what_if"][:3]]}
out.update(seconds=time.perf_counter() - t0, peak_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
print(json.dumps(out))
"""


def build_and_summarize(args) -> float:
    """One node: its tables, then its summary (as its launcher does); returns the summary's seconds."""
    from dtprof.summarize import summarize_node
    from synth import build_ddp_node

    run_dir, node, ranks, steps = args
    nd = build_ddp_node(run_dir, node, RANKS_PER_NODE, ranks, steps, slow_rank=SLOW_RANK, slow_factor=SLOW_FACTOR,
                        host_offset_ns=(node % 64) * 1_000_000, seed=1)
    t0 = time.perf_counter()
    summarize_node(str(nd))
    return time.perf_counter() - t0


def measure(what: str, path: Path, cap_gib: float) -> dict:
    """Run MEASURE in a fresh process; stop it if its RSS passes ``cap_gib`` (the machine has no swap: a process
    past its memory starves or gets others killed), returning ``stopped`` with the RSS it had reached."""
    p = subprocess.Popen([sys.executable, "-c", MEASURE, what, str(path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    t0, rss = time.perf_counter(), 0.0
    while True:
        try:
            out, err = p.communicate(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            rss = max(rss, rss_gib(p.pid))
            if rss > cap_gib:
                p.kill()
                p.communicate()
                return {"stopped": True, "seconds": time.perf_counter() - t0, "peak_gib": rss}
    if p.returncode:
        raise SystemExit(f"{what} measurement failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def rss_gib(pid: int) -> float:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, IndexError, ValueError):   # it just ended
        return 0.0


def du_gib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**30


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dir", default=None, help="where to build the run (default: the system's temp directory)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes building the nodes")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (printed)")
    ap.add_argument("--memory-cap-gib", type=float, default=12.0,
                    help="stop a measurement whose RSS passes this (it fails the memory target then; default 12, "
                         "half of the development machine, which has no swap)")
    ap.add_argument("--reuse", default=None, metavar="RUN",
                    help="measure this run (built with --keep for the same --ranks and --steps) instead of building")
    args = ap.parse_args()
    if args.ranks % RANKS_PER_NODE or args.ranks <= SLOW_RANK:
        ap.error(f"--ranks must be a multiple of {RANKS_PER_NODE} above {SLOW_RANK}")
    from dtprof.runformat import create_run_dir

    nodes = args.ranks // RANKS_PER_NODE
    rows = args.ranks * args.steps * (5 + 8)
    if args.reuse:
        from dtprof.reader import open_run
        from dtprof.summarize import make_summaries

        run_dir = Path(args.reuse)
        tmp = run_dir
        args.keep = True   # never delete a run given to measure
        run = open_run(run_dir)
        if len(run.node_dirs) != nodes:
            ap.error(f"{run_dir} has {len(run.node_dirs)} nodes, not {nodes}")
        t0 = time.perf_counter()
        made = make_summaries(run, workers=args.workers)
        print(f"ranks {args.ranks} ({nodes} nodes of {RANKS_PER_NODE}), steps {args.steps}: {rows:,} spans + "
              f"collectives, {du_gib(run_dir):.2f} GiB on disk; reused {run_dir}, {len(made)} stale or missing "
              f"node summaries remade in {time.perf_counter() - t0:.0f} s with {args.workers} processes", flush=True)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="dtprof-scale-", dir=args.dir))
        run_dir = tmp / "run"
    try:
        if not args.reuse:
            create_run_dir(run_dir, {"command": ["synthetic"], "created": "benchmarks/analyze_scale.py"})
            t0 = time.perf_counter()
            with ProcessPoolExecutor(max_workers=args.workers) as pool:
                node_s = list(pool.map(build_and_summarize,
                                       [(run_dir, n, args.ranks, args.steps) for n in range(nodes)],
                                       chunksize=max(1, nodes // (args.workers * 8))))
            t_build = time.perf_counter() - t0
            print(f"ranks {args.ranks} ({nodes} nodes of {RANKS_PER_NODE}), steps {args.steps}: {rows:,} spans + "
                  f"collectives, {du_gib(run_dir):.2f} GiB on disk; built and summarised in {t_build:.0f} s with "
                  f"{args.workers} processes (node summary in the pool: median "
                  f"{sorted(node_s)[len(node_s) // 2]:.2f} s, max {max(node_s):.2f} s)", flush=True)
        one = measure("node", run_dir / f"node-host{0:05d}", args.memory_cap_gib)
        print(f"one node's summary (fresh process): {one['seconds']:.2f} s, peak RSS {one['peak_gib']:.2f} GiB "
              f"(target <= {TARGET_NODE_S:.0f} s)", flush=True)
        glob = measure("global", run_dir, args.memory_cap_gib)
        if glob.get("stopped"):
            print(f"global analysis from the node summaries (fresh process): STOPPED after {glob['seconds']:.1f} s "
                  f"at {glob['peak_gib']:.2f} GiB RSS, over --memory-cap-gib {args.memory_cap_gib:g} "
                  f"(targets <= {TARGET_GLOBAL_S:.0f} s, <= {TARGET_GLOBAL_GIB:.0f} GiB)")
            glob.update(stragglers=None)
        else:
            print(f"global analysis from the node summaries (fresh process): {glob['seconds']:.1f} s, peak RSS "
                  f"{glob['peak_gib']:.2f} GiB (targets <= {TARGET_GLOBAL_S:.0f} s, <= {TARGET_GLOBAL_GIB:.0f} GiB)")
            print(f"stragglers named: {glob['stragglers']} (injected: [{SLOW_RANK}]); step p50 "
                  f"{glob['step_p50_s']:.4f} s; top what-if: {glob['what_if']}")
        checks = {"global analysis finished": not glob.get("stopped"),
                  "global time": glob["seconds"] <= TARGET_GLOBAL_S,
                  "global memory": glob["peak_gib"] <= TARGET_GLOBAL_GIB,
                  "node summary time": one["seconds"] <= TARGET_NODE_S,
                  "straggler named alone": glob["stragglers"] == [SLOW_RANK]}
        print("| measure | value | target |\n|---|---|---|\n"
              f"| one node's summary | {one['seconds']:.2f} s, {one['peak_gib']:.2f} GiB | <= {TARGET_NODE_S:.0f} s |\n"
              f"| global analysis | {glob['seconds']:.1f} s, {glob['peak_gib']:.2f} GiB | <= {TARGET_GLOBAL_S:.0f} s, "
              f"<= {TARGET_GLOBAL_GIB:.0f} GiB |\n| stragglers | {glob['stragglers']} | [{SLOW_RANK}] |")
        ok = all(checks.values())
        print("PASS" if ok else "FAIL: " + ", ".join(k for k, v in checks.items() if not v))
        return 0 if ok else 1
    finally:
        if args.keep:
            if not args.reuse:
                print(f"kept {run_dir}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
