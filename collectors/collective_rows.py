"""The ``collectives`` and ``groups`` rows as one rank builds them, shared by every hook object that records a
collective (c10d's functions: hooks_collectives.py; DDP's buckets: hooks_ddp.py; pipelining: hooks_pipelining.py;
functional collectives: hooks_functional.py; DeviceMesh: mesh.py): the process groups' names and seq counters, the
async operations awaiting completion, and the NCCL works awaiting their GPU-side duration. The completion rules are
in hooks_collectives.py's docstring; the fault rules in runtime.py's.

A ``CollectiveRows`` is given the rank's ``RankContext`` (collectors/parts.py), never the recorder. Its tables are
read by the hot paths (bound into the wrappers' closures): they are plain dicts and a deque, never replaced.
"""
from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from functools import partial

from dtprof.collectors.records import COLUMN, Group, collective_row

now = time.monotonic_ns


class _ThreadFlags(threading.local):
    """Per-thread flags, read on every collective: class defaults, so reading one needs no getattr default."""
    busy = False                  # inside a wrapped call
    bucket = None                 # [index, is_last, used] inside a (wrapped) DDP comm hook
    stage_mb = None               # (stage, microbatch) of the pipeline's point-to-point batch in progress
    thread_state_kept = False     # CollectiveHooks.keep_thread_state ran in this thread


MAX_PENDING = 4096
# NCCL works whose GPU-side duration (Work._get_duration(), needs TORCH_NCCL_ENABLE_TIMING=1, which `dtprof run`
# sets unless the user did) the flusher reads once the GPU has finished them (``CollectiveRows.timed``). Bounded, since
# each entry keeps its work alive.
MAX_TIMED = 2048
MAX_TIMED_TRIES = 5

MAIN_THREAD = threading.main_thread().ident
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


def nbytes(t) -> int:
    try:
        return t.numel() * t.element_size()
    except AttributeError:
        return 0


def nbytes_list(ts) -> int:
    return sum(nbytes(t) for t in ts) if ts else 0


# torch.dtype -> its name without "torch." (str() of a dtype is slow per call). A memo of a pure function of torch's
# dtypes, the same for every recorder, so it is the one table kept at module level.
DTYPE_NAMES: dict = {}


def dtype_name(t) -> str:
    try:
        return DTYPE_NAMES[t.dtype]
    except KeyError:
        name = DTYPE_NAMES[t.dtype] = str(t.dtype).replace("torch.", "")
        return name
    except AttributeError:
        return ""


def first(ts):
    return ts[0] if ts else None

_COL = COLUMN["collectives"]
_END, _ISSUE, _OP, _GROUP, _SOURCE, _GPU = (_COL[c] for c in ("end_ns", "issue_ns", "op", "group", "source",
                                                             "gpu_duration_ns"))
_P2P = ("send", "recv")


