"""What-if: a cross-rank dependency model of every step, its replay, counterfactual scenarios and the critical path
(docs/what-if.md).

The model (``build``), per rank-step, from what the run recorded:

- the rank's timeline cut into **work** items (forward, backward, optimizer, data_wait, other, and ``exposed_comm``
  for blocked time no collective explains), **arrive** items (a collective issued: its ``issue_ns``) and **wait**
  items. The rank is *blocked* where the step breakdown counts communication as blocking (analyzers/breakdown.py,
  cases 1 and 3: a ``comm_wait`` span, or a collective in flight while no compute runs); a blocked stretch waits
  for each collective of the rank that completes inside it (one wait item per exit, for that instance), or, when
  none completes inside it, for a collective that exits within ``EXIT_TOLERANCE_NS`` after it. Waited time is not
  work: the replay recomputes it. A blocked stretch that waits for nothing (the rank went on while its collectives
  were still in flight, e.g. host gaps between a pipeline's ops) is fixed ``exposed_comm`` time;
- collectives are synchronisation points matched across ranks by instance (``collectives.instance_keys``: (group,
  seq), and (group, sender, receiver, seq) for point-to-point, so a pipeline's send/recv are its p2p edges): an
  instance completes on rank r at its last participant's arrival plus r's measured transfer (``lag``: r's release
  minus the measured last arrival, on the run model's aligned clock);
- each rank starts the step at its measured aligned offset from the step's earliest rank.

``replay`` recomputes every rank's step from the model with ``relax``, the one replay engine of dtprof (vectorised
fixed-point relaxation: each pass recomputes all times from the previous pass's instance completions; a dependency
chain of n links settles in n + 1 passes).
The job's step time is the slowest rank's step (analyzers/steps.py). Replaying the unmodified model reproduces the
measured steps up to the model's error (``replay_error``, reported per run).

Scenarios are pure edits of the work durations and transfers (``scenarios``); a scenario's saving is relative to
the unmodified replay, so the replay's own error cancels: predicted = measured × (scenario ÷ identity replay).

``critical_path``: per measured step, the chain of work and transfers that sets the slowest rank's end, walked back
through each binding wait to the instance's last arriver; its length by rank and by part.

``relax`` is also the engine of the pipeline's theoretical bubble (analyzers/pipeline.py ``replay_schedule``): that
definition replays a different model (compute ops only, each waiting for its upstream stage's op, nothing between
ops) on the same engine, so there is one replay and one place where its semantics live.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pandas as pd

from dtprof.analyzers import steps as steps_mod
from dtprof.analyzers import zero_bucket
from dtprof.analyzers.collectives import BUS_FACTOR, group_link_peak, instance_ids, own_records
from dtprof.analyzers.intervals import (
    _INT64_SAFE,
    _sorted_distinct,
    assign_to_windows,
    coverage_segments,
    innermost,
    split_over_windows,
)
from dtprof.rundir.schema import P2P_OPS, step_level

NS = 1e9
WORK_PARTS = ("forward", "backward", "optimizer", "data_wait", "other", "exposed_comm")
OWN_WORK_PARTS = WORK_PARTS[:-1]   # the rank's own work: no communication
FORWARD, BACKWARD, OPTIMIZER, DATA_WAIT, OTHER, EXPOSED = range(6)
COMPUTE_PARTS = (FORWARD, BACKWARD, OPTIMIZER)
WAIT, ARRIVE, WORKI = 0, 1, 2          # item kinds, in their order at equal times
# interval sets of the timeline
S_WIN, S_OPT, S_BWD, S_FWD, S_CWAIT, S_DATA, S_COLL, S_CAP, S_DEV = range(9)
SPAN_SETS = {"optimizer": S_OPT, "backward": S_BWD, "pp_backward": S_BWD, "forward": S_FWD, "pp_forward": S_FWD,
             "comm_wait": S_CWAIT, "data_wait": S_DATA}
# a blocked stretch with no exit inside waits for a collective only if one exits this close after it (a wait that
# returns just before the collector sees the end); otherwise the rank resumed with the collective still in flight:
# it was not waiting for it, and the stretch is fixed time. A stretch with an explicit wait (a comm_wait span) waits
# for the first collective in flight at its end whatever its recorded exit: the wait returned, so the collective had
# completed; its exit is recorded by a completion callback that, on a busy machine, runs milliseconds later (seen:
# DDP's all-reduce exit 1.2-1.5 ms after ddp_final_wait returned, which made 50 ms of waiting for a straggler fixed
# time and the straggler's removal save nothing on those ranks)
EXIT_TOLERANCE_NS = 200_000


@dataclass
class StepGraph:
    """The dependency model: windows (rank-steps) and their items, sorted by (window, time, kind)."""
    windows: pd.DataFrame      # rank, step, offset_ns (aligned start - the step's earliest), measured, pipeline
    win: np.ndarray            # per item: window row
    kind: np.ndarray           # WAIT / ARRIVE / WORKI
    part: np.ndarray           # WORK_PARTS index for work items, -1 otherwise
    dur: np.ndarray            # work duration (ns, int64); 0 for arrive/wait
    key: np.ndarray            # instance-in-step id for arrive/wait items, -1 for work
    lag: np.ndarray            # wait items: measured transfer after the last arrival (ns); 0 otherwise
    p2p: np.ndarray            # arrive/wait items of a point-to-point op
    n_keys: int
    stage: dict = field(default_factory=dict)   # pipeline rank -> its (lowest) stage
    # wait items: the instance's transfer at its group's link peak bus bandwidth (ns), -1 where no peak is known
    peak_lag: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    link_peaks: dict = field(default_factory=dict)     # group -> (link peak GB/s or None, why)

    @cached_property
    def latest_arrivals(self) -> _MaxBy:
        """The ARRIVE items' grouping by key for ``relax``: made once per model, every scenario replays it."""
        return _MaxBy(self.key[self.kind == ARRIVE], self.n_keys)


@dataclass
class Replay:
    end: np.ndarray            # per window: replayed end (ns from the step's earliest start)
    t: np.ndarray              # per item: time after it
    slack: np.ndarray          # per item: accumulated waiting up to it
    last_arrival: np.ndarray   # per key: latest arrival
    duration: np.ndarray       # per window: replayed step of the rank (ns)


def _cumsum_by(win: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Inclusive running sum of ``x`` within each run of equal ``win`` (items sorted by window)."""
    c = np.cumsum(x)
    first = np.r_[True, win[1:] != win[:-1]]
    base = np.maximum.accumulate(np.where(first, np.arange(len(x)), 0))
    return c - (c[base] - x[base])


def _cummax_by(win: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Running max of non-negative int64 ``x`` within each window (sorted by window)."""
    if len(x) == 0:
        return x
    span = int(x.max()) + 1
    w = win.astype(np.int64) - int(win.min())
    return np.maximum.accumulate(x + w * span) - w * span


class _MaxBy:
    """Per key, the max of values given per item: ``np.maximum.at`` by one sort made once and reused (the replay
    takes it in every pass)."""

    def __init__(self, key: np.ndarray, n_keys: int):
        self.order = np.argsort(key, kind="stable")
        sk = key[self.order]
        self.starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]]) if len(sk) else np.zeros(0, np.int64)
        self.keys = sk[self.starts]
        self.n = max(n_keys, 1)

    def __call__(self, x: np.ndarray, fill: int) -> np.ndarray:
        out = np.full(self.n, fill, np.int64)
        if len(self.starts):
            out[self.keys] = np.maximum.reduceat(x[self.order], self.starts)
        return out


