"""Pipeline-parallel training of the tiny LM with torch.distributed.pipelining: one stage per rank (2 or more),
the blocks split evenly, GPipe or 1F1B schedule.

    torchrun --nproc_per_node=2 examples/train_pipeline.py --schedule 1f1b --microbatches 4 [--print-health]
"""
import os
import sys

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import (  # noqa: E402
    SlowDown,
    TinyLM,
    batch_for,
    clipped,
    fixed_step,
    health_line,
    lm_loss,
    parse_args,
    poisoned,
    setup_distributed,
    step_line,
)


class StageModule(nn.Module):
    """The slice of TinyLM that one stage runs: embedding on the first, head on the last, blocks between."""

    def __init__(self, full: TinyLM, stage: int, stages: int):
        super().__init__()
        n = len(full.blocks)
        lo, hi = stage * n // stages, (stage + 1) * n // stages
        self.first, self.last = stage == 0, stage == stages - 1
        self.embed, self.pos = (full.embed, full.pos) if self.first else (None, None)
        self.slow = full.slow if self.first else SlowDown()
        self.blocks = nn.ModuleList(full.blocks[lo:hi])
        self.ln, self.head = (full.ln, full.head) if self.last else (None, None)

    def forward(self, x):
        if self.first:
            x = self.embed(x) + self.pos[:, : x.shape[1]]
        x = self.slow(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x)) if self.last else x


def main():
    def extra(p):
        p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
        p.add_argument("--microbatches", type=int, default=4)
        p.add_argument("--stage-ms", default="", help="comma-separated: each stage sleeps this long per step in its "
                                                      "forward (split over the microbatches), e.g. 70,30")
        p.add_argument("--fixed-stage-ms", default="", help="with --fix-every: --stage-ms of the fixed steps")

    args = parse_args(__doc__, extra)
    rank, world, device = setup_distributed()
    if world < 2:
        raise SystemExit("train_pipeline.py needs 2 or more ranks (one stage each)")
    if args.layers < world:
        args.layers = world
    torch.manual_seed(args.seed)
    full = TinyLM(args.vocab, args.dim, args.layers, seq=args.seq)
    if rank == args.slow_rank:
        full.slow.seconds = args.slow_ms / 1000 / args.microbatches   # per microbatch: X ms per step in total
    module = StageModule(full, rank, world).to(device)
    if args.stage_ms:
        module.slow.seconds = float(args.stage_ms.split(",")[rank]) / 1000 / args.microbatches
    # this stage's parameters, counted by the job (the memory ledger's truth, tests/jobs/test_rank_jobs.py)
    print(f"stage {rank} parameters {sum(q.numel() for q in module.parameters())} "
          f"tensors {len(list(module.parameters()))}", flush=True)
    stage = PipelineStage(module, rank, world, device)
    cls = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    at = [0]      # the step in progress, for --nan-at (the schedule calls the loss function per microbatch)
    schedule = cls(stage, n_microbatches=args.microbatches,
                   loss_fn=lambda out, target: poisoned(lm_loss(out, target), at[0], rank, args))
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr)
    last = rank == world - 1
    for step in range(args.steps):
        at[0] = step
        if args.fix_every and args.stage_ms:
            ms = args.fixed_stage_ms if fixed_step(args, step) else args.stage_ms
            module.slow.seconds = float(ms.split(",")[rank]) / 1000 / args.microbatches if ms else 0.0
        x, y = batch_for(step, 0, args, device)     # one data stream for the whole pipeline
        # contiguous: torch 2.11's stages check the input's strides against the shapes they were built for (a
        # slice of the (batch, seq + 1) tokens failed there: "expected (64, 1) actual (65, 1)"); same values
        x, y = x.contiguous(), y.contiguous()
        opt.zero_grad(set_to_none=True)
        losses = []
        if rank == 0:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        norm = clipped(module.parameters(), args)     # the stage's own parameters: each stage clips its own
        opt.step()
        if last:
            loss = torch.stack(losses).mean()
            print(step_line(step, loss.item(), args), flush=True)
            if args.print_health:     # the microbatches' mean in float64, the mean dtprof records
                mean = torch.stack([v.double() for v in losses]).mean().item()
                print(health_line(rank, step, mean, norm, opt.param_groups[0]["lr"]), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
