"""torch's pipelining (``torch.distributed.pipelining``) as one rank sees it: each micro-batch's
``forward_one_chunk``/``backward_one_chunk``(/``backward_weight_one_chunk``) as a ``pp_forward``/``pp_backward``
span with ``stage`` and ``microbatch``; the P2P ops built by ``get_{fwd,bwd}_{send,recv}_ops`` tagged with their
stage and microbatch for their ``collectives`` rows (recorded by hooks_collectives.py's isend/irecv wrappers); the
first ``step()`` of each schedule object writes a ``pipeline_schedule`` meta row: {"schedule": <class name>,
"stages": n, "microbatches": m, "stage_indices": [i, ...]} (the stages this rank runs).

``PipelineHooks`` is made by the c10d hooks (``CollectiveHooks``) and installed once pipelining is imported; its
wrappers go in through their ``swap``, so an A/B block's "off" takes them out with the collective wrappers. A
schedule's ``step()`` raises ``StepFlags.pp_active`` while it runs and tells the step clock (collectors/stepclock.py)
when the outermost one begins (``begin_step(args)``: the batch it is given) and ends (``end_step()``).
"""
from __future__ import annotations

import time

from dtprof.collectors.records import span_row

now = time.monotonic_ns


class PipelineHooks:
    """The pipelining wrappers of one rank, over its ``RankContext`` and the step clock's ``StepFlags``."""

    def __init__(self, ctx, flags, c10d_hooks, begin_step, end_step) -> None:
        self.ctx = ctx
        self.flags = flags
        self.c10d_hooks = c10d_hooks    # where the wrappers are swapped in, and P2POp's isend/irecv in place
        self.tls = c10d_hooks.rows.tls
        self.begin_step = begin_step    # begin_step(args): the outermost schedule step() starts (the step clock)
        self.end_step = end_step        # end_step(): and returns

    def wrap_chunk(self, orig, kind, name):
        ctx = self.ctx

        def chunk(stage, chunk_id, *args, **kwargs):
            if ctx.disabled or not ctx.active:
                return orig(stage, chunk_id, *args, **kwargs)
            t0 = now()
            try:
                return orig(stage, chunk_id, *args, **kwargs)
            finally:
                try:
                    t1 = now()
                    ctx.last_progress_ns = t1
                    # ctx.span's row, built here (each micro-batch's forward and backward pass here)
                    ctx.append_span(span_row(ctx.rank, ctx.step, kind, name, t0, t1, stage.stage_index,
                                             int(chunk_id)))
                except Exception:
                    ctx.fault(f"pipeline {name}")

        chunk.__wrapped__ = orig
        return chunk

    def wrap_batch_p2p(self, orig):
        """schedules._batch_p2p calls isend/irecv directly for all-send or all-recv batches: pass the ops' common
        stage and microbatch to their rows (``tls.stage_mb``), and hand each op the isend/irecv in place."""
        ctx, tls, c10d_hooks = self.ctx, self.tls, self.c10d_hooks

        def _batch_p2p(p2p_ops, *args, **kwargs):
            if not ctx.active:
                return orig(p2p_ops, *args, **kwargs)
            tag = None      # the ops' common (stage, microbatch), if they have one
            for i, p in enumerate(p2p_ops or ()):
                api = c10d_hooks.api_of.get(p.op)
                if api is not None and p.op is not getattr(c10d_hooks.c10d, api):
                    c10d_hooks.current_p2p_op(p)    # built with the isend/irecv not in place now (rare)
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
        ctx, flags, begin, end = self.ctx, self.flags, self.begin_step, self.end_step

        def step(schedule, *args, **kwargs):
            if ctx.disabled or not ctx.active:
                return orig(schedule, *args, **kwargs)
            try:
                if not getattr(schedule, "_dtprof_announced", False):
                    schedule._dtprof_announced = True
                    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
                    ctx.meta("pipeline_schedule", {
                        "schedule": type(schedule).__name__,
                        "stages": _int_or_none(getattr(schedule, "_num_stages", None)),
                        "microbatches": _int_or_none(getattr(schedule, "_n_microbatches", None)),
                        "stage_indices": [int(s.stage_index) for s in stages if s is not None]})
                if not flags.pp_active:
                    begin(args)
            except Exception:
                ctx.fault("pipeline schedule step")
            flags.pp_active += 1
            try:
                return orig(schedule, *args, **kwargs)
            finally:
                flags.pp_active -= 1
                if not flags.pp_active:
                    try:
                        end()
                    except Exception:
                        ctx.fault("pipeline schedule step")

        step.__wrapped__ = orig
        return step

    def install(self) -> None:
        from torch.distributed.pipelining import schedules, stage

        swap = self.c10d_hooks.swap

        # through swap: set_wrappers(False) takes these out too, so that an A/B block's "off" runs none of dtprof
        base = stage._PipelineStageBase
        for meth, kind in (("forward_one_chunk", "pp_forward"), ("backward_one_chunk", "pp_backward"),
                           ("backward_weight_one_chunk", "pp_backward")):
            if meth in base.__dict__:
                orig = base.__dict__[meth]
                swap(base, meth, orig, self.wrap_chunk(orig, kind, meth.replace("_one_chunk", "")))
        for meth in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
            if meth in base.__dict__:
                orig = base.__dict__[meth]
                swap(base, meth, orig, _wrap_ops_getter(orig))
        if hasattr(schedules, "_batch_p2p"):
            swap(schedules, "_batch_p2p", schedules._batch_p2p, self.wrap_batch_p2p(schedules._batch_p2p))
        for obj in list(vars(schedules).values()):
            if isinstance(obj, type) and issubclass(obj, schedules._PipelineSchedule) and "step" in obj.__dict__:
                orig = obj.__dict__["step"]
                swap(obj, "step", orig, self.wrap_schedule_step(orig))


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
