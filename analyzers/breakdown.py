"""Where each step went: a partition of every rank-step into parts that add up to the step (docs/metrics.md,
"Step breakdown").

Each rank's step window ``[start_ns, end_ns)`` is cut at every endpoint of its spans and collectives; each
elementary segment goes to exactly one part, the first that applies in this order:

0. ``gpu_wait`` -- on a GPU rank, the host is blocked (a ``comm_wait`` span) while its GPU still runs earlier work
   (a compute span timed on the device, source ``cuda_event``): waiting for the GPU, never communication;
1. ``exposed_comm`` -- the rank is blocked on communication (a ``comm_wait`` span), even inside a compute span;
2. ``forward`` (also ``pp_forward``), ``backward`` (also ``pp_backward``), ``optimizer`` -- compute: the innermost
   phase, the one whose span began last (intervals.innermost): Lightning runs forward and backward inside
   ``optimizer.step(closure)``, and they stay forward and backward; the optimizer's own time is the rest of its span
   (a forward recomputed inside backward records no forward span: it is backward time);
3. ``exposed_comm`` -- a collective is in flight (``issue_ns`` to its end) and no compute covers the instant;
4. ``data_wait`` -- a ``data_wait`` span (time in the DataLoader iterator's ``__next__``), except while a profiler
   trace capture runs (its stop and export are not waiting for input: ``other``);
5. ``bubble`` -- in a step that runs pipeline ops on this rank, the rest of the step: the stage idles (fill and
   drain, waiting for a slower neighbour, transfers, host gaps between microbatches), as the pipeline analyzer's
   measured bubble counts it;
6. ``other`` -- otherwise, nothing recorded (Python, launch gaps, untraced work).

On a pipeline rank (one with ``pp_forward``/``pp_backward`` spans) the time a point-to-point ``send``/``recv`` is in
flight in case 1 or 3 is ``bubble`` too: the stage waits for its neighbour (schedule fill and drain, stage
imbalance and the transfer itself; the pipeline section separates the schedule's own share). So the pipeline's
fill is never read as data wait: its ``recv`` outranks the ``data_wait`` span it sits in.

Exposed communication is judged by what it does to the step, not by who issued it: a collective issued outside
every forward, backward and optimizer span (an engine's gradient reduction after ``loss.backward()`` returns, as
DeepSpeed ZeRO's; its all-gather of updated partitions after the optimizer; a framework's logging collective
between steps) is ``exposed_comm`` wherever no compute hides it, like one issued inside backward. Where it was
issued is a split of the part (``issued``, one of ISSUED: inside forward, backward or the optimizer; after forward;
after backward; between steps, i.e. after the optimizer or before any compute), never a part of its own.

Where several collectives are in flight at once, the instant is split equally between them. Exposed
communication is also split by mesh dimension (the group's ``mesh_dim``, ``"(none)"`` outside a DeviceMesh), by
op and by where it was issued; a ``comm_wait`` with no collective in flight counts under op and issued
``"(no collective in flight)"``.

On a GPU rank communication is what the device did (analyzers/runmodel.py ``device_comm``): a one-rank group's
collective is not communication, a collective NCCL timed is in flight only for its device-side duration, and a
host wait with no communication in flight and the GPU idle (a first NCCL call setting up its communicator) is
``other``, not communication. A CPU rank keeps the host's view (its waits with nothing in flight are
``exposed_comm``).

``other`` is the window minus the other parts, so the parts of every rank-step sum to its duration exactly (up to
float rounding), and their means over a rank's measured steps sum to its mean step time. Spans and collectives are
cut at step boundaries (a piece of an interval counts in the step it falls in).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from dtprof.analyzers.intervals import coverage_segments, innermost, split_over_windows
from dtprof.analyzers.mesh import NO_DIM, mesh_dim_of
from dtprof.analyzers.steps import dense_codes
from dtprof.rundir.schema import BREAKDOWN_PARTS, P2P_OPS

NS = 1e9
PARTS = BREAKDOWN_PARTS   # declared with the run format: node summaries store them (dtprof/rundir/schema.py)
# a communication wait that outlasts every collective of its rank (e.g. DDP finishing its buckets after the last
# all-reduce returned)
UNKNOWN_OP = "(no collective in flight)"
PP_KINDS = ("pp_forward", "pp_backward")

# span sets; communication channels (dim, op) follow as sets N_SPAN_SETS, N_SPAN_SETS + 1, ...
COMM_WAIT, OPTIMIZER, BACKWARD, FORWARD, DATA_WAIT, PIPE_REGION, CAPTURE, DEVICE = range(8)
N_SPAN_SETS = 8
COMPUTE_SETS = (OPTIMIZER, BACKWARD, FORWARD)
SPAN_SET = {"comm_wait": COMM_WAIT, "optimizer": OPTIMIZER, "backward": BACKWARD, "pp_backward": BACKWARD,
            "forward": FORWARD, "pp_forward": FORWARD, "data_wait": DATA_WAIT}


@dataclass
class Breakdown:
    per_step: pd.DataFrame   # rank, step, one ``<part>_s`` column per PARTS (same row order as the windows)
    exposed: pd.DataFrame    # rank, step, dim, op, issued, exposed_s: exposed communication of a rank-step per channel
    pipeline_ranks: list[int]


def _codes(col: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """(integer code per row, the distinct values) of a column, categorical or not, without per-row strings."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        return col.cat.codes.to_numpy(np.int64), np.asarray(col.cat.categories.astype(str))
    codes, values = pd.factorize(col.astype(str))
    return codes.astype(np.int64), np.asarray(values)


