"""A/B blocks, for measuring dtprof's cost (benchmarks/overhead.py; not a user option).

With ``DTPROF_AB_BLOCK_STEPS=K`` in the rank's environment, every K optimizer steps the rank switches its hooks on
the training thread's path out or back in: the forward/backward/DataLoader hooks, the collective and pipelining
wrappers, ``Work.wait`` and the ``c10d::allreduce_`` kernel (the optimizer hooks stay: they count the steps). Every
rank switches after the same optimizer step, so the job's step K·i+1 .. K·(i+1) (counting from 1) runs with the
hooks on for even i and off for odd i, and the job's own step times compare the two in one run. Steps run off are
not recorded. The background threads run throughout: their cost is not in the difference. While they run, every
step is recorded in full detail (collectors/sampling.py).
"""
from __future__ import annotations


class AbBlocks:
    """The A/B switch of one rank. ``switch(on)``: the recorder's path hooks in or out; ``restart_step()``: the next
    recorded step starts now (after an "off" block)."""

    def __init__(self, switch, restart_step):
        self.block = 0             # switch the hooks off and on every this many optimizer steps (0: never)
        self.steps = 0             # optimizer steps seen so far
        self.off = False           # the hooks are out (an "off" block)
        self.switch = switch
        self.restart_step = restart_step

    def step_done(self) -> None:
        """After each optimizer step: every ``block`` of them, switch the hooks off or back on, at the same step on
        every rank."""
        self.steps += 1
        if self.steps % self.block:
            return
        on = self.off
        self.switch(on)
        if on:
            self.restart_step()
        self.off = not on
