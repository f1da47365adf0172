"""Stragglers (docs/metrics.md, "Stragglers").

Arrival skew: a collective instance is ``(group, seq)``; its ranks' arrivals are their ``issue_ns`` moved onto the
reference host's clock (clock.py). Lateness = arrival - first arrival of the instance. The last rank to arrive is
the instance's straggler and its peers' arrival wait (``time_lost_s``) is Σ over the other ranks of
(last arrival - their arrival). Point-to-point ops are left out. Behind an asynchronous collective (a DDP bucket)
a peer keeps computing for part of that wait, so it is more than the job lost; the job's loss is the what-if's
``straggler_removed`` saving.

Compute score (NVIDIA resiliency-ext, "relative" reference): score = median compute time per step of the fastest
rank / this rank's median (1.0 = as fast as the fastest). Compute excludes comm_wait (overlap.py), so a rank that
waits for a slow peer does not look slow itself.

Classification by impact (dtprof convention, docs/what-if.md; DDP equalises step time, so step time alone is never
used). The criteria are stated once, in ``PERSISTENT_RULE`` and ``TRANSIENT_RULE``; the summary, the report, triage
and the docs quote them, and each flagged rank's ``reason`` gives the numbers the criterion counted:
- **persistent**: the what-if model's ``straggler_removed`` scenario (analyzers/whatif.py: the rank's work set to
  its peers' median, part by part) saves at least ``AnalysisOptions.straggler_min_saving`` (5 %) of the job's step
  over the measured steps, and at least that much in >= 75 % of them (and more than chance explains: a
  one-sided sign test at 5 %), or its median step saves at least 3x the
  threshold (a saving that holds, not a few slow steps: one long preemption raises the mean, not the median), and
  its typical extra work (what-if ``typical_excess``: per part, the median over steps of its part minus its peers',
  summed), less its typical extra wait for a CPU (what-if ``typical_cpu_wait``: the training thread runnable but
  not running, from Linux's per-thread run delay), is at least that share of the median step and at least half the
  median step's saving: a slow rank's excess recurs in the same part and is its own work, while a rank that a busy
  machine preempts saves something in many steps but spends that excess waiting for a core (or, preempted in a
  different part each step, has little).
  The compute score and arrival lead below are evidence, not criteria: a rank that is slower but that nobody waits
  for (or that a busy machine slows as much as its peers) costs nothing and is named by nobody;
- **transient**: otherwise, if in >= 2 measured steps it arrived last with a summed lead >= 50 % of the median step
  time, and in at least twice as many such steps as any other rank (so symmetric noise on a busy machine, where
  every rank is sometimes late, names nobody);
- **none** otherwise.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from dtprof.analyzers import clock as clock_mod
from dtprof.analyzers import steps as steps_mod
from dtprof.analyzers.collectives import own_records
from dtprof.rundir.schema import P2P_OPS

NS = 1e9
SCORE_THRESHOLD = 0.75
# late_step_frac (evidence, not a criterion) counts steps where a rank held its peers up by 15 % of the median
# step: healthy ranks on busy CPUs arrive last systematically by a few percent (measured: 2.2 ms/step, ~9 %).
PERSISTENT_DELAY_FRAC = 0.15
TRANSIENT_DELAY_FRAC = 0.50
TRANSIENT_MIN_STEPS = 2
DEFAULT_MIN_SAVING = 0.05   # AnalysisOptions.straggler_min_saving's default
# the saving must hold in at least this share of the measured steps: most of them, not a few (a 2-core machine's
# scheduling makes a few steps of any rank slow; a real 40 ms straggler held in 5 of 7 steps of a busy hybrid run)
PERSISTENT_HELD_FRAC = 0.75
# ... and in more of them than chance explains: a one-sided sign test at this level (a rank as likely to save as not
# in each step would hold in that many steps with at most this probability: 6 of 6, 7 of 8, 9 of 10, 11 of 14). Few
# measured steps are little evidence: on CI, an unslowed 2-rank Ray job of 6 measured steps, beside two other jobs
# on 2 cores, had one rank save 10 % in 5 of them (83 %, which chance gives 11 % of the time)
PERSISTENT_SIGNIFICANCE = 0.05
# ... or its median step saves at least this many times the threshold. Measured on this 2-core machine: an
# unslowed DDP job's busiest rank saved 7 % held in 58 % of steps (not a straggler); a rank slowed to 0.14 of its
# peer's speed saved 48 % held in 67 % of steps (a straggler: its median step saves ~48 %); an unslowed job beside a
# CPU hog reached a 35 % mean saving from a single 33 ms preemption (the median step saved little).
LARGE_SAVING_FACTOR = 3
# ... and the recurring excess must carry at least this share of the median step's saving: a rank that a busy
# machine preempts more often than its peer (CI, 2 hogs beside an unslowed 2-rank job: median saving 23 % of the
# step, ~3 ms, held in 70 % of steps) saves in many steps, but in a different part each time, so its typical excess
# (0.7 ms) explains a quarter of it; a slowed rank's typical excess is its saving (it waits in the same part)
RECURRING_SHARE = 0.5


def persistent_rule(min_saving: float = DEFAULT_MIN_SAVING) -> str:
    """The persistent-straggler criterion in words, for ``min_saving`` (the options' threshold)."""
    return (f"persistent: removing the rank's extra work (its work set to its peers' median) would save at least "
            f"{min_saving:.0%} of the step over the measured steps, and at least that much in at least "
            f"{PERSISTENT_HELD_FRAC:.0%} of them and in more than chance would give (a one-sided sign test at "
            f"{PERSISTENT_SIGNIFICANCE:.0%}) (or its median measured step would save at least "
            f"{LARGE_SAVING_FACTOR * min_saving:.0%}), and a typical step of it does at least {min_saving:.0%} of the "
            f"median step more work than its peers in the same parts, not counting time its training thread waited "
            f"for a CPU, and at least {RECURRING_SHARE:.0%} of its median step's saving (a recurring excess of its "
            f"own, not a busy machine's preemptions)")


PERSISTENT_RULE = persistent_rule()
TRANSIENT_RULE = (f"transient: holds its peers up by at least {TRANSIENT_DELAY_FRAC:.0%} of the median step in "
                  f"{TRANSIENT_MIN_STEPS} or more measured steps, twice as many as any other rank")
LABELS = {"sm_clock_mhz_mean": "SM clock (mean)", "temp_c_max": "temperature (max)", "power_w_mean": "power (mean)",
          "sm_util_mean_pct": "SM utilisation (mean)", "ecc_errors_max": "uncorrected ECC errors (max)"}


# The arrivals reduced where the data is (a node summary): per collective instance (group, seq) and part (the rows of
# one host on one node, which share a clock, so its earliest and latest arrival are those of its earliest and
# latest issue): the count of rows, the earliest issue and Σ of the others' distance from it, the latest issue with
# its rank (ties: the highest rank), that row's step (-1: none) and op, and the second-latest issue (the latest when
# the part has one row); for triage's mismatch check (analyzers/triage.py mismatch_candidates) the number of distinct
# (op, in_bytes, dtype) among the part's rows (``kinds``) and the latest row's, as "op|in_bytes|dtype" (``kind``).
# Point-to-point ops are left out; the ranks' own records win over trace rows.
ARRIVAL_PART_COLUMNS = ("group", "seq", "host", "node", "n", "issue_min_ns", "issue_dsum_ns", "issue_max_ns",
                        "rank_max", "step_max", "op_max", "issue_2nd_ns", "kinds", "kind")
# per rank and step (-1: none): its rows (the instances it took part in)
ARRIVAL_COUNT_COLUMNS = ("rank", "step", "n")


def _collective_rows(model) -> pd.DataFrame:
    co = model.collectives
    if len(co) == 0:
        return co
    return own_records(co[~co["op"].isin(list(P2P_OPS)).to_numpy()])


def arrival_parts(model) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(ARRIVAL_PART_COLUMNS sorted by group, seq, host, node; ARRIVAL_COUNT_COLUMNS sorted by rank, step) of the
    run model's collectives: rank-local, so a node's rows give that node's part of the whole run's."""
    c = _collective_rows(model)
    r = model.ranks
    if len(c) == 0:
        return (pd.DataFrame({k: pd.Series(dtype=object if k in ("group", "host", "node", "op_max", "kind")
                                           else "int64")
                              for k in ARRIVAL_PART_COLUMNS}),
                pd.DataFrame({k: pd.Series(dtype="int64") for k in ARRIVAL_COUNT_COLUMNS}))
    rank = c["rank"].to_numpy(np.int64)
    by_rank = pd.DataFrame({"host": r["host"].astype(str).to_numpy(), "node": r["node"].astype(str).to_numpy()},
                           index=r["rank"].to_numpy(np.int64)).reindex(rank).fillna("")
    step = c["step"].astype("Int64").fillna(-1).to_numpy(np.int64)
    issue = c["issue_ns"].to_numpy(np.int64)
    g = pd.Categorical(c["group"].astype(str))
    h = pd.Categorical(by_rank["host"].to_numpy())
    nd = pd.Categorical(by_rank["node"].to_numpy())
    seq = c["seq"].to_numpy(np.int64)
    order = np.lexsort((rank, issue, nd.codes, h.codes, seq, g.codes))
    key = np.stack([g.codes[order], seq[order], h.codes[order], nd.codes[order]])
    starts = np.flatnonzero(np.r_[True, (key[:, 1:] != key[:, :-1]).any(axis=0)])
    ends = np.r_[starts[1:], len(order)] - 1
    si = issue[order]
    lo = si[starts]
    n = ends - starts + 1
    dsum = np.add.reduceat(si - np.repeat(lo, n), starts)
    last = order[ends]
    sig = pd.MultiIndex.from_arrays([c["op"].astype(str).to_numpy(), c["in_bytes"].to_numpy(np.int64),
                                     c["dtype"].astype(str).to_numpy()])
    sig_code, sig_uniq = pd.factorize(sig)
    part_of_row = np.repeat(np.arange(len(starts)), n)
    kinds = pd.DataFrame({"p": part_of_row, "k": sig_code[order]}).groupby("p")["k"].nunique().to_numpy(np.int64)
    sig_text = np.asarray([f"{o}|{b}|{d}" for o, b, d in sig_uniq], dtype=object)   # one per distinct kind
    parts = pd.DataFrame({
        "group": np.asarray(g.categories, dtype=object)[g.codes[last]], "seq": seq[last],
        "host": np.asarray(h.categories, dtype=object)[h.codes[last]],
        "node": np.asarray(nd.categories, dtype=object)[nd.codes[last]],
        "n": n.astype(np.int64), "issue_min_ns": lo, "issue_dsum_ns": dsum.astype(np.int64),
        "issue_max_ns": issue[last], "rank_max": rank[last], "step_max": step[last],
        "op_max": c["op"].astype(str).to_numpy()[last],
        "issue_2nd_ns": np.where(n > 1, si[np.maximum(ends - 1, starts)], issue[last]),
        "kinds": kinds, "kind": sig_text[sig_code[last]]})
    counts = pd.DataFrame({"rank": rank, "step": step}).groupby(["rank", "step"], sort=True).size()
    return parts, counts.rename("n").reset_index().astype("int64")


def arrivals(model, parts, counts) -> tuple[pd.DataFrame, pd.Series]:
    """(per collective instance: group, seq, op, rank, step, first_ns, arrival_ns, lateness_s, last, lead_s,
    peers_lost_s, ranks, measured; per rank: its rows in measured steps) from ``arrival_parts`` and
    ``arrival_counts`` of the run (rundir.rows.Rows: its nodes' parts in any order, reduced per instance in DuckDB).

    Arrivals are issue times aligned through the run model's clocks. Of each instance: ``rank`` is the last rank to
    arrive (ties: the highest rank), ``first_ns`` the first arrival, ``arrival_ns`` the last rank's arrival,
    ``lateness_s`` its arrival minus the first one, ``last`` whether it arrived alone last (later than the first,
    with peers), ``lead_s`` its lead over the second-latest arrival (0 unless ``last``), ``peers_lost_s`` Σ over all
    ranks of (last arrival - own arrival) (a part's sum aligned linearly, then rounded to the ns). ``measured``: the
    last rank's row is in the model's measured steps (every instance when no row has a step). Every reduction is
    exact (integers, minima, maxima, the latest by a total order), so the result does not depend on the parts'
    order."""
    no_steps, rows_per_rank = measured_rows_per_rank(counts, model.measured_steps)
    return instance_arrivals(parts, model.clock, model.measured_steps, no_steps), rows_per_rank


def measured_rows_per_rank(counts, measured_steps) -> tuple[bool, pd.Series]:
    """(whether no row of ``arrival_counts`` has a step; per rank its rows in measured steps, every row then)."""
    measured = pd.DataFrame({"step": np.asarray(sorted(measured_steps), np.int64)})
    with counts.connection(measured=measured) as con:
        no_steps = not con.execute("SELECT coalesce(bool_or(step >= 0), false) FROM rows").fetchall()[0][0]
        cm = con.sql("SELECT rank, CAST(sum(n) AS BIGINT) AS n FROM rows "
                     + ("" if no_steps else "WHERE step IN (SELECT step FROM measured) ")
                     + "GROUP BY rank ORDER BY rank").df()
    return no_steps, pd.Series(cm["n"].to_numpy(np.int64),
                               index=pd.Index(cm["rank"].to_numpy(np.int64), name="rank"), name="n")


ARRIVALS_KEY = '"group", seq'   # the per-instance reduction's key: a partition of the parts by it (Rows.partition)


def instance_arrivals(parts, clk: pd.DataFrame, measured_steps, no_steps: bool) -> pd.DataFrame:
    """``arrivals``' per-instance frame from ``arrival_parts`` (all of them, or a partition by ARRIVALS_KEY: then
    the rows of that partition's instances; ``merge_arrivals`` joins the partitions), the run model's clocks
    ``clk`` and measured steps."""
    cols = ["group", "seq", "op", "rank", "step", "first_ns", "arrival_ns", "lateness_s", "last", "lead_s",
            "peers_lost_s", "ranks", "measured"]
    measured = np.asarray(sorted(measured_steps), np.int64)
    off, drift = clock_mod.alignment(clk["host"].astype(str).to_numpy(), clk) if len(clk) else ([], [])
    ref = clock_mod.ref_t(clk)

    def aligned(t: str) -> str:   # clock.align_times in SQL: t + rint(offset + drift × (t - ref_t))
        return f"{t} + CAST(round_even(off + drift * CAST({t} - {ref} AS DOUBLE), 0) AS BIGINT)"

    lo = np.iinfo(np.int64).min
    inst = parts.query(f"""
        WITH p AS (
            SELECT "group", seq, n, issue_dsum_ns AS dsum, issue_min_ns AS t_min, rank_max, step_max, op_max,
                   {aligned("issue_min_ns")} AS a_min, {aligned("issue_max_ns")} AS a_max,
                   {aligned("issue_2nd_ns")} AS a_2nd,
                   CAST(round_even(n * off + drift * CAST(n * (issue_min_ns - {ref}) + issue_dsum_ns AS DOUBLE), 0)
                        AS BIGINT) AS shift
            FROM (SELECT r.*, coalesce(c.off, 0.0) AS off, coalesce(c.drift, 0.0) AS drift
                  FROM rows AS r LEFT JOIN clk AS c USING (host)))
        SELECT "group", seq, first, last_t, count, w.rank AS rank, w.step AS step, w.op AS op,
               CAST(CAST(last_t AS HUGEINT) * count - s_nt - s_dsum - s_shift AS BIGINT) AS lost,
               greatest(CASE WHEN parts > 1 THEN top2[2] ELSE {lo} END, CASE WHEN w.n > 1 THEN w.a2 ELSE {lo} END)
                   AS second
        FROM (SELECT "group", seq, min(a_min) AS first, max(a_max) AS last_t, CAST(sum(n) AS BIGINT) AS count,
                     arg_max({{'rank': rank_max, 'step': step_max, 'op': op_max, 'n': n, 'a2': a_2nd}},
                             (a_max, rank_max)) AS w, count(*) AS parts, max(a_max, 2) AS top2,
                     sum(CAST(n AS HUGEINT) * t_min) AS s_nt, sum(CAST(dsum AS HUGEINT)) AS s_dsum,
                     sum(CAST(shift AS HUGEINT)) AS s_shift
              FROM p GROUP BY "group", seq)
        ORDER BY "group", seq""", clk=pd.DataFrame({"host": clk["host"].astype(str).to_numpy() if len(clk) else [],
                                                    "off": np.asarray(off, float), "drift": np.asarray(drift, float)}))
    if len(inst) == 0:
        return pd.DataFrame({c: pd.Series(dtype=("bool" if c in ("last", "measured") else "float64"))
                             for c in cols})
    first, last_t = inst["first"].to_numpy(np.int64), inst["last_t"].to_numpy(np.int64)
    count, step = inst["count"].to_numpy(np.int64), inst["step"].to_numpy(np.int64)
    is_last = (last_t > first) & (count > 1)
    out = pd.DataFrame({
        "group": pd.Categorical(inst["group"].astype(str).to_numpy()), "seq": inst["seq"].to_numpy(np.int64),
        "op": pd.Categorical(inst["op"].astype(str).to_numpy()), "rank": inst["rank"].to_numpy(np.int64),
        "step": pd.array(np.where(step >= 0, step, 0), dtype="Int64"),
        "first_ns": first, "arrival_ns": last_t, "lateness_s": (last_t - first) / NS, "last": is_last,
        "lead_s": np.where(is_last, (last_t - inst["second"].to_numpy(np.int64)) / NS, 0.0),
        "peers_lost_s": np.where(is_last, inst["lost"].to_numpy(np.int64) / NS, 0.0), "ranks": count})
    out.loc[step < 0, "step"] = pd.NA
    # set-up and teardown traffic (no step: ranks start seconds apart) is not lateness; a run with no steps at all
    # (an import without step markers) has nothing else
    out["measured"] = np.ones(len(out), bool) if no_steps else np.isin(step, measured)
    return out


def merge_arrivals(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """``instance_arrivals`` of all the parts from those of its partitions (ARRIVALS_KEY): the same frame, in
    (group, seq) order with the text columns' categories as one frame's."""
    got = [f for f in frames if len(f)]
    if len(got) <= 1:
        return got[0] if got else frames[0]
    out = pd.concat(got, ignore_index=True)
    for c in ("group", "op"):
        out[c] = pd.Categorical(out[c].astype(str).to_numpy())
    order = np.lexsort((out["seq"].to_numpy(np.int64), out["group"].cat.codes.to_numpy()))
    return out.iloc[order].reset_index(drop=True)


def classify(run, arr: pd.DataFrame, rows_per_rank: pd.Series, per_step: pd.DataFrame, step_p50_s: float | None,
             savings: pd.DataFrame | None = None, min_saving: float = DEFAULT_MIN_SAVING,
             typical_excess: dict[int, float] | None = None,
             typical_cpu_wait: dict[int, float] | None = None) -> pd.DataFrame:
    """``arr``, ``rows_per_rank``: ``arrivals``. Per rank: rank, host, device, late_frac, time_lost_s,
    compute_score, delay_s_per_step, saving_frac, saving_step_frac, kind, late_steps. ``savings``: rank, step,
    saving_frac of the what-if's straggler_removed per measured step (analyzers/whatif.py); ranks without a row save
    nothing. ``typical_excess``: rank -> the what-if's typical_excess (s); a rank without one has none.
    ``typical_cpu_wait``: rank -> the what-if's typical_cpu_wait (s), the part of that excess spent waiting for a
    CPU, which is not the rank's own work."""
    r = run.ranks
    out = pd.DataFrame({"rank": r["rank"].to_numpy(np.int64), "host": r["host"].astype(str).to_numpy(),
                        "device": r["device_name"].astype(str).to_numpy(),
                        "device_index": r["device_index"].astype("Int64").to_numpy()}).sort_values("rank")
    out = out.reset_index(drop=True)
    # over the measured rank-steps, a column at a time (a mask over the frame copies all: 16.4 M rank-steps)
    measured = per_step["measured"].to_numpy(bool)
    rank, step = per_step["rank"].to_numpy(np.int64), per_step["step"].to_numpy(np.int64)
    compute = per_step["compute_s"].to_numpy(float)
    med = steps_mod.ByRank(rank, measured).agg(compute, "median")
    ref = med[med > 0].min() if (med > 0).any() else np.nan
    out["compute_s_median"] = med.reindex(out["rank"]).to_numpy()
    out["compute_score"] = np.where(out["compute_s_median"] > 0, ref / out["compute_s_median"], np.nan)
    busy = np.flatnonzero(measured & (compute > 0))
    _, at = steps_mod.dense_codes(step[busy])
    step_ref = np.full(int(at.max()) + 1 if len(at) else 0, np.inf)
    np.minimum.at(step_ref, at, compute[busy])   # per step the least compute (a minimum: exact in any order)
    slow = (step_ref[at] / compute[busy]) < SCORE_THRESHOLD
    out["slow_step_frac"] = (steps_mod.ByRank(rank[busy], np.ones(len(busy), bool)).agg(slow, "mean")
                             .reindex(out["rank"]).fillna(0.0).to_numpy())
    n_steps = max(len(steps_mod.distinct(step[measured])), 1)
    n = rows_per_rank
    late = arr[(arr["measured"] & arr["last"]).to_numpy()] if len(arr) else arr
    if len(late):
        g = late.groupby("rank")
        nl = g.size()
        lost = g["peers_lost_s"].sum()
        lead = g["lead_s"].sum()
    else:
        nl = lost = lead = pd.Series(dtype=float)
    per_step_lead = step_leads(late)
    idx = out["rank"]
    out["instances"] = n.reindex(idx).fillna(0).astype(int).to_numpy()
    out["late_count"] = nl.reindex(idx).fillna(0).astype(int).to_numpy()
    out["late_frac"] = np.where(out["instances"] > 0, out["late_count"] / out["instances"].clip(lower=1), 0.0)
    out["time_lost_s"] = lost.reindex(idx).fillna(0.0).to_numpy()
    out["delay_s_per_step"] = lead.reindex(idx).fillna(0.0).to_numpy() / n_steps
    p50 = step_p50_s or 0.0
    late_steps = per_step_lead["rank"][late_step(per_step_lead["lead_s"], p50)].value_counts()
    out["late_steps"] = late_steps.reindex(idx).fillna(0).astype(int).to_numpy()
    # Steps in which the rank held its peers up by a material lead at some collective. Per step, not per
    # collective instance: a rank that is late to a step's first all-reduce arrives with everyone at the next ones.
    if p50 > 0 and len(per_step_lead):
        held = per_step_lead[per_step_lead["lead_s"] >= PERSISTENT_DELAY_FRAC * p50].groupby("rank").size()
    else:
        held = pd.Series(dtype=int)
    out["late_step_frac"] = held.reindex(idx).fillna(0).to_numpy() / n_steps
    sv = savings if savings is not None and len(savings) else pd.DataFrame(columns=["rank", "step", "saving_frac"])
    sv = sv.astype({"rank": "int64", "saving_frac": "float64"})
    out["saving_frac"] = sv.groupby("rank")["saving_frac"].mean().reindex(idx).fillna(0.0).to_numpy()
    held_steps = (sv["saving_frac"] >= min_saving).groupby(sv["rank"]).sum()
    # over the steps the what-if replayed (all measured steps, or its sample of them: whatif.replay_steps)
    replayed = max(int(sv["step"].nunique()), 1) if len(sv) else n_steps
    out["saving_step_frac"] = held_steps.reindex(idx).fillna(0).to_numpy() / replayed
    significant = np.array([sign_test_p(int(k), replayed) <= PERSISTENT_SIGNIFICANCE
                            for k in held_steps.reindex(idx).fillna(0)])
    out["saving_frac_median"] = sv.groupby("rank")["saving_frac"].median().reindex(idx).fillna(0.0).to_numpy()
    out["typical_excess_s"] = pd.Series(typical_excess or {}, dtype=float).reindex(idx).fillna(0.0).to_numpy()
    out["typical_cpu_wait_s"] = pd.Series(typical_cpu_wait or {}, dtype=float).reindex(idx).fillna(0.0).to_numpy()
    own_excess = out["typical_excess_s"].to_numpy() - out["typical_cpu_wait_s"].clip(lower=0.0).to_numpy()
    held = out["saving_step_frac"]
    if p50 > 0:
        needed = np.maximum(min_saving, RECURRING_SHARE * out["saving_frac_median"].to_numpy()) * p50
        consistent = own_excess >= needed
    else:
        consistent = np.zeros(len(out), bool)
    holds = (held >= PERSISTENT_HELD_FRAC) & significant
    persistent = (out["saving_frac"] >= min_saving) & consistent & (
        holds | (out["saving_frac_median"] >= LARGE_SAVING_FACTOR * min_saving))
    transient = ~persistent & late_most(out["late_steps"].to_numpy(), TRANSIENT_MIN_STEPS)
    out["kind"] = np.where(persistent, "persistent", np.where(transient, "transient", "none"))
    out["reason"] = [
        (f"removing its extra work would save about {sf:.0%} of the step ({hf:.0%} of measured steps save at least "
         f"{min_saving:.0%}; a typical step does {ex * 1e3:.1f} ms more work than its peers{cpu_wait_note(cw)})"
         if pe else
         f"held its peers up by >= {TRANSIENT_DELAY_FRAC:.0%} of the median step in {n} measured steps" if tr else "")
        for pe, tr, sf, hf, ex, cw, n in zip(persistent, transient, out["saving_frac"], out["saving_step_frac"],
                                             out["typical_excess_s"], out["typical_cpu_wait_s"], out["late_steps"])]
    return out


def step_leads(arr: pd.DataFrame) -> pd.DataFrame:
    """Per rank and step (rank, step, lead_s): Σ ``lead_s`` of the instances of ``arr`` (``instance_arrivals``'
    frame, the rows the caller counts) it arrived last at. A rank that is late to a step's first all-reduce arrives
    with everyone at the next ones, so lateness is judged per step, not per collective instance."""
    late = arr[arr["last"].to_numpy(bool)] if len(arr) else arr
    if len(late) == 0:
        return pd.DataFrame({"rank": pd.Series(dtype="int64"), "step": pd.Series(dtype="Int64"),
                             "lead_s": pd.Series(dtype="float64")})
    return late.groupby(["rank", "step"], dropna=False)["lead_s"].sum().reset_index()


def late_step(lead_s, step_p50_s: float) -> np.ndarray:
    """Whether a rank-step's lead (``step_leads``) held its peers up: at least ``TRANSIENT_DELAY_FRAC`` of the
    median step (none without a median step)."""
    p50 = step_p50_s or 0.0
    return (np.asarray(lead_s, np.float64) >= TRANSIENT_DELAY_FRAC * p50) & (p50 > 0)


def late_most(late_steps: np.ndarray, min_steps) -> np.ndarray:
    """Per rank, whether its count of late steps (``late_step``) is at least ``min_steps`` (a number, or one per
    rank) and at least twice any other rank's: symmetric noise on a busy machine, where every rank is sometimes
    late, names nobody."""
    ls = np.asarray(late_steps, np.int64)
    top = np.sort(ls)[::-1]
    others_max = np.where(ls == top[0], top[1] if len(top) > 1 else 0, top[0]) if len(top) else ls
    return (ls >= min_steps) & (ls >= 2 * others_max)


def local_arrivals(model) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(``instance_arrivals`` of the run model's collectives on one clock, every instance counted: the ranks of one
    host, the live path's, dtprof/live.py; per collectives row that ``arrivals`` counts, its rank, step (-1: none)
    and ``lateness_ns``, its arrival minus the instance's first arrival)."""
    from dtprof.rundir.rows import Rows

    parts, _ = arrival_parts(model)
    arr = instance_arrivals(Rows.of("arrival_parts", parts), pd.DataFrame({"host": []}), (), no_steps=True)
    c = _collective_rows(model)
    first = pd.Series(arr["first_ns"].to_numpy(np.int64),
                      index=pd.MultiIndex.from_arrays([arr["group"].astype(str).to_numpy(),
                                                       arr["seq"].to_numpy(np.int64)]))
    key = pd.MultiIndex.from_arrays([c["group"].astype(str).to_numpy(), c["seq"].to_numpy(np.int64)])
    issue = c["issue_ns"].to_numpy(np.int64)
    rows = pd.DataFrame({"rank": c["rank"].to_numpy(np.int64),
                         "step": c["step"].astype("Int64").fillna(-1).to_numpy(np.int64),
                         "lateness_ns": issue - first.reindex(key).to_numpy(np.int64)})
    return arr, rows


def sign_test_p(k: int, n: int) -> float:
    """P(at least ``k`` of ``n`` steps) for a rank that saves or not in each step as a coin falls (one-sided)."""
    if n <= 0:
        return 1.0
    if n > 200:     # the normal approximation, with continuity correction (exact sums grow with n)
        return 0.5 * math.erfc((k - 0.5 - n / 2) / math.sqrt(n / 4) / math.sqrt(2))
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n


def cpu_wait_note(cpu_wait_s: float) -> str:
    """How much longer than its peers' a rank's training thread typically waited for a CPU (said when material):
    time inside its parts that the criterion does not count as its work."""
    return f", and waits {cpu_wait_s * 1e3:.1f} ms more for a CPU (not its own work)" if cpu_wait_s >= 1e-4 else ""


def flagged(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of a classification table (``classify``, Analysis.stragglers) whose rank is flagged: a persistent
    straggler or transient lateness (kind "none": not flagged)."""
    return table[table["kind"].astype(str) != "none"]


def nvml_evidence(cls: pd.DataFrame, rank_gpu: pd.DataFrame, gpus: pd.DataFrame) -> dict[int, dict]:
    """NVML evidence for each flagged rank, built once (summary, report and triage all read it): its GPU's
    clocks, temperature, power, utilisation, ECC and throttling (analyzers/gpu.py's per-GPU table) beside the median
    of the job's other GPUs, and ``lines``, the same as sentences. ``gpu`` is None when the rank has no samples."""
    ranks = flagged(cls)["rank"].tolist()
    ev: dict[int, dict] = {}
    rows = rank_gpu.set_index("rank")["gpu_row"] if len(rank_gpu) else pd.Series(dtype=int)
    for rk in ranks:  # one iteration per flagged rank, a handful at most
        gi = int(rows.get(rk, -1)) if rk in rows.index else -1
        if len(gpus) == 0 or gi < 0:
            ev[rk] = {"host": None, "gpu": None, "lines": [
                "no NVML samples for this rank's GPU (CPU run, NVML unavailable, or GPU not matched)"]}
            continue
        me = gpus.iloc[gi]
        others = gpus.drop(index=gpus.index[gi])
        rec: dict = {"host": str(me["host"]), "gpu": int(me["gpu"]), "samples": int(me["samples"]),
                     "throttled_frac": float(me["throttled_frac"]),
                     "throttle_reasons": [r for r in str(me["throttle_reasons"] or "").split(",") if r]}
        lines = []
        for col, unit in (("sm_clock_mhz_mean", "MHz"), ("temp_c_max", "°C"), ("power_w_mean", "W"),
                          ("sm_util_mean_pct", "%"), ("ecc_errors_max", "")):
            v = me[col]
            o = others[col].median() if len(others) else np.nan
            rec[col] = None if pd.isna(v) else round(float(v), 1)
            rec["others_" + col] = None if pd.isna(o) else round(float(o), 1)
            if pd.isna(v) or (col == "ecc_errors_max" and not v):
                continue
            tail = f" (others' median {o:.0f} {unit})".replace(" )", ")") if pd.notna(o) else ""
            lines.append(f"{LABELS[col]} {v:.0f} {unit}{tail}".replace("  ", " "))
        if me["throttled_s"] > 0:
            lines.append(f"throttled {me['throttled_s']:.2f} s ({me['throttled_frac']:.0%} of sampled time): "
                         f"{me['throttle_reasons'] or 'unknown reason'}")
        else:
            lines.append("no throttling reported by NVML")
        rec["lines"] = [f"GPU {me['host']}:{int(me['gpu'])} " + lines[0]] + lines[1:]
        ev[rk] = rec
    return ev
