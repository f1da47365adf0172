"""Fully sharded data-parallel training of the tiny LM with FSDP2 (`fully_shard`), gloo on CPU or NCCL on GPU;
`--fsdp1` wraps it with the older FullyShardedDataParallel instead (one unit per transformer block).

    torchrun --nproc_per_node=2 examples/train_fsdp.py --steps 20 [--fsdp1] [--clip 1.0] [--print-health]
"""
import os
import sys

import torch
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import TinyLM, batch_for, clipped, health_line, lm_loss, parse_args, poisoned, setup_distributed, step_line  # noqa: E402


def wrap_fsdp1(model, device):
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    block = type(model.blocks[0])
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({block}), device_id=device,
                                    use_orig_params=True)


def main():
    args = parse_args(__doc__, lambda p: p.add_argument("--fsdp1", action="store_true",
                                                        help="FullyShardedDataParallel (FSDP1) instead of FSDP2"))
    rank, world, device = setup_distributed()
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.dim, args.layers, seq=args.seq).to(device)
    if rank == args.slow_rank:
        model.slow.seconds = args.slow_ms / 1000
    if args.fsdp1:
        model = wrap_fsdp1(model, device)
    else:
        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        x, y = batch_for(step, rank, args, device)
        loss = poisoned(lm_loss(model(x), y), step, rank, args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.fsdp1 and args.clip:    # FSDP1's own clip: it all-reduces the shards' norms (torch's would not)
            norm = float(model.clip_grad_norm_(args.clip))
        else:
            norm = clipped(model.parameters(), args)
        opt.step()
        if args.print_health:
            print(health_line(rank, step, loss.item(), norm, opt.param_groups[0]["lr"]), flush=True)
        if rank == 0:
            print(step_line(step, loss.item(), args), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
