"""Collective bandwidth per op, group and message size (docs/metrics.md, "Collective bandwidth", nccl-tests).

Per instance ``(group, seq)`` of a collective: S = max(in_bytes, out_bytes) (largest over its ranks); the transfer
time is the shortest duration of the instance across its ranks (duration = the run model's ``exit_ns`` minus
``issue_ns``), since longer ones include waiting for late peers. algbw = S / transfer time (GB/s = 1e9 bytes/s),
busbw = algbw × factor(op, n) with n the group size:
all_reduce 2(n-1)/n; reduce_scatter, all_gather, all_to_all (n-1)/n; broadcast, reduce, send, recv 1.

Aggregated per (op, group, size bucket): count of instances, total_s (Σ of the instances' mean duration over
ranks: what one rank spent in them), transfer_s (Σ transfer times), algbw/busbw = Σ S / Σ transfer time, the
fraction of the link's peak where the link is known, and share_of_comm = total_s / Σ total_s.
Size buckets are powers of 4 bytes, labelled "1-4 MiB". Point-to-point ops are matched per (group, seq) like the
rest: the sender's and receiver's rows then form the instance, as the run format numbers them per pair.

Where each instance happened (``window``): ``"measured"`` when a row of it was issued inside a measured step of
its rank, ``"excluded"`` inside a step kept out of the statistics (warm-up, traced or FLOP-counted: the run
model's ``measured`` flag), ``"outside"`` outside every step (set-up before the first forward,
checkpointing or evaluation after the last optimizer step). The summary's collective table covers the measured
steps; the traffic outside every step gets its own table (``collectives_outside_steps``).

Link peaks (``LINK_PEAK_GBPS``, unidirectional per GPU, the figure busbw approaches in nccl-tests) are known only
for single-host groups of two or more ranks on the devices listed; everything else (CPU/gloo, inter-host, unknown
GPU, a group of one rank, whose busbw is 0 by the factor) gets null with a reason.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from dtprof.analyzers.intervals import assign_to_windows

NS = 1e9

BUS_FACTOR = {  # function of n (group size)
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0 + 0 * n,
    "reduce": lambda n: 1.0 + 0 * n,
    "send": lambda n: 1.0 + 0 * n,
    "recv": lambda n: 1.0 + 0 * n,
}

# NVLink per-GPU unidirectional bandwidth, GB/s (substring of the device name as NVML/torch report it).
LINK_PEAK_GBPS = (
    ("H100 PCIe", 64.0),     # PCIe Gen5 x16 (no NVLink bridge assumed)
    ("H100", 450.0),         # NVLink 4, 18 links
    ("H200", 450.0),
    ("B200", 900.0),         # NVLink 5
    ("A100-PCIE", 32.0),     # PCIe Gen4 x16
    ("A100 PCIe", 32.0),
    ("A100", 300.0),         # NVLink 3, 12 links
    ("V100", 150.0),         # NVLink 2, 6 links
)

COLUMNS = ["op", "group", "size_bucket", "count", "total_s", "transfer_s", "bytes", "algbw_gbps", "busbw_gbps",
           "link_peak_gbps", "link_peak_frac", "link_peak_reason", "share_of_comm", "group_size", "bucket_lo_bytes"]

_UNITS = [(2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B")]


def size_bucket_label(lo: int) -> str:
    """Label of the power-of-4 bucket starting at ``lo`` bytes: "1-4 MiB", "256 KiB-1 MiB", "0-4 B"."""
    hi = max(lo * 4, 4)
    def part(b):
        for u, name in _UNITS:
            if b >= u:
                return b // u, name
        return 0, "B"
    (a, ua), (b, ub) = part(lo), part(hi)
    if lo == 0:
        ua = ub
    return f"{a}-{b} {ub}" if ua == ub else f"{a} {ua}-{b} {ub}"


def bucket_lo(size: np.ndarray) -> np.ndarray:
    s = np.maximum(np.asarray(size, dtype=np.int64), 1)
    k = np.floor(np.log2(s) / 2).astype(np.int64)
    lo = (4 ** k).astype(np.int64)
    return np.where(np.asarray(size) < 4, 0, lo)


def link_peak(device_names: list[str], hosts_in_group: int) -> tuple[float | None, str]:
    if hosts_in_group > 1:
        return None, "group spans hosts; inter-host link speed unknown"
    names = set(device_names)
    if len(names) != 1:
        return None, "mixed or unknown devices in the group"
    name = names.pop()
    for key, gbps in LINK_PEAK_GBPS:
        if key.lower() in name.lower():
            return gbps, f"{key} link peak {gbps:g} GB/s"
    return None, f"no link peak known for device {name!r}"


def group_link_peak(run, group: str) -> tuple[float | None, str]:
    """(link peak GB/s or None, why) of the process group ``group`` of the run model ``run``: from the devices and
    hosts of the group's ranks (the groups table, else all ranks)."""
    ranks = run.ranks
    dev = pd.Series(ranks["device_name"].astype(str).to_numpy(), index=ranks["rank"].to_numpy(np.int64))
    host = pd.Series(ranks["host"].astype(str).to_numpy(), index=ranks["rank"].to_numpy(np.int64))
    gr = run.groups[run.groups["group"].astype(str) == str(group)] if len(run.groups) else run.groups
    m = [int(x) for x in str(gr["ranks"].iloc[0]).split(",") if x.strip().lstrip("-").isdigit()] if len(gr) else []
    m = m or list(dev.index)
    if len(m) == 1:   # moves nothing over a link (busbw's factor is 0): no peak to hold it, or a what-if, against
        return None, "one rank: nothing crosses a link"
    return link_peak(dev.reindex(m).dropna().tolist(), host.reindex(m).dropna().nunique())


