"""pytorch/examples' DDP tutorial shape (distributed/ddp-tutorial-series/multigpu_torchrun.py): Linear(20, 1), batch
32, SGD, a DataLoader over a synthetic dataset, epochs over it until --steps; steps of a fraction of a millisecond
on a CPU. The short-step job of benchmarks/overhead.py and of the sampling tests. Where a GPU is visible it runs
there as the tutorial does (NCCL, the model on the rank's GPU, each batch copied to it from pinned memory): steps of
about 1.3 ms on an H100.

    torchrun --nproc_per_node=2 examples/train_tiny.py --steps 2000
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=640)
    p.add_argument("--batches", type=int, default=64, help="batches per epoch")
    p.add_argument("--print-time", action="store_true",
                   help="rank 0 prints 'step N loss L t CLOCK cpu PROCESS_CPU th THREAD_CPU' per step")
    p.add_argument("--print-every", type=int, default=1, help="with --print-time: every this many steps")
    args = p.parse_args()
    distributed = "RANK" in os.environ
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.rand(32 * args.batches, 20), torch.rand(32 * args.batches, 1))
    sampler = DistributedSampler(data) if distributed else None
    loader = DataLoader(data, batch_size=32, sampler=sampler, shuffle=sampler is None, pin_memory=cuda)
    model = torch.nn.Linear(20, 1).to(device)
    if distributed:
        model = DDP(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rank0 = not distributed or dist.get_rank() == 0
    step, epoch = 0, 0
    while step < args.steps:
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if args.print_time and rank0 and step % args.print_every == 0:
                print(f"step {step} loss {loss.item():.6f} t {time.monotonic():.6f} cpu {time.process_time():.6f} "
                      f"th {time.thread_time():.6f}", flush=True)
            step += 1
            if step == args.steps:
                break
        epoch += 1
    w = (model.module if distributed else model).weight
    if rank0:
        print(f"final weight sum {float(w.sum()):.6f}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
