"""The rank's sampling decisions (collectors/sampling.py sample_next) on given step durations: which steps are in
full detail, and the period chosen from the measured cost of a detailed step."""
import pytest

from dtprof.collectors import sampling
from dtprof.collectors.parts import RankContext
from dtprof.collectors.sampling import SAMPLE_BLOCK, SAMPLE_BUDGET, Sampler


class Steps:
    """A rank's sampler whose detail switches and meta rows are noted instead of done."""

    def __init__(self, **options):
        self.detailed: list[bool] = []
        self.decisions: list[dict] = []
        ctx = RankContext(0, "host", "", dict(options), add=None, fault=None, event=None,
                          meta=lambda kind, value: self.decisions.append(value))
        self.rec = Sampler(ctx, lambda on: setattr(ctx, "detail", on))

    def run(self, n: int, detailed_ns: int, boundary_ns: int, switch_on_ns: int = 0, switch_off_ns: int = 0) -> None:
        """``switch_*_ns``: what switching the detail on (off) adds to the first step after the switch."""
        for step in range(n):
            on, switched = self.rec.detail, step > 0 and self.rec.detail != self.detailed[-1]
            self.detailed.append(on)
            d = (detailed_ns if on else boundary_ns) + (switched and (switch_on_ns if on else switch_off_ns))
            self.rec.sample_next(step, d)   # as end_step does


def test_long_steps_are_never_sampled():
    s = Steps()
    s.run(400, 60_000_000, 60_000_000)
    assert all(s.detailed) and [d["period"] for d in s.decisions] == [0]


def test_a_costly_detail_samples_blocks_at_a_power_of_two_period():
    s = Steps()
    s.run(2000, 330_000, 300_000)        # a detailed step costs 30 us on 300 us: 10 % of the step
    (d,) = s.decisions
    period = d["period"]
    assert d["detail_cost_ns"] == 30_000 and d["step_ns"] == 300_000
    assert period & (period - 1) == 0 and period * SAMPLE_BUDGET * 300_000 / 30_000 >= SAMPLE_BLOCK
    assert period // 2 * SAMPLE_BUDGET * 300_000 / 30_000 < SAMPLE_BLOCK    # the smallest such period
    assert all(s.detailed[:32])
    assert [i for i in range(64, 2000) if s.detailed[i]] == [i for i in range(64, 2000) if i % period < SAMPLE_BLOCK]


def test_the_switches_around_a_detailed_block_are_priced_with_it():
    """On 300 us steps a detailed step costs 30 us, switching the detail on 600 us and off 100 us: a block costs
    4 x 30 + 700 = 820 us, and the period keeps that under the budget (the steps' own cost alone would allow a
    period eight times shorter)."""
    s = Steps()
    s.run(4000, 330_000, 300_000, switch_on_ns=600_000, switch_off_ns=100_000)
    (d,) = s.decisions
    assert (d["detail_cost_ns"], d["block_cost_ns"], d["step_ns"]) == (30_000, 820_000, 300_000)
    period = d["period"]
    assert 820_000 <= SAMPLE_BUDGET * 300_000 * period < 2 * 820_000
    window = s.detailed[period:3 * period]                           # two whole periods after the calibration
    assert window[:SAMPLE_BLOCK + 1] == [True] * SAMPLE_BLOCK + [False] and sum(window) == 2 * SAMPLE_BLOCK
    paid = sum(330_000 if on else 300_000 for on in window) + 2 * 700_000
    assert paid / (len(window) * 300_000) - 1 <= SAMPLE_BUDGET     # what the job pays for its detail


