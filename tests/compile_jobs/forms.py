"""A small GPT-style model trained a few steps, compiled one of the ways users compile; prints Dynamo's counters
and, for a last step run under torch.profiler, which eager ops of the forward's fused parts ran (none when the
forward ran compiled). The job test_compiled.py runs bare and under `dtprof run`.

    python forms.py FORM STEPS [BACKEND]        # FORM: compile, fullgraph_autograd, method, blocks, clip (one process)
    torchrun --nproc_per_node=2 forms.py FORM STEPS [BACKEND]   # FORM: ddp_of_compiled, compiled_ddp, fsdp2

BACKEND: inductor (default) or aot_eager (Dynamo's graphs, breaks and recompiles are the same; no C++ to build).
"""
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from model import Block  # noqa: E402


class LM(nn.Module):
    def __init__(self, dim=64, layers=2, vocab=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, 4) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def build(form: str, m: nn.Module, backend: str) -> nn.Module:
    if form in ("compile", "clip"):
        return torch.compile(m, backend=backend)
    if form == "fullgraph_autograd":  # one graph or an error, and the backward compiled too (compiled autograd)
        torch._dynamo.config.compiled_autograd = True
        return torch.compile(m, backend=backend, fullgraph=True)
    if form == "method":
        m.compile(backend=backend)
        return m
    if form == "blocks":              # torchtitan's way: each block compiled
        for i, b in enumerate(m.blocks):
            m.blocks[i] = torch.compile(b, backend=backend)
        return m
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    if form == "ddp_of_compiled":
        return DDP(torch.compile(m, backend=backend))
    if form == "compiled_ddp":
        return torch.compile(DDP(m), backend=backend)
    if form == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for b in m.blocks:
            b.compile(backend=backend)
            fully_shard(b)
        fully_shard(m)
        return m
    raise SystemExit(f"unknown form {form}")


def main() -> None:
    form, steps = sys.argv[1], int(sys.argv[2])
    backend = sys.argv[3] if len(sys.argv) > 3 else "inductor"
    torch.manual_seed(0)
    m = LM()
    model = build(form, m, backend)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randint(0, 128, (4, 32))
    # "clip": the gradients clipped twice a step, inside a compiled function (Dynamo traces clip_grad_norm_) and
    # eagerly (the norm the job logs, printed by rank 0 as "NORM step value")
    clip_compiled = torch.compile(lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1e9), backend=backend)
    norms = []

    def step():
        out = model(x)
        loss = F.cross_entropy(out.view(-1, 128), x.view(-1))
        loss.backward()
        if form == "clip":
            clip_compiled(list(m.parameters()))
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9))
        opt.step()
        opt.zero_grad()
        return loss

    for _ in range(steps):
        step()
    from torch._dynamo.utils import counters
    from torch.profiler import profile

    stats = {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
             "recompiles": sum(counters["recompiles"].values()) if "recompiles" in counters else 0}
    with profile() as prof:
        step()
    names = {e.key for e in prof.key_averages()}
    # inductor fuses these into its own kernels: run as aten ops, the forward ran eager
    stats["eager_ops"] = sorted(n for n in names if n in ("aten::gelu", "aten::native_layer_norm"))
    stats["loss"] = round(float(step().detach()), 5)
    if os.environ.get("RANK", "0") == "0":   # one line: two ranks' lines can interleave on a shared pipe
        print("FORM " + json.dumps(stats), flush=True)
        for i, n in enumerate(norms):
            print(f"NORM {i} {float(n)!r}", flush=True)


if __name__ == "__main__":
    main()
