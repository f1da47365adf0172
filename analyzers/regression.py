"""Regression gates: parse gate expressions and decide them on two sides' summaries. Pure numpy, no I/O.

A *side* is one or more runs of one configuration (several runs are pooled to model run-to-run noise). Each run
is given as its summary.json dict (docs/summary-schema.md, issue 3).

Gate expressions
----------------
``KEY OP VALUE`` where KEY is a dotted path into summary.json, OP one of ``< <= > >= == !=`` and VALUE is

- ``0.30`` (no sign, no unit): an absolute limit on the head's value;
- ``+5%`` / ``-2%``: a change relative to base (head ≤ base × 1.05);
- ``-2pp``: a change in percentage points (0.01 of the key's unit; 1.0 for keys ending in ``_pct``);
- ``+0.02``: a signed change in the key's own units (head − base < 0.02).

A relative VALUE needs its sign (``+5%``) so that ``< 5%`` is never silently read as 0.05 or as a change.
A list value (``stragglers``) counts its entries whose ``kind`` is not ``"none"``.

Deciding on noise (step-time keys)
----------------------------------
``steps.time_s.<stat>`` (p50, mean, pNN) is decided on the per-step distributions ``steps.per_step_time_s`` of
both sides (warm-up already excluded by the analyzers), not on the two summary numbers. The default test is a
moving-block bootstrap of the ratio ``stat(head) / stat(base)``: blocks of ~n^(1/3) consecutive steps keep slow
drifts (thermal, data-dependent) in the resamples, and with several runs on a side the runs are resampled first
(a hierarchical bootstrap), so run-to-run spread widens the interval. Resampling two or three runs underestimates
their spread (by (k-1)/k, and with the normal rather than the t quantile), so with several runs the interval is
widened to at least Student's t interval of the runs' own statistics (``run_level_interval``). A rank-based
alternative (Hodges–Lehmann shift of log step times with the Mann–Whitney interval) is available as
``test="rank"``.

A gate *fails* only when the whole confidence interval lies on the wrong side of its limit, i.e. we are confident
that the change exceeds the tolerance; a point estimate past the limit with an interval that straddles it passes
(and says so). A side with fewer than ``MIN_STEPS`` measured steps makes the gate *inconclusive*. The default
tolerance and confidence were chosen from the power curves of ``benchmarks/gate_power.py`` (docs/compare.md).
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

# Chosen from benchmarks/gate_power.py (see docs/compare.md for the measured table).
DEFAULT_STEP_TOLERANCE = 0.02
DEFAULT_CONFIDENCE = 0.90
DEFAULT_N_BOOT = 2000
MIN_STEPS = 20

DEFAULT_GATES = (f"steps.time_s.p50 < +{DEFAULT_STEP_TOLERANCE * 100:g}%",)
# Shown beside the deciding gate; they never fail the build on their own (single numbers with no noise model).
DEFAULT_ADVISORY = (
    "mfu.value > -2pp",
    "overlap.exposed_comm_frac < +0.05",
    "pipeline.bubble_frac < +0.02",
    "stragglers <= +0",
    "memory.ranks.peak_bytes < +5%",  # each rank's memory ledger peak against its own; the note names the rank
)
RANKS_KEY = "memory.ranks."       # memory.ranks.<ledger field>: gated rank by rank, the rank that moved most decides

STEP_KEY = "steps.time_s."
STEP_SAMPLES_KEY = "steps.per_step_time_s"

PASS, FAIL, WARN, INCONCLUSIVE, NA = "pass", "fail", "warn", "inconclusive", "n/a"

_OPS = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal,
        "==": np.equal, "!=": np.not_equal}
_GATE_RE = re.compile(r"^\s*(?P<key>[A-Za-z_][\w.]*)\s*(?P<op><=|>=|==|!=|<|>)\s*"
                      r"(?P<sign>[+-])?\s*(?P<num>\d+(?:\.\d*)?|\.\d+)(?:[eE](?P<exp>[+-]?\d+))?\s*"
                      r"(?P<unit>%|pp)?\s*$")


class GateError(ValueError):
    """A gate expression or a gate's input cannot be used. The message is one line."""


@dataclass(frozen=True)
class Gate:
    """One parsed gate. ``mode`` is "absolute" (limit on head), "ratio" (head/base), or "delta" (head − base)."""
    expr: str
    key: str
    op: str
    mode: str
    limit: float          # absolute value, ratio limit (1 + x), or delta in the key's units
    advisory: bool = False

    @property
    def is_step_time(self) -> bool:
        return self.key.startswith(STEP_KEY)


def parse_gate(expr: str, advisory: bool = False) -> Gate:
    m = _GATE_RE.match(expr)
    if not m:
        raise GateError(f"gate {expr!r}: expected KEY OP VALUE, e.g. 'steps.time_s.p50 < +5%' or "
                        f"'overlap.exposed_comm_frac < 0.30'")
    key, op, sign, unit = m["key"], m["op"], m["sign"], m["unit"]
    x = float(m["num"] + (f"e{m['exp']}" if m["exp"] else ""))
    if sign == "-":
        x = -x
    if unit and not sign:
        raise GateError(f"gate {expr!r}: a change needs its sign ('+{m['num']}{unit}' relative to base); "
                        f"write a plain number for an absolute limit")
    if unit == "%":
        mode, limit = "ratio", 1.0 + x / 100.0
    elif unit == "pp":
        mode, limit = "delta", x * (1.0 if key.endswith("_pct") else 0.01)
    elif sign:
        mode, limit = "delta", x
    else:
        mode, limit = "absolute", x
    if op in ("==", "!=") and mode == "ratio":
        raise GateError(f"gate {expr!r}: '{op}' needs an absolute value or a signed change, not a percentage")
    if key.startswith(STEP_KEY) and op in ("==", "!="):
        raise GateError(f"gate {expr!r}: step times are noisy; use <, <=, > or >=")
    if key.startswith(STEP_KEY) and _step_stat(key) is None:
        raise GateError(f"gate {expr!r}: unknown step-time statistic {key[len(STEP_KEY):]!r} "
                        f"(use p50, mean or pNN such as p90)")
    return Gate(expr.strip(), key, op, mode, limit, advisory)


def _step_stat(key: str) -> float | str | None:
    """``steps.time_s.p90`` -> 0.90 (a quantile), ``...mean`` -> "mean", ``...median`` -> 0.5."""
    name = key[len(STEP_KEY):]
    if name == "mean":
        return "mean"
    if name == "median":
        return 0.5
    m = re.fullmatch(r"p(\d{1,2}(?:\.\d+)?)", name)
    return float(m[1]) / 100.0 if m else None


# ----------------------------------------------------------------------------------------------------------------
# Reading values out of summaries

_MISSING = object()


def lookup(summary: dict, key: str) -> Any:
    """The value at dotted ``key`` in ``summary``; ``_MISSING`` if the path does not exist.

    A null section (``"pipeline": null`` for a job without pipeline parallelism) makes its keys null, not missing."""
    node: Any = summary
    for part in key.split("."):
        if node is None:
            return None
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return _MISSING
    return node


def scalar_value(value: Any) -> float | None:
    """A summary value as a number: lists count their entries (stragglers: those whose kind is not "none")."""
    if value is None or value is _MISSING:
        return None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return None if math.isnan(float(value)) else float(value)
    if isinstance(value, list):
        return float(sum(1 for v in value if not (isinstance(v, dict) and v.get("kind") == "none")))
    if isinstance(value, dict) and "count" in value:
        return scalar_value(value["count"])
    raise GateError(f"value {value!r} is not a number or a list")


def step_samples(summary: dict) -> np.ndarray | None:
    """Per-step job times of one run (warm-up excluded), or None if the summary has none."""
    v = lookup(summary, STEP_SAMPLES_KEY)
    if v is _MISSING or v is None:
        return None
    a = np.asarray(v, dtype=float)
    return a[np.isfinite(a)]


# ----------------------------------------------------------------------------------------------------------------
# Statistics

def _stat(x: np.ndarray, stat, axis=-1) -> np.ndarray:
    if stat == "mean":
        return np.nanmean(x, axis=axis)
    return np.nanquantile(x, stat, axis=axis) if np.isnan(x).any() else np.quantile(x, stat, axis=axis)


def block_length(n: int) -> int:
    """Moving-block length ~ n^(1/3) (Hall, Horowitz & Jing 1995 rate for distribution quantities)."""
    return max(1, int(round(n ** (1.0 / 3.0))))