ITEM_COLUMNS = ("rank", "step", "t", "kind", "part", "dur", "release")
# arrive and wait items: the collective they arrive at or wait for, named by its instance (collectives.instance_keys:
# group and seq, and sender and receiver for point-to-point, -1 otherwise) and what the link-peak scenario needs;
# work items: "" and -1. So the cross-rank part (``graph``) reads the items only, never the collectives table.
COLLECTIVE_COLUMNS = ("c_group", "c_seq", "c_sender", "c_receiver", "c_op", "c_bytes", "c_group_size")




@dataclass
class RankItems:
    """The rank-local part of the model (each rank's own spans and collectives; no other rank, no clock): what a
    node summary stores (analyzers/nodesummary.py) and ``graph`` joins across ranks."""
    items: pd.DataFrame        # ITEM_COLUMNS + COLLECTIVE_COLUMNS, sorted by (rank, step, t, kind)
    stage: dict                # pipeline rank -> its (lowest) stage
    pipeline_ranks: list


def build(model) -> StepGraph:
    """The dependency model of every rank-step of the run model ``model`` (analyzers/runmodel.py)."""
    return graph(model, rank_items(model))


def _window_time_keys(ws: np.ndarray, *pairs: tuple[np.ndarray, np.ndarray]) -> list[np.ndarray]:
    """One int64 key per (window, time), ordered as the pairs are, for each (window rows, times) given; ``ws``: the
    windows' starts. Window × absolute time overflows an int64 on long runs (1.6M rank-steps × a 9,400 s run >
    2^63; the searches on the wrapped keys missed the collective exits of whole ranks, so those ranks never waited
    and the straggler's removal saved nothing): the time is taken from its window's start, and where even windows ×
    that range would not fit (a very long step), replaced by its rank among the times given."""
    rel = [t - ws[w] for w, t in pairs]
    lo = min([0, *(int(r.min()) for r in rel if len(r))])
    span = max([0, *(int(r.max()) for r in rel if len(r))]) - lo + 1
    if len(ws) * span >= _INT64_SAFE:
        times = _sorted_distinct(np.concatenate(rel))
        return [w * len(times) + np.searchsorted(times, r) for (w, _), r in zip(pairs, rel)]
    return [w * span + (r - lo) for (w, _), r in zip(pairs, rel)]


def _blocked_items(b_win, b0, b1, b_explicit, c_win, c_issue, c_exit, ws) -> list[pd.DataFrame]:
    """The items of a rank's blocked stretches (window ``b_win``, from ``b0`` to ``b1``; ``b_explicit``: an explicit
    wait): a wait for each exit of its collectives inside, else for the nearest exit of a collective in flight at
    its end, and the blocked tail after the last exit as fixed work (part EXPOSED)."""
    items = []
    ok = c_win >= 0
    if len(b_win) and ok.any():
        ci_ok = np.flatnonzero(ok)
        order = ci_ok[np.lexsort((c_exit[ci_ok], c_win[ci_ok]))]
        ck, k0, k1 = _window_time_keys(ws, (c_win[order], c_exit[order]), (b_win, b0), (b_win, b1))
        lo = np.searchsorted(ck, k0, side="right")
        hi = np.searchsorted(ck, k1, side="right")
        n_in = hi - lo
        rep = np.repeat(np.arange(len(b_win)), n_in)
        pos = np.arange(len(rep)) - np.repeat(np.cumsum(n_in) - n_in, n_in) + np.repeat(lo, n_in)
        ci = order[pos]
        items.append(pd.DataFrame({"win": b_win[rep], "t": c_exit[ci], "kind": WAIT, "part": -1, "dur": 0,
                                   "ci": ci, "release": c_exit[ci]}))
        # the tail after the last exit inside: fixed blocked time
        last_exit = np.where(n_in > 0, c_exit[order[np.maximum(hi - 1, 0)]], b0)
        # no exit inside (or an explicit wait, which also waits after its last exit inside): the first exit after
        # the stretch of a collective in flight at its end
        nxt = np.minimum(hi, len(order) - 1)
        cand = order[nxt]
        has_next = (((n_in == 0) | b_explicit) & (hi < len(order)) & (c_win[cand] == b_win) & (c_issue[cand] < b1)
                    & ((c_exit[cand] - b1 <= EXIT_TOLERANCE_NS) | b_explicit))
        items.append(pd.DataFrame({"win": b_win[has_next], "t": b1[has_next], "kind": WAIT, "part": -1, "dur": 0,
                                   "ci": cand[has_next], "release": b1[has_next]}))
        tail_start = np.where(has_next, b1, last_exit)
        tail = b1 - tail_start
        keep = tail > 0
        items.append(pd.DataFrame({"win": b_win[keep], "t": tail_start[keep], "kind": WORKI, "part": EXPOSED,
                                   "dur": tail[keep], "ci": -1, "release": 0}))
    elif len(b_win):
        items.append(pd.DataFrame({"win": b_win, "t": b0, "kind": WORKI, "part": EXPOSED, "dur": b1 - b0,
                                   "ci": -1, "release": 0}))
    return items


