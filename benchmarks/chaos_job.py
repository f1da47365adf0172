"""A small DDP training job for benchmarks/chaos.py, with one fault injected at one step (no dtprof in it).

    torchrun --nproc_per_node=3 benchmarks/chaos_job.py

Environment: CHAOS_FAULT (the fault's kind, below; "none" by default), CHAOS_RANK (the rank that injects it),
CHAOS_STEP (at the end of which step), CHAOS_STEPS (steps in all), CHAOS_OUT (a folder: rank 0 writes the final
weights' SHA-256 there as weights.sha256 when it finishes), CHAOS_PG_TIMEOUT (the process group's timeout, s),
CHAOS_MOUNT (the tmpfs the run directory is on, for the run-directory faults).

Faults the job injects itself, the same with and without dtprof: rank_kill, rank_stop (SIGSTOP, left frozen),
rank_raise, rank_exit (os._exit(3)), agent_kill (SIGKILL to its parent, torchrun's agent; in a two-agent job that
is a node lost), coll_timeout (the rank sleeps past the process group's timeout before a collective its peers
wait in), mismatch (a broadcast of another size on one rank; gloo lets it pass). Faults that need dtprof (a no-op
without it): dtprof_kill (SIGKILL to `dtprof run`, the agent's parent), dir_readonly / dir_full (the run
directory's file system remounted read-only / filled), hb_raise / hb_stall (dtprof's heartbeat thread raises at
every beat / blocks forever), flusher_raise / flusher_stall (dtprof's flusher thread raises / blocks forever).
"""
import datetime
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

FAULT = os.environ.get("CHAOS_FAULT", "none")
CULPRIT = int(os.environ.get("CHAOS_RANK", "1"))
AT = int(os.environ.get("CHAOS_STEP", "5"))
STEPS = int(os.environ.get("CHAOS_STEPS", "16"))
PG_TIMEOUT = float(os.environ.get("CHAOS_PG_TIMEOUT", "300"))


def dtprof_recorder():
    """dtprof's rank runtime in this process, when the job runs under `dtprof run` (else None)."""
    rt = sys.modules.get("dtprof.collectors.runtime")
    return getattr(rt, "STATE", None) if rt else None


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def inject(step: int) -> None:
    if FAULT == "rank_kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif FAULT == "rank_stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif FAULT == "rank_raise":
        raise RuntimeError(f"chaos: injected failure at step {step}")
    elif FAULT == "rank_exit":
        os._exit(3)
    elif FAULT == "agent_kill":
        os.kill(os.getppid(), signal.SIGKILL)
    elif FAULT == "coll_timeout":
        time.sleep(PG_TIMEOUT * 1.5)
    elif FAULT == "dtprof_kill" and os.environ.get("DTPROF_NODE_DIR"):
        launcher = parent_of(os.getppid())
        with open(f"/proc/{launcher}/cmdline", "rb") as f:
            if b"dtprof" in f.read():
                os.kill(launcher, signal.SIGKILL)
    elif FAULT in ("dir_readonly", "dir_full") and os.environ.get("CHAOS_MOUNT") and os.environ.get("DTPROF_NODE_DIR"):
        mount = os.environ["CHAOS_MOUNT"]
        if FAULT == "dir_readonly":
            subprocess.run(["mount", "-o", "remount,ro", mount], check=False)
        else:
            try:
                with open(os.path.join(mount, "filler"), "wb") as f:
                    while True:
                        f.write(b"0" * 65536)
                        f.flush()
            except OSError:
                pass
    elif FAULT.startswith(("hb_", "flusher_")) and dtprof_recorder() is not None:
        rec = dtprof_recorder()
        stall = threading.Event()   # never set

        def broken(*a, **k):
            if FAULT.endswith("_stall"):
                stall.wait()
            raise OSError("chaos: injected fault in dtprof's own thread")
        if FAULT.startswith("hb_") and getattr(rec, "heartbeat", None) is not None:
            rec.heartbeat.poll_requests = broken
        elif FAULT.startswith("flusher_"):
            own = rec.flush_once

            def flush_once():   # only the flusher thread breaks: the exit's own flush is what a stuck thread leaves
                if threading.current_thread().name == "dtprof-flusher":
                    broken()
                own()
            rec.flush_once = flush_once
    if FAULT.startswith(("hb_", "flusher_")):   # let the thread meet its fault before the job ends (with or without
        time.sleep(2.5)                          # dtprof alike: a pause changes no weight)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(STEPS):
        x = torch.randn(16, 32, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == AT and (rank == CULPRIT or (FAULT == "mismatch")):
            if FAULT == "mismatch":
                dist.broadcast(torch.ones(12 if rank == CULPRIT else 10), src=0 if CULPRIT else 1)
            else:
                inject(step)
        dist.all_reduce(loss.detach())   # a logging collective, as most jobs have
        time.sleep(0.05)
    if rank == 0 and os.environ.get("CHAOS_OUT"):
        h = hashlib.sha256()
        for k, v in sorted(model.module.state_dict().items()):
            h.update(k.encode() + v.numpy().tobytes())
        with open(os.path.join(os.environ["CHAOS_OUT"], "weights.sha256"), "w") as f:
            f.write(h.hexdigest())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