def instance_ids(*keys: np.ndarray) -> tuple[np.ndarray, int]:
    """Dense ids 0..n-1 of the distinct tuples of non-negative int arrays ``keys`` (one id per instance)."""
    if len(keys[0]) == 0:
        return np.zeros(0, np.int64), 0
    combined = np.zeros(len(keys[0]), np.int64)
    room = 1
    for k in keys:
        k = np.asarray(k, np.int64)
        size = int(k.max()) + 1
        if room * size >= 2**62:  # would overflow: let pandas group the tuples
            ids = pd.DataFrame({f"k{i}": np.asarray(x, np.int64) for i, x in enumerate(keys)}).groupby(
                list(f"k{i}" for i in range(len(keys))), sort=True).ngroup().to_numpy(np.int64)
            return ids, int(ids.max()) + 1
        combined = combined * size + k
        room *= size
    uniq, inv = np.unique(combined, return_inverse=True)
    return inv.astype(np.int64), len(uniq)


def instance_keys(c: pd.DataFrame) -> tuple[np.ndarray, int]:
    """Instance id of each collectives row: (group, seq) for collectives, (group, sender, receiver, seq) for p2p."""
    gcode = c["group"].astype("category").cat.codes.to_numpy(np.int64)
    seq = c["seq"].to_numpy(np.int64)
    rank = c["rank"].to_numpy(np.int64)
    peer = c["peer"].astype("Int64").fillna(-1).to_numpy(np.int64)
    op = c["op"]
    is_send = op.isin(["send"]).to_numpy()
    is_recv = op.isin(["recv"]).to_numpy()
    sender = np.where(is_send, rank, np.where(is_recv, peer, -1)) + 1
    receiver = np.where(is_send, peer, np.where(is_recv, rank, -1)) + 1
    if not (is_send | is_recv).any():
        return instance_ids(gcode, seq - seq.min() if len(seq) else seq)
    return instance_ids(gcode, np.maximum(sender, 0), np.maximum(receiver, 0), seq - seq.min())


WINDOWS = ("measured", "excluded", "outside")


def window_step(rank: np.ndarray, t: np.ndarray, steps: pd.DataFrame) -> np.ndarray:
    """The step of the window ``[start_ns, end_ns)`` of its own rank that holds host time ``t`` on ``rank``, -1 for
    none. ``steps``: rank-steps (rank, step, start_ns, end_ns). Whether that step is measured is the global
    analysis' choice (warm-up), made in ``instances_of``."""
    idx = assign_to_windows(steps["rank"].to_numpy(np.int64), steps["start_ns"].to_numpy(np.int64),
                            steps["end_ns"].to_numpy(np.int64), np.asarray(rank, np.int64), np.asarray(t, np.int64))
    return np.where(idx >= 0, steps["step"].to_numpy(np.int64)[np.maximum(idx, 0)], -1) if len(steps) else idx


