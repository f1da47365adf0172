"""The optimizer post-hook of a boundary-only step: the one call most of a sampled job's steps make into dtprof.

On a step of a fraction of a millisecond the hook's cost is not its instructions but its cache misses: between two
calls the step's own work evicts dtprof's code and objects, and each object the call touches is a miss. The full
post-hook (``StepClock.opt_post_hook``: the parts, the manual-step rule, the sampler, the A/B blocks, the trace
capture) touched a dozen objects and cost ~5.5 µs a step in the short-step job's loop (1.2 µs hot in a tight
loop); this one builds the step's row from the context, one list and its own defaults: +1.6 µs in that loop,
~1,000 instructions (docs/validation.md, "Cost"). It takes the full hook's path whenever there is more to do than
the row: a detailed step, the step at which the sampler may act (``Sampler.quiet_until``), annotations, a part with
boundary work, manual steps, an engine's step call in progress (``RankContext.hold_step_end``), the A/B blocks, a
trace capture in progress. Nothing is decided here: ``StepClock.refresh_fast`` sets when the full hook is next
needed, after each step the full hook ends.
"""
from __future__ import annotations

import time

from dtprof.collectors.records import step_row


def boundary_post_hook(clock):
    """The hook ``torch.optim`` calls after every optimizer step (registered once; ``clock.fast`` is its state:
    [start of the step in progress, the first step whose end takes the full hook, tokens, samples, whether this
    hook has ended steps since the full hook last ran])."""
    ctx, fast, annot, full = clock.ctx, clock.fast, clock.annot, clock.opt_post_hook
    rank, append = clock.rank, clock.append_step
    # the row below is step_row's, built in place (a call is one more frame to miss): the same tuple
    if step_row(rank, 1, 2, 3, None, 5, 6, None, None, None, 0) != (rank, 1, 2, 3, None, 5, 6, None, None, None, 0):
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
