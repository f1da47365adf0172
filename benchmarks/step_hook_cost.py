"""dtprof's CPU cost on a short step's training thread, part by part, in µs (a figure a busy machine moves little).

The short-step job of benchmarks/overhead.py (the DDP tutorial's DDP(Linear(20, 1)), batch 32, SGD, one rank under
`dtprof run` and torchrun) is sampled: most of its steps are boundary-only, whose whole cost on the training
thread is dtprof's optimizer post-hook (the step's row, the sampling decision, the parts that run on every step),
and a block of 4 detailed steps comes every few hundred or thousand steps. Each is priced by the training thread's
own CPU clock (``time.thread_time_ns``: the time other processes take is not in it), in alternating blocks inside
one process, so the machine's drift hits both sides alike; the median over pairs of blocks:

- ``boundary``: blocks of ``opt.step()`` calls alone with dtprof's optimizer hooks in vs out (the rest of a step
  is the same either way, and only adds noise): what a boundary-only step costs;
- ``boundary, hot``: the post-hook called in a tight loop (its code and data in the caches: a floor);
- ``detailed block``: blocks of BLOCK full steps, 4 of them in full detail (the switch of the detail on and off
  included) vs BLOCK boundary-only steps: what one detailed block adds, to be divided by the sampling period;
- dtprof's threads (flusher, heartbeat): their CPU clocks over the boundary blocks, per step.

    .venv/bin/python benchmarks/step_hook_cost.py [--pairs 10] [--calls 4000] [--detail-pairs 200]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BLOCK = 12     # full steps per detailed-block measurement (4 detailed, the rest boundary-only): short blocks, many
# pairs (a full step's noise on a busy machine is tens of µs)


def worker(pairs: int, calls: int, detail_pairs: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    from dtprof.collectors import runtime
    from dtprof.collectors.stepclock import own_threads_cpu_s

    rec = runtime.STATE
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.rand(32 * 64, 20), torch.rand(32 * 64, 1))
    loader = DataLoader(data, batch_size=32, shuffle=True)
    model = DDP(torch.nn.Linear(20, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def batches():
        while True:
            yield from loader

    it = batches()

    def steps(n: int) -> None:
        for _ in range(n):
            x, y = next(it)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()

    steps(200)          # past the sampling's calibration
    assert rec.active and not rec.disabled, "dtprof is not recording in the benchmark process"
    sampler = rec.sampler
    decided = sampler.sample_period
    sampler.sample_period = 1 << 40      # no detailed block but the ones measured below
    rec.set_detail(False)
    steps(20)
    med = statistics.median
    out: dict = {"sampling_period": decided}

    # the post-hook hot: called in a tight loop
    hook = rec.post_hook
    hot = []
    for _ in range(7):
        t0 = time.thread_time_ns()
        for _ in range(calls):
            hook(opt, (), {})
        hot.append((time.thread_time_ns() - t0) / calls)
    out["boundary_hot_ns"] = med(hot)

    # boundary steps: opt.step() with the optimizer hooks in vs out
    diff, other, bare = [], [], []
    for p in range(pairs):
        got = {}
        for mode in ("in", "out") if p % 2 else ("out", "in"):
            if mode == "out":
                rec.remove_optimizer_hooks()
            for _ in range(20):
                opt.step()
            th0, own0 = time.thread_time_ns(), sum(own_threads_cpu_s().values())
            for _ in range(calls):
                opt.step()
            got[mode] = (time.thread_time_ns() - th0) / calls
            if mode == "in":
                other.append((sum(own_threads_cpu_s().values()) - own0) * 1e9 / calls)
            if mode == "out":
                rec.install_optimizer_hooks()
        diff.append(got["in"] - got["out"])
        bare.append(got["out"])
    out["boundary_ns"], out["opt_step_out_ns"] = med(diff), med(bare)
    out["threads_ns_per_step"] = med(other)

    # one detailed block (4 steps, the switches included) vs as many boundary-only steps
    det = []
    for p in range(detail_pairs):
        got = {}
        for mode in ("det", "bnd") if p % 2 else ("bnd", "det"):
            steps(4)
            t0 = time.thread_time_ns()
            if mode == "det":
                rec.set_detail(True)
                steps(4)
                rec.set_detail(False)
                steps(BLOCK - 4)
            else:
                steps(BLOCK)
            got[mode] = time.thread_time_ns() - t0
        det.append(got["det"] - got["bnd"])
    out["detailed_block_ns"] = med(det)
    assert not rec.disabled, "dtprof disabled itself during the benchmark"
    print(json.dumps(out))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=10, help="pairs of blocks per measurement")
    ap.add_argument("--calls", type=int, default=4000, help="optimizer steps per boundary block")
    ap.add_argument("--detail-pairs", type=int, default=200, help="pairs of blocks for the detailed block")
    ap.add_argument("--worker", action="store_true")
    a = ap.parse_args()
    if a.worker:
        return worker(a.pairs, a.calls, a.detail_pairs)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DTPROF_")}
        env["OMP_NUM_THREADS"] = "1"
        torchrun = str(Path(sys.executable).parent / "torchrun")
        cmd = [sys.executable, "-m", "dtprof.cli", "run", "--out", str(Path(tmp) / "run"), "--no-report",
               "--quiet", "--", torchrun, "--nproc_per_node=1", __file__, "--worker", "--pairs", str(a.pairs),
               "--calls", str(a.calls), "--detail-pairs", str(a.detail_pairs)]
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the job exited {done.returncode}; its stderr ends:\n{done.stderr[-3000:]}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"load average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores); training "
          f"thread CPU per step, median over {a.pairs} pairs of blocks ({a.detail_pairs} for the detailed block):\n"
          f"  boundary-only step (dtprof's optimizer post-hook, in - out): {r['boundary_ns'] / 1e3:+.2f} us "
          f"(hot, in a tight loop: {r['boundary_hot_ns'] / 1e3:.2f} us; opt.step() without it "
          f"{r['opt_step_out_ns'] / 1e3:.1f} us)\n"
          f"  one detailed block (4 steps in full detail, the switches included) over 4 boundary-only steps: "
          f"{r['detailed_block_ns'] / 1e3:+.1f} us; the job's sampling chose a block every "
          f"{r['sampling_period']} steps: {r['detailed_block_ns'] / 1e3 / (r['sampling_period'] or 1):+.2f} us a step\n"
          f"  dtprof's threads (flusher, heartbeat) during the boundary blocks: {r['threads_ns_per_step'] / 1e3:.2f} "
          f"us a step")


if __name__ == "__main__":
    main()
