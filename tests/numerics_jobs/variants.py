"""Trains one tiny MLP several ways in one torchrun job and prints, on rank 0, a SHA-256 of each variant's final
weights: plain DDP, DDP with gradient_as_bucket_view, with static_graph, with no_sync gradient accumulation, with a
comm hook registered by the user after the first step, and FSDP2. tests/jobs/test_bit_identical.py runs it with and
without dtprof and compares the digests: dtprof must not change a single bit of training."""
import hashlib

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 6
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 40), torch.nn.Tanh(),
                               torch.nn.Linear(40, 8))


def batch(step, micro=0):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(5, 24, generator=g), torch.randn(5, 8, generator=g)


def loss_of(m, step, micro=0):
    x, y = batch(step, micro)
    return (m(x) - y).pow(2).mean()


def digest(params):
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train_ddp(variant):
    kw = {"bucket_cap_mb": 0.002}   # ~2 KB buckets: several per backward
    if variant == "gradient_as_bucket_view":
        kw["gradient_as_bucket_view"] = True
    if variant == "static_graph":
        kw["static_graph"] = True
    net = model()
    m = DDP(net, **kw)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        if variant == "no_sync":
            with m.no_sync():
                loss_of(m, step, 1).backward()
        loss_of(m, step).backward()
        opt.step()
        if variant == "late_user_hook" and step == 0:
            m.register_comm_hook(None, default_hooks.allreduce_hook)   # legal after the first forward
    return digest(net.parameters())


def train_fsdp2():
    net = model()
    for layer in (net[0], net[2], net[4]):
        fully_shard(layer)
    fully_shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(net, step).backward()
        opt.step()
    return digest(p.full_tensor() for p in net.parameters())


results = {v: train_ddp(v) for v in ("plain", "gradient_as_bucket_view", "static_graph", "no_sync", "late_user_hook")}
results["fsdp2"] = train_fsdp2()
if rank == 0:
    print("param_bytes", sum(p.numel() * p.element_size() for p in model().parameters()))
    for v, d in results.items():
        print("digest", v, d, flush=True)
# every rank leaves together: a rank that tore its gloo pairs down while a peer still used them aborted once
# ("terminate called without an active exception") in a CI run of the bare job
dist.barrier()
dist.destroy_process_group()
