"""Node summaries: the rank-local (map) side of the analysis, computed where the data is (docs/scale.md).

Everything here is a function of each rank's own spans and collectives inside its own step windows: no other
rank, no clock alignment, no warm-up choice. So it can be computed for one node alone (the launcher does it when
the node's job ends; ``dtprof summarize`` for runs without summaries), and the summaries of all nodes, joined by
``combine``, are exactly what ``summarize`` gives for the whole run. ``analyze`` (analyzers/summary.py) always
works from a ``NodeSummary``: the whole run's (``summarize(model)``, the raw path) or the joined nodes' (the scale
path); there is no second derivation.

Per rank-step: its window and the overlap (analyzers/overlap.py) and breakdown (analyzers/breakdown.py) figures;
per rank-step and channel: exposed communication; per rank-step: the what-if model's work, arrival and wait items
(analyzers/whatif.py ``rank_items``), whose arrivals and waits name their collective's instance, and their work per
part (``whatif.work_totals``); per collective instance, the node's rows reduced for the collective table
(``collectives.instance_rows``), the arrivals (``stragglers.arrival_parts``) and the clock fit (``clock.exit_sums``,
read by the run model). The cross-rank figures are made from these by the global analysis.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from dtprof.analyzers import breakdown as breakdown_mod
from dtprof.analyzers import collectives as coll_mod
from dtprof.analyzers import mesh as mesh_mod
from dtprof.analyzers import overlap as overlap_mod
from dtprof.analyzers import steps as steps_mod
from dtprof.analyzers import stragglers as strag_mod
from dtprof.analyzers import whatif as whatif_mod
from dtprof.analyzers.intervals import windows_touched
from dtprof.analyzers.runmodel import RunModel, all_exit_sums
from dtprof.analyzers.steps import by_rank_step
from dtprof.rundir.rows import Rows

# the overlap figures a summary keeps (its data wait is the breakdown's: overlap's own is not read)
OVERLAP_COLUMNS = ("compute_s", "comm_s", "exposed_comm_s", "comm_wait_s", "overlap_ratio", "overlap_s", "level")


@dataclass
class NodeSummary:
    rank_steps: pd.DataFrame   # rank, step, start_ns, end_ns, OVERLAP_COLUMNS, ``bd_<part>_s`` per breakdown PARTS,
                               # ``work_<part>_ns`` per whatif.WORK_PARTS
    exposed: pd.DataFrame      # rank, step, dim, op, issued, exposed_s (breakdown.Breakdown.exposed), by rank-step
    items: pd.DataFrame        # whatif.ITEM_COLUMNS + COLLECTIVE_COLUMNS (of the replayed steps at least)
    instance_rows: Rows        # collectives.INSTANCE_ROW_COLUMNS: the own collectives reduced per instance
    arrival_parts: Rows        # stragglers.ARRIVAL_PART_COLUMNS: the arrivals reduced per instance and part
    arrival_counts: Rows       # stragglers.ARRIVAL_COUNT_COLUMNS: each rank's collectives per step
    rank_group_comm: pd.DataFrame  # mesh.RANK_GROUP_COMM_COLUMNS (read from stored summaries only for a mesh run)
    pipeline_ranks: list[int] = field(default_factory=list)
    stage: dict = field(default_factory=dict)   # pipeline rank -> its (lowest) stage
    unassigned: int = 0        # spans/collectives outside every step window (overlap.OverlapResult)

    def __post_init__(self):
        # the text columns repeated on every rank-step as categoricals in sorted order, whichever path made them
        # (read from the files, dictionary-encoded in the files' order; or computed as text)
        # (a categorical's dtype compares equal whatever its categories' order, so the order is checked here)
        for df, cols in ((self.rank_steps, ("level",)), (self.exposed, ("dim", "op", "issued"))):
            for c in cols:
                col = df[c] if isinstance(df[c].dtype, pd.CategoricalDtype) else df[c].astype(str).astype("category")
                have = col.cat.categories.astype("str")
                cats = have.sort_values()
                if not (col.cat.categories.equals(cats) and col.cat.categories.dtype == cats.dtype):
                    col = col.cat.rename_categories(have).cat.reorder_categories(cats)
                if col is not df[c]:
                    df[c] = col

    def overlap(self) -> overlap_mod.OverlapResult:
        per = self.rank_steps[["rank", "step", *OVERLAP_COLUMNS]].reset_index(drop=True)
        return overlap_mod.OverlapResult(per, self.unassigned)

    def breakdown(self) -> breakdown_mod.Breakdown:
        per = self.rank_steps[["rank", "step"] + [f"bd_{p}_s" for p in breakdown_mod.PARTS]]
        per = per.rename(columns={f"bd_{p}_s": f"{p}_s" for p in breakdown_mod.PARTS}).reset_index(drop=True)
        return breakdown_mod.Breakdown(per, self.exposed, list(self.pipeline_ranks))

    def whatif_items(self) -> whatif_mod.RankItems:
        return whatif_mod.RankItems(items=self.items, stage=dict(self.stage),
                                    pipeline_ranks=list(self.pipeline_ranks))

    def work(self) -> pd.DataFrame:
        """Per rank-step, one column per whatif.WORK_PARTS: the what-if items' work (ns; the rank-steps' own
        columns, not a copy)."""
        return self.rank_steps[[f"work_{p}_ns" for p in whatif_mod.WORK_PARTS]].set_axis(
            list(whatif_mod.WORK_PARTS), axis=1)


def summarize(model, items_by_step: bool = False) -> NodeSummary:
    """The summary of the run model ``model`` (analyzers/runmodel.py): one node's, or a whole run's. Its items by
    (step, rank) given ``items_by_step`` (as a node summary stores them), else by (rank, step)."""
    windows = model.steps
    # the rank-steps that no span, collective or trace capture meets (a long sampled run's boundary-only steps and
    # skipped detail: nearly all of its rank-steps) hold nothing but "other" time: their figures are written in
    # directly (``_with_lone_items``), only the others go through the interval measures
    touched = _touched(model, windows)
    sub = windows if touched.all() else windows[touched]
    rows = np.flatnonzero(touched)
    ov = overlap_mod.rank_step_overlap(model, sub)
    bd = breakdown_mod.step_breakdown(model, sub)
    ri = whatif_mod.rank_items(model, sub)
    per = windows[["rank", "step", "start_ns", "end_ns", *steps_mod.STEP_NUMBERS]].reset_index(drop=True)
    dur = per["end_ns"].to_numpy(np.int64) - per["start_ns"].to_numpy(np.int64)

    def spread(x, fill) -> np.ndarray:   # a column of ``sub``'s rows as one of all the windows'
        x = np.asarray(x)
        out = np.full(len(per), fill, x.dtype)
        out[rows] = x
        return out

    for c in OVERLAP_COLUMNS[:-1]:
        per[c] = spread(ov.per_step[c].to_numpy(), np.nan if c == "overlap_ratio" else 0.0)
    level = np.asarray(ov.per_step["level"].to_numpy(), dtype=object)
    cats = pd.Index(sorted(set(level.tolist()) | ({"hook"} if len(rows) < len(per) else set())), dtype="str")
    per["level"] = pd.Categorical.from_codes(spread(cats.get_indexer(level).astype(np.int8),
                                                    cats.get_loc("hook") if "hook" in cats else 0), cats)
    for p in breakdown_mod.PARTS:
        # nothing known in a lone window: all of it is "other" (breakdown.step_breakdown's arithmetic)
        out = np.maximum(dur.astype(np.float64), 0.0) / breakdown_mod.NS if p == "other" else np.zeros(len(per))
        out[rows] = bd.per_step[f"{p}_s"].to_numpy()
        per[f"bd_{p}_s"] = out
    work = whatif_mod.work_totals(ri.items, sub)
    for i, p in enumerate(whatif_mod.WORK_PARTS):
        out = np.maximum(dur, 0) if p == "other" else np.zeros(len(per), np.int64)
        out[rows] = work[:, i]
        per[f"work_{p}_ns"] = out
    items = _with_lone_items(ri.items, per, touched, items_by_step)
    parts, counts = strag_mod.arrival_parts(model)
    return NodeSummary(rank_steps=per, exposed=bd.exposed, items=items,
                       instance_rows=Rows.of("instance_rows", coll_mod.instance_rows(model)),
                       arrival_parts=Rows.of("arrival_parts", parts), arrival_counts=Rows.of("arrival_counts", counts),
                       rank_group_comm=mesh_mod.rank_group_comm(model.collectives),
                       pipeline_ranks=sorted(set(bd.pipeline_ranks) | set(ri.pipeline_ranks)),
                       stage=ri.stage, unassigned=ov.unassigned)


def _touched(model, windows: pd.DataFrame) -> np.ndarray:
    """Per window (rank-step), whether a span, a collective or a trace capture of its rank meets it."""
    sp, co, cap = model.spans, model.collectives, model.captures
    issue = co["issue_ns"].to_numpy(np.int64)
    start = co["comm_start_ns"].to_numpy(np.int64)
    exit_ns = co["exit_ns"].to_numpy(np.int64)
    key = np.concatenate([sp["rank"].to_numpy(np.int64), co["rank"].to_numpy(np.int64),
                          cap["rank"].to_numpy(np.int64)])
    lo = np.concatenate([sp["start_ns"].to_numpy(np.int64), np.minimum(issue, start),
                         cap["start_ns"].to_numpy(np.int64)])
    hi = np.concatenate([sp["end_ns"].to_numpy(np.int64), np.maximum(issue, exit_ns),
                         cap["end_ns"].to_numpy(np.int64)])
    return windows_touched(windows["rank"].to_numpy(np.int64), windows["start_ns"].to_numpy(np.int64),
                           windows["end_ns"].to_numpy(np.int64), key, lo, hi)


def _with_lone_items(items: pd.DataFrame, per: pd.DataFrame, touched: np.ndarray, by_step: bool) -> pd.DataFrame:
    """``items`` (``whatif.rank_items`` of the touched windows of ``per``, in window order) with those of the other
    windows merged in: as rank_items makes them, a window met by nothing is one "other" work item from its start to
    its end (none if it has no length). In window order (rank, step), or by (step, rank) given ``by_step``; each
    window's items in their order. Each column written once in place (no frame-wide copy or sort)."""
    wr, wstep = per["rank"].to_numpy(np.int64), per["step"].to_numpy(np.int64)
    ws, we = per["start_ns"].to_numpy(np.int64), per["end_ns"].to_numpy(np.int64)
    lone = np.flatnonzero(~touched & (we > ws))
    if not len(lone) and not by_step:
        return items
    i_win = np.searchsorted(wr * (1 << 32) + wstep,
                            items["rank"].to_numpy(np.int64) * (1 << 32) + items["step"].to_numpy(np.int64))
    n_own = np.bincount(i_win, minlength=len(per))
    n_items = n_own.copy()
    n_items[lone] = 1
    order = np.lexsort((wr, wstep)) if by_step else np.arange(len(per))   # the windows in the output's order
    first = np.empty(len(per), np.int64)
    first[order] = np.cumsum(n_items[order]) - n_items[order]
    at_items = first[i_win] + np.arange(len(items)) - (np.cumsum(n_own) - n_own)[i_win]
    at_lone = first[lone]
    total = int(n_items.sum())
    lone_values = {"rank": wr[lone], "step": wstep[lone], "t": ws[lone], "kind": whatif_mod.WORKI,
                   "part": whatif_mod.OTHER, "dur": (we - ws)[lone], "release": 0, "c_group": "", "c_seq": -1,
                   "c_sender": -1, "c_receiver": -1, "c_op": "", "c_bytes": -1, "c_group_size": -1}
    out = {}
    for c in items.columns:
        col = items[c]
        if col.dtype == object or isinstance(col.dtype, pd.StringDtype):   # text: one take (Arrow's, for "str")
            src = np.empty(total, np.int64)
            src[at_items] = np.arange(len(items))
            src[at_lone] = len(items)      # the lone items' value, appended to the items'
            out[c] = pd.concat([col, pd.Series([lone_values[c]], dtype=col.dtype)], ignore_index=True).array.take(src)
        else:
            v = np.empty(total, col.to_numpy().dtype)
            v[at_items] = col.to_numpy()
            v[at_lone] = lone_values[c]
            out[c] = v
    return pd.DataFrame(out, copy=False)   # (no copy into one block per dtype: a long run's items are ~1 GB)


