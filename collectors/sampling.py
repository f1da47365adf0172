"""Step sampling (docs/cli-run.md, "Sampling"): which steps the rank records in full detail and which by their
boundary only. Steps before SAMPLE_FROM are all detailed; long steps are never sampled; otherwise a calibration of
alternating blocks prices a detailed step and the detail is recorded in blocks of SAMPLE_BLOCK steps every period
(``sample_next``), made sparser when the rank's files grow too fast (``check_footprint``). Each decision is a
``sampling`` meta row.

The step clock (collectors/stepclock.py) calls ``sample_next`` after each step; the ``Sampler`` switches the detail
through the ``set_detail`` it is given and reads the detail in force, the options and ``meta`` from the rank's
``RankContext``.
"""
from __future__ import annotations

import time

from dtprof.rundir.schema import DETAIL_BLOCK

now = time.monotonic_ns
# Step sampling (docs/cli-run.md, "Sampling")
SAMPLE_FROM = 32             # steps before this one are all in full detail (warm-up, compiles, the FLOP step)
SAMPLE_CALIBRATION = 32      # then this many steps alternate boundary-only and full-detail blocks
SAMPLE_BLOCK = DETAIL_BLOCK  # steps per full-detail block (4)
# dtprof's cost per step, as a fraction of the step, that the detail's sampling keeps under: half of the 1 % dtprof
# may cost, the other half left to what every step pays (the boundary's optimizer hooks, the flusher's rows)
SAMPLE_BUDGET = 0.005
# Steps this long are never sampled: their detail cost a GPU job 0.11-0.25 % of a 38 ms step (H200), and full
# detail is what a long step's user expects. On a CPU a compiled DDP job's ~72 ms step pays more, mostly torch's
# Python-kernel call per DDP bucket (benchmarks/c10d_kernel_cost.py; docs/validation.md)
SAMPLE_LONG_NS = 50_000_000
SAMPLE_MAX_PERIOD = 4096
# A calibration whose difference is within the steps' noise leaves steps this long in full detail (and calibrates
# again later); shorter steps are sampled with the detail priced at the noise: a detailed step's tens of µs of
# Python are a large share of them, and a busy machine's noise must not leave them all detailed
SAMPLE_NOISY_NS = 5_000_000
# The footprint: a rank's files may grow by about this much a day (issue: <= 50 MB a rank and day at 10 steps a
# second; the rest is the node's NVML and events files). Every FOOTPRINT_CHECK_STEPS steps, once at least
# FOOTPRINT_CHECK_S since the last check, a rank whose files grew faster samples its detail more sparsely; every
# step's boundary row is kept whatever it costs.
FOOTPRINT_BYTES_PER_DAY = 40_000_000
FOOTPRINT_CHECK_STEPS = 1024
FOOTPRINT_CHECK_S = 60
NS_PER_S = 1_000_000_000


