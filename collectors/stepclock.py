"""The step clock: the ``steps`` table and the forward, backward, optimizer, data-wait and evaluation spans, from
the hooks on the training thread's path (the rules: runtime.py's module docstring, "Steps" and "Spans").

``StepClock`` holds the bookkeeping of the step in progress and the hooks that keep it (the recorder, runtime.py,
installs them: global or root module hooks through ``ModuleHooks``, ``torch.autograd.backward``, the DataLoader's
``__next__``, the optimizer step hooks). It is given the rank's ``RankContext`` (the step, the detail and the
rank's flags live there) and the ``StepFlags`` it shares with the DDP and pipelining hooks; it owns the policies a
step's end or span needs: CUDA-event timing (cuda_timing.py), FLOP counting (flops.py) and the forward hooks'
modules (module_hooks.py). At each step's end it asks the ``Sampler`` (sampling.py) whether the next one is
detailed, hears the A/B switch (ab.py) and calls the parts' ``on_optimizer_step`` and ``on_step_end``.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from operator import attrgetter

from dtprof.collectors import inputs
from dtprof.collectors.boundary import BoundarySteps
from dtprof.collectors.cuda_timing import CudaTiming
from dtprof.collectors.flops import FlopCounter
from dtprof.collectors.module_hooks import ModuleHooks
from dtprof.collectors.parts import Parts
from dtprof.collectors.peak_memory import PeakMemory
from dtprof.collectors.records import span_row, step_row

now = time.monotonic_ns


def _last_error_line() -> str:
    return traceback.format_exc().strip().splitlines()[-1]


def on_ctx(name: str) -> property:
    """A property naming the RankContext's field ``name`` (where the rank's flags live); a C-level read."""
    return property(attrgetter("ctx." + name), lambda self, v: setattr(self.ctx, name, v))


class StepClock:
    """The step in progress on the training thread, and the hooks that time it. ``parts``, ``sampler``, ``ab``,
    ``compiler``, ``trace_capture`` and the writer's appends are the recorder's, handed over as it starts."""

    def __init__(self, ctx, flags):
        self.ctx = ctx
        self.flags = flags         # per-step state shared with the DDP and pipelining hooks (parts.StepFlags)
        self.rank = -1
        self.append_span = None    # the writer's append for the spans table (set when the rank starts)
        self.append_step = None    # and for the steps table
        self.init_ns = 0
        self.step_start_ns = None  # start of the step in progress (None before the first forward)
        self.prev_step_end_ns = None
        self.run_delay_fd = None   # the training thread's /proc schedstat (None: not Linux, or no step started yet)
        self.run_delay_mark = None  # its run delay (ns) when the step in progress started
        self.fwd_depth = 0
        self.fwd_t0 = 0
        self.fwd_ev0 = None
        self.fwd_seen_in_step = False
        self.opt_t0 = 0
        self.opt_ev0 = None
        self.manual_steps = False
        self.opt_groups_pending = False   # a part said the optimizer step goes on (parts.py optimizer_step_pending)
        self.step_end_owed = False  # an engine's step call ends the step as it returns (end_held_step)
        # evaluation between steps (runtime.py's module docstring, "Evaluation")
        self.grad_enabled = None   # torch.is_grad_enabled, bound with the hooks (no import per call)
        self.is_compiling = None   # torch.compiler.is_compiling, bound with the hooks
        self.in_eval_call = False  # the top-level forward in progress is an evaluation forward
        self.eval_forwards = []    # the evaluation stretch in progress: [model id, start, end] per forward
        self.annot = {}            # dtprof.annotate's fields for the step in progress (cleared, never replaced)
        self.inferred = {}         # samples/tokens of the step in progress, from its root-module calls
        self.inferred_sources = {}  # what was inferred so far (the step_inputs meta row)
        self.last_inferred = {}    # the last detailed step's inferred samples/tokens (boundary-only steps repeat them)
        self.boundary = BoundarySteps(self)  # the boundary-only steps' ends (collectors/boundary.py)
        self.threads_cpu_step0 = None   # dtprof's threads' CPU seconds when step 0 ended (dtprof_threads_cpu)
        self.cuda = CudaTiming(ctx)          # CUDA events or host times (collectors/cuda_timing.py)
        self.peak_memory = PeakMemory(self.cuda)   # the steps' peak_mem_bytes (collectors/peak_memory.py)
        self.flops = FlopCounter(ctx)        # count_flops: step 1 under FlopCounterMode (collectors/flops.py)
        # the forward hooks' modules: global in step 0, then the roots (collectors/module_hooks.py)
        self.modules = ModuleHooks(ctx, self.fwd_pre_hook, self.fwd_hook, set())
        # the recorder's, handed over as it starts
        self.parts = Parts([], lambda where: None)
        self.sampler = None
        self.ab = None
        self.compiler = None
        self.trace_capture = None
        self.end_ddp_backward = None   # collective_hooks.ddp.end_backward (no lookup per step)

    active = on_ctx("active")
    disabled = on_ctx("disabled")
    step = on_ctx("step")
    detail = on_ctx("detail")
    last_progress_ns = on_ctx("last_progress_ns")
    fault_test = on_ctx("fault_test")

    def fwd_pre_hook(self, module, args, kwargs=None):
        """Global hook in step 0, then registered on the roots with ``with_kwargs`` (collectors/module_hooks.py)."""
        if self.is_compiling() or self.disabled:     # traced by Dynamo: nothing of dtprof's may enter a graph
            return None
        try:
            self.fwd_depth += 1
            if self.modules.global_hooks_on:
                self.modules.in_flight.append(id(module))
                if not self.compiler.watching and "torch._dynamo" in sys.modules:
                    self.compiler.watch()
            if self.fwd_depth == 1 and not self.flags.in_backward:
                t = now()
                grad = self.grad_enabled()
                if not grad and not self.fwd_seen_in_step and (self.step == 0 or id(module) in self.modules.trained):
                    if self.step == 0:
                        self.modules.note_root(module)     # a frozen model run before training is still a root
                    self.evaluation_forward(module, t)
                    return None
                self.in_eval_call = False
                if self.step == 0:
                    self.modules.note_root(module)
                    if grad:
                        self.modules.note_trained(module)
                if self.eval_forwards:
                    self.end_evaluation()
                if grad and not self.flags.pp_active:    # what the trained model consumes: not a frozen teacher's input
                    self.count_inputs(args, kwargs)   # (a pipeline's: begin_pipeline_step)
                if self.fault_test == "forward":
                    raise RuntimeError("injected fault (DTPROF_TEST_FAULT=forward)")
                self.training_forward_at(t)
                self.fwd_t0 = t
                self.fwd_ev0 = self.cuda.event() if self.cuda.on else None
                wrapped = self.modules.wrapped_handles.get(id(module))
                if wrapped and not self.modules.parked_hooks:
                    self.modules.park_hooks(wrapped)
        except Exception:
            self.ctx.fault("forward pre-hook")
        return None

    def training_forward_at(self, t: int) -> None:
        """A training forward (or a pipeline schedule's step) starts at ``t``: CUDA timing is decided on the first,
        the step's first one marks the step as seen, the first step starts here, and it is progress."""
        if self.cuda.on is None:
            self.cuda.decide()
        if not self.fwd_seen_in_step:
            self.fwd_seen_in_step = True
            if self.step_start_ns is None:
                self.step_start_ns = t
                self.run_delay_fd = _open_run_delay()
                self.run_delay_mark = _run_delay_ns(self.run_delay_fd)
        self.last_progress_ns = t

    def count_inputs(self, args, kwargs) -> None:
        """Samples/tokens of this top-level call, summed over the step (collectors/inputs.py)."""
        got = inputs.batch_counts(args, kwargs)
        if got is None:
            return
        for key, n in zip(("samples", "tokens"), got):
            if n is not None:
                self.inferred[key] = self.inferred.get(key, 0) + n
                if key not in self.inferred_sources:
                    self.inferred_sources[key] = inputs.SOURCE[key]
                    self.ctx.meta("step_inputs", dict(self.inferred_sources))

    def begin_forward(self, module, args) -> None:
        """The forward pre-hook for a call already under way when recording started (collectors/identity.py)."""
        if self.active:
            self.fwd_pre_hook(module, args)

    def evaluation_forward(self, module, t: int) -> None:
        """A forward without gradients before the step's first training forward: of the trained model, or in step
        0 of any model (which ones were evaluation is known once one trains: ``end_evaluation``)."""
        self.in_eval_call = True
        self.eval_forwards.append([id(module), t, t])    # its end: fwd_hook sets it
        self.last_progress_ns = t          # a long evaluation is progress, not a hang

    def end_evaluation(self) -> None:
        """Record the evaluation stretch in progress; the step in progress starts again at its end. In step 0 the
        stretch ends with the last forward of a model that then trained: the forwards after it (a frozen teacher
        before the first training forward) are the step's, and with none, there was no evaluation (a loop that
        never trains: the step starts at its first forward)."""
        self.boundary.steps_done()
        forwards, self.eval_forwards = self.eval_forwards, []
        t0 = forwards[0][1]
        calls = len(forwards)
        if self.step == 0:
            calls = max((i + 1 for i, (mid, _, _) in enumerate(forwards) if mid in self.modules.trained), default=0)
        t1 = forwards[calls - 1][2] if calls else t0
        if calls:   # from the previous step's end: the time between two steps is the evaluation's
            start = self.prev_step_end_ns if self.prev_step_end_ns is not None else t0
            self.ctx.span("evaluation", f"{calls} forward(s) without gradients", start, t1)
        self.step_start_ns = t1
        if self.run_delay_fd is None:      # an evaluation before step 0's first training forward
            self.run_delay_fd = _open_run_delay()
        self.run_delay_mark = _run_delay_ns(self.run_delay_fd)

    def fwd_hook(self, module, args, output):
        if self.is_compiling() or self.disabled:
            return None
        try:
            self.fwd_depth -= 1
            if self.modules.global_hooks_on and self.modules.in_flight:
                self.modules.in_flight.pop()
            if self.fwd_depth <= 0:
                self.fwd_depth = 0
                if self.in_eval_call:
                    self.in_eval_call = False
                    self.eval_forwards[-1][2] = now()
                elif not self.flags.in_backward and not self.flags.pp_active:
                    if self.fwd_ev0 is not None:
                        self.cuda.span("forward", self.fwd_ev0)
                    else:
                        self.append_span(span_row(self.rank, self.step, "forward", "forward", self.fwd_t0, now()))
                    if self.modules.parked_hooks:
                        self.modules.unpark_hooks()
        except Exception:
            self.ctx.fault("forward hook")
        return None

    def timed_backward(self, orig):
        rec, flags = self, self.flags

        def backward(*args, **kwargs):
            if rec.disabled or flags.in_backward:
                return orig(*args, **kwargs)
            try:
                t0 = now()
                ev0 = rec.cuda.event() if rec.cuda.on else None
                flags.ddp_last_issue_ns = None
                flags.ddp_next_bucket = 0
                if rec.parts.on_backward and args:
                    rec.parts.call(rec.parts.on_backward, args[0])
            except Exception:
                rec.ctx.fault("backward")
                return orig(*args, **kwargs)
            flags.in_backward = True
            try:
                return orig(*args, **kwargs)
            finally:
                flags.in_backward = False
                try:
                    t1 = now()
                    rec.last_progress_ns = t1
                    if not flags.pp_active:
                        if ev0 is not None:
                            rec.cuda.span("backward", ev0)
                        else:
                            rec.append_span(span_row(rec.rank, rec.step, "backward", "backward", t0, t1))
                    if flags.ddp_last_issue_ns is not None:   # DDP blocked at the end for its last buckets
                        rec.end_ddp_backward(t1)
                except Exception:
                    rec.ctx.fault("backward")

        backward.__wrapped__ = orig
        backward.__name__ = getattr(orig, "__name__", "backward")
        backward.__doc__ = getattr(orig, "__doc__", None)
        return backward

    def timed_next(self, orig):
        rec = self

        def __next__(it):
            if rec.disabled:
                return orig(it)
            t0 = now()
            try:
                return orig(it)
            finally:
                try:
                    rec.append_span(span_row(rec.rank, rec.step, "data_wait", "DataLoader.__next__", t0, now()))
                except Exception:
                    rec.ctx.fault("DataLoader.__next__")

        __next__.__wrapped__ = orig
        return __next__

    def opt_pre_hook(self, optimizer, args, kwargs):
        if self.disabled or self.ab.off or not self.detail or self.opt_groups_pending:
            return None      # (a later parameter group's step of one optimizer step keeps the first one's start)
        try:
            if self.parts.on_optimizer_pre_step:     # before the span starts: the parts' work is not the job's
                self.parts.call(self.parts.on_optimizer_pre_step, optimizer)
            self.opt_t0 = now()
            self.opt_ev0 = self.cuda.event() if self.cuda.on else None
        except Exception:
            self.ctx.fault("optimizer pre-hook")
        return None

    def opt_post_hook(self, optimizer, args, kwargs):
        # the full hook, behind collectors/boundary.py's: a boundary-only step comes here only when it has more to
        # do than its row (the context's flags read directly, the parts with nothing to do on it not called)
        ctx = self.ctx
        if ctx.disabled:
            return None
        try:
            parts = self.parts
            if parts.optimizer_step_pending and parts.pending(optimizer):
                self.opt_groups_pending = True    # the optimizer step is not over: its last group ends it
                if parts.on_optimizer_group:
                    parts.call(parts.on_optimizer_group, optimizer)
                return None
            self.opt_groups_pending = False
            if not ctx.detail:
                if parts.boundary_optimizer_step:     # before the step ends: ctx.step is still this step's
                    parts.call(parts.boundary_optimizer_step, optimizer)
                if self.optimizer_ends_step():
                    self.boundary.end_step(now())
                if self.ab.block:
                    self.ab.step_done()
                return None
            if parts.on_optimizer_step:
                parts.call(parts.on_optimizer_step, optimizer)
            if not self.ab.off:
                t = now()
                if self.opt_ev0 is not None:
                    self.cuda.span("optimizer", self.opt_ev0)
                else:
                    self.append_span(span_row(self.rank, self.step, "optimizer", "optimizer", self.opt_t0 or t, t))
                if self.optimizer_ends_step():
                    self.end_step(t)
            if self.ab.block:
                self.ab.step_done()
        except Exception:
            self.ctx.fault("optimizer post-hook")
        return None

    def optimizer_ends_step(self) -> bool:
        """Not once the program calls ``dtprof.step()``; inside an engine's step call (``ctx.hold_step_end``) the
        step ends as the call returns (``end_held_step``)."""
        self.step_end_owed = self.ctx.hold_step_end and not self.manual_steps
        return not (self.manual_steps or self.ctx.hold_step_end)

    def end_held_step(self) -> None:
        """An engine's step call returned (parts.py ``RankContext.end_held_step``): the step it owes ends now."""
        if self.step_end_owed and not (self.disabled or self.ab.off):
            self.step_end_owed = False
            self.end_step(now())

    def end_step(self, t: int) -> None:
        """Close the step in progress at host time ``t`` (main thread)."""
        self.boundary.steps_done()
        if not self.detail:
            self.boundary.end_step(t)
            return
        if self.eval_forwards:             # dtprof.step() right after an evaluation: the step starts at its end
            self.end_evaluation()
        if self.modules.parked_hooks and not self.flags.pp_active:   # a training forward raised: fwd_hook never ran
            self.modules.unpark_hooks()
        step = self.step
        start = self.step_start_ns if self.step_start_ns is not None else self.init_ns
        a, inferred = self.annot, self.inferred
        mark, self.run_delay_mark = self.run_delay_mark, _run_delay_ns(self.run_delay_fd)
        cpu_wait = self.run_delay_mark - mark if mark is not None and self.run_delay_mark is not None else None
        self.append_step(step_row(
            self.rank, step, start, t, self.peak_memory.read(), a.get("tokens", inferred.get("tokens")),
            a.get("samples", inferred.get("samples")), a.get("model_flops"),
            self.flops.finish(step) if self.flops.step is not None else None, cpu_wait))
        if step == 0:
            # the threads' CPU from here to exit is what they cost the steps after step 0 (start-up excluded)
            self.threads_cpu_step0 = own_threads_cpu_s()
            self.ctx.refresh_identity()           # the device and the process group are set up by now
            self.modules.record_model()
            self.hooks_to_roots()
        if a:
            a.clear()
        if inferred:
            self.inferred = {}
            self.last_inferred = inferred
        self.prev_step_end_ns = self.step_start_ns = t
        self.fwd_seen_in_step = False
        self.fwd_depth = 0
        self.step = step + 1
        self.last_progress_ns = t
        if self.trace_capture is not None:
            self.trace_step_end(step)
        if self.ctx.options.get("count_flops") and self.step == 1:
            self.flops.start()
        self.sampler.sample_next(step, t - start)
        self.parts_step_end(step, t, True)
        self.boundary.refresh()

    def parts_step_end(self, step: int, t: int, detailed: bool) -> None:
        parts = self.parts
        methods = parts.on_step_end if detailed else parts.boundary_step_end
        if methods:
            parts.call(methods, step, t, detailed)

    def trace_step_end(self, step: int) -> None:
        try:
            self.trace_capture.on_step_end(step)
            if self.trace_capture.done:      # its window is over (or had nothing to capture): no call per step
                self.trace_capture = None    # (the recorder keeps its own reference, to close it at exit)
        except Exception:
            self.ctx.event("warning", "trace capture failed: " + _last_error_line())

    def begin_pipeline_step(self, args) -> None:
        """A pipeline schedule's ``step(*args)`` starts (hooks_collectives): its micro-batches' forwards are timed
        by the stage's own chunk spans, so after step 0 (which finds the roots) the root modules' hooks are taken out
        of their modules for the schedule's step: each micro-batch's call would put the stage module on nn.Module's
        slow path for nothing (~80 Python lines each). What those hooks do once a step happens here instead, and
        the samples and tokens are counted once, from the batch the schedule is given (the first stage's: a later
        stage is called with what the stage before it sent, which is not more samples)."""
        t = now()
        if self.eval_forwards:
            self.end_evaluation()
        if args:
            self.count_inputs(args, None)
        self.training_forward_at(t)
        if self.modules.roots is not None and not self.modules.parked_hooks:
            self.modules.park_hooks(self.modules.module_handles)

    def end_pipeline_step(self) -> None:
        """The outermost pipeline schedule's ``step()`` returned: the root modules' hooks go back."""
        if self.modules.parked_hooks:
            self.modules.unpark_hooks()

    def hooks_to_roots(self) -> None:
        """The global module hooks move to the roots (step 0's end, or a compile starting)."""
        depth = self.modules.to_roots()
        if depth is not None:
            self.fwd_depth = depth

    def forget_forwards(self) -> None:
        """The detail was switched on: what the hooks knew of the step in progress is stale."""
        self.fwd_seen_in_step, self.fwd_depth, self.in_eval_call, self.eval_forwards = False, 0, False, []
        self.run_delay_mark = _run_delay_ns(self.run_delay_fd)
        self.inferred = {}

    def restart_step(self) -> None:
        """The next recorded step starts now: after an A/B block with the hooks out (collectors/ab.py)."""
        self.boundary.steps_done()
        self.step_start_ns = now()
        self.forget_forwards()
        self.annot.clear()


def _open_run_delay() -> int | None:
    """The calling (training) thread's scheduler statistics, opened once: reading them costs ~1 µs a step."""
    try:
        return os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    except OSError:                 # not Linux, or a kernel without schedstat
        return None


def _run_delay_ns(fd: int | None) -> int | None:
    """The thread's run delay so far: ns it was runnable but waiting for a CPU (schedstat's second field); None
    without the file, or once the thread that opened it has ended."""
    try:
        return int(os.pread(fd, 64, 0).split()[1]) if fd is not None else None
    except OSError:
        return None


def own_threads_cpu_s() -> dict:
    """CPU seconds each of dtprof's own threads (``dtprof-*``: flusher, heartbeat) has used so far, read from the
    thread's own CPU clock (nanosecond resolution; /proc's utime/stime count 10 ms ticks)."""
    import threading

    out = {}
    for t in threading.enumerate():
        if t.name.startswith("dtprof") and t.ident is not None:
            try:
                out[t.name] = time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident)) / 1e9
            except OSError:                       # the thread just ended
                pass
    return out
