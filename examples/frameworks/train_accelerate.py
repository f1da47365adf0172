"""An Accelerate training loop on CPU: a tiny MLP classifier on in-memory data.

    torchrun --nproc_per_node=2 examples/frameworks/train_accelerate.py
    accelerate launch --multi_gpu --num_machines 1 --num_processes 2 examples/frameworks/train_accelerate.py
    dtprof run -- accelerate launch --multi_gpu --num_machines 1 --num_processes 2 \\
        examples/frameworks/train_accelerate.py                                   # profiled, unchanged
    DS_ACCELERATOR=cpu accelerate launch --use_deepspeed --zero_stage 2 --num_machines 1 --num_processes 2 \\
        examples/frameworks/train_accelerate.py --deepspeed 2                     # DeepSpeed ZeRO-2 on CPU

``--multi_gpu --num_processes 2`` starts two ranks on one machine (through torchrun's launcher, inside the
accelerate process); ``Accelerator(cpu=True)`` keeps them on the CPU with gloo, so no GPU is needed.
The main process prints each step's loss and ``final loss <value>``.
"""
import argparse
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--deepspeed", type=int, default=None, metavar="STAGE",
                   help="Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=STAGE)) (on CPU: DS_ACCELERATOR=cpu)")
    p.add_argument("--print-time", action="store_true",
                   help="end each step line with time.monotonic() and time.process_time() (s)")
    args = p.parse_args()
    if args.deepspeed is None:
        accelerator = Accelerator(cpu=True)
    else:
        # Accelerate's cpu=True never uses DeepSpeed; DeepSpeed's own CPU accelerator (DS_ACCELERATOR=cpu) does. The
        # backend must be named: on a machine without a GPU Accelerate finds none, and its state then counts one
        # process of rank 0 on every rank (DeepSpeed itself still runs on both), so the data are not sharded and
        # DeepSpeed rejects the batch size ("16 != 16 * 1 * 2")
        from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=args.deepspeed),
                                  kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    set_seed(0)
    n = args.steps * args.batch * accelerator.num_processes
    data = TensorDataset(torch.randn(n, args.dim), torch.randint(0, 4, (n,)))
    model = torch.nn.Sequential(torch.nn.Linear(args.dim, args.dim), torch.nn.ReLU(), torch.nn.Linear(args.dim, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt, loader = accelerator.prepare(model, opt, DataLoader(data, batch_size=args.batch))
    model.train()
    for step, (x, y) in enumerate(loader):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        mean_loss = accelerator.gather(loss.detach()).mean()     # an all-gather per step, as loss logging does
        t = ""
        if args.print_time:
            t = f" t {time.monotonic():.6f} cpu {time.process_time():.6f} th {time.thread_time():.6f}"
        accelerator.print(f"step {step} loss {mean_loss.item():.6f}{t}", flush=True)
    accelerator.print(f"final loss {mean_loss.item():.8f}")
    accelerator.end_training()
    # Accelerate leaves its process group up; exiting with gloo's threads alive can abort the process
    # ("terminate called without an active exception", pytorch issue #190489)
    if torch.distributed.is_initialized():
        # freeing DDP's reducer joins gloo's workers while holding the GIL, and a worker still destroying the last
        # all-gather needs the GIL (examples/frameworks/train_hf_trainer.py): let the workers finish first
        torch.distributed.barrier()
        time.sleep(0.2)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
