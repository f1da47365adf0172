"""What dtprof's ``c10d::allreduce_`` kernel costs the thread that issues a DDP bucket, hot and cold.

DDP's Reducer all-reduces each gradient bucket through the dispatcher op ``c10d::allreduce_``, where dtprof's Python
kernel (collectors/hooks_ddp.py, ``DdpHooks.observe_dispatched_allreduce``) sees it. In a loop of calls the kernel
adds ~10-20 us a call; in a training step it adds several times that, because a bucket is issued in
the middle of the backward, whose compute has evicted from the caches everything the kernel's path touches: the
dispatcher's boxing of the arguments into Python objects (three TorchScript objects -- process group, ReduceOp, the
returned Work -- each converted through an import of ``torch.jit._state``), the Python frames, the Python-side
redispatch (the arguments parsed back, the result converted again). This benchmark shows both: one process (gloo, a
world of one, one intra-op thread) calls ``ProcessGroup.allreduce`` (the same dispatcher op DDP calls) under the
recorder as inside a backward, with no kernel, a pass-through Python kernel (the mechanism alone) and dtprof's
kernel, each hot (back to back) and cold (a 32 MB copy between calls, as a backward's compute does), and prints the
training thread's CPU per call (min-max over rounds).

Measured on the 2-core development VM (torch 2.13, CPU): hot 11 / 18-24 / 22-36 us, cold 39-46 / 74-134 /
93-109 us (none / pass-through / dtprof's kernel): the mechanism, not the kernel's own Python, is most of it.

    .venv/bin/python benchmarks/c10d_kernel_cost.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=300)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from dtprof.collectors import runtime

    torch.set_num_threads(1)
    runtime.init(tempfile.mkdtemp(), rank=0, full_detail=True)
    dist.init_process_group("gloo")
    import torch.nn.parallel  # noqa: F401  (importing DDP installs dtprof's kernel)

    hooks = runtime.STATE.collective_hooks.ddp    # the DDP part: its kernel
    flags, rows = hooks.flags, hooks.rows
    pg = dist.distributed_c10d._get_default_group()
    t = torch.zeros(1000)
    op = torch.ops.c10d.allreduce_.default
    below = torch._C._after_autograd_keyset
    big_a, big_b = torch.randn(8 << 20), torch.empty(8 << 20)

    def pass_through(keyset, tensors, process_group, *args):
        return op.redispatch(keyset & below, tensors, process_group, *args)

    def run(n: int, cold: bool) -> float:
        total = 0
        for _ in range(n):
            if cold:
                big_b.copy_(big_a)
            flags.in_backward, flags.ddp_next_bucket = True, 0      # as DDP's buckets are issued
            t0 = time.thread_time_ns()
            work = pg.allreduce([t])
            total += time.thread_time_ns() - t0
            flags.in_backward = False
            work.wait()
            if rows.pending:
                rows.complete_ddp(time.monotonic_ns())
        return total / n / 1e3

    hooks.library._destroy()      # each case below puts its own kernel in
    hooks.library = None
    res: dict = {}
    for _ in range(a.rounds):
        for name in ("none", "pass-through", "dtprof"):
            lib = None
            if name == "dtprof":
                hooks.observe_dispatched_allreduce()
                lib, hooks.library = hooks.library, None
            elif name == "pass-through":
                lib = torch.library.Library("c10d", "IMPL")
                lib.impl("allreduce_", pass_through, "AutogradCPU", with_keyset=True)
            for cold in (False, True):
                run(50, cold)
                res.setdefault((name, cold), []).append(run(a.calls, cold))
            if lib is not None:
                lib._destroy()
    for (name, cold), v in res.items():
        print(f"{name:13s} {'cold' if cold else 'hot ':5s} training-thread CPU per call {min(v):6.1f}-{max(v):6.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
