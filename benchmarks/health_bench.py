"""Numerics health (collectors/numerics.py, analyzers/health.py): false alarms on long clean runs, and what the
sentinel costs a step.

    python benchmarks/health_bench.py alarms [--runs 2] [--steps 1500] [--only NAME-PART]
    python benchmarks/health_bench.py cost [--jobs short,lm,compiled] [--pairs 10] [--full-detail]

``alarms``: clean two-rank jobs recorded with `dtprof run --full-detail` (every step's loss read): the examples'
TinyLM with AdamW on synthetic tokens (examples/train_ddp.py: a noisy, slowly falling loss) and the small regression
of tests/numerics_jobs/health.py with its gradients clipped and a step schedule (loss, gradient norm and a changing
learning rate), and the same unclipped (the gradient norm dtprof computes). Nothing goes wrong in them, so every
health incident in their summary.json is a false alarm; reported per job: rank-steps tested, incidents, and the rate
per 10,000 rank-steps (with a 95 % upper bound when there are none: 3 / n, the rule of three).

``cost``: what the numerics part costs a step under dtprof, side by side in one process: the job runs as `dtprof
run` runs a rank (dtprof injected, recording; its step sampling as it decides), in blocks of whole sampling periods
with the numerics part in the recorder (its callbacks and its ``clip_grad_norm_`` wrapper), out, and in with its
callbacks timed in place (on, off, timed, timed, off, on, ...), everything else of dtprof in throughout. Per job
(``--jobs``): ``short``, the DDP tutorial's Linear(20, 1) (a fraction of a millisecond: sampled), ``lm``, the
examples' TinyLM (~10 ms), and ``compiled``, that TinyLM under torch.compile (inductor); each clips its gradients.
Reported: the sampling, the reads' and the fingerprint's intervals the run chose; the part's own CPU per step (its
callbacks timed in place in the timed blocks, the clock reads' own cost taken out: the direct cost, the least noisy
figure) and what those timers add to a step (timed - on: the harness's, not dtprof's), the training thread's CPU of
on - off blocks (untimed; median over pairs: the direct cost and what it does to the rest, e.g. caches) and the wall
ratio on / off (median over pairs), each beside the step's own time.
``--full-detail``: every step in full detail (no sampling), the part's cost on each step.

    python benchmarks/health_bench.py cost [--jobs short,lm,compiled] [--pairs 10] [--full-detail]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _record(out: Path, script: Path, args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "dtprof.cli", "run", "--out", str(out), "--no-report", "--no-nvml", "--full-detail",
           "--", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-2000:]}")
    return json.loads((out / "summary.json").read_text())


def alarms(runs: int, steps: int, only: str = "") -> None:
    jobs = {
        "train_ddp (TinyLM, AdamW)": (REPO / "examples" / "train_ddp.py",
                                      ["--steps", str(steps), "--dim", "64", "--seq", "32"]),
        "numerics_jobs/health.py clean (clipped, StepLR)": (REPO / "tests" / "numerics_jobs" / "health.py",
                                                            ["clean", str(steps), "0"]),
        "numerics_jobs/health.py noclip (dtprof's gradient norm, StepLR)": (
            REPO / "tests" / "numerics_jobs" / "health.py", ["noclip", str(steps), "0"]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, (script, args) in jobs.items():
            if only not in name:
                continue
            tested = incidents = 0
            kinds: dict[str, int] = {}
            for i in range(runs):
                h = _record(Path(tmp) / f"{script.stem}-{i}", script, args)["health"]
                tested += sum(e["loss"] is not None for e in h["per_step"])
                for inc in h["incidents"]:
                    incidents += 1
                    kinds[inc["kind"]] = kinds.get(inc["kind"], 0) + 1
            rate = incidents / tested * 1e4 if tested else float("nan")
            bound = f" (95 % upper bound {3 / tested * 1e4:.2f})" if not incidents and tested else ""
            print(f"{name}: {runs} run(s) x {steps} steps x 2 ranks, {tested} rank-steps with a loss tested, "
                  f"{incidents} incident(s) {kinds or ''}: {rate:.2f} per 10,000 rank-steps{bound}", flush=True)


JOBS = ("short", "lm", "compiled")


def _job(name: str):
    """(one training step, the model's parameter count) of a bench job: ``short``, the DDP tutorial's Linear(20, 1)
    with SGD (a fraction of a millisecond); ``lm``, the examples' TinyLM (dim 64, 2 layers) with AdamW (~10 ms
    here); ``compiled``, the same TinyLM under torch.compile (inductor). Each clips its gradients
    (``clip_grad_norm_``: the norm the sentinel reads) and calls backward on its loss."""
    import torch

    sys.path.insert(0, str(REPO / "examples"))
    from model import TinyLM

    torch.manual_seed(0)
    if name == "short":
        model = torch.nn.Linear(20, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, y = torch.rand(32, 20), torch.rand(32, 1)
        loss_of = lambda: torch.nn.functional.mse_loss(model(x), y)       # noqa: E731
    else:
        model = TinyLM(128, 64, 2, seq=32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fwd = torch.compile(model) if name == "compiled" else model
        x = torch.randint(0, 128, (8, 32))
        loss_of = lambda: torch.nn.functional.cross_entropy(fwd(x).view(-1, 128), x.view(-1))   # noqa: E731

    def step() -> None:
        loss = loss_of()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # looked up each call, as a job does
        opt.step()
        opt.zero_grad()
    return step, sum(p.numel() for p in model.parameters())


def cost_worker(name: str, pairs: int, full_detail: bool) -> None:
    """In a process that dtprof records (``_in_dtprof``): the job's steps in blocks with the numerics part in and
    out of the recorder (its callbacks and its clip wrapper), everything else of dtprof in throughout, its sampling
    as dtprof decides it; per block the training thread's CPU and the wall time per step. Prints one JSON line."""
    import torch

    from dtprof.collectors import runtime

    torch.set_num_threads(1)
    step, nparams = _job(name)
    for _ in range(8):
        step()                    # dtprof starts recording at the first forward; compiles happen here
    assert runtime.STATE.active, "dtprof did not start in the benchmark process"
    parts = runtime.STATE.parts
    part = next(p for p in parts.parts if p.name == "numerics")
    wrapped = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in part.patched]
    own = [0, 0]    # the part's own CPU: its callbacks and what its clip wrapper adds (``local``), timed in place;
    #                 the calls timed (each pays the two clock reads, CLOCK_NS, taken out)

    def timed(f):
        def g(*args):
            t = time.thread_time_ns()
            try:
                return f(*args)
            finally:
                own[0] += time.thread_time_ns() - t
                own[1] += 1
        return g

    t = time.thread_time_ns()
    for _ in range(10000):
        timed(int)()
    clock_ns = (time.thread_time_ns() - t) / 10000

    callbacks = {cb: getattr(part, cb) for cb in ("on_backward", "on_optimizer_pre_step", "on_optimizer_step",
                                                  "on_step_end", "local")}

    def switch(kind: str) -> None:
        """``on``: the part in; ``timed``: in, its callbacks timed in place; ``off``: out."""
        if (part in parts.parts) != (kind != "off"):
            (parts.parts.remove if kind == "off" else parts.parts.append)(part)
        for cb, f in callbacks.items():
            setattr(part, cb, timed(f) if kind == "timed" else f)
        for mod, attr, w in wrapped:
            setattr(mod, attr, w.__wrapped__ if kind == "off" else w)
        parts.rebind()

    t0 = time.perf_counter()
    while runtime.STATE.clock.sampler.sample_period is None or time.perf_counter() - t0 < 1.0:
        step()                    # through the sampling's calibration (steps 32..63), and a second of steps
    period = runtime.STATE.clock.sampler.sample_period
    # blocks of whole sampling periods, aligned with them: on and off blocks hold as many detailed steps
    block = max(period, 16)
    while block * (time.perf_counter() - t0) / max(1, runtime.STATE.clock.step) < 0.2:
        block *= 2                # a block of at least 0.2 s
    while runtime.STATE.clock.step % block:
        step()
    res: dict = {"on": [], "off": [], "timed": []}
    # on, off, timed, timed, off, on, ...: each kind in each position as often. The on - off pairs are of untimed
    # blocks (the in-place timers cost the training thread two clock reads per call: a syscall on some VMs)
    for b in range(3 * pairs):
        kind = ("on", "off", "timed", "timed", "off", "on")[b % 6]
        switch(kind)
        c0, w0, o0, n0 = time.thread_time_ns(), time.perf_counter_ns(), own[0], own[1]
        for _ in range(block):
            step()
        res[kind].append(((time.thread_time_ns() - c0) / block, (time.perf_counter_ns() - w0) / block,
                          (own[0] - o0 - clock_ns * (own[1] - n0)) / block))
    switch("on")
    assert not runtime.STATE.disabled and part in parts.parts, "dtprof or its numerics part switched off"
    print(json.dumps({"res": res, "block": block, "period": period, "params": nparams,
                      "fp_interval": part.fp_interval, "read_every": part.read_every}))