def rank_items(model, windows: pd.DataFrame | None = None) -> RankItems:
    """Work, arrival and wait items of every rank-step of ``model`` (of the rows of ``windows``, a selection of its
    ``steps``, given them), from that rank's own records only."""
    w = model.steps if windows is None else windows
    wr = w["rank"].to_numpy(np.int64)
    ws = w["start_ns"].to_numpy(np.int64)
    we = w["end_ns"].to_numpy(np.int64)
    wstep = w["step"].to_numpy(np.int64)
    sp = model.spans
    kinds = sp["kind"].astype(str).to_numpy()
    is_pp = np.isin(kinds, ["pp_forward", "pp_backward"])
    pipe_ranks = sorted(int(r) for r in np.unique(sp["rank"].to_numpy(np.int64)[is_pp]))
    stage = {}
    if is_pp.any():
        st = sp.loc[is_pp, ["rank", "stage"]].dropna()
        stage = {int(r): int(s) for r, s in st.groupby("rank")["stage"].min().items()}

    co = own_records(model.collectives)
    co = co[co["comm"].to_numpy(bool)].reset_index(drop=True)   # only communication (runmodel.device_comm)
    c_rank = co["rank"].to_numpy(np.int64)
    c_issue = co["issue_ns"].to_numpy(np.int64)
    c_exit = co["exit_ns"].to_numpy(np.int64)
    c_win = assign_to_windows(wr, ws, we, c_rank, c_issue)

    # the timeline's elementary segments (the window itself is a set, so segments tile it)
    sp_set = np.array([SPAN_SETS.get(k, -1) for k in kinds], np.int64)
    # compute spans: the innermost phase only, as the step breakdown counts them (intervals.innermost)
    is_phase = np.isin(sp_set, (S_OPT, S_BWD, S_FWD))
    sp_rank, sp_start, sp_end = (sp[c].to_numpy(np.int64) for c in ("rank", "start_ns", "end_ns"))
    ph_rank, ph_set, ph_start, ph_end = innermost(sp_rank[is_phase], sp_set[is_phase], sp_start[is_phase],
                                                  sp_end[is_phase])
    other = (sp_set >= 0) & ~is_phase
    dev = is_phase & (sp["source"].astype(str).to_numpy() == "cuda_event")   # compute timed on the GPU
    cap = model.captures
    key = np.concatenate([wr, sp_rank[other], ph_rank, sp_rank[dev], c_rank, cap["rank"].to_numpy(np.int64)])
    start = np.concatenate([ws, sp_start[other], ph_start, sp_start[dev], co["comm_start_ns"].to_numpy(np.int64),
                            cap["start_ns"].to_numpy(np.int64)])
    end = np.concatenate([we, sp_end[other], ph_end, sp_end[dev], c_exit, cap["end_ns"].to_numpy(np.int64)])
    sset = np.concatenate([np.full(len(wr), S_WIN), sp_set[other], ph_set, np.full(dev.sum(), S_DEV),
                           np.full(len(co), S_COLL), np.full(len(cap), S_CAP)])
    item, win, s, e = split_over_windows(wr, ws, we, key, start, end)
    g, seg, cov = coverage_segments(win, sset[item], s, e, 9)
    cs = np.cumsum(seg)
    first = np.r_[True, g[1:] != g[:-1]] if len(g) else np.zeros(0, bool)
    first_idx = np.maximum.accumulate(np.where(first, np.arange(len(g)), 0)) if len(g) else first.astype(int)
    seg_start = ws[g] + cs - seg - (cs[first_idx] - seg[first_idx]) if len(g) else np.zeros(0, np.int64)
    compute = cov[S_OPT] | cov[S_BWD] | cov[S_FWD]
    # blocked on communication as the step breakdown counts it: a host wait while the GPU runs earlier work is that
    # work's time, and on a GPU rank a wait with no communication in flight is the host's own (breakdown.py)
    cpu_win = ~np.isin(wr, model.gpu_ranks)
    blocked = (cov[S_CWAIT] & ~cov[S_DEV] & (cov[S_COLL] | cpu_win[g])) | (cov[S_COLL] & ~compute)
    label = np.select([blocked, cov[S_OPT], cov[S_BWD], cov[S_FWD], cov[S_DATA] & ~cov[S_CAP]],
                      [-1, OPTIMIZER, BACKWARD, FORWARD, DATA_WAIT], OTHER)
    # runs of one label within a window, also cut where a collective is issued (its arrival keeps its place in the
    # work: a functional collective issued mid-forward arrives mid-forward in the replay too)
    new = np.r_[True, (g[1:] != g[:-1]) | (label[1:] != label[:-1])] if len(g) else np.zeros(0, bool)
    if len(g) and len(co):
        seg_key, issue_key = _window_time_keys(ws, (g, seg_start), (c_win[c_win >= 0], c_issue[c_win >= 0]))
        on_issue = np.isin(seg_key, issue_key)
        new |= on_issue
    run_id = np.cumsum(new) - 1
    r_win, r_start = g[new], seg_start[new]
    r_label = label[new]
    r_dur = np.bincount(run_id, weights=seg, minlength=len(r_win)).astype(np.int64) if len(g) else \
        np.zeros(0, np.int64)
    r_end = r_start + r_dur
    # runs with an explicit wait (a comm_wait span, e.g. DDP's final wait for its buckets)
    r_explicit = (np.bincount(run_id, weights=cov[S_CWAIT] * seg, minlength=len(r_win)) > 0) if len(g) else \
        np.zeros(0, bool)

    work = r_label >= 0
    items = [pd.DataFrame({"win": r_win[work], "t": r_start[work], "kind": WORKI, "part": r_label[work],
                           "dur": r_dur[work], "ci": -1, "release": 0})]
    ok = c_win >= 0
    items.append(pd.DataFrame({"win": c_win[ok], "t": c_issue[ok], "kind": ARRIVE, "part": -1, "dur": 0,
                               "ci": np.flatnonzero(ok), "release": 0}))
    # blocked stretches: a wait for each exit inside, else for the nearest exit of a collective in flight
    items += _blocked_items(r_win[~work], r_start[~work], r_end[~work], r_explicit[~work], c_win, c_issue, c_exit, ws)
    it = pd.concat(items, ignore_index=True).sort_values(["win", "t", "kind"], kind="stable", ignore_index=True)
    i_win = it["win"].to_numpy(np.int64)
    ci = it["ci"].to_numpy(np.int64)
    has_c = ci >= 0
    row = np.maximum(ci, 0)
    op = co["op"].astype(str).to_numpy()
    c_peer = co["peer"].astype("Int64").fillna(-1).to_numpy(np.int64)
    is_send, is_recv = op == "send", op == "recv"
    sender = np.where(is_send, c_rank, np.where(is_recv, c_peer, -1))
    receiver = np.where(is_send, c_peer, np.where(is_recv, c_rank, -1))
    nbytes = np.maximum(co["in_bytes"].to_numpy(np.int64), co["out_bytes"].to_numpy(np.int64))

    def of_row(x, none):
        return np.where(has_c, x[row], none) if len(co) else np.full(len(ci), none)

    def text_of_row(col: pd.Series):   # "" where none: its distinct values taken by code, no string per item
        cat = col.astype("category")
        names = pd.array([*cat.cat.categories.astype(str), ""], dtype="str")
        return names.take(of_row(cat.cat.codes.to_numpy(np.int64), len(names) - 1))

    it = it.assign(rank=wr[i_win], step=wstep[i_win], c_group=text_of_row(co["group"]),
                   c_seq=of_row(co["seq"].to_numpy(np.int64), -1), c_sender=of_row(sender, -1),
                   c_receiver=of_row(receiver, -1), c_op=text_of_row(co["op"]), c_bytes=of_row(nbytes, -1),
                   c_group_size=of_row(co["group_size"].to_numpy(np.int64), -1))
    return RankItems(items=it[list(ITEM_COLUMNS + COLLECTIVE_COLUMNS)], stage=stage, pipeline_ranks=pipe_ranks)


