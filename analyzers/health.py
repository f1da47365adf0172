"""Numerics health (docs/metrics.md, "Numerics health"): the per-step loss, gradient norm and learning rate of each
rank, and the incidents in them: the first non-finite value, loss spikes and gradient-norm explosions by a rolling
robust test, and data-parallel replicas whose parameter fingerprints differ (silent corruption). A pure function of
the run's ``health`` table (collectors/numerics.py), its ``numerics`` meta rows and, for the replica groups, its
DDP collectives and groups. No torch.

The robust test: a value x of a rank's series is an outlier when (x - m) / (1.4826 · MAD) > SPIKE_Z, m and MAD
the median and median absolute deviation of the rank's previous SPIKE_WINDOW finite values (at least
SPIKE_MIN_WINDOW of them), all on the logarithms when x and the window are positive; upward only (a falling loss is
progress). Non-finite values never enter the window (one NaN must not shift it), flagged values do (a lasting new
level is absorbed). Consecutive flagged steps of a series are one incident, at its first step.
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pandas as pd

SPIKE_WINDOW = 32
SPIKE_MIN_WINDOW = 8
SPIKE_Z = 8.0
MAD_SIGMA = 1.4826       # MAD of a normal distribution is 0.6745 sigma
MAD_FLOOR = 1e-3         # the MAD's floor, a share of |median|: a flat series is not noise-free
LR_JUMP = 2.0            # a learning rate this many times its window's median (or under its inverse) "changed"
PER_STEP_MAX = 200_000   # rows of ``per_step`` written into summary.json at most


def _num(x):
    return None if x is None or pd.isna(x) else float(x)


def outliers(values: np.ndarray) -> np.ndarray:
    """Robust z of each value against its SPIKE_WINDOW finite predecessors (NaN where not tested); on the logarithms
    when the value and its window are positive (a loss or a norm varies by factors, and a small batch's loss is
    skewed: on a clipped regression's clean 1,600 rank-steps the linear test raised one false spike)."""
    z = np.full(len(values), np.nan)
    window: list[float] = []
    for i, x in enumerate(values):
        if not np.isfinite(x):
            continue
        if len(window) >= SPIKE_MIN_WINDOW:
            w = np.asarray(window[-SPIKE_WINDOW:])
            if x > 0 and (w > 0).all():
                w, x = np.log(w), math.log(x)
            m = float(np.median(w))
            mad = max(float(np.median(np.abs(w - m))), MAD_FLOOR * abs(m), 1e-12)
            z[i] = (x - m) / (MAD_SIGMA * mad)
        window.append(float(values[i]))
        if len(window) > SPIKE_WINDOW:
            del window[0]
    return z


def _runs(steps: np.ndarray, flagged: np.ndarray) -> list[int]:
    """The first step of each run of consecutive flagged entries."""
    first, prev = [], False
    for s, f in zip(steps, flagged):
        if f and not prev:
            first.append(int(s))
        prev = bool(f)
    return first


def replica_groups(collectives: pd.DataFrame, groups: pd.DataFrame) -> list[list[int]]:
    """The data-parallel replica groups: the process groups of DDP's gradient buckets (collectives source "ddp"),
    as their members. FSDP, ZeRO and tensor-parallel shards are not replicas and are never compared."""
    if collectives is None or not len(collectives) or groups is None or not len(groups):
        return []
    ddp = collectives[collectives["source"].astype(str) == "ddp"]
    names = set(ddp["group"].astype(str))
    out = []
    for g in groups[groups["group"].astype(str).isin(names)].drop_duplicates("group").itertuples(index=False):
        members = sorted(int(x) for x in str(g.ranks).split(",") if x.strip())
        if len(members) > 1 and members not in out:
            out.append(members)
    return out


def _vote(values: dict) -> tuple[list[int], bool]:
    """(the ranks off the majority fingerprint, whether there is no majority: all of them then)."""
    counts = Counter(values.values())
    (top, n), = counts.most_common(1)
    if sum(1 for c in counts.values() if c == n) > 1:
        return sorted(values), True
    return sorted(r for r, v in values.items() if v != top), False


def fingerprint_incidents(health: pd.DataFrame, groups: list[list[int]]) -> tuple[list[dict], int]:
    """(the first step each replica group's fingerprints differed, named by the members off the majority value;
    the number of (group, step) comparisons made). Ranks that priced different intervals share only some steps: when
    the first differing step has no majority (two of three replicas there), the first later step with one names
    the culprits (a flipped bit stays flipped)."""
    fp = health.dropna(subset=["param_fp"])
    out, compared = [], 0
    for members in groups:
        g = fp[fp["rank"].isin(members)]
        first = None
        for step, at in g.groupby("step", sort=True):
            if at["rank"].nunique() < 2:
                continue
            compared += 1
            values = dict(zip(at["rank"].astype(int), at["param_fp"].astype("int64")))
            if len(set(values.values())) == 1 or (first is not None and first[2] is False):
                continue
            culprits, tie = _vote(values)
            if first is None:
                first = (int(step), culprits, tie, len(values))
            elif not tie:
                first = (first[0], culprits, False, len(values))
        if first is None:
            continue
        step, culprits, tie, n = first
        who = (f"rank(s) {', '.join(map(str, culprits))} hold parameters that differ from the other "
               f"{n - len(culprits)} replica(s)") if not tie else \
              (f"ranks {', '.join(map(str, culprits))} hold different parameters ({n} replicas, no "
               f"majority: which one is wrong cannot be told)")
        out.append({"kind": "divergence", "step": step, "ranks": culprits, "group": members,
                    "cause": "silent corruption or a replica-local update",
                    "message": f"data-parallel replicas diverged by step {step}: {who} (parameter "
                               f"fingerprints of group {members})"})
    return out, compared


def _series(health: pd.DataFrame, col: str) -> pd.DataFrame:
    return health[["rank", "step", col]].sort_values(["rank", "step"])


def _spikes(health: pd.DataFrame, col: str) -> list[dict]:
    """Per rank, the first step of each run of outliers of ``col`` (robust z, module docstring)."""
    out = []
    for rank, g in _series(health, col).groupby("rank", sort=True):
        v = g[col].to_numpy(float)
        z = outliers(v)
        steps = g["step"].to_numpy()
        for s in _runs(steps, np.nan_to_num(z, nan=-np.inf) > SPIKE_Z):
            i = int(np.flatnonzero(steps == s)[0])
            prior = v[:i][np.isfinite(v[:i])][-SPIKE_WINDOW:]
            out.append({"rank": int(rank), "step": s, "value": float(v[i]), "median": float(np.median(prior)),
                        "z": float(z[i])})
    return out


def _lr_change(health: pd.DataFrame, rank: int, step: int) -> str | None:
    """The learning rate of the update before ``step`` (the row of ``step - 1``) against its window's median."""
    g = health[(health["rank"] == rank) & (health["step"] < step)].sort_values("step")
    lr = g["lr"].to_numpy(float)
    if len(lr) < 2 or not np.isfinite(lr[-1]):
        return None
    prior = lr[:-1][np.isfinite(lr[:-1])][-SPIKE_WINDOW:]
    if not len(prior):
        return None
    m = float(np.median(prior))
    if m > 0 and (lr[-1] > LR_JUMP * m or lr[-1] < m / LR_JUMP):
        return f"the learning rate changed: {lr[-1]:.4g} at step {int(g['step'].iloc[-1])}, against {m:.4g} before"
    return None


def _grouped(spikes: list[dict]) -> dict[int, list[dict]]:
    by: dict[int, list[dict]] = {}
    for s in spikes:
        by.setdefault(s["step"], []).append(s)
    return by


def analyze_health(health: pd.DataFrame, meta: pd.DataFrame | None = None,
                   collectives: pd.DataFrame | None = None, groups: pd.DataFrame | None = None) -> dict:
    """summary.json's ``health`` block (docs/summary-schema.md)."""
    block: dict = {"per_step": [], "incidents": [], "first_nonfinite": None, "nonfinite_steps": [],
                   "spike_test": {"window": SPIKE_WINDOW, "min_window": SPIKE_MIN_WINDOW, "z": SPIKE_Z},
                   "fingerprint": None}
    if health is None or not len(health):
        block["reason"] = "no health rows (a run recorded before run format 1.8, or no optimizer step)"
        return block
    h = health.sort_values(["step", "rank"]).reset_index(drop=True)
    if len(h) <= PER_STEP_MAX:
        src = h["grad_norm_source"].fillna("").astype(str) if "grad_norm_source" in h else pd.Series("", h.index)
        block["per_step"] = [{"rank": int(r.rank), "step": int(r.step), "loss": _num(r.loss),
                              "grad_norm": _num(r.grad_norm), "lr": _num(r.lr),
                              "grad_norm_source": s or None}
                             for r, s in zip(h[["rank", "step", "loss", "grad_norm", "lr"]].itertuples(index=False),
                                             src)]
    else:
        block["per_step_reason"] = (f"{len(h)} rank-steps, over the {PER_STEP_MAX} written here (the run's health "
                                    f"table has them all)")
    skips = (h["scaler_skips"] if "scaler_skips" in h else pd.Series(pd.NA, h.index)).fillna(0).astype("int64")
    block["scaler"] = _scaler_block(h, skips)
    # a step the fp16 loss scaler skipped (it found an inf/NaN gradient: its overflow) is not a numerics incident
    nonfinite = h[(h["nonfinite"].fillna("").astype(str) != "") & (skips == 0)]
    block["nonfinite_steps"] = [{"rank": int(r.rank), "step": int(r.step), "what": str(r.nonfinite).split()}
                                for r in nonfinite.head(1000).itertuples(index=False)]
    block["nonfinite_count"] = int(len(nonfinite))
    incidents: list[dict] = []
    if len(nonfinite):
        first = int(nonfinite["step"].min())
        at = nonfinite[nonfinite["step"] == first]
        loss_bad = at[at["nonfinite"].astype(str).str.contains("loss")]
        culprits = sorted(int(r) for r in (loss_bad if len(loss_bad) else at)["rank"])
        what = "local loss" if len(loss_bad) else "gradient norm"
        others = sorted(set(int(r) for r in h.loc[h["step"] == first, "rank"]) - set(culprits))
        spread = (f"; rank(s) {', '.join(map(str, others))} still finite at that step" if others and len(loss_bad)
                  else "")
        block["first_nonfinite"] = {"step": first, "ranks": culprits, "what": what}
        named, when = culprits, f"first at step {first}"
        # The reads are priced (collectors/numerics.py: every read_every-th detailed step): steps between the
        # culprits' last finite read and `first` were not read, and a value that went non-finite there has
        # spread to every data-parallel peer by `first`. Say so, and name no rank when no rank read there was
        # still finite.
        col = "loss" if len(loss_bad) else "grad_norm"   # a row may hold a fingerprint alone: not a read of it
        last = h.loc[(h["step"] < first) & h["rank"].isin(culprits) & h[col].notna(), "step"]
        if len(last) and int(last.max()) + 1 < first:
            since = int(last.max()) + 1
            block["first_nonfinite"]["since_step"] = since
            when = f"between steps {since} and {first} (not read in between; first seen at step {first})"
            if not others and len(culprits) > 1:
                named = []
                spread = "; every rank read there was non-finite, so which went first is not known"
        incidents.append({"kind": "nonfinite", "step": first, "ranks": named, "what": what,
                          "cause": "a non-finite " + what,
                          "message": f"the {what} went non-finite (NaN/Inf) {when} on rank(s) "
                                     f"{', '.join(map(str, culprits))}{spread}"})
    norm_spikes = _spikes(h, "grad_norm")
    norm_steps = {(s["rank"], s["step"]) for s in norm_spikes}
    for step, ss in sorted(_grouped(_spikes(_unscaled(h, skips), "loss")).items()):
        ranks = sorted(s["rank"] for s in ss)
        at_step = sorted(set(int(r) for r in h.loc[(h["step"] == step) & h["loss"].notna(), "rank"]))
        causes = []
        lr = _lr_change(h, ranks[0], step)
        if lr:
            causes.append(lr)
        norm_at = h[(h["step"] == step) & (h["rank"].isin(ranks))]["grad_norm"]
        if norm_at.notna().any():
            if any((r, step) in norm_steps for r in ranks):
                causes.append("the gradient norm jumped with it")
            elif not lr:
                causes.append("the gradient norm is normal: the data")
        if len(at_step) > 1 and len(ranks) == 1:
            causes.append(f"only rank {ranks[0]}'s loss jumped: that rank's data")
        s0 = ss[0]
        incidents.append({"kind": "loss_spike", "step": int(step), "ranks": ranks, "value": s0["value"],
                          "median": s0["median"], "z": s0["z"], "cause": "; ".join(causes) or None,
                          "message": f"loss spike at step {int(step)} on rank(s) {', '.join(map(str, ranks))}: "
                                     f"{s0['value']:.4g} against a median of {s0['median']:.4g} (robust z "
                                     f"{s0['z']:.1f})" + (f"; {'; '.join(causes)}" if causes else "")})
    for step, ss in sorted(_grouped(norm_spikes).items()):
        ranks = sorted(s["rank"] for s in ss)
        s0 = ss[0]
        lr = _lr_change(h, ranks[0], step)
        incidents.append({"kind": "grad_norm_explosion", "step": int(step), "ranks": ranks, "value": s0["value"],
                          "median": s0["median"], "z": s0["z"], "cause": lr,
                          "message": f"gradient-norm explosion at step {int(step)} on rank(s) "
                                     f"{', '.join(map(str, ranks))}: {s0['value']:.4g} against a median of "
                                     f"{s0['median']:.4g} (robust z {s0['z']:.1f})" + (f"; {lr}" if lr else "")})
    rgroups = replica_groups(collectives, groups)
    div, compared = fingerprint_incidents(h, rgroups)
    incidents += div
    block["fingerprint"] = _fingerprint_block(meta, rgroups, compared)
    block["incidents"] = sorted(incidents, key=lambda i: (i["step"], i["kind"]))
    return block


def _unscaled(h: pd.DataFrame, skips: pd.Series) -> pd.DataFrame:
    """The losses a GradScaler multiplied, divided by its scale (a doubled scale is not a loss spike); a skipped
    step's (its iterations had different scales) left out of the test."""
    if "loss_scale" not in h or not h["loss_scale"].notna().any():
        return h
    loss = h["loss"].where(h["loss_scale"].isna(), h["loss"] / h["loss_scale"])
    return h.assign(loss=loss.where(skips == 0))


def _scaler_block(h: pd.DataFrame, skips: pd.Series) -> dict | None:
    """torch.amp.GradScaler's skipped optimizer steps (its overflows), by step: ``{step, ranks, skips}`` (a step
    holds every skipped iteration before its optimizer step), and its scale's range; None without a scaler."""
    if "loss_scale" not in h or not h["loss_scale"].notna().any():
        return None
    at = h[skips > 0]
    steps = [{"step": int(step), "ranks": sorted(int(r) for r in g["rank"]),
              "skips": int(skips[g.index].max())} for step, g in at.groupby("step", sort=True)]
    scale = h["loss_scale"].dropna()
    return {"skipped_steps": steps[:1000], "skipped_count": len(steps),
            "loss_scale_min": float(scale.min()), "loss_scale_max": float(scale.max())}


def _fingerprint_block(meta: pd.DataFrame | None, rgroups: list, compared: int) -> dict:
    rows = meta[meta["kind"].astype(str) == "numerics"]["value"] if meta is not None and len(meta) else []
    values = [v for v in rows if isinstance(v, dict)]
    intervals = [v["interval"] for v in values if v.get("interval")]
    reasons = sorted({v["reason"] for v in values if v.get("reason")})
    block = {"interval": max(intervals) if intervals else None,
             "cost_ns_max": max((v["cost_ns"] for v in values if v.get("cost_ns") is not None), default=None),
             "replica_groups": rgroups, "compared": compared}
    if not rgroups:
        block["reason"] = "no data-parallel replica group (DDP) in this run" + (f"; {reasons[0]}" if reasons else "")
    elif reasons:
        block["reason"] = reasons[0]
    return block


def of_run(run) -> dict:
    """``analyze_health`` of an open run (dtprof.rundir.run.Run): the DDP collectives are read only when some rank
    recorded a fingerprint."""
    h = run.health
    coll = None
    if len(h) and h["param_fp"].notna().any():
        ddp_groups = run.collective_groups_from("ddp")   # two columns read, never every collective
        coll = pd.DataFrame({"source": ["ddp"] * len(ddp_groups), "group": ddp_groups})
    return analyze_health(h, run.meta, coll, run.groups)
