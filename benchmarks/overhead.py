"""dtprof's overhead on real jobs: step time bare vs under `dtprof run`, and dtprof's own CPU time per step.

Real jobs (issue 14): two-rank torchrun jobs on this machine -- DDP, FSDP2, a pipeline (examples/) and a framework
job (examples/frameworks/train_lightning.py; ``--jobs`` also knows ``accelerate`` and ``lightning-wide``, the
Lightning job with a wider model and ~40 ms steps), a compiled DDP job (``compiled``: torch.compile, inductor), and
two one-rank jobs of short steps where dtprof samples its detail: ``short`` (the DDP tutorial's Linear(20, 1),
~0.25 ms steps) and ``ms`` (a one-layer transformer, 1-3 ms steps) -- each run bare and under
`dtprof run` (its defaults, no report) in interleaved rounds (bare, profiled, profiled, bare, ...: each mode runs
first as often as second), so the machine's noise (other jobs) hits both alike; many short rounds rather than a few
long ones, so a burst of load elsewhere spoils a round or two, not the figure. A job's step time is its own: the
interval between consecutive "step N" lines rank 0 prints, read from the job's clock the line carries
(``--print-time``; not when the line arrives: `dtprof run` relays frequent output in bursts), the first intervals
(warm-up) dropped, median per run; each job runs a few seconds of steps (JOBS), so dtprof's timers cost their share.
Reported per job: bare and profiled median step, the wall ratio (median over rounds of profiled / bare of the same
round) with its confidence interval from the order statistics of the per-round ratios (distribution-free; 95 %
from 6 rounds on, the extremes and their coverage below that), and dtprof's CPU time per rank and step, in three
parts:

- threads in the rank (flusher, heartbeat): each rank reads their own CPU clocks when step 0 ends and at exit
  (``dtprof_threads_cpu`` meta row); the difference over the steps after step 0 (start-up excluded, the tail after
  the last step included);
- `dtprof run`'s launcher and its output relays: their processes' CPU clocks read when the timed steps' first and
  last lines arrive, per step, shared by the ranks;
- hooks on the training thread: measured in a two-rank torchrun job with dtprof injected as `dtprof run` does, as
  CPU time of each rank's training thread (``time.thread_time``: only the CPU the thread used, so it is far less
  sensitive to other work on the machine than wall time), in alternating blocks with dtprof on and off (off: its
  step hooks, collective wrappers, ``Work.wait`` patch and ``c10d::allreduce_`` kernel all taken out; both ranks
  switch at the same point; the first calls after a switch are not measured), the median over blocks of each
  rank's on - off, averaged over the ranks. Two ranks, not one: with a peer, collectives complete later, in gloo's
  threads, and the completion callbacks contend for the GIL as in a real job (a one-rank group priced a
  Lightning-like step at ~125-155 us where a two-rank job paid ~230 us). A step of a tiny DDP model (as many
  modules as the examples' TinyLM, one gradient bucket) gives the cost of a step with one all-reduce; blocks of
  ``dist.all_reduce`` the cost of each further all-reduce (wrapper and Work.wait patch: the call skips the c10d
  kernel), blocks of ``dist.broadcast`` that of any other collective, blocks of DataLoader
  batches that of each batch (the ``__next__`` wrapper). A job's hook cost = step cost + all-reduce cost x (its
  all-reduces per rank-step - 1) + other cost x (its other collectives per rank-step) + batch cost x (its
  DataLoader batches per rank-step), counted in its profiled run. The same blocks read the CPU of the process's
  other threads (all but dtprof's own, which are counted above): what dtprof adds there is its completion
  callbacks, run in the backend's threads (``callbacks``, priced the same way).

The ranks share the machine's cores with all of it, so this CPU is what dtprof takes from the job; a rank it delays
holds the others at the next collective, so a step's wall cost is bounded by about the ranks' sum (2x the per-rank
share here). It resolves what the wall ratio cannot on a busy machine.

``--quick`` is a smoke check (one round, short runs): it runs everything end to end, its figures mean little.
``--in-process`` also runs the older single-process comparison (TinyLM blocks: bare, dtprof, torch.profiler).

    .venv/bin/python benchmarks/overhead.py [--quick] [--rounds 4] [--steps N] [--jobs ddp,fsdp2,pipeline,lightning]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from torch_abort import once_more_on_exit_abort  # noqa: E402  (tests/torch_abort.py says why)

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

    from dtprof.collectors import runtime, stepclock

    sys.path.insert(0, str(REPO / "examples"))
    from model import TinyLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo")       # RANKS ranks started by torchrun (in_process)
    modules = sum(1 for _ in TinyLM(vocab=512, dim=192, layers=3, seq=64).modules())
    tiny = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(modules)]))
    opt = torch.optim.SGD(tiny.parameters(), lr=1e-3)
    x, buf = torch.randn(4, 8), torch.ones(64)
    loader = iter(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(1 << 20, 1)), batch_size=4))

    def switch(on: bool) -> None:
        """Everything dtprof put on the training thread's path in or out: the step hooks, the collective
        wrappers, Work.wait and the c10d::allreduce_ kernel (off = a process without dtprof's hooks)."""
        (runtime.STATE.install_optimizer_hooks if on else runtime.STATE.remove_optimizer_hooks)()
        runtime.STATE.switch_path_hooks(on)

    def cpu():
        """(the training thread's CPU seconds, the CPU seconds of the process's other threads but dtprof's own):
        the second holds what dtprof's completion callbacks cost the backend's threads."""
        own, thread, process = stepclock.own_threads_cpu_s(), time.thread_time(), time.process_time()
        return thread, process - thread - sum(own.values())

    def per_call(t0, n):
        t1 = cpu()
        return (t1[0] - t0[0]) / n, (t1[1] - t0[1]) / n

    def steps(n):
        t0 = cpu()
        for _ in range(n):
            tiny(x).sum().backward()
            opt.step()
            opt.zero_grad()
        return per_call(t0, n)

    def collectives(op, n):
        t0 = cpu()
        for _ in range(n):
            op(buf)
        return per_call(t0, n)

    def broadcast(t):
        dist.broadcast(t, 0)

    def batches(n):
        t0 = cpu()
        for _ in range(n):
            next(loader)
        return per_call(t0, n)

    steps(5)
    assert runtime.STATE.active, "dtprof did not start in the benchmark process"
    on = True
    res = {k: {"on": [], "off": []} for k in ("step", "all_reduce", "collective", "batch", "step_other",
                                              "all_reduce_other", "collective_other", "batch_other")}
    for b in range(blocks):
        for mode in ("on", "off") if b % 2 else ("off", "on"):
            if (mode == "on") != on:
                on = mode == "on"
                switch(on)
                # the first calls after a switch run slower or faster than the steady state (up to ~40 us a step
                # in a two-rank job): not measured
                steps(2), collectives(dist.all_reduce, 5), collectives(broadcast, 5), batches(5)
            # short blocks, many pairs: on and off see the same interference from the rest of the machine
            for k, (main, other) in (("step", steps(10)), ("all_reduce", collectives(dist.all_reduce, 40)),
                                     ("collective", collectives(broadcast, 40)), ("batch", batches(40))):
                res[k][mode].append(main)
                res[k + "_other"][mode].append(other)
    assert not runtime.STATE.disabled, "dtprof disabled itself during the benchmark"
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, res)
    if dist.get_rank() == 0:
        print(json.dumps({"ranks": ranks, "modules": modules}))
    dist.destroy_process_group()


