"""Small training jobs for benchmarks/chaos.py, with one fault injected at one step (no dtprof in them).

    CHAOS_JOB=ddp torchrun --nproc_per_node=3 benchmarks/chaos_job.py

CHAOS_JOB picks the job: ddp (DistributedDataParallel), fsdp2 (`fully_shard`), pipeline
(torch.distributed.pipelining, one stage per rank, GPipe over 4 micro-batches) or lightning (a LightningModule under
Lightning's DDP strategy, which reads torchrun's environment); each ends every step with a logging all-reduce, as
most jobs do. Environment: CHAOS_FAULT (the fault's kind, below; "none" by default), CHAOS_RANK (the rank that
injects it), CHAOS_STEP (at the end of which step), CHAOS_STEPS (steps in all), CHAOS_OUT (a folder: each rank
writes the SHA-256 of its final weights, its own shard or stage, there as weights-<rank>.sha256 when it finishes),
CHAOS_PG_TIMEOUT (the process group's timeout, s), CHAOS_MOUNT (the tmpfs the run directory is on, for the run-
directory faults).

Faults the job injects itself, the same with and without dtprof: rank_kill, rank_stop (SIGSTOP, left frozen),
rank_raise, rank_exit (os._exit(3)), agent_kill (SIGKILL to its parent, torchrun's agent), node_lost (the same in a
two-agent job; every rank's steps after it take NODE_LOST_STEP_S), coll_timeout (the rank sleeps past the process
group's timeout before a collective its peers wait in), mismatch (a broadcast of another size on one rank; gloo lets
it pass), oom (a real allocation the CPU allocator refuses, inside the model's forward), oom_cuda (CUDA's out-of-
memory error with its message, raised there: this machine has no GPU), nan (a NaN in the rank's batch of that step).
Faults that need dtprof (a no-op without it): dtprof_kill (SIGKILL to `dtprof run`, the agent's parent),
dir_readonly / dir_full (the run directory's file system turned read-only by an error / filled), hb_raise / hb_stall
(dtprof's heartbeat thread raises at every beat / blocks forever), flusher_raise / flusher_stall (dtprof's flusher
thread raises / blocks forever).
"""
import datetime
import hashlib
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

FAULT = os.environ.get("CHAOS_FAULT", "none")
CULPRIT = int(os.environ.get("CHAOS_RANK", "1"))
AT = int(os.environ.get("CHAOS_STEP", "5"))
STEPS = int(os.environ.get("CHAOS_STEPS", "16"))
PG_TIMEOUT = float(os.environ.get("CHAOS_PG_TIMEOUT", "300"))
JOB = os.environ.get("CHAOS_JOB", "ddp")
# A node lost: the surviving agent finds the rendezvous store gone within 0.2-1.2 s (its monitor interval, then
# the rendezvous state's 1 s cache) and SIGTERMs its rank. With the job's 0.05 s steps, the few steps left after
# the fault raced that: the bare job wrote its final weights in 3 of 6 runs (campaign fault #45). Steps this long
# after it leave the survivors training when their agent stops them, with or without dtprof.
NODE_LOST_STEP_S = 1.0
# torch 2.x caching allocator text (c10/cuda/CUDACachingAllocator.cpp), as a GPU would raise it
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which 1.23 GiB "
            "is free. Including non-PyTorch memory, this process has 77.87 GiB memory in use. Of the allocated memory "
            "70.20 GiB is allocated by PyTorch, and 6.90 GiB is reserved by PyTorch but unallocated.")


