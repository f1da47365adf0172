"""Hybrid-parallel training of the tiny LM on 4 ranks, on a 2-D DeviceMesh (gloo on CPU, NCCL on GPU).

    torchrun --nproc_per_node=4 examples/train_hybrid.py --mode tp_dp --steps 5
    torchrun --nproc_per_node=4 examples/train_hybrid.py --mode dp_pp --steps 5 --microbatches 4

--mode tp_dp   mesh (dp=2, tp=2): tensor parallel inside each dp group with ``parallelize_module``
               (ColwiseParallel on attention's qkv and the MLP's first Linear, RowwiseParallel on attention's proj
               and the MLP's second Linear); data parallel across it.
--mode dp_pp   mesh (dp=2, pp=2): a 2-stage GPipe pipeline (torch.distributed.pipelining) inside each pp group;
               data parallel across it.
Data parallelism is an explicit all-reduce of the flattened gradients over the mesh's ``dp`` group after each
backward (one ``torch.distributed.all_reduce`` per step, averaged), which keeps the example short and works the
same with DTensor parameters and pipeline stages on gloo and NCCL.

Tensor parallel and the fused qkv Linear: ColwiseParallel shards qkv's output rows in contiguous blocks, so the
rows are reordered before sharding ([q|k|v] -> [q0 k0 v0 | q1 k1 v1], one block of heads per TP rank) and each
Block runs on its local heads (``heads // tp``). The model's function is unchanged.
"""
import os
import sys
import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import SlowDown, TinyLM, batch_for, lm_loss, parse_args, setup_distributed  # noqa: E402


def tp_block_forward(self, x):
    """Block.forward on this TP rank's heads: qkv and mlp[0] outputs are local shards (ColwiseParallel),
    proj and mlp[2] all-reduce their outputs (RowwiseParallel)."""
    b, t, d = x.shape
    hd = d // self.heads
    local_heads = self.heads // self.tp
    q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, local_heads, hd).permute(2, 0, 3, 1, 4)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + self.proj(a.transpose(1, 2).reshape(b, t, local_heads * hd))
    return x + self.mlp(self.ln2(x))


def head_blocked_qkv(block, tp: int) -> None:
    """Reorder qkv's output rows from [q|k|v] to one [q_i|k_i|v_i] block per TP rank (heads split evenly)."""
    d = block.qkv.in_features
    per = d // tp
    idx = torch.cat([torch.arange(part * d + r * per, part * d + (r + 1) * per)
                     for r in range(tp) for part in range(3)])
    with torch.no_grad():
        block.qkv.weight.copy_(block.qkv.weight[idx])
        block.qkv.bias.copy_(block.qkv.bias[idx])


def build_tp(args, mesh, device):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh["tp"].size()
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.dim, args.layers, seq=args.seq).to(device)
    plan = {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
    for blk in model.blocks:
        if blk.heads % tp:
            raise SystemExit(f"heads ({blk.heads}) must be divisible by tp ({tp})")
        head_blocked_qkv(blk, tp)
        parallelize_module(blk, mesh["tp"], plan)
        blk.tp = tp
        blk.forward = types.MethodType(tp_block_forward, blk)
    return model


class StageModule(nn.Module):
    """The slice of TinyLM one pipeline stage runs: embedding first, head last, blocks split evenly."""

    def __init__(self, full: TinyLM, stage: int, stages: int, slow_s: float):
        super().__init__()
        n = len(full.blocks)
        lo, hi = stage * n // stages, (stage + 1) * n // stages
        self.first, self.last = stage == 0, stage == stages - 1
        self.slow = SlowDown(slow_s)
        self.embed, self.pos = (full.embed, full.pos) if self.first else (None, None)
        self.blocks = nn.ModuleList(full.blocks[lo:hi])
        self.ln, self.head = (full.ln, full.head) if self.last else (None, None)

    def forward(self, x):
        x = self.slow(x)
        if self.first:
            x = self.embed(x) + self.pos[:, : x.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x)) if self.last else x


def allreduce_grads(params, group, dp: int) -> None:
    """Data parallelism: one all-reduce of all (local) gradients over the dp group, averaged."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat, group=group)
    flat /= dp
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def main():
    def extra(p):
        p.add_argument("--mode", choices=["tp_dp", "dp_pp"], default="tp_dp")
        p.add_argument("--microbatches", type=int, default=4, help="dp_pp: microbatches per step")

    args = parse_args(__doc__, extra)
    rank, world, device = setup_distributed()
    if world != 4:
        raise SystemExit("train_hybrid.py runs on 4 ranks (a 2 x 2 mesh)")
    second = "tp" if args.mode == "tp_dp" else "pp"
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", second))
    dp_group, dp = mesh["dp"].get_group(), mesh["dp"].size()
    dp_rank = mesh["dp"].get_local_rank()
    slow_s = args.slow_ms / 1000 if rank == args.slow_rank else 0.0

    if args.mode == "tp_dp":
        model = build_tp(args, mesh, device)
        model.slow.seconds = slow_s
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=args.lr)
        for step in range(args.steps):
            x, y = batch_for(step, dp_rank, args, device)   # the TP ranks of one dp replica share its data
            loss = lm_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            allreduce_grads(params, dp_group, dp)
            opt.step()
            if rank == 0:
                print(f"step {step} loss {loss.item():.6f}", flush=True)
    else:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        pp_rank, pp = mesh["pp"].get_local_rank(), mesh["pp"].size()
        args.layers = max(args.layers, pp)
        torch.manual_seed(args.seed)
        full = TinyLM(args.vocab, args.dim, args.layers, seq=args.seq)
        module = StageModule(full, pp_rank, pp, slow_s / args.microbatches).to(device)  # X ms per step in total
        stage = PipelineStage(module, pp_rank, pp, device, group=mesh["pp"].get_group())
        schedule = ScheduleGPipe(stage, n_microbatches=args.microbatches, loss_fn=lm_loss)
        params = list(module.parameters())
        opt = torch.optim.AdamW(params, lr=args.lr)
        for step in range(args.steps):
            x, y = batch_for(step, dp_rank, args, device)
            opt.zero_grad(set_to_none=True)
            losses = []
            if module.first:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
            allreduce_grads(params, dp_group, dp)
            opt.step()
            if module.last and dp_rank == 0:
                print(f"step {step} loss {torch.stack(losses).mean().item():.6f}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
