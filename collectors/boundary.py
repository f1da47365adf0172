"""The boundary-only steps' ends: the optimizer post-hook most of a sampled job's steps make their one call into
dtprof through, and the end of such a step when the full hook takes it.

On a step of a fraction of a millisecond the hook's cost is not its instructions but its cache misses: between two
calls the step's own work evicts dtprof's code and objects, and each object the call touches is a miss. The full
post-hook (``StepClock.opt_post_hook``: the parts, the manual-step rule, the sampler, the A/B blocks, the trace
capture) touched a dozen objects and cost ~5.5 µs a step in the short-step job's loop (1.2 µs hot in a tight
loop); this one builds the step's row from the context, one list and its own defaults: +1.6 µs in that loop,
~1,000 instructions (docs/validation.md, "Cost"). It takes the full hook's path whenever there is more to do than
the row: a detailed step, the step at which the sampler may act (``Sampler.quiet_until``), annotations, a part with
boundary work, manual steps, an engine's step call in progress (``RankContext.hold_step_end``), the A/B blocks, a
trace capture in progress. Nothing is decided in the hook: ``BoundarySteps.refresh`` sets when the full hook is
next needed, after each step the full hook ends.
"""
from __future__ import annotations

import time

from dtprof.collectors.records import step_row


class BoundarySteps:
    """The step clock's boundary-only steps (``StepClock.boundary``)."""

    def __init__(self, clock):
        self.clock = clock
        # the hook's state: [start of the step in progress, the first step whose end takes the full hook
        # (refresh), tokens, samples, whether the hook ended steps since the full hook last ran]
        self.state: list = [None, 0, None, None, False]

    def post_hook(self):
        """The hook ``torch.optim`` calls after every optimizer step (registered once)."""
        clock = self.clock
        ctx, fast, annot, full = clock.ctx, self.state, clock.annot, clock.opt_post_hook
        rank, append = clock.rank, clock.append_step
        # the row below is step_row's, built in place (a call is one more frame to miss): the same tuple
        probe = (rank, 1, 2, 3, None, 5, 6, None, None, None, 0)
        if step_row(*probe) != probe:
            raise RuntimeError("the steps table's columns changed: collectors/boundary.py builds its rows by position")

        def dtprof_optimizer_post_hook(optimizer, args, kwargs, now=time.monotonic_ns):
            step = ctx.step
            if ctx.detail or step >= fast[1] or annot or ctx.disabled or ctx.hold_step_end:
                return full(optimizer, args, kwargs)
            t = now()
            append((rank, step, fast[0], t, None, fast[2], fast[3], None, None, None, 0))
            fast[0] = ctx.last_progress_ns = t
            fast[4] = True
            ctx.step = step + 1
            return None

        return dtprof_optimizer_post_hook

    def steps_done(self) -> None:
        """The hook ended steps: the step in progress starts at the last one's end."""
        fast = self.state
        if fast[4]:
            self.clock.prev_step_end_ns = self.clock.step_start_ns = fast[0]
            fast[4] = False

    def refresh(self) -> None:
        """From which step the hook hands a step's end to ``opt_post_hook``: the next one unless steps are
        boundary-only with nothing but their rows to do, else the one at whose end the sampler may act. After each
        step the full hook ends, and when the manual-step rule or the parts change."""
        self.steps_done()
        c, fast = self.clock, self.state
        parts = c.parts
        quiet = not (c.ctx.detail or c.manual_steps or c.ab.block or c.trace_capture is not None
                     or parts.optimizer_step_pending or parts.boundary_optimizer_step or parts.boundary_step_end)
        fast[0] = c.step_start_ns if c.step_start_ns is not None else c.init_ns
        fast[1] = c.sampler.quiet_until(c.ctx.step) if quiet else 0
        fast[2], fast[3] = c.last_inferred.get("tokens"), c.last_inferred.get("samples")

    def end_step(self, t: int) -> None:
        """Close a boundary-only step the full hook took: its times, the annotations, and the samples/tokens the
        last detailed step inferred (the same loader's batches); nothing else was recorded in it."""
        self.steps_done()
        c = self.clock
        ctx = c.ctx
        step, start, a, inferred = ctx.step, c.step_start_ns, c.annot, c.last_inferred
        if start is None:
            start = c.init_ns
        c.append_step(step_row(c.rank, step, start, t, None, a.get("tokens", inferred.get("tokens")),
                               a.get("samples", inferred.get("samples")), a.get("model_flops"), None, None, 0))
        if a:
            a.clear()
        c.prev_step_end_ns = c.step_start_ns = t
        ctx.step = step + 1
        ctx.last_progress_ns = t
        if c.trace_capture is not None:
            c.trace_step_end(step)
        c.sampler.sample_next(step, t - start)
        if c.parts.boundary_step_end:
            c.parts.call(c.parts.boundary_step_end, step, t, False)
        self.refresh()
