"""A small gloo training loop for the triage tests, with a stand-in for the rank runtime's STATE.

The real runtime (dtprof.collectors.runtime) is not needed: this script keeps a STATE object with the contract's
attributes (rank, step, collective, last_progress_ns, rank_dir), writes steps/spans/collectives rows with
RankWriter as the runtime would, and starts the heartbeat itself.

    python -m torch.distributed.run --nproc_per_node=4 job.py MODE [--culprit R] [--steps N]

MODE: healthy | hang (the culprit gets stuck in its data iterator and never enters the next all_reduce) |
raise (the culprit raises) | kill (the culprit SIGKILLs itself) | mismatch (the culprit broadcasts a different
size at one sequence; gloo lets it pass) | slow (the culprit computes 3x longer). With --fr-dir, every rank writes
its Flight Recorder dump there at the end (pickle for even ranks, JSON for odd ranks).
"""
import argparse
import os
import signal
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

from dtprof.collectors import heartbeat
from dtprof.rundir.writer import RankWriter

p = argparse.ArgumentParser()
p.add_argument("mode")
p.add_argument("--culprit", type=int, default=1)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--bad-step", type=int, default=3)
p.add_argument("--fr-dir")
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
node_dir = Path(os.environ["DTPROF_NODE_DIR"])
writer = RankWriter(node_dir, rank)
writer.write_identity({"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "world_size": world,
                       "node_rank": 0, "host": os.uname().nodename, "pid": os.getpid(), "node": node_dir.name,
                       "device_type": "cpu", "device_index": int(os.environ["LOCAL_RANK"]), "device_name": "cpu",
                       "device_uuid": "", "device_mem_total_bytes": None, "backend": "gloo"})
writer.append("groups", [rank, "0", ",".join(map(str, range(world))), world, "gloo", "default_pg", ""])
if args.fr_dir:  # the pickle dump imports torch._dynamo (seconds): pay for it before the heartbeat starts
    torch._C._distributed_c10d._dump_fr_trace()
STATE = types.SimpleNamespace(rank=rank, step=0, collective=None, last_progress_ns=time.monotonic_ns(),
                              rank_dir=writer.dir)
heartbeat.start(writer.dir, STATE)
seq = {"0": 0}
culprit = rank == args.culprit


def collective(fn, op, tensor, **kw):
    """Run one blocking collective with the STATE bookkeeping the runtime does."""
    seq["0"] += 1
    nbytes = tensor.numel() * tensor.element_size()
    t0 = time.monotonic_ns()
    STATE.collective = {"op": op, "group": "0", "seq": seq["0"], "in_bytes": nbytes, "dtype": str(tensor.dtype),
                        "peer": None, "entered_ns": t0}
    fn(tensor, **kw)
    t1 = time.monotonic_ns()
    STATE.collective = None
    STATE.last_progress_ns = t1
    writer.append("collectives", [rank, STATE.step, op, fn.__name__, "user", "0", world, seq["0"], nbytes, nbytes,
                                  str(tensor.dtype).replace("torch.", ""), None, False, t0, t1, t1, None, None,
                                  None, None])


class DataIter:
    def __next__(self):
        if args.mode == "hang" and culprit and STATE.step == args.bad_step:
            time.sleep(3600)  # a stuck data loader: the culprit never reaches the next collective
        return torch.ones(64)


data = DataIter()
w = torch.ones(64)
for step in range(args.steps):
    STATE.step = step
    t0 = time.monotonic_ns()
    x = next(data)
    t1 = time.monotonic_ns()
    time.sleep(0.02 * (3 if args.mode == "slow" and culprit else 1))  # the "forward/backward"
    y = (x * w).sum()
    t2 = time.monotonic_ns()
    if culprit and step == args.bad_step:
        if args.mode == "raise":
            raise RuntimeError("loss is NaN at step %d" % step)
        if args.mode == "kill":
            writer.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    if args.mode == "mismatch" and step == args.bad_step:
        collective(dist.broadcast, "broadcast", torch.ones(12 if culprit else 10), src=0)
    collective(dist.all_reduce, "all_reduce", torch.ones(64) * y)
    t3 = time.monotonic_ns()
    writer.append("spans", [rank, step, "data_wait", "data_wait", t0, t1, None, None, "main", "hook", None])
    writer.append("spans", [rank, step, "forward", "forward", t1, t2, None, None, "main", "hook", None])
    writer.append("spans", [rank, step, "comm_wait", "all_reduce", t2, t3, None, None, "main", "hook", None])
    writer.append("steps", [rank, step, t0, t3, None, None, None, None, None])
    STATE.last_progress_ns = t3
    writer.flush()

if args.fr_dir:
    c10d = torch._C._distributed_c10d
    d = Path(args.fr_dir)
    d.mkdir(parents=True, exist_ok=True)
    if rank % 2 == 0:
        (d / f"fr_trace_rank_{rank}").write_bytes(c10d._dump_fr_trace())
    else:
        (d / f"fr_trace_rank_{rank}.json").write_bytes(c10d._dump_fr_trace_json())
writer.close()
dist.destroy_process_group()
