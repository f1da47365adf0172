"""Pipeline bubble and stage imbalance (docs/metrics.md, "Pipeline bubble and stage imbalance", dtprof).

Input: ``pp_forward``/``pp_backward`` spans (``stage``, ``microbatch``), and the ``meta`` row of kind
``pipeline_schedule`` (schedule class name, stages, microbatches); without it the schedule is "unknown" (and the
GPipe/1F1B formula is used, saying so in ``schedule_reason``).

Measured (per stage s and step k, on the rank that runs s): bubble = 1 - |union of s's compute spans in k| ÷ the
rank's step k duration. A stage's compute spans are its pp spans plus, when its rank runs only that stage, the
rank's other compute spans (the optimizer step). Pipeline-wide: 1 - Σ compute ÷ Σ duration over the measured
rank-steps of the pipeline ranks (time-weighted; a rank's compute counts all its stages, so interleaved ranks are
not counted once per stage).

The measured bubble splits into two parts that add up exactly, both shares of the same measured step time:
- theoretical (``theoretical_bubble_frac``): the idle time the schedule itself needs with these op times. The
  schedule is replayed with its own measured op durations and nothing between ops (``replay_schedule``): each rank
  runs its compute ops of a step in the observed order; a forward of (stage s, microbatch j) waits for the forward
  of (s-1, j) and the backward of (s, j) for the backward of (s+1, j), in the same pipeline replica. The replayed
  makespan T_k of step k is the shortest step that schedule allows with these op times; theoretical = Σ (T_k −
  compute) ÷ Σ measured step. Unlike a closed formula on median op times it also holds when some microbatches run
  slower (a slow op delays everything downstream of it);
- overhead (``overhead_frac``): Σ (measured step − T_k) ÷ Σ measured step, the idle time the schedule does not
  explain (p2p transfers, Python and launch gaps between ops, waits outside the schedule).
So bubble = theoretical + overhead, over the same measured rank-steps (pipeline-wide and per stage). "Theoretical"
means this and only this everywhere (summary.json, the terminal line, the report's card and per-stage bars).

``schedule_bubble_frac`` is a reference, not a part of the bubble: the schedule's textbook closed form, as a share of
the gap-free step (not of the measured one), on median per-stage times (dtprof's generalisation of (p-1)/(m+p-1) to
non-uniform stages, t_s the median forward + backward time of one microbatch on stage s):
1 - Σ_s m·t_s ÷ (p · (Σ_s t_s + (m-1)·max_s t_s)) for GPipe and 1F1B. Interleaved schedules (v stages per rank) use
docs/metrics.md's (p-1)/(v·m) relative to ideal compute, i.e. (p-1)/(v·m + p - 1) as a share of the step, with p the
number of pipeline ranks; zero-bubble schedules use ZB-H1's (p-1)/(3m) likewise.

Pipeline replicas (DP×PP): the ranks that run a stage are paired with the other stages' ranks in rank order (the
i-th rank holding stage s belongs to pipeline i), which is how row-major DeviceMesh layouts place them.

Stage imbalance = max over stages of compute per step ÷ mean over stages; the bottleneck stage is the argmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from dtprof.analyzers import whatif
from dtprof.analyzers.intervals import assign_to_windows, union_length
from dtprof.analyzers.steps import measured_or_all
from dtprof.rundir.schema import COMPUTE_KINDS

NS = 1e9
PP_KINDS = ("pp_forward", "pp_backward")


@dataclass
class PipelineResult:
    table: pd.DataFrame     # stage, rank, step, bubble_frac, compute_s, theoretical_bubble_frac, duration_s, warmup
    summary: dict
    ops: pd.DataFrame       # per compute op of a pipeline rank: rank, step, replica, stage, microbatch, kind,
                            # start_ns, end_ns (measured), warmup, ideal_start_s, ideal_end_s (replayed, from the
                            # step's start)


def schedule_info(meta: pd.DataFrame) -> tuple[str, int | None, int | None]:
    """(schedule name, stages, microbatches) from the first ``pipeline_schedule`` meta row."""
    rows = meta.loc[meta["kind"].astype(str) == "pipeline_schedule", "value"]
    for v in rows:
        if isinstance(v, dict) and v.get("schedule"):
            return str(v["schedule"]), v.get("stages"), v.get("microbatches")
    return "unknown", None, None


def _pair_groups(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int, pd.MultiIndex]:
    """Dense group codes of the pairs (a, b), their count, and the distinct pairs in code order."""
    u, codes = np.unique(np.stack([a, b]), axis=1, return_inverse=True)
    return codes.ravel(), u.shape[1], pd.MultiIndex.from_arrays([u[0], u[1]])


def pipeline_replicas(pp_rank: np.ndarray, pp_stage: np.ndarray) -> pd.Series:
    """rank -> pipeline replica: the i-th rank (in rank order) holding a rank's lowest stage is in replica i."""
    low = pd.DataFrame({"rank": pp_rank, "stage": pp_stage}).groupby("rank")["stage"].min()
    return low.groupby(low).cumcount().rename("replica")


