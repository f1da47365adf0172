"""The report's "where the step went" chart: one stacked bar per rank of summary.json's
``ranks[].breakdown_s_per_step`` (analyzers/breakdown.py), whose parts sum to the rank's mean step time.

Beyond ``MAX_BARS`` ranks the bars are groups (reports/rankgroups.py): one per node when the job has 2..MAX_BARS
nodes, else per pipeline stage, else per mesh coordinate, else buckets of consecutive ranks. A group's bar is the
mean of its ranks' breakdowns; its label and hover name its worst rank (the longest mean step) and that rank's step
time. With too many nodes for bars and no stage or mesh grouping (1,024 ranks on 128 nodes), the bars are the mean
of all ranks, then the ``WORST_BARS`` ranks computing longest, each its own breakdown. Only formats the analysis:
nothing is computed from the run here.
"""
from __future__ import annotations

import html

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from dtprof.reports import rankgroups as RG
from dtprof.reports.figures import layout

MAX_BARS = 64
WORST_BARS = 8
PART_LABELS = {"forward": "forward", "backward": "backward", "optimizer": "optimizer",
               "gpu_wait": "waiting for the GPU", "exposed_comm": "exposed communication",
               "data_wait": "data wait", "bubble": "pipeline bubble", "other": "other"}
PART_COLORS = {"forward": "#4C78A8", "backward": "#72B7B2", "optimizer": "#54A24B", "gpu_wait": "#9D755D",
               "exposed_comm": "#E45756",
               "data_wait": "#EECA3B", "bubble": "#B279A2", "other": "#BAB0AC"}


def breakdown_table(summary: dict, pipeline: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per bar: label, ranks (text), worst rank and its step time, and the mean seconds of each part."""
    parts = (summary.get("breakdown") or {}).get("parts") or list(PART_LABELS)
    rows = [r for r in summary.get("ranks") or [] if r.get("breakdown_s_per_step")]
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame({"rank": [r["rank"] for r in rows], "host": [str(r.get("host") or "") for r in rows],
                       "step_s": [r["step_time_s_mean"] for r in rows],
                       "compute_s": [r.get("compute_s_per_step") for r in rows],
                       "cpu_wait_s": pd.to_numeric([r.get("cpu_wait_s_per_step") for r in rows], errors="coerce"),
                       **{p: [r["breakdown_s_per_step"][p] for r in rows] for p in parts}})
    df = df.sort_values("rank", ignore_index=True)
    if len(df) <= MAX_BARS:
        df["group"] = np.arange(len(df))
        df["label"] = "rank " + df["rank"].astype(str)
    else:
        grouping = RG.choose(summary, pipeline, df["rank"], MAX_BARS)
        if grouping.kind == "consecutive ranks":
            return _mean_and_worst(df, parts)
        df["group"] = grouping.codes.reindex(df["rank"]).to_numpy()
        df["label"] = df["group"].map(lambda c: html.escape(grouping.labels[c]))
    worst = df.loc[df.groupby("group")["step_s"].idxmax(), ["group", "rank", "step_s"]].set_index("group")
    g = df.groupby("group", sort=True)
    out = g[parts + ["step_s", "cpu_wait_s"]].mean()
    out["ranks"] = g["rank"].agg(RG.ranks_text)
    out["n"] = g.size()
    out["worst_rank"] = worst["rank"]
    out["worst_step_s"] = worst["step_s"]
    out["label"] = g["label"].first()   # the group's ranks are in the hover
    if len(df) > MAX_BARS:
        out["label"] = out["label"] + " · worst " + out["worst_rank"].astype(str)
    return out.reset_index(drop=True)


def _mean_and_worst(df: pd.DataFrame, parts: list[str]) -> pd.DataFrame:
    """Bars: the mean of all ranks, then the WORST_BARS ranks computing longest (summary ranks[].compute_s_per_step),
    each labelled with its node."""
    worst = df.sort_values("compute_s", ascending=False, kind="stable").head(WORST_BARS)
    top = worst.iloc[0]
    mean = {**df[parts + ["step_s", "cpu_wait_s"]].mean().to_dict(), "ranks": RG.ranks_text(df["rank"]), "n": len(df),
            "worst_rank": int(top["rank"]), "worst_step_s": float(top["step_s"]),
            "label": "all (mean)"}
    each = worst.assign(ranks="rank " + worst["rank"].astype(str) + " (" + worst["host"].map(html.escape) + ")",
                        n=1, worst_rank=worst["rank"], worst_step_s=worst["step_s"],
                        label="rank " + worst["rank"].astype(str))
    cols = parts + ["step_s", "cpu_wait_s", "ranks", "n", "worst_rank", "worst_step_s", "label"]
    return pd.concat([pd.DataFrame([mean]), each[cols]], ignore_index=True)[cols]


def breakdown_figure(summary: dict, pipeline: pd.DataFrame | None = None) -> go.Figure | None:
    t = breakdown_table(summary, pipeline)
    if t.empty:
        return None
    parts = (summary.get("breakdown") or {}).get("parts") or list(PART_LABELS)
    grouped = bool((t["n"] > 1).any())
    fig = go.Figure()
    worst = np.where(t["n"] > 1, " (mean of each rank's)<br>worst: rank " + t["worst_rank"].astype(str) + ", "
                     + (t["worst_step_s"] * 1e3).map("{:.2f}".format) + " ms a step", "")
    custom = np.stack([t["ranks"], worst, t["step_s"] * 1e3], axis=1)
    who = "%{customdata[0]}%{customdata[1]}"
    for p in parts:
        fig.add_trace(go.Bar(
            x=t["label"], y=t[p] * 1e3, name=PART_LABELS.get(p, p), marker_color=PART_COLORS.get(p, "#999"),
            customdata=custom,
            hovertemplate=f"{who}<br>{html.escape(PART_LABELS.get(p, p))}: %{{y:.2f}} ms of "
                          "%{customdata[2]:.2f} ms a step<extra></extra>"))
    cpu_wait = t["cpu_wait_s"]
    if cpu_wait.notna().any():   # inside the parts, not one of them: a marker beside each bar, not a segment
        fig.add_trace(go.Scatter(
            x=t["label"], y=cpu_wait * 1e3, mode="markers", name="waiting for a CPU (inside the parts)",
            marker={"symbol": "diamond", "size": 9, "color": "#222"}, customdata=custom,
            hovertemplate=f"{who}<br>waiting for a CPU (runnable, not running): %{{y:.2f}} ms of "
                          "%{customdata[2]:.2f} ms a step<extra></extra>"))
    fig.update_xaxes(type="category", tickangle=0 if len(t) <= 12 else None)   # up to 12 bars: labels level
    title = ("rank" if not grouped else "group of ranks" if t["n"].iloc[1:].gt(1).any() else
             f"rank: all, then the {len(t) - 1} computing longest")
    layout(fig, "Where the step went: mean per measured step, per " + title,
           height=400, xtitle="ranks (grouped)" if grouped else "rank", ytitle="time per step (ms)", barmode="stack")
    # the legend beside the bars, so group labels below have the room they need
    fig.update_xaxes(automargin=True)
    return fig.update_layout(legend={"orientation": "v", "x": 1.01, "y": 1, "yanchor": "top", "font": {"size": 11}})
