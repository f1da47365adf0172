"""Rank side of `dtprof run --trace-steps A:B`: a torch.profiler trace of steps A..B-1 (half-open, like a Python
slice) written into the rank directory, merged into the run after the job by
``dtprof.collectors.kineto.merge_captured_traces``.

The profiler starts at the end of step A-1 (at creation when A == 0) and stops at the end of step B-1, calling
``prof.step()`` at every step end in between, so ``ProfilerStep#k`` is dtprof step A + k. Next to the trace,
``capture.json`` holds a (CLOCK_MONOTONIC, CLOCK_REALTIME) pair read right after the trace stopped: Kineto's
timestamps are wall-clock (ts µs + baseTimeNanoseconds = CLOCK_REALTIME ns, checked on torch 2.13), and the pair
moves them onto the rank's monotonic clock. Any fault disables the capture and is written to ``error.txt`` (the
merge turns it into an events row); training is never interrupted.

The capture disturbs the rank from the profiler's start to the end of its stop and export (~0.2 s on CPU), which
runs after step B-1 has ended and so lands in step B. ``on_window(steps, start_ns, end_ns)`` is told that window
and the steps it overlaps (A..B; A..the step in progress when the job ends first); the runtime writes it as a
``trace_capture`` meta row so that analyses keep those steps out of step statistics and data wait.

Kineto leaves CUPTI attached after a trace unless ``TEARDOWN_CUPTI=1`` when the profiler stops, and then every later
kernel launch of the job pays for it for the rest of the run. The capture stops with ``TEARDOWN_CUPTI=1`` (for that
call only) unless the variable is set already (the user's choice; torch sets 0 itself when torch.compile uses CUDA
graphs) or CUDA is older than 12.6, where re-initialising CUPTI after a teardown can crash a job that uses CUDA
graphs. ``capture.json``'s ``cupti_teardown`` says which.

``gpu_only`` (the default kernel sample of `dtprof run` on a GPU job, ``--no-kernel-sample`` turns it off): when
the window opens, a process that has not initialised CUDA captures nothing, silently (a CPU job pays nothing).
"""
from __future__ import annotations

import json
import os
import time
import traceback
import warnings
from pathlib import Path

CAPTURE_DIR = "kineto"  # same names as dtprof.collectors.kineto (not imported here: it pulls in pandas)
CAPTURE_META = "capture.json"
TRACE_NAME = "trace.json"


