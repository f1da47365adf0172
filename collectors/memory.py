"""The memory ledger: where a rank's bytes go, step by step (the ``memory`` table; docs/run-format.md, issue 48).

A rank-side part (collectors/parts.py). On the steps it samples it writes one ``memory`` row:

- ``params_bytes``, ``grads_bytes``, ``optimizer_state_bytes``: counted from the tensors themselves: the parameters
  of the modules the rank trains (the top-level modules of step 0's forwards, ``ctx.roots``; the optimizers'
  parameters when none is known), their and the optimizers' parameters' ``.grad``, every tensor in
  ``optimizer.state``, and as optimizer state an optimizer parameter that is no module parameter (a master copy:
  DeepSpeed ZeRO's fp32 partition), each storage once (keyed by ``untyped_storage().data_ptr()``), so a view, a tied
  weight or a flat buffer is counted once and a DTensor (FSDP2, tensor parallel) counts its local shard's storage, a
  ZeRO-3 parameter its partition (``ds_tensor``): what this rank holds. Grads are counted at the optimizer step,
  where they exist; an optimizer step taken one parameter group at a time (DeepSpeed ZeRO, whose fp32 grads of a
  group live only around that group's step: collectors/engine_deepspeed.py) adds the earlier groups' grads and
  parameters, read at each group's step (``on_optimizer_group``). Counted again only when the set of tensors may
  have changed (the optimizers' parameter and state counts, the number of grads present) or on every
  ``COUNT_EVERY``-th sampled step; otherwise the last count is carried (the same tensors have the same bytes).
- ``bwd_allocated_bytes``, ``bwd_grads_bytes``: at the start of the step's first backward, what the allocator holds
  (CUDA: ``torch.cuda.memory_allocated()``; CPU: glibc's ``mallinfo2`` in-use bytes, heap and mmapped chunks, where
  torch's CPU tensors live, beside the interpreter's and libraries' own) and the grads present then (none when the
  first parameter has no grad, else the last count's: grads are all set to None or all kept). The analysis takes
  what persists and the previous row's non-tensor bytes from the first to get what the forward left for backward.
- ``params_full_bytes`` (the trained parameters' bytes unsharded: a DTensor's global shape, a ZeRO-3 parameter's
  ``ds_numel``) and ``optimizer_shard_frac`` (the optimizers' parameters' local elements ÷ the trained parameters'
  full elements: 1 replicated, about 1/N under ZeRO or FSDP), read with the counts: what the what-fits levers need
  to tell which categories are already sharded.
- ``kept_unsharded_bytes``, ``kept_unsharded_max_bytes``: FSDP2 groups with ``reshard_after_forward=False`` (the
  root's left out: it never reshards): the bytes of their unsharded parameters, held from forward to backward, and
  the largest group's; null without FSDP2.
- CUDA only: ``forward_peak_bytes`` (the allocator's peak from the step's start to backward's start),
  ``backward_peak_bytes`` (to the optimizer step's start: ``on_optimizer_pre_step``, detailed steps only),
  ``peak_bytes``
  (the step's peak; the recorder resets the peak after each step, collectors/runtime.py), ``reserved_peak_bytes``,
  ``alloc_retries`` and ``ooms`` (cumulative), from ``torch.cuda.memory_stats()`` (host-side counters: no sync).
- ``allocated_bytes``: the allocator's in-use bytes at the optimizer step; ``rss_peak_bytes``: the process's resident
  high-water mark (``getrusage``; monotone over the process: on a CPU there is no per-step allocator peak), read
  when the tensors are counted.

With ``memory_history`` in the rank's options (`dtprof run --memory-history N`, opt-in: each allocation then records
its stack), a CUDA rank keeps the caching allocator's last N allocation events from its first sampled optimizer step
on (``torch.cuda.memory._record_memory_history(max_entries=N)``: a bounded ring) and writes them at an out-of-memory
exit to ``memory_snapshot.pickle`` in its rank directory (``_dump_snapshot``; named in the ``oom`` row).

At exit after an uncaught out-of-memory error (CUDA's ``OutOfMemoryError``, the CPU allocator's "can't allocate
memory") it writes an ``oom`` meta row: the request, the phase and module it was in, the allocator's state then and the
step (read from ``sys.last_value``; the traceback still holds the frames' tensors, so the allocator's figures are
those of the failure).

Cost: nothing on a boundary-only step (``every_step`` False: an optimizer is known from its first detailed step);
a few attribute reads at a detailed step's backward and optimizer step; the counting (a Python loop over the tensors)
and the allocator reads only on sampled steps (``ctx.detail``), its time measured (``cost_ns`` in the ``memory_ledger``
meta row at exit). No dispatch mode, no sync: compiled models stay compiled (the part runs in the eager code around
them: backward's call and the optimizer step).
"""
from __future__ import annotations

