"""Analyse a synthetic DDP-like run of RANKS × STEPS from its node summaries (docs/scale.md) and check the targets.

The run is built node by node (8 ranks a node; per rank-step data_wait, forward, backward, comm_wait and optimizer
spans and 8 all-reduces; rank 7 slowed 1.3×), never held whole: a process pool writes each node's tables and then
its node summary, as each node's launcher does in a real job. The nodes fall in CLASS_NODES classes of the same
clock offset and jitter draws; one node of each class (and the slow rank's) is summarised from its tables, the
others' summaries are copied from it with their ranks and host (synth.copy_summary, the same files: ~0.27 CPU s a
node in all instead of ~1.6). Then, each in a fresh process so its peak memory is its own: one node's summary again
(what one node pays), and the global analysis from the summaries, with its wall and CPU seconds.

Targets (issue 19): global analysis <= 60 s and <= 8 GiB peak on the 2-core development machine, one node's
summary <= 2 s, the injected straggler named alone. `make bench` runs the 1,024 × 200 default; the issue's
target run is `--ranks 16384 --steps 1000` (2,048 nodes; build it where there is disk: --dir).

    .venv/bin/python benchmarks/analyze_scale.py [--ranks 1024] [--steps 200] [--dir /tmp] [--keep]
    .venv/bin/python benchmarks/analyze_scale.py --ranks 16384 --steps 100 --reuse RUN   # a run kept by --keep

``--reuse RUN`` skips the build: it builds the nodes a stopped build left unfinished (a run kept by --keep whose
build was killed), remakes the node summaries that
are missing or stale (written in another summary layout, e.g. after a change of dtprof/rundir/schema.py SUMMARY_LAYOUT)
with a local pool, then measures. ``--dask-workers N`` measures the global analysis again with its per-instance
reductions on a local Dask cluster of N processes (dtprof/cluster.py) and checks it gives the same summary.json.
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
# node n's clock is (n % CLASS_NODES) ms off and rank r draws rank r mod CLASS_NODES × 8's jitter: the nodes of a
# class have the same tables but for rank numbers and host, so one of them is summarised and the others' summaries
# copied from it (build_class)
CLASS_NODES = 64
BUILT_BY = f"benchmarks/analyze_scale.py, node classes of {CLASS_NODES}"   # run.json "created"; --reuse checks it
TARGET_GLOBAL_S, TARGET_GLOBAL_GIB, TARGET_NODE_S = 60.0, 8.0, 2.0
# the global analysis of --ranks 16384 --steps 1000 (seconds, peak RSS GiB, RSS after the imports GiB: 0.11 measured
# at 2,048 ranks, the same imports), printed per rank-step beside a smaller run's (issue 52)
REFERENCE = {"main at 2aa38ac (issue 52)": (52.1, 7.7, 0.11), "main at 69f8e94 (issue 52)": (81.8, 10.56, 0.11)}

# run in a fresh interpreter: time and peak RSS of one step alone (ru_maxrss: KiB on Linux)
MEASURE = """
import json, os, resource, sys, threading, time
from dtprof.allocator import keep_freed_memory
from dtprof.analyzers.summary import analyze
from dtprof.reader import open_run
from dtprof.summarize import summarize_node
what, path = sys.argv[1], sys.argv[2]
keep_freed_memory()   # as every dtprof command's process does (dtprof/cli.py)
page = os.sysconf("SC_PAGE_SIZE")

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page

base = rss()   # after the imports: what the analysis adds is measured from here
stages, cur = [], {"peak": base}

def sample():   # the peak RSS of each stage (a stage's own peak, not the process's so far)
    while True:
        cur["peak"] = max(cur["peak"], rss())
        time.sleep(0.01)

