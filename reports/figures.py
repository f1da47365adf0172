"""The report's plotly figures, one function per view. Each takes a ``Context`` and returns a figure (or None when
the run has nothing to show for that view). No figure reads anything but the run's tables and the ``Analysis``.

Scale rules (so a 1,024-rank, 1,000-step run stays a page, not a trace):
- rank × step heatmaps keep every rank up to ``rankgroups.GROUP_ABOVE`` ranks; beyond, a row is a group of ranks
  (node, pipeline stage or mesh coordinate: reports/rankgroups.py), at most ``MAX_HEATMAP_ROWS`` rows, each cell
  the worst of its ranks (a slow rank is not averaged away), the title naming the worst ranks; steps are binned to
  at most ``MAX_HEATMAP_COLS`` columns (mean of the steps in a column; the axis title says how many steps a column
  holds);
- per-rank bar charts (communication overlap, peak memory) beyond ``GROUP_ABOVE`` ranks show each group's min,
  median and max over its ranks, up to ``MAX_DIST_GROUPS`` groups, and name the worst ranks;
- the timeline is a bounded slice: a window of ``TIMELINE_STEPS`` steps around the slowest measured step, for at
  most ``MAX_TIMELINE_RANKS`` ranks (rank 0, the stragglers, the slowest and fastest computing ranks, then an even
  sample); the section's note names them and says they are a slice;
- NVML series draw one line per GPU up to ``MAX_GPU_LINES`` GPUs, else the p10–p90 band and median over GPUs, binned
  to at most ``MAX_TIME_POINTS`` points (composed with HoloViews' plotly backend: panels that share the time axis).

Every string that comes from a run goes through ``esc`` (HTML entities) before it enters a figure: plotly renders
labels and hover text as a subset of HTML, so an escaped ``<script>`` shows as text.
Times on shared axes are host-aligned through the run model (``analysis.model.align``: offset + drift per host,
analyzers/runmodel.py), the same alignment the Perfetto export uses, and shown from the first step's start.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dtprof.analyzers.steps import measured_or_all
from dtprof.reports import gpu as gpu_view
from dtprof.reports import rankgroups as RG
from dtprof.reports.fmt import count, esc, fixed, fmt_bytes, pct
from dtprof.rundir.schema import COMPUTE_KINDS, P2P_OPS

MAX_HEATMAP_COLS = 250
MAX_HEATMAP_ROWS = 512      # groups of ranks beyond rankgroups.GROUP_ABOVE ranks
MAX_DIST_GROUPS = 4096      # groups in a min/median/max chart (16,384 ranks on 2,048 nodes: a group per node)
TIMELINE_STEPS = 3
MAX_TIMELINE_RANKS = 16
MAX_GPU_LINES = 8
MAX_TIME_POINTS = 400

# colour per timeline category; the same names appear in the legend
COLORS = {"compute": "#4C78A8", "user span": "#9D755D", "pipeline forward": "#72B7B2", "pipeline backward": "#54A24B",
          "data wait": "#EECA3B", "blocked on communication": "#E45756", "collective": "#F58518",
          "p2p send/recv": "#B279A2"}
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif"


@dataclass
class Context:
    run: Any                       # dtprof.rundir.run.Run
    analysis: Any                  # dtprof.analyzers.summary.Analysis
    model: Any                     # the run model (analyzers/runmodel.py): aligned times, job step time
    t0_ns: int                     # aligned start of the first step: x = 0 on time axes
    steps: pd.DataFrame            # analysis.steps with start_ns/end_ns replaced by the aligned times
    measured: pd.DataFrame         # measured steps (all steps if none is measured)
    job: pd.DataFrame              # the model's per-step job table (time_s, warmup, measured)


# the columns of Analysis.steps the figures read (16 M rank-steps at 16,384 × 1,000: the other ~20 stay uncopied)
STEP_COLUMNS = ["rank", "step", "aligned_start_ns", "aligned_end_ns", "duration_s", "compute_s", "comm_s",
                "exposed_comm_s", "warmup", "measured"]


def make_context(run, analysis) -> Context:
    steps = analysis.steps[STEP_COLUMNS].rename(columns={"aligned_start_ns": "start_ns",
                                                         "aligned_end_ns": "end_ns"})
    measured = measured_or_all(steps)
    t0 = int(steps["start_ns"].min()) if len(steps) else 0
    return Context(run, analysis, analysis.model, t0, steps, measured, analysis.model.job)


def _job_time_s(ctx: Context, measured: bool) -> pd.Series:
    """The job's step time per step (the run model's), measured steps only when asked."""
    j = measured_or_all(ctx.job) if measured else ctx.job
    return j.set_index("step")["time_s"]


def step_axis(fig: go.Figure, n_steps: int, axis: str = "x") -> None:
    """Whole-number step ticks (a few-step run would otherwise get 4.5, 5.5)."""
    upd = fig.update_xaxes if axis == "x" else fig.update_yaxes
    upd(dtick=1) if n_steps <= 20 else upd(tickformat="d")


def rank_axis(fig: go.Figure, n_ranks: int, axis: str = "x") -> None:
    """Whole-number rank ticks (plotly would otherwise label 0.5, 1.5 on a few-rank axis)."""
    upd = fig.update_xaxes if axis == "x" else fig.update_yaxes
    upd(dtick=1) if n_ranks <= 32 else upd(tickformat="d")


def layout(fig: go.Figure, title: str, *, height: int = 380, xtitle: str | None = None,
           ytitle: str | None = None, **extra) -> go.Figure:
    fig.update_layout(title={"text": title, "x": 0.01, "font": {"size": 15}}, template="plotly_white",
                      height=height, margin={"l": 70, "r": 30, "t": 50, "b": 50}, font={"family": FONT, "size": 12},
                      legend={"orientation": "h", "y": -0.18}, hoverlabel={"font": {"family": FONT}}, **extra)
    if xtitle is not None:
        fig.update_xaxes(title_text=xtitle)
    if ytitle is not None:
        fig.update_yaxes(title_text=ytitle)
    return fig


# ---------------------------------------------------------------------------------------------- steps over time
def step_time_figure(ctx: Context) -> go.Figure | None:
    """Step time per step: the job's (max over ranks), the median rank's, and the p10–p90 band over ranks."""
    s = ctx.steps
    if s.empty:
        return None
    g = s.groupby("step")["duration_s"]
    q = g.quantile([0.1, 0.5, 0.9]).unstack() * 1e3
    job = _job_time_s(ctx, measured=False).reindex(q.index) * 1e3
    x = q.index.to_numpy()
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=q[0.9], mode="lines", line={"width": 0}, showlegend=False, hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=x, y=q[0.1], mode="lines", line={"width": 0}, fill="tonexty",
                             fillcolor="rgba(76,120,168,0.25)", name="p10–p90 over ranks", hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=x, y=q[0.5], mode="lines", line={"color": "#4C78A8"}, name="median rank",
                             hovertemplate="step %{x}<br>median rank: %{y:.2f} ms<extra></extra>"))
    fig.add_trace(go.Scatter(x=x, y=job, mode="lines", line={"color": "#E45756"}, name="job (slowest rank)",
                             hovertemplate="step %{x}<br>job step time: %{y:.2f} ms<extra></extra>"))
    warm = s.loc[s["warmup"].astype(bool), "step"]
    if len(warm):
        fig.add_vrect(x0=warm.min() - 0.5, x1=warm.max() + 0.5, fillcolor="#999", opacity=0.12, line_width=0,
                      annotation_text="warm-up (excluded)", annotation_position="top left")
    # the y-axis fits the measured steps: a slow warm-up or traced step (seconds of set-up) would flatten them;
    # the excluded steps' values stay in the hover and the off-scale ones are named
    measured = ctx.job.loc[ctx.job["measured"], "step"]
    if 0 < len(measured) < len(job):
        top = float(job[job.index.isin(measured)].max())
        fig.update_yaxes(range=[0, top * 1.15])
        off = job[~job.index.isin(measured) & (job > top * 1.15)]
        if len(off):
            fig.add_annotation(x=float(off.index[0]), y=top * 1.1, showarrow=False, yanchor="top", xanchor="left",
                               text="excluded, off scale: " + ", ".join(f"step {k} {count(float(v))} ms" for k, v in
                                                                       off.head(3).items()),
                               font={"size": 10, "color": "#666"})
    step_axis(fig, len(x))
    return layout(fig, "Step time per step", xtitle="step", ytitle="step time (ms)")


# ------------------------------------------------------------------------------------------- rank × step heatmaps
def _bin_matrix(ctx: Context, df: pd.DataFrame, value: str, scale: float):
    """Pivot rank × step to a matrix; beyond GROUP_ABOVE ranks reduce its rows to groups of ranks (the worst rank's
    value, rankgroups.reduce_rows); average blocks of steps so it has at most MAX_HEATMAP_COLS columns.
    Returns (matrix, row labels: ranks or group labels, steps, the grouping or None, steps per column)."""
    ranks = np.sort(df["rank"].unique())
    steps = np.sort(df["step"].unique())
    ri = np.searchsorted(ranks, df["rank"].to_numpy())
    si = np.searchsorted(steps, df["step"].to_numpy())
    m = np.full((len(ranks), len(steps)), np.nan)
    m[ri, si] = df[value].to_numpy(dtype=float) * scale
    rows, grouping = ranks, None
    if len(ranks) > RG.GROUP_ABOVE:
        # groups beyond MAX_HEATMAP_ROWS (2,048 nodes) are merged in order, a row the worst of a few nodes
        grouping = RG.choose(ctx.analysis.summary or {}, ctx.analysis.pipeline, ranks, MAX_DIST_GROUPS)
        m, rows = RG.reduce_rows(m, ranks, grouping, MAX_HEATMAP_ROWS)
    sb = int(np.ceil(len(steps) / MAX_HEATMAP_COLS))
    if sb > 1:
        S = -(-len(steps) // sb) * sb
        pad = np.full((len(m), S), np.nan)
        pad[:, :len(steps)] = m
        with warnings.catch_warnings():  # an all-NaN block (a rank without those steps) stays NaN, quietly
            warnings.simplefilter("ignore", RuntimeWarning)
            m = np.nanmean(pad.reshape(len(m), S // sb, sb), axis=2)
    return m.astype("float32"), rows, steps[::sb], grouping, sb


def _worst_text(values: pd.Series, unit: str, digits: int = 1) -> str:
    """"rank 5461 (45.2 ms), rank 12 (40.1 ms)": the worst ranks of a per-rank series (rankgroups.WORST_NAMED),
    unless none stands out (synchronous steps: every rank's step time is the job's)."""
    top = RG.worst_ranks(values)
    median = float(values.median())
    if len(top) == 0 or abs(float(top.iloc[0]) - median) <= RG.STANDS_OUT * abs(median):
        return f"none stands out (every rank within {pct(RG.STANDS_OUT)} of the median, {fixed(median, digits)} {unit})"
    return ", ".join(f"rank {r} ({fixed(v, digits)} {unit})" for r, v in top.items())


def rank_step_heatmap(ctx: Context, df: pd.DataFrame, value: str, title: str, label: str, unit: str = "ms",
                      scale: float = 1e3, colorscale: str = "Viridis") -> go.Figure | None:
    """A rank × step heatmap of ``df[value]``. Every heatmap follows one rule: measured steps only (warm-up
    excluded), whatever table its values come from. Beyond GROUP_ABOVE ranks a row is a group of ranks showing its
    worst rank's value, and the title names the worst ranks (by their mean over the measured steps)."""
    df = df.loc[df["step"].isin(ctx.measured["step"].unique()), ["rank", "step", value]]   # 16 M rows: 3 columns
    if df.empty or df[value].isna().all():
        return None
    z, rows, steps, grouping, sb = _bin_matrix(ctx, df, value, scale)
    xt = "step" if sb == 1 else f"step (each column: mean of {sb} steps)"
    who = "rank %{y}"
    if grouping is not None:
        per = -(-grouping.n // MAX_HEATMAP_ROWS)
        yt = f"{grouping.kind} (each row: its worst rank)" if per == 1 else \
            f"{grouping.kind} (each row: the worst rank of {per} of {count(grouping.n)})"
        who = "%{y}"
        means = df.groupby("rank")[value].mean() * scale
        title = f"{title}<br><sup>worst ranks (mean over the measured steps): {_worst_text(means, unit)}</sup>"
        rows = [esc(r) for r in rows]
    else:
        yt = "rank"
    fig = go.Figure(go.Heatmap(
        z=z, x=steps, y=rows, colorscale=colorscale, colorbar={"title": {"text": unit}},
        hovertemplate=f"{who}<br>step %{{x}}<br>{label}{' (worst rank)' if grouping else ''}: %{{z:.2f}} {unit}"
                      "<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    if grouping is None:
        rank_axis(fig, len(rows), "y")
    else:
        fig.update_yaxes(type="category")
    step_axis(fig, len(steps))
    layout(fig, title, height=min(700, 220 + 6 * len(rows)), xtitle=xt, ytitle=yt)
    if grouping is not None:
        fig.update_layout(margin={"t": 70})   # room for the worst ranks under the title
    return fig


def distribution_figure(ctx: Context, values: pd.Series, title: str, what: str, unit: str, *,
                        digits: int = 2) -> go.Figure:
    """Beyond GROUP_ABOVE ranks, a per-rank series (indexed by rank) as one min–max bar per group of ranks with its
    median marked; the hover names the group's worst rank, the title the job's worst ranks."""
    g = RG.choose(ctx.analysis.summary or {}, ctx.analysis.pipeline, values.index, MAX_DIST_GROUPS)
    t = RG.group_stats(values, g)
    labels = [esc(x) for x in t["label"]]
    # a numeric axis with some groups' labels as ticks: thousands of category labels make plotly slow to draw
    x = np.arange(len(t))
    custom = np.stack([[f"{lab} ({r})" for lab, r in zip(labels, t["ranks"])], t["n"].astype(str),
                       t["worst_rank"].astype(str), t["worst"], t["min"], t["median"], t["max"]], axis=1)
    hover = (f"%{{customdata[0]}}<br>{esc(what)} over its %{{customdata[1]}} ranks: min "
             f"%{{customdata[4]:.2f}}, median %{{customdata[5]:.2f}}, max %{{customdata[6]:.2f}} {unit}"
             f"<br>worst: rank %{{customdata[2]}}, %{{customdata[3]:.2f}} {unit}<extra></extra>")
    # the median as a marker and the min–max as an error bar: a line stays visible where 2,048 groups leave a bar
    # less than a pixel wide
    med = t["median"].to_numpy()
    fig = go.Figure(go.Scatter(
        x=x, y=med, mode="markers", name="median rank; bar: min–max over the group's ranks",
        marker={"color": "#1d2330", "size": 3}, showlegend=True, customdata=custom, hovertemplate=hover,
        error_y={"type": "data", "symmetric": False, "array": t["max"].to_numpy() - med,
                 "arrayminus": med - t["min"].to_numpy(), "width": 0, "thickness": 1.5, "color": "#4C78A8"}))
    every = max(1, -(-len(t) // 24))
    fig.update_xaxes(tickvals=x[::every], ticktext=labels[::every], range=[-0.5, len(t) - 0.5])
    worst_of_job = _worst_text(values, unit, digits)
    return layout(fig, f"{title}, per {g.kind}: min–max and median over each one's ranks<br><sup>worst ranks: "
                  f"{worst_of_job}</sup>", xtitle=f"{g.kind} ({count(g.n)} groups of ranks)", ytitle=f"{what} ({unit})",
                  bargap=0.1).update_layout(margin={"t": 70})


# ----------------------------------------------------------------------------------------------------- overlap
def overlap_figure(ctx: Context) -> go.Figure | None:
    """Per rank, mean per measured step: communication hidden under compute vs exposed, and the rank's overlap
    ratio on the right; all three as summary.json states them (``ranks[]``), so the chart and the headline card
    (``overlap.ratio``) cannot disagree. None when the summary has no overlap ratio (no communication measured)."""
    summary = ctx.analysis.summary
    if summary["overlap"]["ratio"] is None:
        return None
    per_rank = pd.DataFrame([{"rank": r["rank"], "comm_s": r["comm_s_per_step"],
                              "exposed_comm_s": r["exposed_comm_s_per_step"], "ratio": r["overlap_ratio"]}
                             for r in summary["ranks"]]).set_index("rank").sort_index()
    g = per_rank[["comm_s", "exposed_comm_s"]].astype(float) * 1e3
    if len(g) > RG.GROUP_ABOVE:
        return distribution_figure(ctx, g["exposed_comm_s"], "Exposed communication per measured step",
                                   "exposed communication per step", "ms")
    hidden = (g["comm_s"] - g["exposed_comm_s"]).clip(lower=0)
    ratio = per_rank["ratio"].astype(float)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Bar(x=g.index, y=hidden, name="overlapped with compute", marker_color="#72B7B2",
                         hovertemplate="rank %{x}<br>overlapped: %{y:.2f} ms/step<extra></extra>"))
    fig.add_trace(go.Bar(x=g.index, y=g["exposed_comm_s"], name="exposed (rank only communicating)",
                         marker_color="#E45756",
                         hovertemplate="rank %{x}<br>exposed: %{y:.2f} ms/step<extra></extra>"))
    fig.add_trace(go.Scatter(x=ratio.index, y=ratio * 100, name="overlap ratio", mode="markers+lines",
                             line={"color": "#333", "width": 1}, marker={"size": 5},
                             hovertemplate="rank %{x}<br>overlap ratio: %{y:.1f} %<extra></extra>"),
                  secondary_y=True)
    fig.update_yaxes(title_text="communication per step (ms)", secondary_y=False)
    fig.update_yaxes(title_text="overlap ratio (%)", range=[0, 105], tickvals=[0, 25, 50, 75, 100],
                     secondary_y=True, showgrid=False)
    rank_axis(fig, len(g))
    return layout(fig, "Communication per rank: overlapped vs exposed (mean per measured step)", barmode="stack",
                  xtitle="rank")


# ---------------------------------------------------------------------------------------------------- timeline
def timeline_window(ctx: Context) -> list[int]:
    """The slowest measured step and its neighbours (TIMELINE_STEPS steps)."""
    job = _job_time_s(ctx, measured=True)
    if job.empty:
        return []
    steps = np.sort(ctx.steps["step"].unique())
    i = int(np.searchsorted(steps, job.idxmax()))
    lo = max(0, min(i - TIMELINE_STEPS // 2, len(steps) - TIMELINE_STEPS))
    return [int(s) for s in steps[lo:lo + TIMELINE_STEPS]]


def timeline_ranks(ctx: Context) -> list[int]:
    ranks = np.sort(ctx.steps["rank"].unique())
    if len(ranks) <= MAX_TIMELINE_RANKS:
        return [int(r) for r in ranks]
    chosen = [int(ranks[0])]
    late = ctx.analysis.flagged
    if late is not None and len(late):
        late = late.sort_values("time_lost_s", ascending=False)
        chosen += [int(r) for r in late["rank"].head(4)]
    comp = ctx.measured.groupby("rank")["compute_s"].mean()
    if len(comp):
        chosen += [int(comp.idxmax()), int(comp.idxmin())]
    for r in ranks[np.linspace(0, len(ranks) - 1, MAX_TIMELINE_RANKS).astype(int)]:
        if len(set(chosen)) >= MAX_TIMELINE_RANKS:
            break
        chosen.append(int(r))
    return sorted(set(chosen))[:MAX_TIMELINE_RANKS]


def timeline_figure(ctx: Context) -> tuple[go.Figure | None, list[int], list[int]]:
    """Per-rank lanes (compute and communication rows) for a window of steps, zoomable, with hover details."""
    window = timeline_window(ctx)
    ranks = timeline_ranks(ctx)
    if not window:
        return None, window, ranks
    run = ctx.run
    # only the rows drawn are read (Parquet row groups skipped by rank and step: docs/scale.md), kernels included
    window_spans = run.read_spans(ranks=ranks, steps=(min(window), max(window)))
    window_spans = window_spans[np.isin(window_spans["step"].fillna(-1).to_numpy("int64"), window)]
    sp = window_spans[~window_spans["kind"].isin(["kernel", "flops_count"])]
    co = ctx.model.collectives
    co = co[np.isin(co["rank"].to_numpy(), ranks) & np.isin(co["step"].fillna(-1).to_numpy("int64"), window)]
    win = ctx.steps[ctx.steps["step"].isin(window)]
    t0 = int(win["start_ns"].min())

    def lanes(r, row):
        return f"rank {r} · {row}"

    kind = sp["kind"].astype(str)
    # pipeline kinds first: they are compute kinds drawn in their own colours
    cat = np.select([kind == "pp_forward", kind == "pp_backward", kind.isin(COMPUTE_KINDS), kind == "user",
                     kind == "data_wait", kind == "comm_wait"],
                    ["pipeline forward", "pipeline backward", "compute", "user span", "data wait",
                     "blocked on communication"], default="")
    sp_start = ctx.model.align(sp["start_ns"].to_numpy(np.int64), sp["rank"].to_numpy(np.int64))
    spans = pd.DataFrame({
        "cat": cat, "lane": [lanes(r, "compute") for r in sp["rank"]],
        "start": (sp_start - t0) / 1e6, "dur": (sp["end_ns"] - sp["start_ns"]).to_numpy() / 1e6,
        "name": [esc(n) for n in sp["name"].astype(str)], "op": kind.to_numpy(), "group": "", "bytes": "",
        "label": [f"{'F' if k == 'pp_forward' else 'B'} s{s} mb{m}" if k.startswith("pp_") else ""
                  for k, s, m in zip(kind, sp["stage"], sp["microbatch"])],
    })
    spans = spans[spans["cat"] != ""]
    op = co["op"].astype(str)
    co_start = ctx.model.align(co["issue_ns"].to_numpy(np.int64), co["rank"].to_numpy(np.int64))
    colls = pd.DataFrame({
        "cat": np.where(op.isin(P2P_OPS), "p2p send/recv", "collective"),
        "lane": [lanes(r, "comm") for r in co["rank"]],
        "start": (co_start - t0) / 1e6, "dur": (co["exit_ns"] - co["issue_ns"]).to_numpy() / 1e6,
        "name": [esc(a) for a in co["api"].astype(str)], "op": op.to_numpy(),
        "group": [esc(g) + (f" → rank {p}" if not pd.isna(p) else "") for g, p in zip(co["group"].astype(str),
                                                                                      co["peer"])],
        "bytes": [fmt_bytes(max(i, o)) for i, o in zip(co["in_bytes"], co["out_bytes"])],
        "label": "",
    })
    bars = pd.concat([spans, colls], ignore_index=True)
    order = [lanes(r, row) for r in ranks for row in ("compute", "comm")]
    bars, order, not_drawn = gpu_view.kernel_lanes(window_spans, bars, order, window, ranks, ctx.model.align,
                                                    t0, esc)
    fig = go.Figure()
    for c, color in {**COLORS, **gpu_view.KERNEL_COLORS, gpu_view.CPU_OUTLINE: "#4C78A8"}.items():
        b = bars[bars["cat"] == c]
        if b.empty:
            continue
        outline = c == gpu_view.CPU_OUTLINE
        fig.add_trace(go.Bar(
            x=b["dur"], base=b["start"], y=b["lane"], orientation="h", name=c,
            # outline: the CPU-side spans over a GPU trace; a kernel bar gets a border so a µs kernel shows
            marker={"color": "rgba(0,0,0,0)" if outline else color, "line": {"color": color, "width": 1.5}}
            if outline else {"color": color, "line": {"color": color, "width": 1}}
            if c in gpu_view.KERNEL_COLORS else {"color": color},
            opacity=0.9 if c != "blocked on communication" else 0.75, text=b["label"], textposition="inside",
            insidetextanchor="middle", textfont={"size": 10, "color": "white"},
            # the duration goes in customdata: on a bar with a base, plotly's %{x} is where the bar ends
            customdata=np.stack([b["name"], b["op"], b["group"], b["bytes"], b["dur"].to_numpy(float)], axis=1),
            hovertemplate=("<b>%{customdata[0]}</b><br>" + c + " · %{customdata[1]}<br>group: %{customdata[2]}"
                           "<br>size: %{customdata[3]}<br>start: %{base:.3f} ms<br>duration: %{customdata[4]:.3f} ms"
                           "<extra></extra>")))
    for step, start in win.groupby("step")["start_ns"].min().items():
        fig.add_vline(x=(start - t0) / 1e6, line={"color": "#999", "dash": "dot", "width": 1})
        fig.add_annotation(x=(start - t0) / 1e6, y=1.0, yref="paper", text=f"step {step}", showarrow=False,
                           xanchor="left", yanchor="bottom", font={"size": 11, "color": "#666"})
    fig.update_yaxes(categoryorder="array", categoryarray=order[::-1], type="category", title_text="rank · lane")
    fig.update_layout(barmode="overlay", bargap=0.25)
    more = f"; the {count(not_drawn)} shortest kernels not drawn" if not_drawn else ""
    return (layout(fig, f"Timeline of steps {window[0]}–{window[-1]} (the slowest measured step and its "
                        f"neighbours{more})", height=140 + 44 * len(order), xtitle=f"time since step {window[0]} "
                        f"started (ms); drag to zoom, double-click to reset"), window, ranks)


# ---------------------------------------------------------------------------------------------------- pipeline
def pipeline_figures(ctx: Context) -> tuple[go.Figure | None, go.Figure | None]:
    """One typical step of the first pipeline replica as measured, above the same ops replayed with no gap between
    them (the analyzer's theoretical schedule); bubble per stage measured vs theoretical."""
    pipe = ctx.analysis.pipeline
    if pipe is None or len(pipe) == 0:
        return None, None
    measured_steps = ctx.measured["step"].unique()
    ops = getattr(ctx.analysis, "pipeline_ops", None)
    pipe_reason = (ctx.analysis.summary.get("pipeline") or {}).get("theoretical_reason")
    sched = None
    if ops is not None and len(ops):
        ops = ops[(ops["replica"] == 0) & ops["stage"].notna() & ops["step"].isin(measured_steps)]
    if ops is not None and len(ops):
        job = _job_time_s(ctx, measured=True)
        job = job[job.index.isin(ops["step"].unique())]
        step = int(job.sub(job.median()).abs().idxmin())  # a typical step
        one = ops[ops["step"] == step]
        start = ctx.model.align(one["start_ns"].to_numpy(np.int64), one["rank"].to_numpy(np.int64))
        first = start.min()
        kind = one["kind"].astype(str).to_numpy()
        stage = one["stage"].astype(int).to_numpy()
        mb = one["microbatch"].fillna(-1).astype(int).to_numpy()
        dur = (one["end_ns"] - one["start_ns"]).to_numpy() / 1e6
        p = int(stage.max()) + 1
        makespan = float(one["ideal_end_s"].max() * 1e3)
        replayed = bool(np.isfinite(makespan))
        sched = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                              subplot_titles=(f"measured, step {step} "
                                              f"({fixed((start + dur * 1e6).max() / 1e6 - first / 1e6)}"
                                              " ms from the first op to the last)",
                                              f"the same ops replayed with no time between them ({fixed(makespan)} ms):"
                                              " the schedule's own bubble" if replayed else
                                              "no replay: " + esc(pipe_reason or "unavailable")))
        rows = [(1, (start - first) / 1e6)] + ([(2, one["ideal_start_s"].to_numpy() * 1e3)] if replayed else [])
        for row, xs in rows:
            for k, name, color in (("pp_forward", "forward", COLORS["pipeline forward"]),
                                   ("pp_backward", "backward", COLORS["pipeline backward"]),
                                   ("other", "other compute (optimizer…)", COLORS["compute"])):
                sel = (kind == k) if k != "other" else ~np.isin(kind, ["pp_forward", "pp_backward"])
                if not sel.any():
                    continue
                sched.add_trace(go.Bar(
                    x=dur[sel], base=xs[sel], y=[f"stage {s}" for s in stage[sel]], orientation="h", name=name,
                    marker_color=color, showlegend=row == 1, legendgroup=name,
                    text=[f"{name[0].upper()}{i}" if i >= 0 else esc(kd) for i, kd in zip(mb[sel], kind[sel])],
                    textposition="inside", insidetextanchor="middle", textfont={"color": "white", "size": 10},
                    customdata=dur[sel],   # %{x} of a bar with a base is its end, not its length
                    hovertemplate=f"%{{y}} {esc(name)} %{{text}}<br>start %{{base:.2f}} ms<br>"
                                  f"duration %{{customdata:.2f}} ms<extra></extra>"), row=row, col=1)
        cats = [f"stage {s}" for s in range(p)][::-1]
        sched.update_yaxes(categoryorder="array", categoryarray=cats, type="category", title_text="pipeline stage")
        sched.update_xaxes(title_text="time since the step's first op (ms)", row=2, col=1)
        layout(sched, "Pipeline schedule: stages × time, measured vs replayed without gaps", height=260 + 60 * p,
               barmode="overlay")
    # the summary's per-stage values (time-weighted over the measured steps), the same numbers as summary.json
    per_stage = (ctx.analysis.summary.get("pipeline") or {}).get("per_stage") or []
    by_stage = pd.DataFrame(per_stage, columns=["stage", "bubble_frac", "theoretical_bubble_frac"]).set_index(
        "stage").astype(float) * 100
    bub = go.Figure([
        go.Bar(x=[f"stage {s}" for s in by_stage.index], y=by_stage["bubble_frac"], name="measured bubble",
               marker_color="#E45756", hovertemplate="%{x}<br>measured: %{y:.1f} % of step<extra></extra>"),
        go.Bar(x=[f"stage {s}" for s in by_stage.index], y=by_stage["theoretical_bubble_frac"],
               name="theoretical bubble of the schedule", marker_color="#BAB0AC",
               hovertemplate="%{x}<br>theoretical: %{y:.1f} % of step<extra></extra>")])
    layout(bub, "Pipeline bubble per stage (over the measured steps)", height=340, xtitle="pipeline stage",
           ytitle="idle share of the step (%)", barmode="group")
    return sched, bub


# -------------------------------------------------------------------------------------------------- stragglers
def straggler_figure(ctx: Context) -> go.Figure | None:
    """Hold-up at collectives per rank and step: the most the rank held its peers up at a collective of that step
    (its lead over the second-latest arrival where it arrived last; 0 where it never did). The analysis keeps each
    instance's last arriver only (docs/scale.md), which is every rank-step's hold-up."""
    arr = ctx.analysis.arrivals
    if arr is None or len(arr) == 0:
        return None
    a = arr[arr["last"].to_numpy(bool)].dropna(subset=["step"]).astype({"step": "int64"})
    a = a.groupby(["rank", "step"], observed=True)["lead_s"].max()
    df = ctx.measured[["rank", "step"]].astype({"step": "int64"})
    df = df.assign(lead_s=a.reindex(pd.MultiIndex.from_frame(df)).fillna(0.0).to_numpy())
    return rank_step_heatmap(ctx, df, "lead_s", "Hold-up at collectives: the last arriver's lead over the "
                             "second-latest (worst per rank and step; 0 = never last)", "hold-up",
                             colorscale="Reds")


# --------------------------------------------------------------------------------------------------------- NVML
def _holoviews():
    """HoloViews with its plotly backend, imported on first use: it costs about 2 s, paid only by runs with NVML."""
    import holoviews as hv
    from holoviews.plotting import plotly as _backend  # noqa: F401  (registers the plotly renderer)
    return hv


def gpu_figure(ctx: Context) -> go.Figure | None:
    """NVML series on the steps' time axis: job step time, SM and memory-bandwidth utilisation, power, SM clock,
    temperature. Composed with HoloViews: one overlay per metric (a curve per GPU, or the p10–p90 band and median
    over GPUs), stacked in a Layout whose panels share the time axis, rendered with its plotly backend."""
    nv = ctx.run.nvml
    if nv.empty:
        return None
    hv = _holoviews()
    host = nv["host"].astype(str)
    t = (ctx.model.align_host(nv["t_ns"].to_numpy(np.int64), host.to_numpy()) - ctx.t0_ns) / 1e9
    gpu_id = host + " · GPU " + nv["gpu"].astype(str)
    metrics = [("sm_util_pct", "SM util (%)"), ("mem_bw_util_pct", "mem-bw util (%)"),
               ("power_w", "power (W)"), ("sm_clock_mhz", "SM clock (MHz)"), ("temp_c", "temp (°C)")]
    tdim = hv.Dimension("t", label="time since the first step started (s)")
    job = ctx.steps.groupby("step")["end_ns"].max().to_frame("end").join(_job_time_s(ctx, measured=False).rename("d"))
    panels = [hv.Curve(((job["end"] - ctx.t0_ns).to_numpy() / 1e9, job["d"].to_numpy() * 1e3), tdim,
                       hv.Dimension("step_ms", label="step time (ms)"), label="job step time")]
    ids = pd.unique(gpu_id)
    span = (t.max() - t.min()) or 1.0
    bins = np.floor((t - t.min()) / span * (MAX_TIME_POINTS - 1)).astype(int)
    per_gpu = len(ids) <= MAX_GPU_LINES
    if per_gpu:
        df = nv[[c for c, _ in metrics]].assign(_t=t, _id=gpu_id.to_numpy(), _bin=bins)
        g = df.groupby(["_id", "_bin"], sort=False).mean(numeric_only=True).reset_index()
        for col, label in metrics:
            dim = hv.Dimension(col, label=label)
            panels.append(hv.Overlay([hv.Curve((one["_t"].to_numpy(), one[col].to_numpy()), tdim, dim,
                                               label=esc(gid)) for gid, one in g.groupby("_id", sort=False)]))
    else:
        df = nv[[c for c, _ in metrics]].assign(_b=bins, _t=t)
        tb = df.groupby("_b")["_t"].mean().to_numpy()
        q = df.groupby("_b")[[c for c, _ in metrics]].quantile([0.1, 0.5, 0.9])
        for col, label in metrics:
            qq = q[col].unstack()
            dim = hv.Dimension(col, label=label)
            panels.append(hv.Area((tb, qq[0.1].to_numpy(), qq[0.9].to_numpy()), tdim, [dim, f"{col}_p90"],
                                  label=f"p10–p90 over {len(ids)} GPUs")
                          * hv.Curve((tb, qq[0.5].to_numpy()), tdim, dim, label="median GPU"))
    layout_hv = hv.Layout(panels).cols(1).opts(shared_axes=True)
    fig = go.Figure(hv.render(layout_hv, backend="plotly"))

    # house style on what HoloViews drew: panels top to bottom in the order composed, one colour per GPU in every
    # panel, a legend entry once, hover with units, one time-axis title at the bottom, no per-panel titles
    palette = ["#4C78A8", "#F58518", "#E45756", "#72B7B2", "#54A24B", "#EECA3B", "#B279A2", "#FF9DA6"]
    colour = {esc(gid): palette[i % len(palette)] for i, gid in enumerate(ids)}
    labels = ["step time (ms)"] + [label for _, label in metrics]
    yaxes = sorted((k for k in fig.layout if k.startswith("yaxis")), key=lambda k: -fig.layout[k].domain[1])
    panel_of = {("y" + k[5:]): i for i, k in enumerate(yaxes)}
    for i, k in enumerate(yaxes):
        fig.layout[k].title = {"text": labels[i] if i < len(labels) else "", "font": {"size": 10}}
    seen: set[str] = set()
    for tr in fig.data:
        label = labels[panel_of.get(tr.yaxis or "y", 0)]
        name = tr.name or ""   # HoloViews names a trace by its element's label, verbatim
        tr.name = tr.legendgroup = name
        tr.showlegend = bool(name) and name not in seen
        seen.add(name)
        if name == "job step time":
            tr.update(line={"color": "#333", "width": 1.5}, mode="lines+markers", marker={"size": 3})
        elif name in colour:
            tr.line = {"color": colour[name], "width": 1}
        elif name.startswith("p10"):
            tr.update(fillcolor="rgba(76,120,168,0.25)", line={"width": 0}, hoverinfo="skip")
            continue
        elif name == "median GPU":
            tr.line = {"color": "#4C78A8", "width": 1}
        tr.hovertemplate = f"{name}<br>t %{{x:.2f}} s<br>{label}: %{{y:.1f}}<extra></extra>"
    bottom = "x" + yaxes[-1][5:] if yaxes else "x"
    fig.layout.annotations = ()
    fig.layout.width = None
    fig.layout.autosize = True   # HoloViews fixes the size; the page's column decides it
    fig.update_xaxes(title_text=None, showticklabels=False, domain=[0.0, 1.0])
    fig.update_yaxes(automargin=True)
    fig.layout["xaxis" + bottom[1:]].update(title={"text": tdim.label}, showticklabels=True)
    return layout(fig, "GPU telemetry (NVML) on the steps' time axis", height=1000)


# ------------------------------------------------------------------------------------------------------- memory
def memory_figure(ctx: Context) -> go.Figure | None:
    mem = ctx.analysis.memory
    if mem is None or len(mem) == 0 or mem["peak_mem_bytes"].isna().all():
        return None
    gib = 2**30
    if len(mem) > RG.GROUP_ABOVE:
        fig = distribution_figure(ctx, mem.set_index("rank")["peak_mem_bytes"].astype(float) / gib,
                                  "Peak memory", "peak memory", "GiB")
        total = mem["device_mem_total_bytes"].astype(float)
        if total.notna().any():
            fig.add_hline(y=float(total.min()) / gib, line={"color": "#E45756", "dash": "dash"},
                          annotation_text=f"smallest device memory {fixed(total.min() / gib)} GiB")
        return fig
    fig = go.Figure(go.Bar(x=mem["rank"], y=mem["peak_mem_bytes"].astype(float) / gib, name="peak memory",
                           marker_color="#4C78A8",
                           customdata=(mem["headroom_frac"].astype(float) * 100).to_numpy(),
                           hovertemplate="rank %{x}<br>peak: %{y:.2f} GiB<br>headroom: %{customdata:.1f} %"
                                         "<extra></extra>"))
    total = mem["device_mem_total_bytes"].astype(float)
    if total.notna().any():
        fig.add_trace(go.Scatter(x=mem["rank"], y=total / gib, mode="lines", name="device memory",
                                 line={"color": "#E45756", "dash": "dash", "shape": "hvh"},
                                 hovertemplate="rank %{x}<br>device total: %{y:.1f} GiB<extra></extra>"))
    rank_axis(fig, len(mem))
    return layout(fig, "Peak memory per rank", height=340, xtitle="rank", ytitle="memory (GiB)")


# ---------------------------------------------------------------------------------------------- numerics health
HEALTH_RANKS_DRAWN = 16      # beyond this many ranks, each step's median over ranks and its min-max band
INCIDENT_COLOR = {"nonfinite": "#E45756", "loss_spike": "#F58518", "grad_norm_explosion": "#B279A2",
                  "divergence": "#54A24B"}


def health_figure(ctx: Context) -> go.Figure | None:
    """Loss and gradient norm per rank over steps (summary.json ``health.per_step``), incidents marked at their
    step."""
    health = (ctx.analysis.summary or {}).get("health") or {}
    rows = pd.DataFrame(health.get("per_step") or [], columns=["rank", "step", "loss", "grad_norm", "lr"])
    panels = [c for c in ("loss", "grad_norm") if rows[c].notna().any()]
    if not panels:
        return None
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=[{"loss": "local loss", "grad_norm": "gradient norm"}[c] for c in panels])
    ranks = sorted(rows["rank"].unique())
    for i, col in enumerate(panels, start=1):
        data = rows.dropna(subset=[col])
        if len(ranks) <= HEALTH_RANKS_DRAWN:
            for r in ranks:
                d = data[data["rank"] == r]
                fig.add_trace(go.Scatter(x=d["step"], y=d[col], mode="lines", name=f"rank {r}", legendgroup=str(r),
                                         showlegend=i == 1, hovertemplate=f"rank {r}<br>step %{{x}}<br>{col} "
                                                                           "%{y:.4g}<extra></extra>"), row=i, col=1)
        else:
            g = data.groupby("step")[col]
            lo, mid, hi = g.min(), g.median(), g.max()
            fig.add_trace(go.Scatter(x=hi.index, y=hi, mode="lines", line={"width": 0}, showlegend=False,
                                     hoverinfo="skip"), row=i, col=1)
            fig.add_trace(go.Scatter(x=lo.index, y=lo, mode="lines", line={"width": 0}, fill="tonexty",
                                     fillcolor="rgba(76,120,168,0.25)", name="min-max over ranks",
                                     showlegend=i == 1, hoverinfo="skip"), row=i, col=1)
            fig.add_trace(go.Scatter(x=mid.index, y=mid, mode="lines", line={"color": "#4C78A8"},
                                     name="median over ranks", showlegend=i == 1), row=i, col=1)
    for inc in health.get("incidents") or []:
        fig.add_vline(x=inc["step"], line={"color": INCIDENT_COLOR.get(inc["kind"], "#888"), "dash": "dash"},
                      annotation_text=inc["kind"].replace("_", " "), annotation_position="top")
    step_axis(fig, int(rows["step"].nunique()))
    return layout(fig, "Loss and gradient norm per rank", height=260 + 160 * len(panels), xtitle=None)