import ctypes
import os
import resource
import sys
import time
import weakref

from dtprof.collectors.parts import RankContext, RankPart
from dtprof.collectors.peak_memory import rss_high_water_bytes
from dtprof.collectors.records import _record

MemoryRow = _record("MemoryRow", "memory")

COUNT_EVERY = 8          # sampled steps between two full counts of an unchanged tensor set
now = time.monotonic_ns

class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _cpu_allocated():
    """glibc's bytes in use (heap chunks + mmapped chunks), or None without glibc's mallinfo2 (glibc < 2.33)."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return None
    fn.restype = _MallInfo2

    def allocated() -> int:
        m = fn()
        return int(m.uordblks + m.hblkhd)
    return allocated


def _storage_key(t):
    """(key, bytes) of the storage a tensor lives in; a DTensor's local shard, a DeepSpeed ZeRO-3 parameter's
    partition (``ds_tensor``: its ``data`` is empty outside its forward). The key is the storage's address: host and
    device memory share one virtual address space (CUDA's unified addressing), so it names one storage whatever the
    device (reading ``t.device`` would double the count's time)."""
    s = _local(t).untyped_storage()
    return s.data_ptr(), s.nbytes()


def _local(t):
    """The tensor this rank holds of ``t``: a DTensor's local shard, a ZeRO-3 parameter's partition, else ``t``."""
    local = getattr(t, "_local_tensor", None)
    if local is None:
        local = getattr(t, "ds_tensor", None)
    return t if local is None else local


def _full_numel(t) -> int:
    """The elements of ``t`` unsharded: a DTensor's global shape, a ZeRO-3 parameter's ``ds_numel``."""
    n = getattr(t, "ds_numel", None)
    return int(n) if n is not None else int(t.numel())


def _tensors_bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        try:
            key, n = _storage_key(t)
        except Exception:        # a tensor without storage (meta, fake): nothing held
            continue
        if key and key not in seen:
            seen.add(key)
            total += n
    return total


class MemoryLedger(RankPart):
    name = "memory"
    every_step = False        # a boundary-only step has nothing to count: its callbacks are not called there

    def __init__(self):
        self.optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.counts = None        # (params, grads, optimizer state) bytes of the last count
        self.shards = (None, None, None, None)  # the last count's _shards()
        self.signature = None     # what the last count was made of
        self.sampled = 0          # sampled steps since the last full count
        self.bwd = None           # (allocated, grads present) at the step's first backward
        self.fwd_peak = None
        self.bwd_peak = None      # CUDA: the allocator's peak at the step's optimizer step's start
        self.cost_ns = 0
        self.rows = 0
        self.step_of_row = -1
        self.rss_peak = None
        self.torch = None
        self.cuda = False
        self.cpu_allocated = None
        self.history = False      # the allocator's history ring is on (--memory-history)
        self.has_cuda = False
        self.groups: list = []    # the earlier groups of a grouped optimizer step: [params, [(grad ref, key, bytes)]]

    def install(self, ctx: RankContext) -> None:
        import torch

        self.ctx = ctx
        self.torch = torch
        self.cpu_allocated = _cpu_allocated()
        # once: is_available() asks the driver (tens of µs), and a process's CUDA does not come or go
        self.has_cuda = bool(torch.cuda.is_available())

    # ---- the tensors ------------------------------------------------------------------------------------------

    def _params(self):
        for opt in list(self.optimizers):
            for g in opt.param_groups:
                yield from g["params"]
        for params, _ in self.groups:
            yield from params

    def _signature(self):
        opts = list(self.optimizers)
        return (tuple(id(o) for o in opts), tuple(sum(len(g["params"]) for g in o.param_groups) for o in opts),
                tuple(len(o.state) for o in opts))

    def _grads_present(self) -> int:
        """The grads' bytes at backward's start without a pass over the parameters: none when the first parameter
        has no grad (zero_grad(set_to_none=True) before the step), else the last count's (grads accumulate)."""
        first = next(self._params(), None)
        if first is None or first.grad is None or self.counts is None:
            return 0
        return self.counts[1]

    def _model_params(self) -> list:
        roots = self.ctx.roots() if self.ctx.roots is not None else []
        return list({id(p): p for m in roots for p in m.parameters()}.values())

    def _count(self) -> tuple[int, int, int]:
        """(params, grads, optimizer state) bytes. Params: the trained modules' parameters (the roots step 0's
        forwards ran), else the optimizers'; an optimizer parameter that is no module parameter's storage is a master
        copy (ZeRO's fp32 partition, a mixed-precision master): optimizer state, as ZeRO's accounting has it."""
        seen: set = set()
        model = self._model_params()
        opt = list(self._params())
        params = _tensors_bytes(model or opt, seen)
        masters = _tensors_bytes(opt, seen) if model else 0
        grads = _tensors_bytes((p.grad for p in (*model, *opt) if p.grad is not None), seen)
        # the earlier groups' grads: freed since (their address may be a later group's now), or counted above
        grads += sum(n for _, refs in self.groups for ref, key, n in refs if ref() is None or key not in seen)
        state = masters + _tensors_bytes((v for o in list(self.optimizers) for st in o.state.values()
                                          if isinstance(st, dict) for v in st.values()
                                          if isinstance(v, self.torch.Tensor)), seen)
        return params, grads, state

    def _shards(self) -> tuple[int, float | None, int | None, int | None]:
        """(the trained parameters' bytes unsharded, the optimizers' parameters' local elements ÷ the trained
        parameters' full elements, ``_kept_unsharded``): what the what-fits levers need to tell a replicated
        category (1) from a ZeRO/FSDP-sharded one (1/N), and FSDP2 groups not resharded after forward."""
        model = self._model_params() or list(self._params())
        full = sum(_full_numel(p) for p in model)
        full_bytes = sum(_full_numel(p) * p.element_size() for p in model)
        opt = sum(int(_local(p).numel()) for p in {id(p): p for p in self._params()}.values())
        return (full_bytes, opt / full if full else None, *self._kept_unsharded())

    def _kept_unsharded(self) -> tuple[int | None, int | None]:
        """FSDP2 modules that keep their parameters unsharded from forward to backward (``reshard_after_forward``
        False; the root's group never reshards, so it is left out): (their unsharded bytes, the largest group's),
        or (None, None) without FSDP2."""
        groups = []
        roots = self.ctx.roots() if self.ctx.roots is not None else []
        for m in {id(m): m for r in roots for m in r.modules()}.values():
            get = getattr(m, "_get_fsdp_state", None)
            if get is None:
                continue
            state = get()
            group = getattr(state, "_fsdp_param_group", None)
            if group is None:
                continue
            if state._is_root or group.post_forward_mesh_info is not None:
                groups.append(0)
                continue
            groups.append(sum(fp.sharded_param.numel() * (fp.param_dtype or fp.orig_dtype).itemsize
                              for fp in group.fsdp_params))
        return (sum(groups), max(groups)) if groups else (None, None)

    def _allocated(self):
        if self.cuda:
            return int(self.torch.cuda.memory_allocated())
        return self.cpu_allocated() if self.cpu_allocated is not None else None

    # ---- callbacks --------------------------------------------------------------------------------------------

    def on_backward(self, tensors) -> None:
        if self.bwd is not None or not self.ctx.detail or not self.optimizers:
            return            # the step's first backward only; before the first optimizer step nothing is known
        t0 = now()
        torch = self.torch
        self.cuda = self.has_cuda and torch.cuda.is_initialized()
        if self.cuda:
            self.fwd_peak = int(torch.cuda.max_memory_allocated())
        self.bwd = (self._allocated(), self._grads_present())
        self.cost_ns += now() - t0

    def on_optimizer_pre_step(self, optimizer) -> None:
        """CUDA, detailed steps: the allocator's peak when the step's first optimizer step starts (forward and
        backward's peak)."""
        if self.cuda and self.bwd is not None and self.bwd_peak is None:
            self.bwd_peak = int(self.torch.cuda.max_memory_allocated())

    def on_optimizer_group(self, optimizer) -> None:
        if not self.ctx.detail or self.ctx.step == self.step_of_row:
            return
        t0 = now()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        refs, seen = [], set()
        for p in params:
            g = p.grad
            if g is not None:
                key, n = _storage_key(g)
                if key and key not in seen:
                    seen.add(key)
                    refs.append((weakref.ref(g), key, n))
        self.groups.append((params, refs))
        self.cost_ns += now() - t0

    def on_optimizer_step(self, optimizer) -> None:
        new = optimizer not in self.optimizers
        if new:
            self.optimizers[optimizer] = True
        step = self.ctx.step
        if not self.ctx.detail or step == self.step_of_row:
            if new:
                self.signature = None
            return
        t0 = now()
        sig = self._signature()
        self.sampled += 1
        if sig != self.signature or self.counts is None or self.sampled >= COUNT_EVERY:
            self.counts = self._count()
            self.shards = self._shards()
            self.signature, self.sampled = sig, 0
            # monotone, and a system call that sums over the process's threads: read with the counts only
            self.rss_peak = rss_high_water_bytes()
        params, grads, state = self.counts
        stats = {}
        torch = self.torch
        self.cuda = self.has_cuda and torch.cuda.is_initialized()
        if self.cuda and not self.history and self.ctx.options.get("memory_history"):
            self.history = True       # once, whatever happens: a ring that cannot start is not retried each step
            torch.cuda.memory._record_memory_history(max_entries=int(self.ctx.options["memory_history"]))
        if self.cuda:
            stats = torch.cuda.memory_stats()
        bwd_alloc, bwd_grads = self.bwd if self.bwd is not None else (None, None)
        self.ctx.add(MemoryRow(
            self.ctx.rank, step, now(), params, grads, state, bwd_alloc, bwd_grads,
            self._allocated(),
            self.fwd_peak if self.cuda else None,
            stats.get("allocated_bytes.all.peak"), stats.get("reserved_bytes.all.peak"),
            stats.get("num_alloc_retries"), stats.get("num_ooms"), self.rss_peak, *self.shards[:2],
            self.bwd_peak if self.cuda else None, *self.shards[2:]))
        self.rows += 1
        self.step_of_row = step
        self.bwd = self.fwd_peak = self.bwd_peak = None
        self.groups = []
        self.cost_ns += now() - t0

    def on_step_end(self, step: int, t_ns: int, detailed: bool) -> None:
        # a step without an optimizer step (dtprof.step()) starts afresh
        self.bwd = self.fwd_peak = self.bwd_peak = None
        self.groups = []

    def on_exit(self) -> None:
        self.ctx.meta("memory_ledger", {"rows": self.rows, "cost_ns": self.cost_ns,
                                        "cpu_allocator": self.cpu_allocated is not None})
        exc = getattr(sys, "last_value", None)
        if exc is None:
            return
        from dtprof import oom

        exc, parsed = oom.in_chain(exc)
        if exc is None or parsed is None:
            return
        self.ctx.meta("oom", self.oom_record(exc, parsed["requested_bytes"]))

    def oom_record(self, exc, request: int) -> dict:
        """What the rank held when an allocation failed: the request, the phase and module (from the traceback's
        frames: the out-of-memory error's own, where another exception wraps it), the allocator's figures (the
        traceback still holds the frames' tensors) and the last count."""
        phase, module = _phase_of(getattr(exc, "__traceback__", None) or getattr(sys, "last_traceback", None))
        rec = {"step": self.ctx.step, "requested_bytes": request, "phase": phase, "module": module,
               "message": str(exc).splitlines()[0][:500], "type": type(exc).__name__,
               "allocated_bytes": None, "reserved_bytes": None, "device_total_bytes": None,
               "device_free_bytes": None}
        try:
            rec["allocated_bytes"] = self._allocated()
            if self.cuda:
                torch = self.torch
                rec["reserved_bytes"] = int(torch.cuda.memory_reserved())
                free, total = torch.cuda.mem_get_info()
                rec.update(device_free_bytes=int(free), device_total_bytes=int(total))
            else:
                rec.update(_cpu_room())
        except Exception:
            pass
        if self.counts is not None:
            rec.update(zip(("params_bytes", "grads_bytes", "optimizer_state_bytes"), self.counts))
        if self.history:
            try:
                path = os.path.join(self.ctx.rank_dir, "memory_snapshot.pickle")
                self.torch.cuda.memory._dump_snapshot(path)
                rec["snapshot"] = "memory_snapshot.pickle"
            except Exception:
                pass
        return rec


def _cpu_room() -> dict:
    """A CPU rank's room: the machine's available memory (/proc/meminfo MemAvailable) and, under an address-space
    limit (RLIMIT_AS), what is left of it; the smaller is what an allocation could have had."""
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    free = avail
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        free = min(free, max(0, limit - vm))
        total = min(total, limit)
    return {"device_free_bytes": int(free), "device_total_bytes": int(total)}


def _phase_of(tb) -> tuple[str | None, str | None]:
    """('forward' | 'backward' | 'optimizer' | None, the innermost module's class) from a traceback's frames."""
    phase = module = None
    while tb is not None:
        f = tb.tb_frame
        path, func = f.f_code.co_filename, f.f_code.co_name
        if "/torch/autograd/" in path or (path.endswith("/torch/_tensor.py") and func == "backward"):
            phase = "backward"
        elif "/torch/optim/" in path and phase is None:
            phase = "optimizer"
        elif func == "forward" and phase is None:
            phase = "forward"
        if func == "forward":
            obj = f.f_locals.get("self")
            if obj is not None and hasattr(obj, "_modules"):
                module = type(obj).__name__
        tb = tb.tb_next
    return phase, module


def make(options: dict):
    return MemoryLedger()
