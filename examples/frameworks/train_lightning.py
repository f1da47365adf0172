"""A PyTorch Lightning DDP job on CPU (gloo): a tiny regression model on in-memory data.

    python examples/frameworks/train_lightning.py                        # Lightning's own launcher (2 processes)
    torchrun --nproc_per_node=2 examples/frameworks/train_lightning.py   # torchrun starts the ranks
    dtprof run -- python examples/frameworks/train_lightning.py          # either, profiled, unchanged

Lightning detects torchrun from its environment; without it, ``Trainer(devices=2, strategy="ddp")`` re-runs this
script once more as rank 1 (its subprocess launcher). Rank 0 prints each step's loss as ``step <n> loss <value>``
(as the other examples do; benchmarks/overhead.py times the steps by the clock ``--print-time`` adds to them), and
each rank its final loss as ``final loss <value>``. ``--val-every N`` adds Lightning's validation loop every N
training batches (and its sanity check before training), as most Lightning jobs have; rank 0 prints
``validation`` each time it starts. ``--clip C``: Lightning's gradient clipping (``gradient_clip_val``, by norm);
``--print-health``: each rank prints ``HEALTH <rank> <step> <loss> <grad norm> <lr>`` before each optimizer step,
its micro-batches' mean loss and the total norm of Lightning's ``grad_norm`` utility (before any clipping).
``--sleep-ms`` adds idle host time after each step on every rank (a job that
must stay alive a while without computing much: a live scrape of its metrics).
"""
import argparse
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self, dim: int, lr: float):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.ReLU(), torch.nn.Linear(dim, 1))
        self.lr = lr
        self.losses: list | None = None     # --print-health: this step's micro-batch losses

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)     # sync_dist: an all-reduce per logged step
        if self.losses is not None:
            self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class PrintHealth(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from lightning.pytorch.utilities import grad_norm

        norm = float(grad_norm(pl_module, 2)["grad_2.0_norm_total"])
        loss = sum(pl_module.losses) / len(pl_module.losses)
        print(f"HEALTH {trainer.global_rank} {trainer.global_step} {loss!r} {norm!r} "
              f"{optimizer.param_groups[0]['lr']!r}", flush=True)
        pl_module.losses.clear()


class PrintSteps(L.Callback):
    def __init__(self, print_time: bool, sleep_ms: float):
        self.print_time, self.sleep_ms = print_time, sleep_ms

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.sleep_ms:
            time.sleep(self.sleep_ms / 1000)
        if trainer.is_global_zero and (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            t = ""
            if self.print_time:
                t = f" t {time.monotonic():.6f} cpu {time.process_time():.6f} th {time.thread_time():.6f}"
            print(f"step {trainer.global_step - 1} loss {outputs['loss'].item():.6f}{t}", flush=True)

    def on_validation_start(self, trainer, pl_module):
        if trainer.is_global_zero:
            print("validation" + (" (sanity check)" if trainer.sanity_checking else ""), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per rank")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=...)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--clip", type=float, default=None, help="Trainer(gradient_clip_val=...): clip by norm")
    p.add_argument("--print-health", action="store_true", help="each rank prints HEALTH lines (module docstring)")
    p.add_argument("--compile", action="store_true", help="compile the module's network (torch.compile(module.net))")
    p.add_argument("--sleep-ms", type=float, default=0.0, help="idle host time after each training batch")
    p.add_argument("--print-time", action="store_true",
                   help="end each step line with time.monotonic() and time.process_time() (s)")
    p.add_argument("--val-every", type=int, default=0,
                   help="run the validation loop every N training batches (0: no validation)")
    p.add_argument("--val-batches", type=int, default=8, help="validation batches per rank")
    args = p.parse_args()
    L.seed_everything(0, verbose=False)
    world = 2
    n = args.steps * args.accumulate * args.batch * world
    data = TensorDataset(torch.randn(n, args.dim), torch.randn(n, 1))
    val = None
    if args.val_every:
        m = args.val_batches * args.batch * world
        val = DataLoader(TensorDataset(torch.randn(m, args.dim), torch.randn(m, 1)), batch_size=args.batch)
    trainer = L.Trainer(devices=2, accelerator="cpu", strategy="ddp", max_steps=args.steps, max_epochs=1,
                        accumulate_grad_batches=args.accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                        **(dict(val_check_interval=args.val_every, limit_val_batches=args.val_batches) if val else {}),
                        gradient_clip_val=args.clip,
                        callbacks=[PrintSteps(args.print_time, args.sleep_ms)]
                        + ([PrintHealth()] if args.print_health else []))
    model = Regressor(args.dim, lr=args.lr)
    if args.print_health:
        model.losses = []
    if args.compile:
        model.net = torch.compile(model.net)
    trainer.fit(model, DataLoader(data, batch_size=args.batch), val)
    print(f"rank {trainer.global_rank} final loss {trainer.callback_metrics['train_loss'].item():.8f}", flush=True)
    if args.compile:
        import os
        import sys

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        from compile_stats import print_dynamo_line

        print_dynamo_line(trainer.global_rank)


if __name__ == "__main__":
    main()
