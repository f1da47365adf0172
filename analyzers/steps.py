"""Steps and throughput: per rank and step durations, the job's step time, warm-up detection, percentiles.

Definitions (docs/metrics.md, "Steps, step time and warm-up"):
- a rank's step k lasts ``end_ns - start_ns`` of its ``steps`` row;
- the job's step time of step k is the maximum over ranks of that step's duration (a synchronous job waits for
  its slowest rank);
- jitter is the coefficient of variation (std / mean) of the job's measured step times;
- throughput: ``tokens`` and ``samples`` of a ``steps`` row are what that rank consumed in that step
  (``dtprof.annotate``), so the job's tokens per step is the sum over ranks and tokens/s = that sum / job step time.
  (With tensor or pipeline parallelism only the ranks that own the data should annotate.)

Where these live: ``analyzers/runmodel.py`` calls ``rank_steps``, ``job_steps`` and ``warmup_of`` once per run; every
consumer reads the model's ``steps``/``job`` columns. Steps a trace capture disturbed (``traced``) and steps that
ran under FlopCounterMode (``flops_counted``: ``executed_flops`` set; `dtprof run` counts one by default) are slow
for dtprof's sake: they are kept out of the statistics like warm-up steps (``measured`` is False) and listed in
``traced_steps`` / ``flops_counted_steps``.

Warm-up (dtprof convention): by default the leading steps that are slow are excluded -- step 0 always when the run
has at least 4 steps (it carries allocator, autotuning and DDP bucket set-up), plus any further leading steps
whose job step time exceeds 1.2 x the median of the rest; at most half the steps. The run passes through the steps
dtprof slowed (a compiled job's step 2 recompiles after the FLOP-counting step 1). ``warmup=N`` overrides.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from dtprof.rundir.schema import DETAIL_BLOCK

NS = 1e9
WARMUP_SLOW_FACTOR = 1.2


def measured_or_all(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``df`` whose ``measured`` flag is set, or all of them when none is: the steps every per-step
    figure is taken over (a run too short for a measured step is shown whole rather than empty)."""
    m = df["measured"].to_numpy(bool)
    return df[m] if m.any() else df


def detect_warmup(job_time_s: np.ndarray, disturbed: np.ndarray | None = None) -> int:
    """Number of leading warm-up steps in a sequence of job step times (see module docstring). ``disturbed``: steps
    dtprof slowed (FLOP-counted, traced), which the leading run passes through without being ended or extended by
    them: a compiled job's step 2 recompiles after the FLOP-counting step 1 ran eager."""
    n = len(job_time_s)
    if n < 4:
        return 0
    cap = n // 2
    rest_median = float(np.median(job_time_s[1:]))
    slow = job_time_s > WARMUP_SLOW_FACTOR * rest_median
    if disturbed is None:
        disturbed = np.zeros(n, bool)
    # extend through the leading run of slow or disturbed steps after step 0; it ends after its last slow step
    k = end = 1
    while k < cap and (slow[k] or disturbed[k]):
        if slow[k] and not disturbed[k]:
            end = k + 1
        k += 1
    return end


# the steps table's per-step numbers as the run model carries them (float64, NaN where a rank did not report one;
# float64: FLOPs pass int64's range for large models, and bytes, tokens and samples stay exact below 2**53); the
# node summaries' rank_steps carry them too (dtprof/rundir/schema.py), so the global analysis never reads the steps
# table
STEP_NUMBERS = ("peak_mem_bytes", "tokens", "samples", "model_flops", "executed_flops", "cpu_wait_s", "detail")


