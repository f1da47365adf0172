"""The offline HTML report: one self-contained file that opens from file:// on an air-gapped machine.

    render(analysis, options=None) -> str     (dtprof/report.py save_report writes it: the run's report.html)

The page: a header (command, world size, hosts and devices, versions, duration, status and why: the analysis'
``run`` block and triage verdict), the step breakdown as one stacked bar per rank (reports/breakdown.py), headline
cards (MFU with its FLOP and peak sources, step time p50/p90, throughput, exposed communication, overlap, pipeline
bubble, stragglers), the findings most severe first (each links to the chart with its evidence), then one section
per view (see ``SECTIONS``). The page only formats the ``Analysis``: it never runs an analyzer (or triage) again.
Figures are plotly (``reports/figures.py``); plotly.js (its cartesian bundle, ``_plotly_js``) is inlined once, so
the page makes no network request.

Decisions
- Headline numbers are read from ``analysis.summary`` (summary.json) only, never recomputed here, so the page and
  ``dtprof summary`` cannot disagree. ``HEADLINES`` lists the summary keys read; a missing key shows "n/a".
- ``finding["chart"]`` names a section anchor from ``SECTIONS`` (or a card id ``card-<key>``, or ``headline``);
  an unknown anchor is shown without a link.
- Escaping: every run-supplied string in the page text goes through ``html.escape``; figure JSON lives in
  ``<script type="application/json">`` with ``<``, ``>``, ``&`` and U+2028/2029 written as ``\\u`` escapes so data can
  never close the tag; strings inside figures are HTML-escaped too (figures.esc), since plotly renders a subset of
  HTML in labels.
- HoloViews (plotly backend) composes the NVML telemetry view (an overlay per metric, stacked on one shared time
  axis, figures.gpu_figure); the other views are single plotly figures or subplots. HoloViews is imported only when
  a run has NVML samples, since the import adds ~2 s to a report build.
- Charts draw lazily (assets/report.js): the first viewport's at once, others when scrolled near or when the
  browser is idle; ``window.dtprofReport.drawAll()`` (or ``#draw-all`` in the URL, or printing) draws them all.
  Each chart div reserves its figure's height so the page does not jump.
- Heatmaps over ``QUANT_MIN_CELLS`` cells are stored as 16-bit codes (``quantize_heatmap_z``), half the bytes of
  float32, at 1/65,534 of the colour range; report.js decodes them.
- Large runs: see the scale rules in figures.py; beyond ``rankgroups.GROUP_ABOVE`` ranks per-rank charts show
  groups of ranks and a "Ranks by group" section names the worst ranks (reports/rankgroups.py,
  docs/report-scale.md). Progress goes to stderr (``Progress``) when asked or when the run is large.
"""
from __future__ import annotations

import base64
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dtprof.analyzers.stragglers import PERSISTENT_RULE, TRANSIENT_RULE
from dtprof.reports import rankgroups as RG
from dtprof.reports.fmt import (
    MISSING,
    count,
    esc,
    fixed,
    fmt_bytes,
    fmt_evidence,
    fmt_frac,
    fmt_s,
    fmt_value,
    pct,
    pct1,
    plain,
    sig,
)

ASSETS = Path(__file__).parent / "assets"
# plotly.js's cartesian bundle, from npm plotly.js-cartesian-dist-min (MIT, assets/plotly-cartesian.LICENSE);
# update it with the plotly package (same plotly.js version, see _plotly_js)
CARTESIAN_JS = ASSETS / "plotly-cartesian.min.js"
# The page loads nothing from the network: inline scripts and styles only, images and fonts as data: URIs.
CSP = ("default-src 'none'; script-src 'unsafe-inline' 'unsafe-eval'; style-src 'unsafe-inline'; "
       "img-src data: blob:; font-src data:")

# anchor -> section title, in page order
SECTIONS = {
    "steps": "Step time",
    "ranks": "Ranks by group",
    "timeline": "Timeline",
    "kernels": "GPU time and top kernels",
    "heatmaps": "Rank × step heatmaps",
    "overlap": "Communication overlap",
    "pipeline": "Pipeline schedule and bubble",
    "stragglers": "Stragglers",
    "collectives": "Collectives",
    "mesh": "Parallelism dimensions (DeviceMesh)",
    "gpu": "GPU telemetry (NVML)",
    "memory": "Memory",
    "memory-ledger": "Memory ledger and what would fit",
    "health": "Numerics health",
}