# where each collective was issued (its rank's innermost compute phase at its issue, or the last one before it):
# a split of exposed communication, never a part of its own
ISSUED = ("forward", "backward", "optimizer", "after forward", "after backward", "between steps")
NO_ISSUE = UNKNOWN_OP   # a communication wait with no collective in flight: issued by nothing recorded


def issued_phase(phases: tuple, co: pd.DataFrame) -> np.ndarray:
    """Per collective, the index in ISSUED of where it was issued: inside its rank's innermost compute phase
    (``phases``: intervals.innermost of the compute spans), else after the last phase that ended before it
    (forward, backward; after the optimizer, or before any compute: "between steps")."""
    p_rank, p_set, p_start, p_end = phases
    c_rank, c_issue = co["rank"].to_numpy(np.int64), co["issue_ns"].to_numpy(np.int64)
    inside, after = np.full(N_SPAN_SETS, 5, np.int64), np.full(N_SPAN_SETS, 5, np.int64)
    inside[[FORWARD, BACKWARD, OPTIMIZER]] = 0, 1, 2
    after[[FORWARD, BACKWARD, OPTIMIZER]] = 3, 4, 5
    out = np.full(len(co), 5, np.int64)
    if not len(p_rank) or not len(co):
        return out
    # phases are disjoint and sorted by (rank, start): the last one of the rank starting at or before the issue
    t0 = min(int(p_start.min()), int(c_issue.min()))
    span = max(int(p_end.max()), int(c_issue.max())) - t0 + 1
    i = np.searchsorted(p_rank * span + (p_start - t0), c_rank * span + (c_issue - t0), side="right") - 1
    j = np.maximum(i, 0)
    hit = (i >= 0) & (p_rank[j] == c_rank)
    in_phase = hit & (c_issue < p_end[j])
    return np.where(hit, np.where(in_phase, inside[p_set[j]], after[p_set[j]]), out)


CHANNEL_KINDS = ("exposed_comm", "bubble")   # the part a channel's exposed time goes to