def replay_schedule(rank, step, stage, mb, kind, name, dur_ns, replica) -> np.ndarray | None:
    """Each op's finish (ns from the step's start) if the schedule ran with its
    measured op durations and nothing between ops (no p2p transfer, no launch or Python gap); None when the observed
    order contradicts the dependencies (a cycle).

    Each rank runs its ops of a step one after another in the order given (arrays sorted by rank, step, start). The
    k-th forward of (stage s, microbatch j) in a step also waits for the k-th forward of (s-1, j), and the k-th
    input backward of (s, j) for the k-th input backward of (s+1, j), in the same replica (k > 0 when a step runs
    the schedule more than once, as with gradient accumulation). A split-off weight backward
    (``backward_weight``) waits only for its own rank's earlier ops. Every rank starts the step at 0. Replayed by
    the what-if engine (``whatif.relax``), the one replay of dtprof.
    """
    n = len(rank)
    if n == 0:
        return np.zeros(0, np.int64)
    idx = np.arange(n)
    same = np.zeros(n, bool)
    same[1:] = (rank[1:] == rank[:-1]) & (step[1:] == step[:-1])
    role = np.where(kind == "pp_forward", "F", np.where((kind == "pp_backward") & (name != "backward_weight"),
                                                         "B", ""))
    ops = pd.DataFrame({"role": role, "replica": replica, "step": step, "stage": stage, "mb": mb, "i": idx})
    ops = ops[(ops["role"] != "") & (ops["stage"] >= 0) & (ops["mb"] >= 0)].copy()
    keys = ["role", "replica", "step", "stage", "mb"]
    ops["k"] = ops.groupby(keys, sort=False).cumcount()   # ops are in time order within each key (one rank)
    by_key = ops.set_index(keys + ["k"])["i"]
    upstream = ops["stage"] + np.where(ops["role"] == "F", -1, 1)
    hit = by_key.reindex(pd.MultiIndex.from_arrays([ops["role"], ops["replica"], ops["step"], upstream, ops["mb"],
                                                    ops["k"]])).to_numpy(dtype=float)
    dep_pred = np.full(n, -1, np.int64)
    ok = ~np.isnan(hit)
    dep_pred[ops["i"].to_numpy()[ok]] = hit[ok].astype(np.int64)
    # the engine's model (analyzers/whatif.py ``relax``): one window per (rank, step) starting at 0; each op is
    # [a wait for its upstream op's finish] its work [an arrival: its own finish, key = the op's index]
    win = np.cumsum(~same) - 1
    has_dep = dep_pred >= 0
    sub = np.tile(np.arange(3), n)                  # 0 wait, 1 work, 2 arrive, per op
    op = np.repeat(idx, 3)
    keep = (sub != 0) | has_dep[op]
    op, sub = op[keep], sub[keep]
    item_kind = np.choose(sub, [whatif.WAIT, whatif.WORKI, whatif.ARRIVE])
    key = np.choose(sub, [dep_pred[op], np.full(len(op), -1), op])
    dur = np.where(sub == 1, dur_ns.astype(np.int64)[op], 0)
    out = whatif.relax(win[op], item_kind, dur, key, np.zeros(len(op), np.int64), np.zeros(int(win[-1]) + 1, np.int64),
                       n)
    if out is None:
        return None
    return out[0][sub == 2]