# (key, label, summary paths tried in order, kind). Kinds: frac (shown as %), s (time), rate, count.
HEADLINES = [  # (card id, label, summary key — docs/summary-schema.md, unit kind)
    ("mfu", "MFU", ["mfu.value"], "frac"),
    ("step_time_p50", "Step time p50", ["steps.time_s.p50"], "s"),
    ("step_time_p90", "Step time p90", ["steps.time_s.p90"], "s"),
    ("tokens_per_s", "Tokens / s", ["steps.tokens_per_s"], "rate"),
    ("samples_per_s", "Samples / s", ["steps.samples_per_s"], "rate"),
    ("exposed_comm", "Exposed communication", ["overlap.exposed_comm_frac"], "frac"),
    ("overlap", "Comm/compute overlap", ["overlap.ratio"], "frac"),
    ("gpu_idle", "GPU idle", ["gpu_time.idle_frac"], "frac"),
    ("bubble", "Pipeline bubble", ["pipeline.bubble_frac"], "frac"),
]
SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}   # the severities analyzers/findings.py emits


# ------------------------------------------------------------------------------------------------ small helpers
def pick(d: dict, paths: list[str]):
    """The first value found at a dotted path of a nested dict, else None."""
    for path in paths:
        cur: Any = d
        for part in path.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if cur is not None:
            return cur
    return None


