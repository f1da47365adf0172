"""The rank runtime: what dtprof records inside one training process (docs/run-format.md, issue 2).

Public interface: ``init(out=None, **options) -> bool``, ``step()``, ``span(name)``,
``annotate(**fields)``, ``install_from_env()`` and the module-level ``STATE``.

How it stays out of training's way
- The rank's whole state is one ``Recorder`` object, ``STATE``; the hooks here are its methods. It owns the hook
  objects of hooks_collectives.py, hooks_functional.py and mesh.py and its heartbeat (heartbeat.py), which are given
  the Recorder when it makes them and read and set its attributes (they never import this module, and keep no state
  in module globals). The hot path only reads a few of its attributes and appends rows (collectors/records.py,
  plain tuples built by functions generated from the schema) to the ``RankWriter``'s in-memory lists.
  All file I/O, CUDA event resolution and clock readings happen in one daemon
  flusher thread (every ``flush_interval_s``, default 1 s) and at exit (atexit).
- Every hook body runs under try/except. A fault records an ``events`` error row (the traceback's last line),
  sets ``STATE.disabled`` (every hook becomes a pass-through) and never raises into training.

Steps (the ``steps`` table)
- A step ends at every ``torch.optim`` optimizer step (global step post-hook) or at ``dtprof.step()``.
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

Spans (the ``spans`` table; kinds in dtprof.schema.SPAN_KINDS)
- ``forward``: first top-level module forward pre-hook to its forward hook (global module hooks, nesting depth
  tracked so only the outermost call counts); ``backward``: the duration of ``torch.autograd.backward`` /
  ``Tensor.backward``; ``optimizer``: optimizer step pre- to post-hook; ``data_wait``: the time in
  the DataLoader iterator's ``__next__`` (what a framework does between steps, such as logging collectives, is not
  data wait). Inside a pipeline schedule these are replaced by ``pp_forward``/``pp_backward``
  (hooks_collectives.py). On CUDA, forward/backward/optimizer are timed with CUDA events recorded at the same
  points and converted to host ns through an anchor event (source "cuda_event"); on CPU they are host times
  (source "hook").
- ``flops_count``: with ``count_flops``, step 1 (the second) runs under ``FlopCounterMode`` and its
  ``executed_flops`` is written; that step is slower and the span marks it.

A/B blocks (for measuring dtprof's cost, benchmarks/overhead.py; not a user option)
- With ``DTPROF_AB_BLOCK_STEPS=K`` in the rank's environment, every K optimizer steps the rank switches its hooks on
  the training thread's path out or back in: the forward/backward/DataLoader hooks, the collective and pipelining
  wrappers, ``Work.wait`` and the ``c10d::allreduce_`` kernel (the optimizer hooks stay: they count the steps). Every
  rank switches after the same optimizer step, so the job's step K·i+1 .. K·(i+1) (counting from 1) runs with the
  hooks on for even i and off for odd i, and the job's own step times compare the two in one run. Steps run off are
  not recorded. The background threads run throughout: their cost is not in the difference.
"""
from __future__ import annotations

import atexit
import json
import os
import resource
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from operator import attrgetter
from typing import TYPE_CHECKING

from dtprof.collectors import inputs
from dtprof.collectors.parts import Parts, RankContext, StepFlags
from dtprof.collectors.records import Clock, Event, Meta, span_row, step_row
from dtprof.schema import DETAIL_BLOCK

if TYPE_CHECKING:     # imported when the Recorder starts (torch.distributed is not imported before)
    from dtprof.collectors.heartbeat import Heartbeat
    from dtprof.collectors.hooks_collectives import CollectiveHooks
    from dtprof.collectors.hooks_functional import FunctionalHooks

now = time.monotonic_ns
_OPTIONS_DEFAULT = {"trace_steps": None, "count_flops": False, "hang_timeout_s": None, "flush_interval_s": 1.0,
                    "full_detail": False, "sample_every": None}
# Step sampling (docs/cli-run.md, "Sampling")
SAMPLE_FROM = 32             # steps before this one are all in full detail (warm-up, compiles, the FLOP step)
SAMPLE_CALIBRATION = 32      # then this many steps alternate boundary-only and full-detail blocks
SAMPLE_BLOCK = DETAIL_BLOCK  # steps per full-detail block (4)
# dtprof's cost per step, as a fraction of the step, that the detail's sampling keeps under: half of the 1 % dtprof
# may cost, the other half left to what every step pays (the boundary's optimizer hooks, the flusher's rows)
SAMPLE_BUDGET = 0.005
# Steps this long are never sampled: their detail cost a GPU job 0.11-0.25 % of a 38 ms step (H200), and full
# detail is what a long step's user expects. On a CPU a compiled DDP job's ~72 ms step pays more, mostly torch's
# Python-kernel call per DDP bucket (benchmarks/c10d_kernel_cost.py; docs/validation.md)
SAMPLE_LONG_NS = 50_000_000
SAMPLE_MAX_PERIOD = 4096
# A calibration whose difference is within the steps' noise leaves steps this long in full detail (and calibrates
# again later); shorter steps are sampled with the detail priced at the noise: a detailed step's tens of µs of
# Python are a large share of them, and a busy machine's noise must not leave them all detailed
SAMPLE_NOISY_NS = 5_000_000
# The footprint: a rank's files may grow by about this much a day (issue: <= 50 MB a rank and day at 10 steps a
# second; the rest is the node's NVML and events files). Every FOOTPRINT_CHECK_STEPS steps, once at least
# FOOTPRINT_CHECK_S since the last check, a rank whose files grew faster samples its detail more sparsely; every
# step's boundary row is kept whatever it costs.
FOOTPRINT_BYTES_PER_DAY = 40_000_000
FOOTPRINT_CHECK_STEPS = 1024
FOOTPRINT_CHECK_S = 60
NS_PER_S = 1_000_000_000
RSS_READ_INTERVAL_NS = 50_000_000   # peak_mem_bytes on CPU: at most one getrusage per 50 ms
_ANNOTATABLE = ("tokens", "samples", "model_flops", "stage", "microbatch")


def _last_error_line() -> str:
    return traceback.format_exc().strip().splitlines()[-1]