def block_resample(x: np.ndarray, n_boot: int, rng: np.random.Generator, block: int | None = None) -> np.ndarray:
    """(n_boot, n) circular moving-block bootstrap resamples of the series ``x``."""
    n = len(x)
    b = block or block_length(n)
    n_blocks = -(-n // b)
    starts = rng.integers(0, n, size=(n_boot, n_blocks))
    idx = (starts[:, :, None] + np.arange(b)).reshape(n_boot, n_blocks * b)[:, :n] % n
    return x[idx]


def side_resamples(runs: Sequence[np.ndarray], n_boot: int, rng: np.random.Generator,
                   block: int | None = None) -> np.ndarray:
    """(n_boot, total steps) resamples of a side: runs resampled with replacement, then blocks within each run.

    Unequal run lengths are padded with NaN (statistics ignore them)."""
    if len(runs) == 1:
        return block_resample(runs[0], n_boot, rng, block)
    k = len(runs)
    n_max = max(len(r) for r in runs)
    per_run = np.full((k, n_boot, n_max), np.nan)
    for j, r in enumerate(runs):
        per_run[j, :, :len(r)] = block_resample(r, n_boot, rng, block)
    pick = rng.integers(0, k, size=(n_boot, k))
    return per_run[pick, np.arange(n_boot)[:, None], :].reshape(n_boot, k * n_max)


def _pooled(runs: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate(list(runs))


def bootstrap_ratio(base_runs: Sequence[np.ndarray], head_runs: Sequence[np.ndarray], stat=0.5,
                    confidence: float = DEFAULT_CONFIDENCE, n_boot: int = DEFAULT_N_BOOT, seed: int = 0,
                    block: int | None = None) -> tuple[float, float, float]:
    """Point estimate and two-sided CI of ``stat(head) / stat(base)``: the percentile interval of the (hierarchical)
    block bootstrap, widened to the run-level t interval when a side has several runs."""
    rng = np.random.default_rng(seed)
    est = float(_stat(_pooled(head_runs), stat) / _stat(_pooled(base_runs), stat))
    rb = _stat(side_resamples(base_runs, n_boot, rng, block), stat)
    rh = _stat(side_resamples(head_runs, n_boot, rng, block), stat)
    log_ratio = np.log(rh) - np.log(rb)
    a = (1.0 - confidence) / 2.0
    lo, hi = _widened(np.quantile(log_ratio, [a, 1.0 - a]), base_runs, head_runs, stat, confidence, log=True)
    return est, float(np.exp(lo)), float(np.exp(hi))


def _widened(interval, base_runs, head_runs, stat, confidence: float, log: bool) -> tuple[float, float]:
    """A bootstrap ``interval`` (of the log ratio when ``log``, else of the difference) widened to at least the
    run-level t interval (``run_level_interval``) when a side has several runs."""
    lo, hi = float(interval[0]), float(interval[1])
    runs = run_level_interval(base_runs, head_runs, stat, confidence, log)
    return (lo, hi) if runs is None else (min(lo, runs[0]), max(hi, runs[1]))


def run_level_interval(base_runs: Sequence[np.ndarray], head_runs: Sequence[np.ndarray], stat, confidence: float,
                       log: bool) -> tuple[float, float] | None:
    """Student's t interval of mean(head runs' stat) − mean(base runs' stat), the logs of the stats when ``log``
    (a log ratio), each run one observation and the two sides' variances pooled; None unless a side has two runs.

    Why: the runs, not the steps, are the independent units of run-to-run spread, and two or three of them are
    too few for the bootstrap to see it (benchmarks/gate_power.py: with a 6 % run-to-run spread, identical
    configurations failed the default gate in 9.2 % / 5.0 % of comparisons of two / three runs a side on the
    bootstrap alone, 2.0 % / 3.0 % with this interval)."""
    kb, kh = len(base_runs), len(head_runs)
    if max(kb, kh) < 2:
        return None
    b = np.array([float(_stat(np.asarray(x, float), stat)) for x in base_runs])
    h = np.array([float(_stat(np.asarray(x, float), stat)) for x in head_runs])
    if log:
        if (b <= 0).any() or (h <= 0).any():
            return None
        b, h = np.log(b), np.log(h)
    df = kb + kh - 2
    ss = float(((b - b.mean()) ** 2).sum() + ((h - h.mean()) ** 2).sum())
    se = math.sqrt(ss / df * (1.0 / kb + 1.0 / kh))
    half = _t_ppf(1.0 - (1.0 - confidence) / 2.0, df) * se
    d = float(h.mean() - b.mean())
    return d - half, d + half


@functools.lru_cache(maxsize=64)   # the same (confidence, df) for the gate and every part row of a comparison
def _t_ppf(p: float, df: int) -> float:
    """Inverse CDF of Student's t with ``df`` degrees of freedom, for p > 0.5 (bisection on the CDF, its density
    integrated by Simpson's rule; |error| < 1e-6 for df >= 1); numpy only, no scipy."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(t: float) -> float:
        x = np.linspace(0.0, t, 4001)
        f = c * (1.0 + x * x / df) ** (-(df + 1) / 2)
        return 0.5 + float((x[1] - x[0]) / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum()))

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, hi * 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def bootstrap_value(runs: Sequence[np.ndarray], stat=0.5, confidence: float = DEFAULT_CONFIDENCE,
                    n_boot: int = DEFAULT_N_BOOT, seed: int = 0) -> tuple[float, float, float]:
    """Point estimate and CI of ``stat`` of one side (for absolute step-time limits)."""
    rng = np.random.default_rng(seed)
    est = float(_stat(_pooled(runs), stat))
    r = _stat(side_resamples(runs, n_boot, rng), stat)
    a = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(r, [a, 1.0 - a])
    return est, float(lo), float(hi)


def _norm_ppf(p: float) -> float:
    """Inverse standard normal CDF (Acklam's rational approximation, |error| < 1.2e-9); numpy only, no scipy."""
    a = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02, 1.383577518672690e+02,
         -3.066479806614716e+01, 2.506628277459239e+00)
    b = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02, 6.680131188771972e+01,
         -1.328068155288572e+01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00, -2.549732539343734e+00,
         4.374664141464968e+00, 2.938163982698783e+00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00, 3.754408661907416e+00)
    if p < 0.02425:
        q = math.sqrt(-2 * math.log(p))
        return (((((c[0]*q+c[1])*q+c[2])*q+c[3])*q+c[4])*q+c[5]) / ((((d[0]*q+d[1])*q+d[2])*q+d[3])*q+1)
    if p > 1 - 0.02425:
        return -_norm_ppf(1 - p)
    q = p - 0.5
    r = q * q
    return (((((a[0]*r+a[1])*r+a[2])*r+a[3])*r+a[4])*r+a[5])*q / (((((b[0]*r+b[1])*r+b[2])*r+b[3])*r+b[4])*r+1)


def rank_ratio(base_runs: Sequence[np.ndarray], head_runs: Sequence[np.ndarray],
               confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float, float]:
    """Hodges–Lehmann ratio head/base with its Mann–Whitney (normal approximation) confidence interval.

    On log step times: the shift estimate is the median of all pairwise differences log h_j − log b_i; the interval
    is given by the order statistics k and nm−1−k of those differences, k = nm/2 − z·sqrt(nm(n+m+1)/12).
    Assumes independent steps (no drift)."""
    lb, lh = np.log(_pooled(base_runs)), np.log(_pooled(head_runs))
    n, m = len(lb), len(lh)
    d = np.sort((lh[None, :] - lb[:, None]).ravel())
    z = _norm_ppf(1.0 - (1.0 - confidence) / 2.0)
    k = int(math.floor(n * m / 2.0 - z * math.sqrt(n * m * (n + m + 1) / 12.0)))
    k = min(max(k, 0), n * m - 1)
    return float(np.exp(np.median(d))), float(np.exp(d[k])), float(np.exp(d[n * m - 1 - k]))


# ----------------------------------------------------------------------------------------------------------------
# Evaluating gates

@dataclass
class GateResult:
    gate: Gate
    verdict: str                    # pass | fail | warn (advisory gate failed) | inconclusive | n/a
    base: float | None = None       # the statistic on each side (pooled)
    head: float | None = None
    change: float | None = None     # ratio − 1 for ratio gates, head − base for delta gates, head for absolute
    ci: tuple[float, float] | None = None   # interval of `change` (same units)
    method: str = ""
    note: str = ""
    n_base: int | None = None       # measured steps (step-time gates) or runs
    n_head: int | None = None

    def to_dict(self) -> dict:
        return {"gate": self.gate.expr, "key": self.gate.key, "mode": self.gate.mode, "limit": self.gate.limit,
                "advisory": self.gate.advisory, "verdict": self.verdict, "base": self.base, "head": self.head,
                "change": self.change, "ci": list(self.ci) if self.ci else None, "method": self.method,
                "note": self.note, "n_base": self.n_base, "n_head": self.n_head}


def _decide(op: str, limit: float, lo: float, hi: float) -> bool:
    """True (violated) only when the whole interval [lo, hi] breaks ``value OP limit``."""
    if op in ("<", "<="):
        return bool(lo >= limit) if op == "<" else bool(lo > limit)
    return bool(hi <= limit) if op == ">" else bool(hi < limit)  # step gates refuse == and != at parse time


def _finish(res: GateResult, violated: bool, point_past: bool) -> GateResult:
    if violated:
        res.verdict = WARN if res.gate.advisory else FAIL
    else:
        res.verdict = PASS
        if point_past:
            res.note = (res.note + "; " if res.note else "") + "estimate past the limit but within noise"
    return res


def evaluate_gate(gate: Gate, base: Sequence[dict], head: Sequence[dict], *, test: str = "bootstrap",
                  confidence: float = DEFAULT_CONFIDENCE, n_boot: int = DEFAULT_N_BOOT, seed: int = 0,
                  min_steps: int = MIN_STEPS) -> GateResult:
    """Decide one gate on base and head summaries (one dict per run)."""
    if gate.is_step_time:
        return _evaluate_step_gate(gate, base, head, test=test, confidence=confidence, n_boot=n_boot, seed=seed,
                                   min_steps=min_steps)
    return _evaluate_scalar_gate(gate, base, head)


def _evaluate_step_gate(gate, base, head, *, test, confidence, n_boot, seed, min_steps) -> GateResult:
    stat = _step_stat(gate.key)
    res = GateResult(gate, INCONCLUSIVE)
    head_samples = [step_samples(s) for s in head]
    base_samples = [step_samples(s) for s in base]
    if any(x is None for x in head_samples) or (gate.mode != "absolute" and any(x is None for x in base_samples)):
        res.note = f"no {STEP_SAMPLES_KEY} in a summary"
        return res
    hs = [x for x in head_samples if x is not None]
    bs = [x for x in base_samples if x is not None]   # an absolute gate may have base runs without samples
    res.n_head = int(sum(len(x) for x in hs))
    res.n_base = int(sum(len(x) for x in bs)) if bs else None
    short = [side for side, runs in (("head", hs), ("base", bs if gate.mode != "absolute" else []))
             if any(len(x) < min_steps for x in runs)]
    if short:
        res.note = f"fewer than {min_steps} measured steps in a {' and '.join(short)} run"
        return res
    res.head = float(_stat(_pooled(hs), stat))
    if gate.mode == "absolute":
        est, lo, hi = bootstrap_value(hs, stat, confidence, n_boot, seed)
        res.method = f"block bootstrap, {confidence:.0%} CI"
        res.change, res.ci = est, (lo, hi)
        return _finish(res, _decide(gate.op, gate.limit, lo, hi), not _OPS[gate.op](est, gate.limit))
    res.base = float(_stat(_pooled(bs), stat))
    if test == "rank":
        if stat != 0.5:
            raise GateError(f"gate {gate.expr!r}: the rank test decides medians only (use steps.time_s.p50)")
        est, lo, hi = rank_ratio(bs, hs, confidence)
        res.method = f"Hodges-Lehmann / Mann-Whitney, {confidence:.0%} CI"
    else:
        est, lo, hi = bootstrap_ratio(bs, hs, stat, confidence, n_boot, seed)
        res.method = f"block bootstrap of the ratio, {confidence:.0%} CI"
    if gate.mode == "ratio":
        res.change, res.ci = est - 1.0, (lo - 1.0, hi - 1.0)
        return _finish(res, _decide(gate.op, gate.limit, lo, hi), not _OPS[gate.op](est, gate.limit))
    # delta on a step time: scale the ratio interval by the base statistic
    b = res.base
    res.change, res.ci = b * (est - 1.0), (b * (lo - 1.0), b * (hi - 1.0))
    return _finish(res, _decide(gate.op, gate.limit, *res.ci), not _OPS[gate.op](res.change, gate.limit))


def _side_value(summaries: Sequence[dict], key: str) -> tuple[float | None, bool]:
    """Median over a side's runs of the key's value; (None, present?)."""
    raw = [lookup(s, key) for s in summaries]
    present = any(v is not _MISSING for v in raw)
    vals = [x for x in (scalar_value(v) for v in raw if v is not _MISSING) if x is not None]
    return (float(np.median(vals)) if vals else None), present


def _evaluate_rank_gate(gate, base, head) -> GateResult:
    """``memory.ranks.<field>``: each rank's ledger value (median over a side's runs) against the same rank's, the
    rank whose value moved most (ratio, delta) or is largest (absolute) deciding; ranks on one side only are left
    out. The note names that rank and, for a peak, the ledger category that grew most in it."""
    field = gate.key[len(RANKS_KEY):]
    res = GateResult(gate, NA, n_base=len(base), n_head=len(head), method="per rank: summary values (median over "
                                                                         "runs), the rank that moved most")

    def side(runs):
        return {rank: led[field] for rank, led in _rank_ledgers(runs, (field,)).items() if field in led}

    h, b = side(head), side(base)
    both = sorted(h) if gate.mode == "absolute" else [r for r in sorted(h) if r in b and b[r]]
    if not both:
        res.verdict, res.note = INCONCLUSIVE, f"no rank has {field} on both sides"
        return res

    def change(r):
        return h[r] if gate.mode == "absolute" else h[r] / b[r] - 1.0 if gate.mode == "ratio" else h[r] - b[r]
    worst = max(both, key=change) if gate.op in ("<", "<=") else min(both, key=change)
    moved = change(worst)
    res.head, res.base, res.change = h[worst], b.get(worst), moved
    value = moved + 1.0 if gate.mode == "ratio" else moved
    res = _finish(res, not bool(_OPS[gate.op](value, gate.limit)), False)
    mib = field.endswith("_bytes")
    word = {"absolute": f"{h[worst] / 2**20:.1f} MiB" if mib else f"{h[worst]:.6g}", "ratio": f"{moved:+.1%}",
            "delta": f"{moved / 2**20:+.1f} MiB" if mib else f"{moved:+.6g}"}[gate.mode]
    note = f"rank {worst}'s {field} {word}" + (f" (of {len(both)} ranks)" if len(both) > 1 else "")
    if field == "peak_bytes" and gate.mode != "absolute":
        note = _memory_note(base, head, worst) or note
    res.note = "; ".join(x for x in (res.note, note) if x)
    return res


def _evaluate_scalar_gate(gate, base, head) -> GateResult:
    if gate.key.startswith(RANKS_KEY):
        return _evaluate_rank_gate(gate, base, head)
    res = GateResult(gate, NA, n_base=len(base), n_head=len(head), method="summary values (median over runs)")
    try:
        h, h_present = _side_value(head, gate.key)
        b, b_present = _side_value(base, gate.key) if gate.mode != "absolute" else (None, True)
    except GateError as e:
        raise GateError(f"gate {gate.expr!r}: {e}") from None
    res.head, res.base = h, b
    if not h_present and not b_present:
        res.verdict, res.note = INCONCLUSIVE, f"key {gate.key} is in no summary"
        return res
    if h is None or (gate.mode != "absolute" and b is None):
        if (h_present and h is None) and (gate.mode == "absolute" or (b_present and b is None)):
            res.note = "not measured in this job (null)"
            return res  # n/a: e.g. pipeline.bubble_frac of a job without pipeline parallelism
        res.verdict, res.note = INCONCLUSIVE, f"{gate.key} missing on one side"
        return res
    if gate.mode == "absolute":
        res.change = h
    elif b is None:
        raise AssertionError("unreachable: a relative gate returned above without a base value")
    elif gate.mode == "ratio":
        if b == 0:
            res.verdict, res.note = INCONCLUSIVE, "base value is 0; use an absolute or signed limit"
            return res
        res.change = h / b - 1.0
    else:
        res.change = h - b
    value = res.change + 1.0 if gate.mode == "ratio" else res.change
    res = _finish(res, not bool(_OPS[gate.op](value, gate.limit)), False)
    if gate.key.startswith("mfu.") and gate.mode != "absolute":
        res.note = "; ".join(x for x in (res.note, _peak_note(base, head)) if x)
    if gate.key.startswith("memory.") and gate.mode != "absolute":
        res.note = "; ".join(x for x in (res.note, _memory_note(base, head)) if x)
    return res


LEDGER_KEYS = ("peak_bytes", "params_bytes", "grads_bytes", "optimizer_state_bytes", "activations_peak_bytes")


def _rank_ledgers(summaries: Sequence[dict], keys: Sequence[str] = LEDGER_KEYS) -> dict[int, dict]:
    """rank -> its memory ledger (summary.json ``memory.ranks``), each of ``keys`` the median over the runs."""
    by_rank: dict[int, list[dict]] = {}
    for s in summaries:
        for r in (s.get("memory") or {}).get("ranks") or []:
            by_rank.setdefault(int(r["rank"]), []).append(r)
    return {rank: {k: float(np.median(v)) for k in keys if (v := [x[k] for x in rows if x.get(k) is not None])}
            for rank, rows in by_rank.items()}


def _memory_note(base: Sequence[dict], head: Sequence[dict], rank: int | None = None) -> str:
    """The rank whose peak memory grew most (or ``rank``), from base to head, and the ledger category that grew
    most in it."""
    b, h = _rank_ledgers(base), _rank_ledgers(head)
    both = [r for r in sorted(set(b) & set(h)) if b[r].get("peak_bytes") and h[r].get("peak_bytes")
            and rank in (None, r)]
    if not both:
        return ""
    r = max(both, key=lambda x: h[x]["peak_bytes"] / b[x]["peak_bytes"])
    change = h[r]["peak_bytes"] / b[r]["peak_bytes"] - 1.0
    cats = [(h[r][k] - b[r][k], k[:-6].replace("_", " ")) for k in ("params_bytes", "grads_bytes",
            "optimizer_state_bytes", "activations_peak_bytes") if k in h[r] and k in b[r]]
    grew = max(cats) if cats else None
    return (f"rank {r}'s peak {change:+.1%}" + (f" (most in {grew[1]}: {grew[0] / 2**20:+.1f} MiB)"
                                                 if grew and grew[0] > 0 else ""))


def _peak_note(base: Sequence[dict], head: Sequence[dict]) -> str:
    """MFU divides by a peak; when the two sides' peaks differ (a CPU peak is calibrated in each run, on a busy
    machine by up to 15 %), say so: the MFU change is then partly the peak's."""
    (b, _), (h, _) = _side_value(base, "mfu.peak_flops"), _side_value(head, "mfu.peak_flops")
    if b is None or h is None or abs(h / b - 1.0) < 0.01:
        return ""
    return f"peak differs: base {b / 1e12:.3g}, head {h / 1e12:.3g} TFLOP/s ({h / b - 1.0:+.0%})"


def overall_exit(results: Sequence[GateResult]) -> int:
    """0 every deciding gate passed, 1 any failed, 3 none failed but one was inconclusive."""
    deciding = [r for r in results if not r.gate.advisory]
    if any(r.verdict == FAIL for r in deciding):
        return 1
    if any(r.verdict == INCONCLUSIVE for r in deciding):
        return 3
    return 0


# ----------------------------------------------------------------------------------------------------------------
# Which part of the step moved (the breakdown's per-step series, summary.json ``breakdown.per_step``)

# A part is reported as moved when its whole interval lies beyond this share of the base's mean step time: half
# the step gate's tolerance, so the parts of a failing step change show, while the ~0.5 % run-to-run offset of
# identical configurations (benchmarks/gate_power.py) does not.
PART_FLOOR_FRAC = DEFAULT_STEP_TOLERANCE / 2


def part_series(summary: dict) -> dict[str, np.ndarray] | None:
    """``{row name: per-step seconds}`` of one run: the parts (``backward``), and exposed communication by mesh
    dimension (``exposed_comm[dim=dp]``) and by op (``exposed_comm[op=all_reduce]``); None without the series."""
    ps = lookup(summary, "breakdown.per_step")
    if not isinstance(ps, dict) or not ps.get("parts"):
        return None
    out = {p: np.asarray(v, float) for p, v in ps["parts"].items()}
    for what, key in (("dim", "exposed_comm_by_dim"), ("op", "exposed_comm_by_op")):
        for name, v in (ps.get(key) or {}).items():
            out[f"exposed_comm[{what}={name}]"] = np.asarray(v, float)
    return out


def _rank_part_means(summary: dict, row: str) -> dict[int, float]:
    """Per rank, the mean seconds per step of one row (ranks[].breakdown_s_per_step and its exposed splits)."""
    m = re.fullmatch(r"exposed_comm\[(dim|op)=(.*)\]", row)
    out = {}
    for r in summary.get("ranks") or []:
        if m:
            d = r.get(f"exposed_comm_s_per_step_by_{m[1]}") or {}
            v = d.get(m[2], 0.0)
        else:
            v = (r.get("breakdown_s_per_step") or {}).get(row)
        if isinstance(v, (int, float)) and r.get("rank") is not None:
            out[int(r["rank"])] = float(v)
    return out


def _mover_rank(base: Sequence[dict], head: Sequence[dict], row: str, sign: float) -> tuple[int | None, float | None]:
    """The rank whose mean of ``row`` moved most in the direction of the job's change (median over a side's runs)."""
    def side(runs):
        per: dict[int, list[float]] = {}
        for s in runs:
            for r, v in _rank_part_means(s, row).items():
                per.setdefault(r, []).append(v)
        return {r: float(np.median(v)) for r, v in per.items()}
    b, h = side(base), side(head)
    deltas = {r: h[r] - b[r] for r in h if r in b}
    if not deltas:
        return None, None
    r = max(deltas, key=lambda k: sign * deltas[k])
    return r, deltas[r]


def median_change(br: Sequence[np.ndarray], hr: Sequence[np.ndarray], confidence: float, n_boot: int,
                  seed: int) -> tuple[float, float, float, float, float]:
    """(base median, head median, head − base, its interval) of one per-step series: a block bootstrap of the
    difference of medians (runs resampled first), widened to the runs' t interval."""
    rng = np.random.default_rng(seed)
    a = (1.0 - confidence) / 2.0
    rb = _stat(side_resamples(br, n_boot, rng), 0.5)
    rh = _stat(side_resamples(hr, n_boot, rng), 0.5)
    lo, hi = _widened(np.quantile(rh - rb, [a, 1.0 - a]), br, hr, 0.5, confidence, log=False)
    b_med, h_med = float(np.median(_pooled(br))), float(np.median(_pooled(hr)))
    return b_med, h_med, h_med - b_med, float(lo), float(hi)


def _row_runs(side: list[dict[str, np.ndarray]], name: str) -> list[np.ndarray]:
    """One row's per-step series of each run of a side; zeros where a run never had it (no exposed comm on a dim)."""
    return [x[name] if name in x else np.zeros(len(next(iter(x.values())))) for x in side]


def part_changes(base: Sequence[dict], head: Sequence[dict], *, confidence: float = DEFAULT_CONFIDENCE,
                 n_boot: int = DEFAULT_N_BOOT, seed: int = 0, floor_frac: float = PART_FLOOR_FRAC) -> dict:
    """The parts of the step that moved beyond the noise, largest first.

    Each row's change is median(head) − median(base) of the critical rank's part per measured step (medians, as
    the step gate's p50: a few 2-3x outlier steps must not hide or fake a change), with a block-bootstrap interval
    (runs resampled first, widened to the runs' t interval, as for step time); it *moved* when the whole interval
    lies beyond ±``floor_frac`` × the base's mean step time. Each row names the rank whose own mean of that part
    moved most.
    Returns ``{"rows": [...], "floor_s", "note"}``; rows explain a change, they never decide the exit code."""
    bs, hs = [part_series(s) for s in base], [part_series(s) for s in head]
    if any(x is None for x in bs + hs):
        return {"rows": [], "floor_s": None,
                "note": "no per-step breakdown (breakdown.per_step) in a summary: re-run dtprof summary"}
    b_series = [x for x in bs if x is not None]
    h_series = [x for x in hs if x is not None]
    base_steps = [step_samples(s) for s in base]
    step_mean = float(np.mean(np.concatenate([x for x in base_steps if x is not None] or [np.zeros(1)])))
    floor = floor_frac * step_mean
    names = sorted(set().union(*[set(x) for x in b_series + h_series]))
    rows: list[dict[str, Any]] = []
    for i, name in enumerate(names):
        br, hr = _row_runs(b_series, name), _row_runs(h_series, name)
        if min(min(len(x) for x in br), min(len(x) for x in hr)) < 2:
            continue
        b_med, h_med, change, lo, hi = median_change(br, hr, confidence, n_boot, seed + i)
        if not (lo > floor or hi < -floor):
            continue
        rank, rank_change = _mover_rank(base, head, name, 1.0 if change > 0 else -1.0)
        rows.append({"part": name, "base_s": b_med, "head_s": h_med, "change_s": change,
                     "ci_s": [float(lo), float(hi)], "change_frac_of_step": change / step_mean if step_mean else None,
                     "rank": rank, "rank_change_s": rank_change})
    rows.sort(key=lambda r: -abs(r["change_s"]))
    return {"rows": rows, "floor_s": floor, "note": ""}


# ----------------------------------------------------------------------------------------------------------------
# Stragglers compared by kind and by predicted saving

# A flagged straggler's predicted saving (share of the step) must grow by this much to count: what-if savings of
# identical configurations differ by a few points from run to run (real runs of one configuration on the busy
# 2-core VM showed +2-4 points), and a single number per run has no noise model of its own.
SAVING_GROWTH = 0.05


def _kinds(summary: dict) -> dict[int, str]:
    return {int(s["rank"]): str(s.get("kind")) for s in summary.get("stragglers") or []
            if isinstance(s, dict) and s.get("rank") is not None and s.get("kind") not in (None, "none")}


def _savings(summary: dict) -> dict[tuple[int, ...], float]:
    """Predicted saving (share of the step) of removing each straggler (summary.json ``what_if`` entries of
    scenario ``straggler_removed``, analyzers/whatif.py), by the scenario's ranks."""
    out = {}
    for w in summary.get("what_if") or []:
        if isinstance(w, dict) and w.get("scenario") == "straggler_removed" and w.get("ranks") \
                and isinstance(w.get("saving_frac"), (int, float)):
            out[tuple(sorted(int(r) for r in w["ranks"]))] = float(w["saving_frac"])
    return out


def straggler_changes(base: Sequence[dict], head: Sequence[dict]) -> list[dict]:
    """Rows for stragglers that got worse: a rank persistent in most head runs but in no base run (``fail``); a rank
    newly transient (``warn``); a rank flagged in most head runs whose ``straggler_removed`` saving grew by
    ``SAVING_GROWTH`` (``fail``)."""
    def persistent_in(runs, r):
        return sum(_kinds(s).get(r) == "persistent" for s in runs)
    rows = []
    head_ranks = sorted(set().union(*[set(_kinds(s)) for s in head])) if head else []
    for r in head_ranks:
        b_kinds = sorted({_kinds(s).get(r, "none") for s in base})
        h_kinds = sorted({_kinds(s).get(r, "none") for s in head})
        if persistent_in(head, r) * 2 > len(head) and persistent_in(base, r) == 0:
            rows.append({"rank": r, "what": "became persistent", "base": "/".join(b_kinds), "head": "/".join(h_kinds),
                         "verdict": FAIL})
        elif all(k == "none" for k in b_kinds):
            rows.append({"rank": r, "what": "new straggler", "base": "none", "head": "/".join(h_kinds),
                         "verdict": WARN})
    b_sav = [_savings(s) for s in base]
    h_sav = [_savings(s) for s in head]
    for ranks in sorted(set().union(*[set(x) for x in h_sav])) if h_sav else []:
        if sum(all(r in _kinds(s) for r in ranks) for s in head) * 2 <= len(head):
            continue   # only a rank flagged as a straggler in most head runs: others' savings are noise
        hv = [x[ranks] for x in h_sav if ranks in x]
        bv = [x.get(ranks, 0.0) for x in b_sav]
        if hv and bv and float(np.median(hv)) - float(np.median(bv)) >= SAVING_GROWTH:
            rows.append({"rank": list(ranks)[0] if len(ranks) == 1 else list(ranks), "what": "saving grew",
                         "base": f"{float(np.median(bv)):.1%}", "head": f"{float(np.median(hv)):.1%}",
                         "verdict": FAIL})
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Comparable or not: what identifies a configuration (summary.json run.identity, run.versions and the run's facts)

# (name, how to read it from a summary, blocking: a difference makes the comparison inconclusive)
IDENTITY_KEYS = (
    ("world size", lambda s: lookup(s, "run.world_size"), True),
    ("script (SHA-256)", lambda s: lookup(s, "run.identity.script_sha256"), True),
    ("devices", lambda s: sorted({str(r.get("device")) for r in s.get("ranks") or [] if r.get("device")}) or None,
     True),
    ("model parameters", lambda s: _model_parameters(s), True),
    ("command", lambda s: lookup(s, "run.identity.command"), False),
    ("mesh shape", lambda s: lookup(s, "mesh.shape"), False),
    ("FLOPs per step", lambda s: _flops(lookup(s, "mfu.flops_per_step")), False),
    ("torch", lambda s: lookup(s, "run.versions.torch"), False),
    ("NCCL", lambda s: lookup(s, "run.versions.nccl"), False),
    ("dtprof", lambda s: lookup(s, "run.versions.dtprof"), False),
)


def _flops(v: Any) -> str | None:
    return f"{float(v):.4g}" if isinstance(v, (int, float)) else None


def _model_parameters(summary: dict) -> str | None:
    """The model's parameter count as printed ("1,234,567"), or each rank's where ranks differ (pipeline stages)."""
    m = lookup(summary, "run.model")
    if not isinstance(m, dict):
        return None
    if m.get("parameters") is not None:
        return f"{int(m['parameters']):,}"
    by_rank = m.get("parameters_by_rank") or {}
    return ", ".join(f"rank {r}: {int(n):,}" for r, n in sorted(by_rank.items(), key=lambda x: int(x[0]))) or None


def _side_identity(runs: Sequence[dict], read) -> str | None:
    vals = set()
    for s in runs:
        v = read(s)
        if v is _MISSING or v is None:
            continue
        vals.add(", ".join(map(str, v)) if isinstance(v, list) else str(v))
    return " | ".join(sorted(vals)) if vals else None


def config_differences(base: Sequence[dict], head: Sequence[dict]) -> list[dict]:
    """What differs between the sides' configurations: ``{key, base, head, blocking}``; a key unknown on a side
    (an older or imported run) is not a difference."""
    out = []
    for name, read, blocking in IDENTITY_KEYS:
        b, h = _side_identity(base, read), _side_identity(head, read)
        if b is not None and h is not None and b != h:
            out.append({"key": name, "base": b, "head": h, "blocking": blocking})
    return out


# ----------------------------------------------------------------------------------------------------------------
# The machine as a suspect: the launcher's CPU and GPU probes (summary.json run.probe), before and after each job

# The probe moved when the whole interval of its median ratio lies beyond ±15 %: its timings are a few ms each
# and spread ~±30 % on a busy 2-core machine; at ±10 % identical runs were inconclusive in 1.3 % of simulated
# pairs (benchmarks/gate_power.py), above the gate's 1 % false-alarm target. The GPU probe (CUDA event timings of
# the GPU alone) uses the same band: its spread on a GPU has not been measured (no GPU here).
PROBE_TOLERANCE = 0.15


# Which device bounds the steps (docs/compare.md, "Which probe"): the GPU's busy share of the measured steps, from a
# kernel sample where the run has one (1 - gpu_time.step_idle_frac, an ordinary step's; 1 - idle_frac, the traced
# steps', where no ordinary step is known), else NVML's utilisation (the share of
# time a kernel ran; summary gpus[].sm_util_mean_pct over the measured steps, mean over GPUs). At GPU_BOUND or more
# the host's share of the step is at most a quarter: the GPU bounds it, and only the GPU probe can explain a change;
# at HOST_BOUND or less the GPU waits for the host most of the step: only the CPU probe can; between, both.
GPU_BOUND = 0.75
HOST_BOUND = 0.25


def gpu_idle_share(gt: dict | None) -> tuple[float | None, bool]:
    """The GPU's idle share that stands for the run in a ``gpu_time`` dict: an ordinary step's (``step_idle_frac``)
    where the run has one, else the traced steps' (``idle_frac``); and whether it is the ordinary step's."""
    for key, ordinary in (("step_idle_frac", True), ("idle_frac", False)):
        v = (gt or {}).get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            return float(v), ordinary
    return None, False


def gpu_busy(summary: dict) -> tuple[float | None, str]:
    """(the GPU's busy share of the run's measured steps, its source); (None, why) without one."""
    gt = summary.get("gpu_time") or {}
    idle, ordinary = gpu_idle_share(gt)
    if idle is not None:
        return 1.0 - idle, ("kernel sample (1 - an ordinary step's GPU idle share)" if ordinary else
                            "kernel sample (1 - GPU idle share of kernel time)")
    util = [g.get("sm_util_mean_pct") for g in summary.get("gpus") or []]
    util = [float(u) for u in util if isinstance(u, (int, float)) and not math.isnan(u)]
    if util:
        return float(np.mean(util)) / 100, "NVML GPU utilisation over the measured steps"
    return None, "no GPU busy figure (no kernel sample, no NVML samples)"


def bounding_device(base: Sequence[dict], head: Sequence[dict]) -> dict:
    """Which machine probe can explain a change of these runs' steps: ``{device: "gpu" | "cpu" | "both", why}``
    (module note above GPU_BOUND); every run must agree for one device alone."""
    runs = list(base) + list(head)
    on_gpu = [lookup(s, "run.probe.gpu_start_s") not in (None, _MISSING, []) or bool(s.get("gpus")) for s in runs]
    if not any(on_gpu):
        return {"device": "cpu", "busy": None, "why": "no GPU in these runs"}
    busy = [gpu_busy(s) for s in runs]
    known = [b for b, _ in busy if b is not None]
    if len(known) < len(runs):
        return {"device": "both", "busy": None, "why": next(w for b, w in busy if b is None)}
    lo, hi = min(known), max(known)
    src = "; ".join(sorted({w for _, w in busy}))
    share = f"{lo:.0%}" if f"{lo:.0%}" == f"{hi:.0%}" else f"{lo:.0%}-{hi:.0%}"
    if lo >= GPU_BOUND:
        why = f"GPU-bound: the GPU is busy {share} of the steps ({src}), at least {GPU_BOUND:.0%}"
        return {"device": "gpu", "busy": [lo, hi], "why": why}
    if hi <= HOST_BOUND:
        why = f"host-bound: the GPU is busy {share} of the steps ({src}), at most {HOST_BOUND:.0%}"
        return {"device": "cpu", "busy": [lo, hi], "why": why}
    return {"device": "both", "busy": [lo, hi],
            "why": f"the GPU is busy {share} of the steps ({src}): host and GPU both bound them"}


def probe_change(base: Sequence[dict], head: Sequence[dict], *, confidence: float = DEFAULT_CONFIDENCE,
                 n_boot: int = DEFAULT_N_BOOT, seed: int = 0, kind: str = "cpu",
                 phases: Sequence[str] = ("start", "end")) -> dict | None:
    """Ratio of the ``kind`` probe's (``cpu`` or ``gpu``) median time head ÷ base with its bootstrap interval (runs,
    then timings resampled), at the start and at the end of the job separately: load that came or went during a job
    shows in one of the two (a CPU hog running through a job slowed its start probe 3x while the end probe, after
    the ranks had exited, ran at full speed: pooled, the ten timings' median hid it). The phase whose interval lies
    furthest beyond ±PROBE_TOLERANCE is reported; ``moved`` when it lies wholly beyond. None when a side has no such
    probe (the GPU one on a CPU-only node). ``phases=("job",)``: the CPU probe during the job (``cpu_job_s``,
    dtprof/machine.py JobProbe), alone."""
    def side(runs, phase):
        out = []
        for s in runs:
            p = lookup(s, "run.probe")
            t = (p.get(f"{kind}_{phase}_s") or []) if isinstance(p, dict) else []
            if len(t) < 2:
                return None
            out.append(np.asarray(t, float))
        return out
    best = None
    for phase in phases:
        b, h = side(base, phase), side(head, phase)
        if not b or not h:
            continue
        est, lo, hi = bootstrap_ratio(b, h, 0.5, confidence, n_boot, seed, block=1)
        beyond = max(lo - (1 + PROBE_TOLERANCE), (1 - PROBE_TOLERANCE) - hi)   # > 0: wholly beyond the band
        if best is None or beyond > best[0]:
            best = (beyond, phase, est, lo, hi, b, h)
    if best is None:
        return None
    beyond, phase, est, lo, hi, b, h = best
    moved = beyond > 0
    changed = lo > 1.0 or hi < 1.0   # the interval excludes no change: the machine changed, however little
    word = "slower" if est >= 1 else "faster"
    when = "during the job" if phase == "job" else f"at the job's {phase}"
    line = (f"machine probe ({kind.upper()}, {when}): head {abs(est - 1) * 100:.0f} % {word} than "
            f"base [{(lo - 1) * 100:+.0f}, {(hi - 1) * 100:+.0f} %]"
            + (" -- beyond its noise: the machine changed" if moved else
               " -- the machine changed (its interval excludes no change)" if changed else " (within its noise)"))
    return {"kind": kind, "phase": phase, "ratio": est, "ci": [lo, hi], "moved": bool(moved), "changed": bool(changed),
            "tolerance": PROBE_TOLERANCE, "base_median_s": float(np.median(_pooled(b))),
            "head_median_s": float(np.median(_pooled(h))), "line": line}


# ----------------------------------------------------------------------------------------------------------------
# Machine drift within the step: the parts that do not scale with the machine, and the ranks' own wait for a CPU

# Parts of the step that a faster machine does not shorten (nor a slower one lengthen in proportion): sleeps and the
# step's idle host time (``other``), waits for data, for a peer (exposed communication, collectives outside
# forward/backward) and the pipeline bubble. Compute is the rest. A head whose waits grew while its compute ran
# faster on a quieter machine can pass on step time alone: the waits are judged apart (``machine_drift``).
WAIT_PARTS = ("data_wait", "exposed_comm", "comm_outside_fwd_bwd", "bubble", "other")
COMPUTE_PARTS = ("forward", "backward", "optimizer", "gpu_wait")
# A run whose ranks waited for a CPU (summary ``cpu_wait.frac_of_step``: runnable, not running) for this share of
# the step or more was recorded on a busy machine; one side is the busier when its share exceeds the other's by
# BUSY_DELTA of the step (measured: tests/jobs/test_compare_real.py and benchmarks/gate_power.py, docs/compare.md)
BUSY_CPU_WAIT = 0.05
BUSY_DELTA = 0.03
# Both sides' ranks waited for a CPU this share of the step or more: the step times measure the scheduler more than
# the code (on the shared 2-core VM, identical configurations at 77 % each failed the gate at +22 % with the probe
# saying the head's machine was the faster, and +10-25 % regressions passed: docs/compare.md), so the gate's
# verdict, pass or fail, is inconclusive
SATURATED_CPU_WAIT = 0.5


def cpu_wait_share(runs: Sequence[dict], measure: str = "frac_of_step") -> float | None:
    """Median over a side's runs of how long its ranks waited for a CPU (summary ``cpu_wait``): the share of the step
    (``frac_of_step``) or the seconds per step (``s_per_step``, the mean over its ranks); None where not measured."""
    v = [lookup(s, f"cpu_wait.{measure}") for s in runs]
    v = [float(x) for x in v if isinstance(x, (int, float)) and math.isfinite(x)]
    return float(np.median(v)) if v else None


def _group_series(summary: dict, parts: Sequence[str]) -> np.ndarray | None:
    """Per measured step, the critical rank's seconds in ``parts`` summed (summary ``breakdown.per_step``)."""
    ps = lookup(summary, "breakdown.per_step")
    if not isinstance(ps, dict) or not ps.get("parts"):
        return None
    got = [np.asarray(ps["parts"][p], float) for p in parts if p in ps["parts"]]
    return np.sum(got, axis=0) if got else None


def machine_drift(code: int, base: Sequence[dict], head: Sequence[dict], probe: dict | None, *,
                  confidence: float = DEFAULT_CONFIDENCE, n_boot: int = DEFAULT_N_BOOT, seed: int = 0,
                  tolerance: float = DEFAULT_STEP_TOLERANCE, job_probe: dict | None = None) -> dict:
    """What the machine's drift does to the gates' exit ``code`` (0 pass, 1 fail): ``{verdict, reason, busy,
    head_machine, waits, compute, lines}``; ``verdict`` is "fail", "inconclusive" or None (leave the code as it
    is); ``head_machine`` is "faster", "slower" or None: the machine the head ran on, as decided below.

    Which side ran on the slower machine: the side whose ranks waited for a CPU ``BUSY_DELTA`` of the step more
    (measured inside the job itself) unless the CPU probe's interval says the opposite, else the CPU probe's
    interval where it excludes no change (``changed``). The CPU probe is ``job_probe`` (probe_change of the probe
    during the job, in CPU time) where both sides have one, else ``probe`` (before and after the job): an identical
    configuration whose compute ran 37 % slower failed the gate while the probe after the job said its machine was
    20 % faster and its ranks' CPU wait did not move (docs/compare.md). Then:

    - a pass with the head on the faster machine: the step's waits (``WAIT_PARTS``, which a faster machine does not
      shorten) are judged apart: when their growth's whole interval lies beyond the step gate's tolerance of the
      base step, that is a regression that faster compute hid (fail), unless its lower end is no more than the
      head's ranks waited for a CPU per step (``cpu_wait_share(head, "s_per_step")``: a rank runnable but not
      running holds its peers at the next collective, so that much of the waits can be the scheduler's;
      inconclusive). Otherwise, when the base's ranks waited for
      a CPU more (a busy base), the pass is inconclusive: a slowdown of compute could hide behind it. (A probe
      change within ``PROBE_TOLERANCE`` alone does not make a pass inconclusive: on a busy 2-core machine that
      would hold up ~5 % of identical configurations, benchmarks/gate_power.py.)
    - a fail with the head on the slower machine: inconclusive, the busy machine named;
    - a pass or a fail (not already inconclusive above; a fail of the waits included) where both sides' ranks
      waited for a CPU ``SATURATED_CPU_WAIT`` of the step or more: inconclusive, whatever the probes and the waits
      say (the step times are the scheduler's: in benchmarks/gate_power.py --real, a +10 % sleep recorded beside
      CPU hogs passed against a base recorded at 77 %, its sleep offset by gloo's CPU-bound communication, faster
      on the head; and an identical configuration whose ranks waited for a CPU 65 % and 63 % of the step failed on
      its waits, the ranks' waits for descheduled peers).
    """
    out: dict[str, Any] = {"verdict": None, "reason": None, "busy": None, "head_machine": None,
                           "head_machine_why": None, "waits": None, "compute": None, "lines": []}
    wb, wh = cpu_wait_share(base), cpu_wait_share(head)
    busier = None
    if wb is not None and wh is not None:
        busier = "head" if wh - wb >= BUSY_DELTA else "base" if wb - wh >= BUSY_DELTA else None
        out["busy"] = {"base": wb, "head": wh, "busier": busier, "threshold": BUSY_CPU_WAIT, "delta": BUSY_DELTA}
        for side, w, other, w_other in (("base", wb, "head", wh), ("head", wh, "base", wb)):
            if w >= BUSY_CPU_WAIT:
                out["lines"].append(f"{side} recorded on a busy machine: its ranks waited for a CPU {w:.0%} of the "
                                    f"step (runnable, not running; {other} {w_other:.0%})")
    probe = job_probe or probe   # the probe during the job, where both sides have it, decides
    probe_dir = None
    if probe and probe.get("used", True) and probe.get("changed"):
        probe_dir = "slower" if probe["ratio"] > 1 else "faster"
    if job_probe:   # its CPU time is how fast the CPUs ran, apart from the ranks' wait for one: no conflict, each
        # counts for the side it names (both may hold: one side on slower CPUs, the other on a busier machine)
        head_faster, head_slower = busier == "base" or probe_dir == "faster", busier == "head" or probe_dir == "slower"
    else:   # the ranks' own CPU wait decides which side ran on the busier machine, unless the probe around the job
        # says the opposite (conflicting evidence: no side is taken for the faster one)
        head_faster = (busier == "base" and probe_dir != "slower") or (busier is None and probe_dir == "faster")
        head_slower = (busier == "head" and probe_dir != "faster") or (busier is None and probe_dir == "slower")
    out["head_machine"] = ("faster" if head_faster and not head_slower else
                           "slower" if head_slower and not head_faster else None)
    steps = [step_samples(s) for s in base]
    step = float(np.median(np.concatenate([x for x in steps if x is not None]))) if all(
        x is not None for x in steps) else None
    for key, parts in (("waits", WAIT_PARTS), ("compute", COMPUTE_PARTS)):
        bo, ho = [_group_series(s, parts) for s in base], [_group_series(s, parts) for s in head]
        br, hr = [x for x in bo if x is not None and len(x) >= 2], [x for x in ho if x is not None and len(x) >= 2]
        if step and len(br) == len(bo) and len(hr) == len(ho):
            b_med, h_med, change, lo, hi = median_change(br, hr, confidence, n_boot, seed + (key == "compute"))
            out[key] = {"parts": list(parts), "base_s": b_med, "head_s": h_med, "change_s": change,
                        "ci_s": [lo, hi], "grew": bool(lo > tolerance * step)}
    waits, compute = out["waits"], out["compute"]
    def machine_words(side_busy: str) -> str:
        if busier == side_busy:
            w, wo = (wb, wh) if side_busy == "base" else (wh, wb)
            other = "head" if side_busy == "base" else "base"
            return (f"the {side_busy} was recorded on a busy machine (its ranks waited for a CPU {w:.0%} of the step,"
                    f" the {other}'s {wo:.0%})")
        assert probe is not None
        return (f"the machine ran {abs(probe['ratio'] - 1):.0%} {'faster' if probe['ratio'] < 1 else 'slower'} for "
                f"the head on the CPU probe{' during the job' if probe.get('phase') == 'job' else ''} "
                f"[{probe['ci'][0] - 1:+.0%}, {probe['ci'][1] - 1:+.0%}]")
    if head_faster or head_slower:   # what says so, in words (a reason beside the gates: verdict)
        out["head_machine_why"] = machine_words("base" if head_faster else "head")
    if code == 0 and head_faster:
        if busier == "base":   # (a probe that moved beyond its band does the same: verdict)
            out["verdict"] = "inconclusive"
            out["reason"] = machine_words("base") + ": a slowdown of the head could hide behind the pass"
        if waits and waits["grew"]:
            grew = (f"the step's waits ({', '.join(WAIT_PARTS)}: time a faster machine does not shorten) grew "
                    f"{waits['change_s'] * 1e3:+.1f} ms per step [{waits['ci_s'][0] * 1e3:+.1f}, "
                    f"{waits['ci_s'][1] * 1e3:+.1f}]")
            scheduler_s = cpu_wait_share(head, "s_per_step")
            if scheduler_s is not None and waits["ci_s"][0] <= scheduler_s:
                out["verdict"] = "inconclusive"
                out["reason"] = (f"{grew}, no more than the head's ranks waited for a CPU on a busy machine "
                                 f"({scheduler_s * 1e3:.1f} ms per step): a rank descheduled keeps its peers waiting "
                                 f"at the next collective, so these waits are the scheduler's as much as the code's")
            else:
                faster = (f"; compute {compute['change_s'] * 1e3:+.1f} ms" if compute else "")
                out["verdict"] = "fail"
                out["reason"] = (f"{grew}, beyond the gate's +{tolerance:.0%} of the base step{faster}: "
                                 f"{machine_words('base')}, which hid the slowdown in the step time")
    elif code == 1 and head_slower:
        out["verdict"] = "inconclusive"
        out["reason"] = machine_words("head") + ": the machine, not the code, may have slowed it"
    if (out["verdict"] != "inconclusive" and code in (0, 1) and wb is not None and wh is not None
            and min(wb, wh) >= SATURATED_CPU_WAIT):   # a pass as much as a fail (a sleep hidden by faster gloo comm),
        # and waits that grew: there they are the ranks' waits for descheduled peers, the scheduler's too
        out["verdict"] = "inconclusive"
        out["reason"] = (f"both sides were recorded on a busy machine, saturated (their ranks waited for a CPU {wb:.0%}"
                         f" and {wh:.0%} of the step): the step times measure the scheduler more than the code")
    return out
# Numerics: non-finite values in the head, and a head whose loss departs from a bit-identical base (summary.json
# ``health``, analyzers/health.py)

def _losses(summary: dict) -> dict[tuple[int, int], float]:
    """(rank, step) -> the local loss recorded; NaN where it was non-finite (unequal to every loss)."""
    health = summary.get("health") or {}
    out = {(int(e["rank"]), int(e["step"])): e["loss"] for e in health.get("per_step") or []
           if e.get("loss") is not None}
    out.update({(int(e["rank"]), int(e["step"])): math.nan for e in health.get("nonfinite_steps") or []
                if "loss" in e["what"]})
    return out


def health_changes(base: Sequence[dict], head: Sequence[dict]) -> list[dict]:
    """Rows about the numerics of the head: ``non-finite`` (a head run with a NaN/Inf loss or gradient norm:
    ``fail`` when no base run had one, else ``warn``), and ``loss departs`` (a head run whose local loss at some
    (rank, step) the base runs recorded differs from theirs: ``fail`` when two or more base runs agree bit for bit
    at every shared (rank, step), a deterministic job, so the same seed and data must give the same losses;
    ``warn`` with one base run, whose determinism is not known). Each row names the first step and its ranks."""
    rows: list[dict] = []
    base_bad = any((s.get("health") or {}).get("first_nonfinite") for s in base)
    for i, s in enumerate(head):
        first = (s.get("health") or {}).get("first_nonfinite")
        if first:
            rows.append({"what": "non-finite", "run": i, "step": first["step"], "ranks": first["ranks"],
                         "detail": f"{first['what']} NaN/Inf first at step {first['step']} on rank(s) "
                                   f"{', '.join(map(str, first['ranks']))} "
                                   f"({(s.get('health') or {}).get('nonfinite_count', 0)} rank-steps)",
                         "verdict": WARN if base_bad else FAIL})
    b = [_losses(s) for s in base]
    b = [x for x in b if x]
    if not b:
        return rows
    shared = set(b[0]).intersection(*b[1:]) if len(b) > 1 else set(b[0])
    identical = len(b) > 1 and all(x[k] == b[0][k] for x in b[1:] for k in shared)
    if len(b) > 1 and not identical:
        return rows          # the base itself is not deterministic: a head's different losses say nothing
    for i, s in enumerate(head):
        h = _losses(s)
        # (rank, step) pairs, by step; a NaN differs from everything
        diff = sorted((k for k in shared if k in h and h[k] != b[0][k]), key=lambda k: (k[1], k[0]))
        if not diff:
            continue
        step = diff[0][1]
        ranks = sorted(r for r, st in diff if st == step)
        r0 = ranks[0]
        rows.append({"what": "loss departs", "run": i, "step": step, "ranks": ranks,
                     "detail": f"the local loss departs from the base's at step {step} (rank {r0}: "
                               f"{b[0][(r0, step)]:.6g} -> {h[(r0, step)]:.6g}); "
                               + ("the base runs agree bit for bit, so the same seed and data give the same losses"
                                  if identical else "one base run: whether the job is deterministic is not known"),
                     "verdict": FAIL if identical else WARN})
    return rows


# ----------------------------------------------------------------------------------------------------------------
# The verdict: the exit code and its reasons, from the gates and the rows beside them (`dtprof compare` renders it)

EXIT_OK, EXIT_REGRESSION, EXIT_INCONCLUSIVE = 0, 1, 3
EXIT_MEANING = {EXIT_OK: "all gates passed", EXIT_REGRESSION: "regression", EXIT_INCONCLUSIVE: "inconclusive"}


def comparison(gates: Sequence[Gate], base: Sequence[dict], head: Sequence[dict], *, base_names: Sequence[str],
               head_names: Sequence[str], test: str = "bootstrap", confidence: float = DEFAULT_CONFIDENCE,
               seed: int = 0, allow_different: bool = False) -> dict:
    """The comparison result (``dtprof.compare/1``, docs/compare.md) of the base and head summaries: each gate's
    result, the verdict (``exit_code``, ``outcome``, ``reasons``) and the rows that explain it (``verdict``). What
    the renderers of reports/compare_render.py format; raises GateError for a gate the summaries cannot decide."""
    results = [evaluate_gate(g, base, head, test=test, confidence=confidence, seed=seed) for g in gates]
    v = verdict(results, base, head, confidence=confidence, seed=seed, allow_different=allow_different)
    code, reasons = v["exit_code"], v["reasons"]
    failed = [r.gate.expr for r in results if r.verdict == FAIL and not r.gate.advisory]
    why = ([f"gate {', '.join(failed)} failed"] if failed and code == EXIT_REGRESSION else []) + reasons
    return {"schema": "dtprof.compare/1", "exit_code": code,
            "outcome": EXIT_MEANING[code] + (": " + "; ".join(why) if why else ""),
            "base": list(base_names), "head": list(head_names),
            "settings": {"test": test, "confidence": confidence, "seed": seed, "n_boot": DEFAULT_N_BOOT,
                         "min_steps": MIN_STEPS, "allow_different": allow_different},
            "gates": [r.to_dict() for r in results], "reasons": reasons,
            **{k: v[k] for k in ("parts", "stragglers", "health", "identity", "probe", "gpu_probe", "job_probe",
                                 "gpu_probe_reason", "bound", "drift")}}


def verdict(results: Sequence[GateResult], base: Sequence[dict], head: Sequence[dict], *,
            confidence: float = DEFAULT_CONFIDENCE, seed: int = 0, allow_different: bool = False) -> dict:
    """The exit code after the checks beside the gates, and what explains it: which parts moved, stragglers that
    got worse (a rank that became persistent fails), a machine that changed and configurations that differ
    (inconclusive, exit 3: neither is a regression of the code). ``{exit_code, reasons, parts (part_changes),
    stragglers (straggler_changes), health (health_changes), identity (config_differences), probe, gpu_probe and
    job_probe (probe_change: before and after the job, the GPU's, the CPU's during the job; without a GPU probe
    ``gpu_probe_reason`` says why), bound (bounding_device: which probe is used,
    and why), drift (machine_drift)}``; ``reasons``: why the outcome is what it is, one line each."""
    code = overall_exit(results)
    parts = part_changes(base, head, confidence=confidence, seed=seed)
    strag = straggler_changes(base, head)
    health = health_changes(base, head)
    identity = config_differences(base, head)
    probe = probe_change(base, head, confidence=confidence, seed=seed)
    gpu_probe = probe_change(base, head, confidence=confidence, seed=seed, kind="gpu")
    job_probe = probe_change(base, head, confidence=confidence, seed=seed, phases=("job",))
    reasons = []
    worse = [f"rank {r['rank']} {r['what']}" for r in strag if r["verdict"] == FAIL]
    numerics = [f"{r['what']} at step {r['step']}" for r in health if r["verdict"] == FAIL]
    blocking = [x for x in identity if x["blocking"]]
    if blocking and not allow_different:
        reasons.append("the runs are not comparable: " + "; ".join(f"{x['key']} {x['base']} -> {x['head']}"
                                                                   for x in blocking)
                       + " (--allow-different to decide anyway)")
    bound = bounding_device(base, head)
    machine = _machine_reasons(probe, gpu_probe, bound, slower=code == EXIT_REGRESSION or bool(worse),
                               job_probe=job_probe)
    drift = machine_drift(code, base, head, probe, confidence=confidence, seed=seed, job_probe=job_probe)
    if drift["verdict"] == "fail":   # the hidden slowdown was found: the faster machine no longer makes it doubtful
        machine = []
    elif drift["verdict"] == "inconclusive" and not machine:   # one reason for one machine change
        machine.append(drift["reason"])
    elif code == EXIT_OK and not machine and not worse:
        machine += _steps_against_machine(results, probe, job_probe, drift, bound)
    comparable = not reasons
    reasons += machine
    if numerics and comparable:   # a NaN, or a loss departing from a bit-identical base: no machine explains that
        code = EXIT_REGRESSION
        reasons.insert(0, "numerics: " + "; ".join(numerics))
        if worse:
            reasons.insert(1, "a straggler got worse: " + "; ".join(worse))
    elif reasons:
        code = EXIT_INCONCLUSIVE
    elif drift["verdict"] == "fail":
        code = EXIT_REGRESSION
        reasons.append(drift["reason"])
    elif worse:
        code = EXIT_REGRESSION
        reasons.append("a straggler got worse: " + "; ".join(worse))
    return {"exit_code": code, "reasons": reasons, "parts": parts, "stragglers": strag, "health": health,
            "identity": identity, "probe": probe, "gpu_probe": gpu_probe, "job_probe": job_probe,
            "gpu_probe_reason": None if gpu_probe else _no_gpu_probe(base, head), "bound": bound, "drift": drift}


def _steps_against_machine(results: Sequence[GateResult], probe: dict | None, job_probe: dict | None,
                           drift: dict, bound: dict) -> list[str]:
    """A pass whose steps ran confidently faster (a step-time gate's interval wholly below no change) on a machine
    that ran slower for the head by more than noise (its ranks waited for a CPU ``BUSY_DELTA`` of the step more, or a
    probe, around or during the job, beyond its band; a probe interval that merely excludes no change made 2 % of
    benchmarks/gate_power.py's identical pairs inconclusive, their steps 1 % faster): the steps moved against the
    machine, so they follow something neither measures (gate_power --real at load 7-16: +10 % sleeps beside CPU
    hogs ran 12-19 % faster, [-26, -1 %] the interval nearest no change, than a base recorded while the machine's
    other load was heavier, the probe 3-5x slower for them), and a slower machine's "it can only have slowed the
    head" does not hold: inconclusive, not a pass. Only where the CPU alone bounds the steps (``bound``): steps with
    a GPU in them can follow the GPU (the compiled GPT-2 recorded twice on one H100: the CPU probe 49 % slower after
    the head, the GPU probe unmoved, the steps 3 % faster). Sets that probe's ``explains_verdict``."""
    if bound.get("device") != "cpu":
        return []
    faster = [r for r in results if r.gate.is_step_time and not r.gate.advisory and r.ci
              and r.ci[1] < 0]
    busy = drift["busy"] or {}
    slow = [p for p in (probe, job_probe) if p and p.get("used") and p["moved"] and p["ratio"] > 1]
    if not faster or not (slow or busy.get("busier") == "head"):
        return []
    r = faster[0]
    lo, hi = r.ci or (0.0, 0.0)
    if slow:
        slow[0]["explains_verdict"] = True
        where = "probe during the job" if slow[0]["phase"] == "job" else "probe"
        machine = f"the machine ran {abs(slow[0]['ratio'] - 1) * 100:.0f} % slower on the {where} (head vs base)"
    else:
        machine = (f"the head was recorded on a busy machine (its ranks waited for a CPU {busy['head']:.0%} of the "
                   f"step, the base's {busy['base']:.0%})")
    return [f"{machine}, yet the head's steps ran {-(r.change or 0) * 100:.0f} % faster [{lo * 100:+.0f}, "
            f"{hi * 100:+.0f} %] ({r.gate.expr}): the step times moved against the machine, so the pass is no "
            "evidence"]


def _machine_reasons(probe: dict | None, gpu_probe: dict | None, bound: dict, slower: bool,
                     job_probe: dict | None = None) -> list[str]:
    """Why a machine probe that moved makes the comparison inconclusive. Only the probe of a device that bounds the
    steps counts (``bound``: bounding_device; a CPU that ran slower under GPU-bound steps explains nothing, nor does
    a GPU under host-bound ones): each probe's ``used`` and ``used_why`` say so. A slower machine explains a slower
    head (``slower``: a gate or a straggler row failed; CPU hogs through a job slowed its probe 3x while its steps,
    which wait on communication, moved anywhere from 0 to +27 %), but cannot turn a pass into doubt: it can only
    have slowed the head, so a head that passed on it passed. A faster machine could hide a slowdown behind a pass,
    but cannot explain a slower head: that regression stands. The probe's line shows the change either way. Sets
    each moved probe's ``explains_verdict``."""
    out = []
    for p, what, where in ((probe, "machine", "probe"), (job_probe, "machine", "probe during the job"),
                           (gpu_probe, "GPUs", "GPU probe")):
        if p:
            p["used"] = bound["device"] in ("both", p["kind"])
            p["used_why"] = bound["why"]
        if not p or not p["moved"] or not p["used"]:
            continue
        p["explains_verdict"] = slower if p["ratio"] > 1 else not slower
        if p["explains_verdict"]:
            out.append(f"the {what} ran {abs(p['ratio'] - 1) * 100:.0f} % {'slower' if p['ratio'] > 1 else 'faster'}"
                       f" on the {where} (head vs base)")
    return out


def _no_gpu_probe(base: Sequence[dict], head: Sequence[dict]) -> str:
    """Why there is no GPU probe comparison: the first run without one, and its reason (a CPU-only node, an older
    run)."""
    for side, runs in (("base", base), ("head", head)):
        for s in runs:
            p = lookup(s, "run.probe")
            if not isinstance(p, dict) or not p.get("gpu_start_s"):
                why = p.get("gpu_reason") if isinstance(p, dict) else None
                return f"{side}: {why or 'no GPU probe recorded'}"
    return "no GPU probe recorded"