def progress(msg):   # analyze() names each stage before it starts it
    now, cpu, r = time.perf_counter(), time.process_time(), rss()
    if stages:
        stages[-1].update(seconds=now - stages[-1]["seconds"], cpu_s=cpu - stages[-1]["cpu_s"],
                          peak=max(cur["peak"], r), end=r)
    if msg is not None:
        stages.append({"stage": msg, "seconds": now, "cpu_s": cpu})
        cur["peak"] = r

threading.Thread(target=sample, daemon=True).start()
t0 = time.perf_counter()   # after the imports: a launcher or a worker has them loaded already
c0 = time.process_time()   # this process's CPU time, all its threads (DuckDB's too): what a shared machine's load
workers = None             # does not inflate
if what == "node":
    summarize_node(path)
    out = {}
elif what.startswith("dask:"):   # the per-instance reductions on a local Dask cluster of N worker processes
    from distributed import Client, LocalCluster, get_task_stream
    from dtprof.cluster import DaskReduce
    n = int(what[5:])
    with LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        def worker_rss():
            import resource
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        workers_base = client.run(worker_rss)
        t0 = time.perf_counter()
        with get_task_stream(client) as ts:
            s = analyze(open_run(path), progress=progress, reduce=DaskReduce(client)).summary
        progress(None)
        elapsed = time.perf_counter() - t0   # not the cluster's shutdown
        peaks = client.run(worker_rss)
    busy = {}
    for t in ts.data:   # each task's compute time, per worker
        busy[t["worker"]] = busy.get(t["worker"], 0.0) + sum(x["stop"] - x["start"] for x in t["startstops"]
                                                              if x["action"] == "compute")
    workers = [{"worker": w, "task_s": busy.get(w, 0.0), "peak_gib": peaks[w] / 2**30,
                "base_gib": workers_base[w] / 2**30} for w in sorted(peaks)]
else:
    s = analyze(open_run(path), progress=progress).summary
    progress(None)
if what != "node":
    out = {"stragglers": [x["rank"] for x in s["stragglers"]], "step_p50_s": s["steps"]["time_s"]["p50"],
           "what_if": [w["scenario"] for w in s["what_if"][:3]], "stages": stages, "workers": workers}
    if len(sys.argv) > 3:   # the summary itself, to compare two versions' answers on one run
        with open(sys.argv[3], "w") as f:
            json.dump(s, f, sort_keys=True)
