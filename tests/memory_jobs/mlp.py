"""A 2-rank job for the memory ledger (tests/jobs/test_memory.py): DDP, or FSDP2 with --fsdp, over four 512x512
linear layers, AdamW. Prints the model's parameter count (its truth: P) on rank 0. --keep-unsharded: the FSDP2
layers keep their parameters unsharded from forward to backward (reshard_after_forward=False).

--oom-rank R: at step --oom-step rank R meets a 16384x longer batch in forward (a 2 GiB tensor) with its address
space capped (RLIMIT_AS) 1.5 GiB above what it uses: a real CPU allocator failure mid-forward.
--hoard-rank R: rank R keeps --hoard-mib MiB made of each step's loss between backward and the optimizer
step, as a loop keeping outputs for logging does; it prints the bytes it keeps (their truth: HOARD).
--leak-rank R: rank R caps its address space (RLIMIT_AS) --leak-room-mib above what it uses, then keeps --leak-mib
more every step (steps of at least --step-s): its allocator fails some steps later (the live memory alert's case)."""
import argparse
import os
import resource
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--fsdp", action="store_true")
p.add_argument("--keep-unsharded", action="store_true")   # FSDP2 layers with reshard_after_forward=False
p.add_argument("--steps", type=int, default=6)
p.add_argument("--batch", type=int, default=512)
p.add_argument("--dim", type=int, default=512)
p.add_argument("--oom-rank", type=int, default=-1)
p.add_argument("--oom-step", type=int, default=2)
p.add_argument("--hoard-rank", type=int, default=-1)
p.add_argument("--hoard-mib", type=int, default=8)
p.add_argument("--leak-rank", type=int, default=-1)
p.add_argument("--leak-mib", type=int, default=32)
p.add_argument("--leak-room-mib", type=int, default=1024)
p.add_argument("--step-s", type=float, default=0.0)
args = p.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(4))
        self.step = 0

    def forward(self, x):
        if rank == args.oom_rank and self.step == args.oom_step:
            vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            resource.setrlimit(resource.RLIMIT_AS, (vm + 3 * 2**29, resource.getrlimit(resource.RLIMIT_AS)[1]))
            x = x.repeat(2**31 // x.nbytes, 1)      # 2 GiB
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


net = Net(args.dim)
P = sum(p.numel() for p in net.parameters())
if args.fsdp:
    from torch.distributed.fsdp import fully_shard
    for layer in net.layers:
        fully_shard(layer, reshard_after_forward=not args.keep_unsharded)
    model = fully_shard(net)
else:
    model = torch.nn.parallel.DistributedDataParallel(net)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
kept = []
if rank == args.leak_rank:
    vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm + args.leak_room_mib * 2**20, resource.getrlimit(resource.RLIMIT_AS)[1]))
for step in range(args.steps):
    t0 = time.monotonic()
    net.step = step
    x = torch.randn(args.batch, args.dim)
    loss = model(x).pow(2).mean()
    loss.backward()
    if rank == args.hoard_rank:
        kept.append(loss.detach().repeat(args.hoard_mib * 2**20 // loss.element_size()))
    if rank == args.leak_rank:
        kept.append(torch.ones(args.leak_mib * 2**20 // 4))
    opt.step()
    opt.zero_grad(set_to_none=True)
    time.sleep(max(0.0, args.step_s - (time.monotonic() - t0)))
if rank == 0:
    print("PARAMS", P, "TENSORS", len(list(net.parameters())), flush=True)
if kept:
    print("HOARD", sum(t.untyped_storage().nbytes() for t in kept), flush=True)
dist.destroy_process_group()
