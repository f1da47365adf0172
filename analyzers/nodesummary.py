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

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dtprof.analyzers import breakdown as breakdown_mod
from dtprof.analyzers import clock as clock_mod
from dtprof.analyzers import collectives as coll_mod
from dtprof.analyzers import mesh as mesh_mod
from dtprof.analyzers import overlap as overlap_mod
from dtprof.analyzers import stragglers as strag_mod
from dtprof.analyzers import whatif as whatif_mod

OVERLAP_COLUMNS = ("compute_s", "comm_s", "exposed_comm_s", "comm_wait_s", "data_wait_s", "overlap_ratio",
                   "overlap_s", "level")


@dataclass
class NodeSummary:
    rank_steps: pd.DataFrame   # rank, step, start_ns, end_ns, OVERLAP_COLUMNS, ``bd_<part>_s`` per breakdown PARTS,
                               # ``work_<part>_ns`` per whatif.WORK_PARTS
    exposed: pd.DataFrame      # rank, step, dim, op, exposed_s (breakdown.Breakdown.exposed), by rank-step
    items: pd.DataFrame        # whatif.ITEM_COLUMNS + COLLECTIVE_COLUMNS (of the replayed steps at least)
    instance_rows: pd.DataFrame   # collectives.INSTANCE_ROW_COLUMNS: the own collectives reduced per instance
    arrival_parts: pd.DataFrame   # stragglers.ARRIVAL_PART_COLUMNS: the arrivals reduced per instance and part
    arrival_counts: pd.DataFrame  # stragglers.ARRIVAL_COUNT_COLUMNS: each rank's collectives per step
    rank_group_comm: pd.DataFrame  # mesh.RANK_GROUP_COMM_COLUMNS (read from stored summaries only for a mesh run)
    pipeline_ranks: list[int] = field(default_factory=list)
    stage: dict = field(default_factory=dict)   # pipeline rank -> its (lowest) stage
    unassigned: int = 0        # spans/collectives outside every step window (overlap.OverlapResult)

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

    def work(self) -> np.ndarray:
        """Per rank-step and whatif.WORK_PARTS: the what-if items' work (ns)."""
        return self.rank_steps[[f"work_{p}_ns" for p in whatif_mod.WORK_PARTS]].to_numpy(np.int64)


def summarize(model) -> NodeSummary:
    """The summary of the run model ``model`` (analyzers/runmodel.py): one node's, or a whole run's."""
    windows = model.steps
    ov = overlap_mod.rank_step_overlap(model, windows)
    bd = breakdown_mod.step_breakdown(model, windows)
    ri = whatif_mod.rank_items(model)
    per = windows[["rank", "step", "start_ns", "end_ns"]].reset_index(drop=True)
    for c in OVERLAP_COLUMNS:
        per[c] = ov.per_step[c].to_numpy()
    for p in breakdown_mod.PARTS:
        per[f"bd_{p}_s"] = bd.per_step[f"{p}_s"].to_numpy()
    work = whatif_mod.work_totals(ri.items, windows)
    for i, p in enumerate(whatif_mod.WORK_PARTS):
        per[f"work_{p}_ns"] = work[:, i]
    parts, counts = strag_mod.arrival_parts(model)
    return NodeSummary(rank_steps=per, exposed=bd.exposed, items=ri.items,
                       instance_rows=coll_mod.instance_rows(model), arrival_parts=parts, arrival_counts=counts,
                       rank_group_comm=mesh_mod.rank_group_comm(model.collectives),
                       pipeline_ranks=sorted(set(bd.pipeline_ranks) | set(ri.pipeline_ranks)),
                       stage=ri.stage, unassigned=ov.unassigned)


def node_tables(model) -> tuple[dict, dict]:
    """(tables, facts) of the summary of ``model`` (one node's) as the run format stores them (dtprof/schema.py
    SUMMARY_TABLES): ``summarize``'s, and the exits the clock fit reads (``clock.exit_sums``, read by the run
    model before the rest: analyzers/runmodel.py)."""
    ns = summarize(model)
    return ({"rank_steps": ns.rank_steps, "exposed": ns.exposed, "whatif_items": ns.items,
             "instance_rows": ns.instance_rows, "arrival_parts": ns.arrival_parts,
             "arrival_counts": ns.arrival_counts, "rank_group_comm": ns.rank_group_comm,
             "clock_exits": clock_mod.exit_sums(model.ranks, model.collectives)},
            {"pipeline_ranks": list(ns.pipeline_ranks), "stage": {str(k): v for k, v in ns.stage.items()},
             "unassigned": int(ns.unassigned)})


