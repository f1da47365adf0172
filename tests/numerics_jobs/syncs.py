"""A DDP job with a torch.amp.GradScaler (its scale and skip flag read by dtprof) and its gradients unscaled and
clipped on even steps (on odd steps dtprof computes the norm of the gradients the scaler unscaled), recorded by
tests/jobs/test_numerics.py to show that dtprof reads no device value on the host: before training, the Tensor
methods that read a tensor's values on the host (``item``, ``tolist``, ``__float__``, ``__int__``, ``__bool__``,
``numpy``, ``cpu``, ``to``) and ``copy_`` are wrapped to note each call made from dtprof's rank-side code
(collectors/), wherever it runs; at the end each rank prints "SYNCS rank {json}": per call, the method, whether
its tensor lies in the numerics part's host ring (the buffers its non-blocking copies land in) and, for copy_,
``non_blocking`` and whether it copies into the ring. On a GPU each read outside the ring would be a host-device
sync (torch.cuda.set_sync_debug_mode would name it there; this check needs no GPU: it is the same calls, counted
by their caller).

    torchrun --nproc_per_node=2 syncs.py STEPS
"""
import json
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import dtprof.collectors

RANK_SIDE = os.path.dirname(os.path.abspath(dtprof.collectors.__file__)) + os.sep
calls: list = []


def noted(name, orig):
    def wrapper(self, *args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if caller.startswith(RANK_SIDE):
            calls.append((name, self, args, kwargs, threading.current_thread() is threading.main_thread()))
        return orig(self, *args, **kwargs)
    return wrapper


for name in ("item", "tolist", "__float__", "__int__", "__bool__", "numpy", "cpu", "to", "copy_"):
    setattr(torch.Tensor, name, noted(name, getattr(torch.Tensor, name)))

steps = int(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
for step in range(steps):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 16, generator=g)
    loss = (model(x) - x[:, :1]).pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    if step % 2 == 0:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
dist.barrier()
from dtprof.collectors import runtime  # noqa: E402

part = next(p for p in runtime.STATE.parts.parts if p.name == "numerics")
ring = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in (part.buf_f, part.buf_i)]


def in_ring(t) -> bool:
    return isinstance(t, torch.Tensor) and any(lo <= t.data_ptr() < hi for lo, hi in ring)


notes = [{"method": name, "in_ring": in_ring(t), "training_thread": main,
          **({"into_ring": in_ring(t), "from_ring": in_ring(args[0]) if args else None,
              "non_blocking": bool(kwargs.get("non_blocking", args[1] if len(args) > 1 else False))}
             if name == "copy_" else {})}
         for name, t, args, kwargs, main in calls]
print(f"SYNCS {rank} {json.dumps({'steps': steps, 'calls': notes})}", flush=True)
dist.destroy_process_group()