# the examples' step line with --print-time: the job's clock, the process's and the training thread's CPU time when
# it was printed
STEP_LINE = re.compile(r"^step (\d+) .* t (\d+\.\d+) cpu (\d+\.\d+) th (\d+\.\d+)$")
MODEL = ["--dim", "256", "--seq", "64", "--layers", "2", "--batch", "8"]
GPU_MODEL = ["--dim", "1024", "--layers", "4", "--seq", "512", "--batch", "8", "--vocab", "8192"]
# name -> (command, steps per run: a few seconds of steps on this machine, so the timers' cost is spread as in a job)
JOBS = {
    "ddp": (["examples/train_ddp.py", *MODEL], 40),
    "fsdp2": (["examples/train_fsdp.py", *MODEL], 40),
    "pipeline": (["examples/train_pipeline.py", *MODEL], 50),
    "lightning": (["examples/frameworks/train_lightning.py", "--dim", "1024", "--batch", "64", "--lr", "0.001"], 200),
    # the same framework job with a wider model: ~40 ms steps, the length of the issue's reference DDP job
    "lightning-wide": (["examples/frameworks/train_lightning.py", "--dim", "1536", "--batch", "64", "--lr", "0.001"],
                       100),
    "accelerate": (["examples/frameworks/train_accelerate.py", "--dim", "1024", "--batch", "64"], 200),
    # the DDP tutorial's shape (Linear(20, 1), batch 32): steps of a fraction of a millisecond, where sampling works
    "short": (["examples/train_tiny.py", "--print-every", "50"], 16000),
    # a step of 1-3 ms (one rank, a one-layer 32-wide transformer): where dtprof must cost at most 1 %
    "ms": (["examples/train_ddp.py", "--dim", "32", "--seq", "16", "--layers", "1", "--batch", "4"], 3000),
    # the DDP job with torch.compile (inductor on the CPU): the compiled forward must stay compiled
    "compiled": (["examples/train_ddp.py", *MODEL, "--compile"], 60),
    # one rank on a GPU (NCCL, CUDA-event spans, NVML): ~20-40 ms fp32 steps of a 4-layer, 1024-wide transformer on
    # an H100/H200; only where a GPU is visible (the examples pick CUDA when it is)
    "ddp-gpu": (["examples/train_ddp.py", *GPU_MODEL], 200),
    "fsdp2-gpu": (["examples/train_fsdp.py", *GPU_MODEL], 200),
}
DEFAULT_JOBS = "ddp,fsdp2,pipeline,lightning,short,ms,compiled"
# name -> (A/B block in steps, steps per A/B run): about 15-20 on/off pairs of blocks a run, ~30 s of steps here;
# a block's steps but its first AB_SKIP and its last are used, so at least 4 (the shortest blocks have 6)
AB = {"ddp": (8, 264), "fsdp2": (6, 180), "pipeline": (7, 224), "lightning": (10, 440), "lightning-wide": (10, 440),
      "accelerate": (10, 440), "ddp-gpu": (10, 440), "fsdp2-gpu": (10, 440), "short": (64, 3000), "ms": (64, 3000),
      "compiled": (8, 264)}
