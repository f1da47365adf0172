"""dtprof's overhead on real jobs: step time bare vs under `dtprof run`, and dtprof's own CPU time per step.

Real jobs (issue 14): two-rank torchrun jobs on this machine -- DDP, FSDP2, a pipeline (examples/) and a framework
job (examples/frameworks/train_accelerate.py) -- each run bare and under `dtprof run` (its defaults, no report),
bare and profiled runs interleaved with the order alternating per round, so the machine's noise (other jobs) hits
both alike. A job's step time is its own: the interval between consecutive "step N" lines rank 0 prints (taken as
they arrive; the first intervals are warm-up and dropped), median per run. Reported per job: bare and profiled
median step, the ratio (median over rounds of profiled / bare of the same round), and dtprof's CPU time per step:
its background threads (flusher, heartbeat; each rank reports their CPU time at exit, ``dtprof_threads_cpu`` meta
row) and its hooks on the training thread (measured in one process, below). Target: <= 1 % of the step.

Hook cost (in one process, started the way `dtprof run` starts a rank): a tiny model with as many modules as the
examples' TinyLM, ~1 ms steps, alternating blocks with dtprof's training hooks installed and removed
(``runtime.STATE.remove_train_hooks``): the median added time per step is the training-thread cost.
``--in-process`` also runs the older single-process comparison (TinyLM blocks: bare, dtprof, torch.profiler).

    .venv/bin/python benchmarks/overhead.py [--rounds 3] [--steps 40] [--jobs ddp,fsdp2,pipeline,accelerate]
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
    # Absolute cost per step, measured where it is not drowned by compute: a tiny model (as many modules as TinyLM)
    # whose step is ~1 ms; it is made a root module like TinyLM, so each step runs dtprof's forward hooks on the
    # root, its backward wrapper and its optimizer hooks, and writes the step and span rows.
    tiny = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(sum(1 for _ in model.modules()))])
    runtime.STATE.note_root(tiny)
    if installed:
        runtime.STATE.remove_train_hooks()
        runtime.STATE.install_train_hooks()
    topt = torch.optim.SGD(tiny.parameters(), lr=1e-3)
    xt = torch.randn(4, 8)
    tiny_res = {"bare": [], "dtprof": []}
    for b in range(60):
        for mode in ("bare", "dtprof") if b % 2 else ("dtprof", "bare"):
            want = mode == "dtprof"
            if want != installed:
                (runtime.STATE.install_train_hooks if want else runtime.STATE.remove_train_hooks)()
                installed = want
            t0 = time.perf_counter()
            for _ in range(100):
                tiny(xt).sum().backward()
                topt.step()
            tiny_res[mode].append((time.perf_counter() - t0) / 100)
    assert not runtime.STATE.disabled, "dtprof disabled itself during the benchmark"
    print(json.dumps({"blocks": results, "tiny": tiny_res,
                      "module_calls_per_step": sum(1 for _ in model.modules())}))


STEP_LINE = re.compile(r"^step (\d+) ")
MODEL = ["--dim", "256", "--seq", "64", "--layers", "2", "--batch", "8"]
JOBS = {
    "ddp": ["examples/train_ddp.py", *MODEL],
    "fsdp2": ["examples/train_fsdp.py", *MODEL],
    "pipeline": ["examples/train_pipeline.py", *MODEL],
    "accelerate": ["examples/frameworks/train_accelerate.py", "--dim", "1024", "--batch", "64"],
}
WARMUP_INTERVALS = 3


def run_job(name: str, steps: int, run_dir: Path | None) -> dict:
    """One run of a job; ``run_dir`` set: under `dtprof run`. Its median step (s) and, profiled, dtprof's thread
    CPU seconds per rank-step."""
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
        out["threads_cpu_s_per_rank_step"] = cpu / max(1, len(run.steps))
    return out


def hook_cost_per_step() -> tuple[float, float, int]:
    """(added seconds per step on the training thread, tiny-model bare step, modules) from the in-process worker."""
    data = in_process(blocks=0, steps=0)
    tiny = data["tiny"]
    added = statistics.median(d - b for d, b in zip(tiny["dtprof"], tiny["bare"]))
    return added, statistics.median(tiny["bare"]), data["module_calls_per_step"]


def in_process(blocks: int, steps: int) -> dict:
    import dtprof._inject
    from dtprof.runformat import create_node_dir, create_run_dir

    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DTPROF_", "RANK", "LOCAL_RANK"))}
        env["OMP_NUM_THREADS"] = "1"
        env["DTPROF_NODE_DIR"] = str(create_node_dir(create_run_dir(Path(tmp) / "run", {"benchmark": "overhead"})))
        env["DTPROF_CONFIG"] = json.dumps({"flush_interval_s": 1.0})
        env["PYTHONPATH"] = os.pathsep.join([str(Path(dtprof._inject.__file__).parent), env.get("PYTHONPATH", "")])
        out = subprocess.run([sys.executable, __file__, "--worker", "--blocks", str(blocks), "--steps",
                              str(steps)], env=env, capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr[-2000:])
        return json.loads(out.stdout.strip().splitlines()[-1])


def print_in_process(blocks: int, steps: int) -> None:
    results = in_process(blocks, steps)["blocks"]
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
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--in-process", action="store_true", help="also the single-process TinyLM comparison")
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--block-steps", type=int, default=8)
    ap.add_argument("--worker", action="store_true")
    a = ap.parse_args()
    if a.worker:
        return worker(a.blocks, a.block_steps if a.blocks else 0)

    added, tiny_step, modules = hook_cost_per_step()
    print(f"training-thread hooks: +{added * 1e6:.1f} us per step (tiny model, {modules} modules, "
          f"{tiny_step * 1e6:.0f} us bare step)", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.jobs.split(","):
            bare, prof, cpu = [], [], []
            for r in range(a.rounds):
                for mode in (("bare", "dtprof") if r % 2 == 0 else ("dtprof", "bare")):
                    print(f"{name} round {r + 1}/{a.rounds}: {mode} ...", file=sys.stderr)
                    res = run_job(name, a.steps, Path(tmp) / f"{name}-{r}" if mode == "dtprof" else None)
                    (prof if mode == "dtprof" else bare).append(res["step_s"])
                    if mode == "dtprof":
                        cpu.append(res["threads_cpu_s_per_rank_step"])
            ratio = statistics.median(p / b for p, b in zip(prof, bare))
            rows.append((name, statistics.median(bare), statistics.median(prof), ratio, statistics.median(cpu)))
    print(f"{'job':11s} {'bare step':>10s} {'dtprof step':>12s} {'ratio':>7s} {'dtprof CPU/step: threads':>25s} "
          f"{'+ hooks':>8s} {'= % of step':>11s}")
    for name, b, p, ratio, cpu in rows:
        print(f"{name:11s} {b * 1e3:8.2f}ms {p * 1e3:10.2f}ms {ratio:7.4f} {cpu * 1e6:23.1f}us {added * 1e6:6.1f}us "
              f"{(cpu + added) / b * 100:10.2f}%")
    print(f"ratio = median over {a.rounds} interleaved rounds of (profiled / bare median step); target <= 1.01. "
          f"CPU per step per rank: dtprof's background threads (measured in the job) + its training-thread hooks "
          f"(measured in one process).")
    if a.in_process:
        print_in_process(a.blocks, a.block_steps)


if __name__ == "__main__":
    main()