def own_records(co: pd.DataFrame) -> pd.DataFrame:
    """The collectives that are the job's instances: the ranks' own records, over rows a captured torch.profiler
    trace adds for the same calls (source "kineto", numbered apart); a run with only trace rows keeps those."""
    kineto = co["source"].isin(["kineto"]).to_numpy()
    return co[~kineto] if (~kineto).any() else co


# the per-instance reduction of some ranks' collectives rows (``instance_rows``): what a node summary stores, so the
# global analysis merges nodes' rows per instance instead of reading every rank's row of every collective
INSTANCE_ROW_COLUMNS = ("group", "sender", "receiver", "seq", "wstep", "op", "n", "dur_min_ns", "dur_sum_ns",
                        "bytes_max", "group_size_max")


def instance_rows(model) -> pd.DataFrame:
    """The run model's own collective records reduced per instance (group, sender, receiver, seq; sender and
    receiver -1 but for point-to-point) and ``wstep``, the step of the rank's window its issue falls in (-1: none):
    the first row's op, the count of rows, the shortest and summed durations (``exit_ns - issue_ns``), the largest
    message and group size. Rank-local: the rows of a node reduce to that node's part of the whole run's."""
    co = model.collectives
    if len(co) == 0:
        return pd.DataFrame({c: pd.Series(dtype=object if c in ("group", "op") else "int64")
                             for c in INSTANCE_ROW_COLUMNS})
    c = own_records(co)
    rank = c["rank"].to_numpy(np.int64)
    peer = c["peer"].astype("Int64").fillna(-1).to_numpy(np.int64)
    op = c["op"].astype(str).to_numpy()
    sender = np.where(op == "send", rank, np.where(op == "recv", peer, -1))
    receiver = np.where(op == "send", peer, np.where(op == "recv", rank, -1))
    wstep = window_step(rank, c["issue_ns"].to_numpy(np.int64), model.steps)
    group = c["group"].astype(str).to_numpy()
    key = ["group", "sender", "receiver", "seq"]
    df = pd.DataFrame({"group": group, "sender": sender, "receiver": receiver, "seq": c["seq"].to_numpy(np.int64)})
    # an instance's op is its first row's (in table order; ranks that disagree are triage's mismatch)
    first_op = pd.Series(op).groupby([df[k] for k in key], sort=False).transform("first").to_numpy()
    df = df.assign(wstep=wstep, op=first_op,
                   dur=c["exit_ns"].to_numpy(np.int64) - c["issue_ns"].to_numpy(np.int64),
                   nbytes=np.maximum(c["in_bytes"].to_numpy(np.int64), c["out_bytes"].to_numpy(np.int64)),
                   group_size=c["group_size"].to_numpy(np.int64))
    return _typed(df.groupby(key + ["wstep"], sort=True).agg(
        op=("op", "first"), n=("dur", "size"), dur_min_ns=("dur", "min"), dur_sum_ns=("dur", "sum"),
        bytes_max=("nbytes", "max"), group_size_max=("group_size", "max")).reset_index())


def _typed(df: pd.DataFrame) -> pd.DataFrame:
    return df[list(INSTANCE_ROW_COLUMNS)].astype({c: "int64" for c in INSTANCE_ROW_COLUMNS
                                                  if c not in ("group", "op")})


INSTANCE_KEY = '"group", sender, receiver, seq'   # the per-instance reduction's key (Rows.partition)


