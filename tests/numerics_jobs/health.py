"""A small DDP regression trained STEPS steps with its gradients clipped, and one numerics incident at step K on
purpose; each rank prints what it computed per step, "HEALTH rank step loss grad_norm lr" (the truth that
tests/jobs/test_numerics.py checks dtprof's health table and summary against).

    torchrun --nproc_per_node=N health.py MODE STEPS K
MODE: clean (no incident), nan (a NaN in rank 1's batch at step K), lr (the learning rate 3000x for step K's
update only; clipped as torchtitan does, torch.nn.utils.get_total_norm then clip_grads_with_norm_), flip (rank N-1
flips the sign bit of one weight before step K's forward: its replica differs),
noclip (no incident and no clipping: the printed grad_norm is the job's own, the 2-norm of every gradient in
float64 after DDP's all-reduce; and nanoGPT's gradient accumulation: two micro-batches a step, each one's loss
divided by 2 before its backward, the first under no_sync; the printed loss is the micro-batches' mean, undivided,
in float64: what such a job logs),
fp16 (mixed precision as on a GPU: float16 autocast on the CPU and a torch.amp.GradScaler, the gradients unscaled
and clipped; an inf in rank 1's targets at step K (its loss is inf): the scaler skips that optimizer step on both
ranks and halves its scale; each rank also prints "SCALER rank step scale skipped", the scale it multiplied the
loss by, read with get_scale(), and whether its scale fell at the update: the skip).
"""
import contextlib
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

mode, steps, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)    # an lr that changes as schedules do
accum = 2 if mode == "noclip" else 1
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if mode == "fp16" else None


def batch(i):
    # 10 ms waited as for a data loader: on its own the toy step is ~2 ms, and on a shared 2-core machine a rank's
    # compute can run 0.3 ms slower than its peer's for most steps without waiting for a CPU (a CI run's clean job
    # was named a straggler so); this job is about numerics, the straggler rule's own tests slow a rank on purpose
    time.sleep(0.01)
    g = torch.Generator().manual_seed(1000 * rank + i)
    x = torch.randn(8, 16, generator=g)
    return x, x[:, :1] * 0.5 + 0.1 * torch.randn(8, 1, generator=g)


for step in range(steps):
    x, y = batch(accum * step)
    if mode == "nan" and step == k and rank == 1:
        x[0, 0] = float("nan")
    if mode == "fp16" and step == k and rank == 1:
        y[0, 0] = float("inf")
    if mode == "flip" and step == k and rank == world - 1:
        with torch.no_grad():
            net[0].weight.detach().view(torch.int32)[0, 0] ^= torch.tensor(-2**31, dtype=torch.int32)   # the sign bit
    if mode == "lr" and step == k:
        opt.param_groups[0]["lr"] *= 3000
    opt.zero_grad()
    losses = []
    for micro in range(accum):
        if micro:
            x, y = batch(accum * step + micro)
        sync = model.no_sync() if micro < accum - 1 else contextlib.nullcontext()
        with sync:
            if scaler is not None:
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                loss = (out.float() - y).pow(2).mean()
                scaler.scale(loss).backward()
                losses.append(loss.item())
                continue
            loss = (model(x) - y).pow(2).mean()
            (loss / accum if accum > 1 else loss).backward()
        losses.append(loss.item())
    if mode == "noclip":
        norm = torch.cat([p.grad.double().flatten() for p in model.parameters()]).norm()
    elif mode == "lr":      # torchtitan's form of the clip: the total norm computed, then the clip given it
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, norm)
    elif scaler is not None:
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if scaler is not None:
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        print(f"SCALER {rank} {step} {scale!r} {int(scaler.get_scale() < scale)}", flush=True)
    else:
        opt.step()
    lr = opt.param_groups[0]["lr"]
    if mode == "lr" and step == k:
        opt.param_groups[0]["lr"] /= 3000
    sched.step()
    print(f"HEALTH {rank} {step} {sum(losses) / accum!r} {norm.item()!r} {lr!r}", flush=True)
dist.barrier()
dist.destroy_process_group()