def _channels(run, pipeline_ranks: list[int], issued: np.ndarray, co: pd.DataFrame) -> tuple[np.ndarray, pd.DataFrame]:
    """Each collective's channel code and the channels: dim (its group's mesh dimension), op, issued (where it was
    issued: ISSUED) and part (one of CHANNEL_KINDS: ``bubble`` for a p2p op on a pipeline rank, whose waits are the
    pipeline's bubble; else ``exposed_comm``). Vectorised on the columns' integer codes."""
    g_code, g_names = _codes(co["group"])
    o_code, o_names = _codes(co["op"])
    bubble = np.isin(co["rank"].to_numpy(np.int64), pipeline_ranks) & np.isin(o_names, P2P_OPS)[o_code]
    nk, ni = len(CHANNEL_KINDS), len(ISSUED)
    raw = ((g_code * len(o_names) + o_code) * ni + issued) * nk + bubble.astype(np.int64)
    uniq, inverse = np.unique(raw, return_inverse=True)
    u_part = np.asarray(CHANNEL_KINDS, dtype=object)[uniq % nk]
    u_issued = np.asarray(ISSUED, dtype=object)[(uniq // nk) % ni]
    rest = uniq // nk // ni
    u_op = o_names[rest % max(len(o_names), 1)] if len(uniq) else np.zeros(0, object)
    u_group = g_names[rest // max(len(o_names), 1)] if len(uniq) else np.zeros(0, object)
    dims = mesh_dim_of(run.groups, pd.Series(u_group, dtype=object)).to_numpy()
    # channels that differ only by group collapse onto one (dim, op, issued, part)
    chans = pd.DataFrame({"dim": dims, "op": u_op, "issued": u_issued, "part": u_part})
    code = chans.groupby(["dim", "op", "issued", "part"], sort=True).ngroup().to_numpy(np.int64)
    table = chans.assign(code=code).drop_duplicates("code").sort_values("code", ignore_index=True)
    return code[inverse.ravel()], table


def step_breakdown(run, windows: pd.DataFrame) -> Breakdown:
    """``run``: the run model (analyzers/runmodel.py); ``windows``: rank, step, start_ns, end_ns (one row per
    rank-step; the result keeps their order)."""
    n_win = len(windows)
    wr = windows["rank"].to_numpy(np.int64)
    ws = windows["start_ns"].to_numpy(np.int64)
    we = windows["end_ns"].to_numpy(np.int64)

    sp = run.spans
    k_code, k_names = _codes(sp["kind"])
    sp_set = np.array([SPAN_SET.get(k, -1) for k in k_names], np.int64)[k_code] if len(sp) else \
        np.zeros(0, np.int64)
    is_pp_span = np.isin(k_names, PP_KINDS)[k_code] if len(sp) else np.zeros(0, bool)
    pipeline_ranks = sorted(int(r) for r in np.unique(sp["rank"].to_numpy(np.int64)[is_pp_span]))

    co = run.collectives
    co = co[co["comm"].to_numpy(bool)]   # only communication (runmodel.device_comm)
    sp_rank, sp_start, sp_end = (sp[c].to_numpy(np.int64) for c in ("rank", "start_ns", "end_ns"))
    other_span = (sp_set >= 0) & ~np.isin(sp_set, COMPUTE_SETS)
    phases = innermost(*(a[np.isin(sp_set, COMPUTE_SETS)] for a in (sp_rank, sp_set, sp_start, sp_end)))
    # each collective's channel (dim, op, issued, part) is a set after the span sets
    chan_codes, chans = _channels(run, pipeline_ranks, issued_phase(phases, co), co)
    n_chan = len(chans)
    cap = run.captures
    device = np.isin(sp_set, COMPUTE_SETS) & (sp["source"].astype(str).to_numpy() == "cuda_event")
    key = np.concatenate([sp_rank[other_span], phases[0], sp_rank[device], co["rank"].to_numpy(np.int64),
                          cap["rank"].to_numpy(np.int64)])
    start = np.concatenate([sp_start[other_span], phases[2], sp_start[device], co["comm_start_ns"].to_numpy(np.int64),
                            cap["start_ns"].to_numpy(np.int64)])
    end = np.concatenate([sp_end[other_span], phases[3], sp_end[device], co["exit_ns"].to_numpy(np.int64),
                          cap["end_ns"].to_numpy(np.int64)])
    sset = np.concatenate([sp_set[other_span], phases[1], np.full(device.sum(), DEVICE), N_SPAN_SETS + chan_codes,
                           np.full(len(cap), CAPTURE)])
    item, win, s, e = split_over_windows(wr, ws, we, key, start, end)
    sset = sset[item]
    # a rank-step that runs pipeline ops: its whole window is pipeline time
    pipe_win = np.unique(split_over_windows(wr, ws, we, sp_rank[is_pp_span], sp_start[is_pp_span],
                                            sp_end[is_pp_span])[1])
    win = np.concatenate([win, pipe_win])
    sset = np.concatenate([sset, np.full(len(pipe_win), PIPE_REGION)])
    s = np.concatenate([s, ws[pipe_win]])
    e = np.concatenate([e, we[pipe_win]])

    n_sets = N_SPAN_SETS + n_chan
    g, seg, cov = coverage_segments(win, sset, s, e, n_sets)
    seg = seg.astype(np.float64)
    compute = cov[OPTIMIZER] | cov[BACKWARD] | cov[FORWARD]
    chan_cov = np.stack(cov[N_SPAN_SETS:]) if n_chan else np.zeros((0, len(seg)), bool)
    n_cover = chan_cov.sum(axis=0)
    waiting = cov[COMM_WAIT]
    gpu_wait = waiting & cov[DEVICE]   # case 0 of the module docstring
    # blocked on communication: on a GPU rank only while a collective communicates (none: the host's own time)
    cpu_win = ~np.isin(wr, run.gpu_ranks)
    blocked = waiting & ~cov[DEVICE] & ((n_cover > 0) | cpu_win[g])
    comm_time = blocked | (~compute & (n_cover > 0))   # case 1 or 3 of the module docstring

    def total(mask, weight=None):
        w = seg if weight is None else seg * weight
        return np.bincount(g[mask], weights=w[mask], minlength=n_win)

    parts = {
        "optimizer": total(~waiting & cov[OPTIMIZER]),   # compute sets never overlap (innermost phase only)
        "backward": total(~waiting & cov[BACKWARD]),
        "forward": total(~waiting & cov[FORWARD]),
        "gpu_wait": total(gpu_wait),
        "data_wait": total(~comm_time & ~compute & ~cov[CAPTURE] & cov[DATA_WAIT]),
        "exposed_comm": np.zeros(n_win), "bubble": np.zeros(n_win),
    }
    exposed_rows = []
    share = np.divide(1.0, n_cover, out=np.zeros(len(seg)), where=n_cover > 0)
    for i, ch in enumerate(chans.itertuples(index=False)):
        t = total(comm_time & chan_cov[i], share)
        parts[ch.part] += t
        if ch.part == "exposed_comm":
            exposed_rows.append((ch.dim, ch.op, ch.issued, t))
    parts["bubble"] += total(~comm_time & ~compute & ~cov[DATA_WAIT] & ~cov[CAPTURE] & cov[PIPE_REGION])
    orphan = total(blocked & (n_cover == 0))   # blocked, but no collective of this rank in flight (a CPU rank)
    parts["exposed_comm"] += orphan
    exposed_rows.append((NO_DIM, UNKNOWN_OP, NO_ISSUE, orphan))

    duration = (we - ws).astype(np.float64)
    known = sum(parts.values())
    parts["other"] = np.maximum(duration - known, 0.0)
    per_step = pd.DataFrame({"rank": wr, "step": windows["step"].to_numpy(np.int64)})
    for p in PARTS:
        per_step[f"{p}_s"] = parts[p] / NS
    exposed = [pd.DataFrame({"rank": wr, "step": per_step["step"].to_numpy(), "dim": d, "op": o, "issued": i,
                             "exposed_s": t / NS})
               for d, o, i, t in exposed_rows]
    exposed = pd.concat(exposed, ignore_index=True)
    exposed = exposed.groupby(["rank", "step", "dim", "op", "issued"], as_index=False, sort=False)["exposed_s"].sum()
    # rank-step order (channels in their sorted order within one): the same rows in the same order whether the
    # breakdown ran on one node or on the whole run, so sums over them agree to the last bit (nodesummary.combine)
    exposed = exposed[exposed["exposed_s"] > 0].sort_values(["rank", "step"], kind="stable", ignore_index=True)
    return Breakdown(per_step, exposed, pipeline_ranks)


def rank_means(bd: Breakdown, by_rank, duration_s) -> pd.DataFrame:
    """Per rank, mean over its measured steps: ``step_time_s_mean``, each part's ``<part>_s``, and the exposed
    communication per step by dimension, by op and by where it was issued as dicts (``exposed_by_dim``,
    ``exposed_by_op``, ``exposed_by_issued``). ``by_rank``:
    ``steps.ByRank`` of ``bd.per_step``'s ranks and its measured rows (a column at a time: a mask over the whole
    frame copies every column at once, 16.4 M rank-steps)."""
    ps = bd.per_step
    measured = by_rank.rows
    cols = [f"{p}_s" for p in PARTS]
    out = pd.DataFrame({c: by_rank.agg(v, "mean")
                        for c, v in [("step_time_s_mean", duration_s)] + [(c, ps[c]) for c in cols]})
    out.index.name = "rank"
    n_steps = by_rank.size()
    # the measured rows' exposed time summed per (rank, channel), grouped by a categorical key of their codes (in
    # the rows' order, as a group-by of (rank, channel) sums them; no masked copy of the 16.4 M-row table)
    ex = bd.exposed
    sel = np.flatnonzero(measured_rows(ps, measured, ex))
    ex_ranks, rank_code = dense_codes(ex["rank"].to_numpy(np.int64)[sel])
    value = pd.Series(ex["exposed_s"].to_numpy(float)[sel])
    for what, col in (("dim", "exposed_by_dim"), ("op", "exposed_by_op"), ("issued", "exposed_by_issued")):
        chan = ex[what].astype("category")
        names = chan.cat.categories
        key = rank_code * len(names) + chan.cat.codes.to_numpy(np.int64)[sel]
        tot = value.groupby(pd.Categorical.from_codes(key, categories=pd.RangeIndex(len(ex_ranks) * len(names))),
                            observed=True).sum()
        code = tot.index.astype(np.int64).to_numpy()
        ranks = ex_ranks[code // max(len(names), 1)]
        per: dict = {r: {} for r in out.index}
        for r, k, v, n in zip(ranks, names[code % max(len(names), 1)], tot.to_numpy(float),
                              n_steps.reindex(ranks).to_numpy()):   # one pass over the (rank, channel) sums
            per[r][str(k)] = float(v) / n
        out[col] = [per[r] for r in out.index]
    return out


def measured_rows(per_step: pd.DataFrame, measured: np.ndarray, rows: pd.DataFrame) -> np.ndarray:
    """Which rows of ``rows`` (rank, step) fall in a rank-step of ``per_step`` (one row per rank-step, sorted by
    them) that ``measured`` marks: a binary search per row, not a join."""
    key = per_step["rank"].to_numpy(np.int64) * (1 << 32) + per_step["step"].to_numpy(np.int64)
    rkey = rows["rank"].to_numpy(np.int64) * (1 << 32) + rows["step"].to_numpy(np.int64)
    if len(rkey) == len(key) and np.array_equal(rkey, key):   # a row per rank-step, in order: no search
        return measured.copy()
    at = np.minimum(np.searchsorted(key, rkey), max(len(key) - 1, 0))
    if not len(key):
        return np.zeros(len(rows), bool)
    return (key[at] == rkey) & measured[at]


def exposed_by_dim_rank_step(bd: Breakdown) -> pd.DataFrame:
    """rank, step, mesh_dim, exposed_s: exposed communication of each rank-step per mesh dimension."""
    e = bd.exposed.groupby(["rank", "step", "dim"], as_index=False)["exposed_s"].sum()
    return e.rename(columns={"dim": "mesh_dim"})


def critical_per_step(bd: Breakdown, measured: np.ndarray, duration_s: np.ndarray) -> pd.DataFrame:
    """The job's breakdown per measured step: for each step, the parts of its **critical rank**, the rank that
    waited least on its peers (the largest step duration minus ``exposed_comm`` and ``bubble``; ties to the lower
    rank). Its parts sum to its own step duration, and a rank slowed in one phase shows that phase growing there,
    not its peers' waiting. Columns: step, rank, ``<part>_s`` per PARTS, and ``exposed:<dim|op|issued>:<name>_s``
    for the critical rank's exposed communication by mesh dimension, op and place of issue (0 where it had none)."""
    ps = bd.per_step
    rows = np.flatnonzero(measured)   # the measured rows by position: a mask over the frame copies every column
    if not len(rows):
        return pd.DataFrame(columns=["step", "rank"] + [f"{p}_s" for p in PARTS])
    busy = (np.asarray(duration_s, float)[rows] - ps["exposed_comm_s"].to_numpy(float)[rows]
            - ps["bubble_s"].to_numpy(float)[rows])
    # per step the largest busy time, ties (and a step whose busy times are all NaN) to the lowest rank: one pass
    # with ufunc.at, not a sort of every measured rank-step
    steps, inv = dense_codes(ps["step"].to_numpy(np.int64)[rows])
    top = np.full(len(steps), -np.inf)
    np.fmax.at(top, inv, busy)
    cand = (busy == top[inv]) | (np.isnan(busy) & (top[inv] == -np.inf))
    rank = ps["rank"].to_numpy(np.int64)[rows]
    low = np.full(len(steps), np.iinfo(np.int64).max)
    np.minimum.at(low, inv[cand], rank[cand])
    pick = np.flatnonzero(cand & (rank == low[inv]))
    pick = pick[np.argsort(inv[pick], kind="stable")]
    crit = ps.iloc[rows[pick]][["step", "rank"] + [f"{p}_s" for p in PARTS]].reset_index(drop=True)
    ex = bd.exposed
    ckey = crit["rank"].to_numpy(np.int64) * (1 << 32) + crit["step"].to_numpy(np.int64)
    ex = ex[np.isin(ex["rank"].to_numpy(np.int64) * (1 << 32) + ex["step"].to_numpy(np.int64), ckey)]
    for what in ("dim", "op", "issued"):
        wide = ex.pivot_table(index="step", columns=what, values="exposed_s", aggfunc="sum", fill_value=0.0)
        for name in wide.columns:
            crit[f"exposed:{what}:{name}_s"] = wide[name].reindex(crit["step"]).fillna(0.0).to_numpy()
    return crit