RANKS = 2                       # ranks per job (torchrun --nproc_per_node) but those in JOB_RANKS
# one rank: the issue's ~0.25 ms step (two ranks here take 1.2-2 ms a step, most of it their scheduling on 2 cores)
JOB_RANKS = {"ddp-gpu": 1, "fsdp2-gpu": 1, "short": 1, "ms": 1}


WARMUP_INTERVALS = 3


def ranks_of(name: str) -> int:
    return JOB_RANKS.get(name, RANKS)


def launcher_cpu_ns(launcher: int) -> int:
    """CPU nanoseconds used so far by `dtprof run`'s own processes: the launcher and its output relays (each read
    from the process's own CPU clock: all its threads, nanosecond resolution; Linux's CPUCLOCK_SCHED clock of
    another process)."""
    pids = [launcher]
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline") as f:
                    relay = "dtprof.relay" in f.read()
            except (OSError, IndexError, ValueError):
                continue
            if ppid == launcher and relay:
                pids.append(int(d))
    total = 0
    for pid in pids:
        try:
            total += time.clock_gettime_ns(((~pid) << 3) | 2)
        except OSError:                   # exited meanwhile
            pass
    return total


RUNNING: list[subprocess.Popen] = []   # the jobs run_job started (each in its own session)


def stop_running_job(signum, _frame) -> None:
    """SIGTERM (a ``timeout`` around the benchmark): the job in its own session would outlive this process and load
    the machine; stop it (`dtprof run` forwards the signal to its job), then exit."""
    for proc in RUNNING:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except OSError:
            pass
    sys.exit(128 + signum)


def job_command(name: str, steps: int, run_dir: Path | None, ab_block: int = 0) -> tuple[list[str], dict]:
    """(command, environment) of one run of job ``name`` (run_job's arguments): torchrun with the job's step lines
    timed (``--print-time``), under `dtprof run` when ``run_dir`` is set."""
    bindir = Path(sys.executable).parent
    cmd = [str(bindir / "torchrun"), f"--nproc_per_node={ranks_of(name)}", "--monitor-interval=0.2", *JOBS[name][0],
           "--steps", str(steps), "--print-time"]
    if run_dir is not None:
        cmd = [sys.executable, "-m", "dtprof.cli", "run", "--out", str(run_dir), "--no-report", "--quiet", "--", *cmd]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTPROF_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    if ab_block:
        env["DTPROF_AB_BLOCK_STEPS"] = str(ab_block)
    return cmd, env


