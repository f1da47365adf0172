"""The rank runtime: what dtprof records inside one training process (docs/run-format.md, issue 2).

Public interface: ``init(out=None, **options) -> bool``, ``step()``, ``span(name)``,
``annotate(**fields)``, ``install_from_env()`` and the module-level ``STATE``.

How it stays out of training's way
- One ``Recorder`` per rank, ``STATE``: it starts the recording (the writer, the hooks, the parts), runs the flusher
  and the exit, switches the detail and owns the objects that do the rest, each one concern in its own module and
  none holding the recorder. What they may know and do is the rank's ``RankContext`` (collectors/parts.py: rank,
  step, detail, the ``active``/``disabled`` flags, ``add(row)``, ``fault(where)``, ...), where those flags live;
  the per-step state the step clock shares with the DDP and pipelining hooks is a ``StepFlags``:
  - the step clock (stepclock.py ``StepClock``): steps, forward/backward/optimizer/data-wait/evaluation spans, with
    CUDA-event timing (cuda_timing.py), FLOP counting (flops.py) and the forward hooks' modules (module_hooks.py);
  - sampling (sampling.py ``Sampler``): which steps are recorded in full detail;
  - torch.compile (compile_watch.py ``CompileWatch``): Dynamo never traces dtprof;
  - the A/B blocks of benchmarks/overhead.py (ab.py ``AbBlocks``);
  - collectives: c10d's functions (hooks_collectives.py ``CollectiveHooks``), DDP's buckets (hooks_ddp.py),
    pipelining (hooks_pipelining.py), functional collectives (hooks_functional.py) and DeviceMesh (mesh.py), all
    writing through one ``CollectiveRows`` (collective_rows.py);
  - the heartbeat (heartbeat.py), the trace capture (trace_capture.py), and the parts of PART_FACTORIES
    (parts.py: a new rank-side concern is a part).
  None of them imports this module or keeps state in module globals. The hot path only reads a few attributes and
  appends rows (collectors/records.py, plain tuples built by functions generated from the schema) to the
  ``RankWriter``'s in-memory lists. All file I/O, CUDA event resolution and clock readings happen in one daemon
  flusher thread (every ``flush_interval_s``, default 1 s) and at exit (atexit).
- Every hook body runs under try/except. A fault records an ``events`` error row (the traceback's last line),
  sets ``STATE.disabled`` (every hook becomes a pass-through) and never raises into training.

Steps (the ``steps`` table)
- A step ends at every ``torch.optim`` optimizer step (global step post-hook) or at ``dtprof.step()``; an engine
  that steps the torch optimizer once per parameter group takes them as one (a part says the step goes on), and an
  engine's own step call ends it as it returns (a part holds the end: ``RankContext.hold_step_end``): DeepSpeed,
  collectors/engine_deepspeed.py.
  Rule against double counting: once the program calls ``dtprof.step()``, optimizer steps no longer end steps;
  a ``dtprof.step()`` that directly follows an optimizer-ended step (no forward in between) only switches the
  mode and does not add an empty step. Loops with several optimizers per iteration should call ``dtprof.step()``.
- A step starts where the previous one ended; step 0 starts at the rank's first top-level forward.
- Evaluation: top-level forwards of the trained model (a root module of step 0 whose forward ran with gradients,
  or the module it wraps; in step 0, any model) without gradients (``torch.no_grad``/``inference_mode``), before
  the step's first training forward, form an evaluation stretch (Lightning's validation loop, the Hugging Face Trainer's
  ``evaluate``, an Accelerate loop's eval pass). It is recorded as one ``evaluation`` span from the previous step's
  end (before step 0: the first such forward's start) to the last such forward's end, its inputs are not counted,
  and the step in progress starts again at its end: the stretch lies between steps, outside every step window, so
  step times, throughput and MFU are the training's, and every instant from step 0's start to the last step's end
  is in a step or in an evaluation.
  Not evaluation: after step 0, a model other than the trained one run without gradients (a distillation
  teacher, a frozen encoder), and forwards without gradients after the step's first training forward. What a
  framework does after the last evaluation forward (Lightning's epoch-end metric sync, callbacks) falls in the
  next step, among what happens between steps.
- ``peak_mem_bytes``: on CUDA ``torch.cuda.max_memory_allocated()`` (reset after each step); on CPU the process's
  resident-set high-water mark ``getrusage(RUSAGE_SELF).ru_maxrss`` (monotone over the process lifetime: it
  cannot be reset cheaply), read at most every 50 ms: a step that ends sooner after the last reading repeats it.

Spans (the ``spans`` table; kinds in dtprof.rundir.schema.SPAN_KINDS)
- ``forward``: first top-level module forward pre-hook to its forward hook (global module hooks, nesting depth
  tracked so only the outermost call counts); ``backward``: the duration of ``torch.autograd.backward`` /
  ``Tensor.backward``; ``optimizer``: optimizer step pre- to post-hook; ``data_wait``: the time in
  the DataLoader iterator's ``__next__`` (what a framework does between steps, such as logging collectives, is not
  data wait). Inside a pipeline schedule these are replaced by ``pp_forward``/``pp_backward``
  (hooks_pipelining.py). On CUDA, forward/backward/optimizer are timed with CUDA events recorded at the same
  points and converted to host ns through an anchor event (source "cuda_event"); on CPU they are host times
  (source "hook").
- ``flops_count``: with ``count_flops``, step 1 (the second) runs under ``FlopCounterMode`` and its
  ``executed_flops`` is written; that step is slower and the span marks it.

A/B blocks (for measuring dtprof's cost, benchmarks/overhead.py; not a user option): collectors/ab.py.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import TYPE_CHECKING

from dtprof.collectors.ab import AbBlocks
from dtprof.collectors.compile_watch import CompileWatch
from dtprof.collectors.parts import Parts, RankContext, StepFlags
from dtprof.collectors.records import Clock, Event, Meta, span_row
from dtprof.collectors.sampling import Sampler
from dtprof.collectors.stepclock import StepClock, on_ctx, own_threads_cpu_s

if TYPE_CHECKING:     # imported when the Recorder starts (torch.distributed is not imported before)
    from dtprof.collectors.heartbeat import Heartbeat
    from dtprof.collectors.hooks_collectives import CollectiveHooks
    from dtprof.collectors.hooks_functional import FunctionalHooks

now = time.monotonic_ns
_OPTIONS_DEFAULT = {"trace_steps": None, "count_flops": False, "hang_timeout_s": None, "flush_interval_s": 1.0,
                    "full_detail": False, "sample_every": None}
_ANNOTATABLE = ("tokens", "samples", "model_flops", "stage", "microbatch")


def _last_error_line() -> str:
    return traceback.format_exc().strip().splitlines()[-1]


class Recorder:
    """One rank's recording: its start, writer, flusher and exit, and the objects it owns (module docstring).
    ``STATE`` is the only instance.

    The heartbeat reads ``rank``, ``step``, ``collective`` (the blocking collective the main thread is in: its row,
    or the row's columns up to ``issue_ns``, and when it entered; else None) and ``last_progress_ns`` from the
    rank's ``RankContext``; the recorder names them too, with ``active``, ``disabled`` and ``rank_dir``."""

    def __init__(self):
        self.rank = -1
        self.rank_dir = None
        self.host = socket.gethostname()
        self.options = {}
        # what the hook objects and parts may know and do (collectors/parts.py): the flags above are kept there
        self.ctx = ctx = RankContext(self.rank, self.host, self.rank_dir, self.options, self.add, self.fault,
                                     self.event, self.meta)
        ctx.extend, ctx.span, ctx.refresh_identity = self.extend, self.span, self.refresh_identity
        self.flags = StepFlags()   # per-step state shared with the DDP and pipelining hooks
        self.writer = None         # the RankWriter (None until init)
        self.append_span = None    # the writer's append for the spans table
        self.append_collective = None   # and for the collectives table (a synchronous collective's row)
        self.append_step = None    # and for the steps table
        self.identity_new = None   # a fresh rank.json dict computed on the main thread, written by the flusher
        self.trace_capture = None
        # ---- the step in progress and its hooks (collectors/stepclock.py) ----
        self.clock = clock = StepClock(ctx, self.flags)
        ctx.roots = lambda: list(clock.modules.roots or ())
        ctx.end_held_step = clock.end_held_step   # an engine's step call returned (collectors/engine_deepspeed.py)
        # torch.compile: Dynamo never traces dtprof (collectors/compile_watch.py)
        self.compiler = clock.compiler = CompileWatch(ctx, self.on_compile_start, clock.fwd_pre_hook, clock.fwd_hook,
                                                      clock.modules.compiled_roots)
        self.sampler = clock.sampler = Sampler(ctx, self.set_detail)   # full detail or not (collectors/sampling.py)
        self.ab = clock.ab = AbBlocks(self.switch_path_hooks, clock.restart_step)   # benchmarks (collectors/ab.py)
        # ---- collectives (hooks_collectives.py, hooks_functional.py) ----
        self.collective_hooks: CollectiveHooks | None = None     # made at start
        self.functional_hooks: FunctionalHooks | None = None     # and DeviceMesh's hooks, made at start
        self.heartbeat: Heartbeat | None = None
        self.final_flushed = False            # ray_exit.final_flush ran (a Ray worker, flushed before Ray kills it)
        # ---- installed hooks ----
        self.hook_handles = []     # optimizer hooks: the post-hook (every step's boundary)
        self.post_hook = None      # the registered post-hook (collectors/boundary.py), opt_post_hook behind it
        self.opt_pre_handle = None  # the pre-hook (the optimizer span's start): only while steps are detailed
        self.waiter = None         # identity's waiter while this process does not know its rank yet
        self.orig_backward = None
        self.orig_next = None      # torch.utils.data's _BaseDataLoaderIter.__next__
        # ---- rank-side parts (collectors/parts.py): made at start ----
        self.parts = Parts([], self.part_fault)

    # The rank's flags live in its RankContext, where the hook objects read them; these name them on the Recorder
    # too (the heartbeat, raytrain.py, the tests and the benchmarks read them here).
    active = on_ctx("active")
    disabled = on_ctx("disabled")
    step = on_ctx("step")
    detail = on_ctx("detail")
    collective = on_ctx("collective")
    last_progress_ns = on_ctx("last_progress_ns")
    fault_test = on_ctx("fault_test")

    # ---- rows ----------------------------------------------------------------------------------------------

    def add(self, row) -> None:
        """Append one typed row (collectors/records.py) to its table."""
        self.writer.append(row.table, row)

    def extend(self, table: str, rows: list) -> None:
        """Append several rows (plain tuples) to one table."""
        self.writer.extend(table, rows)

    def fault(self, where: str) -> None:
        """Disable dtprof on this rank after a fault of its own: a ``fault`` meta row (the fact) and an events
        error row (the message the report lists; before the rank has a writer, in this process's own events
        file). Nothing is printed into the job's output: the launcher names the fault once, at the end.
        Never raises."""
        try:
            from dtprof.rundir.writer import FAULT_EVENT, process_event

            self.disabled = True
            error = _last_error_line()
            if self.writer is not None:
                self.meta("fault", {"where": where, "error": error})
                self.add(Event(self.rank, self.host, now(), "error", "rank",
                               f"{FAULT_EVENT} on this rank after a fault in {where}: {error}"))
            elif os.environ.get("DTPROF_NODE_DIR"):
                process_event(os.environ["DTPROF_NODE_DIR"], self.host, "error",
                              f"{FAULT_EVENT} in pid {os.getpid()} after a fault in {where}: {error}")
        except BaseException:
            pass

    def event(self, level: str, message: str) -> None:
        if self.writer is not None:
            self.add(Event(self.rank, self.host, now(), level, "rank", message))

    def meta(self, kind: str, value: dict) -> None:
        """One structured fact (the ``meta`` table; kinds and keys in dtprof.rundir.schema.META_KINDS). The value is
        stored as JSON text, the run format's form of a json column."""
        self.add(Meta(self.rank, self.host, now(), kind, json.dumps(value, separators=(",", ":"))))

    def trace_window(self, steps: list, start_ns: int, end_ns: int) -> None:
        """The --trace-steps capture disturbed this rank from ``start_ns`` (profiler start) to ``end_ns`` (stop
        and export done), overlapping ``steps``."""
        self.meta("trace_capture", {"steps": steps, "start_ns": start_ns, "end_ns": end_ns})

    def span(self, kind, name, t0, t1, stage=None, microbatch=None, lane="main", source="hook", step=None):
        # into the spans list's own append: this runs several times per step
        self.append_span(span_row(self.rank, self.step if step is None else step, kind, name, t0, t1, stage,
                                  microbatch, lane, source))

    def clock_row(self) -> None:
        self.add(Clock(self.rank, self.host, time.monotonic_ns(), time.time_ns()))

    # ---- identity ------------------------------------------------------------------------------------------

    def rank_json(self) -> dict:
        from dtprof.collectors import identity

        return identity.rank_identity(self.rank, self.host, self.rank_dir, self.options)

    def refresh_identity(self) -> None:
        """Recompute rank.json on the calling (main) thread, e.g. after init_process_group; the flusher writes
        it."""
        self.identity_new = self.rank_json()

    # ---- start-up ------------------------------------------------------------------------------------------

    def start(self, rank: int, rdir: str, node_dir, opts: dict) -> None:
        from dtprof.collectors import hooks_collectives, hooks_functional
        from dtprof.rundir.writer import RankWriter

        ctx = self.ctx
        self.rank, self.rank_dir, self.options = ctx.rank, ctx.rank_dir, ctx.options = rank, rdir, opts
        where, _, only_rank = os.environ.get("DTPROF_TEST_FAULT", "").partition("@")
        self.fault_test = where if (not only_rank or int(only_rank) == rank) else ""
        self.writer = RankWriter(node_dir, rank)
        self.append_span = ctx.append_span = self.writer.appender("spans")
        self.append_collective = ctx.append_collective = self.writer.appender("collectives")
        self.append_step = self.writer.appender("steps")
        clock = self.clock
        self.last_progress_ns = clock.init_ns = now()
        clock.rank, clock.append_span, clock.append_step = rank, self.append_span, self.append_step
        self.writer.write_identity(self.rank_json())
        self.clock_row()
        self.ab.block = self.sampler.ab_block = int(os.environ.get("DTPROF_AB_BLOCK_STEPS") or 0)
        self.sampler.writer = self.writer
        self.install_train_hooks()
        hooks = self.collective_hooks = hooks_collectives.CollectiveHooks(
            ctx, self.flags, (clock.begin_pipeline_step, clock.end_pipeline_step))
        ctx.group = hooks.rows.group
        hooks.install()
        clock.end_ddp_backward = hooks.ddp.end_backward
        self.functional_hooks = hooks_functional.FunctionalHooks(ctx, hooks.rows)
        self.functional_hooks.install()     # hybrid hook-in: functional collectives, DeviceMesh
        self.start_parts(opts)
        self.active = True
        self.start_flusher(float(opts.get("flush_interval_s") or 1.0))
        self.start_companions(opts)

    def start_parts(self, opts) -> None:
        """The rank-side parts (collectors/parts.py), over a context that is not the recorder."""
        from dtprof.collectors.parts import make_parts

        self.parts = self.clock.parts = make_parts(opts, self.part_fault)
        self.parts.on_rebind = self.clock.boundary.refresh
        self.parts.install(self.ctx)

    def part_fault(self, where: str) -> None:
        """A part's own fault switches that part off (collectors/parts.py), not the rank's recording."""
        self.event("error", f"dtprof part {where} switched off after a fault: {_last_error_line()}")

    def start_companions(self, opts) -> None:
        """The heartbeat (triage) and the trace capture (--trace-steps)."""
        from dtprof.collectors.heartbeat import Heartbeat

        try:
            if self.heartbeat is None:
                self.heartbeat = Heartbeat(self.rank_dir, self.ctx)
                self.heartbeat.start()
        except Exception:
            self.event("warning", f"heartbeat did not start: {_last_error_line()}")
        sample = opts.get("kernel_sample") or {}   # dtprof run's default kernel sample: a GPU job's only
        if opts.get("trace_steps") or sample:
            try:
                from dtprof.collectors.trace_capture import TraceCapture

                a, b = str(opts.get("trace_steps") or sample["steps"]).split(":")
                self.trace_capture = self.clock.trace_capture = TraceCapture(
                    self.rank_dir, int(a), int(b), on_window=self.trace_window,
                    gpu_only=not opts.get("trace_steps") and sample.get("gpu_only"))
            except Exception:
                self.event("warning", f"trace capture unavailable: {_last_error_line()}")

    # ---- the flusher thread --------------------------------------------------------------------------------

    def flush_once(self) -> None:
        if self.writer is None:
            return
        if self.clock.cuda.on:
            self.clock.cuda.resolve()
        if self.collective_hooks is not None:
            self.collective_hooks.rows.expire_pending()
            self.collective_hooks.rows.resolve_gpu_durations()
        ident, self.identity_new = self.identity_new, None
        if ident is not None:
            self.writer.write_identity(ident)
        if self.parts.on_flush:
            self.parts.call(self.parts.on_flush)
        self.clock_row()
        self.writer.flush()

    def flush_loop(self, interval: float) -> None:
        while True:
            time.sleep(interval)
            try:
                self.flush_once()
            except Exception:
                self.fault("flusher")
                try:
                    self.writer.flush()
                except Exception:
                    return

    def at_exit(self) -> None:
        try:
            if self.trace_capture is not None:
                try:
                    self.trace_capture.close()
                except Exception:
                    self.event("warning", "trace capture close failed: " + _last_error_line())
            if self.clock.cuda.on:
                import torch

                torch.cuda.synchronize()      # at exit only: lets the last steps' CUDA-event spans resolve
            if self.clock.eval_forwards:         # an evaluation after the last step
                self.clock.end_evaluation()
            if self.collective_hooks is not None:
                self.collective_hooks.rows.expire_pending(all_=True)
                self.collective_hooks.rows.resolve_gpu_durations(final=True)
            self.meta("dtprof_threads_cpu", {"threads": own_threads_cpu_s(),
                                             "at_step0_end": self.clock.threads_cpu_step0,
                                             "steps": self.step})
            if self.parts.on_exit:
                self.parts.call(self.parts.on_exit)
            self.flush_once()
            self.writer.close()
        except BaseException:
            pass

    def on_sigterm(self, signum, frame) -> None:
        """torchrun stops the surviving workers with SIGTERM when one fails; Python's default action skips
        atexit. Flush what we have, then die of SIGTERM as the default action would."""
        import signal

        self.at_exit()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def start_flusher(self, interval: float) -> None:
        t = threading.Thread(target=self.flush_loop, args=(interval,), name="dtprof-flusher", daemon=True)
        t.start()
        atexit.register(self.at_exit)
        try:
            import signal

            if threading.current_thread() is threading.main_thread() and \
                    signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:   # never replace the program's own handler
                signal.signal(signal.SIGTERM, self.on_sigterm)
        except Exception:
            pass

    # ---- the step boundary only (sampling, collectors/sampling.py), and switching the detail -----------------

    def set_detail(self, on: bool) -> None:
        """Full detail (every hook in) or the step boundary only (the optimizer hooks) from the next step on."""
        if on == self.detail:
            return
        self.detail = on
        if self.parts.on_detail:
            self.parts.call(self.parts.on_detail, on)
        self.collective_hooks.set_wrappers(on)
        (self.install_path_hooks if on else self.remove_path_hooks)()
        if self.hook_handles:
            self.switch_opt_pre_hook(on)
        if on:
            self.clock.forget_forwards()

    def begin_forward(self, module, args) -> None:
        """The forward pre-hook for a call already under way when recording started (collectors/identity.py)."""
        self.clock.begin_forward(module, args)

    # ---- torch.compile (collectors/compile_watch.py) ------------------------------------------------------

    def on_compile_start(self, _args=None) -> None:
        """Dynamo is about to trace a frame: global module hooks would be traced into its graph and guarded on,
        and taking them out later would recompile it. They move to the roots now, once. A process still waiting to
        know its rank (collectors/identity.py) is identified now, as at its first forward, which this is."""
        try:
            if self.waiter is not None:
                waiter, self.waiter = self.waiter, None
                waiter.identify_now()
            if self.clock.modules.global_hooks_on and not self.disabled:
                self.clock.hooks_to_roots()
        except Exception:
            self.fault("compile start")

    def install_train_hooks(self) -> None:
        self.install_optimizer_hooks()
        self.install_path_hooks()

    def remove_train_hooks(self) -> None:
        """Take the step/span hooks out again (benchmarks/overhead.py alternates with and without them)."""
        self.remove_optimizer_hooks()
        self.remove_path_hooks()

    def install_optimizer_hooks(self) -> None:
        from torch.optim import optimizer as optim

        self.post_hook = self.clock.boundary.post_hook()     # the full hook, opt_post_hook, behind it
        self.hook_handles[:] = [optim.register_optimizer_step_post_hook(self.post_hook)]
        self.switch_opt_pre_hook(self.detail)

    def switch_opt_pre_hook(self, on: bool) -> None:
        """The optimizer pre-hook times the optimizer span of a detailed step; a boundary-only step does without
        its call."""
        from torch.optim import optimizer as optim

        if on and self.opt_pre_handle is None:
            self.opt_pre_handle = optim.register_optimizer_step_pre_hook(self.clock.opt_pre_hook)
        elif not on and self.opt_pre_handle is not None:
            self.opt_pre_handle.remove()
            self.opt_pre_handle = None

    def remove_optimizer_hooks(self) -> None:
        for h in self.hook_handles:
            h.remove()
        self.hook_handles.clear()
        self.switch_opt_pre_hook(False)

    def switch_path_hooks(self, on: bool) -> None:
        """Everything dtprof puts on the training thread's path but the optimizer hooks, in (on) or out: the
        forward, backward and DataLoader hooks, the collective and pipelining wrappers, ``Work.wait`` and the
        ``c10d::allreduce_`` kernel (CollectiveHooks.set_wrappers); while out, the wrappers off a step's path
        (DeviceMesh) pass through (``active`` is False). For measuring what they cost: the A/B blocks and
        benchmarks/overhead.py."""
        self.collective_hooks.set_wrappers(on)
        (self.install_path_hooks if on else self.remove_path_hooks)()
        self.active = on

    def install_path_hooks(self) -> None:
        """The hooks on the training thread's path but the optimizer's: forward, backward, DataLoader batches."""
        import torch
        from torch.utils.data import dataloader

        clock = self.clock
        clock.grad_enabled = torch.is_grad_enabled
        clock.is_compiling = torch.compiler.is_compiling
        depth = clock.modules.install()
        if depth is not None:
            clock.fwd_depth = depth
        # Tensor.backward calls torch.autograd.backward (looked up at each call): one wrapper times both
        self.orig_backward = torch.autograd.backward
        torch.autograd.backward = clock.timed_backward(self.orig_backward)
        self.orig_next = dataloader._BaseDataLoaderIter.__next__
        dataloader._BaseDataLoaderIter.__next__ = clock.timed_next(self.orig_next)

    def remove_path_hooks(self) -> None:
        import torch

        self.clock.modules.remove()
        if self.orig_backward is not None:
            torch.autograd.backward = self.orig_backward
        if self.orig_next is not None:
            from torch.utils.data import dataloader

            dataloader._BaseDataLoaderIter.__next__ = self.orig_next


# The heartbeat's SIGTERM fallback treats this handler as the default action: it must still kill a rank stuck in C++.
Recorder.on_sigterm.dtprof_default_action = True  # type: ignore[attr-defined]
STATE = Recorder()


# ---------------------------------------------------------------------------------------------------------------
# Identity and start-up

def _is_torchrun_launcher() -> bool:
    """True in the torchrun launcher process. ``import torch`` happens there while runpy is still locating
    ``-m torch.distributed.run`` (sys.argv[0] is "-m" then), so the original command line is what tells."""
    argv = list(getattr(sys, "orig_argv", None) or sys.argv)
    scripts = [a for a in (sys.argv[:1] + argv[:2]) if a]
    if any(os.path.basename(a).startswith("torchrun") for a in scripts):
        return True
    for i, a in enumerate(argv[:-1]):
        if a == "-m" and argv[i + 1] in ("torch.distributed.run", "torch.distributed.launch"):
            return True
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name in ("torch.distributed.run", "torch.distributed.launch"):
        return True
    for a in sys.argv[:1]:
        if a.replace(os.sep, "/").endswith(("torch/distributed/run.py", "torch/distributed/launch.py")):
            return True
    return False


def _rank_dir_owner(rank_dir) -> int | None:
    """One process per rank directory: the pid of another live process that records this rank, else None (the
    directory is then claimed for this process). A process gone meanwhile (an elastic restart) is taken over."""
    owner = os.path.join(rank_dir, ".owner")
    try:
        with open(owner) as f:
            pid = int(f.read().strip() or 0)
        if pid and pid != os.getpid():
            os.kill(pid, 0)        # raises if that process is gone
            return pid
    except (FileNotFoundError, ValueError, ProcessLookupError):
        pass
    except PermissionError:        # alive, another user's
        return pid
    with open(owner, "w") as f:
        f.write(str(os.getpid()))
    return None


def install_from_env() -> bool:
    """Called by the injected sitecustomize once torch is imported: profile this process if it is a rank."""
    if STATE.active or not os.environ.get("DTPROF_NODE_DIR"):
        return STATE.active
    from dtprof.collectors import identity

    if "LOCAL_RANK" not in os.environ and identity.launcher_rank() is None and _is_torchrun_launcher():
        return False
    STATE.compiler.patch()
    if identity.launcher_rank() is not None:
        if init(report_taken=False) or STATE.disabled:
            return STATE.active
        # Another process records this RANK: this one inherited it (a DataLoader worker, a helper subprocess) and
        # is named as unidentified only if it trains (collectors/identity.py).
        STATE.waiter = identity.wait_for_identity(lambda rank: init(rank=rank), STATE)
        return False
    return init()               # no launcher named this process: recording starts once it identifies itself


def init(out=None, *, rank: int | None = None, report_taken: bool = True, node_dir=None, **options) -> bool:
    """Start recording this rank. ``out``: a run directory for jobs not started by `dtprof run` (each process then
    gets its own node directory in it); default: ``DTPROF_NODE_DIR``. ``rank``: default the process group's rank,
    else ``RANK``; with neither (srun, mp.spawn, Lightning's launcher before init_process_group) recording starts
    when this process identifies itself (collectors/identity.py) and True is returned now. ``report_taken``: when
    another live process records that rank, name this one in the run as unidentified (collectors/identity.py).
    ``node_dir``: an existing node directory to record into (collectors/raytrain.py makes one per Ray Train
    worker). Options override ``DTPROF_CONFIG``. Returns True when recording."""
    if STATE.active or STATE.ab.off:       # recording (an A/B "off" block is recording too)
        return True
    if STATE.disabled:
        return False
    try:
        from dtprof.rundir.writer import create_node_dir, create_run_dir, rank_dir

        env = os.environ
        opts = dict(_OPTIONS_DEFAULT)
        if env.get("DTPROF_CONFIG"):
            opts.update(json.loads(env["DTPROF_CONFIG"]) or {})
        opts.update(options)
        if out is not None:
            # The ranks of one job share the run directory (same join id); anything else there is refused.
            join_id = env.get("TORCHELASTIC_RUN_ID") or (
                f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}" if env.get("MASTER_ADDR") and env.get("MASTER_PORT")
                else None)
            run_dir = create_run_dir(out, {"created_by": "dtprof.init"}, join_id=join_id)
            node_dir = create_node_dir(run_dir)
        elif node_dir is not None:
            pass
        elif env.get("DTPROF_NODE_DIR"):
            node_dir = env["DTPROF_NODE_DIR"]
        else:
            return False
        from dtprof.collectors import identity

        if rank is None:
            pg = identity.process_group_rank()
            rank = pg[0] if pg else identity.launcher_rank(env)
            if rank is None:
                STATE.waiter = identity.wait_for_identity(
                    lambda r: init(out, rank=r, report_taken=report_taken, node_dir=node_dir, **options), STATE)
                return True
        rdir = rank_dir(node_dir, rank)
        os.makedirs(rdir, exist_ok=True)
        owner = _rank_dir_owner(str(rdir))
        if owner is not None:
            if report_taken:
                identity.report_unidentified(node_dir, rank, owner, STATE.host)
            return False
        STATE.start(rank, str(rdir), node_dir, opts)
        return True
    except BaseException:
        STATE.fault("init")
        STATE.active = False
        return False


