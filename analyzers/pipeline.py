"""Pipeline bubble and stage imbalance (metrics.md, "Pipeline bubble and stage imbalance", dtprof).

Input: ``pp_forward``/``pp_backward`` spans (``stage``, ``microbatch``), and the rank side's events row
``pipeline schedule: <ClassName>, stages=<p>, microbatches=<m>, stage_indices=<i,j>`` for the schedule name; without
it the schedule is "unknown" (and the GPipe/1F1B formula is used, saying so in ``schedule_reason``).

Measured (per stage s and step k, on the rank that runs s): bubble = 1 - |union of s's compute spans in k| ÷ the
rank's step k duration. A stage's compute spans are its pp spans plus, when its rank runs only that stage, the
rank's other compute spans (the optimizer step). Pipeline-wide: 1 - Σ compute ÷ Σ duration over the measured
stage-steps (time-weighted).

Theoretical, from measured times (dtprof's generalisation of (p-1)/(m+p-1) to non-uniform stages): with t_s the
median forward + backward time of one microbatch on stage s (summed over its pp spans for that microbatch), o_s the
median other compute per step of s's rank (optimizer) and m microbatches, a GPipe or 1F1B step lasts at least

    T = Σ_s t_s + (m - 1) · max_s t_s + max_s o_s

(the first microbatch crosses every stage, the other m-1 follow at the pace of the slowest stage, then the
optimizers run), and stage s is busy m·t_s + o_s of it: theoretical bubble_s = 1 - (m·t_s + o_s) / T, and the
pipeline's is 1 - Σ_s (m·t_s + o_s) / (p·T). For uniform stages and no optimizer time this is (p-1)/(m+p-1).
Interleaved schedules (v stages per rank) use metrics.md's (p-1)/(v·m) relative to ideal compute, i.e.
(p-1)/(v·m + p - 1) as a share of the step, with p the number of pipeline ranks; zero-bubble schedules use ZB-H1's
(p-1)/(3m) likewise. ``schedule_bubble_frac`` is the schedule's share without optimizer time.

Stage imbalance = max over stages of compute per step ÷ mean over stages; the bottleneck stage is the argmax.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dtprof.analyzers.intervals import assign_to_windows, measure
from dtprof.schema import COMPUTE_KINDS

NS = 1e9
SCHEDULE_RE = re.compile(r"pipeline schedule:\s*(\w+)(?:.*?stages=(\d+))?(?:.*?microbatches=(\d+))?")
PP_KINDS = ("pp_forward", "pp_backward")


@dataclass
class PipelineResult:
    table: pd.DataFrame     # stage, rank, step, bubble_frac, compute_s, theoretical_bubble_frac, duration_s, warmup
    summary: dict


def schedule_info(run) -> tuple[str, int | None, int | None]:
    ev = run.events
    if len(ev):
        msgs = ev["message"].astype(str)
        hits = msgs[msgs.str.contains("pipeline schedule:", regex=False)]
        for msg in hits.unique()[:1]:
            m = SCHEDULE_RE.search(msg)
            if m:
                return m.group(1), (int(m.group(2)) if m.group(2) else None), (int(m.group(3)) if m.group(3) else None)
    return "unknown", None, None


def analyze_pipeline(run, windows: pd.DataFrame) -> PipelineResult | None:
    """``windows``: per rank-step rank, step, start_ns, end_ns, duration_s, warmup. None when no pp spans."""
    sp = run.spans
    is_pp = sp["kind"].isin(list(PP_KINDS)).to_numpy() & sp["stage"].notna().to_numpy()
    if not is_pp.any():
        return None
    wr = windows["rank"].to_numpy(np.int64)
    ws = windows["start_ns"].to_numpy(np.int64)
    we = windows["end_ns"].to_numpy(np.int64)
    rank = sp["rank"].to_numpy(np.int64)
    start = sp["start_ns"].to_numpy(np.int64)
    end = sp["end_ns"].to_numpy(np.int64)
    win = assign_to_windows(wr, ws, we, rank, start)
    stage = sp["stage"].astype("Int64").fillna(-1).to_numpy(np.int64)

    pp = pd.DataFrame({"rank": rank[is_pp], "stage": stage[is_pp], "win": win[is_pp],
                       "mb": sp["microbatch"].astype("Int64").fillna(-1).to_numpy(np.int64)[is_pp],
                       "kind": sp["kind"].astype(str).to_numpy()[is_pp],
                       "dur_ns": (end - start)[is_pp]})
    stages_of_rank = pp.groupby("rank")["stage"].nunique()
    single = stages_of_rank[stages_of_rank == 1]
    stage_of_single = pp.drop_duplicates("rank").set_index("rank")["stage"].reindex(single.index)

    # groups = (stage, window); the rank's non-pp compute joins its only stage's group
    other = np.isin(sp["kind"].astype(str).to_numpy(), [k for k in COMPUTE_KINDS if k not in PP_KINDS])
    other &= np.isin(rank, single.index.to_numpy()) & (win >= 0)
    st_other = stage_of_single.reindex(rank[other]).to_numpy(np.int64)
    g_stage = np.concatenate([stage[is_pp], st_other])
    g_win = np.concatenate([win[is_pp], win[other]])
    g_start = np.concatenate([start[is_pp], start[other]])
    g_end = np.concatenate([end[is_pp], end[other]])
    ok = g_win >= 0
    g_stage, g_win, g_start, g_end = g_stage[ok], g_win[ok], g_start[ok], g_end[ok]
    uniq, codes = np.unique((g_stage - g_stage.min()) * len(windows) + g_win, return_inverse=True)
    g_start = np.maximum(g_start, ws[g_win])
    g_end = np.minimum(g_end, we[g_win])
    busy = measure(codes, np.zeros(len(codes), np.int8), g_start, g_end, len(uniq), 1, {"u": lambda c: c[0]})["u"]
    uw = uniq % len(windows)
    ustage = uniq // len(windows) + g_stage.min()
    tbl = pd.DataFrame({"stage": ustage, "rank": wr[uw],
                        "step": windows["step"].to_numpy()[uw], "compute_s": busy / NS,
                        "duration_s": windows["duration_s"].to_numpy()[uw],
                        "warmup": windows["warmup"].to_numpy()[uw]})
    tbl["bubble_frac"] = 1.0 - tbl["compute_s"] / tbl["duration_s"].where(tbl["duration_s"] > 0)
    tbl = tbl.sort_values(["stage", "rank", "step"]).reset_index(drop=True)

    # measured per-microbatch forward/backward times per stage
    ppm = pp[(pp["win"] >= 0)].copy()
    ppm["warm"] = windows["warmup"].to_numpy()[ppm["win"].to_numpy()]
    if (~ppm["warm"]).any():
        ppm = ppm[~ppm["warm"]]
    per_mb = ppm.groupby(["stage", "win", "mb", "kind"], sort=False)["dur_ns"].sum().unstack("kind", fill_value=0)
    for k in PP_KINDS:
        if k not in per_mb:
            per_mb[k] = 0
    per_mb = per_mb.reset_index()
    f_s = per_mb.groupby("stage")["pp_forward"].median() / NS
    b_s = per_mb.groupby("stage")["pp_backward"].median() / NS
    mb_count = ppm.groupby(["stage", "win"])["mb"].nunique().groupby("stage").median()

    schedule, ev_stages, ev_mb = schedule_info(run)
    stages = sorted(tbl["stage"].unique().tolist())
    p = ev_stages or len(stages)
    m = ev_mb or int(round(float(mb_count.median()))) if len(mb_count) else ev_mb or 0
    meas = tbl[~tbl["warmup"]] if (~tbl["warmup"]).any() else tbl
    # other compute (optimizer) per stage per step: stage busy minus its pp compute
    pp_busy = (per_mb.groupby(["stage", "win"])[list(PP_KINDS)].sum().sum(axis=1) / NS).groupby("stage").median()
    stage_busy = meas.groupby("stage")["compute_s"].median()
    t_s = (f_s + b_s).reindex(stages).fillna(0.0)
    o_s = (stage_busy.reindex(stages) - pp_busy.reindex(stages)).clip(lower=0).fillna(0.0)
    n_pp_ranks = int(tbl["rank"].nunique())
    v = max(1, int(round(len(stages) / max(n_pp_ranks, 1))))
    sched_l = schedule.lower()
    reason = ""
    if "interleaved" in sched_l or "looped" in sched_l or v > 1:
        pr = n_pp_ranks
        sched_bubble = (pr - 1) / (v * m + pr - 1) if m else None
        theo_stage = pd.Series(sched_bubble, index=stages)
        theo = sched_bubble
        formula = "(p-1)/(v·m+p-1), uniform stages"
    elif "zerobubble" in sched_l or "zbv" in sched_l or "dualpipe" in sched_l:
        r = (p - 1) / (3 * m) if m else None
        sched_bubble = r / (1 + r) if r is not None else None
        theo_stage = pd.Series(sched_bubble, index=stages)
        theo = sched_bubble
        formula = "ZB-H1 (p-1)/(3m) relative to ideal compute, uniform stages"
    else:
        if schedule == "unknown":
            reason = "no schedule name recorded; GPipe/1F1B formula assumed"
        t_pipe = float(t_s.sum() + (m - 1) * t_s.max()) if m else 0.0
        T = t_pipe + float(o_s.max())
        busy_s = m * t_s + o_s
        theo_stage = 1.0 - busy_s / T if T > 0 else pd.Series(np.nan, index=stages)
        theo = float(1.0 - busy_s.sum() / (len(stages) * T)) if T > 0 else None
        sched_bubble = float(1.0 - (m * t_s).sum() / (len(stages) * t_pipe)) if t_pipe > 0 else None
        formula = "1 - (m·t_s + o_s) / (Σt + (m-1)·max t + max o), measured per-stage times"
    tbl["theoretical_bubble_frac"] = tbl["stage"].map(theo_stage).astype(float)

    comp = meas.groupby("stage")["compute_s"].mean()
    imbalance = float(comp.max() / comp.mean()) if len(comp) and comp.mean() > 0 else None
    bottleneck = int(comp.idxmax()) if len(comp) else None
    dur = float(meas["duration_s"].sum())
    per_stage = meas.groupby("stage").agg(rank=("rank", "min"), compute=("compute_s", "sum"),
                                           duration=("duration_s", "sum"), steps=("step", "nunique"))
    summary = {
        "stages": int(p), "microbatches": int(m), "schedule": schedule,
        "bubble_frac": float(1.0 - meas["compute_s"].sum() / dur) if dur > 0 else None,
        "theoretical_bubble_frac": theo, "schedule_bubble_frac": sched_bubble,
        "theoretical_formula": formula,
        "imbalance": imbalance, "bottleneck_stage": bottleneck, "virtual_stages_per_rank": v,
        "per_stage": [{"stage": int(s), "rank": int(r["rank"]),
                       "bubble_frac": float(1 - r["compute"] / r["duration"]) if r["duration"] > 0 else None,
                       "theoretical_bubble_frac": (float(theo_stage[s]) if pd.notna(theo_stage.get(s)) else None),
                       "compute_s_per_step": float(r["compute"] / max(r["steps"], 1)),
                       "forward_s_per_microbatch": float(f_s.get(s, np.nan)),
                       "backward_s_per_microbatch": float(b_s.get(s, np.nan))}
                      for s, r in per_stage.iterrows()],  # one per stage
    }
    if reason:
        summary["schedule_reason"] = reason
    return PipelineResult(tbl, summary)
