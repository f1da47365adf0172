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
simultaneous).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from dtprof.analyzers.collectives import instance_ids, instance_keys

P2P = ("send", "recv")


def _host_of_rank(r: pd.DataFrame) -> pd.Series:
    return pd.Series(r["host"].astype(str).to_numpy(), index=r["rank"].to_numpy(np.int64))


def fit_clocks(ranks: pd.DataFrame, co: pd.DataFrame) -> pd.DataFrame:
    """Per host: host, offset_ns, drift_ppm, residual_ns, n_pairs, ref_t_ns, reference (bool), reason.
    ``ranks``: the ranks table; ``co``: the run model's collectives (with ``exit_ns``)."""
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
    if len(hosts) == 1 or len(co) == 0:
        return pd.DataFrame(list(rows.values()))
    coll = ~co["op"].isin(list(P2P)).to_numpy()
    blocking = coll & ~co["async_op"].to_numpy(bool)
    use = blocking if blocking.any() else coll & co["end_ns"].notna().to_numpy()
    c = co[use]
    exit_ns = c["exit_ns"].to_numpy(np.int64)
    n_rank = int(ranks["rank"].max()) + 1
    host_code_of_rank = np.full(n_rank, -1, np.int64)
    host_code_of_rank[ranks["rank"].to_numpy(np.int64)] = pd.Categorical(
        host_of.to_numpy(), categories=hosts).codes
    rank = c["rank"].to_numpy(np.int64)
    hcode = host_code_of_rank[np.clip(rank, 0, n_rank - 1)]
    ok = (rank < n_rank) & (hcode >= 0)
    inst, _ = instance_keys(c)
    inst, hcode, exit_ns = inst[ok], hcode[ok], exit_ns[ok]
    # mean exit per (instance, host), then pair every host's with the reference host's of the same instance
    pair, n_pair = instance_ids(inst, hcode)
    cnt = np.bincount(pair, minlength=n_pair)
    base = int(exit_ns.min()) if len(exit_ns) else 0
    mean_exit = np.bincount(pair, weights=(exit_ns - base).astype(float), minlength=n_pair) / np.maximum(cnt, 1)
    p_inst = np.zeros(n_pair, np.int64)
    p_inst[pair] = inst
    p_host = np.zeros(n_pair, np.int64)
    p_host[pair] = hcode
    ref_code = hosts.index(ref)
    ref_exit = np.full(int(inst.max()) + 1 if len(inst) else 0, np.nan)
    is_ref = p_host == ref_code
    ref_exit[p_inst[is_ref]] = mean_exit[is_ref]
    y_ref = ref_exit[p_inst] if len(ref_exit) else np.zeros(n_pair)
    keep = ~is_ref & ~np.isnan(y_ref)
    o = pd.DataFrame({"host": np.asarray(hosts, dtype=object)[p_host[keep]], "exit": mean_exit[keep] + base,
                      "exit_ref": y_ref[keep] + base})
    r = pd.DataFrame({"exit_ref": mean_exit[is_ref] + base})
    if len(o) == 0:
        for h in hosts:
            if h != ref:
                rows[h]["reason"] = "no collective shared with the reference host; not aligned"
        return pd.DataFrame(list(rows.values()))
    ref_t = int(r["exit_ref"].min())
    o["x"] = o["exit"] - ref_t
    o["y"] = o["exit_ref"] - o["exit"]
    g = o.groupby("host", sort=False)
    mx, my = g["x"].transform("mean"), g["y"].transform("mean")
    o["dx"], o["dy"] = o["x"] - mx, o["y"] - my
    o["dxx"], o["dxy"] = o["dx"] ** 2, o["dx"] * o["dy"]
    s = o.groupby("host", sort=False).agg(n=("x", "size"), mx=("x", "mean"), my=("y", "mean"),
                                          sxx=("dxx", "sum"), sxy=("dxy", "sum"))
    slope = np.where(s["sxx"] > 0, s["sxy"] / s["sxx"].where(s["sxx"] > 0, 1.0), 0.0)
    s["slope"] = slope
    s["offset"] = s["my"] - slope * s["mx"]
    o = o.merge(s[["slope", "offset"]], left_on="host", right_index=True)
    o["res"] = (o["y"] - (o["offset"] + o["slope"] * o["x"])).abs()
    res = o.groupby("host", sort=False)["res"].max()
    for h, row in s.iterrows():  # one iteration per host
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


def align_times(t: np.ndarray, host: np.ndarray, clock: pd.DataFrame) -> np.ndarray:
    """Times ``t`` (ns) of hosts ``host`` (array of host names) moved onto the reference host's clock."""
    t = np.asarray(t, dtype=np.int64)
    if len(clock) == 0 or len(t) == 0:
        return t
    idx = pd.Index(clock["host"]).get_indexer(np.asarray(host, dtype=object))
    known = idx >= 0
    off = np.where(known, clock["offset_ns"].to_numpy(float)[np.maximum(idx, 0)], 0.0)
    drift = np.where(known, clock["drift_ppm"].to_numpy(float)[np.maximum(idx, 0)], 0.0) * 1e-6
    ref_t = clock["ref_t_ns"].to_numpy(np.int64)[0] if len(clock) else 0
    return t + np.rint(off + drift * (t - ref_t).astype(float)).astype(np.int64)