def run_job(name: str, steps: int, run_dir: Path | None, ab_block: int = 0, core: int | None = None) -> dict:
    """One run of a job; ``run_dir`` set: under `dtprof run`. Its median step (s) and, profiled, the CPU seconds per
    step of `dtprof run`'s launcher and output relays over the timed steps, dtprof's thread CPU seconds per
    rank-step after step 0 and the collectives per rank-step. A run that hits torch's exit abort after its steps
    runs once more, as in the tests (tests/torch_abort.py). ``ab_block``: profiled with dtprof's hooks switched off
    and on every that many steps (A/B blocks, collectors/runtime.py); ``lines`` then holds rank 0's (step, job
    clock, process CPU time, training thread CPU time)."""
    cmd, env = job_command(name, steps, run_dir, ab_block)
    lines: list[tuple[int, float, float, float]] = []   # rank 0's step lines: (step, job clock, process, thread CPU)
    cpu: list[tuple[int, int]] = []

    def launch(attempt: int) -> subprocess.CompletedProcess:
        if attempt:
            print(f"{name}: torch's exit abort after the steps: running it once more", file=sys.stderr)
            if run_dir is not None:
                shutil.rmtree(run_dir)
        cpu.clear()
        lines.clear()
        # Its own session, as `dtprof run` gives the job one: Linux's autogroup scheduler shares the CPU per
        # session, so a bare job left in this session would compete with whatever else runs here and read slower
        # than it is. stderr to a file (a pipe nobody reads could fill and block the job): read only to recognise
        # torch's exit abort
        with tempfile.TemporaryFile("w+") as err:
            pin = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None   # noqa: E731
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                    start_new_session=True, preexec_fn=pin)
            RUNNING.append(proc)
            assert proc.stdout is not None
            for line in proc.stdout:
                m = STEP_LINE.match(line)
                if m:
                    # the job's own clock: `dtprof run` relays output in bursts
                    n = int(m.group(1))
                    lines.append((n, float(m.group(2)), float(m.group(3)), float(m.group(4))))
                    # the timed steps' first line and the last few (one of the last may not arrive: take the latest)
                    every = n - lines[-2][0] if len(lines) > 1 else 1    # a job may print every few steps
                    if run_dir is not None and (len(lines) == WARMUP_INTERVALS + 1 or n >= steps - 3 * every):
                        cpu.append((n, launcher_cpu_ns(proc.pid)))   # by step: a job may print every few steps
            proc.wait()
            err.seek(0)
            return subprocess.CompletedProcess(cmd, proc.returncode, "", err.read())

    done = once_more_on_exit_abort(launch)
    if done.returncode:
        sys.exit(f"{name}: {' '.join(cmd)} exited {done.returncode}; its stderr ends:\n{done.stderr[-3000:]}")
    # per step between consecutive lines (a job may print every few steps: its output, read line by line here and
    # relayed in bursts by `dtprof run`, would otherwise cost the bare run more than the profiled one)
    intervals = [(b[1] - a[1]) / max(1, b[0] - a[0]) for a, b in zip(lines, lines[1:])][WARMUP_INTERVALS:]
    # rank 0's process CPU (all its threads: dtprof's hooks, its flusher and heartbeat) per step, the same way
    cpu_steps = [(b[2] - a[2]) / max(1, b[0] - a[0]) for a, b in zip(lines, lines[1:])][WARMUP_INTERVALS:]
    out = {"step_s": statistics.median(intervals), "cpu_s": statistics.median(cpu_steps)}
    if ab_block:
        return {**out, "lines": list(lines)}
    if run_dir is not None:
        (i0, c0), (i1, c1) = cpu[0], cpu[-1]    # (step, launcher CPU ns)
        if i1 <= i0:
            sys.exit(f"{name}: only {len(lines)} step lines of {steps} arrived; no CPU interval to measure")
        out["launcher_cpu_s_per_step"] = (c1 - c0) / 1e9 / (i1 - i0)
        from dtprof.reader import open_run

        run = open_run(run_dir)
        meta = run.meta[run.meta["kind"].astype(str) == "dtprof_threads_cpu"]
        # from the end of step 0 to exit: the start-up (imports, process group) is not the steps' cost
        per_rank = [(sum(v["threads"].values()) - sum(v["at_step0_end"].values())) / (v["steps"] - 1)
                    for v in meta["value"]]
        out["threads_cpu_s_per_rank_step"] = statistics.mean(per_rank)
        n = max(1, len(run.steps))
        out["collectives_per_rank_step"] = len(run.collectives) / n
        out["batches_per_rank_step"] = int((run.spans["kind"].astype(str) == "data_wait").sum()) / n
        out["all_reduces_per_rank_step"] = int((run.collectives["op"].astype(str) == "all_reduce").sum()) / n
        # what the ranks' step sampling decided (collectors/runtime.py): a round far off is told apart by it
        out["sampling"] = [(v.get("period"), v.get("calibration")) for k, v in
                           zip(run.meta["kind"].astype(str), run.meta["value"]) if k == "sampling"]
    return out


def paired_round(name: str, steps: int, run_dir: Path, r: int) -> dict:
    """``--paired``: the bare and the profiled run of one round at the same time, each on a core of its own (all
    its processes: the profiled job's launcher, relays and dtprof's threads share its core, so all of dtprof's CPU
    counts against its steps), the cores swapped every round: both see the machine's load of the same moment."""
    from concurrent.futures import ThreadPoolExecutor

    cores = (0, 1) if r % 2 == 0 else (1, 0)
    with ThreadPoolExecutor(2) as pool:
        bare = pool.submit(run_job, name, steps, None, 0, cores[0])
        prof = pool.submit(run_job, name, steps, run_dir, 0, cores[1])
        return {"bare": bare.result(), "dtprof": prof.result()}


def median_interval(xs: list[float], want: float = 0.95) -> tuple[float, float, float, float]:
    """The median of ``xs`` and its distribution-free confidence interval from order statistics: the k-th
    smallest and k-th largest, the largest k whose coverage 1 - 2 P(Binomial(n, 1/2) < k) is at least ``want``
    (k = 1, the extremes, when n is too small for ``want``: n >= 6 rounds for 95 %). (median, low, high, coverage)."""
    from math import comb

    xs, n = sorted(xs), len(xs)
    cover = lambda k: 1 - 2 * sum(comb(n, i) for i in range(k)) / 2 ** n   # noqa: E731
    k = 1
    while k + 1 <= (n + 1) // 2 and cover(k + 1) >= want:
        k += 1
    return statistics.median(xs), xs[k - 1], xs[n - k], cover(k)


AB_SKIP = 2   # steps at the start of each A/B block not used: right after a switch steps run slower or faster
# and the block's last step is not used either: it holds the switch itself (in the optimizer's post-hook, before the
# job prints the step's line), which costs more switching on than off (~280 against ~80 us, hot): in the block means
# it made the off blocks look slower than they are


def ab_step_used(n0: int, n1: int, block: int) -> bool:
    """Step n1 (timed from step n0's line) counts in its A/B block: it follows n0 directly and is neither one of
    the block's first AB_SKIP steps nor its last (which holds the switch)."""
    return n1 == n0 + 1 and AB_SKIP <= n1 % block < block - 1