def combine(tables: dict, facts: list[dict], computed: list[NodeSummary]) -> NodeSummary:
    """The whole run's summary from its nodes': ``tables`` (the stored summaries' tables, already concatenated by
    the reader), their ``facts``, and the summaries ``computed`` here for nodes that had none. Rank-steps and
    items come out sorted by (rank, step) like the run model's windows, each rank-step's items in their order."""
    per = [tables["rank_steps"]] + [c.rank_steps for c in computed]
    exposed = [tables["exposed"]] + [c.exposed for c in computed]
    items = [tables["whatif_items"]] + [c.items for c in computed]
    stage: dict = {}
    for f in facts:
        stage.update({int(k): int(v) for k, v in f["stage"].items()})
    for c in computed:
        stage.update(c.stage)
    return NodeSummary(rank_steps=_by_rank_step(pd.concat(per, ignore_index=True)),
                       exposed=_by_rank_step(pd.concat(exposed, ignore_index=True)),
                       items=_by_rank_step(pd.concat(items, ignore_index=True)),
                       # in node order (an instance's op is its first node's), merged per instance by the analysis
                       instance_rows=pd.concat([tables["instance_rows"]] + [c.instance_rows for c in computed],
                                               ignore_index=True),
                       # in node order: the arrivals' reduction does not depend on the order of the parts
                       arrival_parts=pd.concat([tables["arrival_parts"]] + [c.arrival_parts for c in computed],
                                               ignore_index=True),
                       arrival_counts=pd.concat([tables["arrival_counts"]] + [c.arrival_counts for c in computed],
                                                ignore_index=True),
                       rank_group_comm=pd.concat([tables["rank_group_comm"]] + [c.rank_group_comm for c in computed],
                                                 ignore_index=True) if "rank_group_comm" in tables
                       else mesh_mod.rank_group_comm(pd.DataFrame()),
                       pipeline_ranks=sorted({int(r) for f in facts for r in f["pipeline_ranks"]}
                                             | {r for c in computed for r in c.pipeline_ranks}),
                       stage=stage,
                       unassigned=sum(int(f["unassigned"]) for f in facts) + sum(c.unassigned for c in computed))


def _by_rank_step(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` stably sorted by (rank, step); left as is when it already is (nodes read in rank order)."""
    key = df["rank"].to_numpy(np.int64) * (1 << 32) + df["step"].to_numpy(np.int64)
    if len(key) < 2 or bool((key[1:] >= key[:-1]).all()):
        return df.reset_index(drop=True)
    return df.iloc[np.argsort(key, kind="stable")].reset_index(drop=True)


def of_run(run, model) -> NodeSummary:
    """The run's summary from its nodes' stored summaries (``Run.node_summaries``); a node without one is
    summarised here from its own tables (not written: ``dtprof summarize`` and the launcher write them). Only the
    what-if items of the steps the replay samples (``whatif.replay_steps``) are read."""
    from dtprof.analyzers.runmodel import RunModel

    item_steps = whatif_mod.replay_steps(model)
    wanted: tuple[str, ...] = ("rank_steps", "exposed", "whatif_items", "instance_rows", "arrival_parts",
                               "arrival_counts")
    # the communication per rank, step and group only where the mesh block needs it (a DeviceMesh dimension named)
    if mesh_mod.named_dims(run.groups):
        wanted += ("rank_group_comm",)
    facts, tables = run.node_summaries(item_steps, tables=wanted)
    missing = [nd for nd, f in zip(run.node_dirs, facts) if f is None]
    if len(missing) == len(run.node_dirs):   # none stored: the whole run at once is the same computation
        return summarize(model)
    computed = [summarize(RunModel.of(run.node_run(nd))) for nd in missing]
    if item_steps is not None:
        for c in computed:
            c.items = c.items[c.items["step"].isin(item_steps).to_numpy()]
    return combine(tables, [f for f in facts if f is not None], computed)