def _microbatch_times(pp: pd.DataFrame, wmeas: np.ndarray) -> tuple[pd.Series, pd.Series, pd.Series]:
    """Per stage, for the closed form: the median forward and backward time of one microbatch (s) and the median
    number of microbatches a step, over the measured steps (all steps if none is measured)."""
    ppm = pp[(pp["win"] >= 0)].copy()
    ppm["meas"] = wmeas[ppm["win"].to_numpy()]
    if ppm["meas"].any():
        ppm = ppm[ppm["meas"]]
    per_mb = ppm.groupby(["stage", "win", "mb", "kind"], sort=False)["dur_ns"].sum().unstack("kind", fill_value=0)
    for k in PP_KINDS:
        if k not in per_mb:
            per_mb[k] = 0
    per_mb = per_mb.reset_index()
    f_s = per_mb.groupby("stage")["pp_forward"].median() / NS
    b_s = per_mb.groupby("stage")["pp_backward"].median() / NS
    mb_count = ppm.groupby(["stage", "win"])["mb"].nunique().groupby("stage").median()
    return f_s, b_s, mb_count


def _schedule_bubble(schedule: str, p: int, m: int, v: int, ranks_per_pipeline: int,
                     t_s: pd.Series) -> tuple[float | None, str, str]:
    """(the schedule's closed-form bubble, its formula, why a schedule was assumed or ""): p stages, m microbatches,
    v virtual stages per rank, ``t_s`` each stage's forward + backward time of one microbatch."""
    sched_l = schedule.lower()
    if "interleaved" in sched_l or "looped" in sched_l or v > 1:
        pr = ranks_per_pipeline
        return ((pr - 1) / (v * m + pr - 1) if m else None), "(p-1)/(v·m+p-1), uniform stages", ""
    if "zerobubble" in sched_l or "zbv" in sched_l or "dualpipe" in sched_l:
        r = (p - 1) / (3 * m) if m else None
        return (r / (1 + r) if r is not None else None), \
            "ZB-H1 (p-1)/(3m) relative to ideal compute, uniform stages", ""
    reason = "no schedule name recorded; GPipe/1F1B assumed" if schedule == "unknown" else ""
    t_pipe = float(t_s.sum() + (m - 1) * t_s.max()) if m else 0.0
    sched_bubble = float(1.0 - (m * t_s).sum() / (len(t_s) * t_pipe)) if t_pipe > 0 else None
    return sched_bubble, "1 - Σ m·t_s / (p·(Σ t_s + (m-1)·max t_s)), median per-stage microbatch times", reason


def _per_stage(per_stage: pd.DataFrame, replay_ok: bool, f_s: pd.Series, b_s: pd.Series) -> list[dict]:
    """summary ``pipeline.per_stage``: one row per stage."""
    return [{"stage": int(s), "rank": int(r["rank"]),
             "bubble_frac": float(1 - r["compute"] / r["duration"]) if r["duration"] > 0 else None,
             "theoretical_bubble_frac": (float((r["ideal"] - r["compute"]) / r["duration"])
                                         if replay_ok and r["duration"] > 0 else None),
             "overhead_frac": (float((r["duration"] - r["ideal"]) / r["duration"])
                               if replay_ok and r["duration"] > 0 else None),
             "compute_s_per_step": float(r["compute"] / max(r["rank_steps"], 1)),
             "forward_s_per_microbatch": float(f_s.get(s, np.nan)),
             "backward_s_per_microbatch": float(b_s.get(s, np.nan))}
            for s, r in per_stage.iterrows()]


