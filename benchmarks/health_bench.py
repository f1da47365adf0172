"""Numerics health (collectors/numerics.py, analyzers/health.py): false alarms on long clean runs, and what the
sentinel costs a step.

    python benchmarks/health_bench.py alarms [--runs 2] [--steps 1500]
    python benchmarks/health_bench.py cost [--steps 400]

``alarms``: clean two-rank jobs recorded with `dtprof run --full-detail` (every step's loss read): the examples'
TinyLM with AdamW on synthetic tokens (examples/train_ddp.py: a noisy, slowly falling loss) and the small
regression of tests/numerics_jobs/health.py with its gradients clipped and a step schedule (loss, gradient norm
and a changing learning rate). Nothing goes wrong in them, so every health incident in their summary.json is a
false alarm; reported per job: rank-steps tested, incidents, and the rate per 10,000 rank-steps (with a 95 %
upper bound when there are none: 3 / n, the rule of three).

``cost``: the sentinel's callbacks on a real training step of TinyLM in one process: the training thread's CPU
time per step (``time.thread_time``) with the part's callbacks called as the recorder calls them (``on_backward``
with the loss, the ``clip_grad_norm_`` wrapper, ``on_optimizer_step``, ``on_step_end``) and without, in
alternating blocks, the median over blocks of (with - without); beside it the step's own CPU time, so the cost
reads in benchmarks/overhead.py's terms (dtprof's CPU per rank-step, and its share of the step).
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


def alarms(runs: int, steps: int) -> None:
    jobs = {
        "train_ddp (TinyLM, AdamW)": (REPO / "examples" / "train_ddp.py",
                                      ["--steps", str(steps), "--dim", "64", "--seq", "32"]),
        "numerics_jobs/health.py clean (clipped, StepLR)": (REPO / "tests" / "numerics_jobs" / "health.py",
                                                            ["clean", str(steps), "0"]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, (script, args) in jobs.items():
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


def cost(steps: int) -> None:
    import torch

    sys.path.insert(0, str(REPO / "examples"))
    from model import TinyLM

    from dtprof.collectors.numerics import NumericsSentinel
    from dtprof.collectors.parts import RankContext

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyLM(128, 64, 2, seq=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 128, (8, 32))
    rows: list = []
    meta: list = []
    ctx = RankContext(0, "bench", tempfile.gettempdir(), {}, rows.append, lambda w: None, lambda lv, m: None,
                      lambda k, v: meta.append(v))
    part = NumericsSentinel()
    part.install(ctx)          # wraps clip_grad_norm_ (taken out again by on_exit)
    clip = torch.nn.utils.clip_grad_norm_

    def step(i: int, on: bool) -> None:
        loss = torch.nn.functional.cross_entropy(model(x).view(-1, 128), x.view(-1))
        if on:
            part.on_backward(loss)
        loss.backward()
        (clip if on else clip.__wrapped__)(model.parameters(), 1.0)
        opt.step()
        if on:
            ctx.step = i
            part.on_optimizer_step(opt)
            part.on_step_end(i, time.monotonic_ns(), True)
            ctx.step = i + 1
        opt.zero_grad()

    block, with_, without = 20, [], []
    i = 0
    for b in range(steps // block):
        on = b % 2 == 0
        t0 = time.thread_time_ns()
        for _ in range(block):
            step(i, on)
            i += 1
        (with_ if on else without).append((time.thread_time_ns() - t0) / block)
    part.on_exit()
    diffs = [a - b for a, b in zip(with_, without)]
    base = statistics.median(without)
    extra = statistics.median(diffs)
    print(f"TinyLM step (dim 64, 2 layers, {sum(p.numel() for p in model.parameters())} parameters) on this CPU: "
          f"{base / 1e3:.0f} us of the training thread's CPU without the sentinel; the sentinel adds "
          f"{extra / 1e3:.1f} us per step ({extra / base:.2%}), median over {len(diffs)} block pairs "
          f"of {block} steps; {len(rows)} health rows written; the fingerprint's price: {meta}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["alarms", "cost"])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None)
    a = ap.parse_args()
    if a.what == "alarms":
        alarms(a.runs, a.steps or 1500)
    else:
        cost(a.steps or 400)


if __name__ == "__main__":
    main()