def graph(model, ri: RankItems, steps: np.ndarray | None = None) -> StepGraph:
    """The dependency model from the rank-local items ``ri`` (of one run, or concatenated from node summaries)
    and the run model's windows and clocks: the cross-rank part. ``steps``: only these steps' windows (the replay
    sample, ``replay_steps``; None: every rank-step). Steps are independent in the model (each starts every rank at
    its measured offset; instances are matched within a step), so a subset of them is modelled exactly as in the
    whole. The collectives table is not read: each arrival and wait names its instance (COLLECTIVE_COLUMNS)."""
    w = model.steps
    # the sampled steps' rows of the four columns read (not a mask over every column: 16.4 M rank-steps at 16,384
    # ranks), found by a table over the step numbers (not a hash per rank-step)
    rows = np.isin(w["step"].to_numpy(np.int64), steps, kind="table") if steps is not None else slice(None)
    wr = w["rank"].to_numpy(np.int64)[rows]
    wstep = w["step"].to_numpy(np.int64)[rows]
    astart = w["aligned_start_ns"].to_numpy(np.int64)[rows]
    base = pd.Series(astart).groupby(wstep).transform("min").to_numpy(np.int64)
    windows = pd.DataFrame({"rank": wr, "step": wstep, "offset_ns": astart - base,
                            "measured": w["measured"].to_numpy(bool)[rows],
                            "pipeline": np.isin(wr, ri.pipeline_ranks)})
    it = ri.items
    keep = np.isin(it["step"].to_numpy(np.int64), steps, kind="table") if steps is not None else None
    if keep is not None and not keep.all():   # (the node summaries' items are read for these steps only: no copy)
        it = it[keep]
    i_rank, i_step = it["rank"].to_numpy(np.int64), it["step"].to_numpy(np.int64)
    # windows are sorted by (rank, step) (steps.rank_steps): each item's window row by binary search
    i_win = np.searchsorted(wr * (1 << 32) + wstep, i_rank * (1 << 32) + i_step)
    kind = it["kind"].to_numpy(np.int64)
    has_c = kind != WORKI
    # instance-in-step keys: (group, sender, receiver, seq) of the collective, and the step of the item's window
    key_id = np.full(len(it), -1, np.int64)
    n_keys = 0
    gcode = pd.factorize(it["c_group"])[0].astype(np.int64)   # categorical from the summaries: by its codes
    if has_c.any():
        seq, cstep = it["c_seq"].to_numpy(np.int64)[has_c], i_step[has_c]
        key_id[has_c], n_keys = instance_ids(gcode[has_c], it["c_sender"].to_numpy(np.int64)[has_c] + 1,
                                             it["c_receiver"].to_numpy(np.int64)[has_c] + 1, seq - seq.min(),
                                             cstep - cstep.min())
    # each wait's measured transfer after the instance's last arrival (aligned clock)
    arrive = kind == ARRIVE
    t = it["t"].to_numpy(np.int64)
    last_al = _MaxBy(key_id[arrive], n_keys)(model.align(t[arrive], i_rank[arrive]), np.iinfo(np.int64).min)
    waiting = kind == WAIT
    rel_al = model.align(it["release"].to_numpy(np.int64)[waiting], i_rank[waiting])
    lag = np.zeros(len(it), np.int64)
    lw = last_al[key_id[waiting]]
    lag[waiting] = np.where(lw > np.iinfo(np.int64).min, np.maximum(rel_al - lw, 0), 0)
    p2p = it["c_op"].isin(P2P_OPS).to_numpy() & has_c
    peak_lag, link_peaks = _link_peak_lags(model, it, gcode, key_id, waiting, n_keys)
    return StepGraph(windows=windows, win=i_win, kind=kind, part=it["part"].to_numpy(np.int64),
                     dur=it["dur"].to_numpy(np.int64), key=key_id, lag=lag, p2p=p2p, n_keys=n_keys,
                     stage=ri.stage, peak_lag=peak_lag, link_peaks=link_peaks)


def _link_peak_lags(model, it: pd.DataFrame, gcode: np.ndarray, key_id: np.ndarray, waiting: np.ndarray,
                    n_keys: int) -> tuple[np.ndarray, dict]:
    """Per item: for a wait, its instance's transfer at the group's link peak bus bandwidth, S × factor(op, n) ÷
    peak (analyzers/collectives.py: S the instance's largest message over its ranks, busbw = algbw × factor); -1
    where the group's link peak is unknown. And each waited-on group's (peak, why)."""
    out = np.full(len(it), -1, np.int64)
    if not waiting.any():
        return out, {}
    inst_size = np.maximum(_MaxBy(key_id[waiting], n_keys)(it["c_bytes"].to_numpy(np.int64)[waiting], 0), 0)
    # one factor and one peak per distinct (op, group size, group), not one call per item
    op_code, ops = pd.factorize(it["c_op"])
    n = it["c_group_size"].to_numpy(np.int64)[waiting]
    g_names = pd.factorize(it["c_group"])[1]
    codes, _ = instance_ids(op_code[waiting].astype(np.int64), n - n.min(), gcode[waiting])
    first = np.zeros(int(codes.max()) + 1, np.int64)
    first[codes[::-1]] = np.arange(len(codes))[::-1]   # each combination's first waiting item
    uniq = [(str(ops[op_code[waiting][i]]), int(n[i]), str(g_names[gcode[waiting][i]])) for i in first]
    peaks = {g: group_link_peak(model, g) for g in sorted({g for _, _, g in uniq})}
    factor = np.array([BUS_FACTOR[o](k) if o in BUS_FACTOR and k > 0 else np.nan for o, k, _ in uniq], float)
    gbps = np.array([peaks[g][0] or np.nan for _, _, g in uniq], float)
    t = inst_size[key_id[waiting]] * factor[codes] / (gbps[codes] * 1e9) * NS
    out[waiting] = np.where(np.isfinite(t), np.rint(np.nan_to_num(t)), -1).astype(np.int64)
    return out, peaks


