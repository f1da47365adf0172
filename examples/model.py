"""A small transformer language model shared by the example trainers (embedding, N blocks of attention + MLP,
LM head), plus the helpers they share: arguments, process-group setup and synthetic token batches.

The examples do not import dtprof: they are ordinary training scripts that `dtprof run` profiles unchanged.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _delay(ctx.seconds)
        return grad, None


BUSY = [False]   # --slow-busy: the delays spin on the CPU instead of sleeping


def _delay(seconds: float) -> None:
    """Sleep ``seconds``, or with --slow-busy spin that long (a straggler that burns its core, as slow compute does)."""
    if not BUSY[0]:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class SlowDown(nn.Module):
    """Sleeps inside forward (so the delay counts as compute) on the rank chosen by --slow-rank; with
    ``in_backward`` inside backward instead (so DDP's gradient all-reduce waits for it)."""

    def __init__(self, seconds: float = 0.0, in_backward: bool = False):
        super().__init__()
        self.seconds = seconds
        self.in_backward = in_backward

    def forward(self, x):
        if self.seconds > 0 and self.in_backward:
            return _SleepInBackward.apply(x, self.seconds)
        if self.seconds > 0:
            _delay(self.seconds)
        return x


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int = 4, seq: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq, dim))
        self.slow = SlowDown()
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.slow(self.embed(tokens) + self.pos[:, : tokens.shape[1]])
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def parse_args(description: str, extra=None):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank sleeps --slow-ms in its forward each step")
    p.add_argument("--slow-ms", type=float, default=0.0)
    p.add_argument("--slow-in", choices=["forward", "backward"], default="forward",
                   help="where --slow-rank sleeps: in forward (compute) or in backward (DDP's all-reduce waits)")
    p.add_argument("--slow-busy", action="store_true",
                   help="--slow-rank spins on the CPU for --slow-ms instead of sleeping")
    p.add_argument("--data-ms", type=float, default=0.0, help="every rank waits this long for each batch")
    p.add_argument("--fix-every", type=int, default=0,
                   help="every N-th step runs as the fixed job: without --slow-ms and --data-ms (and, in "
                        "train_ddp.py, with --no-sync on those steps only): the slowed and the fixed job interleaved "
                        "step by step in one run, so a busy machine's load hits both alike")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (inductor) before training")
    p.add_argument("--print-time", action="store_true",
                   help="end each step line with the job's clock (time.monotonic(), s) when it is printed and the "
                        "process's CPU time (time.process_time(), s) and the printing thread's, the training "
                        "thread (time.thread_time(), s): benchmarks/overhead.py times the steps by them, whatever "
                        "way the line travels")
    p.add_argument("--clip", type=float, default=0.0,
                   help="clip the gradients' global norm to this (torch.nn.utils.clip_grad_norm_); 0: no clipping")
    p.add_argument("--nan-at", default="", metavar="STEP:RANK",
                   help="a numerics incident on purpose: rank RANK's loss is NaN at step STEP")
    p.add_argument("--print-health", action="store_true",
                   help="each rank with a loss prints 'HEALTH rank step loss grad_norm lr' per step, full precision "
                        "(grad_norm nan without --clip)")
    if extra:
        extra(p)
    args = p.parse_args()
    BUSY[0] = args.slow_busy
    return args


def poisoned(loss, step: int, rank: int, args):
    """The loss, NaN on the step and rank of ``--nan-at``."""
    if args.nan_at and [step, rank] == [int(v) for v in args.nan_at.split(":")]:
        return loss * float("nan")     # the gradients go NaN too, as with a NaN in the data
    return loss


def clipped(parameters, args):
    """``--clip``: the gradients clipped, and their global norm as a float (FSDP2's is a replicated DTensor);
    None without it."""
    if not args.clip:
        return None
    norm = torch.nn.utils.clip_grad_norm_(parameters, args.clip)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def health_line(rank: int, step: int, loss: float, norm: float | None, lr: float) -> str:
    """``--print-health``: what the rank computed this step, each value's repr (read back bit for bit)."""
    return f"HEALTH {rank} {step} {loss!r} {float('nan') if norm is None else norm!r} {lr!r}"


def step_line(step: int, loss: float, args) -> str:
    """The line rank 0 (the last stage in a pipeline) prints per step."""
    clocks = ""
    if args.print_time:
        clocks = f" t {time.monotonic():.6f} cpu {time.process_time():.6f} th {time.thread_time():.6f}"
    return f"step {step} loss {loss:.6f}{clocks}"


def setup_distributed():
    """Initialise the default group (gloo on CPU, nccl with CUDA); also works as a plain single process."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    cuda = torch.cuda.is_available()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), device


class SlowBatches(torch.utils.data.Dataset):
    """A slow input pipeline (``--data-ms``): batch ``step`` waits that long before it is made. Read through a
    DataLoader, as real input is, so the wait is time in the loader's ``__next__``."""

    def __init__(self, rank: int, args):
        self.rank, self.args = rank, args

    def __len__(self):
        return self.args.steps

    def __getitem__(self, step):
        if not fixed_step(self.args, step):
            time.sleep(self.args.data_ms / 1000)
        return batch_for(step, self.rank, self.args, torch.device("cpu"))


def fixed_step(args, step: int) -> bool:
    """Whether ``step`` runs as the fixed job (``--fix-every``)."""
    return args.fix_every > 0 and step % args.fix_every == args.fix_every - 1


def batches(rank: int, args, device):
    """The job's batches in step order: made in the loop, or through a DataLoader when ``--data-ms`` slows input."""
    if args.data_ms <= 0:
        return (batch_for(step, rank, args, device) for step in range(args.steps))
    loader = torch.utils.data.DataLoader(SlowBatches(rank, args), batch_size=None)
    return ((x.to(device), y.to(device)) for x, y in loader)


def batch_for(step: int, rank: int, args, device):
    """Synthetic next-token data: a fixed function of (seed, step, rank), the same with or without profiling."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    return data[:, :-1].to(device), data[:, 1:].to(device)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
