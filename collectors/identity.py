"""Which rank this process is, under every launcher (issue 14).

Launchers differ in what a rank knows when it imports torch:

- torchrun, ``python -m torch.distributed.run`` and what is built on them (``accelerate launch`` runs torchrun's
  launcher inside its own CLI process) give each worker ``RANK`` before Python starts. That rank is taken at once.
- Lightning's own launcher (``python train.py`` with ``Trainer(devices=2)``) re-runs the script for ranks 1.. with
  only ``LOCAL_RANK``/``WORLD_SIZE``; its parent becomes rank 0 later. ``torch.multiprocessing.spawn`` children and
  ``srun`` tasks (``SLURM_PROCID``) pass their rank to ``init_process_group`` themselves.
  Such a process is *unnamed* until it identifies itself: its rank is the one its process group reports when
  ``init_process_group`` returns; a process that reaches its first module forward with no process group is a
  single-process job (rank 0 of 1).
- A process that inherited ``RANK`` from a rank that records it (a DataLoader worker, a helper subprocess) waits
  the same way.
- A process that never does either (the accelerate CLI, the parent of ``mp.spawn``, torchrun's own launcher) is
  never recorded.

A process that identifies as a rank another live process already records (e.g. a subprocess that inherited
``RANK``) is not dropped in silence: it writes an ``error`` event (``unidentified-<pid>.jsonl.gz`` in the node
directory) naming its pid, command line and the rank it claimed; the analysis lists it under
``run.unidentified_processes``.
"""
from __future__ import annotations

import os
import sys


def launcher_rank(env=os.environ) -> int | None:
    """The global rank a launcher put in the environment before Python started (``RANK``), else None."""
    v = env.get("RANK", "").strip()
    return int(v) if v.isdigit() else None


def local_rank(env=os.environ) -> int:
    for k in ("LOCAL_RANK", "SLURM_LOCALID"):
        if env.get(k, "").strip().isdigit():
            return int(env[k])
    return 0


def node_rank(env=os.environ) -> int | None:
    for k in ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID"):
        if env.get(k, "").strip().isdigit():
            return int(env[k])
    return None


def process_group_rank() -> tuple[int, int] | None:
    """(rank, world size) of the default process group, or None while there is none."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def rank_identity(rank: int, host: str, rank_dir: str, options: dict) -> dict:
    """The rank's rank.json (docs/run-format.md): who it is, on which device, with which torch and options."""
    import torch

    env = os.environ
    ident = {
        "rank": rank, "local_rank": local_rank(env),
        "world_size": int(env.get("WORLD_SIZE", 1)),
        "node_rank": node_rank(env),
        "host": host, "pid": os.getpid(), "node": os.path.basename(os.path.dirname(rank_dir)),
        "device_type": "cpu", "device_index": None, "device_name": "cpu", "device_uuid": "",
        "device_mem_total_bytes": None, "backend": "",
        "torch_version": torch.__version__, "python": sys.version.split()[0], "argv": sys.argv,
        "options": options,
    }
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            ident["backend"] = str(dist.get_backend())
            ident["world_size"] = dist.get_world_size()
    except Exception:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        i = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(i)
        ident.update(device_type="cuda", device_index=i, device_name=props.name,
                     device_uuid=str(getattr(props, "uuid", "")),
                     device_mem_total_bytes=int(props.total_memory))
    return ident


class _Waiter:
    """Holds an unnamed process until it identifies itself, then calls ``start(rank)`` once."""

    def __init__(self, start, rec):
        self.start = start
        self.rec = rec             # the runtime's Recorder (this module never imports the runtime)
        self.done = False
        self.handle = None

    def identified(self, rank: int) -> None:
        if self.done:
            return
        self.done = True
        if self.handle is not None:
            self.handle.remove()
        self.start(rank)
        if "ray.train" in sys.modules:   # a Ray Train worker: Ray kills it without atexit (collectors/raytrain.py)
            from dtprof.collectors import ray_exit

            ray_exit.flush_after_training(self.rec)

    def identify_now(self) -> None:
        """At the first forward (or the first compile, which is one): the process group's rank if there is one,
        else ``RANK``, else 0 (a single-process job)."""
        pg = process_group_rank()
        self.identified(pg[0] if pg else (launcher_rank() or 0))

    def first_forward(self, module, args):
        if self.done:
            return None
        try:
            self.identify_now()
            self.rec.begin_forward(module, args)   # this call's own pre-hook ran before recording started
        except Exception:
            pass
        return None


def wait_for_identity(start, rec) -> _Waiter:
    """Call ``start(rank)`` when this process's process group exists (its rank), or at its first forward (the
    process group's rank if one exists by then, else ``RANK``, else 0: a single-process job)."""
    import torch.distributed as dist
    from torch.nn.modules import module as nn_module

    waiter = _Waiter(start, rec)
    if dist.is_available():
        c10d = dist.distributed_c10d
        orig = c10d.init_process_group

        def init_process_group(*args, **kwargs):
            result = orig(*args, **kwargs)
            try:
                waiter.identified(dist.get_rank())
            except Exception:
                pass
            return result

        init_process_group.__wrapped__ = orig  # type: ignore[attr-defined]
        init_process_group.__doc__ = orig.__doc__
        c10d.init_process_group = dist.init_process_group = init_process_group
    waiter.handle = nn_module.register_module_forward_pre_hook(waiter.first_forward)
    return waiter


def report_unidentified(node_dir, rank: int, owner_pid: int | None, host: str) -> None:
    """An ``error`` event naming this process, in its own file ``unidentified-<pid>.jsonl.gz`` of the node directory
    (an events table the reader merges into the node's events): this process is a rank nobody will see."""
    from dtprof.rundir.writer import UNIDENTIFIED_EVENT, process_event

    argv = " ".join(sys.argv)[:300]
    process_event(node_dir, host, "error", f"{UNIDENTIFIED_EVENT} pid {os.getpid()} ({argv}) identified as rank "
                                           f"{rank}, which pid {owner_pid} already records; this process is not "
                                           f"recorded")
