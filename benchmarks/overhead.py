"""dtprof's overhead on real jobs: step time bare vs under `dtprof run`, and dtprof's own CPU time per step.

Real jobs (issue 14): two-rank torchrun jobs on this machine -- DDP, FSDP2, a pipeline (examples/) and a framework
job (examples/frameworks/train_lightning.py; ``--jobs`` also knows ``accelerate``) -- each run bare and under
`dtprof run` (its defaults, no report), bare and profiled runs interleaved with the order alternating per round, so
the machine's noise (other jobs) hits both alike. A job's step time is its own: the interval between consecutive
"step N" lines rank 0 prints (taken as they arrive; the first intervals are warm-up and dropped), median per run.
Reported per job: bare and profiled median step, the ratio (median over rounds of profiled / bare of the same
round), and dtprof's CPU time per rank and step, in two parts:

- background threads (flusher, heartbeat): each rank reads their own CPU clocks at exit (``dtprof_threads_cpu``
  meta row), divided by the rank's steps;
- hooks on the training thread: measured in one process started the way `dtprof run` starts a rank, as CPU time
  of the training thread (``time.thread_time``: only the CPU the thread used, so it is far less sensitive to other
  work on the machine than wall time), in alternating blocks with dtprof on and off (its hooks removed and
  recording paused). A step of a tiny DDP model on a one-rank gloo group (as many modules as the examples' TinyLM,
  one gradient bucket) gives the cost of a step with one collective; blocks of ``dist.all_reduce`` the cost of
  each further collective. A job's hook cost = step cost + collective cost x (its collectives per rank-step - 1),
  counted in its profiled run. The collective wrappers and DDP's ``c10d::allreduce_`` observer stay installed in the
  off blocks (they cannot be taken out) and pass straight through there, so that pass-through is not counted: a
  lower bound by that much.

``--quick`` is a smoke check (one round, short runs): it runs everything end to end, its figures mean little.
``--in-process`` also runs the older single-process comparison (TinyLM blocks: bare, dtprof, torch.profiler).

    .venv/bin/python benchmarks/overhead.py [--quick] [--rounds 3] [--steps 40] [--jobs ddp,fsdp2,pipeline,lightning]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODES = ("bare", "dtprof", "torch.profiler")


def worker(blocks: int, steps: int) -> None:
    import torch

    from dtprof.collectors import runtime

    sys.path.insert(0, str(REPO / "examples"))
    from model import TinyLM, lm_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyLM(vocab=512, dim=192, layers=3, seq=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 512, (16, 8, 65), generator=g)

    def train(n):
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            x, y = data[i % 16, :, :-1], data[i % 16, :, 1:]
            loss = lm_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            out.append(time.perf_counter() - t0)
        return out[1:]

    train(5)                      # warm-up; dtprof starts recording at the first forward (no RANK: one process)
    assert runtime.STATE.active, "dtprof did not start in the benchmark process"
    installed = True
    results = []
    for b in range(blocks):
        for mode in MODES[b % 3:] + MODES[: b % 3]:
            want = mode == "dtprof"
            if want != installed:
                (runtime.STATE.install_train_hooks if want else runtime.STATE.remove_train_hooks)()
                installed = want
            if mode == "torch.profiler":
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    t = train(steps + 1)
                    prof.step()
            else:
                t = train(steps + 1)
            results.append({"block": b, "mode": mode, "times": t})
    assert not runtime.STATE.disabled, "dtprof disabled itself during the benchmark"
    print(json.dumps({"blocks": results}))


def hooks_worker(blocks: int) -> None:
    """CPU time of the training thread per step and per collective, dtprof on vs off (module docstring)."""
    import torch
    import torch.distributed as dist

    from dtprof.collectors import runtime

    sys.path.insert(0, str(REPO / "examples"))
    from model import TinyLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    modules = sum(1 for _ in TinyLM(vocab=512, dim=192, layers=3, seq=64).modules())
    tiny = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(modules)]))
    opt = torch.optim.SGD(tiny.parameters(), lr=1e-3)
    x, buf = torch.randn(4, 8), torch.ones(64)

    def steps(n):
        t0 = time.thread_time()
        for _ in range(n):
            tiny(x).sum().backward()
            opt.step()
            opt.zero_grad()
        return (time.thread_time() - t0) / n

    def collectives(n):
        t0 = time.thread_time()
        for _ in range(n):
            dist.all_reduce(buf)
        return (time.thread_time() - t0) / n

    steps(5)                      # dtprof starts recording at the first forward (no RANK: one process)
    assert runtime.STATE.active, "dtprof did not start in the benchmark process"
    on = True
    res = {"step": {"on": [], "off": []}, "collective": {"on": [], "off": []}}
    for b in range(blocks):
        for mode in ("on", "off") if b % 2 else ("off", "on"):
            if (mode == "on") != on:
                on = mode == "on"
                (runtime.STATE.install_train_hooks if on else runtime.STATE.remove_train_hooks)()
                runtime.STATE.active = on          # the collective observers record only while active
            res["step"][mode].append(steps(100))
            res["collective"][mode].append(collectives(200))
    assert not runtime.STATE.disabled, "dtprof disabled itself during the benchmark"
    print(json.dumps({**res, "modules": modules}))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

STEP_LINE = re.compile(r"^step (\d+) ")
MODEL = ["--dim", "256", "--seq", "64", "--layers", "2", "--batch", "8"]
JOBS = {
    "ddp": ["examples/train_ddp.py", *MODEL],
    "fsdp2": ["examples/train_fsdp.py", *MODEL],
    "pipeline": ["examples/train_pipeline.py", *MODEL],
    "lightning": ["examples/frameworks/train_lightning.py", "--dim", "1024", "--batch", "64", "--lr", "0.001"],
    "accelerate": ["examples/frameworks/train_accelerate.py", "--dim", "1024", "--batch", "64"],
}
DEFAULT_JOBS = "ddp,fsdp2,pipeline,lightning"
WARMUP_INTERVALS = 3


def run_job(name: str, steps: int, run_dir: Path | None) -> dict:
    """One run of a job; ``run_dir`` set: under `dtprof run`. Its median step (s) and, profiled, dtprof's thread
    CPU seconds per rank-step and the collectives per rank-step."""
    bindir = Path(sys.executable).parent
    cmd = [str(bindir / "torchrun"), "--nproc_per_node=2", "--monitor-interval=0.2", *JOBS[name], "--steps",
           str(steps)]
    if run_dir is not None:
        cmd = [sys.executable, "-m", "dtprof.cli", "run", "--out", str(run_dir), "--no-report", "--quiet", "--", *cmd]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTPROF_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    # Its own session, as `dtprof run` gives the job one: Linux's autogroup scheduler shares the CPU per session, so
    # a bare job left in this session would compete with whatever else runs here and read slower than it is.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    seen = []
    for line in proc.stdout:
        if STEP_LINE.match(line):
            seen.append(time.monotonic())
    if proc.wait():
        sys.exit(f"{name}: {' '.join(cmd)} exited {proc.returncode}")
    intervals = [b - a for a, b in zip(seen, seen[1:])][WARMUP_INTERVALS:]
    out = {"step_s": statistics.median(intervals)}
    if run_dir is not None:
        from dtprof.reader import open_run

        run = open_run(run_dir)
        meta = run.meta[run.meta["kind"].astype(str) == "dtprof_threads_cpu"]
        cpu = sum(sum(v["threads"].values()) for v in meta["value"])
        rank_steps = max(1, len(run.steps))
        out["threads_cpu_s_per_rank_step"] = cpu / rank_steps
        out["collectives_per_rank_step"] = len(run.collectives) / rank_steps
    return out


def hook_cost(blocks: int) -> dict:
    """Training-thread CPU seconds dtprof adds: per step (with one collective) and per further collective, each
    the median over blocks of (on - off) of the same block; and the off step (the tiny model's own cost)."""
    data = in_process(["--hooks", "--blocks", str(blocks)])
    added = {k: statistics.median(a - b for a, b in zip(data[k]["on"], data[k]["off"])) for k in ("step", "collective")}
    return {**added, "bare_step": statistics.median(data["step"]["off"]), "modules": data["modules"]}


def in_process(args: list[str]) -> dict:
    import dtprof._inject
    from dtprof.runformat import create_node_dir, create_run_dir

    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DTPROF_", "RANK", "LOCAL_RANK"))}
        env["OMP_NUM_THREADS"] = "1"
        env["DTPROF_NODE_DIR"] = str(create_node_dir(create_run_dir(Path(tmp) / "run", {"benchmark": "overhead"})))
        env["DTPROF_CONFIG"] = json.dumps({"flush_interval_s": 1.0})
        env["PYTHONPATH"] = os.pathsep.join([str(Path(dtprof._inject.__file__).parent), env.get("PYTHONPATH", "")])
        out = subprocess.run([sys.executable, __file__, "--worker", *args], env=env, capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr[-2000:])
        return json.loads(out.stdout.strip().splitlines()[-1])


def print_in_process(blocks: int, steps: int) -> None:
    results = in_process(["--blocks", str(blocks), "--block-steps", str(steps)])["blocks"]
    med = {(r["block"], r["mode"]): statistics.median(r["times"]) for r in results}
    print(f"{'mode':15s} {'median step (ms)':>17s} {'paired ratio vs bare':>21s}   blocks x steps")
    for m in MODES:
        all_t = [t for r in results if r["mode"] == m for t in r["times"]]
        ratio = statistics.median(med[(b, m)] / med[(b, "bare")] for b in range(blocks))
        print(f"{m:15s} {statistics.median(all_t) * 1e3:17.3f} {ratio:21.4f}   {blocks} x {steps}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="bare/profiled pairs per job")
    ap.add_argument("--steps", type=int, default=40, help="steps per run")
    ap.add_argument("--jobs", default=DEFAULT_JOBS, help=f"comma-separated, of {', '.join(JOBS)}")
    ap.add_argument("--quick", action="store_true", help="smoke check: 1 round of 12-step runs, short hook blocks")
    ap.add_argument("--in-process", action="store_true", help="also the single-process TinyLM comparison")
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--block-steps", type=int, default=8)
    ap.add_argument("--hook-blocks", type=int, default=30, help="on/off block pairs of the hook measurement")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--hooks", action="store_true")
    a = ap.parse_args()
    if a.worker:
        return hooks_worker(a.blocks) if a.hooks else worker(a.blocks, a.block_steps)
    if a.quick:
        a.rounds, a.steps, a.hook_blocks = 1, 12, 4

    hooks = hook_cost(a.hook_blocks)
    print(f"training-thread hooks (CPU): +{hooks['step'] * 1e6:.1f} us per step with one collective, "
          f"+{hooks['collective'] * 1e6:.1f} us per further collective (tiny DDP model, {hooks['modules']} modules, "
          f"{hooks['bare_step'] * 1e6:.0f} us CPU per bare step)", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.jobs.split(","):
            bare, prof, cpu, colls = [], [], [], []
            for r in range(a.rounds):
                for mode in (("bare", "dtprof") if r % 2 == 0 else ("dtprof", "bare")):
                    print(f"{name} round {r + 1}/{a.rounds}: {mode} ...", file=sys.stderr)
                    res = run_job(name, a.steps, Path(tmp) / f"{name}-{r}" if mode == "dtprof" else None)
                    (prof if mode == "dtprof" else bare).append(res["step_s"])
                    if mode == "dtprof":
                        cpu.append(res["threads_cpu_s_per_rank_step"])
                        colls.append(res["collectives_per_rank_step"])
            ratio = statistics.median(p / b for p, b in zip(prof, bare))
            n_coll = statistics.median(colls)
            hook_s = hooks["step"] + hooks["collective"] * max(n_coll - 1, 0)
            rows.append((name, statistics.median(bare), statistics.median(prof), ratio, statistics.median(cpu),
                         n_coll, hook_s))
    print(f"{'job':11s} {'bare step':>10s} {'dtprof step':>12s} {'ratio':>7s} {'CPU/step: threads':>18s} "
          f"{'hooks':>9s} {'(colls)':>8s} {'= % of step':>11s}")
    for name, b, p, ratio, cpu, n_coll, hook_s in rows:
        print(f"{name:11s} {b * 1e3:8.2f}ms {p * 1e3:10.2f}ms {ratio:7.4f} {cpu * 1e6:16.1f}us {hook_s * 1e6:7.1f}us "
              f"{n_coll:8.1f} {(cpu + hook_s) / b * 100:10.2f}%")
    print(f"ratio = median over {a.rounds} interleaved round(s) of (profiled / bare median step); target <= 1.01. "
          f"CPU per rank and step: dtprof's background threads (their CPU clocks, read in the job) + its "
          f"training-thread hooks (CPU time, in one process: per step + per further collective x (colls - 1)).")
    if a.in_process:
        print_in_process(a.blocks, a.block_steps)


if __name__ == "__main__":
    main()