out.update(seconds=elapsed if workers else time.perf_counter() - t0, cpu_s=time.process_time() - c0,
           load=os.getloadavg()[0], base_gib=base / 2**30,
           peak_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
print(json.dumps(out))
"""


def node_dir(run_dir: Path, node: int) -> Path:
    return run_dir / f"node-host{node:05d}"


def build_class(args) -> tuple[int, int]:
    """Build the nodes of one class (the same host offset and jitter draws: node % CLASS_NODES), each with its
    summary, as its launcher would write it: the class's template node (its first) and the slow rank's node
    summarised from their tables, every other one's summary copied from the template's with its ranks shifted
    (synth.copy_summary: the same files, ~10x faster). ``tables`` False: the nodes' tables exist, only their
    summaries are (re)made (stale after a change of the summary layout). Returns (nodes summarised, nodes copied)."""
    from dtprof.rundir.writer import SUMMARY_COMPLETE, SUMMARY_DIR
    from dtprof.summarize import summarize_node
    from synth import build_ddp_node, copy_summary

    run_dir, todo, template, ranks, steps, tables = args
    made = copied = 0
    cache: dict = {}
    for node in ([template] if template in todo else []) + [n for n in todo if n != template]:
        nd = node_dir(run_dir, node)
        if tables:
            build_ddp_node(run_dir, node, RANKS_PER_NODE, ranks, steps, slow_rank=SLOW_RANK, slow_factor=SLOW_FACTOR,
                           host_offset_ns=(node % CLASS_NODES) * 1_000_000, seed=1,
                           jitter_period=CLASS_NODES * RANKS_PER_NODE)
        tpl = node_dir(run_dir, template)
        if node in (template, SLOW_RANK // RANKS_PER_NODE) or not (tpl / SUMMARY_DIR / SUMMARY_COMPLETE).exists():
            summarize_node(str(nd))
            made += 1
        else:
            copy_summary(tpl, nd, (node - template) * RANKS_PER_NODE, cache)
            copied += 1
    return made, copied


def build_nodes(run_dir: Path, todo: list[int], args, tables: bool = True) -> tuple[int, int]:
    """Build the nodes ``todo`` of the run (``tables`` False: their summaries only) in a process pool, one task per
    class; returns (summarised, copied)."""
    slow_node = SLOW_RANK // RANKS_PER_NODE
    tasks = []
    for c in range(CLASS_NODES):
        members = [n for n in range(c, args.ranks // RANKS_PER_NODE, CLASS_NODES)]
        template = next((n for n in members if n != slow_node), members[0] if members else None)
        mine = [n for n in todo if n % CLASS_NODES == c]
        if mine:
            tasks.append((run_dir, mine, template, args.ranks, args.steps, tables))
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        done = list(pool.map(build_class, tasks))
    return sum(d[0] for d in done), sum(d[1] for d in done)


def build_missing(run_dir: Path, nodes: int, args) -> int:
    """Build the nodes of a kept run that a stopped build (killed, out of time) left without a complete summary
    (a partly written one is removed first), so that a long build can be finished in several sittings. Returns
    how many."""
    from dtprof.rundir.writer import SUMMARY_COMPLETE, SUMMARY_DIR

    todo = [n for n in range(nodes) if not (node_dir(run_dir, n) / SUMMARY_DIR / SUMMARY_COMPLETE).exists()]
    if len(todo) == nodes:   # nothing of this run: not a run this benchmark built
        return 0
    for n in todo:
        shutil.rmtree(node_dir(run_dir, n), ignore_errors=True)
    build_nodes(run_dir, todo, args)
    return len(todo)


def measure(what: str, path: Path, cap_gib: float, summary_out: str | None = None) -> dict:
    """Run MEASURE in a fresh process; stop it if its RSS passes ``cap_gib`` (the machine has no swap: a process
    past its memory starves or gets others killed), returning ``stopped`` with the RSS it had reached. The global
    analysis's summary.json is written to ``summary_out`` if given."""
    p = subprocess.Popen([sys.executable, "-c", MEASURE, what, str(path), *([summary_out] if summary_out else [])],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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


def measure_on_dask(run_dir: Path, args, glob: dict, rank_steps: int) -> bool:
    """The global analysis again with the per-instance reductions on a local Dask cluster of ``--dask-workers``
    processes: the client's time and peak RSS, each worker's task seconds and peak RSS, and whether its
    summary.json is the one-machine one (every key but analysis_s). Returns that."""
    from scale_checks import differences

    out = str(Path(args.summary_out).with_suffix(".dask.json"))
    d = measure(f"dask:{args.dask_workers}", run_dir, args.memory_cap_gib, out)
    if d.get("stopped"):
        print(f"on Dask: STOPPED at {d['peak_gib']:.2f} GiB RSS of the client")
        return False
    one, dask = (json.loads(Path(f).read_text()) for f in (args.summary_out, out))
    diff = differences(one, dask)
    print(f"on a local Dask cluster of {args.dask_workers} worker processes (fresh client process): "
          f"{d['seconds']:.1f} s, client peak RSS {d['peak_gib']:.2f} GiB "
          f"({(d['peak_gib'] - d['base_gib']) * 2**30 / rank_steps:.0f} B per rank-step over the imports); "
          f"one machine: {glob['seconds']:.1f} s, {glob['peak_gib']:.2f} GiB")
    for w in d["workers"]:
        print(f"  worker {w['worker']}: tasks {w['task_s']:.1f} s, peak RSS {w['peak_gib']:.2f} GiB "
              f"({w['base_gib']:.2f} GiB after its start)")
    print("  summary.json: the same as the one-machine one" if not diff else
          f"  summary.json DIFFERS in {len(diff)} field(s), e.g. {diff[:3]}")
    if args.stages:
        print_stages(d["stages"])
    return not diff


def print_per_rank_step(glob: dict, rank_steps: int) -> None:
    """The global analysis per rank-step beside the 16,384 × 1,000 run's (REFERENCE): the guard's figures. Memory is
    the peak RSS less the process's after its imports (a fixed ~0.2 GiB that would swamp a small run's figure)."""
    us = glob["seconds"] / rank_steps * 1e6
    grown = (glob["peak_gib"] - glob["base_gib"]) * 2**30 / rank_steps
    print(f"per rank-step: {us:.2f} us, {grown:.0f} B over the imports ({glob['base_gib']:.2f} GiB); "
          f"16,384 x 1,000 ({16384 * 1000:,} rank-steps) for comparison:")
    for what, (sec, gib, base) in REFERENCE.items():
        print(f"  {what}: {sec / 16.384:.2f} us, {(gib - base) * 2**30 / 16.384e6:.0f} B ({sec:.1f} s, {gib:.2f} GiB)")


def print_stages(stages: list[dict]) -> None:
    """analyze()'s stages: seconds, the stage's own peak RSS and the RSS it left (DuckDB's per-instance reductions
    run in a thread beside the stages from "node summaries" to "collective bandwidth", which wait for them)."""
    print("| stage | s | CPU s | peak GiB | after GiB |\n|---|---|---|---|---|")
    for st in stages:
        print(f"| {st['stage']} | {st['seconds']:.2f} | {st['cpu_s']:.2f} | {st['peak'] / 2**30:.2f} | "
              f"{st['end'] / 2**30:.2f} |")


def rss_gib(pid: int) -> float:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, IndexError, ValueError):   # it just ended
        return 0.0


def cpu_s() -> float:
    """CPU seconds of this process and its finished children (the build's pool)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


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
    ap.add_argument("--stages", action="store_true",
                    help="print the global analysis's time and peak RSS stage by stage (analyze's progress stages)")
    ap.add_argument("--dask-workers", type=int, default=0, metavar="N",
                    help="also run the global analysis with its per-instance reductions on a local Dask cluster of "
                         "N worker processes (dtprof/cluster.py), print the client's and each worker's figures and "
                         "check that its summary.json equals the one-machine one")
    ap.add_argument("--summary-out", default=None, metavar="FILE",
                    help="write the global analysis's summary.json here (to compare two versions on one run)")
    args = ap.parse_args()
    if args.ranks % RANKS_PER_NODE or args.ranks <= SLOW_RANK:
        ap.error(f"--ranks must be a multiple of {RANKS_PER_NODE} above {SLOW_RANK}")
    from dtprof.rundir.writer import create_run_dir

    nodes = args.ranks // RANKS_PER_NODE
    rows = args.ranks * args.steps * (5 + 8)
    if args.reuse:
        from dtprof.reader import open_run
        from dtprof.summarize import pending

        run_dir = Path(args.reuse)
        tmp = run_dir
        args.keep = True   # never delete a run given to measure
        created = json.loads((run_dir / "run.json").read_text()).get("created") if (run_dir / "run.json").exists() \
            else None
        if created != BUILT_BY:   # its nodes drew independent jitter: a summary copied from a class's would be wrong
            ap.error(f"{run_dir}/run.json: not a run this benchmark built in classes (created: {created!r}); "
                     f"build a new one")
        t0, c0 = time.perf_counter(), cpu_s()
        built = build_missing(run_dir, nodes, args)
        run = open_run(run_dir)
        if len(run.node_dirs) != nodes:
            ap.error(f"{run_dir} has {len(run.node_dirs)} nodes, not {nodes}")
        made = build_nodes(run_dir, [int(nd.name.removeprefix("node-host")) for nd in pending(run)], args,
                           tables=False)
        if built:
            print(f"built the {built} node(s) a stopped build had left unbuilt or unsummarised", flush=True)
        print(f"ranks {args.ranks} ({nodes} nodes of {RANKS_PER_NODE}), steps {args.steps}: {rows:,} spans + "
              f"collectives, {du_gib(run_dir):.2f} GiB on disk; reused {run_dir}; stale or missing node "
              f"summaries: {made[0]} remade, {made[1]} copied from their class's; in {time.perf_counter() - t0:.0f} s "
              f"({cpu_s() - c0:.0f} CPU s) with {args.workers} processes", flush=True)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="dtprof-scale-", dir=args.dir))
        run_dir = tmp / "run"
    tmp_summary = Path(tempfile.mkdtemp(prefix="dtprof-scale-summary-"))
    try:
        if not args.reuse:
            create_run_dir(run_dir, {"command": ["synthetic"], "created": BUILT_BY})
            t0, c0 = time.perf_counter(), cpu_s()
            made, copied = build_nodes(run_dir, list(range(nodes)), args)
            print(f"ranks {args.ranks} ({nodes} nodes of {RANKS_PER_NODE}), steps {args.steps}: {rows:,} spans + "
                  f"collectives, {du_gib(run_dir):.2f} GiB on disk; built in {time.perf_counter() - t0:.0f} s "
                  f"({cpu_s() - c0:.0f} CPU s) with {args.workers} processes: {made} node summaries made, {copied} "
                  f"copied from their class's", flush=True)
        one = measure("node", run_dir / f"node-host{0:05d}", args.memory_cap_gib)
        print(f"one node's summary (fresh process): {one['seconds']:.2f} s, peak RSS {one['peak_gib']:.2f} GiB "
              f"(target <= {TARGET_NODE_S:.0f} s)", flush=True)
        if args.dask_workers and not args.summary_out:   # the one-machine summary, to compare (removed below)
            args.summary_out = str(tmp_summary / "summary.json")
        glob = measure("global", run_dir, args.memory_cap_gib, args.summary_out)
        if glob.get("stopped"):
            print(f"global analysis from the node summaries (fresh process): STOPPED after {glob['seconds']:.1f} s "
                  f"at {glob['peak_gib']:.2f} GiB RSS, over --memory-cap-gib {args.memory_cap_gib:g} "
                  f"(targets <= {TARGET_GLOBAL_S:.0f} s, <= {TARGET_GLOBAL_GIB:.0f} GiB)")
            glob.update(stragglers=None)
        else:
            print(f"global analysis from the node summaries (fresh process): {glob['seconds']:.1f} s "
                  f"({glob['cpu_s']:.1f} CPU s, load {glob['load']:.1f} on {os.cpu_count()} CPUs at its end), "
                  f"peak RSS {glob['peak_gib']:.2f} GiB (targets <= {TARGET_GLOBAL_S:.0f} s, "
                  f"<= {TARGET_GLOBAL_GIB:.0f} GiB)")
            print(f"stragglers named: {glob['stragglers']} (injected: [{SLOW_RANK}]); step p50 "
                  f"{glob['step_p50_s']:.4f} s; top what-if: {glob['what_if']}")
            print_per_rank_step(glob, args.ranks * args.steps)
            if args.stages:
                print_stages(glob["stages"])
        same_on_dask = True
        if args.dask_workers and not glob.get("stopped"):
            same_on_dask = measure_on_dask(run_dir, args, glob, args.ranks * args.steps)
        checks = {"global analysis finished": not glob.get("stopped"),
                  "the same summary on Dask": same_on_dask,
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
        shutil.rmtree(tmp_summary, ignore_errors=True)
        if args.keep:
            if not args.reuse:
                print(f"kept {run_dir}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
