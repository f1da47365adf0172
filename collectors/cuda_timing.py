"""CUDA-event timing of a detailed step's forward, backward and optimizer spans (runtime.py's module docstring,
"Spans"). On CUDA the step clock records an event at each span's start and end instead of reading the host clock;
the flusher thread turns the finished pairs into ``cuda`` lane spans in host ns through one anchor event, recorded
after one ``synchronize`` before the first step. Nothing here synchronises training: the hot path only records an
event and appends it to ``pending``.
"""
from __future__ import annotations

import time

from dtprof.collectors.records import span_row

now = time.monotonic_ns


class CudaTiming:
    """The CUDA events of one rank's spans, over its ``RankContext``. ``on``: None until the first forward
    (``decide``), then True (CUDA events) or False (host timing)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.on: bool | None = None
        self.anchor = None         # (event, host_ns) recorded after one synchronize
        self.pending: list = []    # [((step, kind), start_event, end_event)] resolved by the flusher

    def decide(self) -> None:
        import torch

        self.on = bool(torch.cuda.is_available() and torch.cuda.is_initialized())
        if self.on:
            torch.cuda.synchronize()          # once, before the first step: pairs a GPU event with a host time
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            ev.synchronize()
            self.anchor = (ev, now())

    @staticmethod
    def event():
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def span(self, kind, ev0) -> None:
        """A forward, backward or optimizer span whose device time comes from the CUDA event ``ev0`` and one
        recorded now (``resolve``); the hooks append a host-timed one themselves when ``ev0`` is None."""
        self.pending.append(((self.ctx.step, kind), ev0, self.event()))

    def resolve(self) -> None:
        """Flusher: turn finished event pairs into spans. The hot path only appends to ``pending``; this thread
        removes the prefix it looked at (list slice operations are atomic under the GIL)."""
        anchor, anchor_ns = self.anchor
        pending, ctx = self.pending, self.ctx
        n = len(pending)
        keep = []
        for item in pending[:n]:
            (step, kind), e0, e1 = item
            if e1.query() and e0.query():
                t0, t1 = (anchor_ns + int(anchor.elapsed_time(e) * 1e6) for e in (e0, e1))
                ctx.append_span(span_row(ctx.rank, step, kind, kind, t0, t1, lane="cuda", source="cuda_event"))
            else:
                keep.append(item)
        del pending[:n]
        pending[:0] = keep