def json_for_script(obj_json: str) -> str:
    """JSON text made safe inside <script>: no '<', '>' or '&' can appear (so no '</script>'), same value."""
    return (obj_json.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


class Progress:
    """A one-line progress bar on stderr ("report [#####.....] 5/10 heatmaps")."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled
        self.t0 = time.monotonic()
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / self.total)
        line = (f"dtprof report [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label} "
                f"({fixed(time.monotonic() - self.t0, unit='s')})")
        sys.stderr.write(("\r" + line.ljust(90)) if self.tty else line + "\n")
        if self.tty and self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


# ------------------------------------------------------------------------------------------------------ the page
QUANT_MIN_CELLS = 10_000   # heatmaps with more cells than this are stored quantized (see figure_json)
QUANT_NAN = 65535


def quantize_heatmap_z(z: np.ndarray) -> dict:
    """A float matrix as 16-bit codes: value = offset + code × scale, NaN = code 65535. The resolution is 1/65,534
    of the matrix's range, far below the 2 decimals the hover shows for any realistic range; half the bytes of
    float32. Decoded by report.js (``dequantize``) before plotting."""
    finite = np.isfinite(z)
    lo = float(z[finite].min()) if finite.any() else 0.0
    hi = float(z[finite].max()) if finite.any() else 0.0
    scale = (hi - lo) / (QUANT_NAN - 1) or 1.0
    codes = np.full(z.shape, QUANT_NAN, dtype="<u2")
    codes[finite] = np.rint((z[finite] - lo) / scale).astype("<u2")
    return {"dtprof_quantized": {"bdata": base64.b64encode(codes.tobytes()).decode("ascii"),
                                 "shape": list(z.shape), "offset": lo, "scale": scale}}


def figure_json(fig) -> str:
    """The figure as plotly JSON, with large heatmaps' z quantized to 16 bits (``quantize_heatmap_z``): at 1,024
    ranks the four heatmaps are most of the page's bytes, and the browser's load time grows with the bytes."""
    from plotly.io.json import to_json_plotly

    d = fig.to_dict()
    for trace in d.get("data", []):
        z = trace.get("z")
        if trace.get("type") == "heatmap" and isinstance(z, dict) and z.get("dtype") in ("f4", "f8"):
            shape = [int(n) for n in str(z["shape"]).split(",")]
            if math.prod(shape) > QUANT_MIN_CELLS:
                arr = np.frombuffer(base64.b64decode(z["bdata"]), dtype="<" + z["dtype"]).reshape(shape)
                trace["z"] = quantize_heatmap_z(arr.astype("float64"))
    return to_json_plotly(d)


class _Page:
    def __init__(self):
        self.figures: list[str] = []   # <script type=application/json> blocks
        self.n = 0

    def figure(self, fig, anchor_id: str) -> str:
        if fig is None:
            return ""
        self.n += 1
        data_id = f"figdata-{self.n}"
        self.figures.append(f'<script type="application/json" id="{data_id}">{json_for_script(figure_json(fig))}'
                            f"</script>")
        # the final height is reserved before the chart draws (charts draw lazily, see assets/report.js)
        height = fig.layout.height or 450
        return (f'<div class="chart" id="{esc(anchor_id)}" data-fig="{data_id}" '
                f'style="min-height:{int(height)}px"></div>')


def _header(identity: dict, summary: dict) -> str:
    """The run's identity (``Analysis.identity``: command, devices, versions) and its state from the analysis
    (summary ``run`` and ``triage``): nothing is derived here."""
    command = identity["command"]
    command = shlex.join(map(str, command)) if isinstance(command, (list, tuple)) else str(command)
    srun = summary.get("run") or {}
    status = srun.get("status") or "unknown"   # the worst node's (analyzers/summary.py worst_status)
    reason = ""
    if status in ("failed", "hung", "killed"):   # say why: the analysis' triage verdict
        reason = (summary.get("triage") or {}).get("message") or summary.get("triage_reason") or ""
    code = srun.get("exit_code")
    code_html = f" (exit code {esc(code)})" if code is not None else ""
    dev_text = ", ".join(f"{n} × {esc(name or 'unknown device')}" for name, n in identity["devices"].items()) \
        or "unknown"
    versions = identity["versions"]
    # a version the run could not read is shown with the launcher's reason (``<name>_reason``), not as "None"
    def version(k: str, v) -> str:
        why = versions.get(f"{k}_reason")
        return f"{esc(k)} {esc(v)}" if v is not None else f"{esc(k)} {MISSING}" + (f" ({esc(why)})" if why else "")

    ver_text = " · ".join(version(k, v) for k, v in versions.items() if not k.endswith("_reason")) or "not recorded"
    duration = srun.get("duration_s")
    duration_text = (fmt_s(duration) if duration is not None
                     else f"{MISSING} ({srun.get('duration_s_reason') or 'unknown'})")
    started = srun.get("start_time") or ""
    hosts = srun.get("hosts") or []
    host_text = (f"{len(hosts)}: " + ", ".join(esc(h) for h in hosts[:8]) +
                 (f" and {len(hosts) - 8} more" if len(hosts) > 8 else "")) if hosts else \
        esc(srun.get("hosts_reason") or "not recorded")
    cls = status if status in ("completed", "failed", "hung", "killed") else "other"
    reason_html = f' <span class="reason">{esc(reason)}</span>' if reason else ""
    return f"""<header class="top">
<h1>dtprof report — {esc(identity["name"])}</h1>
<div><code id="command">{esc(command)}</code></div>
<dl class="meta">
<dt>status</dt><dd><span class="status {cls}" id="status">{esc(status)}</span>{reason_html}{code_html}</dd>
<dt>duration</dt><dd id="duration">{esc(duration_text)}{' · started ' + esc(started) if started else ''}</dd>
<dt>world size</dt><dd id="world-size">{esc(srun.get("world_size"))}</dd>
<dt>hosts</dt><dd id="hosts">{host_text}</dd>
<dt>devices</dt><dd>{dev_text}</dd>
<dt>versions</dt><dd>{ver_text}</dd>
</dl></header>"""


def gpu_card_subs(summary: dict) -> dict:
    """Card notes that say where the overlap figure comes from and what GPU idle is made of."""
    from dtprof.reports.gpu import overlap_labels

    labels = overlap_labels(summary)
    subs = {"overlap": "; ".join(f"{esc(label)}: {fmt_frac(v)} ({esc(src)})" for label, src, v in labels)}
    g = summary.get("gpu_time")
    if g:
        c = g.get("idle_causes") or {}
        ordinary = (f"; an ordinary step, which the profiler did not slow: at most {fmt_frac(g['step_idle_frac'])}"
                    if g.get("step_idle_frac") is not None else "")
        subs["gpu_idle"] = (f"no kernel running, share of the traced steps' kernel time (HTA); of it host wait "
                            f"{fmt_frac(c.get('host_wait'))}, kernel wait {fmt_frac(c.get('kernel_wait'))}, "
                            f'other {fmt_frac(c.get("other"))}{ordinary} <a href="#kernels">details</a>')
    else:
        subs["gpu_idle"] = esc(summary.get("gpu_time_reason") or "no GPU kernel trace")
    return subs


def _cards(summary: dict) -> str:
    out = []
    mfu = summary.get("mfu") or {}
    subs = {
        "mfu": " · ".join(x for x in (
            f"FLOPs: {esc(mfu.get('flops_source'))}" if mfu.get("flops_source") else "",
            f"peak: {esc(mfu.get('peak_source'))}" if mfu.get("peak_source") else "",
            f"{sig(mfu['peak_flops'] / 1e12)} TFLOP/s {esc(mfu.get('dtype') or '')}" if mfu.get("peak_flops") else "",
        ) if x) if mfu.get("value") is not None else esc(mfu.get("value_reason") or "unknown"),
        "step_time_p50": "median of the job's step time (slowest rank), warm-up excluded",
        "step_time_p90": "90th percentile of the job's step time",
        # where the count comes from (the summary's own words: "inferred: ..." or the user's annotation)
        **{k: "whole job" + (f"; {esc(src)}" if (src := pick(summary, [f"steps.{k}_source"])) else "")
           for k in ("tokens_per_s", "samples_per_s")},
        "exposed_comm": esc(pick(summary, ["overlap.exposed_comm_frac_reason"])
                            or "share of step time a rank could only communicate (mean over ranks and steps)"),
        "overlap": "share of communication hidden under compute",
    }
    ev = summary.get("evaluation")
    if ev:   # outside every step: say so where a reader would look for it
        subs["step_time_p50"] += (f"; evaluation between steps not included ({esc(ev.get('stretches'))} "
                                  f"stretch(es), {fmt_s(ev.get('total_s'))} on rank {esc(ev.get('rank'))})")
    samp = pick(summary, ["steps.sampling"]) or {}
    if (pick(summary, ["steps.boundary_only_count"]) or pick(summary, ["steps.detail_skipped_count"])) \
            and samp.get("statement"):   # what sampling recorded in detail
        subs["step_time_p50"] += f"; sampling: {esc(samp['statement'])}"
        subs["exposed_comm"] += "; over the steps recorded in full detail"
    subs.update(gpu_card_subs(summary))
    theo = pick(summary, ["pipeline.theoretical_bubble_frac"])
    over = pick(summary, ["pipeline.overhead_frac"])
    subs["bubble"] = ((f"= theoretical (the schedule itself) {fmt_frac(theo)} + overhead (p2p and gaps between "
                       f"ops) {fmt_frac(over)}, shares of the step") if theo is not None and over is not None else
                      "no pipeline parallelism" if pick(summary, ["pipeline.bubble_frac"]) is None else
                      esc(pick(summary, ["pipeline.theoretical_reason"]) or ""))
    for key, label, paths, kind in HEADLINES:
        value = pick(summary, paths)
        num = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        unit = "/s"  # the label names what is counted (tokens, samples)
        shown = fmt_value(num, kind, unit)
        out.append(f'<div class="card{" na" if num is None else ""}" id="card-{key}" data-key="{key}" '
                   f'data-value="{"" if num is None else repr(float(num))}"><div class="label">{esc(label)}</div>'
                   f'<div class="value">{esc(shown)}</div><div class="sub">{subs.get(key, "")}</div></div>')
    strag = summary.get("stragglers")
    if isinstance(strag, dict):
        strag = strag.get("ranks") or strag.get("stragglers") or []
    strag = strag if isinstance(strag, list) else []
    names = ", ".join(f"rank {esc(s.get('rank'))} ({esc(s.get('kind', ''))})" for s in strag[:4]
                      if isinstance(s, dict))
    late = [s for s in summary.get("transient_lateness") or [] if isinstance(s, dict)]
    transient = ("; transient lateness (not a straggler): " + ", ".join(f"rank {esc(s.get('rank'))}" for s in late[:4])
                 if late else "")
    out.append(f'<div class="card" id="card-stragglers" data-key="stragglers" data-value="{len(strag)}">'
               f'<div class="label">Stragglers</div><div class="value">{len(strag)}</div>'
               f'<div class="sub">{names or "no rank flagged"}{transient}'
               f'{" <a href=&quot;#stragglers&quot;>details</a>".replace("&quot;", chr(34)) if strag else ""}'
               f"</div></div>")
    return "\n".join(out)


def _findings(findings: list, anchors: set) -> str:
    if not findings:
        return '<p class="empty">No findings: nothing in this run crossed a threshold.</p>'
    items = sorted(findings, key=lambda f: SEVERITY_ORDER[f["severity"]])
    out = ['<ol class="findings">']
    for f in items:
        sev = f["severity"]
        chart = f.get("chart") or ""   # a section id of SECTIONS
        link = (f' <a href="#{esc(chart)}" class="evidence-link">show the evidence</a>' if chart in anchors
                else "")
        ev = f'<div class="evidence">Evidence: {esc(fmt_evidence(f["evidence"]))}</div>' if f.get("evidence") else ""
        rec = f'<div class="rec">What to do: {esc(f.get("recommendation"))}</div>' if f.get("recommendation") else ""
        about = " · ".join(x for x in (f"part: {esc(f['part'])}" if f.get("part") else "",
                                       f"mesh dimension: {esc(f['dim'])}" if f.get("dim") else "") if x)
        about = f'<div class="about">About: {about}</div>' if about else ""
        out.append(f'<li class="{esc(sev)}" data-id="{esc(f.get("id"))}" data-part="{esc(f.get("part") or "")}" '
                   f'data-dim="{esc(f.get("dim") or "")}"><span class="sev">{esc(sev)}</span>'
                   f'{esc(f.get("message"))}{link}{about}{ev}{rec}</li>')
    out.append("</ol>")
    return "\n".join(out)


def _table(df, columns: list[tuple[str, str, Callable[[Any], str] | None]], limit: int, what: str) -> str:
    """An HTML table: columns are (column, header, formatter or None for text)."""
    if df is None or len(df) == 0:
        return f'<p class="empty">No {what}.</p>'
    rows = []
    for rec in df.head(limit).to_dict("records"):
        cells = []
        for col, _, f in columns:
            v = rec.get(col)
            cells.append(f'<td class="t">{esc(v)}</td>' if f is None else f"<td>{esc(f(v))}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    head = "".join(f'<th class="{"t" if f is None else ""}">{esc(h)}</th>' for _, h, f in columns)
    more = f'<p class="note">{len(df) - limit} more rows not shown.</p>' if len(df) > limit else ""
    return f'<table class="data"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>{more}'


def _section(anchor: str, body: str, note: str = "") -> str:
    note_html = f'<p class="note">{note}</p>' if note else ""
    return f'<section id="{anchor}"><h2>{esc(SECTIONS[anchor])}</h2>{note_html}{body}</section>'


def _ranks_by_group(analysis) -> str:
    """Beyond GROUP_ABOVE ranks: the ranks computing the longest per step, named with their node, stage and mesh
    coordinates, then per grouping (reports/rankgroups.py) its groups with the longest worst rank."""
    import pandas as pd

    rows = [r for r in (analysis.summary or {}).get("ranks") or [] if r.get("compute_s_per_step") is not None]
    if not rows:
        return '<p class="empty">No measured steps.</p>'
    ranks = pd.DataFrame(rows).set_index("rank", drop=False)
    compute = ranks["compute_s_per_step"].astype(float)
    groupings = RG.groupings(analysis.summary, analysis.pipeline)
    worst = ranks.loc[RG.worst_ranks(compute, RG.WORST_NAMED * 2).index].copy()
    cols: list[tuple[str, str, Callable[[Any], str] | None]] = [("rank", "rank", plain)]
    for g in groupings:
        worst[g.kind] = [g.labels[c] if c == c else "" for c in g.codes.reindex(worst.index)]
        cols.append((g.kind, g.kind, None))
    cols += [("compute_s_per_step", "compute / step", fmt_s), ("exposed_comm_s_per_step", "exposed comm / step",
                                                                fmt_s),
             ("step_time_s_mean", "step (mean)", fmt_s), ("compute_score", "compute score (1 = fastest)",
                                                          lambda v: fixed(v, 2))]
    out = ['<h3>Ranks computing the longest per step</h3><div id="worst-ranks">',
           _table(worst, cols, RG.WORST_NAMED * 2, "ranks"), "</div>"]
    for g in groupings or [RG.consecutive(compute.index, 64)]:
        t = RG.group_stats(compute, g).sort_values("max", ascending=False)
        out.append(f'<h3>By {esc(g.kind)} ({count(g.n)} groups): the {min(RG.WORST_NAMED, g.n)} with the longest worst '
                   f'rank</h3><div class="by-group" data-kind="{esc(g.kind)}">')
        out.append(_table(t, [("label", g.kind, None), ("ranks", "ranks", None), ("min", "min", fmt_s),
                              ("median", "median", fmt_s), ("max", "max", fmt_s),
                              ("worst_rank", "worst rank", plain)], RG.WORST_NAMED, "groups"))
        out.append("</div>")
    return "".join(out)


@dataclass
class _Parts:
    """What every section of the page reads: the page (its figures), the figures' context, the analysis, the run."""
    page: _Page
    ctx: Any                  # reports/figures.py Context
    analysis: Any             # dtprof.analyzers.summary.Analysis
    run: Any                  # dtprof.rundir.run.Run (raw spans for the timeline, the world size)
    summary: dict
    n_ranks: int


def _steps_section(p: _Parts) -> str:
    from dtprof.reports import figures as F

    return _section("steps", p.page.figure(F.step_time_figure(p.ctx), "fig-step-time"),
                    f"{p.n_ranks} ranks; the band shows the spread over ranks, the red line the job's step "
                    "time (a step ends when its slowest rank ends).")


def _ranks_section(p: _Parts) -> str:
    if p.n_ranks <= RG.GROUP_ABOVE:
        return ""
    return _section("ranks", _ranks_by_group(p.analysis), (
        f"{count(p.n_ranks)} ranks: beyond {RG.GROUP_ABOVE} ranks the per-rank charts below show groups of ranks "
        "(node, pipeline stage or mesh coordinate), each group's spread and its worst rank. Ranks are compared "
        "by compute per step, not step time: in synchronous training every rank's step lasts as long as the "
        "slowest rank's (docs/metrics.md, Stragglers)."))


def _timeline_section(p: _Parts) -> str:
    from dtprof.reports import figures as F

    tl, window, tl_ranks = F.timeline_figure(p.ctx)
    world = p.run.world_size or p.n_ranks
    note = (f"Ranks shown: {', '.join(map(str, tl_ranks))}" + (f" — a slice of {len(tl_ranks)} of the {count(world)} "
            "ranks: rank 0, the stragglers, the slowest and fastest computing ranks, then an even sample"
            if len(tl_ranks) < world else "") +
            ". Each rank has a compute row and a communication row; red marks time blocked on communication. "
            "Where a GPU trace exists, each CUDA stream gets a row of kernels (compute and communication "
            "coloured apart) under the rank's CPU-side spans, drawn as outlines.")
    return _section("timeline", p.page.figure(tl, "fig-timeline") or '<p class="empty">No steps.</p>', note)


def _kernels_section(p: _Parts) -> str:
    from dtprof.reports.gpu import tables_html

    gpu_tables = tables_html(p.summary)
    if not gpu_tables:
        return ""
    return _section("kernels", gpu_tables, "From the trace's GPU kernels, HolisticTraceAnalysis' "
                    "definitions (docs/metrics.md, GPU time): idle = no kernel running on any stream, "
                    "compute = computation kernels, non-compute = only communication / memory / sync "
                    "kernels running; shares of kernel time. Window: "
                    f"{esc(pick(p.summary, ['gpu_time.window']))} (options.gpu_window).")


def _heatmaps_section(p: _Parts) -> str:
    from dtprof.reports import figures as F

    hm = [p.page.figure(F.rank_step_heatmap(p.ctx, p.ctx.steps, col, title, label, colorscale=cs), fid)
          for col, title, label, cs, fid in (
              ("duration_s", "Step time per rank and step", "step time", "Viridis", "heatmap-step"),
              ("compute_s", "Compute time per rank and step", "compute", "Viridis", "heatmap-compute"),
              ("exposed_comm_s", "Exposed communication per rank and step", "exposed comm", "Reds",
               "heatmap-exposed-comm"))]
    return _section("heatmaps", "".join(hm), "Measured steps only (warm-up excluded). A slow rank shows "
                    "as a dark row in compute time while the others wait on it in exposed communication.")


def _overlap_section(p: _Parts) -> str:
    from dtprof.reports import figures as F

    return _section("overlap", p.page.figure(F.overlap_figure(p.ctx), "fig-overlap")
                    or '<p class="empty">No communication recorded.</p>',
                    "Overlap ratio = |comm ∩ compute| ÷ |comm|; exposed = comm not hidden under compute "
                    "(docs/metrics.md, compute/communication overlap).")


def _pipeline_section(p: _Parts) -> str:
    from dtprof.reports import figures as F

    sched, bub = F.pipeline_figures(p.ctx)
    if sched is None and bub is None:
        return ""
    return _section("pipeline", p.page.figure(sched, "fig-pipeline-schedule") +
                    p.page.figure(bub, "fig-pipeline-bubble"),
                    "Bubble of a stage = 1 − its compute ÷ its measured step time = theoretical (the "
                    "idle time the schedule itself needs with these op times, replayed with no gap "
                    "between ops) + overhead (the rest: p2p transfers, gaps between ops), all as "
                    "shares of the measured step, summed over the measured steps.")


def _stragglers_section(p: _Parts) -> str:
    from dtprof.reports import figures as F

    st = p.analysis.flagged
    shown = st.sort_values("time_lost_s", ascending=False) if st is not None and len(st) else st
    strag_table = _table(shown, [("rank", "rank", plain), ("host", "host", None), ("device", "GPU", None),
                                   ("kind", "kind", None), ("reason", "why (share of measured steps)", None),
                                   ("time_lost_s", "peers' arrival wait", fmt_s),
                                   ("compute_score", "compute score (1 = fastest)", lambda v: fixed(v, 2))],
                         50, "rank flagged as a straggler")
    return _section("stragglers", strag_table + p.page.figure(F.straggler_figure(p.ctx), "fig-stragglers"),
                    "Lateness = a rank's arrival at a collective minus the first rank's arrival (clocks "
                    "aligned across hosts). " + esc(PERSISTENT_RULE.capitalize()) + "; "
                    + esc(TRANSIENT_RULE) + ".")


def _collectives_section(p: _Parts) -> str:
    coll = p.analysis.collectives
    if coll is not None and len(coll):
        coll = coll.sort_values("total_s", ascending=False)
    return _section("collectives", _table(coll, [
        ("op", "op", None), ("group", "group", None), ("mesh_dim", "mesh dimension", None),
        ("size_bucket", "message size", None),
        ("count", "count", count), ("total_s", "total time", fmt_s), ("transfer_s", "transfer time", fmt_s),
        ("algbw_gbps", "algbw (GB/s)", lambda v: fixed(v, 2)), ("busbw_gbps", "busbw (GB/s)", lambda v: fixed(v, 2)),
        ("link_peak_frac", "of link peak", pct), ("share_of_comm", "share of comm time",
                                                             pct1)], 60, "collectives recorded"),
        "algbw = S ÷ transfer time, busbw = algbw × the nccl-tests factor (docs/metrics.md); transfer time excludes "
        "waiting for late peers.")


def _mesh_section(p: _Parts) -> str:
    mesh = p.analysis.summary.get("mesh")
    if not mesh:
        return ""
    import pandas as pd

    per_dim = pd.DataFrame(mesh["per_dim"]).sort_values("comm_s_per_step", ascending=False)
    pipes = pd.DataFrame(mesh.get("pipeline_groups") or [])
    if len(pipes):
        pipes = pipes.sort_values("bubble_frac_max", ascending=False)   # past the table's limit: worst first
        pipes["ranks"] = pipes["ranks"].map(lambda r: ", ".join(map(str, r)))
    shape = " × ".join(f"{n} {d}" for n, d in zip(mesh.get("shape") or [], mesh.get("dims") or []))
    body = _table(per_dim, [
        ("dim", "mesh dimension", None), ("comm_s_per_step", "communication / step", fmt_s),
        ("exposed_comm_s_per_step", "exposed communication / step", fmt_s),
        ("bytes_per_step", "bytes / step", fmt_bytes)],
        20, "mesh dimensions")
    if len(pipes):
        body += "<h3>Pipeline groups</h3>" + _table(pipes, [
            ("ranks", "ranks (stages)", None), ("bubble_frac", "bubble (mean)", pct1),
            ("bubble_frac_max", "bubble (worst stage-step)", pct1)], 64, "pipeline groups")
    return _section("mesh", body, f"DeviceMesh {esc(shape) or '(shape not recorded)'}; the costliest "
                    f"dimension is <b>{esc(mesh.get('costliest_dim'))}</b> (most exposed "
                    "communication per step). Exposed communication is split across dimensions in "
                    "proportion to each one's share of a rank-step's communication time.")


def _gpu_section(p: _Parts) -> str:
    from dtprof.reports import figures as F

    gpu = p.analysis.gpu
    gpu_fig = F.gpu_figure(p.ctx)
    gpu_tbl = _table(gpu.sort_values("sm_util_mean_pct") if gpu is not None and len(gpu) else None, [
        ("host", "host", None), ("gpu", "GPU", plain),
        ("sm_util_mean_pct", "SM util (mean)", lambda v: fixed(v, unit="%")),
        ("mem_bw_util_mean_pct", "mem-bw util (mean)", lambda v: fixed(v, unit="%")), ("idle_frac", "idle", pct),
        ("throttled_s", "throttled", fmt_s), ("power_w_mean", "power (mean)", lambda v: fixed(v, 0, unit="W"))],
        16, "NVML samples (no GPU, or NVML unavailable)")
    return _section("gpu", p.page.figure(gpu_fig, "fig-gpu") + gpu_tbl, "Lowest SM utilisation first.")


def _memory_section(p: _Parts) -> str:
    from dtprof.reports import figures as F

    return _section("memory", p.page.figure(F.memory_figure(p.ctx), "fig-memory")
                    or '<p class="empty">No memory peaks recorded.</p>',
                    "Peak = CUDA allocator peak on GPU, process RSS high-water mark on CPU.")


def _memory_ledger_section(p: _Parts) -> str:
    from dtprof.reports import memory as M

    mem = p.summary.get("memory") or {}
    if not mem.get("ranks"):
        return ""
    return _section("memory-ledger", p.page.figure(M.ledger_figure(mem), "fig-memory-ledger")
                    + p.page.figure(M.over_steps_figure(mem), "fig-memory-steps") + M.ledger_html(mem), M.NOTE)
def _health_section(p: _Parts) -> str:
    """Loss and gradient norm per rank over steps with the incidents marked, and the incidents (analyzers/health.py,
    summary.json ``health``)."""
    import pandas as pd

    from dtprof.reports import figures as F
    from dtprof.reports.fmt import fmt_num

    health = p.summary.get("health") or {}
    if not health.get("per_step") and not health.get("incidents"):
        return ""
    incidents = pd.DataFrame(health.get("incidents") or [], columns=["step", "kind", "ranks", "message"])
    incidents["ranks"] = [", ".join(map(str, r)) for r in incidents["ranks"]]
    table = _table(incidents, [("step", "step", plain), ("kind", "incident", None), ("ranks", "ranks", None),
                               ("message", "what dtprof saw", None)], 20, "numerics incidents")
    test = health.get("spike_test") or {}
    fp = health.get("fingerprint") or {}
    fp_note = (f"replica fingerprints compared {fp.get('compared', 0)} time(s), every {fp['interval']} steps"
               if fp.get("interval") and fp.get("replica_groups") else
               f"replica fingerprints not compared ({fp.get('reason') or 'no fingerprint'})")
    last = max(health.get("per_step") or [{}], key=lambda e: e.get("step", -1))
    return _section("health", p.page.figure(F.health_figure(p.ctx), "fig-health") + table, (
        f"Each rank's local loss (before any reduction) and the gradient norm its clip_grad_norm_ returned; learning "
        f"rate at the last step {fmt_num(last.get('lr'))}. Spikes: a robust z over {test.get('window')} steps above "
        f"{test.get('z')} (docs/metrics.md, Numerics health); {fp_note}."))


# The page's sections after the headline, in order: each builder returns its <section> ("" when the run has nothing
# for it), then the progress bar moves on by the label beside it (None: no step of its own). A new view is a
# builder here, an anchor and title in SECTIONS, and its figure in reports/figures.py.
REPORT_SECTIONS: tuple[tuple[Callable[[_Parts], str], str | None], ...] = (
    (_steps_section, "step time"), (_ranks_section, None), (_timeline_section, "timeline"),
    (_kernels_section, None), (_heatmaps_section, "heatmaps"), (_overlap_section, "overlap"),
    (_pipeline_section, "pipeline"), (_stragglers_section, "stragglers"), (_collectives_section, "collectives"),
    (_mesh_section, None), (_gpu_section, "gpu"), (_memory_section, "memory"),
    (_memory_ledger_section, None),
    (_health_section, None),
)


def _notices(notices: list[str]) -> str:
    """The analysis' notices (analyzers/summary.py run_notices), or "" when there are none."""
    return ("<section id=\"notices\"><h2>Notices</h2><ul class=\"notices\">" +
            "".join(f"<li>{esc(n)}</li>" for n in notices) + "</ul></section>") if notices else ""


def render(analysis, options: dict | None = None) -> str:
    """The page of ``analysis`` (analyzers/summary.py ``Analysis``; its run ``analysis.run`` read only for raw
    spans: the timeline), the renderer contract (docs/architecture.md); ``options``: ``progress``, a progress bar
    on stderr (None or absent: only for runs with more than 50,000 rank-steps). dtprof/report.py writes it."""
    from dtprof.reports import figures as F
    from dtprof.reports.breakdown import breakdown_figure
    from dtprof.reports.whatif import whatif_html

    show = (options or {}).get("progress")
    if show is None:
        show = len(analysis.run.steps) > 50_000   # counting the spans would read them all
    progress = Progress(10, bool(show))
    run = analysis.run
    page = _Page()
    summary = analysis.summary or {}
    # first on the page, so the first screen says where the step went
    breakdown_chart = page.figure(breakdown_figure(summary, analysis.pipeline), "fig-breakdown")
    breakdown_chart = f'<div id="breakdown">{breakdown_chart}</div>' if breakdown_chart else ""
    breakdown_chart = (f'<div class="headline-row">{breakdown_chart}'
                       f'{whatif_html(summary, analysis.unnamed_suspects)}</div>')
    ctx = F.make_context(run, analysis)
    progress.step("context")
    parts = _Parts(page, ctx, analysis, run, summary, ctx.steps["rank"].nunique())
    sections = []
    for build, label in REPORT_SECTIONS:
        section = build(parts)
        if section:
            sections.append(section)
        if label:
            progress.step(label)

    anchors = {s.split('"')[1] for s in sections} | {"headline"} | {f"card-{k}" for k, *_ in HEADLINES} | \
        {"card-stragglers"} | ({"breakdown"} if breakdown_chart else set())
    notice_html = _notices(analysis.notices)
    toc = "".join(f'<a href="#{a}">{esc(t)}</a>' for a, t in SECTIONS.items() if a in anchors)
    plotly_js = _plotly_js()
    css = (ASSETS / "report.css").read_text()
    js = (ASSETS / "report.js").read_text()
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>dtprof report — {esc(analysis.identity["name"])}</title>
<style>{css}</style></head>
<body>
{_header(analysis.identity, summary)}
<nav class="toc"><a href="#headline">Headline</a><a href="#findings">Findings</a>{toc}</nav>
<main>
<section id="headline"><h2>Headline</h2><div class="cards">{_cards(summary)}</div>{breakdown_chart}</section>
<section id="findings"><h2>Findings</h2><p class="note">Most severe first.</p>
{_findings(analysis.findings or [], anchors)}</section>
{notice_html}
{"".join(sections)}
</main>
<script>{plotly_js}</script>
{"".join(page.figures)}
<script>{js}</script>
</body></html>
"""


def _plotly_js() -> str:
    """plotly.js for the page: its cartesian partial bundle (``CARTESIAN_JS``: every figure here is a bar, scatter
    or heatmap; 1.5 MB instead of the full 4.8 MB, which the browser must parse before any chart draws: at
    16,384 ranks the page is usable in half the time, docs/report-scale.md) when it is the plotly.js version the
    installed plotly writes figures for, else that version's full bundle from the plotly package."""
    from plotly.offline import get_plotlyjs, get_plotlyjs_version

    js = CARTESIAN_JS.read_text(encoding="utf-8")
    if f"(cartesian - minified) v{get_plotlyjs_version()}\n" not in js[:200]:
        js = get_plotlyjs()
    if "</script" in js.lower():  # never seen, but an inlined script must not close its own tag
        js = js.replace("</script", "<\\/script").replace("</SCRIPT", "<\\/SCRIPT")
    return js