def ab_pairs(lines: list[tuple[int, float, float, float]], block: int,
             center=statistics.fmean) -> list[tuple[float, ...]]:
    """The A/B blocks of one run (collectors/runtime.py): rank 0's step n (0-based, as the job prints it) runs in
    block n // block, hooks on in even blocks and off in odd ones. A step's time and CPU are the differences from
    the previous step's line to its own (the job's clock, its process's CPU time: all its threads, dtprof's
    included, and its training thread's; step n-1's line comes after the switch that ends its block). Per block,
    the ``center`` of its steps but the first ``AB_SKIP`` and the last (the mean: what the job pays on average;
    the median: a shift robust to the bursts of this shared machine); per off block after the first pair (warm-up)
    with an on block on each side, that of its neighbours (their mean) less its own: drift in the machine's speed
    cancels to first order. Returns, per such off block, (its ``center`` step, then on - off per step of: step
    time, process CPU, training thread CPU), in seconds."""
    steps: dict[int, list[tuple[float, float, float]]] = {}
    for (n0, t0, c0, h0), (n1, t1, c1, h1) in zip(lines, lines[1:]):
        if ab_step_used(n0, n1, block):
            steps.setdefault(n1 // block, []).append((t1 - t0, c1 - c0, h1 - h0))
    c = {b: [center(col) for col in zip(*xs)] for b, xs in steps.items() if len(xs) >= 2}   # per block
    used = [b for b in sorted(c) if b % 2 == 1 and b >= 3 and b - 1 in c and b + 1 in c]
    return [(c[b][0], *((c[b - 1][i] + c[b + 1][i]) / 2 - c[b][i] for i in range(3))) for b in used]


def _t(want: float, nu: int) -> float:
    """Student's t quantile for a two-sided ``want`` interval with ``nu`` degrees of freedom (Cornish-Fisher
    expansion: no scipy here)."""
    z = statistics.NormalDist().inv_cdf(0.5 + want / 2)
    return z + (z ** 3 + z) / (4 * nu) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * nu ** 2)


def _spread(runs: list[list[float]], m: float) -> float:
    """Variance of the pooled values about ``m`` plus 2 x their lag-1 covariance within each run, when positive:
    neighbouring A/B differences share an on block, so they are correlated."""
    xs = [x for run in runs for x in run]
    lag1 = [(a - m) * (b - m) for run in runs for a, b in zip(run, run[1:])]
    return statistics.variance(xs, m) + 2 * max(0.0, sum(lag1) / max(1, len(lag1)))


def mean_interval(runs: list[list[float]], want: float = 0.95) -> tuple[float, float, float]:
    """The mean of the A/B differences of several runs (each run's in block order) and its ``want`` interval
    (Student's t, the variance from ``_spread``). (mean, low, high)."""
    xs = [x for run in runs for x in run]
    m = statistics.fmean(xs)
    half = _t(want, len(xs) - 1) * (_spread(runs, m) / len(xs)) ** 0.5
    return m, m - half, m + half


def ratio_interval(ratios: list[float], want: float = 0.95) -> tuple[float, float, float]:
    """The rounds pooled: the geometric mean of per-round ratios and its ``want`` interval (Student's t on their
    logarithms; rounds are independent runs). Narrower than the median's order statistics when the rounds are
    many, and as honest: a round's two runs share the machine's load of that moment. (mean, low, high)."""
    from math import exp, log

    logs = [log(r) for r in ratios]
    m = statistics.fmean(logs)
    if len(logs) < 2:
        return exp(m), float("nan"), float("nan")
    half = _t(want, len(logs) - 1) * statistics.stdev(logs) / len(logs) ** 0.5
    return exp(m), exp(m - half), exp(m + half)


TRIM = 0.1   # the fraction of A/B differences trimmed_interval cuts from each end


def trimmed_interval(runs: list[list[float]], want: float = 0.95) -> tuple[float, float, float]:
    """Yuen's trimmed mean of the A/B differences of several runs and its ``want`` interval: ``TRIM`` of them cut
    from each end, the variance that of the winsorised values (``_spread``) over (1 - 2 TRIM)^2. This machine's
    bursts (single blocks tens of ms off) fall in on or off blocks by chance and move the plain mean by more than
    dtprof's cost; they move this less. (trimmed mean, low, high)."""
    xs = sorted(x for run in runs for x in run)
    n = len(xs)
    g = int(TRIM * n)
    lo, hi = xs[g], xs[n - g - 1]
    m = statistics.fmean(xs[g:n - g])
    wins = [[min(max(x, lo), hi) for x in run] for run in runs]
    wm = statistics.fmean(x for run in wins for x in run)
    half = _t(want, n - 2 * g - 1) * (_spread(wins, wm) / n) ** 0.5 / (1 - 2 * g / n)
    return m, m - half, m + half


def hook_cost(blocks: int) -> dict:
    """Training-thread CPU seconds dtprof adds: per step (with one DDP bucket), per further all-reduce (it also
    passes dtprof's c10d::allreduce_ kernel) and per further other collective (a broadcast: the wrapper and the
    Work.wait patch alone), each the median over blocks of (on - off) of the same block; and the off step (the tiny
    model's own cost)."""
    data = in_process(["--hooks", "--blocks", str(blocks)], ranks=RANKS)
    per_rank = data["ranks"]
    added = {k: statistics.mean(statistics.median(a - b for a, b in zip(r[k]["on"], r[k]["off"])) for r in per_rank)
             for k in per_rank[0]}
    return {**added, "bare_step": statistics.mean(statistics.median(r["step"]["off"]) for r in per_rank),
            "modules": data["modules"]}