def relax(win: np.ndarray, kind: np.ndarray, dur: np.ndarray, key: np.ndarray, lag: np.ndarray, off: np.ndarray,
          n_keys: int, latest: _MaxBy | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The replay engine, shared by every model of the run (this module's step model, and the pipeline analyzer's
    gap-free schedule, analyzers/pipeline.py). Items are sorted by window; in each window they run one after another
    from the window's offset ``off``: a work item takes ``dur``, an ARRIVE item marks the time ``key`` is reached by
    this window, a WAIT item holds the window until ``key``'s latest arrival plus the item's ``lag``. Returns (time
    after each item, accumulated waiting up to each item, latest arrival per key), or None when the dependencies do
    not settle (a cycle: the recorded order contradicts them).

    Vectorised fixed-point relaxation: each pass recomputes all times from the previous pass's latest arrivals. An
    acyclic chain of dependencies passes through each key at most once, so it settles within n_keys + 1 passes;
    one more pass that changes nothing confirms it. ``latest``: ``_MaxBy`` of the ARRIVE items' keys, when the
    caller replays the same items several times (it sorts them)."""
    c = _cumsum_by(win, dur) + off[win]
    wait = kind == WAIT
    arrive = kind == ARRIVE
    lowest = np.iinfo(np.int64).min
    constrained = wait & (key >= 0)
    latest = latest if latest is not None else _MaxBy(key[arrive], n_keys)
    last = latest(c[arrive], lowest)   # the first pass: no wait holds anyone yet
    for _ in range(n_keys + 1):
        rel = np.where(constrained, last[np.maximum(key, 0)], lowest)
        cand = np.where(rel > lowest, rel + lag - c, 0)
        slack = _cummax_by(win, np.maximum(cand, 0))
        t = c + slack
        new = latest(t[arrive], lowest)
        if np.array_equal(new, last):
            return t, slack, last
        last = new
    return None


def replay(g: StepGraph, dur: np.ndarray | None = None, lag: np.ndarray | None = None) -> Replay | None:
    """Replay the model with work durations ``dur`` and transfers ``lag`` (default: as measured). None when the
    dependencies do not settle (a cycle: the recorded order contradicts the matching)."""
    off = g.windows["offset_ns"].to_numpy(np.int64)
    out = relax(g.win, g.kind, g.dur if dur is None else dur, g.key, g.lag if lag is None else lag, off, g.n_keys,
                g.latest_arrivals)
    if out is None:
        return None
    t, slack, last = out
    end = off.copy()
    if len(t):
        is_last = np.r_[g.win[1:] != g.win[:-1], True]
        end[g.win[is_last]] = t[is_last]
    return Replay(end=end, t=t, slack=slack, last_arrival=last, duration=end - off)


def job_steps(g: StepGraph, r: Replay) -> pd.Series:
    """Per step: the replayed job step (s), the slowest rank's replayed step."""
    return pd.Series(r.duration / NS).groupby(g.windows["step"].to_numpy()).max()


# ---------------------------------------------------------------- scenarios: pure edits of (dur, lag)

def _part_totals(g: StepGraph, dur: np.ndarray) -> pd.DataFrame:
    """Per window and work part: total work (ns)."""
    work = g.kind == WORKI
    n, k = len(g.windows), len(WORK_PARTS)
    tot = np.bincount(g.win[work] * k + g.part[work], weights=dur[work], minlength=n * k).reshape(n, k)
    return pd.DataFrame(tot, columns=list(WORK_PARTS))


def _own_parts(g: StepGraph) -> pd.DataFrame:
    """``_part_totals`` of the measured work, made once per model (every scenario starts from it)."""
    if "_own_parts" not in g.__dict__:
        g.__dict__["_own_parts"] = _part_totals(g, g.dur)
    return g.__dict__["_own_parts"]


def _scaled(g: StepGraph, target: np.ndarray, parts: tuple[int, ...], rows: np.ndarray) -> np.ndarray:
    """Work durations with each window in ``rows``'s parts ``parts`` scaled so the part totals become ``target``
    (windows × len(WORK_PARTS), NaN: unchanged)."""
    own = _own_parts(g).to_numpy()
    factor = np.ones_like(own)
    for p in parts:
        f = np.divide(target[:, p], own[:, p], out=np.ones(len(own)), where=own[:, p] > 0)
        f = np.where(np.isnan(f), 1.0, f)
        factor[rows, p] = f[rows]
    work = g.kind == WORKI
    out = g.dur.astype(np.float64)
    out[work] *= factor[g.win[work], g.part[work]]
    return np.rint(out).astype(np.int64)


def peers_of(g: StepGraph) -> dict[int, int]:
    """Each rank's peer group: its peers are the other ranks of the group, doing the same work (the same pipeline
    stage on a pipeline run, -1 for a rank with none; else one group). A group key, not a list of peers per rank:
    those lists grow with the square of the ranks (16,384 ranks: 268 M entries)."""
    ranks = sorted(set(g.windows["rank"].tolist()))
    if g.stage:
        return {r: g.stage.get(r, -1) for r in ranks}
    return {r: 0 for r in ranks}


def straggler_removed(g: StepGraph, ranks: list[int], peers: dict[int, int]) -> np.ndarray:
    """Work durations with ``ranks``' work, part by part in each step, set to the median of their peers'."""
    tot = _own_parts(g).copy()
    tot["rank"] = g.windows["rank"].to_numpy()
    tot["step"] = g.windows["step"].to_numpy()
    group = tot["rank"].map(peers).to_numpy()
    target = np.full((len(tot), len(WORK_PARTS)), np.nan)
    rows = []
    for r in ranks:
        if r not in peers:
            continue
        pr = (group == peers[r]) & ~tot["rank"].isin(ranks).to_numpy()
        if not pr.any():
            continue
        med = tot[pr].groupby("step")[list(WORK_PARTS)].median()
        mine = np.flatnonzero(tot["rank"].to_numpy() == r)
        target[mine] = med.reindex(tot["step"].to_numpy()[mine]).to_numpy()
        rows.extend(mine.tolist())
    parts = tuple(i for i, p in enumerate(WORK_PARTS) if p != "exposed_comm")
    return _scaled(g, target, parts, np.asarray(rows, np.int64))


def balanced_stages(g: StepGraph) -> np.ndarray:
    """Work durations with every pipeline rank's forward, backward and optimizer compute in each step set to the
    mean over pipeline ranks (each stage's ops equalised to the mean op). The optimizer too: a balanced partition
    moves the layers' parameters with them, and each stage's optimizer step is its own parameters' (DeepSpeed's
    PipelineEngine: 6 against 2 blocks uniformly partitioned, stage 0's AdamW step the longest part of its
    step)."""
    tot = _own_parts(g)
    pipe = g.windows["pipeline"].to_numpy()
    steps = g.windows["step"].to_numpy()
    mean = tot[pipe].groupby(steps[pipe]).mean()
    target = mean.reindex(steps).to_numpy()
    return _scaled(g, target, COMPUTE_PARTS, np.flatnonzero(pipe))


def no_data_wait(g: StepGraph) -> np.ndarray:
    return np.where((g.kind == WORKI) & (g.part == DATA_WAIT), 0, g.dur)


def perfect_overlap(g: StepGraph) -> tuple[np.ndarray, np.ndarray]:
    """Collectives (not point-to-point) cost nothing after their last arrival, and blocked time no collective
    explains is gone: communication is never exposed; ranks still wait for their peers' arrival."""
    dur = np.where((g.kind == WORKI) & (g.part == EXPOSED) & ~g.windows["pipeline"].to_numpy()[g.win], 0, g.dur)
    return dur, np.where(g.p2p, g.lag, 0)


def no_pipeline_gaps(g: StepGraph) -> tuple[np.ndarray, np.ndarray]:
    """On pipeline ranks: point-to-point transfers and the host gaps (other, blocked time no collective explains)
    between ops removed."""
    pipe = g.windows["pipeline"].to_numpy()[g.win]
    gap = (g.kind == WORKI) & pipe & np.isin(g.part, [OTHER, EXPOSED])
    return np.where(gap, 0, g.dur), np.where(g.p2p, 0, g.lag)


def collectives_at_link_peak(g: StepGraph) -> np.ndarray:
    """Transfers: every collective whose group's link peak is known takes no longer after its last arrival than its
    bytes need at that peak bus bandwidth (a measured transfer already faster stays)."""
    return np.where(g.peak_lag >= 0, np.minimum(g.lag, g.peak_lag), g.lag)


# ---------------------------------------------------------------- the analysis: replay error, scenarios, path

@dataclass
class WhatIf:
    graph: StepGraph
    identity: Replay | None
    summary: dict                       # summary.json: replay, what_if, critical_path
    straggler_savings: pd.DataFrame     # rank, step, saving_frac: straggler_removed per measured step
    typical_excess: dict[int, float]    # per suspected rank: typical_excess (s)
    typical_cpu_wait: dict[int, float]  # per suspected rank: typical_cpu_wait (s)


def _measured(g: StepGraph) -> np.ndarray:
    return np.array(sorted(set(g.windows.loc[g.windows["measured"], "step"].tolist())), np.int64)


def work_totals(items: pd.DataFrame, windows: pd.DataFrame) -> np.ndarray:
    """Per row of ``windows`` (rank, step; sorted by them) and work part (WORK_PARTS): the total work of its items
    in ns. Rank-local: a node summary stores it per rank-step (``work_<part>_ns``), so the suspects and their
    typical excess cover every measured step whatever steps the replay samples."""
    out = np.zeros((len(windows), len(WORK_PARTS)), np.int64)
    work = items["kind"].to_numpy() == WORKI
    if not work.any():
        return out
    wkey = windows["rank"].to_numpy(np.int64) * (1 << 32) + windows["step"].to_numpy(np.int64)
    ikey = items["rank"].to_numpy(np.int64)[work] * (1 << 32) + items["step"].to_numpy(np.int64)[work]
    k = len(WORK_PARTS)
    cell = np.searchsorted(wkey, ikey) * k + items["part"].to_numpy(np.int64)[work]
    tot = np.bincount(cell, weights=items["dur"].to_numpy(np.int64)[work], minlength=len(windows) * k)
    return np.rint(tot).astype(np.int64).reshape(len(windows), k)


def _work_table(model, work: pd.DataFrame) -> pd.DataFrame:
    """Every rank-step of the model (rank, step, measured) with its work per part (ns, int) from ``work`` (a
    column per WORK_PARTS: its columns, not a copy), and ``cpu_wait`` (ns its training thread waited for a CPU, float;
    NaN where not reported)."""
    w = model.steps
    out = work[list(WORK_PARTS)].reset_index(drop=True)
    for c in ("rank", "step", "measured"):   # as Series: shared (pandas copies a NumPy array it is given)
        out[c] = w[c].reset_index(drop=True)
    out["cpu_wait"] = w["cpu_wait_s"].to_numpy(float) * NS
    return out


def typical_excess(work: pd.DataFrame, ranks: list[int], peers: dict[int, int]) -> dict[int, tuple[float, float]]:
    """Per rank of ``ranks``: its (typical extra work, typical extra wait for a CPU) in seconds, from one pass over
    ``work`` (``_work_table``) for all of them. Extra work: over the own-work parts, the sum of the median over the
    measured steps of its part minus its peers' median part; a slow rank's excess recurs in the same part, a rank
    that a busy machine preempts in a different part each step has none. Extra CPU wait: the same median for its
    training thread's run delay (``cpu_wait``; 0 where a rank did not report it): time the machine's other processes
    took from the rank, not work the rank itself does."""
    cols = [*OWN_WORK_PARTS, "cpu_wait"]
    d = _typical_over_peers(work, ranks, peers, cols)
    out = {}
    for r in ranks:
        cpu_wait = float(d[r]["cpu_wait"]) / NS if np.isfinite(d[r]["cpu_wait"]) else 0.0
        out[r] = (float(d[r][list(OWN_WORK_PARTS)].sum()) / NS, cpu_wait)
    return out


def _typical_over_peers(work: pd.DataFrame, ranks: list[int], peers: dict[int, int],
                        cols: list[str]) -> dict[int, pd.Series]:
    """Per rank of ``ranks`` and column of ``cols``: the median over the measured steps of its value minus the
    median of its peers' (NaN skipped). One matrix (measured steps × peer group) per group and column, sorted once
    per row: the median of the others is read from the sorted row with the rank's own value left out, so the cost
    does not grow with the number of ranks asked for (at 16,384 ranks a filter and group-by per rank took seconds
    each)."""
    meas = np.flatnonzero(work["measured"].to_numpy(bool))
    rank = work["rank"].to_numpy(np.int64)[meas]
    steps, si = steps_mod.dense_codes(work["step"].to_numpy(np.int64)[meas])
    out: dict[int, dict] = {r: {} for r in ranks}
    for key in sorted({peers[r] for r in ranks}):
        members = np.array(sorted(q for q, k in peers.items() if k == key), np.int64)
        mi = np.minimum(np.searchsorted(members, rank), len(members) - 1)
        inside = members[mi] == rank   # the group's rows (a binary search each, not a set test)
        in_group, at = meas, si
        if not inside.all():   # one group of every rank (data parallel): no copies of 16.4 M indices
            sel = np.flatnonzero(inside)
            mi, in_group, at = mi[sel], meas[sel], si[sel]
        del inside
        asked = [r for r in ranks if peers[r] == key]
        for c in cols:
            m = np.full((len(steps), len(members)), np.nan)
            m[at, mi] = work[c].to_numpy()[in_group]
            valid = (~np.isnan(m)).sum(axis=1)
            mid = (len(members) - 1) // 2
            if (valid == len(members)).all():   # no gap: only the middle places are needed, partitioned (O(n))
                srt = np.partition(m, sorted({max(mid - 1, 0), mid, min(mid + 1, len(members) - 1)}), axis=1)
            else:
                srt = np.sort(m, axis=1)   # NaN last
            rows = np.arange(len(steps))
            for r in asked:
                own = m[:, int(np.searchsorted(members, r))]
                has = ~np.isnan(own)
                n = valid - has   # the others' values
                mid = n // 2
                hi, lo = (_kth_of_others(srt, rows, k, has, own) for k in (mid, mid - 1))
                med = np.where(n % 2 == 1, hi, (lo + hi) / 2)
                med = np.where(n > 0, med, np.nan)
                out[r][c] = pd.Series(own - med).median()
    return {r: pd.Series(v, dtype=float) for r, v in out.items()}


def _kth_of_others(srt: np.ndarray, rows: np.ndarray, k: np.ndarray, has: np.ndarray, own: np.ndarray) -> np.ndarray:
    """Per row of ``srt`` (sorted, or partitioned around the places asked): the ``k``-th smallest value once the
    row's own value (``own``, where ``has``) is left out. The own value's first place among equal values is at or
    before k exactly when the k-th smallest is not below it (a NaN k-th: past the row's values), so one comparison
    per row finds it, not a count over the row (which, per rank and part, was most of this at 16,384 ranks)."""
    last = srt.shape[1] - 1
    k = np.clip(k, 0, last)
    before = has & ~(srt[rows, k] < own)
    return srt[rows, np.minimum(k + before, last)]


def suspects(work: pd.DataFrame, peers: dict[int, int], limit: int = 8) -> list[int]:
    """Ranks whose own work (no waiting; ``work``: ``_work_table``) exceeds their peers' median in the mean
    measured step, most first."""
    meas = work["measured"].to_numpy(bool)   # a column at a time: a mask over the frame copies every column
    own = pd.Series(sum(work[p].to_numpy()[meas] for p in OWN_WORK_PARTS))
    mean = own.groupby(work["rank"].to_numpy()[meas]).mean()
    excess = {}
    for key in sorted(set(peers.values())):   # per peer group: each rank against the median of the others
        members = [r for r, k in peers.items() if k == key and r in mean.index]
        v = mean.reindex(members).to_numpy(float)
        order = np.argsort(v, kind="stable")
        sv = v[order]
        for pos, i in enumerate(order):
            n = len(sv) - 1   # the others
            if n == 0:
                continue
            # the k-th smallest of the others is sv[k], or sv[k + 1] from the rank's own place on
            mid = [k + (k >= pos) for k in ((n // 2,) if n % 2 else (n // 2 - 1, n // 2))]
            med = sv[mid[0]] if len(mid) == 1 else (sv[mid[0]] + sv[mid[1]]) / 2
            excess[members[i]] = mean[members[i]] - float(med)
    excess = dict(sorted(excess.items()))
    return [r for r, x in sorted(excess.items(), key=lambda kv: -kv[1]) if x > 0][:limit]


# the replay covers at most this many rank-steps (all measured steps of a run up to 1,024 ranks × 256 steps), else
# an evenly spaced sample of at least REPLAY_MIN_STEPS measured steps: its cost grows with the items of every
# replayed rank-step times the scenarios (docs/scale.md)
REPLAY_RANK_STEPS = 262_144
REPLAY_MIN_STEPS = 8


def replay_steps(model) -> np.ndarray | None:
    """The measured steps the what-if replays when not all of them (sorted), None for all of them: of the measured
    steps that are multiples of the largest power of two 2**k with at least the budget's number of them, that many
    evenly spaced (first and last included). A node summary stores the items by the level k of their step (the
    trailing zero bits: dtprof/rundir/schema.py ITEM_LEVEL), so reading the sample reads the levels >= k only, at most
    about twice the sampled steps' items, whatever the warm-up."""
    w = model.steps
    measured = steps_mod.distinct(w["step"].to_numpy(np.int64)[w["measured"].to_numpy(bool)])
    cap = max(REPLAY_MIN_STEPS, REPLAY_RANK_STEPS // max(len(steps_mod.distinct(w["rank"].to_numpy(np.int64))), 1))
    if len(measured) <= cap:
        return None
    level = step_level(measured)
    on = measured[level >= np.sort(level)[::-1][cap - 1]]   # the lattice of 2**k: at least cap of them
    return on[np.unique(np.linspace(0, len(on) - 1, cap).round().astype(np.int64))]


def analyze_whatif(model, items: RankItems | None = None, on_gpu: bool = False,
                   work: pd.DataFrame | None = None) -> WhatIf | None:
    """The what-if analysis of the run model from its rank-local items (``rank_items``, or the node summaries':
    those of the ``replay_steps`` at least) and ``work`` (``work_totals`` of every rank-step of the model as a
    column per WORK_PARTS, default from ``items``): None when the run has no measured step."""
    items = items if items is not None else rank_items(model)
    if work is None:
        work = pd.DataFrame(work_totals(items.items, model.steps), columns=list(WORK_PARTS))
    work_t = _work_table(model, work)
    g = graph(model, items, replay_steps(model))
    steps = _measured(g)
    if not len(steps):
        return None
    job = model.job.set_index("step")["time_s"]
    measured_s = job.reindex(steps).to_numpy(float)
    ident = replay(g)
    out: dict = {}
    if ident is None:
        out["replay"] = {"error_frac": None, "reason": "the recorded order contradicts the collectives' matching"}
        return WhatIf(g, None, {"replay": out["replay"], "what_if": [], "critical_path": None},
                      pd.DataFrame(columns=["rank", "step", "saving_frac"]), {}, {})
    base = job_steps(g, ident).reindex(steps).to_numpy(float)
    err = np.abs(base - measured_s) / measured_s
    out["replay"] = {"error_frac": float(err.mean()), "error_frac_max": float(err.max()),
                     "steps": int(len(steps)),
                     "method": "each measured step replayed from the unmodified model; mean over measured steps of "
                               "|replayed - measured| ÷ measured job step"}
    all_measured = np.unique(work_t.loc[work_t["measured"], "step"].to_numpy(np.int64))
    if len(steps) < len(all_measured):
        out["replay"]["method"] = (f"an evenly spaced sample of {len(steps)} of the {len(all_measured)} measured "
                                   f"steps (at most {REPLAY_RANK_STEPS:,} rank-steps) replayed from the unmodified "
                                   f"model; mean over them of |replayed - measured| ÷ measured job step")
    # the measured mean step over every measured step; savings are over the replayed ones
    mean_meas = float(job.reindex(all_measured).to_numpy(float).mean())

    def entry(name, ranks, dur=None, lag=None, basis="") -> tuple[dict, np.ndarray] | None:
        r = replay(g, dur, lag)
        if r is None:
            return None
        per = job_steps(g, r).reindex(steps).to_numpy(float)
        saving = 1.0 - per.sum() / base.sum()
        return ({"scenario": name, "ranks": list(ranks), "predicted_step_s": mean_meas * (1.0 - saving),
                 "measured_step_s": mean_meas, "saving_frac": float(saving), "basis": basis},
                1.0 - per / base)

    entries = []
    skipped = []
    peers = peers_of(g)
    rows = []
    for r in suspects(work_t, peers):
        e = entry("straggler_removed", [r], straggler_removed(g, [r], peers),
                  basis=f"rank {r}'s work in each step set to the median of its peers' "
                        f"({'same stage' if g.stage else 'every other rank'}), part by part")
        if e:
            entries.append(e[0])
            rows.append(pd.DataFrame({"rank": r, "step": steps, "saving_frac": e[1]}))
    typical = typical_excess(work_t, [e["ranks"][0] for e in entries], peers)   # the suspects removed above
    excess = {r: x for r, (x, _) in typical.items()}
    cpu_wait = {r: w for r, (_, w) in typical.items()}
    meas = work_t["measured"].to_numpy(bool)
    has = {p: bool(np.nansum(work_t[p].to_numpy(np.float64)[meas]) > 0) for p in WORK_PARTS}
    pipe_win = g.windows["pipeline"].to_numpy()
    exposed_off_pipe = (g.kind == WORKI) & (g.part == EXPOSED) & ~pipe_win[g.win] & (g.dur > 0)
    comm = bool((g.lag[(g.kind == WAIT) & ~g.p2p] > 0).any() or exposed_off_pipe.any())
    if comm:
        d, la = perfect_overlap(g)
        e = entry("perfect_overlap", [], d, la, "every collective done the moment its last participant arrives and "
                  "no other blocked time: an upper bound for overlapping communication with compute")
        if e:
            entries.append(e[0])
    if has["data_wait"]:
        e = entry("no_data_wait", [], no_data_wait(g), basis="every data_wait span of every rank removed")
        if e:
            entries.append(e[0])
    if g.stage:
        e = entry("balanced_stages", [], balanced_stages(g),
                  basis="each pipeline rank's forward, backward and optimizer compute in a step set to the mean "
                        "over stages")
        if e:
            entries.append(e[0])
        d, la = no_pipeline_gaps(g)
        e = entry("no_pipeline_gaps", [], d, la, "pipeline point-to-point transfers and host gaps between ops "
                  "removed")
        if e:
            entries.append(e[0])
    known = (g.kind == WAIT) & (g.peak_lag >= 0)
    if not on_gpu:
        skipped.append({"scenario": "collectives_at_link_peak",
                        "reason": "CPU run: gloo moves data through the CPU's memory and sockets, no device link "
                                  "with a peak bus bandwidth"})
    elif not known.any():
        skipped.append({"scenario": "collectives_at_link_peak",
                        "reason": "no collective of a group with a known link peak: "
                                  + "; ".join(sorted({why for _, why in g.link_peaks.values()}))})
    else:
        e = entry("collectives_at_link_peak", [], lag=collectives_at_link_peak(g),
                  basis="each collective's transfer after its last arrival cut to its bytes at the link's peak bus "
                        "bandwidth (" + "; ".join(sorted({why for p, why in g.link_peaks.values() if p})) + ")")
        if e:
            entries.append(e[0])
    zero_entry, zero_skipped = zero_bucket.what_if(model, on_gpu, mean_meas)   # DeepSpeed ZeRO-1/2: all in one bucket
    entries += [zero_entry] if zero_entry else []
    skipped += [zero_skipped] if zero_skipped else []
    out["what_if"] = sorted(entries, key=lambda x: -x["saving_frac"])
    out["what_if_skipped"] = skipped
    out["critical_path"] = critical_path(g, ident, steps)
    sav = pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=["rank", "step", "saving_frac"])
    return WhatIf(g, ident, out, sav, excess, cpu_wait)


def critical_path(g: StepGraph, r: Replay, steps: np.ndarray) -> dict:
    """Share of the critical path by rank and by part over the measured steps ``steps``. The path starts at the
    slowest rank's end and walks back: work items count for their rank and part; at a wait that held the rank
    (its slack grew there) the walk continues at the instance's last arriver, from its arrival, and the transfer
    after that arrival counts as the last arriver's ``exposed_comm``. Where ranks tie at the end, the lowest
    rank's end starts the walk."""
    n = len(g.kind)
    idx = np.arange(n)
    first = np.r_[True, g.win[1:] != g.win[:-1]] if n else np.zeros(0, bool)
    prev_slack = np.where(first, 0, np.r_[0, r.slack[:-1]])
    binding = (g.kind == WAIT) & (r.slack > prev_slack)
    w_first = np.full(len(g.windows), -1)
    w_first[g.win[first]] = idx[first]
    w_last = np.full(len(g.windows), -1)
    is_last = np.r_[g.win[1:] != g.win[:-1], True] if n else np.zeros(0, bool)
    w_last[g.win[is_last]] = idx[is_last]
    # each key's last arriver's arrive item
    arrive = np.flatnonzero(g.kind == ARRIVE)
    order = arrive[np.lexsort((r.t[arrive], g.key[arrive]))]
    last_item = np.full(g.n_keys, -1)
    last_item[g.key[order]] = order   # later rows overwrite: the latest arrival wins
    # per window, work per part accumulated up to each item
    work = g.kind == WORKI
    acc = np.zeros((n, len(WORK_PARTS)))
    if n:
        acc[idx[work], g.part[work]] = g.dur[work]
        acc = np.cumsum(acc, axis=0)
    ranks = g.windows["rank"].to_numpy()
    by_rank: dict[int, float] = {}
    by_part = dict.fromkeys(WORK_PARTS, 0.0)
    wsteps = g.windows["step"].to_numpy()
    by_step = np.argsort(wsteps, kind="stable")     # each step's windows as one slice (not a scan per step)
    sorted_steps = wsteps[by_step]
    for s in steps.tolist():
        wins = by_step[np.searchsorted(sorted_steps, s, "left"):np.searchsorted(sorted_steps, s, "right")]
        if not len(wins):
            continue
        wcur = int(wins[np.argmax(r.end[wins])])
        i = int(w_last[wcur])
        for _ in range(n + 1):
            if i < 0:
                break
            lo = int(w_first[wcur])
            seg = binding[lo:i + 1]
            j = lo + int(np.flatnonzero(seg)[-1]) if seg.any() else -1
            stop = j if j >= 0 else lo - 1
            add = acc[i] - (acc[stop] if stop >= 0 else 0)
            rk = int(ranks[wcur])
            for p, v in zip(WORK_PARTS, add):
                if v > 0:
                    by_part[p] += v
                    by_rank[rk] = by_rank.get(rk, 0.0) + v
            if j < 0:
                break
            nxt = int(last_item[g.key[j]])
            if nxt < 0:
                break
            wcur, i = int(g.win[nxt]), nxt
            by_part["exposed_comm"] += float(g.lag[j])   # the transfer: the collective the last arriver started
            rk = int(ranks[wcur])
            by_rank[rk] = by_rank.get(rk, 0.0) + float(g.lag[j])
    total = sum(by_part.values())
    if total <= 0:
        return {"by_rank": {}, "by_part": {}}
    return {"by_rank": {str(k): v / total for k, v in sorted(by_rank.items(), key=lambda kv: -kv[1])},
            "by_part": {k: v / total for k, v in by_part.items() if v > 0},
            "method": "per measured step, from the slowest rank's end back through each wait that held a rank to "
                      "the instance's last arriver; shares of the path's total length"}


# ---------------------------------------------------------------- checking a prediction against the fixed run

BOUND_SCENARIOS = ("perfect_overlap",)   # upper bounds of the saving, not estimates of it


def parse_prediction(spec: str) -> tuple[str, list[int] | None]:
    """``SCENARIO[:RANK[,RANK...]]`` -> (scenario, ranks or None when not given). ValueError when malformed."""
    name, _, ranks = spec.partition(":")
    if not name.strip():
        raise ValueError(f"--check-prediction {spec!r}: expected SCENARIO[:RANK[,RANK...]]")
    try:
        return name.strip(), sorted(int(x) for x in ranks.split(",")) if ranks.strip() else None
    except ValueError:
        raise ValueError(f"--check-prediction {spec!r}: ranks must be integers, e.g. straggler_removed:1") from None


def check_prediction(base: list[dict], head: list[dict], scenario: str, ranks: list[int] | None) -> dict:
    """A prediction of the base runs' what-if list (summary.json ``what_if``) against the head runs, which applied
    the fix: predicted and measured mean step and saving (pooled: the mean over the runs of a side) and the
    prediction's error. ValueError, naming what the base runs offer, when a base run lacks the entry."""
    entries = []
    for s in base:
        wi = s.get("what_if") or []
        hits = [w for w in wi
                if w.get("scenario") == scenario and (ranks is None or sorted(w.get("ranks", [])) == ranks)]
        if len(hits) != 1:
            have = ", ".join(w["scenario"] + (":" + ",".join(map(str, w["ranks"])) if w.get("ranks") else "")
                             for w in wi) or "none"
            raise ValueError(f"--check-prediction {scenario}{':' + ','.join(map(str, ranks)) if ranks else ''}: "
                             f"{'ambiguous' if hits else 'not'} in the base run's what-if list (it has: {have})")
        entries.append(hits[0])
    base_step = float(np.mean([w["measured_step_s"] for w in entries]))
    predicted = float(np.mean([w["predicted_step_s"] for w in entries]))
    head_step = float(np.mean([s["steps"]["time_s"]["mean"] for s in head]))
    pred_saving = 1.0 - predicted / base_step
    meas_saving = 1.0 - head_step / base_step
    out = {"scenario": scenario, "ranks": entries[0]["ranks"], "basis": entries[0]["basis"],
           "kind": "bound" if scenario in BOUND_SCENARIOS else "estimate",
           "base_step_s": base_step, "predicted_step_s": predicted, "measured_step_s": head_step,
           "predicted_saving_frac": pred_saving, "measured_saving_frac": meas_saving,
           "step_error_frac": (predicted - head_step) / head_step,
           "saving_error_frac": (pred_saving - meas_saving) / meas_saving if meas_saving else None,
           "method": "mean measured step of each side (pooled over its runs); error = (predicted - measured) ÷ "
                     "measured, of the step and of the saving"}
    if out["kind"] == "bound":
        out["bound_held"] = head_step >= predicted
    return out
