"""A plain gloo training script with no dtprof in it, for `dtprof run --hang-timeout` end-to-end tests.

    torchrun --nproc_per_node=4 plain_train.py MODE [--culprit 1] [--steps 8] [--bad-step 3]

MODE as in job.py: healthy | hang | raise | kill | mismatch | slow; abort_at_exit: the culprit trains to the end and
is killed by SIGABRT in its interpreter's teardown, after its atexit hooks (as torch's own teardown abort is);
stop: a DDP job whose culprit SIGSTOPs itself (a frozen process: a rank stuck in the kernel or on a dead device);
kill_agent: the culprit SIGKILLs its parent, torchrun's agent, and trains on.
"""
import argparse
import ctypes
import os
import signal
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("mode")
p.add_argument("--culprit", type=int, default=1)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--bad-step", type=int, default=3)
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
culprit = rank == args.culprit
model = torch.nn.Linear(64, 1)
ddp = args.mode == "stop"   # DDP's bucket all-reduce runs inside backward: no collective call of the script's own
if ddp:
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)


class DataIter:
    def __init__(self):
        self.step = 0

    def __next__(self):
        if args.mode == "hang" and culprit and self.step == args.bad_step:
            time.sleep(3600)  # a stuck data loader
        self.step += 1
        return torch.ones(8, 64)


data = DataIter()


class AbortInTeardown:
    # libstdc++'s std::terminate with no exception in flight: what a C++ thread in torch's teardown hits
    terminate = ctypes.CDLL("libstdc++.so.6")._ZSt9terminatev

    def __del__(self):   # runs when the interpreter clears __main__, after the atexit hooks
        self.terminate()


if args.mode == "abort_at_exit" and culprit:
    teardown_bomb = AbortInTeardown()
if args.mode == "raise_at_start" and culprit:   # before any step: its peers wait in step 0's first all-reduce
    raise RuntimeError("no such dataset")
for step in range(args.steps):
    x = next(data)
    loss = model(x).pow(2).mean()
    loss.backward()
    if args.mode == "slow" and culprit:
        time.sleep(0.06)
    time.sleep(0.02)
    if culprit and step == args.bad_step:
        if args.mode == "raise":
            raise RuntimeError(f"loss is NaN at step {step}")
        if args.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if args.mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if args.mode == "kill_agent":
            os.kill(os.getppid(), signal.SIGKILL)
    if args.mode == "mismatch" and step == args.bad_step:
        dist.broadcast(torch.ones(12 if culprit else 10), src=0)
    for prm in model.parameters() if not ddp else ():
        dist.all_reduce(prm.grad)
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
