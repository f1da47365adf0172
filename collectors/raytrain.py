"""Ray Train workers profiled on a cluster that dtprof did not start (issue 38): ``dtprof.ray_train``.

A Ray cluster is started once (``ray start``) and jobs arrive with ``ray job submit`` or a driver that calls
``ray.init(address=...)``; nothing of `dtprof run` reaches the workers. The one line that profiles them wraps the
training function::

    trainer = TorchTrainer(dtprof.ray_train(train_func, run_dir="/shared/runs/exp1"), ...)

In each worker, before ``train_func`` runs (Ray Train has set up the process group by then):

- the run directory is created or joined: its ``join_id`` is ``ray-train:<experiment name>``, the same for every
  worker and every attempt of one ``trainer.fit()``; another job's run there is refused (one line on the worker's
  stderr, which Ray relays to the driver; the job runs on unprofiled);
- the worker gets a node directory of its own (``node-<host>-<pid>``) whose node.json says which rank it records
  (``attempt_rank``, Ray Train's world rank) and which ``attempt`` of that rank it is: 1 + the node directories of
  that rank already in the run. Ray restarts the whole worker group after a failure, so every rank of a restarted
  group is a new process with the next attempt; the reader keeps each rank's last attempt as the rank and lists
  the earlier ones as restarts (dtprof/rundir/run.py ``Run.restarts``);
- the rank is recorded as under `dtprof run` (collectors/runtime.py ``init`` with this node directory and rank).

Only the processes that run the wrapped function are recorded: Ray's own processes (driver, controller, raylet,
other tasks) never call it. When ``train_func`` raises, the exception (type, message, traceback), the step it
was raised in and the time go into node.json (``failure``), an ``error`` events row and the heartbeat's exception
dump; then the exception propagates to Ray unchanged. When it returns, node.json records the end. Either way the
rank's rows are flushed before the wrapper returns or re-raises, as at a process's exit: Ray kills a worker
(``ray.kill``) without running its atexit handlers.

Under `dtprof run` (a script that starts a local cluster inherits dtprof's environment) the workers are already
recorded into that run: ``run_dir`` is not used, and a failure is still recorded on the rank. There, without the
wrapper, a worker is flushed when Ray's training thread ends (ray_exit.py ``flush_after_training``, started by
collectors/identity.py when a Ray Train worker identifies itself).
"""
from __future__ import annotations

import functools
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

from dtprof.collectors import ray_exit

FAILURE_EVENT = "training function raised"   # the events row's message starts with this


def ray_train(train_func: Callable, run_dir: str | os.PathLike, **options: Any) -> Callable:
    """``train_func`` for ``TorchTrainer`` with each worker recorded as a rank of the run at ``run_dir``.
    ``options``: as ``dtprof.init``'s (e.g. ``trace_steps="5:7"``, ``count_flops=False``)."""
    run_dir = str(run_dir)

    @functools.wraps(train_func)   # Ray reads the signature (config or none) through __wrapped__
    def profiled_train_func(*args, **kwargs):
        worker = _Worker.start(run_dir, options)
        try:
            result = train_func(*args, **kwargs)
        except BaseException as e:
            if worker is not None:
                worker.failed(e)
            raise
        if worker is not None:
            worker.finished()
        return result

    return profiled_train_func


def _say(message: str) -> None:
    """One line on the worker's stderr (Ray relays it to the driver): only for a run that cannot be recorded."""
    try:
        sys.stderr.write(f"dtprof: {message}\n")
    except Exception:
        pass