def node_tables(model) -> tuple[dict, dict]:
    """(tables, facts) of the summary of ``model`` (one node's) as the run format stores them (dtprof/rundir/schema.py
    SUMMARY_TABLES): ``summarize``'s, and the exits the clock fit reads (``clock.exit_sums``, read by the run
    model before the rest: analyzers/runmodel.py)."""
    # the items step by step (each rank-step's in their order); the writer orders them by their step's level
    # (dtprof/rundir/schema.py ITEM_LEVEL), stably, so a level's row groups hold its steps in order
    ns = summarize(model, items_by_step=True)
    return ({"rank_steps": ns.rank_steps, "exposed": ns.exposed, "whatif_items": ns.items,
             "instance_rows": ns.instance_rows.frame, "arrival_parts": ns.arrival_parts.frame,
             "arrival_counts": ns.arrival_counts.frame, "rank_group_comm": ns.rank_group_comm,
             # the clock fit reads every exit, the skipped detail's too (runmodel.exit_sums does for the raw path)
             "clock_exits": all_exit_sums(model.run)},
            {"pipeline_ranks": list(ns.pipeline_ranks), "stage": {str(k): v for k, v in ns.stage.items()},
             "unassigned": int(ns.unassigned), "detail_every": int(model.detail_every)})


def combine(tables: dict, rows: dict[str, Rows], facts: list[dict], computed: dict) -> NodeSummary:
    """The whole run's summary from its nodes': ``tables`` (the stored summaries' per rank-step tables, already
    concatenated by the reader), ``rows`` (per instance table, the reader's view of the stored summaries' files and
    the computed nodes' rows: ``Run.summary_rows``, reduced in DuckDB by their consumers), their ``facts``, and the
    summaries ``computed`` here (node directory -> summary) for nodes that had none. Rank-steps and items come out
    sorted by (rank, step) like the run model's windows, each rank-step's items in their order."""
    made = list(computed.values())
    per = [tables["rank_steps"]] + [c.rank_steps for c in made]
    exposed = [tables["exposed"]] + [c.exposed for c in made]
    items = [tables["whatif_items"]] + [c.items for c in made]
    stage: dict = {}
    for f in facts:
        stage.update({int(k): int(v) for k, v in f["stage"].items()})
    for c in made:
        stage.update(c.stage)

    return NodeSummary(rank_steps=by_rank_step(pd.concat(per, ignore_index=True)),
                       exposed=by_rank_step(pd.concat(exposed, ignore_index=True)),
                       items=by_rank_step(pd.concat(items, ignore_index=True)),
                       instance_rows=rows["instance_rows"], arrival_parts=rows["arrival_parts"],
                       arrival_counts=rows["arrival_counts"],
                       rank_group_comm=pd.concat([tables["rank_group_comm"]] + [c.rank_group_comm for c in made],
                                                 ignore_index=True) if "rank_group_comm" in tables
                       else mesh_mod.rank_group_comm(pd.DataFrame()),
                       pipeline_ranks=sorted({int(r) for f in facts for r in f["pipeline_ranks"]}
                                             | {r for c in made for r in c.pipeline_ranks}),
                       stage=stage,
                       unassigned=sum(int(f["unassigned"]) for f in facts) + sum(c.unassigned for c in made))


