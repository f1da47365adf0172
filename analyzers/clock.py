"""Clock alignment across hosts (docs/metrics.md, "Clock alignment across hosts"). The run model
(analyzers/runmodel.py) fits it once per run; every consumer aligns through the model.

Processes on one host share CLOCK_MONOTONIC; different hosts do not. The exit of a blocking collective is taken as
simultaneous on all its ranks, so for every collective instance ``(group, seq)`` seen on the reference host (the
host of rank 0) and on host h, ``y = exit_ref - exit_h`` samples h's offset. A least-squares line
``y = offset + drift * (t_h - ref_t_ns)`` per host gives the offset at ``ref_t_ns`` and the drift (reported in
ppm); ``residual_ns`` is the largest absolute residual of that fit, i.e. how far from simultaneous the exits still
are after alignment (an upper bound on the alignment error the data can vouch for).

To align, add ``offset_ns + drift_ppm * 1e-6 * (t - ref_t_ns)`` to a host's times (``align_times``).
Exits are the run model's ``exit_ns`` (analyzers/runmodel.py) of blocking collectives; if a run has none,
asynchronous ones whose completion was seen are used. Point-to-point ops are left out (their exits are not
simultaneous). The fit reads only the mean exit per (instance, host), which ``exit_sums`` reduces each node's rows
to (stored in its node summary, docs/scale.md); the whole run's rows go through the same reduction.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from dtprof.analyzers.collectives import instance_ids

P2P = ("send", "recv")


def _host_of_rank(r: pd.DataFrame) -> pd.Series:
    return pd.Series(r["host"].astype(str).to_numpy(), index=r["rank"].to_numpy(np.int64))


# per collective instance (group, seq) and host: the exits of its rows on that host reduced (``exit_sums``), which a
# node summary stores so the fit never reads every rank's row of every collective. ``blocking`` 1: blocking rows;
# 0: asynchronous rows whose end was seen (used only when a run has no blocking row). Exits are stored as the
# smallest and the integer sum of the others' distance from it, so sums never overflow and merge exactly.
EXIT_SUM_COLUMNS = ("group", "seq", "host", "blocking", "n", "exit_min_ns", "exit_dsum_ns")
_KEY = ["group", "seq", "host", "blocking"]


def exit_sums(ranks: pd.DataFrame, co: pd.DataFrame) -> pd.DataFrame:
    """EXIT_SUM_COLUMNS of the collectives rows ``co`` (with ``exit_ns``: the run model's), sorted by
    (group, seq, host, blocking). Point-to-point rows, asynchronous rows whose end was never seen and rows of ranks
    not in ``ranks`` are left out. Rank-local: a node's rows give that node's part of the whole run's."""
    host_of = _host_of_rank(ranks)
    coll = ~co["op"].isin(list(P2P)).to_numpy() if len(co) else np.zeros(0, bool)
    blocking = coll & ~co["async_op"].to_numpy(bool) if len(co) else coll
    use = blocking | (coll & co["end_ns"].notna().to_numpy()) if len(co) else coll
    rank = co["rank"].to_numpy(np.int64)[use]
    host = host_of.reindex(rank).to_numpy()
    known = pd.notna(host)
    c = co[use][known]
    df = pd.DataFrame({"group": c["group"].astype(str).to_numpy(), "seq": c["seq"].to_numpy(np.int64),
                       "host": host[known].astype(str), "blocking": blocking[use][known].astype(np.int64),
                       "exit": c["exit_ns"].to_numpy(np.int64)})
    g = df.groupby(_KEY, sort=True)["exit"]
    lo = g.transform("min").to_numpy(np.int64)
    out = df.assign(d=df["exit"].to_numpy(np.int64) - lo).groupby(_KEY, sort=True).agg(
        n=("exit", "size"), exit_min_ns=("exit", "min"), exit_dsum_ns=("d", "sum")).reset_index()
    return out[list(EXIT_SUM_COLUMNS)].astype({"seq": "int64", "blocking": "int64", "n": "int64",
                                                "exit_min_ns": "int64", "exit_dsum_ns": "int64"})


def merge_exit_sums(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """``exit_sums`` of several sets of rows (nodes) as one: the same (group, seq, host) reported by two nodes
    (two launchers on one host) merged exactly. Each host's rows come out in (group, seq) order like
    ``exit_sums``', which is all the order ``fit_clocks`` depends on."""
    s = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=list(EXIT_SUM_COLUMNS))
    if len(s) == 0:
        return s
    _, n_keys = instance_ids(*[pd.Categorical(s[c]).codes.astype(np.int64) if c in ("group", "host")
                               else s[c].to_numpy(np.int64) - int(s[c].min()) for c in _KEY])
    if n_keys == len(s):   # each host's rows from one node, in (group, seq) order: all the fit needs
        return s
    lo = s.groupby(_KEY, sort=False)["exit_min_ns"].transform("min").to_numpy(np.int64)
    d = s["exit_dsum_ns"].to_numpy(np.int64) + s["n"].to_numpy(np.int64) * (s["exit_min_ns"].to_numpy(np.int64) - lo)
    out = s.assign(exit_min_ns=lo, exit_dsum_ns=d).groupby(_KEY, sort=True).agg(
        n=("n", "sum"), exit_min_ns=("exit_min_ns", "first"), exit_dsum_ns=("exit_dsum_ns", "sum")).reset_index()
    return out[list(EXIT_SUM_COLUMNS)]


def fit_clocks(ranks: pd.DataFrame, sums: pd.DataFrame) -> pd.DataFrame:
    """Per host: host, offset_ns, drift_ppm, residual_ns, n_pairs, ref_t_ns, reference (bool), reason.
    ``ranks``: the ranks table; ``sums``: ``exit_sums`` of the run's collectives (``merge_exit_sums`` of its
    nodes'): the mean exit per (instance, host) is all the fit reads."""
    host_of = _host_of_rank(ranks)
    hosts = sorted(set(host_of.tolist()))
    rows = {h: {"host": h, "offset_ns": 0.0, "drift_ppm": 0.0, "residual_ns": 0.0, "n_pairs": 0, "ref_t_ns": 0,
                "reference": False, "reason": ""} for h in hosts}
    if not hosts:
        return pd.DataFrame(columns=["host", "offset_ns", "drift_ppm", "residual_ns", "n_pairs", "ref_t_ns",
                                     "reference", "reason"])
    ref = host_of.get(0, hosts[0])
    rows[ref]["reference"] = True
    rows[ref]["reason"] = "reference host (rank 0)"
    if len(hosts) == 1 or len(sums) == 0:
        return pd.DataFrame(list(rows.values()))
    blocking = sums["blocking"].to_numpy(np.int64) == 1
    s = sums[blocking] if blocking.any() else sums[~blocking]
    s = s[s["host"].isin(hosts).to_numpy()]
    # mean exit per (instance, host) as an offset from ``base`` (exact integers, then one division)
    n = s["n"].to_numpy(np.int64)
    lo = s["exit_min_ns"].to_numpy(np.int64)
    base = int(lo.min()) if len(lo) else 0
    mean = ((lo - base) + s["exit_dsum_ns"].to_numpy(np.int64) / n) if len(s) else np.zeros(0)
    m = pd.DataFrame({"group": np.asarray(s["group"], dtype=object), "seq": s["seq"].to_numpy(np.int64),
                      "host": np.asarray(s["host"], dtype=object), "exit": mean})
    is_ref = (m["host"] == ref).to_numpy()
    r = m[is_ref][["group", "seq", "exit"]].rename(columns={"exit": "exit_ref"})
    # pair every host's mean exit with the reference host's of the same instance
    o = m[~is_ref].merge(r, on=["group", "seq"], how="inner", sort=False)
    if len(o) == 0:
        for h in hosts:
            if h != ref:
                rows[h]["reason"] = "no collective shared with the reference host; not aligned"
        return pd.DataFrame(list(rows.values()))
    ref_rel = int(np.floor(r["exit_ref"].min()))
    ref_t = base + ref_rel
    o["x"] = o["exit"] - ref_rel
    o["y"] = o["exit_ref"] - o["exit"]
    g = o.groupby("host", sort=False)
    mx, my = g["x"].transform("mean"), g["y"].transform("mean")
    o["dx"], o["dy"] = o["x"] - mx, o["y"] - my
    o["dxx"], o["dxy"] = o["dx"] ** 2, o["dx"] * o["dy"]
    st = o.groupby("host", sort=False).agg(n=("x", "size"), mx=("x", "mean"), my=("y", "mean"),
                                           sxx=("dxx", "sum"), sxy=("dxy", "sum"))
    slope = np.where(st["sxx"] > 0, st["sxy"] / st["sxx"].where(st["sxx"] > 0, 1.0), 0.0)
    st["slope"] = slope
    st["offset"] = st["my"] - slope * st["mx"]
    o = o.merge(st[["slope", "offset"]], left_on="host", right_index=True)
    o["res"] = (o["y"] - (o["offset"] + o["slope"] * o["x"])).abs()
    res = o.groupby("host", sort=False)["res"].max()
    for h, row in st.iterrows():  # one iteration per host
        rows[h].update(offset_ns=float(row["offset"]), drift_ppm=float(row["slope"] * 1e6),
                       residual_ns=float(res[h]), n_pairs=int(row["n"]), ref_t_ns=ref_t)
    for h in hosts:
        if h != ref and rows[h]["n_pairs"] == 0:
            rows[h]["reason"] = "no collective shared with the reference host; not aligned"
        rows[h]["ref_t_ns"] = ref_t
    return pd.DataFrame(list(rows.values()))


def align_by_rank(run, t: np.ndarray, rank: np.ndarray, clock: pd.DataFrame) -> np.ndarray:
    """Times ``t`` (ns) of ranks ``rank`` moved onto the reference host's clock (vectorised through the rank)."""
    r = run.ranks
    if len(r) == 0 or len(t) == 0:
        return np.asarray(t, dtype=np.int64)
    n = int(r["rank"].max()) + 1
    host_per_rank = np.full(n, "", dtype=object)
    host_per_rank[r["rank"].to_numpy(np.int64)] = r["host"].astype(str).to_numpy()
    idx = pd.Index(clock["host"]).get_indexer(host_per_rank) if len(clock) else np.full(n, -1)
    off = np.where(idx >= 0, clock["offset_ns"].to_numpy(float)[np.maximum(idx, 0)] if len(clock) else 0.0, 0.0)
    drift = np.where(idx >= 0, clock["drift_ppm"].to_numpy(float)[np.maximum(idx, 0)] if len(clock) else 0.0, 0.0)
    ref_t = int(clock["ref_t_ns"].iloc[0]) if len(clock) else 0
    t = np.asarray(t, dtype=np.int64)
    rank = np.asarray(rank, dtype=np.int64)
    return t + np.rint(off[rank] + drift[rank] * 1e-6 * (t - ref_t).astype(float)).astype(np.int64)


def alignment(host: np.ndarray | pd.Categorical, clock: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(offset_ns, drift as a fraction) of each of the hosts ``host`` (host names; 0 for a host without a fit):
    a time ``t`` of that host is ``t + offset + drift * (t - ref_t(clock))`` on the reference host's clock."""
    if len(clock) == 0:
        return np.zeros(len(host)), np.zeros(len(host))
    h = host if isinstance(host, pd.Categorical) else pd.Categorical(np.asarray(host, dtype=object))
    # one look-up per distinct host, not per time (millions of times, a few thousand hosts)
    idx = np.where(h.codes >= 0, pd.Index(clock["host"]).get_indexer(h.categories)[np.maximum(h.codes, 0)], -1)
    known = idx >= 0
    off = np.where(known, clock["offset_ns"].to_numpy(float)[np.maximum(idx, 0)], 0.0)
    drift = np.where(known, clock["drift_ppm"].to_numpy(float)[np.maximum(idx, 0)], 0.0) * 1e-6
    return off, drift


def ref_t(clock: pd.DataFrame) -> int:
    return int(clock["ref_t_ns"].to_numpy(np.int64)[0]) if len(clock) else 0


def align_times(t: np.ndarray, host: np.ndarray | pd.Categorical, clock: pd.DataFrame) -> np.ndarray:
    """Times ``t`` (ns) of hosts ``host`` (array of host names) moved onto the reference host's clock."""
    t = np.asarray(t, dtype=np.int64)
    if len(clock) == 0 or len(t) == 0:
        return t
    off, drift = alignment(host, clock)
    return t + np.rint(off + drift * (t - ref_t(clock)).astype(float)).astype(np.int64)