def dtprof_recorder():
    """dtprof's rank runtime in this process, when the job runs under `dtprof run` (else None)."""
    rt = sys.modules.get("dtprof.collectors.runtime")
    return getattr(rt, "STATE", None) if rt else None


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def inject(step: int) -> None:
    if os.environ.get("CHAOS_OUT"):   # when the fault landed (benchmarks/chaos.py times a bare hang from it)
        with open(os.path.join(os.environ["CHAOS_OUT"], "injected"), "w") as f:
            f.write(f"{FAULT} {step}\n")
    if FAULT == "rank_kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif FAULT == "rank_stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif FAULT == "rank_raise":
        raise RuntimeError(f"chaos: injected failure at step {step}")
    elif FAULT == "rank_exit":
        os._exit(3)
    elif FAULT in ("agent_kill", "node_lost"):
        os.kill(os.getppid(), signal.SIGKILL)
    elif FAULT == "coll_timeout":
        time.sleep(PG_TIMEOUT * 1.5)
    elif FAULT == "dtprof_kill" and os.environ.get("DTPROF_NODE_DIR"):
        launcher = parent_of(os.getppid())
        with open(f"/proc/{launcher}/cmdline", "rb") as f:
            if b"dtprof" in f.read():
                os.kill(launcher, signal.SIGKILL)
    elif FAULT in ("dir_readonly", "dir_full") and os.environ.get("CHAOS_MOUNT") and os.environ.get("DTPROF_NODE_DIR"):
        mount = os.environ["CHAOS_MOUNT"]
        # after dtprof's first flush (once a second) and the benchmark's next look (every 0.5 s): on a quiet
        # machine step 5 came before either, and a fault with no flushed rows checks nothing of what it may lose
        time.sleep(2.0)
        if FAULT == "dir_readonly":   # ext4 mounted errors=remount-ro: an error turns it read-only, files open or not
            with open(os.environ["CHAOS_FS_ERROR"], "w") as f:
                f.write("chaos\n")
        else:
            try:
                with open(os.path.join(mount, "filler"), "wb") as f:
                    while True:
                        f.write(b"0" * 65536)
                        f.flush()
            except OSError:
                pass
    elif FAULT.startswith(("hb_", "flusher_")) and dtprof_recorder() is not None:
        rec = dtprof_recorder()
        stall = threading.Event()   # never set

        def broken(*a, **k):
            if FAULT.endswith("_stall"):
                stall.wait()
            raise OSError("chaos: injected fault in dtprof's own thread")
        if FAULT.startswith("hb_") and getattr(rec, "heartbeat", None) is not None:
            rec.heartbeat.poll_requests = broken
        elif FAULT.startswith("flusher_"):
            own = rec.flush_once

            def flush_once():   # only the flusher thread breaks: the exit's own flush is what a stuck thread leaves
                if threading.current_thread().name == "dtprof-flusher":
                    broken()
                own()
            rec.flush_once = flush_once
    if FAULT.startswith(("hb_", "flusher_")):   # let the thread meet its fault before the job ends (with or without
        # dtprof alike: a pause changes no weight); a stalled heartbeat shows once it is 5 s old (STALE_BEAT_S)
        time.sleep(7.0 if FAULT == "hb_stall" else 2.5)


class Trip(torch.nn.Module):
    """An identity layer in each model's forward: the oom faults fail an allocation here at their step."""
    step = -1

    def forward(self, x):
        if Trip.step == AT and dist.get_rank() == CULPRIT:
            if FAULT == "oom":
                torch.empty(1 << 46, dtype=torch.uint8)   # 64 TiB: the CPU allocator refuses it
            elif FAULT == "oom_cuda":
                raise torch.OutOfMemoryError(CUDA_OOM)
        return x


def batch(gen: torch.Generator, step: int, rank: int) -> torch.Tensor:
    x = torch.randn(16, 32, generator=gen)
    if FAULT == "nan" and step == AT and rank == CULPRIT:
        x[0, 0] = float("nan")
    return x