def _noisy(s: Steps, n: int, step_ns: int, spread_ns: int) -> None:
    """Steps of ``step_ns`` +- ``spread_ns`` (a fixed pattern), whatever the detail: dtprof's cost lost in noise."""
    for step in range(n):
        s.detailed.append(s.rec.detail)
        s.rec.sample_next(step, step_ns + spread_ns * ((step * 7) % 5 - 2) // 2)


def test_a_short_step_whose_cost_is_lost_in_noise_is_sampled_priced_at_the_noise():
    s = Steps()
    _noisy(s, 200, 300_000, 60_000)        # 0.3 ms steps, +-60 us: no difference between detail and boundary
    (d,) = s.decisions
    assert d["period"] > 0 and d["detail_cost_ns"] > 0        # not left in full detail
    assert d["block_cost_ns"] <= SAMPLE_BUDGET * d["step_ns"] * d["period"]


def test_a_long_step_whose_cost_is_lost_in_noise_stays_in_full_detail():
    s = Steps()
    _noisy(s, 200, 20_000_000, 4_000_000)
    assert [d["period"] for d in s.decisions] == [0, 0]       # calibrated at 32 and again at 128
    assert all(s.detailed[64:128])


def test_a_cheap_detail_keeps_every_step_and_calibrates_again_later():
    s = Steps()
    s.run(500, 300_100, 300_000)         # 100 ns on 300 us: under the budget
    assert [d["period"] for d in s.decisions] == [0, 0, 0]       # calibrated at 32, 128 and 256
    assert [d["calibration"][0] for d in s.decisions] == [32, 128, 256]
    boundary = [i for i, on in enumerate(s.detailed) if not on]
    blocks = [range(a + SAMPLE_BLOCK * k, a + SAMPLE_BLOCK * (k + 1)) for a in (32, 128, 256) for k in (0, 2, 4, 6)]
    assert boundary == [i for b in blocks for i in b]


@pytest.mark.parametrize("options,reason", [({"full_detail": True}, "full detail asked for"),
                                            ({"sample_every": 64}, "--sample-every")])
def test_options_decide_at_step_32(options, reason):
    s = Steps(**options)
    s.run(300, 330_000, 300_000)
    (d,) = s.decisions
    assert d["reason"] == reason
    if options.get("full_detail"):
        assert all(s.detailed)
    else:
        assert [i for i in range(32, 300) if s.detailed[i]] == [i for i in range(32, 300) if i % 64 < SAMPLE_BLOCK]


def test_module_constants_keep_the_documented_schedule():
    assert (sampling.SAMPLE_FROM, sampling.SAMPLE_CALIBRATION, sampling.SAMPLE_BLOCK) == (32, 32, 4)


class Written:
    """The rank's writer as the footprint check reads it: bytes so far, grown by each step as recorded."""

    def __init__(self):
        self.bytes = 0

    def bytes_written(self) -> int:
        return self.bytes


def _long_job(monkeypatch, n, step_ns, detailed_bytes, boundary_bytes, **options):
    """``n`` steps of ``step_ns`` on a clock of their own; each step's rows add ``detailed_bytes`` (in detail) or
    ``boundary_bytes`` to the rank's files. Returns the Steps and the bytes written after each step."""
    clock = [0]
    monkeypatch.setattr(sampling, "now", lambda: clock[0])
    s = Steps(**options)
    s.rec.writer = w = Written()
    sizes = []
    for step in range(n):
        s.detailed.append(s.rec.detail)
        clock[0] += step_ns
        w.bytes += detailed_bytes if s.rec.detail else boundary_bytes
        sizes.append(w.bytes)
        s.rec.sample_next(step, step_ns)
    return s, sizes


def test_a_long_jobs_files_stay_under_their_daily_budget(monkeypatch):
    """100 ms steps (never sampled for cost) whose detail writes 2 kB a step: 20 kB/s in full detail, 40 times the
    budget. The check makes the detailed blocks sparser until the files grow within it; every step is still a
    step (boundary rows go on)."""
    n, step_ns = 30_000, 100_000_000
    s, sizes = _long_job(monkeypatch, n, step_ns, 2000, 20)
    foot = [d for d in s.decisions if str(d["reason"]).startswith("footprint")]
    assert foot and all(d["period"] & (d["period"] - 1) == 0 for d in foot)
    last = foot[-1]["from_step"]
    budget = sampling.FOOTPRINT_BYTES_PER_DAY / 86_400 * step_ns / 1e9       # bytes a step may add
    assert (sizes[-1] - sizes[last]) / (n - 1 - last) <= budget
    assert all(s.detailed[i] == (i % foot[-1]["period"] < SAMPLE_BLOCK) for i in range(last + 1, n))
    assert last < 5000                   # decided within minutes of the job, not at its end


def test_a_small_footprint_and_chosen_sampling_are_left_alone(monkeypatch):
    s, _ = _long_job(monkeypatch, 6000, 100_000_000, 40, 20)                 # 400 B/s: within the budget
    assert all(s.detailed) and not any(str(d["reason"]).startswith("footprint") for d in s.decisions)
    s, _ = _long_job(monkeypatch, 6000, 100_000_000, 2000, 20, full_detail=True)
    assert all(s.detailed)


def test_the_steps_called_quiet_are_those_whose_end_changes_nothing(monkeypatch):
    """Sampler.quiet_until tells the boundary hook (collectors/boundary.py) at which step's end it must call the
    sampler again while steps are boundary-only: before it, sample_next switches nothing and checks no footprint;
    most boundary-only steps of a sampled job are before it."""
    s = Steps()
    checks = []
    monkeypatch.setattr(s.rec, "check_footprint", lambda nxt: checks.append(nxt))
    quiet, acted = 0, []
    until = 0
    for step in range(6000):
        before = s.rec.detail
        s.rec.sample_next(step, 330_000 if before else 300_000)
        if step < until:
            quiet += 1
            assert s.rec.detail == before and not checks, step
        elif s.rec.detail != before or checks:
            acted.append(step)
        checks.clear()
        until = 0 if s.rec.detail else s.rec.quiet_until(step + 1)    # as BoundarySteps.refresh asks
    period = s.decisions[0]["period"]
    assert 0 < period < 2048 and acted            # sampled: detailed blocks came, each switched on at its step
    assert quiet > 0.9 * (6000 - 64) * (period - SAMPLE_BLOCK) / period