def rank_steps(s: pd.DataFrame) -> pd.DataFrame:
    """Per rank-step (sorted) of the steps table ``s``: rank, step, start_ns, end_ns, STEP_NUMBERS, duration_s."""
    per = pd.DataFrame({   # the steps table's own arrays, not copies (16.4 M rows at 16,384 x 1,000)
        "rank": s["rank"].to_numpy(np.int64), "step": s["step"].to_numpy(np.int64),
        "start_ns": s["start_ns"].to_numpy(np.int64), "end_ns": s["end_ns"].to_numpy(np.int64),
    }, copy=False)
    for col in ("peak_mem_bytes", "tokens", "samples", "model_flops", "executed_flops"):
        per[col] = s[col].astype("Float64").to_numpy(np.float64, na_value=np.nan)
    per["cpu_wait_s"] = s["cpu_wait_ns"].astype("Float64").to_numpy(np.float64, na_value=np.nan) / NS
    # 0: only the boundary of this step was recorded (sampling); NaN or 1: full detail
    per["detail"] = (s["detail"].astype("Float64").to_numpy(np.float64, na_value=np.nan) if "detail" in s
                     else np.full(len(s), np.nan))
    key = per["rank"].to_numpy() * (1 << 32) + per["step"].to_numpy()
    if len(key) >= 2 and not bool((key[1:] >= key[:-1]).all()):   # the nodes' tables in rank order already: no sort
        per = per.sort_values(["rank", "step"], kind="stable").reset_index(drop=True)
    return with_duration(per)


def with_duration(per: pd.DataFrame) -> pd.DataFrame:
    """``per`` (rank, step, start_ns, end_ns, STEP_NUMBERS: from the steps table or the node summaries'
    rank_steps) with ``duration_s``, in the run model's column order."""
    out = per[["rank", "step", "start_ns", "end_ns"]].copy(deep=False)
    out["duration_s"] = (per["end_ns"] - per["start_ns"]) / NS
    for col in STEP_NUMBERS:
        out[col] = per[col] if col in per else np.nan   # a Series: shared, not copied (a column added later: NaN)
    return out


class ByRank:
    """Per-rank aggregates over some of the rank-steps (``rows``, a mask) of a frame sorted by rank: the values in
    ``rows`` grouped by a categorical key (the rank's code), made once, so pandas groups by its codes without hashing
    every rank-step's rank for each figure, and a column at a time (a mask over the frame copies every column at
    once: 16.4 M rank-steps at 16,384 x 1,000). The groups and the order of their values are a groupby by rank's,
    so the figures are the same (a key with missing codes for the rows left out instead changes their last bits)."""

    def __init__(self, rank: np.ndarray, rows: np.ndarray):
        rank = np.asarray(rank, np.int64)
        n = len(rank)
        starts = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]]) if n else np.zeros(0, np.int64)
        if len(starts) > 1 and (np.diff(rank[starts]) <= 0).any():   # not sorted by rank
            ranks, codes = np.unique(rank, return_inverse=True)
        else:
            ranks, codes = rank[starts], np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, n]))
        self.ranks = ranks
        self.rows = np.asarray(rows, bool)
        self.recorded = np.bincount(codes, minlength=len(ranks))      # rank-steps per rank, all rows
        codes = codes[self.rows]
        self.counts = np.bincount(codes, minlength=len(ranks))        # per rank, in ``rows``
        self.key = pd.Categorical.from_codes(codes, categories=pd.Index(ranks))
        self._grouper = None

    def agg(self, values, how: str) -> pd.Series:
        """``how`` ("mean", "median", "sum", "max") of ``values`` (one per rank-step) per rank with rows. pandas'
        grouping of the key (its groups, their order and each row's group) is made by the first call and reused:
        made anew for each figure it cost ~0.2 s of every ~0.25 s figure at 16.4 M rank-steps."""
        s = pd.Series(np.asarray(values)[self.rows])
        if self._grouper is None:
            gb = s.groupby(self.key, observed=True)
            self._grouper = gb._grouper if hasattr(gb, "_grouper") else gb.grouper   # pandas < 2.2: .grouper
        out = s.groupby(self._grouper).agg(how)
        return out.set_axis(out.index.astype(np.int64))

    def size(self) -> pd.Series:
        """Rank-steps in ``rows`` per rank with rows."""
        has = self.counts > 0
        return pd.Series(self.counts[has], index=pd.Index(self.ranks[has]))


