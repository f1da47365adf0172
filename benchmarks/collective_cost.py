"""dtprof's cost per collective call, hot: what its wrappers add to a synchronous all-gather and to an async
all-reduce with its wait, measured side by side in one process.

One process under `dtprof run` (gloo, a world of one, one intra-op thread) calls ``dist.all_gather_single``
(``all_gather_into_tensor`` before torch 2.13, as FSDP2 does) and ``dist.all_reduce(async_op=True).wait()`` in
blocks of 500, with dtprof's path hooks switched in and out between blocks (``switch_path_hooks``, as the A/B
blocks of benchmarks/overhead.py do); it prints the median per-call time of each kind of block and their
difference. A call in a real job costs more than this hot figure
(docs/validation.md), and the bare calls' own time depends on the machine's load (gloo's thread hand-off): this is
for comparing two versions of the collective path, alternated on one machine under the same load.

    .venv/bin/python benchmarks/collective_cost.py [--blocks 40]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CALLS = 500


def worker(blocks: int) -> None:
    import torch
    import torch.distributed as dist

    from dtprof.collectors import runtime

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):                      # step 0 starts the recording
        model(torch.zeros(1, 8)).sum().backward()
        opt.step()
    assert runtime.STATE.active, "dtprof did not start in the benchmark process"
    inp, out, x = torch.zeros(64), torch.zeros(64), torch.zeros(64)

    def per_call(call, n: int) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(n):
            call()
        return (time.perf_counter_ns() - t0) / n / 1000

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # the older name: torch < 2.13
    kinds = {"synchronous all-gather": lambda: gather(out, inp),
             "async all_reduce + wait": lambda: dist.all_reduce(x, async_op=True).wait()}
    times: dict[str, dict[bool, list[float]]] = {k: {True: [], False: []} for k in kinds}
    for b in range(blocks):
        on = b % 2 == 0
        runtime.STATE.switch_path_hooks(on)
        for name, call in kinds.items():
            per_call(call, 50)                  # the first calls after a switch are not measured
            times[name][on].append(per_call(call, CALLS))
    runtime.STATE.switch_path_hooks(True)
    for name, t in times.items():
        on, off = statistics.median(t[True]), statistics.median(t[False])
        print(f"{name:36s} bare {off:7.2f} us  under dtprof {on:7.2f} us  dtprof adds {on - off:6.2f} us per call",
              flush=True)
    assert not runtime.STATE.disabled, "dtprof disabled itself during the benchmark"
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=40, help="blocks of calls, alternately with and without dtprof")
    ap.add_argument("--worker", action="store_true")
    a = ap.parse_args()
    if a.worker:
        worker(a.blocks)
        return
    with socket.socket() as s:                  # a free port for the one-rank group's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "dtprof.cli", "run", "--out", str(Path(tmp) / "run"), "--no-report", "--quiet",
               "--", sys.executable, __file__, "--worker", "--blocks", str(a.blocks)]
        sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