def _ops_frame(rank, step, replica, stage, mb, kind, start, end, warmup) -> pd.DataFrame:
    """Per compute op of a pipeline rank (PipelineResult.ops), in replay order; -1 stage or microbatch: none."""
    return pd.DataFrame({"rank": rank, "step": step, "replica": replica,
                         "stage": pd.array(np.where(stage >= 0, stage, None), dtype="Int64"),
                         "microbatch": pd.array(np.where(mb >= 0, mb, None), dtype="Int64"),
                         "kind": kind, "start_ns": start, "end_ns": end, "warmup": warmup})


def _bubble_parts(rank_busy: pd.DataFrame, replay_ok: bool) -> tuple[float | None, float | None, float | None]:
    """(bubble, theoretical, overhead) of the pipeline ranks' measured rank-steps (all if none is measured):
    bubble = theoretical + overhead, both over the same rank-steps and the same denominator (module docstring)."""
    rmeas = measured_or_all(rank_busy)
    dur = float(rmeas["duration_s"].sum())
    busy = float(rmeas["compute_s"].sum())
    bubble = float(1.0 - busy / dur) if dur > 0 else None
    ideal_total = float(rmeas["ideal_step_s"].sum()) if replay_ok else None
    theo = (ideal_total - busy) / dur if ideal_total is not None and dur > 0 else None
    overhead = (dur - ideal_total) / dur if ideal_total is not None and dur > 0 else None
    return bubble, theo, overhead


def _add_ideal(tbl: pd.DataFrame, rank_busy: pd.DataFrame, ops: pd.DataFrame, replayed: np.ndarray | None,
               o_dur: np.ndarray, replica_of: pd.Series) -> str | None:
    """The replay's ideal step per (stage, rank-step) and per rank-step, and each op's ideal start and end, added to
    ``tbl``, ``rank_busy`` and ``ops``; returns why there is no replay, or None."""
    o_replica, o_step = ops["replica"].to_numpy(np.int64), ops["step"].to_numpy(np.int64)
    reason = None
    if replayed is None:
        reason = "the recorded op order contradicts the pipeline's dependencies; no replay"
        ideal = pd.Series(np.nan, index=pd.MultiIndex.from_arrays([o_replica[:0], o_step[:0]]), dtype=float)
        ops["ideal_start_s"] = ops["ideal_end_s"] = np.nan
    else:
        finish = replayed
        ideal = pd.Series(finish / NS).groupby([o_replica, o_step]).max()   # makespan per (replica, step)
        ops["ideal_end_s"] = finish / NS
        ops["ideal_start_s"] = (finish - o_dur) / NS

    def ideal_of(ranks, steps):
        key = pd.MultiIndex.from_arrays([replica_of.reindex(ranks).to_numpy(np.int64), np.asarray(steps)])
        return ideal.reindex(key).to_numpy(dtype=float)
    # a rank-step whose replica ran no op needs no time by the schedule: its compute (none) is all it needs
    tbl["ideal_step_s"] = ideal_of(tbl["rank"], tbl["step"])
    rank_busy["ideal_step_s"] = ideal_of(rank_busy["rank"], rank_busy["step"])
    if replayed is not None:
        tbl["ideal_step_s"] = tbl["ideal_step_s"].fillna(tbl["compute_s"])
        rank_busy["ideal_step_s"] = rank_busy["ideal_step_s"].fillna(rank_busy["compute_s"])
    tbl["theoretical_bubble_frac"] = (tbl["ideal_step_s"] - tbl["compute_s"]) / tbl["duration_s"].where(
        tbl["duration_s"] > 0)
    return reason