# ---------------------------------------------------------------------------------------------------------------
# Public API for training code

def step() -> None:
    """End the current step now (for loops without torch.optim; see the double-counting rule above)."""
    rec = STATE
    if not rec.active or rec.disabled:
        return
    try:
        clock = rec.clock
        first_manual = not clock.manual_steps
        clock.manual_steps = True
        if first_manual:
            clock.boundary.refresh()     # optimizer steps no longer end steps: the boundary hook leaves them alone
        if first_manual and rec.step > 0 and not clock.fwd_seen_in_step:
            return                   # the optimizer hook just ended this step
        clock.end_step(now())
    except Exception:
        rec.fault("dtprof.step")


@contextmanager
def span(name: str):
    """Record a ``user`` span named ``name`` around the block (cheap no-op when not recording)."""
    rec = STATE
    if not rec.active or rec.disabled:
        yield
        return
    t0 = now()
    try:
        yield
    finally:
        try:
            annot = rec.clock.annot
            rec.span("user", str(name), t0, now(), stage=annot.get("stage"), microbatch=annot.get("microbatch"))
        except Exception:
            rec.fault("dtprof.span")


def annotate(**fields) -> None:
    """Attach facts to the step in progress: tokens=, samples=, model_flops= (steps table); stage=, microbatch=
    (put on the ``user`` spans that follow in this step)."""
    rec = STATE
    if not rec.active or rec.disabled:
        return
    try:
        for k, v in fields.items():
            if k not in _ANNOTATABLE:
                raise ValueError(f"dtprof.annotate: unknown field {k!r} (known: {', '.join(_ANNOTATABLE)})")
            rec.clock.annot[k] = None if v is None else int(v)
    except ValueError as e:
        rec.event("warning", str(e))
    except Exception:
        rec.fault("dtprof.annotate")
