"""The rank runtime: what dtprof records inside one training process (docs/run-format.md, issue 2).

Public interface (BRIEF §2): ``init(out=None, **options) -> bool``, ``step()``, ``span(name)``,
``annotate(**fields)``, ``install_from_env()`` and the module-level ``STATE``.

How it stays out of training's way
- The hot path (hooks, wrapped collectives) only reads a few module globals and appends tuples/lists to the
  ``RankWriter``'s in-memory lists. All file I/O, CUDA event resolution and clock readings happen in one daemon
  flusher thread (every ``flush_interval_s``, default 1 s) and at exit (atexit).
- Every hook body runs under try/except. A fault records an ``events`` error row (the traceback's last line),
  sets ``STATE.disabled`` (every hook becomes a pass-through) and never raises into training.

Steps (the ``steps`` table)
- A step ends at every ``torch.optim`` optimizer step (global step post-hook) or at ``dtprof.step()``.
  Rule against double counting: once the program calls ``dtprof.step()``, optimizer steps no longer end steps;
  a ``dtprof.step()`` that directly follows an optimizer-ended step (no forward in between) only switches the
  mode and does not add an empty step. Loops with several optimizers per iteration should call ``dtprof.step()``.
- A step starts where the previous one ended; step 0 starts at the rank's first top-level forward.
- ``peak_mem_bytes``: on CUDA ``torch.cuda.max_memory_allocated()`` (reset after each step); on CPU the process's
  resident-set high-water mark ``getrusage(RUSAGE_SELF).ru_maxrss`` (monotone over the process lifetime: it
  cannot be reset cheaply).

Spans (the ``spans`` table; kinds in dtprof.schema.SPAN_KINDS)
- ``forward``: first top-level module forward pre-hook to its forward hook (global module hooks, nesting depth
  tracked so only the outermost call counts); ``backward``: the duration of ``torch.autograd.backward`` /
  ``Tensor.backward``; ``optimizer``: optimizer step pre- to post-hook; ``data_wait``: end of the previous step to
  the first forward of the next. Inside a pipeline schedule these are replaced by ``pp_forward``/``pp_backward``
  (hooks_collectives.py). On CUDA, forward/backward/optimizer are timed with CUDA events recorded at the same
  points and converted to host ns through an anchor event (source "cuda_event"); on CPU they are host times
  (source "hook").
- ``flops_count``: with ``count_flops``, step 1 (the second) runs under ``FlopCounterMode`` and its
  ``executed_flops`` is written; that step is slower and the span marks it.
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

now = time.monotonic_ns


class _State:
    """What other parts of dtprof (heartbeat, watchdog) may read about this rank. Plain attributes only."""

    def __init__(self):
        self.active = False        # recording
        self.disabled = False      # a fault switched dtprof off for this rank
        self.rank = -1
        self.step = 0              # index of the step in progress
        self.collective = None     # dict of the blocking collective the main thread is in, else None
        self.last_progress_ns = 0
        self.rank_dir = None
        self.host = socket.gethostname()
        self.options = {}


STATE = _State()
W = None                 # the RankWriter (None until init)
_OPTIONS_DEFAULT = {"trace_steps": None, "count_flops": False, "hang_timeout_s": None, "flush_interval_s": 1.0}

# ---- per-step bookkeeping (main thread only) ----
_init_ns = 0
_step_start_ns = None     # start of the step in progress (None before the first forward)
_prev_step_end_ns = None
_fwd_depth = 0
_fwd_t0 = 0
_fwd_ev0 = None
_fwd_seen_in_step = False
_in_backward = False
_opt_t0 = 0
_opt_ev0 = None
_manual_steps = False
_annot = {}
_pp_active = 0            # >0 while a pipeline schedule's step() runs (set by hooks_collectives)
_ddp_last_issue_ns = None  # issue time of DDP's last bucket in the backward in progress (set by the DDP hook)
_trace_capture = None
_flop_mode = None
_flops_step = None
_identity_new = None       # a fresh rank.json dict computed on the main thread, written by the flusher
_fault_test = ""          # tests only: DTPROF_TEST_FAULT=<hook>[@<rank>] injects a fault ("collective", "forward")

# ---- CUDA timing (decided at the first forward) ----
_cuda = None              # None undecided, False host timing, True CUDA events
_cuda_anchor = None       # (event, host_ns) recorded after one synchronize
_cuda_pending = []        # [row, start_event, end_event] resolved by the flusher


def _fault(where: str) -> None:
    """Record a dtprof fault as an events error row and disable dtprof on this rank. Never raises."""
    try:
        STATE.disabled = True
        last = traceback.format_exc().strip().splitlines()[-1]
        msg = f"dtprof disabled on this rank after a fault in {where}: {last}"
        if W is not None:
            W.append("events", (STATE.rank, STATE.host, now(), "error", "rank", msg))
        sys.stderr.write(f"dtprof[rank {STATE.rank}]: {msg}\n")
    except BaseException:
        pass


def event(level: str, message: str) -> None:
    if W is not None:
        W.append("events", (STATE.rank, STATE.host, now(), level, "rank", message))


def _span(kind, name, t0, t1, stage=None, microbatch=None, lane="main", source="hook", step=None):
    W.append("spans", (STATE.rank, STATE.step if step is None else step, kind, name, t0, t1, stage, microbatch,
                       lane, source))


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


def _identity() -> dict:
    import torch

    env = os.environ
    ident = {
        "rank": STATE.rank, "local_rank": int(env.get("LOCAL_RANK", 0)), "world_size": int(env.get("WORLD_SIZE", 1)),
        "node_rank": int(env["GROUP_RANK"]) if env.get("GROUP_RANK", "").isdigit() else None,
        "host": STATE.host, "pid": os.getpid(), "node": os.path.basename(os.path.dirname(STATE.rank_dir)),
        "device_type": "cpu", "device_index": None, "device_name": "cpu", "device_uuid": "",
        "device_mem_total_bytes": None, "backend": "",
        "torch_version": torch.__version__, "python": sys.version.split()[0], "argv": sys.argv,
        "options": STATE.options,
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
                     device_uuid=str(getattr(props, "uuid", "")), device_mem_total_bytes=int(props.total_memory))
    return ident


def refresh_identity() -> None:
    """Recompute rank.json on the calling (main) thread, e.g. after init_process_group; the flusher writes it."""
    global _identity_new
    _identity_new = _identity()


def _claim_rank_dir(rank_dir) -> bool:
    """One process per rank directory: a process spawned by a rank (it inherits RANK) must not write there too."""
    owner = os.path.join(rank_dir, ".owner")
    try:
        with open(owner) as f:
            pid = int(f.read().strip() or 0)
        if pid and pid != os.getpid():
            os.kill(pid, 0)        # raises if that process is gone (e.g. an elastic restart): take over
            return False
    except (FileNotFoundError, ValueError, ProcessLookupError):
        pass
    except PermissionError:
        return False
    with open(owner, "w") as f:
        f.write(str(os.getpid()))
    return True


def install_from_env() -> bool:
    """Called by the injected sitecustomize once torch is imported: profile this process if it is a rank."""
    if STATE.active or not os.environ.get("DTPROF_NODE_DIR"):
        return STATE.active
    if "RANK" not in os.environ and "LOCAL_RANK" not in os.environ and _is_torchrun_launcher():
        return False
    return init()


def init(out=None, **options) -> bool:
    """Start recording this rank. ``out``: a run directory for jobs not started by `dtprof run` (each process then
    gets its own node directory in it); default: ``DTPROF_NODE_DIR``. Options override ``DTPROF_CONFIG``.
    Returns True when recording."""
    global W, _init_ns, _trace_capture
    if STATE.active:
        return True
    if STATE.disabled:
        return False
    try:
        from dtprof.runformat import RankWriter, create_node_dir, create_run_dir, rank_dir

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
        elif env.get("DTPROF_NODE_DIR"):
            node_dir = env["DTPROF_NODE_DIR"]
        else:
            return False
        rank = int(env.get("RANK", 0))
        rdir = rank_dir(node_dir, rank)
        os.makedirs(rdir, exist_ok=True)
        if not _claim_rank_dir(str(rdir)):
            return False
        STATE.rank, STATE.rank_dir, STATE.options = rank, str(rdir), opts
        _set_fault_test(env.get("DTPROF_TEST_FAULT", ""), rank)
        W = RankWriter(node_dir, rank)
        _init_ns = now()
        STATE.last_progress_ns = _init_ns
        W.write_identity(_identity())
        _clock_row()
        from dtprof.collectors import hooks_collectives

        _install_train_hooks()
        hooks_collectives.install()
        from dtprof.collectors import hooks_functional  # hybrid hook-in: functional collectives, DeviceMesh

        hooks_functional.install()
        STATE.active = True
        _start_flusher(float(opts.get("flush_interval_s") or 1.0))
        _start_companions(opts)
        return True
    except BaseException:
        _fault("init")
        STATE.active = False
        return False


def _set_fault_test(spec: str, rank: int) -> None:
    global _fault_test
    where, _, only_rank = spec.partition("@")
    _fault_test = where if (not only_rank or int(only_rank) == rank) else ""


def _start_companions(opts) -> None:
    """The heartbeat (triage helper) and the trace capture (interop helper), when those modules exist."""
    global _trace_capture
    try:
        from dtprof.collectors import heartbeat
    except ImportError:
        heartbeat = None
    if heartbeat is not None:
        try:
            heartbeat.start(STATE.rank_dir, STATE)
        except Exception:
            event("warning", f"heartbeat did not start: {traceback.format_exc().strip().splitlines()[-1]}")
    if opts.get("trace_steps"):
        try:
            from dtprof.collectors.trace_capture import TraceCapture

            a, b = str(opts["trace_steps"]).split(":")
            _trace_capture = TraceCapture(STATE.rank_dir, int(a), int(b))
        except Exception:
            event("warning", f"trace capture unavailable: {traceback.format_exc().strip().splitlines()[-1]}")


# ---------------------------------------------------------------------------------------------------------------
# The flusher thread

def _clock_row() -> None:
    W.append("clock", (STATE.rank, STATE.host, time.monotonic_ns(), time.time_ns()))


def _flush_once() -> None:
    global _identity_new
    if W is None:
        return
    if _cuda:
        _resolve_cuda_events()
    from dtprof.collectors import hooks_collectives

    hooks_collectives.expire_pending()
    hooks_collectives.resolve_gpu_durations()
    ident, _identity_new = _identity_new, None
    if ident is not None:
        W.write_identity(ident)
    _clock_row()
    W.flush()


def _flush_loop(interval: float) -> None:
    while True:
        time.sleep(interval)
        try:
            _flush_once()
        except Exception:
            _fault("flusher")
            try:
                W.flush()
            except Exception:
                return


def _at_exit() -> None:
    try:
        if _trace_capture is not None:
            try:
                _trace_capture.close()
            except Exception:
                event("warning", "trace capture close failed: " + traceback.format_exc().strip().splitlines()[-1])
        from dtprof.collectors import hooks_collectives

        if _cuda:
            import torch

            torch.cuda.synchronize()      # at exit only: lets the last steps' CUDA-event spans resolve
        hooks_collectives.expire_pending(all_=True)
        hooks_collectives.resolve_gpu_durations(final=True)
        _flush_once()
        W.close()
    except BaseException:
        pass


def _on_sigterm(signum, frame) -> None:
    """torchrun stops the surviving workers with SIGTERM when one fails; Python's default action skips atexit.
    Flush what we have, then die of SIGTERM as the default action would."""
    import signal

    _at_exit()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


_on_sigterm.dtprof_default_action = True   # the heartbeat's fallback must still kill a rank stuck in C++


def _start_flusher(interval: float) -> None:
    t = threading.Thread(target=_flush_loop, args=(interval,), name="dtprof-flusher", daemon=True)
    t.start()
    atexit.register(_at_exit)
    try:
        import signal

        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:   # never replace the program's own handler
            signal.signal(signal.SIGTERM, _on_sigterm)
    except Exception:
        pass


# ---------------------------------------------------------------------------------------------------------------
# CUDA event timing (small on purpose: recorded in hooks, resolved in the flusher, never synchronising training)

def _decide_cuda() -> None:
    global _cuda, _cuda_anchor
    import torch

    _cuda = bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    if _cuda:
        torch.cuda.synchronize()          # once, before the first step: pairs a GPU event with a host time
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        ev.synchronize()
        _cuda_anchor = (ev, now())


def _cuda_event():
    import torch

    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def _resolve_cuda_events() -> None:
    """Turn finished event pairs into spans. The hot path only appends to ``_cuda_pending``; this thread removes
    the prefix it looked at (list slice operations are atomic under the GIL)."""
    anchor, anchor_ns = _cuda_anchor
    n = len(_cuda_pending)
    keep = []
    for item in _cuda_pending[:n]:
        row, e0, e1 = item
        if e1.query() and e0.query():
            row[4] = anchor_ns + int(anchor.elapsed_time(e0) * 1e6)
            row[5] = anchor_ns + int(anchor.elapsed_time(e1) * 1e6)
            W.append("spans", row)
        else:
            keep.append(item)
    del _cuda_pending[:n]
    _cuda_pending[:0] = keep


def _compute_span(kind, t0, ev0, t1) -> None:
    if _cuda and ev0 is not None:
        _cuda_pending.append(([STATE.rank, STATE.step, kind, kind, t0, t1, None, None, "cuda", "cuda_event"],
                              ev0, _cuda_event()))
    else:
        _span(kind, kind, t0, t1)


# ---------------------------------------------------------------------------------------------------------------
# Training hooks: module forward, backward, optimizer

def _fwd_pre_hook(module, args):
    global _fwd_depth, _fwd_t0, _fwd_ev0, _step_start_ns, _fwd_seen_in_step
    if STATE.disabled:
        return None
    try:
        _fwd_depth += 1
        if _fwd_depth == 1 and not _in_backward:
            t = now()
            if STATE.step == 0:
                _note_root(module)
            if _fault_test == "forward":
                raise RuntimeError("injected fault (DTPROF_TEST_FAULT=forward)")
            if _cuda is None:
                _decide_cuda()
            if not _fwd_seen_in_step:
                _fwd_seen_in_step = True
                if _step_start_ns is None:
                    _step_start_ns = t
                elif _prev_step_end_ns is not None:
                    _span("data_wait", "data_wait", _prev_step_end_ns, t)
            _fwd_t0 = t
            _fwd_ev0 = _cuda_event() if _cuda else None
            STATE.last_progress_ns = t
    except Exception:
        _fault("forward pre-hook")
    return None


def _note_root(module) -> None:
    global _roots
    if _roots is None:
        import weakref

        _roots = weakref.WeakSet()
    _roots.add(module)


def _fwd_hook(module, args, output):
    global _fwd_depth
    if STATE.disabled:
        return None
    try:
        _fwd_depth -= 1
        if _fwd_depth <= 0:
            _fwd_depth = 0
            if not _in_backward and not _pp_active:
                _compute_span("forward", _fwd_t0, _fwd_ev0, now())
    except Exception:
        _fault("forward hook")
    return None


def _timed_backward(orig):
    def backward(*args, **kwargs):
        global _in_backward, _ddp_last_issue_ns
        if STATE.disabled or _in_backward:
            return orig(*args, **kwargs)
        try:
            t0 = now()
            ev0 = _cuda_event() if _cuda else None
            _ddp_last_issue_ns = None
        except Exception:
            _fault("backward")
            return orig(*args, **kwargs)
        _in_backward = True
        try:
            return orig(*args, **kwargs)
        finally:
            _in_backward = False
            try:
                t1 = now()
                STATE.last_progress_ns = t1
                if not _pp_active:
                    _compute_span("backward", t0, ev0, t1)
                if _ddp_last_issue_ns is not None:
                    # DDP blocks at the end of backward until its last buckets are reduced.
                    _span("comm_wait", "ddp_final_wait", _ddp_last_issue_ns, t1)
                    _ddp_last_issue_ns = None
            except Exception:
                _fault("backward")

    backward.__wrapped__ = orig
    backward.__name__ = getattr(orig, "__name__", "backward")
    backward.__doc__ = getattr(orig, "__doc__", None)
    return backward


def _opt_pre_hook(optimizer, args, kwargs):
    global _opt_t0, _opt_ev0
    if STATE.disabled:
        return None
    try:
        _opt_t0 = now()
        _opt_ev0 = _cuda_event() if _cuda else None
    except Exception:
        _fault("optimizer pre-hook")
    return None


def _opt_post_hook(optimizer, args, kwargs):
    if STATE.disabled:
        return None
    try:
        t = now()
        _compute_span("optimizer", _opt_t0 or t, _opt_ev0, t)
        if not _manual_steps:
            _end_step(t)
    except Exception:
        _fault("optimizer post-hook")
    return None


def _peak_mem_bytes():
    if _cuda:
        import torch

        peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return int(peak)
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024   # Linux reports KiB


def _end_step(t: int) -> None:
    """Close the step in progress at host time ``t`` (main thread)."""
    global _step_start_ns, _prev_step_end_ns, _fwd_seen_in_step, _annot, _fwd_depth
    step = STATE.step
    start = _step_start_ns if _step_start_ns is not None else _init_ns
    a = _annot
    W.append("steps", (STATE.rank, step, start, t, _peak_mem_bytes(), a.get("tokens"), a.get("samples"),
                       a.get("model_flops"), _flops_finish(step)))
    if step == 0:
        refresh_identity()           # the device and the process group are set up by now
        _hooks_to_roots()
    _annot = {}
    _prev_step_end_ns = _step_start_ns = t
    _fwd_seen_in_step = False
    _fwd_depth = 0
    STATE.step = step + 1
    STATE.last_progress_ns = t
    if _trace_capture is not None:
        try:
            _trace_capture.on_step_end(step)
        except Exception:
            event("warning", "trace capture failed: " + traceback.format_exc().strip().splitlines()[-1])
    if STATE.options.get("count_flops") and STATE.step == 1:
        _flops_start()


def _flops_start() -> None:
    """Run the next step (step 1) under FlopCounterMode."""
    global _flop_mode, _flops_step
    from torch.utils.flop_counter import FlopCounterMode

    _flop_mode = FlopCounterMode(display=False)
    _flop_mode.__enter__()
    _flops_step = (STATE.step, now())


def _flops_finish(step):
    global _flop_mode, _flops_step
    if _flop_mode is None or _flops_step is None or _flops_step[0] != step:
        return None
    mode, (s, t0) = _flop_mode, _flops_step
    _flop_mode = _flops_step = None
    mode.__exit__(None, None, None)
    _span("flops_count", "FlopCounterMode", t0, now(), step=s)
    return int(mode.get_total_flops())


_hook_handles = []        # optimizer hooks
_module_handles = []      # forward hooks: global ones during step 0, then on the root modules only
_roots = None             # weakref.WeakSet of the modules seen at nesting depth 0 in step 0
_orig_backward = None


def _install_module_hooks() -> None:
    """Global module hooks put every module call of the program on nn.Module's slow path (~4 us each, measured in
    benchmarks/overhead.py), so they are used only in step 0 to find the top-level modules; after that the
    forward hooks sit on those root modules alone. Forward spans after step 0 therefore come from the modules
    that were top-level in step 0 (a model first called later is not timed as ``forward``)."""
    from torch.nn.modules import module as nn_module

    if _roots is None:
        _module_handles[:] = [nn_module.register_module_forward_pre_hook(_fwd_pre_hook),
                              nn_module.register_module_forward_hook(_fwd_hook)]
    else:
        _module_handles[:] = [h for m in list(_roots) for h in (
            m.register_forward_pre_hook(_fwd_pre_hook, prepend=True), m.register_forward_hook(_fwd_hook))]


def _remove_module_hooks() -> None:
    for h in _module_handles:
        h.remove()
    _module_handles.clear()


def _hooks_to_roots() -> None:
    global _roots
    if _roots is None or not _module_handles:
        return
    _remove_module_hooks()         # the global ones (installed while _roots was None)
    _install_module_hooks()


def _install_train_hooks() -> None:
    global _orig_backward
    import torch
    from torch.optim import optimizer as optim

    _install_module_hooks()
    _hook_handles[:] = [
        optim.register_optimizer_step_pre_hook(_opt_pre_hook),
        optim.register_optimizer_step_post_hook(_opt_post_hook),
    ]
    _orig_backward = (torch.autograd.backward, torch.Tensor.backward)
    torch.autograd.backward = _timed_backward(_orig_backward[0])
    torch.Tensor.backward = _timed_backward(_orig_backward[1])


def _remove_train_hooks() -> None:
    """Take the step/span hooks out again (benchmarks/overhead.py alternates with and without them)."""
    import torch

    _remove_module_hooks()
    for h in _hook_handles:
        h.remove()
    _hook_handles.clear()
    if _orig_backward is not None:
        torch.autograd.backward, torch.Tensor.backward = _orig_backward


# ---------------------------------------------------------------------------------------------------------------
# Public API for training code

def step() -> None:
    """End the current step now (for loops without torch.optim; see the double-counting rule above)."""
    global _manual_steps
    if not STATE.active or STATE.disabled:
        return
    try:
        first_manual = not _manual_steps
        _manual_steps = True
        if first_manual and STATE.step > 0 and not _fwd_seen_in_step:
            return                   # the optimizer hook just ended this step
        _end_step(now())
    except Exception:
        _fault("dtprof.step")


@contextmanager
def span(name: str):
    """Record a ``user`` span named ``name`` around the block (cheap no-op when not recording)."""
    if not STATE.active or STATE.disabled:
        yield
        return
    t0 = now()
    try:
        yield
    finally:
        try:
            _span("user", str(name), t0, now(), stage=_annot.get("stage"), microbatch=_annot.get("microbatch"))
        except Exception:
            _fault("dtprof.span")


_ANNOTATABLE = ("tokens", "samples", "model_flops", "stage", "microbatch")


def annotate(**fields) -> None:
    """Attach facts to the step in progress: tokens=, samples=, model_flops= (steps table); stage=, microbatch=
    (put on the ``user`` spans that follow in this step)."""
    if not STATE.active or STATE.disabled:
        return
    try:
        for k, v in fields.items():
            if k not in _ANNOTATABLE:
                raise ValueError(f"dtprof.annotate: unknown field {k!r} (known: {', '.join(_ANNOTATABLE)})")
            _annot[k] = None if v is None else int(v)
    except ValueError as e:
        event("warning", str(e))
    except Exception:
        _fault("dtprof.annotate")