class _Worker:
    def __init__(self, node_dir: Path | None, info: dict):
        self.node_dir = node_dir      # None under `dtprof run`: its launcher writes the node.json
        self.info = info

    @classmethod
    def start(cls, run_dir: str, options: dict) -> _Worker | None:
        from dtprof.collectors import runtime

        if os.environ.get("DTPROF_NODE_DIR"):     # `dtprof run` records this process already
            return cls(None, {})
        try:
            import ray.train

            from dtprof.rundir.writer import (
                NODE_MANIFEST,
                RunExistsError,
                create_node_dir,
                create_run_dir,
                write_json_atomic,
            )

            ctx = ray.train.get_context()
            rank, experiment = int(ctx.get_world_rank()), str(ctx.get_experiment_name())
            try:
                run = create_run_dir(Path(run_dir), {"created_by": "dtprof.ray_train", "experiment": experiment},
                                     join_id=f"ray-train:{experiment}")
            except RunExistsError as e:
                _say(f"{e}; this Ray Train run ({experiment}) is not recorded")
                return None
            attempt = 1 + sum(_recorded_rank(nd) == rank for nd in run.glob("node-*"))
            node_dir = create_node_dir(run)
            info = {"node": node_dir.name, "host": socket.gethostname(), "pid": os.getpid(),
                    "command": list(sys.argv), "cwd": os.getcwd(), "created_by": "dtprof.ray_train",
                    "start_time": _utc(), "start_mono_ns": time.monotonic_ns(), "status": None,
                    "attempt_rank": rank, "attempt": attempt,
                    "ray": {"experiment": experiment, "world_rank": rank, "world_size": int(ctx.get_world_size()),
                            "local_rank": int(ctx.get_local_rank()), "node_rank": int(ctx.get_node_rank())}}
            write_json_atomic(node_dir / NODE_MANIFEST, info)
            worker = cls(node_dir, info)
            opts = {"count_flops": True, **options}     # as `dtprof run` records by default
            if not runtime.init(rank=rank, node_dir=str(node_dir), **opts):
                _say(f"{run_dir}: rank {rank} is not recorded (see the events in {node_dir})")
            return worker
        except Exception as e:
            _say(f"{run_dir}: not recorded ({type(e).__name__}: {e})")
            return None

    def failed(self, exc: BaseException) -> None:
        """The training function raised: record where and what, flush, and let the exception go on."""
        try:
            from dtprof.collectors import heartbeat, runtime

            rec = runtime.STATE
            text = f"{type(exc).__name__}: {exc}"[:500]
            record = heartbeat.exception_record(type(exc), exc, exc.__traceback__)
            if rec.active and not rec.disabled:
                rec.event("error", f"{FAILURE_EVENT} at step {rec.step}: {text}")
                if rec.heartbeat is not None:
                    rec.heartbeat.exit_status = f"exception: {text}"
                heartbeat.write_dump(Path(rec.rank_dir), rec, "exception", f"exception: {text}", record,
                                     beat=rec.heartbeat)
            self.end("failed", 1, failure={"step": rec.step, "exception": text, "time": _utc(),
                                           "mono_ns": time.monotonic_ns(), "traceback": record["frames"][-8:]})
        except Exception:
            pass

    def finished(self) -> None:
        try:
            self.end("completed", 0)
        except Exception:
            pass

    def end(self, status: str, exit_code: int, **extra: Any) -> None:
        """Flush the rank as its exit would, then write node.json's end (in this order: a node.json that says
        the attempt ended comes with all of its rows)."""
        from dtprof.collectors import runtime
        from dtprof.rundir.writer import NODE_MANIFEST, write_json_atomic

        ray_exit.final_flush(runtime.STATE)
        if self.node_dir is None:
            return
        end = time.monotonic_ns()
        self.info.update(status=status, exit_code=exit_code, end_time=_utc(), end_mono_ns=end,
                         duration_s=round((end - self.info["start_mono_ns"]) / 1e9, 3), **extra)
        write_json_atomic(self.node_dir / NODE_MANIFEST, self.info)


def _recorded_rank(node_dir: Path) -> int | None:
    """The rank a node directory of a Ray Train run records (its node.json's ``attempt_rank``), else None."""
    import json

    try:
        rank = json.loads((node_dir / "node.json").read_text()).get("attempt_rank")
        return rank if isinstance(rank, int) else None
    except (OSError, ValueError, AttributeError):
        return None


def _utc() -> str:
    import datetime as dt

    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