def _small_range(values: np.ndarray) -> bool:
    """Integers whose range is small enough to count over (step numbers, ranks) rather than sort."""
    return bool(len(values)) and int(values.max()) - int(values.min()) <= 4 * len(values) + (1 << 20)


def dense_codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the sorted distinct ``values``, each value's place among them), as np.unique(return_inverse=True) gives them;
    counted over the values' range when it is small (step numbers), not sorted (16.4 M rank-steps)."""
    if not _small_range(values):
        uniq, inv = np.unique(values, return_inverse=True)
        return uniq, inv.ravel()
    lo = int(values.min())
    offset = values - lo   # once: at 16.4 M rank-steps each new array is ~0.1 s of first-touched memory
    present = np.bincount(offset) > 0
    place = np.cumsum(present) - 1
    return np.flatnonzero(present) + lo, place[offset]


def distinct(values: np.ndarray) -> np.ndarray:
    """The sorted distinct ``values`` (``dense_codes``' first part, without each value's place)."""
    if not _small_range(values):
        return np.unique(values)
    lo = int(values.min())
    return np.flatnonzero(np.bincount(values - lo)) + lo


def job_steps(per: pd.DataFrame) -> pd.DataFrame:
    """Per step: the job's step time ``time_s`` (max over ranks: the one place it is derived), ranks, tokens,
    samples, ``traced`` (any rank's step was disturbed by a trace capture; needs ``per["traced"]``),
    ``flops_counted`` (any rank ran it under FlopCounterMode; needs ``per["flops_counted"]``) and ``boundary_only``
    (sampling recorded only its boundary on some rank; needs ``per["boundary_only"]``)."""
    job = per.groupby("step", sort=True).agg(time_s=("duration_s", "max"), ranks=("rank", "size"),
                                              tokens=("tokens", "sum"), samples=("samples", "sum"),
                                              tokens_known=("tokens", "count"), samples_known=("samples", "count"),
                                              traced=("traced", "any"), flops_counted=("flops_counted", "any"),
                                              boundary_only=("boundary_only", "any"))
    return job.reset_index()


# A long run's detail is read for a sample of its detailed steps: at most ANALYSED_RANK_STEPS rank-steps (the node
# summary's and the analysis's cost grows with the detailed rank-steps' spans and collectives: a sampled 1,000,000-step
# run of 8 ranks holds ~2 M of them), never fewer than ANALYSED_MIN_STEPS steps. The sample is every k-th of the
# ranks' detailed blocks by step number (k a power of two), so every node of a run, and the ranks' own sampling
# (blocks at multiples of a power-of-two period), pick nested sets: the run's is that of the largest k any node used.
ANALYSED_RANK_STEPS = 131_072
ANALYSED_MIN_STEPS = 256