class TraceCapture:
    def __init__(self, rank_dir, start_step: int, end_step: int, on_window=None, gpu_only: bool = False):
        self.dir = Path(rank_dir) / CAPTURE_DIR
        self.gpu_only = gpu_only
        self.start_step, self.end_step = int(start_step), int(end_step)
        self.prof = None
        self.done = False
        self.on_window = on_window
        self.started_ns = None       # monotonic ns the profiler was started
        self.last_step_end = None    # the last step that ended while the profiler ran
        self.cupti_teardown = False  # the stop tore CUPTI down (TEARDOWN_CUPTI=1 for it)
        if self.end_step <= self.start_step:
            self._fail(f"empty --trace-steps window {start_step}:{end_step}")
        elif self.start_step == 0:
            self._start()

    def _fail(self, message: str) -> None:
        self.done = True
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "error.txt").write_text(message + "\n")
        except OSError:
            pass
        prof, self.prof = self.prof, None
        if prof is not None:
            try:
                self._stop(prof)
            except Exception:
                pass
            self._window_closed()

    def _start(self) -> None:
        try:
            import torch

            if self.gpu_only and not (torch.cuda.is_available() and torch.cuda.is_initialized()):
                self.done = True   # the kernel sample of a job that does not use a GPU: nothing to capture
                return
            from torch.profiler import ProfilerActivity, profile, schedule

            self.started_ns = time.monotonic_ns()
            acts = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(ProfilerActivity.CUDA)
            # A schedule is what makes torch emit ProfilerStep#k ranges; one active cycle of the whole window.
            # No warm-up cycle on purpose (the capture's steps are kept out of the statistics anyway), so torch's
            # "won't be using warmup" warning is silenced: nothing dtprof does may print into the job's stderr.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
                sched = schedule(wait=0, warmup=0, active=self.end_step - self.start_step, repeat=1)
            # Kineto (C++) writes "profiler_start"/"profiler_stop" lines to fd 2 at its default log level. It reads
            # KINETO_LOG_LEVEL once, when the process first profiles: raised above its highest level (USDT, 5) for
            # that moment only, unless the user set it, and not left for the job's child processes to inherit.
            quiet_kineto = "KINETO_LOG_LEVEL" not in os.environ
            if quiet_kineto:
                os.environ["KINETO_LOG_LEVEL"] = "6"
            try:
                self.prof = profile(activities=acts, record_shapes=True, on_trace_ready=self._export,
                                    schedule=sched)
                self.prof.start()
            finally:
                if quiet_kineto:
                    os.environ.pop("KINETO_LOG_LEVEL", None)
        except Exception as e:
            self._fail(f"could not start torch.profiler: {type(e).__name__}: {e}")

    def on_step_end(self, step: int) -> None:
        """Called by the rank runtime at the end of every step (dtprof step index)."""
        if self.done:
            return
        try:
            if self.prof is None and step == self.start_step - 1:
                self._start()
            elif self.prof is not None:
                self.last_step_end = step
                if step >= self.end_step - 1:
                    self._finish()
                else:
                    self.prof.step()
        except Exception as e:
            self._fail(f"{type(e).__name__}: {e}: {traceback.format_exc(limit=2)!r}")

    def _finish(self) -> None:
        prof, self.prof = self.prof, None
        self.done = True
        self._stop(prof)  # ends the active cycle: on_trace_ready (self._export) writes the trace
        self._window_closed()

    def _stop(self, prof) -> None:
        """``prof.stop()``, tearing CUPTI down after it where that is safe and nobody chose otherwise (above)."""
        self.cupti_teardown = "TEARDOWN_CUPTI" not in os.environ and _teardown_safe()
        if self.cupti_teardown:
            os.environ["TEARDOWN_CUPTI"] = "1"    # Kineto reads it when it disables the activities
        try:
            prof.stop()
        finally:
            if self.cupti_teardown:
                os.environ.pop("TEARDOWN_CUPTI", None)

    def _window_closed(self) -> None:
        """Report the disturbed window: from the profiler's start to now (its stop and export are done)."""
        end_ns = time.monotonic_ns()
        if self.on_window is None or self.started_ns is None:
            return
        last = self.start_step if self.last_step_end is None else self.last_step_end + 1
        started, self.started_ns = self.started_ns, None
        self.on_window(list(range(self.start_step, last + 1)), started, end_ns)

    def _export(self, prof) -> None:
        mono, wall = time.monotonic_ns(), time.time_ns()
        self.dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.dir / TRACE_NAME))
        meta = {"trace": TRACE_NAME, "start_step": self.start_step, "end_step": self.end_step,
                "mono_ns": mono, "wall_ns": wall, "cupti_teardown": self.cupti_teardown,
                "clock": "kineto ts*1000 + baseTimeNanoseconds = CLOCK_REALTIME"}
        tmp = self.dir / f".{CAPTURE_META}.tmp"
        tmp.write_text(json.dumps(meta) + "\n")
        tmp.replace(self.dir / CAPTURE_META)

    def close(self) -> None:
        """At exit: a window still open (the job ended early) is written as far as it went."""
        if self.prof is None or self.done:
            return
        try:
            self._finish()
        except Exception as e:
            self._fail(f"could not write the trace at exit: {type(e).__name__}: {e}")


def _teardown_safe() -> bool:
    """CUDA 12.6 or later (or no CUDA): CUPTI can be torn down and initialised again, CUDA graphs or not."""
    import torch

    version = getattr(torch.version, "cuda", None)
    if not version:
        return True
    try:
        return tuple(int(x) for x in version.split(".")[:2]) >= (12, 6)
    except ValueError:
        return False
