"""A job's own clock of its communication, independent of any profiler: the time its training thread spends inside
``torch.distributed`` calls and ``Work.wait`` (nested calls counted once).

``install()`` wraps them; call it before DeepSpeed is imported (``deepspeed.comm`` looks some functions up once).
``comm_s()`` is the running total (s). The examples print per step ``clock <rank> {"steps": [[duration,
communication], ...]}`` from it (examples/frameworks/train_deepspeed.py, train_hf_trainer.py).
"""
import threading
import time

import torch.distributed as dist

COMM_FUNCS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
              "broadcast", "reduce", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier",
              "all_to_all_single", "all_to_all", "gather", "scatter", "all_gather_object", "broadcast_object_list")
_MAIN = threading.get_ident()
_clock = {"depth": 0, "comm_s": 0.0}


def _timed(fn):
    def wrapper(*args, **kwargs):
        if threading.get_ident() != _MAIN or _clock["depth"]:
            return fn(*args, **kwargs)
        _clock["depth"] += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _clock["comm_s"] += time.perf_counter() - t0
            _clock["depth"] -= 1
    wrapper.__name__ = getattr(fn, "__name__", "wrapper")
    wrapper.__wrapped__ = fn
    return wrapper


def install() -> None:
    for name in COMM_FUNCS:
        if hasattr(dist, name):
            setattr(dist, name, _timed(getattr(dist, name)))
    dist.Work.wait = _timed(dist.Work.wait)


def comm_s() -> float:
    return _clock["comm_s"]