def detail_every(detailed_steps: np.ndarray, n_ranks: int) -> int:
    """The smallest power of two k such that the steps among ``detailed_steps`` that ``detail_read`` keeps for k
    number at most the limit above (1: all of them)."""
    limit = max(ANALYSED_MIN_STEPS, ANALYSED_RANK_STEPS // max(n_ranks, 1))
    blocks = np.asarray(detailed_steps, np.int64) // DETAIL_BLOCK
    k = 1
    while np.count_nonzero(blocks % k == 0) > limit:
        k *= 2
    return k


def detail_read(steps: np.ndarray, every: int) -> np.ndarray:
    """Which of ``steps`` the analysis reads the detail of when it reads every ``every``-th block."""
    return (np.asarray(steps, np.int64) // DETAIL_BLOCK) % every == 0


def warmup_of(job: pd.DataFrame, warmup: int | None) -> tuple[int, str]:
    """(leading warm-up steps, "detected" or "user"). Steps dtprof disturbed (traced, FLOP-counted) do not count as
    slow when detecting."""
    if warmup is not None:
        return max(0, min(int(warmup), len(job))), "user"
    t = job["time_s"].to_numpy(dtype=float).copy()
    disturbed = job["traced"].to_numpy(bool) | job["flops_counted"].to_numpy(bool)
    if disturbed.any() and (~disturbed).any():
        t[disturbed] = np.median(t[~disturbed])
    return detect_warmup(t, disturbed), "detected"


# what a sampled run's numbers are made of, said wherever some steps have their times only
USES = "; step times and throughput use every step, the breakdown, overlap, what-if and stragglers the detailed ones"


def sampling(meta: pd.DataFrame, detailed: int, boundary_only: int, skipped: int = 0, every: int = 1,
             means: tuple[float | None, float | None] = (None, None)) -> dict | None:
    """summary.json ``steps.sampling``: what the ranks' step sampling decided (the ``sampling`` meta rows,
    collectors/runtime.py) and what it means for the analysis; None for a run without sampling rows whose every step
    was read in full detail. ``means``:
    the mean time of the timed steps the analysis read in detail and of the boundary-only ones (the detailed steps
    are the breakdown's sample: a user compares the two to see whether it stands for the run)."""
    last = {int(r): v for r, k, v in zip(meta["rank"], meta["kind"].astype(str), meta["value"])
            if k == "sampling" and isinstance(v, dict)}    # a rank's last decision (it may calibrate again)
    read = (f"; the analysis read the detail of {detailed} of the {detailed + skipped} detailed steps (the blocks "
            f"starting at multiples of {DETAIL_BLOCK * every} steps)" if skipped else "")
    compared = (f"; the detailed steps took {means[0] * 1e3:.3g} ms on average, the others {means[1] * 1e3:.3g} ms"
                if means[0] is not None and means[1] is not None else "")
    if not last:     # no sampling rows (an import, a run before 1.5, a job that ended in its calibration)
        if not skipped and not boundary_only:
            return None
        recorded = (f"{detailed + skipped} step(s) in full detail, {boundary_only} with their times only{read}{USES}"
                    if boundary_only else f"every step in full detail{read}")
        return {"statement": recorded + compared, "detailed_step_mean_s": means[0],
                "boundary_step_mean_s": means[1]}
    rows = sorted(last.items())
    periods = sorted({int(v.get("period") or 0) for _, v in rows})
    costs = [v["detail_cost_ns"] / NS for _, v in rows if v.get("detail_cost_ns") is not None]
    block_costs = [v["block_cost_ns"] / NS for _, v in rows if v.get("block_cost_ns") is not None]
    step = [v["step_ns"] / NS for _, v in rows if v.get("step_ns")]
    v0 = rows[0][1]
    cost_s = float(np.median(costs)) if costs else None
    block_s = float(np.median(block_costs)) if block_costs else None
    step_s = float(np.median(step)) if step else None
    out: dict = {"period_steps": periods[-1], "block_steps": v0.get("block"), "from_step": v0.get("from_step"),
           "calibration_steps": v0.get("calibration"), "budget_frac": v0.get("budget"),
           "detail_cost_s": cost_s, "block_cost_s": block_s, "boundary_step_s": step_s,
           "ranks_by_period": {str(p): sorted(r for r, v in rows if int(v.get("period") or 0) == p) for p in periods},
           "detailed_step_mean_s": means[0], "boundary_step_mean_s": means[1]}
    cost = (f"dtprof's cost of a detailed step was measured at {cost_s * 1e6:.0f} µs on {step_s * 1e3:.3g} ms steps"
            + (f", {block_s * 1e6:.0f} µs a block of {v0.get('block')} with its switches" if block_s is not None
               else "")
            if cost_s is not None and step_s is not None else "")
    made_sparser = [(r, v["reason"]) for r, v in rows if str(v.get("reason") or "").startswith("footprint")]
    footprint = [why for _, why in made_sparser]
    out["footprint_ranks"] = sorted(r for r, _ in made_sparser)
    if footprint:    # collectors/runtime.py check_footprint: a long job's files kept under their daily budget
        cost = (f"{cost}; " if cost else "") + (f"made sparser on {len(footprint)} rank(s) to bound their files' "
                                                f"growth ({footprint[0]})")
    if boundary_only == 0:
        out["statement"] = f"every step in full detail ({cost or 'no sampling needed'}{read})"
    else:
        blocks = (f"blocks of {out['block_steps']} steps every {out['period_steps']} from step {out['from_step']}"
                  if out["period_steps"] else "calibration blocks only")
        out["statement"] = (f"{detailed + skipped} step(s) in full detail, {boundary_only} with their times only "
                            f"({blocks}"
                            + (f"; {cost}" + ("" if footprint else f", over {out['budget_frac'] * 100:g}% of the step")
                               if cost and out["period_steps"] else "") + read
                            + ")" + USES + compared)
    return out


def _mean(t: pd.Series) -> float | None:
    return float(t.mean()) if len(t) else None


def step_stats(model) -> dict:
    """summary.json ``steps`` block: percentiles over the job's timed step times (neither warm-up nor disturbed
    by a trace capture nor FLOP-counted; detailed and boundary-only steps alike), throughput, and what sampling
    recorded in detail. ``model``: the run model (analyzers/runmodel.py)."""
    job = model.job
    meas = job[job["timed"]]
    t = meas["time_s"].to_numpy(dtype=float)
    out: dict = {"count": int(len(t)), "total_count": int(len(job)), "warmup_steps": int(model.warmup_steps),
                 "warmup_source": model.warmup_source, "traced_steps": [int(x) for x in job.loc[job["traced"], "step"]],
                 "flops_counted_steps": [int(x) for x in job.loc[job["flops_counted"], "step"]],
                 "detailed_count": int(job["measured"].sum()), "boundary_only_count": int(job["boundary_only"].sum()),
                 "detail_skipped_count": int(job["detail_skipped"].sum()), "detail_read_every": model.detail_every}
    traced = job.loc[job["traced"], "time_s"].to_numpy(float)
    # what a trace capture (--trace-steps, the default kernel sample) cost the job: its steps' extra time over a
    # typical measured step (docs/metrics.md, "Why the GPU is slow")
    out["traced_cost_s"] = float(np.sum(traced - np.median(t))) if len(traced) and len(t) else None
    if len(t):
        p50, p90, p99 = np.percentile(t, [50, 90, 99])
        mean = float(t.mean())
        out["time_s"] = {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": mean,
                         "min": float(t.min()), "max": float(t.max())}
        out["jitter_frac"] = float(t.std() / mean) if mean > 0 else None
    else:
        out["time_s"] = {"p50": None, "p90": None, "p99": None, "mean": None, "min": None, "max": None}
        out["jitter_frac"] = None
        out["time_s_reason"] = ("no measured steps (all steps are warm-up, traced or FLOP-counted, or none were "
                                "recorded)")
    means = (_mean(job.loc[job["measured"], "time_s"]), _mean(meas.loc[meas["boundary_only"], "time_s"]))
    out["sampling"] = sampling(model.run.meta, out["detailed_count"], out["boundary_only_count"],
                               out["detail_skipped_count"], model.detail_every, means)
    out["per_step_time_s"] = [float(x) for x in t]
    out["per_step_index"] = [int(x) for x in meas["step"]]
    total_t = float(t.sum()) if len(t) else 0.0
    for what in ("tokens", "samples"):
        known = (meas[f"{what}_known"] > 0).all() and len(meas) > 0
        if known and total_t > 0:
            out[f"{what}_per_s"] = float(meas[what].sum() / total_t)
        else:
            out[f"{what}_per_s"] = None
            out[f"{what}_per_s_reason"] = (f"no {what} per step: not inferable from the root module's input "
                                           f"and not given with dtprof.annotate({what}=...)")
    return out


def by_rank_step(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` stably sorted by (rank, step); left as is when it already is (nodes read in rank order)."""
    key = df["rank"].to_numpy(np.int64) * (1 << 32) + df["step"].to_numpy(np.int64)
    if len(key) < 2 or bool((key[1:] >= key[:-1]).all()):
        return df.reset_index(drop=True)
    return df.iloc[np.argsort(key, kind="stable")].reset_index(drop=True)