class CollectiveRows:
    """The collective-recording tables of one rank (module docstring) and the rows' parts they give."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.tls = _ThreadFlags()
        self.groups: dict = {}               # id(pg) or None -> (name, size, pg, the group's seq counter)
        self.seq: dict = {}                  # group name or (group, src, dst) -> itertools.count() of its seqs
        self.pending: dict = {}              # completion key -> (work, rows, issue_ns, entry): awaiting completion
        # NCCL works completed on the host whose GPU-side duration the flusher reads once the GPU has run them
        # (resolve_gpu_durations). A deque: future callbacks append while the flusher pops.
        self.timed: collections.deque = collections.deque()
        self.source_by_module: dict = {}     # a caller's module name -> its source
        self.source_by_code: dict = {}       # the code object of a direct caller outside c10d -> its source
        # (id(group) or None, rank in it) -> global rank: a pipeline stage names its peer so
        self.global_peers: dict = {}
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
        self.nccl_timing: bool | None = None   # decided on first use: timing enabled and CUDA present

    # ---- groups, seq and the rows' parts known before a call ------------------------------------------------

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
        return self.seq.setdefault(key, itertools.count())

    def group(self, group):
        """(name, size, pg, seq counter) for a ProcessGroup or None (the default group), cached; records new
        groups."""
        ctx = self.ctx
        info = self.groups.get(None if group is None else id(group))
        if info is not None:
            return info
        import torch.distributed as dist

        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        info = self.groups.get(id(pg))
        if info is None:
            name = getattr(pg, "group_name", None) or dist.distributed_c10d._get_process_group_name(pg)
            ranks = dist.get_process_group_ranks(pg)
            info = (str(name), len(ranks), pg, self.seq_counter(str(name)))
            try:
                backend = str(dist.get_backend(pg))
            except Exception:
                backend = ""
            ctx.add(Group(rank=ctx.rank, group=info[0], ranks=",".join(map(str, ranks)), size=len(ranks),
                          backend=backend, desc=str(getattr(pg, "group_desc", "") or ""), mesh_dim=""))
            self.groups[id(pg)] = info
        self.groups[None if group is None else id(group)] = info
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
        name, size, _pg, counter = self.groups.get(None if group is None else id(group)) or self.group(group)
        if op in _P2P:
            rank = self.ctx.rank
            key = (name, rank, peer) if op == "send" else (name, peer, rank)
            counter = self.seq.get(key) or self.seq_counter(key)
        return name, size, next(counter)

    def make_row(self, op, api, source, where, in_b, out_b, dtype, peer, async_op, issue, return_ns, end_ns=None,
                 bucket=None, stage=None, microbatch=None, step=None):
        ctx = self.ctx
        name, size, seq = where
        return collective_row(ctx.rank, ctx.step if step is None else step, op, api, source, name, size, seq, in_b,
                              out_b, dtype, peer, bool(async_op), issue, return_ns, end_ns, None, bucket, stage,
                              microbatch)

    # ---- completion ---------------------------------------------------------------------------------------------

    def add_pending(self, key, work, rows) -> int:
        """Hold ``rows`` until ``complete(key, t)`` (or expiry) gives them their end time; returns the entry's
        number for a completion callback (``complete(key, t, entry)``)."""
        entry = next(self.entry_numbers)
        self.pending[key] = (work, rows, rows[0][_ISSUE], entry)
        return entry

    def pending_rows(self, key):
        item = self.pending.get(key)
        return None if item is None else item[1]

    def complete(self, key, t, entry: int | None = None) -> None:
        """First completion of an async work wins (future callback thread or main thread's wait()). ``entry``: the
        pending entry a callback was made for; another entry under the same key is left pending."""
        item = self.pending.pop(key, None)
        if item is None:
            return
        if entry is not None and item[3] != entry:
            self.pending.setdefault(key, item)   # a later op's, whose key reuses a freed object's id
            return
        rows = item[1]
        if len(rows) == 1:     # most: one row, and no list comprehension (a Python frame) for it
            r = rows[0]
            rows = [r[:_END] + (t,) + r[_END + 1:]]          # the row with its end_ns
        else:
            rows = [r[:_END] + (t,) + r[_END + 1:] for r in rows]
        if self.nccl_timing is not False and self.wants_gpu_duration() and hasattr(item[0], "_get_duration") \
                and len(self.timed) < MAX_TIMED:
            self.timed.append((item[0], rows, 0))
        else:
            self.ctx.extend("collectives", rows)

    def complete_ddp(self, t: int) -> None:
        """The end of a backward in which DDP waited for its collectives: each one not yet completed ends at ``t``.
        Their completion callbacks are late when this thread holds the GIL as the backend's thread marks them
        complete: DDP's wait returns on the future's completion, before its callbacks run, and a callback that then
        waits for the GIL runs up to the interpreter's switch interval (5 ms) later, or never if the process exits
        first (the last step's bucket was once written with no end)."""
        # list() copies the table at once (the backend's thread may complete an item meanwhile); complete() is then
        # a no-op for it: the first completion wins
        for key, item in list(self.pending.items()):
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
            self.ctx.fault("collective completion")

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
        timed = self.timed
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
            self.ctx.extend("collectives", rows)

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
        self.pending[key] = (work, rows, rows[0][_ISSUE], entry)
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
        pending = self.pending
        if not pending or (not all_ and len(pending) <= MAX_PENDING):
            return
        keys = sorted(pending, key=lambda k: pending[k][2])
        for k in keys if all_ else keys[: len(keys) - MAX_PENDING // 2]:
            item = pending.pop(k, None)
            if item is not None:
                self.ctx.extend("collectives", item[1])
