"""Data-parallel training of the tiny LM with DistributedDataParallel (gloo on CPU, NCCL on GPU).

    torchrun --nproc_per_node=2 examples/train_ddp.py --steps 20
    python examples/train_ddp.py              # a single process (world size 1) works too
"""
import contextlib
import os
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import TinyLM, batches, fixed_step, lm_loss, parse_args, setup_distributed, step_line  # noqa: E402


def main():
    def extra(p):
        p.add_argument("--no-sync", action="store_true",
                       help="never all-reduce gradients (DDP no_sync): the job with its communication removed")
        p.add_argument("--sync-point", action="store_true",
                       help="with --no-sync: all-reduce one number after backward instead, so the ranks still meet "
                            "where the gradient all-reduce met them but (almost) nothing is transferred")
        p.add_argument("--sleep-ms", type=float, default=0.0,
                       help="every rank sleeps this long after each optimizer step (idle host time: the step "
                            "breakdown's 'other', which a faster machine does not shorten)")

    args = parse_args(__doc__, extra)
    rank, world, device = setup_distributed()
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.dim, args.layers, seq=args.seq).to(device)
    if rank == args.slow_rank:
        model.slow.seconds = args.slow_ms / 1000
        model.slow.in_backward = args.slow_in == "backward"
    if args.compile:
        model = torch.compile(model)   # DDP(torch.compile(model)): DDP's buckets stay eager around the graph
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    for step, (x, y) in enumerate(batches(rank, args, device)):
        fixed = fixed_step(args, step)
        if rank == args.slow_rank and args.fix_every:
            model.slow.seconds = 0.0 if fixed else args.slow_ms / 1000
        no_sync = args.no_sync and (fixed or not args.fix_every)
        with ddp.no_sync() if no_sync else contextlib.nullcontext():
            loss = lm_loss(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        if no_sync and args.sync_point:
            torch.distributed.all_reduce(torch.zeros(1, device=device))
        opt.step()
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)
        if rank == 0:
            print(step_line(step, loss.item(), args), flush=True)
    if args.compile:
        from compile_stats import print_dynamo_line

        print_dynamo_line(rank)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
