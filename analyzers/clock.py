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

from dtprof.rundir.schema import P2P_OPS


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
    coll = ~co["op"].isin(list(P2P_OPS)).to_numpy() if len(co) else np.zeros(0, bool)
    blocking = coll & ~co["async_op"].to_numpy(bool) if len(co) else coll
    use = np.flatnonzero(blocking | (coll & co["end_ns"].notna().to_numpy()) if len(co) else coll)
    # every key as an integer code in its sorted order (no per-row strings: a long run has tens of millions of rows)
    hosts = pd.Index(sorted(set(host_of.astype(str))), dtype="str")
    by_rank = host_of.astype(str).groupby(level=0).first()     # rank -> host (the ranks table has one row per rank)
    rank = co["rank"].to_numpy(np.int64)[use]
    at = np.minimum(np.searchsorted(by_rank.index.to_numpy(np.int64), rank), max(len(by_rank) - 1, 0))
    known = (by_rank.index.to_numpy(np.int64)[at] == rank) if len(by_rank) else np.zeros(len(rank), bool)
    use = use[known]
    h_code = hosts.get_indexer(by_rank.to_numpy())[at[known]] if len(use) else np.zeros(0, np.int64)
    g = co["group"].iloc[use]
    g = g if isinstance(g.dtype, pd.CategoricalDtype) else g.astype("category")
    g_names = g.cat.categories.astype(str)
    groups = pd.Index(sorted(set(g_names)), dtype="str")
    g_code = groups.get_indexer(g_names)[g.cat.codes.to_numpy()] if len(use) else np.zeros(0, np.int64)
    seq = co["seq"].to_numpy(np.int64)[use]
    bl = blocking[use].astype(np.int64)
    exit_ns = co["exit_ns"].to_numpy(np.int64)[use]
    s0 = int(seq.min()) if len(seq) else 0
    n_seq = int(seq.max()) - s0 + 1 if len(seq) else 1
    if len(groups) * n_seq * len(hosts) * 2 < 2**62:   # one int64 key in (group, seq, host, blocking) order
        key = ((g_code * n_seq + (seq - s0)) * len(hosts) + h_code) * 2 + bl
        codes, uniq = pd.factorize(key)   # hashed, then only the distinct keys sorted
        rank_of = np.empty(len(uniq), np.int64)
        rank_of[np.argsort(uniq)] = np.arange(len(uniq))
        inv = rank_of[codes]
        first = np.zeros(len(uniq), np.int64)
        first[inv] = np.arange(len(inv))   # a row of each key, to read its parts back
    else:
        order = np.lexsort((bl, h_code, seq, g_code))
        cols = np.stack([g_code[order], seq[order], h_code[order], bl[order]])
        new = np.r_[True, (cols[:, 1:] != cols[:, :-1]).any(axis=0)] if len(order) else np.zeros(0, bool)
        inv = np.empty(len(order), np.int64)
        inv[order] = np.cumsum(new) - 1
        first = order[new]
    n_keys = len(first)
    lo = np.full(n_keys, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(lo, inv, exit_ns)
    dsum = np.zeros(n_keys, np.int64)
    np.add.at(dsum, inv, exit_ns - lo[inv])
    # (no rows: an empty text column, as pandas makes one from no values)
    out = pd.DataFrame({"group": pd.array(groups, dtype="str").take(g_code[first]) if n_keys else
                        np.zeros(0, object), "seq": seq[first],
                        "host": pd.array(hosts, dtype="str").take(h_code[first]), "blocking": bl[first],
                        "n": np.bincount(inv, minlength=n_keys).astype(np.int64), "exit_min_ns": lo,
                        "exit_dsum_ns": dsum})
    return out[list(EXIT_SUM_COLUMNS)]


def fit_clocks(ranks: pd.DataFrame, sums) -> pd.DataFrame:
    """Per host: host, offset_ns, drift_ppm, residual_ns, n_pairs, ref_t_ns, reference (bool), reason.
    ``ranks``: the ranks table; ``sums``: ``exit_sums`` of the run's collectives as rundir.rows.Rows (its nodes'
    rows, or the whole run's), merged per (instance, host) and fitted in DuckDB: the mean exit per (instance, host),
    rounded to the ns, is all the fit reads. Its sums are exact integers, so the fit does not depend on the order
    the rows come in (nodes, threads)."""
    from dtprof.rundir.rows import sql_text

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
    if len(hosts) == 1:
        return pd.DataFrame(list(rows.values()))
    with sums.connection(hosts=pd.DataFrame({"host": hosts})) as con:
        # the blocking rows when the run has any (else asynchronous rows whose end was seen) of known hosts; the
        # mean exit per (instance, host) rounded to the ns (half up), in exact integers: merged over the nodes
        # that report the same host (two launchers on one host), else straight from each row
        # one scan for both: whether any row is blocking, and how many hosts more than one node reports
        blocking, shared = con.execute(
            "SELECT coalesce(bool_or(b), false), count(*) FILTER (WHERE several) FROM (SELECT host, "
            "bool_or(blocking = 1) AS b, min(origin) <> max(origin) AS several FROM rows GROUP BY host)").fetchall()[0]
        blocking = int(blocking)
        use = f"FROM rows WHERE blocking = {blocking} AND host IN (SELECT host FROM hosts)"
        m = (f"""(SELECT "group", seq, host, lo + (2 * d + n) // (2 * n) AS e FROM (
                     SELECT "group", seq, host, min(exit_min_ns) AS lo, sum(n) AS n,
                            CAST(sum(exit_dsum_ns) + sum(CAST(n AS HUGEINT) * exit_min_ns)
                                 - sum(n) * min(exit_min_ns) AS BIGINT) AS d
                     {use} GROUP BY ALL))""" if shared else
             f"""(SELECT "group", seq, host, exit_min_ns + (2 * exit_dsum_ns + n) // (2 * n) AS e {use})""")
        quoted = sql_text(ref)
        # paired with the reference host's of the same instance: x = exit - the reference's first mean exit,
        # y = the reference's exit - exit
        con.execute(f'CREATE TEMP TABLE r AS SELECT "group", seq, e AS e_ref FROM {m} WHERE host = {quoted}')
        r0 = con.execute("SELECT min(e_ref) FROM r").fetchall()[0][0]
        fit = []
        if r0 is not None:
            con.execute(f'CREATE TEMP TABLE o AS SELECT host, e - {r0} AS x, e_ref - e AS y '
                        f'FROM {m} JOIN r USING ("group", seq) WHERE host <> {quoted}')
            stats = con.execute("SELECT host, count(*), sum(CAST(x AS HUGEINT)), sum(CAST(y AS HUGEINT)), "
                                "sum(CAST(x AS HUGEINT) * x), sum(CAST(x AS HUGEINT) * y) FROM o "
                                "GROUP BY host ORDER BY host").fetchall()
            for h, n, sx, sy, sxx, sxy in stats:   # one per host: least squares of y on x from exact sums
                den = n * sxx - sx * sx
                slope = (n * sxy - sx * sy) / den if den > 0 else 0.0
                fit.append((h, slope, sy / n - slope * (sx / n), n))
        fits = pd.DataFrame(fit, columns=["host", "slope", "offset", "n"])
        con.register("fits", fits)
        res = dict(con.execute("SELECT host, max(abs(CAST(y AS DOUBLE) - (f.offset + f.slope * CAST(x AS DOUBLE)))) "
                               "FROM o JOIN fits AS f USING (host) GROUP BY host").fetchall()) if fit else {}
    ref_t = int(r0) if fit else 0
    for h, slope, offset, n in fit:
        rows[h].update(offset_ns=float(offset), drift_ppm=float(slope * 1e6), residual_ns=float(res[h]),
                       n_pairs=int(n))
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
