"""Collectives, point-to-point, DDP buckets and pipeline stages as one rank sees them (the ``collectives``,
``groups`` and pipeline ``spans`` rows). The runtime's Recorder makes one ``CollectiveHooks``, installs it and owns
it; the hooks and the tables they keep live in that object, none in this module. See runtime.py for the fault
rules.

What is visible from Python (torch-facts "What each parallel style sends through Python"):
- user code, FSDP1/FSDP2 and pipelining call the ``torch.distributed`` functions, which we wrap in both
  ``torch.distributed`` and ``torch.distributed.distributed_c10d`` (the same wrapper object in both, because c10d
  compares functions by identity, e.g. ``op.op is isend``). A thread-local guard records only the outermost call.
- ``source`` is taken from the module of the direct caller (one frame, cached per module name): code under
  ``torch.distributed.fsdp`` / ``torch.distributed._composable.fsdp`` -> "fsdp", ``torch.distributed.pipelining``
  -> "pipeline", a DDP comm hook -> "ddp", anything else -> "user".
- DDP's Reducer runs in C++ and all-reduces each bucket through the dispatcher op ``c10d::allreduce_``. A Python
  kernel for that op at the autograd dispatch keys (AutogradCPU/AutogradCUDA, above the backends' kernels) sees
  each call and redispatches it unchanged, so DDP's own reduction (its division by the world size while copying
  into the bucket, then a SUM all-reduce) runs exactly as without dtprof: no comm hook is registered, training is
  bit-identical and the user may register their own hook at any time. A user's hook is wrapped only to label its
  collectives with the bucket (``bucket.index()``); a hook whose collective passes neither through Python nor
  through the dispatcher is recorded as the bucket buffer itself. Bucket collectives get api "ddp_bucket",
  ``bucket`` = index (the Reducer launches buckets in index order; without a hook the index is counted per
  backward). Calls already inside a wrapped ``torch.distributed`` function are not counted twice (``tls.busy``).
- Completion: ``work.get_future().add_done_callback(cb)`` where the backend supports it; gloo point-to-point works
  have no future, so ``Work.wait`` is patched on the class: every blocking wait is a ``comm_wait`` span and
  completes the rows of that work. A synchronous call is one ``comm_wait`` span from issue to return.
- Byte counts: ``in_bytes``/``out_bytes`` are this rank's input and output tensors; for ``send`` in = tensor,
  out = 0; for ``recv`` in = 0, out = tensor (so max(in, out) is the message size on both sides).
- ``seq`` counts per group for collectives and per (group, src, dst) for point-to-point, in call order.
- Pipelining: ``forward_one_chunk``/``backward_one_chunk``(/``backward_weight_one_chunk``) become ``pp_forward``
  / ``pp_backward`` spans with ``stage`` and ``microbatch``; P2P ops built by ``get_{fwd,bwd}_{send,recv}_ops``
  carry their stage and microbatch into the rows. The first ``step()`` of each schedule object writes a
  ``pipeline_schedule`` meta row: {"schedule": <class name>, "stages": n, "microbatches": m,
  "stage_indices": [i, ...]} (the stages this rank runs).
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from functools import partial
from typing import Any

from dtprof.collectors.records import COLUMN, Group, collective_row, span_row

now = time.monotonic_ns


class _ThreadFlags(threading.local):
    """Per-thread flags, read on every collective: class defaults, so reading one needs no getattr default."""
    busy = False                  # inside a wrapped call
    bucket = None                 # [index, is_last, used] inside a (wrapped) DDP comm hook
    stage_mb = None               # (stage, microbatch) of the pipeline's point-to-point batch in progress
    thread_state_kept = False     # CollectiveHooks.keep_thread_state ran in this thread


MAX_PENDING = 4096
# NCCL works whose GPU-side duration (Work._get_duration(), needs TORCH_NCCL_ENABLE_TIMING=1, which `dtprof run`
# sets unless the user did) the flusher reads once the GPU has finished them (``rec.timed``). Bounded, since
# each entry keeps its work alive.
MAX_TIMED = 2048
MAX_TIMED_TRIES = 5

_MAIN_THREAD = threading.main_thread().ident
_C10D_INTERNAL = ("torch.distributed.distributed_c10d", "torch.distributed.c10d_logger")


def _source_of_module(name: str) -> str:
    """The ``source`` of a collective called from module ``name``."""
    if name.startswith(("torch.distributed.fsdp", "torch.distributed._composable.fsdp")):
        return "fsdp"
    if name.startswith("torch.distributed.pipelining"):
        return "pipeline"
    if name.startswith("torch.distributed.algorithms.ddp_comm_hooks"):
        return "ddp"
    return "user"


def _nbytes(t) -> int:
    try:
        return t.numel() * t.element_size()
    except AttributeError:
        return 0


def _nbytes_list(ts) -> int:
    return sum(_nbytes(t) for t in ts) if ts else 0


# torch.dtype -> its name without "torch." (str() of a dtype is slow per call). A memo of a pure function of torch's
# dtypes, the same for every recorder, so it is the one table kept at module level.
_DTYPE_NAMES: dict = {}


def _dtype(t) -> str:
    try:
        return _DTYPE_NAMES[t.dtype]
    except KeyError:
        name = _DTYPE_NAMES[t.dtype] = str(t.dtype).replace("torch.", "")
        return name
    except AttributeError:
        return ""


def _first(ts):
    return ts[0] if ts else None


# ---- argument extractors: same signatures as torch 2.13 after ``peer_of`` (CollectiveHooks.global_peer); return
# (in_bytes, out_bytes, dtype, group, peer, async)

# all_reduce and broadcast: Lightning calls them every step (a logged value, the SIGTERM check), so _nbytes' and
# _dtype's lines are here rather than two more frames (each costs the training thread several µs in a real job)
def _x_all_reduce(peer_of, tensor, op=None, group=None, async_op=False):
    try:
        b = tensor.numel() * tensor.element_size()
        return b, b, _DTYPE_NAMES.get(tensor.dtype) or _dtype(tensor), group, None, async_op
    except AttributeError:
        return 0, 0, "", group, None, async_op


def _x_all_reduce_coalesced(peer_of, tensors, op=None, group=None, async_op=False):
    b = _nbytes_list(tensors)
    return b, b, _dtype(_first(tensors)), group, None, async_op


def _x_all_gather(peer_of, tensor_list, tensor, group=None, async_op=False):
    return _nbytes(tensor), _nbytes_list(tensor_list), _dtype(tensor), group, None, async_op


def _x_all_gather_coalesced(peer_of, output_tensor_lists, input_tensor_list, group=None, async_op=False):
    out = sum(_nbytes_list(lst) for lst in output_tensor_lists)
    return _nbytes_list(input_tensor_list), out, _dtype(_first(input_tensor_list)), group, None, async_op


def _x_out_in(peer_of, output, input, *rest, group=None, async_op=False, op=None, output_split_sizes=None,
              input_split_sizes=None):
    return _nbytes(input), _nbytes(output), _dtype(input), group, None, async_op


# FSDP2 calls these two for every parameter group, forward and backward: tensors only (torch checks that), so their
# sizes are read without _nbytes' guard, and the dtype's name from its table once it is there
def _x_all_gather_into(peer_of, output_tensor, input_tensor, group=None, async_op=False):
    return (input_tensor.numel() * input_tensor.element_size(), output_tensor.numel() * output_tensor.element_size(),
            _DTYPE_NAMES.get(input_tensor.dtype) or _dtype(input_tensor), group, None, async_op)


def _x_reduce_scatter(peer_of, output, input_list, op=None, group=None, async_op=False):
    return _nbytes_list(input_list), _nbytes(output), _dtype(output), group, None, async_op


def _x_reduce_scatter_tensor(peer_of, output, input, op=None, group=None, async_op=False):
    return (input.numel() * input.element_size(), output.numel() * output.element_size(),
            _DTYPE_NAMES.get(input.dtype) or _dtype(input), group, None, async_op)


def _x_all_to_all(peer_of, output_tensor_list, input_tensor_list, group=None, async_op=False):
    return (_nbytes_list(input_tensor_list), _nbytes_list(output_tensor_list), _dtype(_first(input_tensor_list)),
            group, None, async_op)


def _x_all_to_all_single(peer_of, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                         async_op=False):
    return _nbytes(input), _nbytes(output), _dtype(input), group, None, async_op


def _x_broadcast(peer_of, tensor, src=None, group=None, async_op=False, group_src=None):
    peer = int(src) if src is not None else peer_of(group, None, group_src)
    try:
        b = tensor.numel() * tensor.element_size()
        return b, b, _DTYPE_NAMES.get(tensor.dtype) or _dtype(tensor), group, peer, async_op
    except AttributeError:
        return 0, 0, "", group, peer, async_op


def _x_reduce(peer_of, tensor, dst=None, op=None, group=None, async_op=False, group_dst=None):
    b = _nbytes(tensor)
    return b, b, _dtype(tensor), group, peer_of(group, dst, group_dst), async_op


def _x_barrier(peer_of, group=None, async_op=False, device_ids=None, timeout=None):
    return 0, 0, "", group, None, async_op


def _x_monitored_barrier(peer_of, group=None, timeout=None, wait_all_ranks=False):
    return 0, 0, "", group, None, False


def _x_gather(peer_of, tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    return (_nbytes(tensor), _nbytes_list(gather_list), _dtype(tensor), group, peer_of(group, dst, group_dst),
            async_op)


def _x_scatter(peer_of, tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    return (_nbytes_list(scatter_list), _nbytes(tensor), _dtype(tensor), group, peer_of(group, src, group_src),
            async_op)


def _x_send(peer_of, tensor, dst=None, group=None, tag=0, group_dst=None):
    return _nbytes(tensor), 0, _dtype(tensor), group, peer_of(group, dst, group_dst), False


def _x_recv(peer_of, tensor, src=None, group=None, tag=0, group_src=None):
    return 0, _nbytes(tensor), _dtype(tensor), group, peer_of(group, src, group_src), False


def _x_isend(peer_of, tensor, dst=None, group=None, tag=0, group_dst=None):
    return _nbytes(tensor), 0, _dtype(tensor), group, peer_of(group, dst, group_dst), True


def _x_irecv(peer_of, tensor, src=None, group=None, tag=0, group_src=None):
    return 0, _nbytes(tensor), _dtype(tensor), group, peer_of(group, src, group_src), True


# api -> (canonical op, extractor)
_APIS = {
    "all_reduce": ("all_reduce", _x_all_reduce),
    "all_reduce_coalesced": ("all_reduce", _x_all_reduce_coalesced),
    "all_gather": ("all_gather", _x_all_gather),
    "all_gather_coalesced": ("all_gather", _x_all_gather_coalesced),
    "all_gather_into_tensor": ("all_gather", _x_all_gather_into),
    "_all_gather_base": ("all_gather", _x_all_gather_into),
    "all_gather_single": ("all_gather", _x_all_gather_into),
    "reduce_scatter": ("reduce_scatter", _x_reduce_scatter),
    "reduce_scatter_tensor": ("reduce_scatter", _x_reduce_scatter_tensor),
    "_reduce_scatter_base": ("reduce_scatter", _x_reduce_scatter_tensor),
    "reduce_scatter_single": ("reduce_scatter", _x_reduce_scatter_tensor),
    "all_to_all": ("all_to_all", _x_all_to_all),
    "all_to_all_single": ("all_to_all", _x_all_to_all_single),
    "broadcast": ("broadcast", _x_broadcast),
    "reduce": ("reduce", _x_reduce),
    "barrier": ("barrier", _x_barrier),
    "monitored_barrier": ("barrier", _x_monitored_barrier),
    "gather": ("gather", _x_gather),
    "scatter": ("scatter", _x_scatter),
    "send": ("send", _x_send),
    "recv": ("recv", _x_recv),
    "isend": ("send", _x_isend),
    "irecv": ("recv", _x_irecv),
}
_P2P = ("send", "recv")
_COL = COLUMN["collectives"]
_END, _PEER, _ISSUE, _OP, _GROUP, _SOURCE, _GPU = (_COL[c] for c in ("end_ns", "peer", "issue_ns", "op", "group",
                                                                    "source", "gpu_duration_ns"))
_NO_STAGE = (None, None)


class CollectiveHooks:
    """dtprof's hooks in torch.distributed for one Recorder (collectors/runtime.py), and every table they keep. The
    Recorder makes one, installs it (``install``) and may take it out again (``remove``: torch's own functions back);
    this module never imports the runtime, so the two are not a circle. The wrappers close over this object and its
    recorder, so the hot paths read them without a global lookup."""

    def __init__(self, rec) -> None:
        self.rec = rec
        self.tls = _ThreadFlags()
        self.source_by_module: dict = {}     # a caller's module name -> its source
        self.source_by_code: dict = {}       # the code object of a direct caller outside c10d -> its source
        self.api_of: dict = {}               # a collective function, original or our wrapper -> its c10d name (P2POp)
        self.c10d: Any = None                # torch.distributed.distributed_c10d, once installed
        self.swapped: dict = {}              # (owner, attribute) -> (original, our wrapper): what set_wrappers switches
        self.patched: list = []              # (owner, attribute, original) patched for good: what remove puts back
        self.finders: list = []              # the _AfterImport finders this object put on sys.meta_path
        # (id(group) or None, rank in it) -> global rank: a pipeline stage names its peer so
        self.global_peers: dict = {}
        # (id(group) or None, the peer's rank in it, "send"/"recv") -> (group name, group size, the peer's global
        # rank, the seq key): what where() and global_peer() find for a point-to-point op, looked up once per route
        self.p2p_routes: dict = {}
        # Each pending entry's own number: a completion callback names the entry it was made for, not only its key.
        # Keys are ``id()``s, which Python reuses once an object is freed: a callback that waited for the GIL while
        # the main thread completed its entry (complete_ddp) and issued the next step's bucket, whose future got the
        # freed one's id, once gave that new bucket the old one's end, 40 ms before its peers arrived (a what-if
        # replay 71 % off that step).
        self.entry_numbers = itertools.count()
        # (op, group) whose works have no future: gloo's point-to-point ops ("Work::getFuture not implemented").
        # Asking again raises again, and a raised C++ error costs the training thread ~20 µs (hot): 8 of them a step
        # in a 2-stage pipeline. Their rows are completed by Work.wait.
        self.futureless: set = set()
        # The c10d::allreduce_ kernel (observe_dispatched_allreduce): its torch.library registration (kept alive:
        # dropping it removes the kernel), whether DDP was imported (set_wrappers puts the kernel back), and its
        # dispatch keys. A torch.distributed all-reduce records itself in its wrapper, so the kernel would only pass
        # the call on, at ~10 us (hot) per call for the Python round trip; the wrapper takes these keys out of the
        # dispatch for the call instead. The kernel redispatches below autograd anyway, so the op runs as it does
        # through the kernel: the guard is used only when no tensor requires grad, where the autograd keys do
        # nothing for the op or a view of it.
        self.library: Any = None
        self.kernel_wanted = False
        self.observer_keys: Any = None
        self.exclude_keys: Any = None
        self.nccl_timing: bool | None = None   # decided on first use: timing enabled and CUDA present

    # ---- the rows' parts ----------------------------------------------------------------------------------------

    def wants_gpu_duration(self) -> bool:
        if self.nccl_timing is None:
            try:
                import torch

                self.nccl_timing = os.environ.get("TORCH_NCCL_ENABLE_TIMING") == "1" and torch.cuda.is_available()
            except Exception:
                self.nccl_timing = False
        return bool(self.nccl_timing)

    def caller_source(self, frame) -> str:
        """Source of the first caller outside c10d itself (send_object_list etc. call the tensor functions). A
        direct caller outside c10d is remembered by its code object: the wrappers look ``source_by_code`` up
        first."""
        name = frame.f_globals.get("__name__", "")
        if name not in _C10D_INTERNAL:
            src = self.source_by_code[frame.f_code] = self.source_of_module(name)
            return src
        while name in _C10D_INTERNAL and frame.f_back is not None:
            frame = frame.f_back
            name = frame.f_globals.get("__name__", "")
        return self.source_of_module(name)

    def source_of_module(self, name: str) -> str:
        src = self.source_by_module.get(name)
        if src is None:
            src = self.source_by_module[name] = _source_of_module(name)
        return src

    def seq_counter(self, key):
        """The seq counter of a group name or a point-to-point route (name, src, dst): ``next()`` of it is the next
        call's seq, drawn without a Python frame on the hot paths (their rows take it from the group's cache)."""
        return self.rec.seq.setdefault(key, itertools.count())

    def group(self, group):
        """(name, size, pg, seq counter) for a ProcessGroup or None (the default group), cached; records new
        groups."""
        rec = self.rec
        info = rec.groups.get(None if group is None else id(group))
        if info is not None:
            return info
        import torch.distributed as dist

        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        info = rec.groups.get(id(pg))
        if info is None:
            name = getattr(pg, "group_name", None) or dist.distributed_c10d._get_process_group_name(pg)
            ranks = dist.get_process_group_ranks(pg)
            info = (str(name), len(ranks), pg, self.seq_counter(str(name)))
            try:
                backend = str(dist.get_backend(pg))
            except Exception:
                backend = ""
            rec.add(Group(rank=rec.rank, group=info[0], ranks=",".join(map(str, ranks)), size=len(ranks),
                          backend=backend, desc=str(getattr(pg, "group_desc", "") or ""), mesh_dim=""))
            rec.groups[id(pg)] = info
        rec.groups[None if group is None else id(group)] = info
        return info

    def global_peer(self, group, peer, group_peer):
        if peer is not None:
            return int(peer)
        if group_peer is None:
            return None
        key = (None if group is None else id(group), group_peer)
        got = self.global_peers.get(key)
        if got is None:
            import torch.distributed as dist

            got = self.global_peers[key] = dist.get_global_rank(
                group if group is not None else dist.distributed_c10d._get_default_group(), group_peer)
        return got

    def where(self, op, group, peer):
        """(group name, group size, seq) of the next call of ``op``: the part of a row known before the call."""
        rec = self.rec
        name, size, _pg, counter = rec.groups.get(None if group is None else id(group)) or self.group(group)
        if op in _P2P:
            key = (name, rec.rank, peer) if op == "send" else (name, peer, rec.rank)
            counter = rec.seq.get(key) or self.seq_counter(key)
        return name, size, next(counter)

    def make_row(self, op, api, source, where, in_b, out_b, dtype, peer, async_op, issue, return_ns, end_ns=None,
                 bucket=None, stage=None, microbatch=None, step=None):
        rec = self.rec
        name, size, seq = where
        return collective_row(rec.rank, rec.step if step is None else step, op, api, source, name, size, seq, in_b,
                              out_b, dtype, peer, bool(async_op), issue, return_ns, end_ns, None, bucket, stage,
                              microbatch)

    # ---- completion ---------------------------------------------------------------------------------------------

    def add_pending(self, key, work, rows) -> int:
        """Hold ``rows`` until ``complete(key, t)`` (or expiry) gives them their end time; returns the entry's
        number for a completion callback (``complete(key, t, entry)``)."""
        entry = next(self.entry_numbers)
        self.rec.pending[key] = (work, rows, rows[0][_ISSUE], entry)
        return entry

    def pending_rows(self, key):
        item = self.rec.pending.get(key)
        return None if item is None else item[1]

    def complete(self, key, t, entry: int | None = None) -> None:
        """First completion of an async work wins (future callback thread or main thread's wait()). ``entry``: the
        pending entry a callback was made for; another entry under the same key is left pending."""
        rec = self.rec
        item = rec.pending.pop(key, None)
        if item is None:
            return
        if entry is not None and item[3] != entry:
            rec.pending.setdefault(key, item)   # a later op's, whose key reuses a freed object's id
            return
        rows = item[1]
        if len(rows) == 1:     # most: one row, and no list comprehension (a Python frame) for it
            r = rows[0]
            rows = [r[:_END] + (t,) + r[_END + 1:]]          # the row with its end_ns
        else:
            rows = [r[:_END] + (t,) + r[_END + 1:] for r in rows]
        if self.nccl_timing is not False and self.wants_gpu_duration() and hasattr(item[0], "_get_duration") \
                and len(rec.timed) < MAX_TIMED:
            rec.timed.append((item[0], rows, 0))
        else:
            rec.writer.extend("collectives", rows)

    def complete_ddp(self, t: int) -> None:
        """The end of a backward in which DDP waited for its collectives: each one not yet completed ends at ``t``.
        Their completion callbacks are late when this thread holds the GIL as the backend's thread marks them
        complete: DDP's wait returns on the future's completion, before its callbacks run, and a callback that then
        waits for the GIL runs up to the interpreter's switch interval (5 ms) later, or never if the process exits
        first (the last step's bucket was once written with no end)."""
        # list() copies the table at once (the backend's thread may complete an item meanwhile); complete() is then
        # a no-op for it: the first completion wins
        for key, item in list(self.rec.pending.items()):
            if item[1][0][_SOURCE] == "ddp":
                self.complete(key, t)

    def done(self, key, entry, _fut) -> None:
        """A future's completion callback (bound to ``key`` and its pending ``entry`` with functools.partial:
        cheaper to make than a closure). It runs in the backend's thread, where an exception would be printed into
        the job's output (add_done_callback, unlike then(), has no child future to hold it)."""
        try:
            t = now()
            if not self.tls.thread_state_kept:
                self.keep_thread_state()
            self.complete(key, t, entry)
        except Exception:
            self.rec.fault("collective completion")

    def keep_thread_state(self) -> None:
        """Keep the calling thread's Python thread state for as long as the thread lives. A completion callback
        runs in a thread the backend made (gloo's workers, NCCL's watchdog) that has none of its own: the binding
        makes one for each call and frees it after, and a new thread state maps its frame stack afresh: ~20 µs of
        CPU per callback, while the thread waiting for that work waits too (a gloo all-reduce, its callback and the
        wait: 97 -> 120 µs, against 100 µs with a C builtin as the callback, measured in a micro-benchmark of one
        gloo all-reduce). One more reference taken in the first callback keeps it, so every later callback in that
        thread reuses it; the cost is one thread state per such thread (a few kB), freed at exit."""
        self.tls.thread_state_kept = True
        # in this thread state's own locals: kept from now on
        try:
            import ctypes

            ctypes.pythonapi.PyGILState_Ensure()   # the GIL is held here: only the reference count goes up
        except Exception:
            pass

    def resolve_gpu_durations(self, final: bool = False) -> None:
        """Flusher: fill gpu_duration_ns from NCCL's start/end events once the GPU has run them, then write the
        rows. A work whose events are not ready is retried on the next flushes; after MAX_TIMED_TRIES (or at exit)
        its rows are written without a duration."""
        rec = self.rec
        timed = rec.timed
        for _ in range(len(timed)):
            work, rows, tries = timed.popleft()
            try:
                ms = work._get_duration()   # raises until the end event has completed on the GPU
            except Exception:
                if tries + 1 < MAX_TIMED_TRIES and not final:
                    timed.append((work, rows, tries + 1))
                    continue
                ms = None
            if ms is not None:
                rows = [r[:_GPU] + (int(ms * 1e6),) + r[_GPU + 1:] for r in rows]
            rec.writer.extend("collectives", rows)

    def call_recorded(self, fn, *args, **kwargs):
        """Call ``fn``, a collective its caller records: what it issues through c10d is not recorded a second time
        (functional collectives reach ``c10d::allreduce_`` too)."""
        tls = self.tls
        outer = tls.busy
        tls.busy = True
        try:
            return fn(*args, **kwargs)
        finally:
            tls.busy = outer

    def track(self, work, rows) -> None:
        """Wait for ``work``'s completion: a future callback where the backend has one, else Work.wait."""
        key = id(work)
        entry = next(self.entry_numbers)          # add_pending's two lines, here: every async collective passes
        self.rec.pending[key] = (work, rows, rows[0][_ISSUE], entry)
        kind = (rows[0][_OP], rows[0][_GROUP])
        if kind in self.futureless:
            return
        try:
            fut = work.get_future()
        except RuntimeError:
            self.futureless.add(kind)
            return
        # add_done_callback: no child future to build (then() costs ~3x as much on the training thread)
        fut.add_done_callback(partial(self.done, key, entry))

    def expire_pending(self, all_=False) -> None:
        """Flusher: write rows whose work was never seen to complete (end_ns null) when too many or at exit."""
        rec = self.rec
        pending = rec.pending
        if not pending or (not all_ and len(pending) <= MAX_PENDING):
            return
        keys = sorted(pending, key=lambda k: pending[k][2])
        for k in keys if all_ else keys[: len(keys) - MAX_PENDING // 2]:
            item = pending.pop(k, None)
            if item is not None:
                rec.writer.extend("collectives", item[1])

    # ---- the wrappers -------------------------------------------------------------------------------------------

    def wrap_collective(self, api, orig, caller_depth: int = 1):
        """``orig`` recording its call; ``caller_depth``: the caller's frame, 2 when called from another wrapper
        (wrap_pipeline_p2p)."""
        op, extract = _APIS[api]
        p2p = op in _P2P
        skip_observer = api in ("all_reduce", "all_reduce_coalesced")   # the calls that reach c10d::allreduce_
        hooks, rec, tls, source_by_code = self, self.rec, self.tls, self.source_by_code
        caller_source, group_info, where, track, peer_of = (self.caller_source, self.group, self.where, self.track,
                                                           self.global_peer)

        def wrapper(*args, **kwargs):
            if rec.disabled or not rec.active or tls.busy:
                return orig(*args, **kwargs)
            try:
                issue = now()
                if rec.fault_test == "collective":
                    raise RuntimeError("injected fault (DTPROF_TEST_FAULT=collective)")
                in_b, out_b, dtype, group, peer, async_op = extract(peer_of, *args, **kwargs)
                bucket = tls.bucket
                if bucket is None:
                    caller = sys._getframe(caller_depth)
                    api_name, source, bucket_index = api, source_by_code.get(caller.f_code) or caller_source(caller), \
                        None
                else:
                    api_name, source, bucket_index = "ddp_bucket", "ddp", bucket[0]
                    bucket[2] = True
                    if bucket[1]:
                        rec.ddp_last_issue_ns = issue
                if p2p:
                    name, size, seq = where(op, group, peer)
                else:      # where() for a collective, without its frame: Lightning issues three every step
                    name, size, _pg, counter = rec.groups.get(None if group is None else id(group)) or group_info(group)
                    seq = next(counter)
                # the row's columns up to issue_ns (what the heartbeat names while the call runs) and its bucket and
                # stage, built here rather than through make_row: every collective passes here, and each call on
                # its path costs the training thread
                head = (rec.rank, rec.step, op, api_name, source, name, size, seq, in_b, out_b, dtype, peer,
                        bool(async_op), issue)
                stage, mb = tls.stage_mb or _NO_STAGE
                if not async_op:
                    rec.collective = (head, issue)
            except Exception:
                rec.fault(f"collective wrapper ({api})")
                return orig(*args, **kwargs)
            tls.busy = True
            try:
                # a tensor's requires_grad read here, anything else (a list, a keyword) by _no_grad
                if skip_observer and hooks.observer_keys is not None and (
                        args and getattr(args[0], "requires_grad", None) is False or _no_grad(args, kwargs)):
                    with hooks.exclude_keys(hooks.observer_keys):
                        result = orig(*args, **kwargs)
                else:
                    result = orig(*args, **kwargs)
            finally:
                tls.busy = False
                rec.collective = None
            try:
                ret = now()
                rec.last_progress_ns = ret
                if async_op and result is not None:
                    track(result, [collective_row(*head, ret, None, None, bucket_index, stage, mb)])
                else:
                    if p2p and op == "recv" and peer is None and isinstance(result, int):
                        head = head[:_PEER] + (result,) + head[_PEER + 1:]
                    rec.append_collective(collective_row(*head, ret, ret, None, bucket_index, stage, mb))
                    rec.append_span(span_row(head[0], head[1], "comm_wait", api, issue, ret))
            except Exception:
                rec.fault(f"collective wrapper ({api})")
            return result

        return _dressed_as(wrapper, orig, api)

    def wrap_pipeline_p2p(self, api, orig, generic):
        """isend/irecv called as torch's pipelining calls them, once per micro-batch and direction: ``op(tensor,
        group=g, tag=t, group_dst=r)`` (``group_src=r``), from schedules._batch_p2p. The row wrap_collective makes,
        in one Python frame instead of five (each frame costs the training thread several µs, cold, in a real job).
        Any other call goes to ``generic``, wrap_collective's wrapper."""
        op, peer_arg = ("send", "group_dst") if api == "isend" else ("recv", "group_src")
        pipeline_form = {"group", "tag", peer_arg}
        rec, tls, source_by_code, routes = self.rec, self.tls, self.source_by_code, self.p2p_routes
        caller_source, group_info, track, seq_counter, global_peer = (self.caller_source, self.group, self.track,
                                                                      self.seq_counter, self.global_peer)

        def wrapper(*args, **kwargs):
            if len(args) != 1 or kwargs.keys() != pipeline_form or rec.disabled or not rec.active or tls.busy \
                    or tls.bucket is not None or rec.fault_test:
                return generic(*args, **kwargs)
            try:
                issue = now()
                tensor, group, group_peer = args[0], kwargs["group"], kwargs[peer_arg]
                route_key = (None if group is None else id(group), group_peer, op)
                route = routes.get(route_key)
                if route is None:
                    name, size = group_info(group)[:2]
                    peer = global_peer(group, None, group_peer)
                    seq_key = (name, rec.rank, peer) if op == "send" else (name, peer, rec.rank)
                    route = routes[route_key] = (name, size, peer, seq_key)
                name, size, peer, seq_key = route
                seq = next(rec.seq.get(seq_key) or seq_counter(seq_key))
                b = tensor.numel() * tensor.element_size()
                caller = sys._getframe(1)
                head = (rec.rank, rec.step, op, api, source_by_code.get(caller.f_code) or caller_source(caller),
                        name, size, seq, b if op == "send" else 0, 0 if op == "send" else b,
                        _DTYPE_NAMES.get(tensor.dtype) or _dtype(tensor), peer, True, issue)
                stage, mb = tls.stage_mb or _NO_STAGE
            except Exception:
                rec.fault(f"collective wrapper ({api})")
                return orig(*args, **kwargs)
            tls.busy = True
            try:
                work = orig(*args, **kwargs)
            finally:
                tls.busy = False
            try:
                ret = now()
                rec.last_progress_ns = ret
                if work is not None:
                    track(work, [collective_row(*head, ret, None, None, None, stage, mb)])
            except Exception:
                rec.fault(f"collective wrapper ({api})")
            return work

        return _dressed_as(wrapper, orig, api)

    def current_p2p_op(self, p) -> str:
        """Give P2POp ``p`` the isend/irecv now in c10d (dtprof's wrapper or torch's own, set_wrappers); returns
        which ("isend" or "irecv")."""
        api = self.api_of.get(p.op, "")
        if api:
            op = getattr(self.c10d, api)
            if p.op is not op:
                p.op = op
        return api

    def wrap_batch_isend_irecv(self, orig):
        rec, tls = self.rec, self.tls

        def batch_isend_irecv(p2p_op_list):
            if rec.disabled or not rec.active or tls.busy:
                return orig(p2p_op_list)
            try:
                issue = now()
                step = rec.step
                calls = []          # the arguments of each op's row, complete but for return_ns
                for p in p2p_op_list:
                    is_send = self.current_p2p_op(p) == "isend"
                    op = "send" if is_send else "recv"
                    b = _nbytes(p.tensor)
                    stage, mb = getattr(p, "_dtprof_stage_mb", (None, None))
                    source = "pipeline" if stage is not None else self.caller_source(sys._getframe(1))
                    calls.append((op, source, self.where(op, p.group, p.peer), b if is_send else 0,
                                  0 if is_send else b, _dtype(p.tensor), p.peer, stage, mb))
            except Exception:
                rec.fault("batch_isend_irecv wrapper")
                return orig(p2p_op_list)
            tls.busy = True
            try:
                works = orig(p2p_op_list)
            finally:
                tls.busy = False
            try:
                ret = now()
                rows = [self.make_row(op, "batch_isend_irecv", source, where, in_b, out_b, dtype, peer, True, issue,
                                      ret, None, None, stage, mb, step)
                        for op, source, where, in_b, out_b, dtype, peer, stage, mb in calls]
                if works and len(works) == len(rows):
                    for w, r in zip(works, rows):
                        self.track(w, [r])
                elif works:                      # coalesced (NCCL): one work for the whole batch
                    self.track(works[-1], rows)
                else:
                    rec.writer.extend("collectives", rows)
            except Exception:
                rec.fault("batch_isend_irecv wrapper")
            return works

        batch_isend_irecv.__wrapped__ = orig
        batch_isend_irecv.__doc__ = orig.__doc__
        return batch_isend_irecv

    def wrap_work_wait(self, orig):
        rec, tls = self.rec, self.tls

        def wait(work, *args, **kwargs):
            if rec.disabled or not rec.active or tls.busy:
                return orig(work, *args, **kwargs)
            t0 = now()
            item = rec.pending.get(id(work))
            if item is not None:
                rec.collective = (item[1][0], t0)
            try:
                return orig(work, *args, **kwargs)
            finally:
                rec.collective = None
                try:
                    t1 = now()
                    rec.last_progress_ns = t1
                    rec.append_span(span_row(rec.rank, rec.step, "comm_wait", "wait", t0, t1))
                    if item is not None:      # else nothing of this work is recorded, or its callback completed it
                        self.complete(id(work), t1)
                except Exception:
                    rec.fault("Work.wait wrapper")

        wait.__wrapped__ = orig
        return wait

    # ---- DDP ----------------------------------------------------------------------------------------------------

    def wrap_comm_hook(self, hook):
        """A DDP comm hook that records each bucket; the future DDP gets back is the hook's own, unchanged."""
        rec, tls = self.rec, self.tls

        def dtprof_comm_hook(state, bucket):
            if rec.disabled or not rec.active:
                return hook(state, bucket)
            try:
                issue = now()
                ctx = [bucket.index(), bucket.is_last(), False]
            except Exception:
                rec.fault("DDP comm hook")
                return hook(state, bucket)
            tls.bucket = ctx
            try:
                fut = hook(state, bucket)
            finally:
                tls.bucket = None
            try:
                # the hook's collective did not pass through Python: record the bucket itself
                if not ctx[2] and not rec.disabled:
                    buf = bucket.buffer()
                    b = _nbytes(buf)
                    pg = state if state is not None and hasattr(state, "group_name") else None
                    row = self.make_row("all_reduce", "ddp_bucket", "ddp", self.where("all_reduce", pg, None), b, b,
                                        _dtype(buf), None, True, issue, now(), bucket=ctx[0])
                    key = id(fut)
                    fut.add_done_callback(partial(self.done, key, self.add_pending(key, fut, [row])))
                    if ctx[1]:
                        rec.ddp_last_issue_ns = issue
            except Exception:
                rec.fault("DDP comm hook")
            return fut

        dtprof_comm_hook.__qualname__ = getattr(hook, "__qualname__", "hook")
        dtprof_comm_hook.__wrapped__ = hook
        return dtprof_comm_hook

    def observe_dispatched_allreduce(self) -> None:
        """Put a recording kernel for ``c10d::allreduce_`` above the CPU and CUDA kernels (module docstring)."""
        import torch
        import torch.distributed as dist

        op = torch.ops.c10d.allreduce_.default
        below_autograd = torch._C._after_autograd_keyset
        unbox_pg, unbox_work = dist.ProcessGroup.unbox, dist.Work.unbox
        rec, tls, group_info, track = self.rec, self.tls, self.group, self.track

        def allreduce_(keyset, tensors, process_group, *args):
            """A ``c10d::allreduce_`` issued from C++ (DDP's Reducer, a built-in or C++-calling comm hook, a direct
            ``ProcessGroup.allreduce``): one async row, completed by the work's future. Every DDP bucket passes here
            on the training thread, so the row is made in this one frame: no imports, no lookups that can be made
            once."""
            if rec.disabled or not rec.active or tls.busy:
                return op.redispatch(keyset & below_autograd, tensors, process_group, *args)
            issue = now()
            out = op.redispatch(keyset & below_autograd, tensors, process_group, *args)
            try:
                ret = now()
                if rec.fault_test == "collective":
                    raise RuntimeError("injected fault (DTPROF_TEST_FAULT=collective)")
                first = tensors[0] if tensors else None
                ctx = tls.bucket
                if ctx is not None:                                   # inside a (wrapped) user comm hook
                    ctx[2] = True
                    source, api, bucket = "ddp", "ddp_bucket", ctx[0]
                elif rec.in_backward or threading.get_ident() != _MAIN_THREAD:
                    source = "ddp"
                    # a gradient bucket (else the unused-parameter map)
                    if first is not None and first.is_floating_point():
                        api, bucket = "ddp_bucket", rec.ddp_next_bucket
                        rec.ddp_next_bucket += 1
                    else:
                        api, bucket = "all_reduce", None
                else:
                    source, api, bucket = "user", "ProcessGroup.allreduce", None
                if source == "ddp":
                    rec.ddp_last_issue_ns = issue
                if len(tensors) == 1:
                    b, dtype = first.numel() * first.element_size(), _DTYPE_NAMES.get(first.dtype) or _dtype(first)
                else:
                    b, dtype = _nbytes_list(tensors), _dtype(first)
                pg = unbox_pg(process_group)
                name, size, _pg, counter = rec.groups.get(id(pg)) or group_info(pg)      # where(), without its frame
                seq = next(counter)
                track(unbox_work(out[1]), [collective_row(rec.rank, rec.step, "all_reduce", api, source, name, size,
                                                          seq, b, b, dtype, None, True, issue, ret, bucket=bucket)])
            except Exception:
                rec.fault("c10d::allreduce_ observer")
            return out

        lib = torch.library.Library("c10d", "IMPL")
        keys = ("AutogradCPU", "AutogradCUDA")
        for key in keys:
            lib.impl("allreduce_", allreduce_, key, with_keyset=True)
        self.library = lib
        self.exclude_keys = torch._C._ExcludeDispatchKeyGuard
        observer_keys = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, keys[0]))
        for key in keys[1:]:
            observer_keys = observer_keys | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
        self.observer_keys = observer_keys

    def install_ddp(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        orig_register = DDP.register_comm_hook
        rec = self.rec

        def register_comm_hook(ddp, state, hook):
            if rec.disabled or not rec.active:
                return orig_register(ddp, state, hook)
            return orig_register(ddp, state, self.wrap_comm_hook(hook))

        register_comm_hook.__doc__ = orig_register.__doc__
        self.patch(DDP, "register_comm_hook", register_comm_hook)
        self.kernel_wanted = True
        self.observe_dispatched_allreduce()

    # ---- pipelining ---------------------------------------------------------------------------------------------

    def wrap_chunk(self, orig, kind, name):
        rec = self.rec

        def chunk(stage, chunk_id, *args, **kwargs):
            if rec.disabled or not rec.active:
                return orig(stage, chunk_id, *args, **kwargs)
            t0 = now()
            try:
                return orig(stage, chunk_id, *args, **kwargs)
            finally:
                try:
                    t1 = now()
                    rec.last_progress_ns = t1
                    # rec.span's row, built here (each micro-batch's forward and backward pass here)
                    rec.append_span(span_row(rec.rank, rec.step, kind, name, t0, t1, stage.stage_index,
                                             int(chunk_id)))
                except Exception:
                    rec.fault(f"pipeline {name}")

        chunk.__wrapped__ = orig
        return chunk

    def wrap_batch_p2p(self, orig):
        """schedules._batch_p2p calls isend/irecv directly for all-send or all-recv batches: pass the ops' common
        stage and microbatch to their rows (``tls.stage_mb``), and hand each op the isend/irecv in place."""
        rec, tls = self.rec, self.tls

        def _batch_p2p(p2p_ops, *args, **kwargs):
            if not rec.active:
                return orig(p2p_ops, *args, **kwargs)
            tag = None      # the ops' common (stage, microbatch), if they have one
            for i, p in enumerate(p2p_ops or ()):
                api = self.api_of.get(p.op)
                if api is not None and p.op is not getattr(self.c10d, api):
                    self.current_p2p_op(p)    # built with the isend/irecv not in place now (rare: no call otherwise)
                t = getattr(p, "_dtprof_stage_mb", None)
                if i == 0:
                    tag = t
                elif t != tag:
                    tag = None
                    break
            tls.stage_mb = tag
            try:
                return orig(p2p_ops, *args, **kwargs)
            finally:
                tls.stage_mb = None

        _batch_p2p.__wrapped__ = orig
        return _batch_p2p

    def wrap_schedule_step(self, orig):
        rec = self.rec

        def step(schedule, *args, **kwargs):
            if rec.disabled or not rec.active:
                return orig(schedule, *args, **kwargs)
            try:
                if not getattr(schedule, "_dtprof_announced", False):
                    schedule._dtprof_announced = True
                    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
                    rec.meta("pipeline_schedule", {
                        "schedule": type(schedule).__name__,
                        "stages": _int_or_none(getattr(schedule, "_num_stages", None)),
                        "microbatches": _int_or_none(getattr(schedule, "_n_microbatches", None)),
                        "stage_indices": [int(s.stage_index) for s in stages if s is not None]})
                if not rec.pp_active:
                    rec.begin_pipeline_step(args)
            except Exception:
                rec.fault("pipeline schedule step")
            rec.pp_active += 1
            try:
                return orig(schedule, *args, **kwargs)
            finally:
                rec.pp_active -= 1
                if not rec.pp_active and rec.parked_hooks:
                    try:
                        rec.unpark_hooks()
                    except Exception:
                        rec.fault("pipeline schedule step")

        step.__wrapped__ = orig
        return step

    def install_pipelining(self) -> None:
        from torch.distributed.pipelining import schedules, stage

        # through swap: set_wrappers(False) takes these out too, so that an A/B block's "off" runs none of dtprof
        base = stage._PipelineStageBase
        for meth, kind in (("forward_one_chunk", "pp_forward"), ("backward_one_chunk", "pp_backward"),
                           ("backward_weight_one_chunk", "pp_backward")):
            if meth in base.__dict__:
                orig = base.__dict__[meth]
                self.swap(base, meth, orig, self.wrap_chunk(orig, kind, meth.replace("_one_chunk", "")))
        for meth in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
            if meth in base.__dict__:
                orig = base.__dict__[meth]
                self.swap(base, meth, orig, _wrap_ops_getter(orig))
        if hasattr(schedules, "_batch_p2p"):
            self.swap(schedules, "_batch_p2p", schedules._batch_p2p, self.wrap_batch_p2p(schedules._batch_p2p))
        for obj in list(vars(schedules).values()):
            if isinstance(obj, type) and issubclass(obj, schedules._PipelineSchedule) and "step" in obj.__dict__:
                orig = obj.__dict__["step"]
                self.swap(obj, "step", orig, self.wrap_schedule_step(orig))

    # ---- installation -------------------------------------------------------------------------------------------

    def install_later(self, module_name, installer) -> None:
        rec = self.rec

        def run():
            try:
                installer()
            except Exception:
                rec.event("warning", f"{installer.__name__.removeprefix('install_')} hooks unavailable: "
                                     f"{sys.exc_info()[0].__name__}: {sys.exc_info()[1]}")

        if module_name in sys.modules:
            run()
        else:
            finder = _AfterImport(module_name, run)
            self.finders.append(finder)
            sys.meta_path.insert(0, finder)

    def wrap_init_process_group(self, orig):
        rec = self.rec

        def init_process_group(*args, **kwargs):
            result = orig(*args, **kwargs)
            try:
                rec.groups.pop(None, None)
                rec.refresh_identity()
            except Exception:
                pass
            return result

        init_process_group.__wrapped__ = orig
        init_process_group.__doc__ = orig.__doc__
        return init_process_group

    def swap(self, owner, name: str, orig, wrapper) -> None:
        """Put ``wrapper`` in place of ``orig``, switched by set_wrappers."""
        setattr(owner, name, wrapper)
        self.swapped[(owner, name)] = (orig, wrapper)

    def patch(self, owner, name: str, new) -> None:
        """Put ``new`` in place of ``owner.name`` until remove()."""
        self.patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def set_wrappers(self, on: bool) -> None:
        """Put dtprof's collective and pipelining wrappers, its ``Work.wait`` and its ``c10d::allreduce_`` kernel
        in (on) or take them out (off: those calls run as without dtprof), for measuring what they cost
        (benchmarks/overhead.py; the runtime's A/B blocks). Other patched methods (DeviceMesh, DDP's
        register_comm_hook: not on a step's path) stay and pass through while the recorder is not active."""
        for (owner, name), (orig, wrapper) in self.swapped.items():
            setattr(owner, name, wrapper if on else orig)
        if on and self.kernel_wanted and self.library is None:
            self.observe_dispatched_allreduce()
        elif not on and self.library is not None:
            self.library._destroy()
            self.library = self.observer_keys = None

    def install(self) -> None:
        """Wrap the c10d collectives, and DDP's and pipelining's hooks once they are imported."""
        import torch.distributed as dist

        if not dist.is_available():
            return
        c10d = self.c10d = dist.distributed_c10d
        for api in _APIS:
            orig = getattr(c10d, api, None)
            if orig is None:
                continue
            if api in ("isend", "irecv"):
                w = self.wrap_pipeline_p2p(api, orig, self.wrap_collective(api, orig, caller_depth=2))
            else:
                w = self.wrap_collective(api, orig)
            self.api_of[orig] = self.api_of[w] = api
            self.swap(c10d, api, orig, w)
            if getattr(dist, api, None) is orig:
                self.swap(dist, api, orig, w)
        orig = c10d.batch_isend_irecv
        w = self.wrap_batch_isend_irecv(orig)
        self.swap(c10d, "batch_isend_irecv", orig, w)
        self.swap(dist, "batch_isend_irecv", orig, w)
        ipg = self.wrap_init_process_group(c10d.init_process_group)
        self.patch(c10d, "init_process_group", ipg)
        self.patch(dist, "init_process_group", ipg)
        self.swap(dist.Work, "wait", dist.Work.wait, self.wrap_work_wait(dist.Work.wait))

        # P2POp(op, ...) checks its op against c10d's isend/irecv, ours while dtprof's wrappers are in and torch's
        # while they are out; code that took one of them earlier (`from torch.distributed import isend`) holds the
        # other. The check accepts both, always (it replaces torch's one, at no cost); the batch wrappers hand each
        # op the one in place (current_p2p_op)
        torch_check = getattr(c10d, "_check_op", None)
        api_of = self.api_of

        def _check_op(op) -> None:
            if api_of.get(op) not in ("isend", "irecv"):
                torch_check(op)

        if torch_check is not None:      # a torch without it checks otherwise, or not at all
            self.patch(c10d, "_check_op", _check_op)
        self.install_later("torch.nn.parallel.distributed", self.install_ddp)
        self.install_later("torch.distributed.pipelining", self.install_pipelining)

    def remove(self) -> None:
        """Take every hook out: torch's own functions, methods and kernels back, as before install()."""
        self.set_wrappers(False)
        self.swapped.clear()
        self.kernel_wanted = False
        for owner, name, orig in reversed(self.patched):
            setattr(owner, name, orig)
        self.patched.clear()
        for finder in self.finders:
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
        self.finders.clear()


def _dressed_as(wrapper, orig, api: str):
    """``wrapper`` with ``orig``'s name, doc and module, and ``__wrapped__`` = ``orig``."""
    wrapper.__wrapped__ = orig
    wrapper.__name__ = getattr(orig, "__name__", api)
    wrapper.__qualname__ = getattr(orig, "__qualname__", api)
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    wrapper.__module__ = getattr(orig, "__module__", None)
    return wrapper


def _no_grad(args, kwargs) -> bool:
    """True when no tensor argument of an all_reduce / all_reduce_coalesced call requires grad."""
    x = args[0] if args else kwargs.get("tensor", kwargs.get("tensors"))
    if isinstance(x, (list, tuple)):
        return not any(getattr(t, "requires_grad", False) for t in x)
    return not getattr(x, "requires_grad", False)


def _wrap_ops_getter(orig):
    def get_ops(stage, chunk_id, *args, **kwargs):
        ops = orig(stage, chunk_id, *args, **kwargs)
        try:
            for p in ops or ():
                p._dtprof_stage_mb = (stage.stage_index, int(chunk_id))
        except Exception:
            pass
        return ops

    get_ops.__wrapped__ = orig
    return get_ops


def _int_or_none(v):
    return None if v is None else int(v)


class _AfterImport:
    """Meta-path finder that runs ``callback`` right after module ``name`` is first imported (importing
    torch.distributed.pipelining ourselves would cost every rank ~1.2 s)."""

    def __init__(self, name, callback):
        self.name, self.callback, self.done = name, callback, False

    def find_spec(self, name, path=None, target=None):
        if name != self.name or self.done:
            return None
        self.done = True
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            real_exec, callback = spec.loader.exec_module, self.callback

            def exec_module(module):
                real_exec(module)
                callback()

            spec.loader.exec_module = exec_module
        return spec