def priced(hooks: dict | None, n_coll: float, n_ar: float, n_batch: float, suffix: str) -> float:
    """A job's hook cost per rank-step from the per-step / per-collective figures and its own collective counts
    (module docstring); ``suffix`` "_other": what they cost the process's other threads."""
    if not hooks:
        return float("nan")
    return (hooks["step" + suffix] + hooks["all_reduce" + suffix] * max(n_ar - 1, 0)
            + hooks["collective" + suffix] * (n_coll - n_ar) + hooks["batch" + suffix] * n_batch)


def in_process(args: list[str], ranks: int = 0) -> dict:
    """Run this file's worker as `dtprof run` runs a rank (dtprof injected, recording into a throwaway run):
    one process, or ``ranks`` processes under torchrun. The worker's last stdout line, parsed."""
    import dtprof._inject
    from dtprof.rundir.writer import create_node_dir, create_run_dir

    cmd = [sys.executable, __file__, "--worker", *args]
    if ranks:
        cmd = [str(Path(sys.executable).parent / "torchrun"), f"--nproc_per_node={ranks}", "--standalone",
               "--monitor-interval=0.2", *cmd[1:]]
    def launch(attempt: int) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:   # a fresh throwaway run each time
            env = {k: v for k, v in os.environ.items() if not k.startswith(("DTPROF_", "RANK", "LOCAL_RANK"))}
            env["OMP_NUM_THREADS"] = "1"
            env["DTPROF_NODE_DIR"] = str(create_node_dir(create_run_dir(Path(tmp) / "run", {"benchmark": "overhead"})))
            env["DTPROF_CONFIG"] = json.dumps({"flush_interval_s": 1.0})
            env["PYTHONPATH"] = os.pathsep.join([str(Path(dtprof._inject.__file__).parent),
                                                 env.get("PYTHONPATH", "")])
            return subprocess.run(cmd, env=env, capture_output=True, text=True)

    out = once_more_on_exit_abort(launch)   # torch's exit abort: once more (tests/torch_abort.py)
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
    ap.add_argument("--rounds", type=int, default=8, help="bare/profiled pairs per job (6 or more: a 95 %% interval)")
    ap.add_argument("--steps", type=int, default=0, help="steps per run (default: the job's own, see JOBS)")
    ap.add_argument("--jobs", default=DEFAULT_JOBS, help=f"comma-separated, of {', '.join(JOBS)}")
    ap.add_argument("--quick", action="store_true", help="smoke check: 1 round of 12-step runs, short hook blocks")
    ap.add_argument("--in-process", action="store_true", help="also the single-process TinyLM comparison")
    ap.add_argument("--paired", action="store_true",
                    help="one-rank jobs: each round runs bare and profiled at the same time, each pinned to a core "
                         "of its own (the profiled job's launcher, relays and dtprof threads on its core too), the "
                         "cores swapped every round")
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--block-steps", type=int, default=8)
    ap.add_argument("--hook-blocks", type=int, default=300,
                    help="on/off block pairs of the hook measurement (0: none)")
    ap.add_argument("--ab-runs", type=int, default=3,
                    help="profiled runs per job with dtprof's hooks switched off and on in blocks (0: none)")
    ap.add_argument("--ab-seconds", type=float, default=0,
                    help="per job, no further A/B run starts after this many seconds of A/B runs (0: no limit): "
                         "as many runs as fit a lent machine's time")
    ap.add_argument("--keep-lines", type=Path, default=None,
                    help="write each A/B run's step lines (step, job clock, process CPU, thread CPU) as JSON here")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--hooks", action="store_true")
    a = ap.parse_args()
    if a.worker:
        return hooks_worker(a.blocks) if a.hooks else worker(a.blocks, a.block_steps)
    signal.signal(signal.SIGTERM, stop_running_job)
    if a.quick:
        a.rounds, a.steps, a.hook_blocks, a.ab_runs = 1, 12, 20, 1

    print(f"load average before: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} "
          f"({os.cpu_count()} cores)", file=sys.stderr)
    hooks = hook_cost(a.hook_blocks) if a.hook_blocks else None
    if hooks:
        print(f"training-thread hooks (CPU): +{hooks['step'] * 1e6:.1f} us per step with one DDP bucket, "
              f"+{hooks['all_reduce'] * 1e6:.1f} us per further all-reduce, +{hooks['collective'] * 1e6:.1f} us per "
              f"other collective (tiny DDP model, {hooks['modules']} modules, {hooks['bare_step'] * 1e6:.0f} us CPU "
              f"per bare step); in the process's other threads (completion callbacks): "
              f"+{hooks['step_other'] * 1e6:.1f} us per step, +{hooks['all_reduce_other'] * 1e6:.1f} us per further "
              f"all-reduce, +{hooks['collective_other'] * 1e6:.1f} us per other collective; "
              f"+{hooks['batch'] * 1e6:.1f} us per DataLoader batch", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.jobs.split(","):
            steps = a.steps or JOBS[name][1]
            walls, cpus, threads, launcher, colls = [], [], [], [], []
            sampled: list[dict] = []
            for r in range(a.rounds):
                res = {}
                if a.paired and ranks_of(name) == 1:
                    print(f"{name} round {r + 1}/{a.rounds}: bare and dtprof at once ...", file=sys.stderr)
                    res = paired_round(name, steps, Path(tmp) / f"{name}-{r}", r)
                # bare, profiled, profiled, bare, ...: each mode runs first as often as second
                for mode in () if res else (("bare", "dtprof") if r % 2 == 0 else ("dtprof", "bare")):
                    print(f"{name} round {r + 1}/{a.rounds}: {mode} ...", file=sys.stderr)
                    res[mode] = run_job(name, steps, Path(tmp) / f"{name}-{r}" if mode == "dtprof" else None)
                walls.append((res["bare"]["step_s"], res["dtprof"]["step_s"]))
                sampled.append(res["dtprof"])
                cpus.append((res["bare"]["cpu_s"], res["dtprof"]["cpu_s"]))
                threads.append(res["dtprof"]["threads_cpu_s_per_rank_step"])
                launcher.append(res["dtprof"]["launcher_cpu_s_per_step"] / ranks_of(name))
                colls.append((res["dtprof"]["collectives_per_rank_step"], res["dtprof"]["all_reduces_per_rank_step"],
                              res["dtprof"]["batches_per_rank_step"]))
            n_coll = statistics.median(c for c, _, _ in colls)
            n_ar = statistics.median(ar for _, ar, _ in colls)      # all-reduces, DDP's buckets included
            n_batch = statistics.median(nb for _, _, nb in colls)   # DataLoader batches (data_wait spans)
            rows.append((name, steps, statistics.median(b for b, _ in walls), statistics.median(p for _, p in walls),
                         median_interval([p / b for b, p in walls]), statistics.median(threads),
                         statistics.median(launcher),
                         n_coll, n_ar, priced(hooks, n_coll, n_ar, n_batch, ""),
                         priced(hooks, n_coll, n_ar, n_batch, "_other"), median_interval([p / b for b, p in cpus])))
            g, glo, ghi = ratio_interval([p / b for b, p in walls])
            print(f"{name}: rounds pooled: profiled / bare {g:.4f} [{glo:.4f}, {ghi:.4f}] (geometric mean, 95 % t "
                  f"interval over {len(walls)} rounds)", file=sys.stderr)
            if any(res.get("sampling") for res in sampled):
                print(f"{name}: each profiled run's sampling decisions (period, calibration steps): "
                      f"{'; '.join(str(res['sampling']) for res in sampled)}", file=sys.stderr)
            print(f"{name}: per-round profiled / bare ratios "
                  f"{', '.join(f'{p / b:.4f}' for b, p in walls)} (process CPU: "
                  f"{', '.join(f'{p / b:.4f}' for b, p in cpus)}); load average after: {os.getloadavg()[0]:.2f}",
                  file=sys.stderr)
            block, ab_steps = AB[name]
            if a.quick:
                block, ab_steps = 4, 32
            ab: list[list[tuple[float, ...]]] = []    # per A/B run, its off blocks (ab_pairs)
            ab_robust: list[list[float]] = []          # the same with the blocks' medians: step time on - off
            ab_start = time.monotonic()
            for r in range(a.ab_runs):
                if r and a.ab_seconds and time.monotonic() - ab_start > a.ab_seconds:
                    break                     # the time budget: no further run starts (at least one ran)
                print(f"{name} A/B run {r + 1}/{a.ab_runs} (blocks of {block} steps) ...", file=sys.stderr)
                lines = run_job(name, ab_steps, Path(tmp) / f"{name}-ab-{r}", ab_block=block)["lines"]
                if a.keep_lines:
                    a.keep_lines.mkdir(parents=True, exist_ok=True)
                    (a.keep_lines / f"{name}-ab-{r}.json").write_text(json.dumps({"block": block, "lines": lines}))
                ab.append(ab_pairs(lines, block))
                ab_robust.append([x[1] for x in ab_pairs(lines, block, statistics.median)])
                print(f"{name} A/B run {r + 1}: per off block, on - off step time / process CPU / training thread "
                      f"CPU (us): {', '.join('/'.join(f'{d * 1e6:.0f}' for d in x[1:]) for x in ab[-1])}",
                      file=sys.stderr)
            pairs = sum(len(run) for run in ab)
            rows[-1] += ((statistics.fmean(x[0] for run in ab for x in run),
                          *(mean_interval([[x[i] for x in run] for run in ab]) for i in (1, 2, 3)),
                          mean_interval(ab_robust), trimmed_interval([[x[1] for x in run] for run in ab]), pairs,
                          len(ab))
                         if pairs >= 2 else None,)
    print(f"{'job':14s} {'steps':>5s} {'bare step':>10s} {'dtprof step':>11s} {'wall ratio [CI]':>23s} "
          f"{'CPU/rank-step: threads':>22s} {'launcher':>9s} {'hooks':>8s} {'callbacks':>9s} {'(colls':>6s} "
          f"{'ar)':>4s} {'= % of step':>11s} {'rank 0 CPU ratio [CI]':>27s}")
    for name, steps, b, p, (r, rlo, rhi, _cover), th, la, nc, nar, hk, cb, (c, clo, chi, _), _ab in rows:
        print(f"{name:14s} {steps:5d} {b * 1e3:8.2f}ms {p * 1e3:9.2f}ms {r:7.4f} [{rlo:.4f}, {rhi:.4f}] "
              f"{th * 1e6:20.1f}us {la * 1e6:7.1f}us {hk * 1e6:6.1f}us {cb * 1e6:7.1f}us {nc:6.1f} {nar:4.1f} "
              f"{(th + la + hk + cb) / b * 100:10.2f}% {c:9.4f} [{clo:.4f}, {chi:.4f}]")
    if a.ab_runs:
        print(f"\n{'A/B job':14s} {'runs':>4s} {'blocks':>6s} {'off step':>9s} {'step time on - off [95 %]':>34s} "
              f"{'process CPU on - off':>26s} {'training thread':>26s} {'+ threads, launcher':>19s} "
              f"{'wall cost at most':>17s} {'step time, block medians':>34s} {'step time, trimmed':>34s}")
        us = lambda m: f"{m[0] * 1e6:+7.0f} [{m[1] * 1e6:+.0f}, {m[2] * 1e6:+.0f}]us"   # noqa: E731
        for name, *_, th, la, _nc, _nar, _hk, _cb, _cpu, ab in rows:
            if ab is None:
                continue
            off, wall, cpu, thread, robust, trimmed, pairs, runs = ab
            # what runs in both kinds of block (dtprof's threads, the launcher and relays) is not in the
            # difference: at most all of it, on every rank, on the step's critical path
            most = wall[2] + ranks_of(name) * (th + la)
            print(f"{name:14s} {runs:4d} {pairs:6d} {off * 1e3:7.2f}ms {us(wall):>25s} = {wall[0] / off * 100:+5.2f}% "
                  f"{us(cpu):>26s} {us(thread):>26s} {(th + la) * 1e6:17.1f}us {most / off * 100:16.2f}% "
                  f"{us(robust):>25s} = {robust[0] / off * 100:+5.2f}% {us(trimmed):>25s} = "
                  f"{trimmed[0] / off * 100:+5.2f}%")
    print(f"{a.rounds} " + ("paired rounds per one-rank job (bare and profiled at once, a core each, swapped every "
                            "round; interleaved for the others: " if a.paired else "interleaved rounds per job (")
          + f"bare, profiled, profiled, bare, ...); load average at the end "
          f"{os.getloadavg()[0]:.2f}. wall ratio: median over rounds of (profiled / bare median step) and its "
          f"{rows[0][4][3] * 100:.1f} % confidence interval (order statistics of the per-round ratios; 95 % from 6 "
          f"rounds on); rank 0 CPU ratio: the same for rank 0's process CPU per step (all its threads, dtprof's "
          f"hooks and threads included; the job's own --print-time clocks), which other work on the machine moves "
          f"far less than the wall time. dtprof's CPU per rank and step: its threads in the rank (flusher, "
          f"heartbeat; their CPU clocks from the end of step 0 to exit), `dtprof run`'s launcher and output relays "
          f"(process CPU clocks over the timed steps, shared by the {RANKS} ranks), the training-thread hooks "
          f"(in a two-rank job: per step + per further all-reduce + per other collective + per DataLoader batch) "
          f"and what they cost the process's other threads (callbacks: the completion callbacks that run in the "
          f"backend's threads, priced the same way): the CPU dtprof takes from the cores the ranks share; a rank "
          f"it delays holds the others at the next collective, so a step's wall "
          f"cost is bounded by about the ranks' sum, {RANKS}x this share.")
    if a.ab_runs:
        print(f"A/B: in profiled runs (runs: how many per job), dtprof's hooks switched off and on in blocks of steps "
              f"on every rank at once (AB, collectors/runtime.py: its step hooks, collective wrappers, Work.wait "
              f"patch and c10d::allreduce_ kernel); per off block (blocks: how many), the mean of the on blocks beside "
              f"it less its own, per step, of rank 0's step time (the job's own clock), process CPU (all its threads: "
              f"hooks, completion callbacks, the flusher's work on their rows) and training thread CPU; the mean over "
              f"blocks with its 95 % interval (Student's t; neighbouring blocks share an on block, counted as lag-1 "
              f"covariance): dtprof's cost in the job's own step time, in one run, free of the run-to-run spread of "
              f"the wall ratio. + threads, launcher: the CPU per rank-step that runs in both kinds of block (the "
              f"columns threads and launcher above). Wall cost at most: the step time interval's high end plus "
              f"{RANKS}x that (every rank's, as if all of it delayed the step), over the off step. Step time, block "
              f"medians: the same difference with each block's median step instead of its mean (a shift in the "
              f"step time that the machine's bursts move less). Step time, trimmed: the blocks' differences with "
              f"{TRIM * 100:.0f} % cut from each end (Yuen's trimmed mean; the same bursts, mostly in one kind of "
              f"block by chance, move the plain mean more than dtprof's cost).")
    if a.in_process:
        print_in_process(a.blocks, a.block_steps)


if __name__ == "__main__":
    main()