def net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), Trip(), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def hosts_the_store() -> bool:
    """Whether this rank's agent hosts the rendezvous store (`--rdzv-conf=is_host=1`, benchmarks/chaos.py's node
    to lose). The rendezvous numbers the two nodes by their agents' pids, not by --node_rank, so under two
    `dtprof run` launchers either node may hold rank 1: lose the other and the surviving agent, its job finished,
    waits 300 s in torchrun's exit barrier for the lost one."""
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        return b"--rdzv-conf=is_host=1" in f.read().split(b"\0")


def end_of_step(step: int, rank: int, loss: torch.Tensor) -> None:
    culprit = hosts_the_store() if FAULT == "node_lost" and step == AT else rank == CULPRIT
    if step == AT and (culprit or FAULT == "mismatch"):
        if FAULT == "mismatch":
            dist.broadcast(torch.ones(12 if rank == CULPRIT else 10), src=0 if CULPRIT else 1)
        else:
            inject(step)
    dist.all_reduce(loss.detach().clone())   # a logging collective, as most jobs have
    time.sleep(NODE_LOST_STEP_S if FAULT == "node_lost" and step >= AT else 0.05)


def write_weights(rank: int, state: dict) -> None:
    if not os.environ.get("CHAOS_OUT"):
        return
    h = hashlib.sha256()
    for k, v in sorted(state.items()):
        v = v.to_local() if hasattr(v, "to_local") else v   # a DTensor: this rank's shard
        h.update(k.encode() + v.detach().contiguous().numpy().tobytes())
    with open(os.path.join(os.environ["CHAOS_OUT"], f"weights-{rank}.sha256"), "w") as f:
        f.write(h.hexdigest())


def data_parallel(rank: int) -> torch.nn.Module:
    model = net()
    if JOB == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for i in (0, 3):
            fully_shard(model[i])
        return fully_shard(model)
    return torch.nn.parallel.DistributedDataParallel(model)


def train_parallel(rank: int) -> dict:
    model = data_parallel(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(STEPS):
        Trip.step = step
        loss = model(batch(gen, step, rank)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        end_of_step(step, rank, loss)
    return model.state_dict()


def train_pipeline(rank: int) -> dict:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    world = dist.get_world_size()
    torch.manual_seed(rank)
    stage_mod = torch.nn.Sequential(torch.nn.Linear(32, 32), Trip(), torch.nn.ReLU())
    stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda out, y: (out - y).pow(2).mean())
    opt = torch.optim.SGD(stage_mod.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000)
    for step in range(STEPS):
        Trip.step = step
        x = batch(gen, step, 0 if rank == 0 else -1)
        losses: list = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=torch.zeros(16, 32), losses=losses)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
        end_of_step(step, rank, torch.stack(losses).mean() if losses else torch.zeros(()))
    return stage_mod.state_dict()


def train_lightning(rank: int) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, IterableDataset

    class Batches(IterableDataset):
        def __iter__(self):
            r = int(os.environ.get("RANK", "0"))
            gen = torch.Generator().manual_seed(1000 + r)
            for step in range(STEPS):
                yield batch(gen, step, r)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()

        def training_step(self, x, i):
            Trip.step = i
            loss = self.net(x).pow(2).mean()
            self.log("loss", loss, sync_dist=True)   # sync_dist: the logging all-reduce
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Inject(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, x, i):
            if i == AT and trainer.global_rank == CULPRIT and FAULT != "mismatch":
                inject(i)
            time.sleep(0.05)

    world = int(os.environ["WORLD_SIZE"])
    trainer = L.Trainer(devices=world, accelerator="cpu", strategy="ddp", max_steps=STEPS, max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Inject()])
    module = Module()
    trainer.fit(module, DataLoader(Batches(), batch_size=None))
    return module.net.state_dict()


def main():
    if JOB == "lightning":   # Lightning starts the process group itself (torchrun's environment)
        rank = int(os.environ["RANK"])
        write_weights(rank, train_lightning(rank))
        return
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    rank = dist.get_rank()
    state = train_pipeline(rank) if JOB == "pipeline" else train_parallel(rank)
    write_weights(rank, state)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
