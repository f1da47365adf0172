"""Collectives, point-to-point, DDP buckets and pipeline stages as one rank sees them (the ``collectives``,
``groups`` and pipeline ``spans`` rows). The runtime's Recorder makes one ``CollectiveHooks`` (the c10d functions'
wrappers and ``Work.wait``) over the rank's ``RankContext`` and ``StepFlags`` (collectors/parts.py), installs it and
owns it; it makes the DDP part (hooks_ddp.py) and the pipelining part (hooks_pipelining.py) and installs each once
its torch module is imported. The tables they all write (groups, seq, pending completions) are one
``CollectiveRows`` (collective_rows.py); nothing is kept in module globals. See runtime.py for the fault rules.

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

import sys
import time
from typing import Any

from dtprof.collectors.collective_rows import DTYPE_NAMES, CollectiveRows, dtype_name, first, nbytes, nbytes_list
from dtprof.collectors.records import COLUMN, collective_row, span_row

now = time.monotonic_ns


# ---- argument extractors: same signatures as torch 2.13 after ``peer_of`` (CollectiveHooks.global_peer); return
# (in_bytes, out_bytes, dtype, group, peer, async)

# all_reduce and broadcast: Lightning calls them every step (a logged value, the SIGTERM check), so nbytes' and
# dtype_name's lines are here rather than two more frames (each costs the training thread several µs in a real job)
def _x_all_reduce(peer_of, tensor, op=None, group=None, async_op=False):
    try:
        b = tensor.numel() * tensor.element_size()
        return b, b, DTYPE_NAMES.get(tensor.dtype) or dtype_name(tensor), group, None, async_op
    except AttributeError:
        return 0, 0, "", group, None, async_op


def _x_all_reduce_coalesced(peer_of, tensors, op=None, group=None, async_op=False):
    b = nbytes_list(tensors)
    return b, b, dtype_name(first(tensors)), group, None, async_op


def _x_all_gather(peer_of, tensor_list, tensor, group=None, async_op=False):
    return nbytes(tensor), nbytes_list(tensor_list), dtype_name(tensor), group, None, async_op


def _x_all_gather_coalesced(peer_of, output_tensor_lists, input_tensor_list, group=None, async_op=False):
    out = sum(nbytes_list(lst) for lst in output_tensor_lists)
    return nbytes_list(input_tensor_list), out, dtype_name(first(input_tensor_list)), group, None, async_op


def _x_out_in(peer_of, output, input, *rest, group=None, async_op=False, op=None, output_split_sizes=None,
              input_split_sizes=None):
    return nbytes(input), nbytes(output), dtype_name(input), group, None, async_op


# FSDP2 calls these two for every parameter group, forward and backward: tensors only (torch checks that), so their
# sizes are read without nbytes' guard, and the dtype's name from its table once it is there
def _x_all_gather_into(peer_of, output_tensor, input_tensor, group=None, async_op=False):
    return (input_tensor.numel() * input_tensor.element_size(), output_tensor.numel() * output_tensor.element_size(),
            DTYPE_NAMES.get(input_tensor.dtype) or dtype_name(input_tensor), group, None, async_op)


def _x_reduce_scatter(peer_of, output, input_list, op=None, group=None, async_op=False):
    return nbytes_list(input_list), nbytes(output), dtype_name(output), group, None, async_op


def _x_reduce_scatter_tensor(peer_of, output, input, op=None, group=None, async_op=False):
    return (input.numel() * input.element_size(), output.numel() * output.element_size(),
            DTYPE_NAMES.get(input.dtype) or dtype_name(input), group, None, async_op)


def _x_all_to_all(peer_of, output_tensor_list, input_tensor_list, group=None, async_op=False):
    return (nbytes_list(input_tensor_list), nbytes_list(output_tensor_list), dtype_name(first(input_tensor_list)),
            group, None, async_op)


def _x_all_to_all_single(peer_of, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                         async_op=False):
    return nbytes(input), nbytes(output), dtype_name(input), group, None, async_op


def _x_broadcast(peer_of, tensor, src=None, group=None, async_op=False, group_src=None):
    peer = int(src) if src is not None else peer_of(group, None, group_src)
    try:
        b = tensor.numel() * tensor.element_size()
        return b, b, DTYPE_NAMES.get(tensor.dtype) or dtype_name(tensor), group, peer, async_op
    except AttributeError:
        return 0, 0, "", group, peer, async_op


def _x_reduce(peer_of, tensor, dst=None, op=None, group=None, async_op=False, group_dst=None):
    b = nbytes(tensor)
    return b, b, dtype_name(tensor), group, peer_of(group, dst, group_dst), async_op


def _x_barrier(peer_of, group=None, async_op=False, device_ids=None, timeout=None):
    return 0, 0, "", group, None, async_op


def _x_monitored_barrier(peer_of, group=None, timeout=None, wait_all_ranks=False):
    return 0, 0, "", group, None, False


def _x_gather(peer_of, tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    return (nbytes(tensor), nbytes_list(gather_list), dtype_name(tensor), group, peer_of(group, dst, group_dst),
            async_op)


def _x_scatter(peer_of, tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    return (nbytes_list(scatter_list), nbytes(tensor), dtype_name(tensor), group, peer_of(group, src, group_src),
            async_op)


def _x_send(peer_of, tensor, dst=None, group=None, tag=0, group_dst=None):
    return nbytes(tensor), 0, dtype_name(tensor), group, peer_of(group, dst, group_dst), False


def _x_recv(peer_of, tensor, src=None, group=None, tag=0, group_src=None):
    return 0, nbytes(tensor), dtype_name(tensor), group, peer_of(group, src, group_src), False


def _x_isend(peer_of, tensor, dst=None, group=None, tag=0, group_dst=None):
    return nbytes(tensor), 0, dtype_name(tensor), group, peer_of(group, dst, group_dst), True


def _x_irecv(peer_of, tensor, src=None, group=None, tag=0, group_src=None):
    return 0, nbytes(tensor), dtype_name(tensor), group, peer_of(group, src, group_src), True


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
_PEER = _COL["peer"]
_NO_STAGE = (None, None)


class CollectiveHooks:
    """dtprof's wrappers of torch.distributed's functions for one rank, and the DDP and pipelining parts they
    switch with (``set_wrappers``). Made by the Recorder (collectors/runtime.py) over the rank's ``RankContext`` (never
    the recorder), installed (``install``) and possibly taken out again (``remove``: torch's own functions back). The
    wrappers close over the context and the tables, so the hot paths read them without a global lookup.
    ``pipeline_step``: (begin, end), the step clock's calls when a pipeline schedule's outermost step() begins (with
    its arguments) and returns (hooks_pipelining.py)."""

    def __init__(self, ctx, flags=None, pipeline_step=None) -> None:
        from dtprof.collectors.hooks_ddp import DdpHooks
        from dtprof.collectors.hooks_pipelining import PipelineHooks
        from dtprof.collectors.parts import StepFlags

        self.ctx = ctx
        self.flags = flags if flags is not None else StepFlags()
        self.rows = CollectiveRows(ctx)
        self.tls = self.rows.tls
        self.ddp = DdpHooks(ctx, self.rows, self.flags)
        begin, end = pipeline_step or (lambda args: None, lambda: None)
        self.pipeline = PipelineHooks(ctx, self.flags, self, begin, end)
        self.api_of: dict = {}               # a collective function, original or our wrapper -> its c10d name (P2POp)
        self.c10d: Any = None                # torch.distributed.distributed_c10d, once installed
        self.swapped: dict = {}              # (owner, attribute) -> (original, our wrapper): what set_wrappers switches
        self.patched: list = []              # (owner, attribute, original) patched for good: what remove puts back
        self.finders: list = []              # the _AfterImport finders this object put on sys.meta_path
        # (id(group) or None, the peer's rank in it, "send"/"recv") -> (group name, group size, the peer's global
        # rank, the seq key): what where() and global_peer() find for a point-to-point op, looked up once per route
        self.p2p_routes: dict = {}

    # ---- the wrappers -------------------------------------------------------------------------------------------

    def wrap_collective(self, api, orig, caller_depth: int = 1):
        """``orig`` recording its call; ``caller_depth``: the caller's frame, 2 when called from another wrapper
        (wrap_pipeline_p2p)."""
        op, extract = _APIS[api]
        p2p = op in _P2P
        skip_observer = api in ("all_reduce", "all_reduce_coalesced")   # the calls that reach c10d::allreduce_
        ddp, ctx, flags, rows = self.ddp, self.ctx, self.flags, self.rows
        tls, source_by_code, groups = rows.tls, rows.source_by_code, rows.groups
        caller_source, group_info, where, track, peer_of = (rows.caller_source, rows.group, rows.where, rows.track,
                                                           rows.global_peer)

        def wrapper(*args, **kwargs):
            if ctx.disabled or not ctx.active or tls.busy:
                return orig(*args, **kwargs)
            try:
                issue = now()
                if ctx.fault_test == "collective":
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
                        flags.ddp_last_issue_ns = issue
                if p2p:
                    name, size, seq = where(op, group, peer)
                else:      # where() for a collective, without its frame: Lightning issues three every step
                    name, size, _pg, counter = groups.get(None if group is None else id(group)) or group_info(group)
                    seq = next(counter)
                # the row's columns up to issue_ns (what the heartbeat names while the call runs) and its bucket and
                # stage, built here rather than through make_row: every collective passes here, and each call on
                # its path costs the training thread
                head = (ctx.rank, ctx.step, op, api_name, source, name, size, seq, in_b, out_b, dtype, peer,
                        bool(async_op), issue)
                stage, mb = tls.stage_mb or _NO_STAGE
                if not async_op:
                    ctx.collective = (head, issue)
            except Exception:
                ctx.fault(f"collective wrapper ({api})")
                return orig(*args, **kwargs)
            tls.busy = True
            try:
                # a tensor's requires_grad read here, anything else (a list, a keyword) by _no_grad
                if skip_observer and ddp.observer_keys is not None and (
                        args and getattr(args[0], "requires_grad", None) is False or _no_grad(args, kwargs)):
                    with ddp.exclude_keys(ddp.observer_keys):
                        result = orig(*args, **kwargs)
                else:
                    result = orig(*args, **kwargs)
            finally:
                tls.busy = False
                ctx.collective = None
            try:
                ret = now()
                ctx.last_progress_ns = ret
                if async_op and result is not None:
                    track(result, [collective_row(*head, ret, None, None, bucket_index, stage, mb)])
                else:
                    if p2p and op == "recv" and peer is None and isinstance(result, int):
                        head = head[:_PEER] + (result,) + head[_PEER + 1:]
                    ctx.append_collective(collective_row(*head, ret, ret, None, bucket_index, stage, mb))
                    ctx.append_span(span_row(head[0], head[1], "comm_wait", api, issue, ret))
            except Exception:
                ctx.fault(f"collective wrapper ({api})")
            return result

        return _dressed_as(wrapper, orig, api)

    def wrap_pipeline_p2p(self, api, orig, generic):
        """isend/irecv called as torch's pipelining calls them, once per micro-batch and direction: ``op(tensor,
        group=g, tag=t, group_dst=r)`` (``group_src=r``), from schedules._batch_p2p. The row wrap_collective makes,
        in one Python frame instead of five (each frame costs the training thread several µs, cold, in a real job).
        Any other call goes to ``generic``, wrap_collective's wrapper."""
        op, peer_arg = ("send", "group_dst") if api == "isend" else ("recv", "group_src")
        pipeline_form = {"group", "tag", peer_arg}
        ctx, rows, routes = self.ctx, self.rows, self.p2p_routes
        tls, source_by_code, seqs = rows.tls, rows.source_by_code, rows.seq
        caller_source, group_info, track, seq_counter, global_peer = (rows.caller_source, rows.group, rows.track,
                                                                      rows.seq_counter, rows.global_peer)

        def wrapper(*args, **kwargs):
            if len(args) != 1 or kwargs.keys() != pipeline_form or ctx.disabled or not ctx.active or tls.busy \
                    or tls.bucket is not None or ctx.fault_test:
                return generic(*args, **kwargs)
            try:
                issue = now()
                tensor, group, group_peer = args[0], kwargs["group"], kwargs[peer_arg]
                route_key = (None if group is None else id(group), group_peer, op)
                route = routes.get(route_key)
                if route is None:
                    name, size = group_info(group)[:2]
                    peer = global_peer(group, None, group_peer)
                    seq_key = (name, ctx.rank, peer) if op == "send" else (name, peer, ctx.rank)
                    route = routes[route_key] = (name, size, peer, seq_key)
                name, size, peer, seq_key = route
                seq = next(seqs.get(seq_key) or seq_counter(seq_key))
                b = tensor.numel() * tensor.element_size()
                caller = sys._getframe(1)
                head = (ctx.rank, ctx.step, op, api, source_by_code.get(caller.f_code) or caller_source(caller),
                        name, size, seq, b if op == "send" else 0, 0 if op == "send" else b,
                        DTYPE_NAMES.get(tensor.dtype) or dtype_name(tensor), peer, True, issue)
                stage, mb = tls.stage_mb or _NO_STAGE
            except Exception:
                ctx.fault(f"collective wrapper ({api})")
                return orig(*args, **kwargs)
            tls.busy = True
            try:
                work = orig(*args, **kwargs)
            finally:
                tls.busy = False
            try:
                ret = now()
                ctx.last_progress_ns = ret
                if work is not None:
                    track(work, [collective_row(*head, ret, None, None, None, stage, mb)])
            except Exception:
                ctx.fault(f"collective wrapper ({api})")
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
        ctx, rows = self.ctx, self.rows
        tls = rows.tls

        def batch_isend_irecv(p2p_op_list):
            if ctx.disabled or not ctx.active or tls.busy:
                return orig(p2p_op_list)
            try:
                issue = now()
                step = ctx.step
                calls = []          # the arguments of each op's row, complete but for return_ns
                for p in p2p_op_list:
                    is_send = self.current_p2p_op(p) == "isend"
                    op = "send" if is_send else "recv"
                    b = nbytes(p.tensor)
                    stage, mb = getattr(p, "_dtprof_stage_mb", (None, None))
                    source = "pipeline" if stage is not None else rows.caller_source(sys._getframe(1))
                    calls.append((op, source, rows.where(op, p.group, p.peer), b if is_send else 0,
                                  0 if is_send else b, dtype_name(p.tensor), p.peer, stage, mb))
            except Exception:
                ctx.fault("batch_isend_irecv wrapper")
                return orig(p2p_op_list)
            tls.busy = True
            try:
                works = orig(p2p_op_list)
            finally:
                tls.busy = False
            try:
                ret = now()
                made = [rows.make_row(op, "batch_isend_irecv", source, where, in_b, out_b, dtype, peer, True, issue,
                                      ret, None, None, stage, mb, step)
                        for op, source, where, in_b, out_b, dtype, peer, stage, mb in calls]
                if works and len(works) == len(made):
                    for w, r in zip(works, made):
                        rows.track(w, [r])
                elif works:                      # coalesced (NCCL): one work for the whole batch
                    rows.track(works[-1], made)
                else:
                    ctx.extend("collectives", made)
            except Exception:
                ctx.fault("batch_isend_irecv wrapper")
            return works

        batch_isend_irecv.__wrapped__ = orig
        batch_isend_irecv.__doc__ = orig.__doc__
        return batch_isend_irecv

    def wrap_work_wait(self, orig):
        ctx, rows = self.ctx, self.rows
        tls, pending, complete = rows.tls, rows.pending, rows.complete

        def wait(work, *args, **kwargs):
            if ctx.disabled or not ctx.active or tls.busy:
                return orig(work, *args, **kwargs)
            t0 = now()
            item = pending.get(id(work))
            if item is not None:
                ctx.collective = (item[1][0], t0)
            try:
                return orig(work, *args, **kwargs)
            finally:
                ctx.collective = None
                try:
                    t1 = now()
                    ctx.last_progress_ns = t1
                    ctx.append_span(span_row(ctx.rank, ctx.step, "comm_wait", "wait", t0, t1))
                    if item is not None:      # else nothing of this work is recorded, or its callback completed it
                        complete(id(work), t1)
                except Exception:
                    ctx.fault("Work.wait wrapper")

        wait.__wrapped__ = orig
        return wait


    # ---- installation -------------------------------------------------------------------------------------------

    def install_later(self, module_name, label, installer) -> None:
        ctx = self.ctx

        def run():
            try:
                installer()
            except Exception:
                ctx.event("warning", f"{label} hooks unavailable: "
                                     f"{sys.exc_info()[0].__name__}: {sys.exc_info()[1]}")

        if module_name in sys.modules:
            run()
        else:
            finder = _AfterImport(module_name, run)
            self.finders.append(finder)
            sys.meta_path.insert(0, finder)

    def wrap_init_process_group(self, orig):
        ctx, groups = self.ctx, self.rows.groups

        def init_process_group(*args, **kwargs):
            result = orig(*args, **kwargs)
            try:
                groups.pop(None, None)
                ctx.refresh_identity()
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
        (benchmarks/overhead.py; the A/B blocks). Other patched methods (DeviceMesh, DDP's
        register_comm_hook: not on a step's path) stay and pass through while the recorder is not active."""
        for (owner, name), (orig, wrapper) in self.swapped.items():
            setattr(owner, name, wrapper if on else orig)
        self.ddp.set_kernel(on)

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
        self.install_later("torch.nn.parallel.distributed", "ddp", self.ddp.install)
        self.install_later("torch.distributed.pipelining", "pipelining", self.pipeline.install)

    def remove(self) -> None:
        """Take every hook out: torch's own functions, methods and kernels back, as before install()."""
        self.set_wrappers(False)
        self.swapped.clear()
        self.ddp.remove()
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