def analyze_pipeline(run, windows: pd.DataFrame) -> PipelineResult | None:
    """``run``: the run model; ``windows``: per rank-step rank, step, start_ns, end_ns, duration_s, warmup,
    measured (the model's steps). None when no pp spans."""
    sp = run.spans
    is_pp = sp["kind"].isin(list(PP_KINDS)).to_numpy() & sp["stage"].notna().to_numpy()
    if not is_pp.any():
        return None
    wr = windows["rank"].to_numpy(np.int64)
    ws = windows["start_ns"].to_numpy(np.int64)
    we = windows["end_ns"].to_numpy(np.int64)
    wstep = windows["step"].to_numpy(np.int64)
    wwarm = windows["warmup"].to_numpy(bool)
    wmeas = windows["measured"].to_numpy(bool)   # neither warm-up nor disturbed by a trace capture
    rank = sp["rank"].to_numpy(np.int64)
    start = sp["start_ns"].to_numpy(np.int64)
    end = sp["end_ns"].to_numpy(np.int64)
    kind = sp["kind"].astype(str).to_numpy()
    name = sp["name"].astype(str).to_numpy()
    win = assign_to_windows(wr, ws, we, rank, start)
    stage = sp["stage"].astype("Int64").fillna(-1).to_numpy(np.int64)
    micro = sp["microbatch"].astype("Int64").fillna(-1).to_numpy(np.int64)

    pp = pd.DataFrame({"rank": rank[is_pp], "stage": stage[is_pp], "win": win[is_pp], "mb": micro[is_pp],
                       "kind": kind[is_pp], "dur_ns": (end - start)[is_pp]})
    stages_of_rank = pp.groupby("rank")["stage"].nunique()
    single = stages_of_rank[stages_of_rank == 1]
    stage_of_single = pp.drop_duplicates("rank").set_index("rank")["stage"].reindex(single.index)
    pp_ranks = stages_of_rank.index.to_numpy()

    # every compute span of a pipeline rank inside a step window, clipped to it
    comp = np.isin(kind, list(COMPUTE_KINDS)) & np.isin(rank, pp_ranks) & (win >= 0)
    c_win, c_rank = win[comp], rank[comp]
    c_start = np.maximum(start[comp], ws[c_win])
    c_end = np.minimum(end[comp], we[c_win])
    # a non-pp span belongs to its rank's stage when the rank runs only one
    c_stage = np.where(stage[comp] >= 0, stage[comp],
                       stage_of_single.reindex(c_rank).fillna(-1).to_numpy(np.int64))
    c_pp = is_pp[comp]
    if not (c_pp & (c_stage >= 0)).any():
        return None   # pipeline spans, but none inside a step window

    # measured, per (stage, window) of every window of a pipeline rank (a window without ops is all bubble): the
    # union of that stage's compute spans
    in_stage = c_stage >= 0
    codes, n_codes, pairs_of_code = _pair_groups(c_stage[in_stage], c_win[in_stage])
    busy = pd.Series(union_length(codes, c_start[in_stage], c_end[in_stage], n_codes), index=pairs_of_code)
    pairs = pp[["rank", "stage"]].drop_duplicates()
    grid = pd.DataFrame({"rank": wr, "win": np.arange(len(windows))}).merge(pairs, on="rank")
    tbl = pd.DataFrame({"stage": grid["stage"].to_numpy(), "rank": grid["rank"].to_numpy(),
                        "step": wstep[grid["win"]], "duration_s": windows["duration_s"].to_numpy()[grid["win"]],
                        "warmup": wwarm[grid["win"]], "measured": wmeas[grid["win"]], "win": grid["win"].to_numpy()})
    tbl["compute_s"] = busy.reindex(pd.MultiIndex.from_arrays([tbl["stage"], tbl["win"]])).fillna(0).to_numpy() / NS
    tbl["bubble_frac"] = 1.0 - tbl["compute_s"] / tbl["duration_s"].where(tbl["duration_s"] > 0)
    # ... and per (rank, window): all the rank's compute, for the pipeline-wide figure
    pp_wins = np.flatnonzero(np.isin(wr, pp_ranks))
    rank_busy = pd.DataFrame({"rank": wr[pp_wins], "step": wstep[pp_wins], "win": pp_wins,
                              "duration_s": windows["duration_s"].to_numpy()[pp_wins], "warmup": wwarm[pp_wins],
                              "measured": wmeas[pp_wins]})
    rw, rw_codes = np.unique(c_win, return_inverse=True)
    rank_busy["compute_s"] = pd.Series(union_length(rw_codes, c_start, c_end, len(rw)) / NS,
                                       index=rw).reindex(pp_wins).fillna(0).to_numpy()

    # the schedule replayed on its measured op times
    order = np.lexsort((c_start, c_win))
    o_win = c_win[order]
    replica_of = pipeline_replicas(pp["rank"].to_numpy(), pp["stage"].to_numpy())
    o_dur = (c_end - c_start)[order]
    o_replica = replica_of.reindex(wr[o_win]).to_numpy(np.int64)
    replayed = replay_schedule(wr[o_win], wstep[o_win], np.where(c_pp[order], c_stage[order], -1),
                               micro[comp][order], kind[comp][order], name[comp][order], o_dur, o_replica)
    ops = _ops_frame(wr[o_win], wstep[o_win], o_replica, c_stage[order], micro[comp][order], kind[comp][order],
                     c_start[order], c_end[order], wwarm[o_win])
    replay_reason = _add_ideal(tbl, rank_busy, ops, replayed, o_dur, replica_of)

    f_s, b_s, mb_count = _microbatch_times(pp, wmeas)

    schedule, ev_stages, ev_mb = schedule_info(run.meta)
    stages = sorted(tbl["stage"].unique().tolist())
    p = ev_stages or len(stages)
    m = ev_mb or int(round(float(mb_count.median()))) if len(mb_count) else ev_mb or 0
    t_s = (f_s + b_s).reindex(stages).fillna(0.0)
    replicas = int(replica_of.max()) + 1
    ranks_per_pipeline = max(1, len(pp_ranks) // replicas)
    v = int(stages_of_rank.max())
    sched_bubble, formula, reason = _schedule_bubble(schedule, p, m, v, ranks_per_pipeline, t_s)

    replay_ok = replayed is not None
    bubble, theo, overhead = _bubble_parts(rank_busy, replay_ok)
    meas = measured_or_all(tbl)
    stage_comp = meas.groupby("stage")["compute_s"].mean()
    imbalance = float(stage_comp.max() / stage_comp.mean()) if len(stage_comp) and stage_comp.mean() > 0 else None
    bottleneck = int(stage_comp.idxmax()) if len(stage_comp) else None
    per_stage = meas.groupby("stage").agg(rank=("rank", "min"), compute=("compute_s", "sum"),
                                           duration=("duration_s", "sum"), ideal=("ideal_step_s", "sum"),
                                           rank_steps=("step", "size"))
    summary = {
        "stages": int(p), "microbatches": int(m), "schedule": schedule,
        "bubble_frac": bubble, "theoretical_bubble_frac": theo,
        "overhead_frac": overhead,
        "schedule_bubble_frac": sched_bubble, "schedule_formula": formula,
        "theoretical_method": "schedule replayed on its measured op times with no gap between ops; theoretical = "
                              "Σ (replayed step − compute) ÷ Σ measured step, overhead = Σ (measured − replayed "
                              "step) ÷ Σ measured step, bubble = theoretical + overhead",
        "imbalance": imbalance, "bottleneck_stage": bottleneck, "virtual_stages_per_rank": v,
        "replicas": replicas,
        "per_stage": _per_stage(per_stage, replay_ok, f_s, b_s),
    }
    if reason:
        summary["schedule_reason"] = reason
    if replay_reason:
        summary["theoretical_reason"] = replay_reason
    tbl = tbl.drop(columns="win").sort_values(["stage", "rank", "step"]).reset_index(drop=True)
    return PipelineResult(tbl, summary, ops)
