"""What a kernel launch costs the host before and after a torch.profiler trace, with and without CUPTI's teardown
(collectors/trace_capture.py): the cost dtprof's kernel sample would leave on a GPU job for the rest of its run.

    python benchmarks/cupti_linger.py          # on a GPU machine; prints one line per mode

Each mode runs in a fresh process: ``attached`` (TEARDOWN_CUPTI unset: Kineto leaves CUPTI attached) and
``teardown`` (TEARDOWN_CUPTI=1 when the profiler stops, as dtprof's capture does). In each, the median host time
of a launch (a one-element add; 20 rounds of 2000 launches, a synchronize after each round) before the trace and
after it.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

ROUNDS, LAUNCHES = 20, 2000


def launch_us() -> float:
    import torch

    x = torch.zeros(1, device="cuda")
    per = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for _ in range(LAUNCHES):
            x.add_(1)
        per.append((time.perf_counter_ns() - t0) / LAUNCHES / 1e3)
        torch.cuda.synchronize()
    return statistics.median(per)


def child(mode: str) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    launch_us()                          # warm: CUDA's context, the kernel's first launch
    before = launch_us()
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.start()
    x = torch.zeros(1, device="cuda")
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    if mode == "teardown":
        os.environ["TEARDOWN_CUPTI"] = "1"
    prof.stop()
    os.environ.pop("TEARDOWN_CUPTI", None)
    after = launch_us()
    print(f"{mode:9s} launch before the trace {before:.2f} us, after it {after:.2f} us ({after - before:+.2f} us)",
          flush=True)


def main() -> None:
    if len(sys.argv) > 1:
        child(sys.argv[1])
        return
    env = {k: v for k, v in os.environ.items() if k != "TEARDOWN_CUPTI"}
    for mode in ("attached", "teardown"):
        subprocess.run([sys.executable, __file__, mode], env=env, check=False, timeout=120)


if __name__ == "__main__":
    main()
