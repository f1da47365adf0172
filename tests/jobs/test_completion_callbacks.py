"""Completion callbacks of async collectives run in the backend's own threads (gloo's workers here, NCCL's watchdog
on a GPU). A thread the backend made has no Python thread state; without dtprof keeping one, the binding makes and
frees a new one for every callback (~20 µs each, measured in docs/validation.md). Real gloo, a world of one, in a
fresh interpreter (the thread states are process-wide)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from conftest import free_port

JOB = textwrap.dedent("""
    import json, os, sys, threading
    import torch, torch.distributed as dist
    import dtprof
    from dtprof.collectors.runtime import STATE
    from dtprof.reader import open_run

    dist.init_process_group("gloo")
    assert dtprof.init(sys.argv[1])
    hc = STATE.collective_hooks.rows    # the recorder's tables: the completion callbacks call hc.complete
    seen = []                      # per callback: its thread, and how many callbacks that thread state has run
    complete = hc.complete

    def counting_complete(key, t, entry=None):
        if entry is not None:      # a completion callback (a wait passes no entry)
            hc.tls.calls = getattr(hc.tls, "calls", 0) + 1
            seen.append((threading.get_ident(), hc.tls.calls))
        complete(key, t, entry)

    hc.complete = counting_complete
    main = threading.get_ident()
    # a work already complete when its callback is added runs the callback inline, on this thread, and how often
    # that happens depends on the machine's load: all-reduce until 50 callbacks ran in a backend thread (bounded)
    t = torch.ones(1 << 14)
    n = 0
    while n < 200 or (sum(th != main for th, _ in seen) < 50 and n < 5000):
        dist.all_reduce(t, async_op=True).wait()
        n += 1
    del hc.complete                # the method again
    STATE.flush_once()
    rows = open_run(sys.argv[1]).table("collectives")
    print(json.dumps({"seen": seen, "main": main, "calls": n, "rows": len(rows),
                      "ended": int(rows["end_ns"].notna().sum())}))
    dist.destroy_process_group()
""")


def test_completion_callbacks_reuse_their_backend_threads_python_state(tmp_path):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", JOB, str(tmp_path / "run")], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rows"] == got["calls"] and got["ended"] == got["calls"]    # every all-reduce recorded, with its end
    in_backend = [(thread, n) for thread, n in got["seen"] if thread != got["main"]]
    assert len(in_backend) >= 50, got["seen"]
    per_thread: dict[int, list[int]] = {}
    for thread, n in in_backend:
        per_thread.setdefault(thread, []).append(n)
    # each backend thread ran its callbacks in one thread state: the count it keeps goes 1, 2, 3, ... (a new thread
    # state per callback would read 1 every time)
    for thread, counts in per_thread.items():
        assert counts == list(range(1, len(counts) + 1)), (thread, counts)
    assert max(len(c) for c in per_thread.values()) >= 25
