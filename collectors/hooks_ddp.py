"""DDP's gradient buckets as one rank sees them (``collectives`` rows with api "ddp_bucket"; the ``ddp_final_wait``
``comm_wait`` span). How they are seen (a Python kernel for ``c10d::allreduce_`` above the backends' kernels, a
user's comm hook wrapped only to label its collectives) is in hooks_collectives.py's docstring.

``DdpHooks`` is made by the c10d hooks (``CollectiveHooks``), which install it once DDP is imported and switch its
kernel with their wrappers (``set_kernel``). It is given the rank's ``RankContext``, the shared ``CollectiveRows``
and the ``StepFlags`` it shares with the step clock (collectors/stepclock.py): the step clock sets ``in_backward``
and resets the bucket count at each backward; this sets ``ddp_last_issue_ns``, and the step clock calls
``end_backward`` when a backward in which DDP issued buckets returns.
"""
from __future__ import annotations

import threading
import time
from functools import partial
from typing import Any

from dtprof.collectors.collective_rows import DTYPE_NAMES, MAIN_THREAD, dtype_name, nbytes, nbytes_list
from dtprof.collectors.records import collective_row, span_row

now = time.monotonic_ns


class DdpHooks:
    """DDP's comm-hook registration wrapped and the recording ``c10d::allreduce_`` kernel, for one rank."""

    def __init__(self, ctx, rows, flags) -> None:
        self.ctx = ctx
        self.rows = rows
        self.flags = flags
        self.patched: Any = None     # (DDP, its own register_comm_hook) while installed
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

    def end_backward(self, t: int) -> None:
        """A backward in which DDP issued buckets returned at ``t``: DDP blocked at its end until its last buckets
        were reduced (a ``ddp_final_wait`` span from the last bucket's issue), and the buckets whose completion
        callback has not run yet end at ``t`` (CollectiveRows.complete_ddp)."""
        ctx, flags = self.ctx, self.flags
        ctx.append_span(span_row(ctx.rank, ctx.step, "comm_wait", "ddp_final_wait", flags.ddp_last_issue_ns, t))
        flags.ddp_last_issue_ns = None
        if self.rows.pending:   # DDP's collectives whose completion callback has not run yet
            self.rows.complete_ddp(t)

    def wrap_comm_hook(self, hook):
        """A DDP comm hook that records each bucket; the future DDP gets back is the hook's own, unchanged."""
        ctx, rows, flags, tls = self.ctx, self.rows, self.flags, self.rows.tls

        def dtprof_comm_hook(state, bucket):
            if ctx.disabled or not ctx.active:
                return hook(state, bucket)
            try:
                issue = now()
                bucket_ctx = [bucket.index(), bucket.is_last(), False]
            except Exception:
                ctx.fault("DDP comm hook")
                return hook(state, bucket)
            tls.bucket = bucket_ctx
            try:
                fut = hook(state, bucket)
            finally:
                tls.bucket = None
            try:
                # the hook's collective did not pass through Python: record the bucket itself
                if not bucket_ctx[2] and not ctx.disabled:
                    buf = bucket.buffer()
                    b = nbytes(buf)
                    pg = state if state is not None and hasattr(state, "group_name") else None
                    row = rows.make_row("all_reduce", "ddp_bucket", "ddp", rows.where("all_reduce", pg, None), b, b,
                                        dtype_name(buf), None, True, issue, now(), bucket=bucket_ctx[0])
                    key = id(fut)
                    fut.add_done_callback(partial(rows.done, key, rows.add_pending(key, fut, [row])))
                    if bucket_ctx[1]:
                        flags.ddp_last_issue_ns = issue
            except Exception:
                ctx.fault("DDP comm hook")
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
        ctx, flags, rows = self.ctx, self.flags, self.rows
        tls, groups, group_info, track = rows.tls, rows.groups, rows.group, rows.track

        def allreduce_(keyset, tensors, process_group, *args):
            """A ``c10d::allreduce_`` issued from C++ (DDP's Reducer, a built-in or C++-calling comm hook, a direct
            ``ProcessGroup.allreduce``): one async row, completed by the work's future. Every DDP bucket passes here
            on the training thread, so the row is made in this one frame: no imports, no lookups that can be made
            once."""
            if ctx.disabled or not ctx.active or tls.busy:
                return op.redispatch(keyset & below_autograd, tensors, process_group, *args)
            issue = now()
            out = op.redispatch(keyset & below_autograd, tensors, process_group, *args)
            try:
                ret = now()
                if ctx.fault_test == "collective":
                    raise RuntimeError("injected fault (DTPROF_TEST_FAULT=collective)")
                first = tensors[0] if tensors else None
                bucket_ctx = tls.bucket
                if bucket_ctx is not None:                                   # inside a (wrapped) user comm hook
                    bucket_ctx[2] = True
                    source, api, bucket = "ddp", "ddp_bucket", bucket_ctx[0]
                elif flags.in_backward or threading.get_ident() != MAIN_THREAD:
                    source = "ddp"
                    # a gradient bucket (else the unused-parameter map)
                    if first is not None and first.is_floating_point():
                        api, bucket = "ddp_bucket", flags.ddp_next_bucket
                        flags.ddp_next_bucket += 1
                    else:
                        api, bucket = "all_reduce", None
                else:
                    source, api, bucket = "user", "ProcessGroup.allreduce", None
                if source == "ddp":
                    flags.ddp_last_issue_ns = issue
                if len(tensors) == 1:
                    b, dtype = first.numel() * first.element_size(), DTYPE_NAMES.get(first.dtype) or dtype_name(first)
                else:
                    b, dtype = nbytes_list(tensors), dtype_name(first)
                pg = unbox_pg(process_group)
                name, size, _pg, counter = groups.get(id(pg)) or group_info(pg)      # where(), without its frame
                seq = next(counter)
                track(unbox_work(out[1]), [collective_row(ctx.rank, ctx.step, "all_reduce", api, source, name, size,
                                                          seq, b, b, dtype, None, True, issue, ret, bucket=bucket)])
            except Exception:
                ctx.fault("c10d::allreduce_ observer")
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

    def install(self) -> None:
        """Once DDP is imported (hooks_collectives installs it then): its comm hooks and the c10d kernel."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        orig_register = DDP.register_comm_hook
        ctx = self.ctx

        def register_comm_hook(ddp, state, hook):
            if ctx.disabled or not ctx.active:
                return orig_register(ddp, state, hook)
            return orig_register(ddp, state, self.wrap_comm_hook(hook))

        register_comm_hook.__doc__ = orig_register.__doc__
        self.patched = (DDP, orig_register)
        DDP.register_comm_hook = register_comm_hook
        self.kernel_wanted = True
        self.observe_dispatched_allreduce()

    def set_kernel(self, on: bool) -> None:
        """The ``c10d::allreduce_`` kernel in (once DDP was imported) or out (hooks_collectives.set_wrappers)."""
        if on and self.kernel_wanted and self.library is None:
            self.observe_dispatched_allreduce()
        elif not on and self.library is not None:
            self.library._destroy()
            self.library = self.observer_keys = None

    def remove(self) -> None:
        self.set_kernel(False)
        self.kernel_wanted = False
        if self.patched is not None:
            cls, orig = self.patched
            cls.register_comm_hook = orig
            self.patched = None