class Recorder:
    """Everything dtprof knows and does inside one rank. ``STATE`` is the only instance.

    Heartbeat and watchdog read ``active``, ``disabled``, ``rank``, ``step``, ``collective`` (the blocking
    collective the main thread is in: its row, or the row's columns up to ``issue_ns``, and when it entered; else
    None), ``last_progress_ns`` and ``rank_dir``: plain attributes.
    The rest is bookkeeping of the main thread's step, kept here so that one object holds the rank's state."""

    def __init__(self):
        self.rank = -1
        self.rank_dir = None
        self.host = socket.gethostname()
        self.options = {}
        # what the hook objects and parts may know and do (collectors/parts.py): the flags above are kept there
        self.ctx = RankContext(self.rank, self.host, self.rank_dir, self.options, self.add, self.fault, self.event,
                               self.meta)
        self.ctx.extend, self.ctx.span, self.ctx.refresh_identity = self.extend, self.span, self.refresh_identity
        self.flags = StepFlags()   # per-step state shared with the DDP and pipelining hooks
        self.writer = None         # the RankWriter (None until init)
        self.append_span = None    # the writer's append for the spans table
        self.append_collective = None   # and for the collectives table (a synchronous collective's row)
        self.append_step = None    # and for the steps table
        # ---- per-step bookkeeping (main thread only) ----
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
        # evaluation between steps (module docstring, "Evaluation")
        self.grad_enabled = None   # torch.is_grad_enabled, bound with the hooks (no import per call)
        self.trained = set()       # ids of step 0's roots whose forward ran with gradients, and the modules they wrap
        self.in_eval_call = False  # the top-level forward in progress is an evaluation forward
        self.eval_forwards = []    # the evaluation stretch in progress: [model id, start, end] per forward
        self.annot = {}
        self.inferred = {}         # samples/tokens of the step in progress, from its root-module calls
        self.inferred_sources = {}  # what was inferred so far (the step_inputs meta row)
        self.parked_hooks = []     # (hooks dict, key, hook, first) of hooks out for now (park_hooks)
        self.end_ddp_backward = None   # collective_hooks.ddp.end_backward, bound at start (no lookup per step)
        self.trace_capture = None
        self.flop_mode = None
        self.flops_step = None
        self.identity_new = None   # a fresh rank.json dict computed on the main thread, written by the flusher
        self.threads_cpu_step0 = None   # dtprof's threads' CPU seconds when step 0 ended (dtprof_threads_cpu)
        self.rss_read_ns = -RSS_READ_INTERVAL_NS   # when peak_mem_bytes last read the RSS high-water mark (CPU)
        self.rss_peak = 0
        # ---- collectives (hooks_collectives.py, hooks_functional.py) ----
        self.collective_hooks: CollectiveHooks | None = None     # made at start
        self.functional_hooks: FunctionalHooks | None = None     # and DeviceMesh's hooks, made at start
        self.heartbeat: Heartbeat | None = None
        self.final_flushed = False            # ray_exit.final_flush ran (a Ray worker, flushed before Ray kills it)
        # ---- CUDA timing (decided at the first forward) ----
        self.cuda = None           # None undecided, False host timing, True CUDA events
        self.cuda_anchor = None    # (event, host_ns) recorded after one synchronize
        self.cuda_pending = []     # [((step, kind), start_event, end_event)] resolved by the flusher
        # ---- installed hooks ----
        self.hook_handles = []     # optimizer hooks: the post-hook (every step's boundary)
        self.opt_pre_handle = None  # the pre-hook (the optimizer span's start): only while steps are detailed
        self.module_handles = []   # forward hooks: global ones during step 0, then on the root modules only
        self.wrapped_handles = {}  # id(trained root) -> the handles of the hooks on the modules it wraps
        self.roots = None          # weakref.WeakSet of the modules seen at nesting depth 0 in step 0
        self.global_hooks_on = False   # the global module hooks are installed (step 0, until a compile starts)
        self.in_flight = []        # ids of the modules whose forward is under way, while the global hooks are on
        self.compile_watch = False  # Dynamo's compile-start callback is registered (on_compile_start)
        self.waiter = None         # identity's waiter while this process does not know its rank yet
        self.compiled_roots = set()  # ids of modules compiled with Module.compile(): timed by their call wrapper
        self.is_compiling = None   # torch.compiler.is_compiling, bound with the hooks
        self.flop_stance = None    # the force_eager stance of the FLOP-counting step (flops_start)
        self.orig_backward = None
        self.orig_next = None      # torch.utils.data's _BaseDataLoaderIter.__next__
        # ---- step sampling (docs/cli-run.md, "Sampling") ----
        self.sample_period = None  # None: undecided; 0: every step in detail; P: SAMPLE_BLOCK steps every P
        self.sample_times = []     # durations (ns) of steps 8..31: are steps long?
        self.calibration_from = SAMPLE_FROM   # the first step of the calibration in progress or last made
        self.calibration = []      # (in detail, duration ns) of the calibration's steps
        self.recalibrate_at = None  # the step at which a calibration that kept full detail is made again
        self.last_inferred = {}    # the last detailed step's inferred samples/tokens (boundary-only steps repeat them)
        self.footprint_mark = None  # (monotonic ns, the writer's bytes) at the last footprint check
        # ---- A/B blocks (module docstring) ----
        self.ab_block = 0          # switch the hooks off and on every this many optimizer steps (0: never)
        self.ab_steps = 0          # optimizer steps seen so far
        self.ab_off = False        # the hooks are out (an "off" block)
        # ---- rank-side parts (collectors/parts.py): made at start ----
        self.parts = Parts([], self.part_fault)

    # The rank's flags live in its RankContext, where the hook objects read them; these name them on the Recorder
    # too (the heartbeat, the watchdog's tests and the benchmarks read them here). attrgetter: a C-level read.
    active = property(attrgetter("ctx.active"), lambda self, v: setattr(self.ctx, "active", v))
    disabled = property(attrgetter("ctx.disabled"), lambda self, v: setattr(self.ctx, "disabled", v))
    step = property(attrgetter("ctx.step"), lambda self, v: setattr(self.ctx, "step", v))
    detail = property(attrgetter("ctx.detail"), lambda self, v: setattr(self.ctx, "detail", v))
    collective = property(attrgetter("ctx.collective"), lambda self, v: setattr(self.ctx, "collective", v))
    last_progress_ns = property(attrgetter("ctx.last_progress_ns"),
                                lambda self, v: setattr(self.ctx, "last_progress_ns", v))
    fault_test = property(attrgetter("ctx.fault_test"), lambda self, v: setattr(self.ctx, "fault_test", v))

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
            from dtprof.runformat import FAULT_EVENT, process_event

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
        """One structured fact (the ``meta`` table; kinds and keys in dtprof.schema.META_KINDS). The value is
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

    def identity(self) -> dict:
        import torch

        from dtprof.collectors import identity

        env = os.environ
        ident = {
            "rank": self.rank, "local_rank": identity.local_rank(env),
            "world_size": int(env.get("WORLD_SIZE", 1)),
            "node_rank": identity.node_rank(env),
            "host": self.host, "pid": os.getpid(), "node": os.path.basename(os.path.dirname(self.rank_dir)),
            "device_type": "cpu", "device_index": None, "device_name": "cpu", "device_uuid": "",
            "device_mem_total_bytes": None, "backend": "",
            "torch_version": torch.__version__, "python": sys.version.split()[0], "argv": sys.argv,
            "options": self.options,
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

    def refresh_identity(self) -> None:
        """Recompute rank.json on the calling (main) thread, e.g. after init_process_group; the flusher writes
        it."""
        self.identity_new = self.identity()

    # ---- start-up ------------------------------------------------------------------------------------------

    def start(self, rank: int, rdir: str, node_dir, opts: dict) -> None:
        from dtprof.collectors import hooks_collectives, hooks_functional
        from dtprof.runformat import RankWriter

        ctx = self.ctx
        self.rank, self.rank_dir, self.options = ctx.rank, ctx.rank_dir, ctx.options = rank, rdir, opts
        where, _, only_rank = os.environ.get("DTPROF_TEST_FAULT", "").partition("@")
        self.fault_test = where if (not only_rank or int(only_rank) == rank) else ""
        self.writer = RankWriter(node_dir, rank)
        self.append_span = ctx.append_span = self.writer.appender("spans")
        self.append_collective = ctx.append_collective = self.writer.appender("collectives")
        self.append_step = self.writer.appender("steps")
        self.init_ns = now()
        self.last_progress_ns = self.init_ns
        self.writer.write_identity(self.identity())
        self.clock_row()
        self.ab_block = int(os.environ.get("DTPROF_AB_BLOCK_STEPS") or 0)
        self.install_train_hooks()
        hooks = self.collective_hooks = hooks_collectives.CollectiveHooks(
            ctx, self.flags, (self.begin_pipeline_step, self.end_pipeline_step))
        ctx.group = hooks.rows.group
        hooks.install()
        self.end_ddp_backward = hooks.ddp.end_backward
        self.functional_hooks = hooks_functional.FunctionalHooks(ctx, hooks.rows)
        self.functional_hooks.install()     # hybrid hook-in: functional collectives, DeviceMesh
        self.start_parts(opts)
        self.active = True
        self.start_flusher(float(opts.get("flush_interval_s") or 1.0))
        self.start_companions(opts)

    def start_parts(self, opts) -> None:
        """The rank-side parts (collectors/parts.py), over a context that is not the recorder."""
        from dtprof.collectors.parts import make_parts

        self.parts = make_parts(opts, self.part_fault)
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
                self.trace_capture = TraceCapture(self.rank_dir, int(a), int(b), on_window=self.trace_window,
                                                  gpu_only=not opts.get("trace_steps") and sample.get("gpu_only"))
            except Exception:
                self.event("warning", f"trace capture unavailable: {_last_error_line()}")

    # ---- the flusher thread --------------------------------------------------------------------------------

    def flush_once(self) -> None:
        if self.writer is None:
            return
        if self.cuda:
            self.resolve_cuda_events()
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
            if self.cuda:
                import torch

                torch.cuda.synchronize()      # at exit only: lets the last steps' CUDA-event spans resolve
            if self.eval_forwards:         # an evaluation after the last step
                self.end_evaluation()
            if self.collective_hooks is not None:
                self.collective_hooks.rows.expire_pending(all_=True)
                self.collective_hooks.rows.resolve_gpu_durations(final=True)
            self.meta("dtprof_threads_cpu", {"threads": _own_threads_cpu_s(), "at_step0_end": self.threads_cpu_step0,
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

    # ---- CUDA event timing (recorded in hooks, resolved in the flusher, never synchronising training) ------

    def decide_cuda(self) -> None:
        import torch

        self.cuda = bool(torch.cuda.is_available() and torch.cuda.is_initialized())
        if self.cuda:
            torch.cuda.synchronize()          # once, before the first step: pairs a GPU event with a host time
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            ev.synchronize()
            self.cuda_anchor = (ev, now())

    @staticmethod
    def cuda_event():
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def resolve_cuda_events(self) -> None:
        """Turn finished event pairs into spans. The hot path only appends to ``cuda_pending``; this thread
        removes the prefix it looked at (list slice operations are atomic under the GIL)."""
        anchor, anchor_ns = self.cuda_anchor
        pending = self.cuda_pending
        n = len(pending)
        keep = []
        for item in pending[:n]:
            (step, kind), e0, e1 = item
            if e1.query() and e0.query():
                t0, t1 = (anchor_ns + int(anchor.elapsed_time(e) * 1e6) for e in (e0, e1))
                self.append_span(span_row(self.rank, step, kind, kind, t0, t1, lane="cuda", source="cuda_event"))
            else:
                keep.append(item)
        del pending[:n]
        pending[:0] = keep

    def cuda_span(self, kind, ev0) -> None:
        """A forward, backward or optimizer span whose device time comes from the CUDA event ``ev0`` and one
        recorded now (resolve_cuda_events); the hooks append a host-timed one themselves when ``ev0`` is None."""
        self.cuda_pending.append(((self.step, kind), ev0, self.cuda_event()))

    # ---- training hooks: module forward, backward, optimizer -----------------------------------------------

    def fwd_pre_hook(self, module, args, kwargs=None):
        """Global hook in step 0, then registered on the roots with ``with_kwargs`` (install_module_hooks)."""
        if self.is_compiling() or self.disabled:     # traced by Dynamo: nothing of dtprof's may enter a graph
            return None
        try:
            self.fwd_depth += 1
            if self.global_hooks_on:
                self.in_flight.append(id(module))
                if not self.compile_watch and "torch._dynamo" in sys.modules:
                    self.watch_compiles()
            if self.fwd_depth == 1 and not self.flags.in_backward:
                t = now()
                grad = self.grad_enabled()
                if not grad and not self.fwd_seen_in_step and (self.step == 0 or id(module) in self.trained):
                    if self.step == 0:
                        self.note_root(module)     # a frozen model run before training is still a root
                    self.evaluation_forward(module, t)
                    return None
                self.in_eval_call = False
                if self.step == 0:
                    self.note_root(module)
                    if grad:
                        self.note_trained(module)
                if self.eval_forwards:
                    self.end_evaluation()
                if grad and not self.flags.pp_active:    # what the trained model consumes: not a frozen teacher's input
                    self.count_inputs(args, kwargs)   # (a pipeline's: begin_pipeline_step)
                if self.fault_test == "forward":
                    raise RuntimeError("injected fault (DTPROF_TEST_FAULT=forward)")
                if self.cuda is None:
                    self.decide_cuda()
                if not self.fwd_seen_in_step:
                    self.fwd_seen_in_step = True
                    if self.step_start_ns is None:
                        self.step_start_ns = t
                        self.run_delay_fd = _open_run_delay()
                        self.run_delay_mark = _run_delay_ns(self.run_delay_fd)
                self.fwd_t0 = t
                self.fwd_ev0 = self.cuda_event() if self.cuda else None
                self.last_progress_ns = t
                wrapped = self.wrapped_handles.get(id(module))
                if wrapped and not self.parked_hooks:
                    self.park_hooks(wrapped)
        except Exception:
            self.fault("forward pre-hook")
        return None

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
                    self.meta("step_inputs", dict(self.inferred_sources))

    def begin_forward(self, module, args) -> None:
        """The forward pre-hook for a call already under way when recording started (collectors/identity.py)."""
        if self.active:
            self.fwd_pre_hook(module, args)

    def note_root(self, module) -> None:
        if self.roots is None:
            import weakref

            self.roots = weakref.WeakSet()
        self.roots.add(module)

    def note_trained(self, module) -> None:
        self.trained.update(id(m) for m in (module, *_wrapped_modules(module)))

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
        forwards, self.eval_forwards = self.eval_forwards, []
        t0 = forwards[0][1]
        calls = len(forwards)
        if self.step == 0:
            calls = max((i + 1 for i, (mid, _, _) in enumerate(forwards) if mid in self.trained), default=0)
        t1 = forwards[calls - 1][2] if calls else t0
        if calls:   # from the previous step's end: the time between two steps is the evaluation's
            start = self.prev_step_end_ns if self.prev_step_end_ns is not None else t0
            self.span("evaluation", f"{calls} forward(s) without gradients", start, t1)
        self.step_start_ns = t1
        if self.run_delay_fd is None:      # an evaluation before step 0's first training forward
            self.run_delay_fd = _open_run_delay()
        self.run_delay_mark = _run_delay_ns(self.run_delay_fd)

    def record_model(self) -> None:
        """A ``model`` meta row at the end of step 0: the parameters of the root modules (each parameter once; a
        DTensor counts its global shape, a plain shard its local one), part of what identifies a configuration
        (`dtprof compare`). Once per run; a model that cannot be counted is left out, never a fault."""
        try:
            roots = list(self.roots or ())
            if not roots:
                return
            params = {id(p): p for m in roots for p in m.parameters()}
            self.meta("model", {"parameters": int(sum(p.numel() for p in params.values())),
                                "modules": sorted({type(m).__name__ for m in roots})})
        except Exception:
            pass

    def fwd_hook(self, module, args, output):
        if self.is_compiling() or self.disabled:
            return None
        try:
            self.fwd_depth -= 1
            if self.global_hooks_on and self.in_flight:
                self.in_flight.pop()
            if self.fwd_depth <= 0:
                self.fwd_depth = 0
                if self.in_eval_call:
                    self.in_eval_call = False
                    self.eval_forwards[-1][2] = now()
                elif not self.flags.in_backward and not self.flags.pp_active:
                    if self.fwd_ev0 is not None:
                        self.cuda_span("forward", self.fwd_ev0)
                    else:
                        self.append_span(span_row(self.rank, self.step, "forward", "forward", self.fwd_t0, now()))
                    if self.parked_hooks:
                        self.unpark_hooks()
        except Exception:
            self.fault("forward hook")
        return None

    def timed_backward(self, orig):
        rec, flags = self, self.flags

        def backward(*args, **kwargs):
            if rec.disabled or flags.in_backward:
                return orig(*args, **kwargs)
            try:
                t0 = now()
                ev0 = rec.cuda_event() if rec.cuda else None
                flags.ddp_last_issue_ns = None
                flags.ddp_next_bucket = 0
                if rec.parts.on_backward and args:
                    rec.parts.call(rec.parts.on_backward, args[0])
            except Exception:
                rec.fault("backward")
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
                            rec.cuda_span("backward", ev0)
                        else:
                            rec.append_span(span_row(rec.rank, rec.step, "backward", "backward", t0, t1))
                    if flags.ddp_last_issue_ns is not None:   # DDP blocked at the end for its last buckets
                        rec.end_ddp_backward(t1)
                except Exception:
                    rec.fault("backward")

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
                    rec.fault("DataLoader.__next__")

        __next__.__wrapped__ = orig
        return __next__

    def opt_pre_hook(self, optimizer, args, kwargs):
        if self.disabled or self.ab_off or not self.detail:
            return None
        try:
            self.opt_t0 = now()
            self.opt_ev0 = self.cuda_event() if self.cuda else None
        except Exception:
            self.fault("optimizer pre-hook")
        return None

    def opt_post_hook(self, optimizer, args, kwargs):
        if self.disabled:
            return None
        try:
            if self.parts.on_optimizer_step:     # before the step ends: ctx.step is still this optimizer step's
                self.parts.call(self.parts.on_optimizer_step, optimizer)
            if not self.detail:
                if not self.manual_steps:
                    self.end_boundary_step(now())
            elif not self.ab_off:
                t = now()
                if self.opt_ev0 is not None:
                    self.cuda_span("optimizer", self.opt_ev0)
                else:
                    self.append_span(span_row(self.rank, self.step, "optimizer", "optimizer", self.opt_t0 or t, t))
                if not self.manual_steps:
                    self.end_step(t)
            if self.ab_block:
                self.ab_step_done()
        except Exception:
            self.fault("optimizer post-hook")
        return None

    def peak_mem_bytes(self):
        if self.cuda:
            import torch

            peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            return int(peak)
        # A system call that sums over all the process's threads (~10 us on the training thread of a busy 2-core
        # VM, timed in a tiny DDP step); the value only grows, so steps under RSS_READ_INTERVAL_NS apart reuse the
        # last reading.
        t = now()
        if t - self.rss_read_ns >= RSS_READ_INTERVAL_NS:
            self.rss_read_ns = t
            self.rss_peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024   # Linux reports KiB
        return self.rss_peak

    def end_step(self, t: int) -> None:
        """Close the step in progress at host time ``t`` (main thread)."""
        if not self.detail:
            self.end_boundary_step(t)
            return
        if self.eval_forwards:             # dtprof.step() right after an evaluation: the step starts at its end
            self.end_evaluation()
        if self.parked_hooks and not self.flags.pp_active:     # a training forward that raised: fwd_hook never ran
            self.unpark_hooks()
        step = self.step
        start = self.step_start_ns if self.step_start_ns is not None else self.init_ns
        a, inferred = self.annot, self.inferred
        mark, self.run_delay_mark = self.run_delay_mark, _run_delay_ns(self.run_delay_fd)
        cpu_wait = self.run_delay_mark - mark if mark is not None and self.run_delay_mark is not None else None
        self.append_step(step_row(
            self.rank, step, start, t, self.peak_mem_bytes(), a.get("tokens", inferred.get("tokens")),
            a.get("samples", inferred.get("samples")), a.get("model_flops"),
            self.flops_finish(step) if self.flops_step is not None else None, cpu_wait))
        if step == 0:
            # the threads' CPU from here to exit is what they cost the steps after step 0 (start-up excluded)
            self.threads_cpu_step0 = _own_threads_cpu_s()
            self.refresh_identity()           # the device and the process group are set up by now
            self.record_model()
            self.hooks_to_roots()
        if a:
            self.annot = {}
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
        if self.options.get("count_flops") and self.step == 1:
            self.flops_start()
        self.sample_next(step, t - start)
        self.parts_step_end(step, t, True)

    def parts_step_end(self, step: int, t: int, detailed: bool) -> None:
        if self.parts.on_step_end:
            self.parts.call(self.parts.on_step_end, step, t, detailed)

    def trace_step_end(self, step: int) -> None:
        try:
            self.trace_capture.on_step_end(step)
        except Exception:
            self.event("warning", "trace capture failed: " + _last_error_line())

    # ---- step sampling: full detail for blocks of steps, the step boundary for the others -------------------

    def end_boundary_step(self, t: int) -> None:
        """Close a boundary-only step: its times, the annotations, and the samples/tokens the last detailed step
        inferred (the same loader's batches); nothing else was recorded in it."""
        step, start, a, inferred = self.step, self.step_start_ns, self.annot, self.last_inferred
        if start is None:
            start = self.init_ns
        self.append_step(step_row(self.rank, step, start, t, None, a.get("tokens", inferred.get("tokens")),
                                  a.get("samples", inferred.get("samples")), a.get("model_flops"), None, None, 0))
        if a:
            self.annot = {}
        self.prev_step_end_ns = self.step_start_ns = t
        self.step = step + 1
        self.last_progress_ns = t
        if self.trace_capture is not None:
            self.trace_step_end(step)
        self.sample_next(step, t - start)
        self.parts_step_end(step, t, False)

    def sample_next(self, step: int, duration_ns: int) -> None:
        """After step ``step`` ended: is the next one in full detail? Steps before SAMPLE_FROM are. Steps of
        SAMPLE_LONG_NS or more are never sampled. Otherwise SAMPLE_CALIBRATION steps alternate boundary-only and
        detailed blocks; dtprof's cost of a detailed step is the difference of the two medians, and when it is over
        SAMPLE_BUDGET of the boundary-only step, detailed blocks of SAMPLE_BLOCK steps start every P steps (P a
        power of two, so ranks that measured different P still share the detailed steps of the largest). A
        calibration that found the cost under budget is repeated at twice its start step, then four times, ...
        (one noisy measurement does not decide a long job; every rank calibrates at the same steps)."""
        nxt = step + 1
        if nxt % FOOTPRINT_CHECK_STEPS == 0 and self.sample_period is not None:
            self.check_footprint(nxt)
        if self.sample_period == 0:
            if nxt != self.recalibrate_at:
                return
            self.sample_period, self.calibration_from, self.sample_times = None, nxt, []
            self.recalibrate_at = 2 * nxt
        elif self.sample_period is None:
            if nxt <= SAMPLE_FROM and step >= 8:      # the steps that tell a long step
                self.sample_times.append(duration_ns)
            elif nxt > self.calibration_from:
                self.calibration.append((self.detail, duration_ns))
        if self.sample_period is None:
            if nxt < SAMPLE_FROM:
                return
            if nxt == SAMPLE_FROM:
                if self.options.get("sample_every") and not self.ab_block:
                    self.decide_sampling(int(self.options["sample_every"]), "--sample-every")
                    self.set_detail(nxt % self.sample_period < SAMPLE_BLOCK)
                    return
                if self.ab_block or self.options.get("full_detail") or self.options.get("trace_steps"):
                    self.decide_sampling(0, "full detail asked for" if self.options.get("full_detail") else None)
                    return
                long = _median(self.sample_times)
                if long is not None and long >= SAMPLE_LONG_NS:
                    self.decide_sampling(0, None)
                    return
                self.recalibrate_at = 2 * (SAMPLE_FROM + SAMPLE_CALIBRATION)
            if nxt < self.calibration_from + SAMPLE_CALIBRATION:
                self.set_detail(((nxt - self.calibration_from) // SAMPLE_BLOCK) % 2 == 1)   # boundary-only first
                return
            self.decide_from_calibration()
            if self.sample_period == 0:
                self.set_detail(True)
                return
        if (nxt % self.sample_period < SAMPLE_BLOCK) != self.detail:     # most steps: no call
            self.set_detail(not self.detail)

    def decide_from_calibration(self) -> None:
        """The period from the calibration's alternating blocks (boundary-only first). A detailed step's own cost
        is the median detailed step less the median boundary-only step, each without its block's first step; a
        detailed block costs more than its steps: switching the detail on lands in its first step and switching
        it off in the next block's first (hooks and kernels installed and taken out, first calls), several
        detailed steps' worth on short steps. The period is chosen from the whole block's cost."""
        calib, self.calibration = self.calibration, []
        at = lambda detail, first: [d for i, (on, d) in enumerate(calib)   # noqa: E731
                                    if on == detail and (i % SAMPLE_BLOCK == 0) == first]
        on, off = at(True, False), at(False, False)
        base, on_first, off_first = _median(off), _median(at(True, True)), _median(at(False, True))
        if not base or _median(on) is None or on_first is None or off_first is None:
            self.decide_sampling(0, None)
            return
        cost, noise = max(0, _median(on) - base), max(_mad(on), _mad(off))
        if cost <= noise:      # within the steps' own spread (median absolute deviation): the machine's noise
            if base >= SAMPLE_NOISY_NS:
                self.decide_sampling(0, None, cost, base)     # full detail, calibrated again later
                return
            cost = noise       # a short step: priced at the noise (full detail could cost it tens of percent)
        if cost <= SAMPLE_BUDGET * base:
            self.decide_sampling(0, None, cost, base)
            return
        block = max(0, on_first - base) + (SAMPLE_BLOCK - 1) * cost + max(0, off_first - base)
        period = 2 * SAMPLE_BLOCK
        while block > SAMPLE_BUDGET * base * period and period < SAMPLE_MAX_PERIOD:
            period *= 2
        self.decide_sampling(period, None, cost, base, block)

    def check_footprint(self, nxt: int) -> None:
        """Over FOOTPRINT_BYTES_PER_DAY's rate since the last check, the detailed blocks start that many times
        more sparsely (a power of two, so ranks still share the detailed steps of the sparsest). Sampling the user
        chose (--full-detail, --sample-every, --trace-steps, A/B blocks) is left as it is."""
        if self.writer is None or self.ab_block or self.options.get("full_detail") \
                or self.options.get("sample_every") or self.options.get("trace_steps"):
            return
        t, written = now(), self.writer.bytes_written()
        if self.footprint_mark is None or t - self.footprint_mark[0] < FOOTPRINT_CHECK_S * NS_PER_S:
            self.footprint_mark = self.footprint_mark or (t, written)
            return
        (t0, b0), self.footprint_mark = self.footprint_mark, (t, written)
        rate, budget = (written - b0) * NS_PER_S / (t - t0), FOOTPRINT_BYTES_PER_DAY / 86_400
        period = max(self.sample_period or 0, SAMPLE_BLOCK)    # every step in detail: a block every block
        if rate <= budget or period >= SAMPLE_MAX_PERIOD:
            return
        while rate > budget and period < SAMPLE_MAX_PERIOD:     # the detail's bytes fall with its share of steps
            period, rate = 2 * period, rate / 2
        self.sample_period = period
        self.calibration_from = nxt
        self.meta("sampling", {
            "period": period, "block": SAMPLE_BLOCK, "from_step": nxt, "calibration": None, "detail_cost_ns": None,
            "block_cost_ns": None, "step_ns": None, "budget": SAMPLE_BUDGET,
            "reason": f"footprint: the rank's files grew {(written - b0) * NS_PER_S / (t - t0) / 1e3:.1f} kB/s, "
                      f"over the {budget / 1e3:.2f} kB/s ({FOOTPRINT_BYTES_PER_DAY / 1e6:.0f} MB a day) it keeps"})

    def decide_sampling(self, period: int, reason, cost_ns=None, step_ns=None, block_cost_ns=None) -> None:
        self.sample_period = period
        self.sample_times = []
        first = self.calibration_from
        start = first + (SAMPLE_CALIBRATION if cost_ns is not None else 0)
        self.meta("sampling", {
            "period": period, "block": SAMPLE_BLOCK, "from_step": start if period else None,
            "calibration": [first, first + SAMPLE_CALIBRATION] if cost_ns is not None else None,
            "detail_cost_ns": cost_ns, "block_cost_ns": block_cost_ns, "step_ns": step_ns, "budget": SAMPLE_BUDGET,
            "reason": reason})

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
            self.fwd_seen_in_step, self.fwd_depth, self.in_eval_call, self.eval_forwards = False, 0, False, []
            self.run_delay_mark = _run_delay_ns(self.run_delay_fd)
            self.inferred = {}

    def flops_start(self) -> None:
        """Run the next step (step 1) under FlopCounterMode."""
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        if "torch._dynamo" in sys.modules:
            # Under a dispatch mode Dynamo declines a frame and marks its code "skip" for the rest of the process:
            # the counted step runs eager (force_eager), so compiled code stays compiled afterwards.
            set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
            if set_stance is None:
                self.meta("flops_skipped", {"reason": "this torch has no torch.compiler.set_stance: counting FLOPs "
                                                      "in a compiled job would turn its compiled code eager"})
                return
            self.flop_stance = set_stance("force_eager")
        self.flop_mode = FlopCounterMode(display=False)
        self.flop_mode.__enter__()
        self.flops_step = (self.step, now())

    def flops_finish(self, step):
        if self.flop_mode is None or self.flops_step is None or self.flops_step[0] != step:
            return None
        mode, (s, t0) = self.flop_mode, self.flops_step
        self.flop_mode = self.flops_step = None
        mode.__exit__(None, None, None)
        if self.flop_stance is not None:
            stance, self.flop_stance = self.flop_stance, None
            stance.__exit__(None, None, None)
        self.span("flops_count", "FlopCounterMode", t0, now(), step=s)
        return int(mode.get_total_flops())

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
        if self.cuda is None:
            self.decide_cuda()
        if not self.fwd_seen_in_step:
            self.fwd_seen_in_step = True
            if self.step_start_ns is None:
                self.step_start_ns = t
                self.run_delay_fd = _open_run_delay()
                self.run_delay_mark = _run_delay_ns(self.run_delay_fd)
        self.last_progress_ns = t
        if self.roots is not None and not self.parked_hooks:
            self.park_hooks(self.module_handles)

    def end_pipeline_step(self) -> None:
        """The outermost pipeline schedule's ``step()`` returned: the root modules' hooks go back."""
        if self.parked_hooks:
            self.unpark_hooks()

    def park_hooks(self, handles) -> None:
        """Take these module hooks out of their modules until ``unpark_hooks``: a module with hooks takes
        nn.Module's slow path on every call. Out during a pipeline schedule's step (begin_pipeline_step), and the
        hooks of the modules a trained root wraps during its training forward, where they would only count depth
        (install_module_hooks)."""
        for h in handles:
            hooks = h.hooks_dict_ref()
            if hooks is not None and h.id in hooks:
                first = next(iter(hooks)) == h.id
                self.parked_hooks.append((hooks, h.id, hooks.pop(h.id), first))

    def unpark_hooks(self) -> None:
        """Put parked hooks back where they were (a pre-hook registered first goes first)."""
        parked, self.parked_hooks = self.parked_hooks, []
        for hooks, key, hook, first in parked:
            hooks[key] = hook
            if first:
                hooks.move_to_end(key, last=False)

    def install_module_hooks(self) -> None:
        """Global module hooks put every module call of the program on nn.Module's slow path (~4 us each,
        measured in benchmarks/overhead.py), so they are used only in step 0 to find the top-level modules; after
        that the forward hooks sit on those root modules alone. Forward spans after step 0 therefore come from the
        modules that were top-level in step 0 (a model first called later is not timed as ``forward``).
        Dynamo traces module hooks into its graphs and guards on the global ones, so they also leave for the roots
        as soon as Dynamo starts to compile (on_compile_start): no graph is ever traced with them."""
        from torch.nn.modules import module as nn_module

        if self.roots is None:
            self.module_handles[:] = [nn_module.register_module_forward_pre_hook(self.fwd_pre_hook),
                                      nn_module.register_module_forward_hook(self.fwd_hook)]
            self.global_hooks_on = True
        else:
            # the roots and, of the trained ones, the modules they wrap: a framework evaluates the unwrapped model
            # (the Hugging Face Trainer calls DDP's module directly); inside the wrapper's training forward their
            # hooks are parked (fwd_pre_hook), so the wrapped module's calls take nn.Module's fast path. A module
            # compiled with Module.compile() is timed by its call wrapper (wrap_compiled_call): hooks on it would
            # run inside its graph.
            handles: dict = {}
            self.wrapped_handles = {}
            for m in list(self.roots):
                wrapped = _wrapped_modules(m) if id(m) in self.trained else []
                for w in (m, *wrapped):
                    if id(w) not in handles and id(w) not in self.compiled_roots:
                        handles[id(w)] = [w.register_forward_pre_hook(self.fwd_pre_hook, prepend=True,
                                                                      with_kwargs=True),
                                          w.register_forward_hook(self.fwd_hook)]
                if wrapped:
                    self.wrapped_handles[id(m)] = [h for w in wrapped for h in handles.get(id(w), ())]
            self.module_handles[:] = [h for hs in handles.values() for h in hs]
            self.global_hooks_on = False
            # forwards under way when the global hooks left: only those with a hook of their own will call fwd_hook
            self.fwd_depth = sum(1 for mid in self.in_flight if mid in handles or mid in self.compiled_roots)
            self.in_flight = []

    def remove_module_hooks(self) -> None:
        for h in self.module_handles:
            h.remove()
        self.module_handles.clear()
        self.wrapped_handles = {}
        self.parked_hooks = []

    def hooks_to_roots(self) -> None:
        if not self.global_hooks_on:
            return
        if self.roots is None:             # a compile before any module ran: no root known yet
            import weakref

            self.roots = weakref.WeakSet()
        self.remove_module_hooks()         # the global ones (installed while roots was None)
        self.install_module_hooks()

    # ---- torch.compile: Dynamo must never trace dtprof (docs/cli-run.md, "Compiled models") ----------------

    def watch_compiles(self) -> None:
        """Have Dynamo call on_compile_start before it traces anything (torch._dynamo is imported by now: the
        program compiled something; importing it ourselves would cost every job ~1.5 s)."""
        self.compile_watch = True
        try:
            from torch._dynamo.callback import callback_handler

            callback_handler.register_start_callback(self.on_compile_start)
        except Exception:             # an older torch: the roots' hooks only move at step 0's end
            self.event("warning", f"Dynamo's compile callbacks are unavailable: {_last_error_line()}")
        _dynamo_skip_our_code()

    def on_compile_start(self, _args=None) -> None:
        """Dynamo is about to trace a frame: global module hooks would be traced into its graph and guarded on,
        and taking them out later would recompile it. They move to the roots now, once. A process still waiting to
        know its rank (collectors/identity.py) is identified now, as at its first forward, which this is."""
        try:
            if self.waiter is not None:
                waiter, self.waiter = self.waiter, None
                waiter.identify_now()
            if self.global_hooks_on and not self.disabled:
                self.hooks_to_roots()
        except Exception:
            self.fault("compile start")

    def patch_compile(self) -> None:
        """Before the program compiles anything (at ``import torch``): ``torch.compile`` and ``Module.compile``
        watch Dynamo's compiles (watch_compiles), and ``Module.compile()`` (which compiles the module's own
        ``_call_impl``, its hooks included) has the module's forward timed by a wrapper around that compiled call,
        which nn.Module calls outside the graph (wrap_compiled_call)."""
        import warnings

        import torch

        # torch warns at each call of a torch.compile(module) while global module hooks exist: ours, in step 0
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        rec = self
        orig_compile, orig_module_compile = torch.compile, torch.nn.Module.compile

        def compile(*args, **kwargs):
            out = orig_compile(*args, **kwargs)
            if not rec.compile_watch:
                rec.watch_compiles()
            return out

        def module_compile(module, *args, **kwargs):
            out = orig_module_compile(module, *args, **kwargs)
            try:
                rec.wrap_compiled_call(module)
            except Exception:
                rec.fault("Module.compile")
            return out

        for wrapper, orig in ((compile, orig_compile), (module_compile, orig_module_compile)):
            wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
            wrapper.__doc__ = orig.__doc__
        torch.compile = compile
        torch.nn.Module.compile = module_compile

    def wrap_compiled_call(self, module) -> None:
        inner = module._compiled_call_impl
        if inner is None:
            return
        rec = self
        self.compiled_roots.add(id(module))
        if not self.compile_watch:
            self.watch_compiles()

        def compiled_call(*args, **kwargs):
            if not rec.active or rec.disabled or not rec.detail:
                return inner(*args, **kwargs)
            rec.fwd_pre_hook(module, args, kwargs)
            out = inner(*args, **kwargs)
            rec.fwd_hook(module, args, out)
            return out

        module._compiled_call_impl = compiled_call

    def install_train_hooks(self) -> None:
        self.install_optimizer_hooks()
        self.install_path_hooks()

    def remove_train_hooks(self) -> None:
        """Take the step/span hooks out again (benchmarks/overhead.py alternates with and without them)."""
        self.remove_optimizer_hooks()
        self.remove_path_hooks()

    def install_optimizer_hooks(self) -> None:
        from torch.optim import optimizer as optim

        self.hook_handles[:] = [optim.register_optimizer_step_post_hook(self.opt_post_hook)]
        self.switch_opt_pre_hook(self.detail)

    def switch_opt_pre_hook(self, on: bool) -> None:
        """The optimizer pre-hook times the optimizer span of a detailed step; a boundary-only step does without
        its call."""
        from torch.optim import optimizer as optim

        if on and self.opt_pre_handle is None:
            self.opt_pre_handle = optim.register_optimizer_step_pre_hook(self.opt_pre_hook)
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

        self.grad_enabled = torch.is_grad_enabled
        self.is_compiling = torch.compiler.is_compiling
        self.install_module_hooks()
        # Tensor.backward calls torch.autograd.backward (looked up at each call): one wrapper times both
        self.orig_backward = torch.autograd.backward
        torch.autograd.backward = self.timed_backward(self.orig_backward)
        self.orig_next = dataloader._BaseDataLoaderIter.__next__
        dataloader._BaseDataLoaderIter.__next__ = self.timed_next(self.orig_next)

    def remove_path_hooks(self) -> None:
        import torch

        self.remove_module_hooks()
        if self.orig_backward is not None:
            torch.autograd.backward = self.orig_backward
        if self.orig_next is not None:
            from torch.utils.data import dataloader

            dataloader._BaseDataLoaderIter.__next__ = self.orig_next

    # ---- A/B blocks: what dtprof costs the job's own steps (benchmarks/overhead.py) -------------------------

    def ab_step_done(self) -> None:
        """Every ``ab_block`` optimizer steps, switch dtprof's hooks off or back on, at the same step on every rank
        (``DTPROF_AB_BLOCK_STEPS``; module docstring, "A/B blocks")."""
        self.ab_steps += 1
        if self.ab_steps % self.ab_block:
            return
        on = self.ab_off
        self.switch_path_hooks(on)
        if on:
            self.step_start_ns = now()     # the next recorded step starts here
            self.fwd_seen_in_step, self.fwd_depth, self.in_eval_call, self.eval_forwards = False, 0, False, []
            self.run_delay_mark = _run_delay_ns(self.run_delay_fd)
            self.inferred, self.annot = {}, {}
        self.ab_off = not on


# The heartbeat's SIGTERM fallback treats this handler as the default action: it must still kill a rank stuck in C++.
Recorder.on_sigterm.dtprof_default_action = True  # type: ignore[attr-defined]
STATE = Recorder()


def _dynamo_skip_our_code() -> None:
    """Tell Dynamo never to compile a frame of dtprof's rank side. A hook called from eager code that runs under
    a compiled module's frame callback (torch.compile(module) runs the module's own hooks outside its graph) is a
    frame Dynamo would otherwise compile (its cached graph would then run instead of the hook), and so would be
    every torch function a hook calls (registering hooks, starting the recording). The hooks and the recorder's
    methods skip their callees too; a wrapper of a torch function (a collective, backward, a DataLoader's
    ``__next__``: the closures) skips only its own frame, so what it wraps is Dynamo's to judge as in a bare job.
    Costs nothing per call."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except Exception:
        return
    from dtprof.collectors import (
        collective_rows,
        hooks_collectives,
        hooks_ddp,
        hooks_functional,
        hooks_pipelining,
        identity,
        inputs,
        parts,
    )

    own = FrameExecStrategy(FrameAction.SKIP, FrameAction.DEFAULT)
    with_callees = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    seen: set = set()

    ours = os.path.dirname(os.path.abspath(__file__))

    def skip(code, strategy) -> None:
        # (a decorated function's code may be the decorator's: contextlib's, shared by every context manager)
        if id(code) in seen or not os.path.abspath(code.co_filename).startswith(ours):
            return
        seen.add(id(code))
        set_code_exec_strategy(code, strategy)
        for nested in code.co_consts:      # closures and comprehensions defined inside
            if hasattr(nested, "co_code"):
                skip(nested, own)

    for mod in (sys.modules[__name__], identity, hooks_collectives, collective_rows, hooks_ddp, hooks_pipelining,
                hooks_functional, parts, inputs):
        strategy = with_callees if mod in (sys.modules[__name__], identity) else own
        for obj in vars(mod).values():
            if getattr(obj, "__module__", None) != mod.__name__:
                continue
            for member in (vars(obj).values() if isinstance(obj, type) else (obj,)):
                code = getattr(getattr(member, "__func__", member), "__code__", None)
                if code is not None:
                    skip(code, strategy)


def _wrapped_modules(module) -> list:
    """The modules a wrapper holds as ``.module`` (DDP, DataParallel, FSDP1, DeepSpeed's engine), outermost first.
    Not what a torch.compile'd module holds (it forwards ``.module`` to the module it compiled): Dynamo traces
    that one, and a hook on it would be traced into the graph."""
    out: list = []
    m = module
    while "_orig_mod" not in getattr(m, "_modules", ()) and len(out) < 4:
        m = getattr(m, "module", None)
        if not hasattr(m, "register_forward_pre_hook"):
            break
        out.append(m)
    return out


def _median(xs: list):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _mad(xs: list) -> int:
    m = _median(xs)
    return _median([abs(x - m) for x in xs]) if m is not None else 0


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


def _own_threads_cpu_s() -> dict:
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
    STATE.patch_compile()
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
    if STATE.active or STATE.ab_off:       # recording (an A/B "off" block is recording too)
        return True
    if STATE.disabled:
        return False
    try:
        from dtprof.runformat import create_node_dir, create_run_dir, rank_dir

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
        first_manual = not rec.manual_steps
        rec.manual_steps = True
        if first_manual and rec.step > 0 and not rec.fwd_seen_in_step:
            return                   # the optimizer hook just ended this step
        rec.end_step(now())
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
            rec.span("user", str(name), t0, now(), stage=rec.annot.get("stage"),
                     microbatch=rec.annot.get("microbatch"))
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
            rec.annot[k] = None if v is None else int(v)
    except ValueError as e:
        rec.event("warning", str(e))
    except Exception:
        rec.fault("dtprof.annotate")