def _in_dtprof(args: list[str], full_detail: bool) -> dict:
    """This file's worker run as `dtprof run` runs a rank (dtprof injected, recording into a throwaway run); its
    last stdout line, parsed."""
    from injected import rank_env

    with tempfile.TemporaryDirectory() as tmp:
        env = rank_env(tmp, "health", full_detail)
        p = subprocess.run([sys.executable, __file__, "cost-worker", *args], env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def cost(jobs: list[str], pairs: int, full_detail: bool) -> None:
    """Per job: what the numerics part adds to a step under dtprof, on - off in the same process (module
    docstring)."""
    for name in jobs:
        d = _in_dtprof([name, str(pairs)] + (["--full-detail"] if full_detail else []), full_detail)
        on, off = d["res"]["on"], d["res"]["off"]
        # pairs of neighbouring blocks (on, off, off, on, ...): each on block with the off block beside it
        cpu = [a[0] - b[0] for a, b in zip(on, off)]
        wall = [a[1] / b[1] for a, b in zip(on, off)]
        base_cpu, base_wall = statistics.median(b[0] for b in off), statistics.median(b[1] for b in off)
        extra = statistics.median(cpu)
        own = statistics.fmean(a[2] for a in d["res"]["timed"])
        timers = statistics.median(t[0] - a[0] for t, a in zip(d["res"]["timed"], on))
        sampling = "every step in full detail" if not d["period"] else \
            f"detail sampled: 4 steps every {d['period']}"
        print(f"{name} ({d['params']} parameters; {sampling}; reads at multiples of {d['read_every']}, fingerprints "
              f"at multiples of {d['fp_interval']} (detailed steps)): "
              f"bare-of-numerics step {base_wall / 1e3:.1f} us wall, {base_cpu / 1e3:.1f} us training-thread CPU; "
              f"the part's own CPU (its callbacks, timed in place in separate blocks) {own / 1e3:.2f} us per step "
              f"({own / base_cpu:.2%}; the in-place timers themselves add {timers / 1e3:+.2f} us); "
              f"the numerics part adds {extra / 1e3:+.2f} us CPU per step ({extra / base_cpu:+.2%}; CPU of on - off "
              f"over {len(cpu)} block pairs of {d['block']} steps, median), wall ratio on / off "
              f"{statistics.median(wall):.4f} (median; range {min(wall):.4f}-{max(wall):.4f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["alarms", "cost", "cost-worker"])
    ap.add_argument("job", nargs="?", help="cost-worker: the job")
    ap.add_argument("pairs", nargs="?", type=int, default=10, help="cost-worker: on/off block pairs")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--only", default="", help="alarms: only the jobs whose name contains this")
    ap.add_argument("--jobs", default=",".join(JOBS), help=f"cost: comma-separated, of {', '.join(JOBS)}")
    ap.add_argument("--pairs", type=int, default=10, help="cost: on/off block pairs per job")
    ap.add_argument("--full-detail", action="store_true", help="cost: every step in full detail (no sampling)")
    a = ap.parse_args()
    if a.what == "alarms":
        alarms(a.runs, a.steps or 1500, a.only)
    elif a.what == "cost-worker":
        cost_worker(a.job, a.pairs, a.full_detail)
    else:
        cost(a.jobs.split(","), a.pairs, a.full_detail)


if __name__ == "__main__":
    main()
