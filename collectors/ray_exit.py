"""Flushing a Ray Train worker before Ray kills it: Ray ends a worker (``ray.kill``) without running its atexit
handlers, so the rank's last rows would be lost (all of a short job). Used by collectors/raytrain.py (a worker
profiled by ``dtprof.ray_train``) and collectors/identity.py (a worker of a script run under `dtprof run`, named by
its process group). Takes the rank's Recorder (collectors/runtime.py) as an argument: stdlib only, no import of the
runtime.
"""
from __future__ import annotations

import atexit
import threading
import time


def final_flush(rec) -> None:
    """Flush the rank once, as its exit would (its ``at_exit``; the atexit call is taken back, it would add its
    rows a second time)."""
    if rec.active and not rec.final_flushed:
        rec.final_flushed = True
        rec.at_exit()
        atexit.unregister(rec.at_exit)


def _training_thread() -> threading.Thread | None:
    """The thread Ray Train runs the training function in: ``TrainingThread(<name>)`` (Train v2's ThreadRunner),
    a ``RunnerThread`` (v1)."""
    return next((t for t in threading.enumerate()
                 if t.name.startswith("TrainingThread(") or type(t).__name__ == "RunnerThread"), None)


def flush_after_training(rec, wait_s: float = 300.0) -> None:
    """Flush ``rec`` when the training thread ends, since Ray kills the worker soon after. A daemon thread looks
    for the training thread (every 0.1 s, for at most ``wait_s``), joins it and flushes."""
    def watch():
        deadline = time.monotonic() + wait_s
        while (thread := _training_thread()) is None:
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
        thread.join()
        final_flush(rec)

    threading.Thread(target=watch, name="dtprof-ray-flush", daemon=True).start()