def of_run(run, model) -> NodeSummary:
    """The run's summary from its nodes' stored summaries (``Run.node_summaries``); a node without one is
    summarised here from its own tables (not written: ``dtprof summarize`` and the launcher write them). Only the
    what-if items of the steps the replay samples (``whatif.replay_steps``) are read."""
    item_steps = whatif_mod.replay_steps(model)
    wanted: tuple[str, ...] = ("exposed", "whatif_items")   # rank_steps: read by the run model already
    # the communication per rank, step and group only where the mesh block needs it (a DeviceMesh dimension named)
    if mesh_mod.named_dims(run.groups):
        wanted += ("rank_group_comm",)
    facts, tables = run.node_summaries(item_steps, tables=wanted)
    tables["rank_steps"] = model.stored_rank_steps
    missing = [nd for nd, f in zip(run.node_dirs, facts) if f is None]
    if len(missing) == len(run.node_dirs):   # none stored: the whole run at once is the same computation
        return summarize(model)
    # a node summarised here reads the blocks the run reads (the stored ones may read more: a superset)
    computed = {nd: summarize(RunModel.of(run.node_run(nd), detail_every=model.detail_every)) for nd in missing}
    if item_steps is not None:
        for c in computed.values():
            c.items = c.items[c.items["step"].isin(item_steps).to_numpy()]
    rows = {t: run.summary_rows(t, facts, {nd: getattr(c, t).frame for nd, c in computed.items()})
            for t in ("instance_rows", "arrival_parts", "arrival_counts")}
    ns = combine(tables, rows, [f for f in facts if f is not None], computed)
    return without_detail(ns, model.skipped_steps) if len(model.skipped_steps) else ns


def without_detail(ns: NodeSummary, steps: np.ndarray) -> NodeSummary:
    """``ns`` with the exposed communication rows of ``steps`` dropped, as a summary that did not read their detail
    makes it (a stored node summary may have read more blocks than the run reads: steps.detail_every). Its
    rank_steps are blank there already: the stored ones were blanked as the run model read them (runmodel's
    ``blank_skipped``), a node summarised here read the run's blocks only. Dropped after the read, not by its SQL:
    a filter of ~750 skipped steps in DuckDB cost more than it saved at 16,384 x 1,000 (measured side by side)."""
    drop = np.isin(ns.exposed["step"].to_numpy(np.int64), steps, kind="table")
    if not drop.any():
        return ns
    return replace(ns, exposed=ns.exposed[~drop].reset_index(drop=True))