def instances_of(rows, measured_steps, keys: bool = False) -> pd.DataFrame:
    """One row per collective instance, from ``instance_rows`` of all nodes (rundir.rows.Rows, merged per instance
    in DuckDB): op (its first node's), group, seq, group_size, bytes, transfer_s, mean_s, ranks, ``window`` (see
    WINDOWS: the lowest over its rows, a row inside a measured step making it measured), sorted by (group, sender,
    receiver, seq). ``rows`` may be a partition by INSTANCE_KEY: then, given ``keys`` (with the sender and the
    receiver), ``merge_instances`` joins the partitions."""
    cols = ["op", "group", "seq", "group_size", "bytes", "transfer_s", "mean_s", "ranks", "window"]
    cols += ["sender", "receiver"] if keys else []
    agg = rows.query(f"""
        SELECT "group", sender, receiver, seq, arg_min(op, origin) AS op, CAST(sum(n) AS BIGINT) AS n,
               min(dur_min_ns) AS dur_min, CAST(sum(dur_sum_ns) AS BIGINT) AS dur_sum, max(bytes_max) AS nbytes,
               max(group_size_max) AS group_size,
               min(CASE WHEN wstep < 0 THEN {WINDOWS.index("outside")}
                        WHEN wstep IN (SELECT step FROM measured) THEN {WINDOWS.index("measured")}
                        ELSE {WINDOWS.index("excluded")} END) AS code
        FROM rows GROUP BY "group", sender, receiver, seq ORDER BY "group", sender, receiver, seq""",
                     measured=pd.DataFrame({"step": np.asarray(sorted(measured_steps), np.int64)}))
    if len(agg) == 0:
        return pd.DataFrame(columns=cols)
    n = agg["n"].to_numpy(np.int64)
    out = pd.DataFrame({
        "op": pd.Categorical(agg["op"].astype(str)), "group": pd.Categorical(agg["group"].astype(str)),
        "seq": agg["seq"].to_numpy(np.int64), "group_size": agg["group_size"].to_numpy(np.int64),
        "bytes": agg["nbytes"].to_numpy(np.int64), "transfer_s": agg["dur_min"].to_numpy(np.int64) / NS,
        "mean_s": agg["dur_sum"].to_numpy(np.int64) / n / NS, "ranks": n,
        "window": np.asarray(WINDOWS, dtype=object)[agg["code"].to_numpy(np.int64)]})
    if keys:
        out["sender"], out["receiver"] = agg["sender"].to_numpy(np.int64), agg["receiver"].to_numpy(np.int64)
    return out


def merge_instances(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """``instances_of`` all the rows from its partitions' (by INSTANCE_KEY, each made with ``keys``): the same
    frame, in (group, sender, receiver, seq) order with the text columns' categories as one frame's."""
    got = [f for f in frames if len(f)]
    if not got:
        return frames[0].drop(columns=["sender", "receiver"], errors="ignore")
    out = pd.concat(got, ignore_index=True)
    for c in ("op", "group"):
        out[c] = pd.Categorical(out[c].astype(str).to_numpy())
    order = np.lexsort((out["seq"].to_numpy(np.int64), out["receiver"].to_numpy(np.int64),
                        out["sender"].to_numpy(np.int64), out["group"].cat.codes.to_numpy()))
    return out.iloc[order].drop(columns=["sender", "receiver"]).reset_index(drop=True)


def collective_table(run, inst: pd.DataFrame) -> pd.DataFrame:
    """Per (op, group, size bucket) of the instances ``inst`` (``instances_of``): COLUMNS."""
    if len(inst) == 0:
        return pd.DataFrame(columns=COLUMNS)
    inst = inst.copy()
    inst["op"] = inst["op"].astype(str)
    inst["group"] = inst["group"].astype(str)
    inst["bucket_lo_bytes"] = bucket_lo(inst["bytes"].to_numpy())
    agg = inst.groupby(["op", "group", "bucket_lo_bytes"], sort=True).agg(
        count=("seq", "size"), total_s=("mean_s", "sum"), transfer_s=("transfer_s", "sum"), bytes=("bytes", "sum"),
        group_size=("group_size", "max")).reset_index()
    agg["size_bucket"] = [size_bucket_label(int(b)) for b in agg["bucket_lo_bytes"]]
    tr = agg["transfer_s"].to_numpy(float)
    algbw = np.divide(agg["bytes"].to_numpy(float), tr, out=np.full(len(agg), np.nan), where=tr > 0) / 1e9
    n = agg["group_size"].to_numpy(float)
    factor = np.array([BUS_FACTOR[o](k) if o in BUS_FACTOR and k > 0 else np.nan
                       for o, k in zip(agg["op"], n)])  # one per table row (op × group × bucket), not per call
    agg["algbw_gbps"] = algbw
    agg["busbw_gbps"] = algbw * factor
    peaks, reasons = zip(*[group_link_peak(run, g) for g in agg["group"]]) if len(agg) else ((), ())
    agg["link_peak_gbps"] = pd.array(list(peaks), dtype="Float64")
    agg["link_peak_frac"] = agg["busbw_gbps"] / agg["link_peak_gbps"]
    agg["link_peak_reason"] = list(reasons)
    tot = agg["total_s"].sum()
    agg["share_of_comm"] = agg["total_s"] / tot if tot > 0 else np.nan
    return agg[COLUMNS]
