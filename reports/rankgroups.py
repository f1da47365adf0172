"""How the report shows per-rank numbers beyond a few hundred ranks (docs/report-scale.md).

Up to ``GROUP_ABOVE`` ranks a per-rank chart has a bar (or a heatmap row) per rank. Beyond, ranks are grouped: each
group shows the distribution of its ranks (min, median, max) and names its worst rank, and the worst ranks of the
job are named in the chart's title and in the "Ranks by group" table. Groupings come from the analysis only:

- node: the host of each rank (summary.json ``ranks[].host``);
- pipeline stage: the stage a rank runs (``Analysis.pipeline``; a rank running several stages: its lowest);
- mesh coordinate: a rank's index along one DeviceMesh dimension (summary.json ``mesh.rank_coords``,
  analyzers/mesh.py), e.g. every rank with tp coordinate 3.

A chart takes the first grouping (in that order) with 2 to its maximum number of groups, else buckets of
consecutive ranks. Only formats the analysis: the values grouped are the analysis' per-rank (or rank-step) numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

GROUP_ABOVE = 256    # more ranks than this: per-rank charts show groups
WORST_NAMED = 5      # the worst ranks named in a grouped chart's title
STANDS_OUT = 0.01    # ... when the worst is more than this share away from the median rank


@dataclass
class Grouping:
    kind: str                # "node", "pipeline stage", "<dim> coordinate", "consecutive ranks"
    codes: pd.Series         # rank -> group number (0..n-1, display order)
    labels: list[str]        # group number -> label

    @property
    def n(self) -> int:
        return len(self.labels)


def _grouping(kind: str, label_of_rank: pd.Series, sort_key: pd.Series | None = None) -> Grouping:
    """Groups in the order of their first rank (or of ``sort_key``, e.g. the stage number)."""
    key = label_of_rank.index.to_series() if sort_key is None else sort_key
    first = key.groupby(label_of_rank).min().sort_values(kind="stable")
    code = pd.Series(np.arange(len(first)), index=first.index)
    return Grouping(kind, label_of_rank.map(code).astype("int64"), [str(x) for x in first.index])


def groupings(summary: dict, pipeline: pd.DataFrame | None = None) -> list[Grouping]:
    """The groupings the analysis supports (its summary and ``Analysis.pipeline``), in preference order: node,
    pipeline stage, mesh coordinates."""
    rows = summary.get("ranks") or []
    out = []
    hosts = pd.Series({int(r["rank"]): str(r.get("host") or "") for r in rows}, dtype=object)
    if len(hosts) and (hosts != "").all() and hosts.nunique() >= 2:
        out.append(_grouping("node", hosts))
    if pipeline is not None and len(pipeline):
        stage = pipeline.groupby("rank")["stage"].min().astype(int)
        if stage.nunique() >= 2:
            out.append(_grouping("pipeline stage", "stage " + stage.astype(str), stage))
    coords = (summary.get("mesh") or {}).get("rank_coords") or {}
    for dim, values in (coords.get("coords") or {}).items():
        c = pd.Series(values, index=coords["ranks"]).astype(int)
        if c.nunique() >= 2:
            out.append(_grouping(f"{dim} coordinate", f"{dim} " + c.astype(str), c))
    return out


def consecutive(ranks, max_groups: int) -> Grouping:
    """Buckets of consecutive ranks, at most ``max_groups`` of them."""
    ranks = np.sort(np.asarray(ranks, dtype=np.int64))
    size = max(1, -(-len(ranks) // max_groups))
    code = np.arange(len(ranks)) // size
    labels = [f"ranks {ranks[i * size]}–{ranks[min(len(ranks), (i + 1) * size) - 1]}" for i in range(code.max() + 1)]
    return Grouping("consecutive ranks", pd.Series(code, index=ranks), labels)


def choose(summary: dict, pipeline: pd.DataFrame | None, ranks, max_groups: int) -> Grouping:
    """The first grouping with 2..max_groups groups that covers ``ranks``, else consecutive buckets."""
    ranks = pd.Index(np.asarray(ranks, dtype=np.int64))
    for g in groupings(summary, pipeline):
        if 2 <= g.n <= max_groups and ranks.isin(g.codes.index).all():
            return g
    return consecutive(ranks, max_groups)


def ranks_text(ranks) -> str:
    """"rank 5", "ranks 8–15" (consecutive) or "ranks 3, 19, 35 … (16)"."""
    r = np.sort(np.asarray(ranks, dtype=np.int64))
    if len(r) == 1:
        return f"rank {r[0]}"
    if r[-1] - r[0] == len(r) - 1:
        return f"ranks {r[0]}–{r[-1]}"
    shown = ", ".join(map(str, r[:3]))
    return f"ranks {shown} … ({len(r)})" if len(r) > 3 else f"ranks {shown}"


def group_stats(values: pd.Series, g: Grouping) -> pd.DataFrame:
    """Per group (display order): label, n, min, median, max of ``values`` (indexed by rank), the worst rank (the
    largest value) and its value, and the ranks as text."""
    v = values.dropna()
    code = g.codes.reindex(v.index)
    v, code = v[code.notna()], code[code.notna()].astype("int64")
    df = pd.DataFrame({"code": code.to_numpy(), "rank": v.index.to_numpy(), "v": v.to_numpy(dtype=float)})
    grp = df.groupby("code", sort=True)
    out = grp["v"].agg(["size", "min", "median", "max"]).rename(columns={"size": "n"})
    pick = grp["v"].idxmax()
    out["worst_rank"] = df.loc[pick.to_numpy(), "rank"].to_numpy()
    out["worst"] = df.loc[pick.to_numpy(), "v"].to_numpy()
    out["ranks"] = grp["rank"].agg(ranks_text)
    out["label"] = [g.labels[c] for c in out.index]
    return out.reset_index(drop=True)


def worst_ranks(values: pd.Series, n: int = WORST_NAMED) -> pd.Series:
    """The ``n`` worst (largest) ranks of ``values`` (indexed by rank), worst first."""
    return values.dropna().nlargest(n)


def reduce_rows(m: np.ndarray, ranks: np.ndarray, g: Grouping, max_rows: int) -> tuple[np.ndarray, list[str]]:
    """A rank × column matrix reduced to one row per group, each cell the worst (max) of the group's ranks, so one
    slow rank stays visible instead of being averaged away; groups beyond ``max_rows`` are merged in display order
    (consecutive groups). Returns the matrix and the row labels."""
    code = g.codes.reindex(ranks).to_numpy()
    keep = ~pd.isna(code)
    code = code[keep].astype(np.int64)
    per = -(-g.n // max_rows)
    row = code // per
    order = np.argsort(row, kind="stable")
    sorted_rows = row[order]
    starts = np.flatnonzero(np.r_[True, sorted_rows[1:] != sorted_rows[:-1]])
    with np.errstate(invalid="ignore"):
        out = np.fmax.reduceat(m[keep][order], starts, axis=0)
    present = sorted_rows[starts]
    labels = [g.labels[r * per] if per == 1 else f"{g.labels[r * per]}…{g.labels[min(g.n, (r + 1) * per) - 1]}"
              for r in present]
    return out, labels