def median(xs: list):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[len(xs) // 2]


def mad(xs: list) -> int:
    m = median(xs)
    return median([abs(x - m) for x in xs]) if m is not None else 0


class Sampler:
    """The sampling decisions of one rank. ``set_detail(on)``: full detail from the next step on, or not;
    ``ab_block``: the A/B blocks' length (benchmarks/overhead.py), which keeps every step detailed."""

    def __init__(self, ctx, set_detail, ab_block=0):
        self.ctx = ctx
        self.set_detail = set_detail
        self.ab_block = ab_block
        self.writer = None         # the RankWriter, for its bytes written (check_footprint); None before start
        self.sample_period = None  # None: undecided; 0: every step in detail; P: SAMPLE_BLOCK steps every P
        self.sample_times = []     # durations (ns) of steps 8..31: are steps long?
        self.calibration_from = SAMPLE_FROM   # the first step of the calibration in progress or last made
        self.calibration = []      # (in detail, duration ns) of the calibration's steps
        self.recalibrate_at = None  # the step at which a calibration that kept full detail is made again
        self.footprint_mark = None  # (monotonic ns, the writer's bytes) at the last footprint check

    @property
    def detail(self) -> bool:
        """The detail in force for the step in progress."""
        return self.ctx.detail

    def sample_next(self, step: int, duration_ns: int) -> None:
        """After step ``step`` ended: is the next one in full detail? Steps before SAMPLE_FROM are. Steps of
        SAMPLE_LONG_NS or more are never sampled. Otherwise SAMPLE_CALIBRATION steps alternate boundary-only and
        detailed blocks; dtprof's cost of a detailed step is the difference of the two medians, and when it is over
        SAMPLE_BUDGET of the boundary-only step, detailed blocks of SAMPLE_BLOCK steps start every P steps (P a
        power of two, so ranks that measured different P still share the detailed steps of the largest). A
        calibration that found the cost under budget is repeated at twice its start step, then four times, ...
        (one noisy measurement does not decide a long job; every rank calibrates at the same steps)."""
        nxt = step + 1
        if nxt % FOOTPRINT_CHECK_STEPS == 0 and self.sample_period is not None:
            self.check_footprint(nxt)
        if self.sample_period == 0:
            if nxt != self.recalibrate_at:
                return
            self.sample_period, self.calibration_from, self.sample_times = None, nxt, []
            self.recalibrate_at = 2 * nxt
        elif self.sample_period is None:
            if nxt <= SAMPLE_FROM and step >= 8:      # the steps that tell a long step
                self.sample_times.append(duration_ns)
            elif nxt > self.calibration_from:
                self.calibration.append((self.ctx.detail, duration_ns))
        if self.sample_period is None:
            if nxt < SAMPLE_FROM:
                return
            if nxt == SAMPLE_FROM:
                if self.ctx.options.get("sample_every") and not self.ab_block:
                    period = int(self.ctx.options["sample_every"])
                    self.decide_sampling(period, "--sample-every")
                    self.set_detail(nxt % period < SAMPLE_BLOCK)
                    return
                if self.ab_block or self.ctx.options.get("full_detail") or self.ctx.options.get("trace_steps"):
                    self.decide_sampling(0, "full detail asked for" if self.ctx.options.get("full_detail") else None)
                    return
                long = median(self.sample_times)
                if long is not None and long >= SAMPLE_LONG_NS:
                    self.decide_sampling(0, None)
                    return
                self.recalibrate_at = 2 * (SAMPLE_FROM + SAMPLE_CALIBRATION)
            if nxt < self.calibration_from + SAMPLE_CALIBRATION:
                self.set_detail(((nxt - self.calibration_from) // SAMPLE_BLOCK) % 2 == 1)   # boundary-only first
                return
            self.decide_from_calibration()
            if self.sample_period == 0:
                self.set_detail(True)
                return
        if (nxt % self.sample_period < SAMPLE_BLOCK) != self.ctx.detail:     # most steps: no call
            self.set_detail(not self.ctx.detail)

    def quiet_until(self, step: int) -> int:
        """While steps are boundary-only, the first step from ``step`` on at whose end ``sample_next`` may act
        (switch the detail on, check the footprint): the steps before it need not call it (collectors/boundary.py).
        ``step`` itself while the sampling is undecided or every step is detailed."""
        period = self.sample_period
        if not period:
            return step
        nxt = step + 1
        return min(-(-nxt // period) * period, -(-nxt // FOOTPRINT_CHECK_STEPS) * FOOTPRINT_CHECK_STEPS) - 1

    def decide_from_calibration(self) -> None:
        """The period from the calibration's alternating blocks (boundary-only first). A detailed step's own cost
        is the median detailed step less the median boundary-only step, each without its block's first step; a
        detailed block costs more than its steps: switching the detail on lands in its first step and switching
        it off in the next block's first (hooks and kernels installed and taken out, first calls), several
        detailed steps' worth on short steps. The period is chosen from the whole block's cost."""
        calib, self.calibration = self.calibration, []
        at = lambda detail, first: [d for i, (on, d) in enumerate(calib)   # noqa: E731
                                    if on == detail and (i % SAMPLE_BLOCK == 0) == first]
        on, off = at(True, False), at(False, False)
        base, on_first, off_first = median(off), median(at(True, True)), median(at(False, True))
        if not base or median(on) is None or on_first is None or off_first is None:
            self.decide_sampling(0, None)
            return
        cost, noise = max(0, median(on) - base), max(mad(on), mad(off))
        if cost <= noise:      # within the steps' own spread (median absolute deviation): the machine's noise
            if base >= SAMPLE_NOISY_NS:
                self.decide_sampling(0, None, cost, base)     # full detail, calibrated again later
                return
            cost = noise       # a short step: priced at the noise (full detail could cost it tens of percent)
        if cost <= SAMPLE_BUDGET * base:
            self.decide_sampling(0, None, cost, base)
            return
        block = max(0, on_first - base) + (SAMPLE_BLOCK - 1) * cost + max(0, off_first - base)
        period = 2 * SAMPLE_BLOCK
        while block > SAMPLE_BUDGET * base * period and period < SAMPLE_MAX_PERIOD:
            period *= 2
        self.decide_sampling(period, None, cost, base, block)

    def check_footprint(self, nxt: int) -> None:
        """Over FOOTPRINT_BYTES_PER_DAY's rate since the last check, the detailed blocks start that many times
        more sparsely (a power of two, so ranks still share the detailed steps of the sparsest). Sampling the user
        chose (--full-detail, --sample-every, --trace-steps, A/B blocks) is left as it is."""
        if self.writer is None or self.ab_block or self.ctx.options.get("full_detail") \
                or self.ctx.options.get("sample_every") or self.ctx.options.get("trace_steps"):
            return
        t, written = now(), self.writer.bytes_written()
        if self.footprint_mark is None or t - self.footprint_mark[0] < FOOTPRINT_CHECK_S * NS_PER_S:
            self.footprint_mark = self.footprint_mark or (t, written)
            return
        (t0, b0), self.footprint_mark = self.footprint_mark, (t, written)
        rate, budget = (written - b0) * NS_PER_S / (t - t0), FOOTPRINT_BYTES_PER_DAY / 86_400
        period = max(self.sample_period or 0, SAMPLE_BLOCK)    # every step in detail: a block every block
        if rate <= budget or period >= SAMPLE_MAX_PERIOD:
            return
        while rate > budget and period < SAMPLE_MAX_PERIOD:     # the detail's bytes fall with its share of steps
            period, rate = 2 * period, rate / 2
        self.sample_period = period
        self.calibration_from = nxt
        self.ctx.meta("sampling", {
            "period": period, "block": SAMPLE_BLOCK, "from_step": nxt, "calibration": None, "detail_cost_ns": None,
            "block_cost_ns": None, "step_ns": None, "budget": SAMPLE_BUDGET,
            "reason": f"footprint: the rank's files grew {(written - b0) * NS_PER_S / (t - t0) / 1e3:.1f} kB/s, "
                      f"over the {budget / 1e3:.2f} kB/s ({FOOTPRINT_BYTES_PER_DAY / 1e6:.0f} MB a day) it keeps"})

    def decide_sampling(self, period: int, reason, cost_ns=None, step_ns=None, block_cost_ns=None) -> None:
        self.sample_period = period
        self.sample_times = []
        first = self.calibration_from
        start = first + (SAMPLE_CALIBRATION if cost_ns is not None else 0)
        self.ctx.meta("sampling", {
            "period": period, "block": SAMPLE_BLOCK, "from_step": start if period else None,
            "calibration": [first, first + SAMPLE_CALIBRATION] if cost_ns is not None else None,
            "detail_cost_ns": cost_ns, "block_cost_ns": block_cost_ns, "step_ns": step_ns, "budget": SAMPLE_BUDGET,
            "reason": reason})
