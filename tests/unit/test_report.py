"""The HTML report, checked in real headless Chromium (Playwright): it loads offline with no console errors and no
network request, every chart draws, the headline cards equal summary.json, findings link to their evidence, and a
run full of hostile names executes nothing. Screenshots go to test-artifacts/ (gitignored).

The analysis comes from the real analyzers (``dtprof.analyzers.summary.analyze``).
"""
from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import SHARED, import_kineto, load
from dtprof.analyzers.summary import analyze
from dtprof.reader import open_run
from dtprof.report import save_report
from dtprof.reports import html as H
from synth import build_run
from synth_report import HOSTILE, build_report_run


def _report(path: Path, **kw) -> tuple[Path, dict]:
    build_report_run(path, **kw)
    run = open_run(path)
    analysis = analyze(run)
    (path / "summary.json").write_text(json.dumps(analysis.summary, default=float))
    return save_report(analysis), analysis


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    base = tmp_path_factory.mktemp("reports")
    return {
        "pipeline": _report(base / "pipeline", world_size=4, steps=12, pipeline=True, slow_rank=2,
                            slow_factor=1.3),
        "hostile": _report(base / "hostile", world_size=2, steps=6, hostile=True),
        "failed": _report(base / "failed", world_size=2, steps=6, status="failed", nvml=False),
    }


@pytest.fixture(scope="module")
def pipeline_page(browser, reports):
    loaded = load(browser, reports["pipeline"][0], "pipeline")
    yield loaded
    loaded.page.close()


@pytest.mark.browser
def test_loads_offline_without_errors_and_draws_every_chart(pipeline_page, reports):
    page = pipeline_page.page
    assert pipeline_page.errors == []
    assert pipeline_page.requests == [reports["pipeline"][0].as_uri()], "the page fetched something"
    charts = page.eval_on_selector_all(
        "div.chart", "els => els.map(e => [e.id, e.getAttribute('data-drawn'), e.querySelectorAll('.main-svg')"
                     ".length, e.getBoundingClientRect().height])")
    ids = {c[0] for c in charts}
    # a pipeline run with NVML has every view
    assert {"fig-step-time", "fig-timeline", "heatmap-step", "heatmap-compute", "heatmap-exposed-comm",
            "fig-overlap", "fig-pipeline-schedule", "fig-pipeline-bubble", "fig-stragglers", "fig-gpu",
            "fig-memory"} <= ids
    for cid, drawn, svgs, height in charts:
        assert drawn == "1" and svgs > 0 and height > 150, f"chart {cid} did not draw"
    # every axis carries a title (units are part of the titles)
    untitled = page.evaluate("""() => [...document.querySelectorAll('div.chart')].flatMap(div =>
        Object.keys(div.layout).filter(k => /^[xy]axis\\d*$/.test(k) && div.layout[k].visible !== false
          && !(div.layout[k].title && div.layout[k].title.text) && !div.layout[k].matches
          && !div.layout[k].overlaying && (div.layout[k].anchor !== undefined || k.length <= 5)
          ).map(k => div.id + '.' + k))""")
    # shared-x subplots title only their bottom axis; the rest must be titled
    assert [u for u in untitled if not re.match(r"fig-(gpu|pipeline-schedule)\.xaxis\d*$", u)] == []


def _expected(summary: dict, paths):
    v = H.pick(summary, paths)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


@pytest.mark.browser
def test_headline_cards_equal_summary_json(pipeline_page, reports):
    path = reports["pipeline"][0]
    summary = json.loads((path.parent / "summary.json").read_text())
    cards = pipeline_page.page.eval_on_selector_all(
        ".card", "els => els.map(e => [e.dataset.key, e.dataset.value, e.querySelector('.value').innerText])")
    shown = {k: (v, text) for k, v, text in cards}
    numbers = 0
    for key, _, paths, kind in H.HEADLINES:
        want = _expected(summary, paths)
        value, text = shown[key]
        if want is None:
            assert value == "" and text == "n/a"
            continue
        numbers += 1
        assert math.isclose(float(value), want, rel_tol=1e-12), key
        if kind == "frac":
            assert text == f"{100 * want:.1f} %", key
        elif kind == "s":
            assert text == f"{want * 1e3:.1f} ms", key   # the synthetic steps last tens of ms
    assert numbers >= 7, "the pipeline run should fill MFU, step times, throughput, comm, overlap and bubble"
    n_strag = len(summary["stragglers"] if isinstance(summary["stragglers"], list) else
                  summary["stragglers"].get("ranks", []))
    # rank 2 is 1.3x slow, but every rank is its own pipeline stage: no rank does the same work, so none is a
    # straggler by impact (analyzers/stragglers.py; a slow stage is the balanced_stages scenario's)
    assert shown["stragglers"][0] == str(n_strag)


@pytest.mark.browser
def test_findings_most_severe_first_and_link_to_drawn_evidence(pipeline_page, reports):
    page = pipeline_page.page
    findings = page.eval_on_selector_all(
        "ol.findings li", "els => els.map(e => [e.className, (e.querySelector('a.evidence-link') || {}).hash])")
    analysis = reports["pipeline"][1]
    assert len(findings) == len(analysis.findings)
    ranks = [H.SEVERITY_ORDER.get(cls, 5) for cls, _ in findings]
    assert ranks == sorted(ranks)
    linked = [h for _, h in findings if h]
    assert linked, "no finding links to a chart"
    for anchor in linked:
        target = page.query_selector(anchor)
        assert target is not None, anchor
        if anchor.startswith("#card-") or anchor == "#headline":
            continue
        assert target.query_selector("div.chart[data-drawn='1'], table.data"), f"{anchor} shows no evidence"


def test_findings_evidence_reads_in_units_not_as_a_python_dict(pipeline_page, reports):
    # each finding's evidence as "key value" pairs in their units (it once showed the dict's repr with 17 digits)
    texts = pipeline_page.page.eval_on_selector_all("ol.findings li div.evidence", "els => els.map(e => e.innerText)")
    analysis = reports["pipeline"][1]
    with_evidence = [f for f in sorted(analysis.findings, key=lambda f: H.SEVERITY_ORDER[f["severity"]])
                     if f.get("evidence")]
    assert len(texts) == len(with_evidence) > 0
    for text, f in zip(texts, with_evidence):
        assert "{'" not in text and "'}" not in text, text
        for key, value in f["evidence"].items():
            assert key in text, (key, text)
            if "frac" in key.split("_") and isinstance(value, float):
                assert f"{key} {100 * value:.1f} %" in text, (key, value, text)
            elif key.endswith("_s") and isinstance(value, float):
                assert f"{key} {H.fmt_s(value)}" in text, (key, value, text)


@pytest.mark.browser
def test_timeline_hover_names_op_group_bytes_and_duration(pipeline_page):
    page = pipeline_page.page
    hover = page.evaluate("""() => {
        const div = document.getElementById('fig-timeline');
        const i = div.data.findIndex(t => t.name === 'collective');
        Plotly.Fx.hover(div, [{curveNumber: i, pointNumber: 0}]);
        return div.querySelector('.hoverlayer').textContent; }""")
    assert "all_reduce" in hover and "group: 0" in hover and "25.0 MiB" in hover and "duration:" in hover
    assert "ms" in hover


@pytest.mark.browser
def test_hostile_names_show_as_text_and_execute_nothing(browser, reports):
    path = reports["hostile"][0]
    loaded = load(browser, path, "hostile")
    page = loaded.page
    try:
        assert loaded.errors == []
        assert loaded.requests == [path.as_uri()]
        assert page.evaluate("window.__pwned") is None
        # no element was created from the payloads
        assert page.evaluate("document.querySelectorAll('img, [onerror], [onload], [onmouseover]').length") == 0
        assert page.inner_text("#command") == shlex.join(["torchrun", HOSTILE["command"]])
        assert HOSTILE["host"] in page.inner_text("header")
        assert HOSTILE["device"] in page.inner_text("header")
        hover = page.evaluate("""() => {
            const div = document.getElementById('fig-timeline');
            const i = div.data.findIndex(t => t.name === 'compute');
            const j = div.data[i].customdata.findIndex(c => c[1] === 'forward');
            Plotly.Fx.hover(div, [{curveNumber: i, pointNumber: j}]);
            return div.querySelector('.hoverlayer').textContent; }""")
        assert HOSTILE["span"] in hover, "the span name should show as typed in the hover"
        raw = path.read_text()
        for payload in HOSTILE.values():
            assert payload not in raw, "a payload reached the HTML unescaped"
    finally:
        page.close()


@pytest.mark.browser
def test_failed_run_header_says_why(browser, reports):
    loaded = load(browser, reports["failed"][0], "failed")
    try:
        assert loaded.errors == []
        header = loaded.page.inner_text("header")
        assert "failed" in header and "timeout in all_reduce #1042" in header and "exit code 1" in header
        assert "No NVML samples" in loaded.page.inner_text("#gpu")
    finally:
        loaded.page.close()


def test_page_inlines_the_cartesian_bundle_of_the_plotly_js_version_figures_are_written_for(monkeypatch):
    # the cartesian bundle (a third of the bytes the browser parses before any chart draws) when its version is
    # the installed plotly's; another version's figures get that version's full bundle
    import plotly.offline
    from plotly.offline import get_plotlyjs, get_plotlyjs_version

    js = H._plotly_js()
    assert f"plotly.js (cartesian - minified) v{get_plotlyjs_version()}" in js[:200]
    assert len(js) < len(get_plotlyjs()) / 2
    monkeypatch.setattr(plotly.offline, "get_plotlyjs_version", lambda: "0.0.1")
    assert H._plotly_js() == get_plotlyjs()


def test_json_in_script_cannot_close_the_tag():
    text = json.dumps({"name": "</script><script>alert(1)</script>", "x": "a & b\u2028"})
    safe = H.json_for_script(text)
    assert "<" not in safe and ">" not in safe and "&" not in safe and "\u2028" not in safe
    assert json.loads(safe) == json.loads(text)


@pytest.mark.browser
def test_charts_draw_lazily_first_screen_then_on_scroll(browser, reports):
    """Without drawAll: the first viewport's charts draw; a chart far below draws once scrolled to (or idle)."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    try:
        page.goto(reports["pipeline"][0].as_uri())
        page.wait_for_selector("body[data-first-screen=done]", state="attached", timeout=60_000)
        first = page.evaluate("window.dtprofReport.times.firstScreen")
        assert "fig-memory" not in first, "the last chart is far below the first viewport"
        for cid in first:
            assert page.get_attribute(f"#{cid}", "data-drawn") == "1"
        page.eval_on_selector("#fig-memory", "e => e.scrollIntoView()")
        page.wait_for_selector("#fig-memory[data-drawn='1']", timeout=30_000)
        page.wait_for_selector("body[data-charts=done]", state="attached", timeout=60_000)  # the rest, when idle
    finally:
        page.close()


def test_large_run_is_binned_and_windowed(tmp_path, capsys, browser):
    """64 ranks x 600 steps: heatmaps keep every rank and bin steps to <= 250 columns, stored as 16-bit codes that
    the page decodes back to the binned values; the timeline shows <= 16 ranks and 3 steps, the slow rank among
    them; the progress bar goes to stderr."""
    from dtprof.reports import figures as F

    path = build_report_run(tmp_path / "big", world_size=64, steps=600, slow_rank=37, slow_factor=1.5)
    run = open_run(path)
    analysis = analyze(run)
    out = save_report(analysis, out_path=tmp_path / "r.html", progress=True)
    err = capsys.readouterr().err
    assert "dtprof report [" in err and "10/10" in err
    figs = {m.group(1): m.group(2) for m in re.finditer(
        r'<div class="chart" id="([^"]+)" data-fig="(figdata-\d+)"', out.read_text())}
    text = out.read_text()

    def fig(cid):
        m = re.search(rf'<script type="application/json" id="{figs[cid]}">(.*?)</script>', text, re.S)
        return json.loads(m.group(1))

    hm = fig("heatmap-step")["data"][0]
    shape = hm["z"]["dtprof_quantized"]["shape"]
    assert shape[0] == 64 and shape[1] <= F.MAX_HEATMAP_COLS
    ctx = F.make_context(open_run(path), analysis)
    want = F._bin_matrix(ctx, ctx.measured, "duration_s", 1e3)[0]
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    try:
        page.goto(out.as_uri())
        page.wait_for_selector("body[data-first-screen=done]", state="attached", timeout=60_000)
        page.eval_on_selector("#heatmap-step", "e => e.scrollIntoView()")
        page.wait_for_selector("#heatmap-step[data-drawn='1']", timeout=60_000)
        drawn = page.evaluate("document.getElementById('heatmap-step').data[0].z")
    finally:
        page.close()
    import numpy as np
    got = np.array([[np.nan if v is None else v for v in row] for row in drawn], dtype=float)
    assert got.shape == want.shape
    assert np.array_equal(np.isnan(got), np.isnan(want))
    resolution = (np.nanmax(want) - np.nanmin(want)) / 65534
    assert np.nanmax(np.abs(got - want)) <= resolution  # within one 16-bit step (plus float32 rounding)
    tl = fig("fig-timeline")
    lanes = {y for t in tl["data"] for y in t["y"]} if isinstance(tl["data"][0]["y"], list) else set()
    ranks = {int(re.match(r"rank (\d+)", y).group(1)) for y in lanes}
    assert 2 <= len(ranks) <= F.MAX_TIMELINE_RANKS and 37 in ranks and 0 in ranks
    assert "steps" in tl["layout"]["title"]["text"]


def _values(y):
    """A trace's values, whether plotly holds them as a list or as a typed array ({dtype, bdata: base64})."""
    import base64

    import numpy as np
    if isinstance(y, dict):
        return np.frombuffer(base64.b64decode(y["bdata"]), dtype=y["dtype"])
    return np.asarray(y, dtype=float)


@pytest.mark.parametrize("world_size", [4, 16])   # a line per GPU up to 8 GPUs, else the band over GPUs
def test_nvml_view_panels_share_one_time_axis(tmp_path, world_size):
    # The NVML view is composed with HoloViews: step time on top, then one panel per metric, every panel on the
    # same time axis, one legend entry per series, hover with the panel's unit.
    from dtprof.reports import figures as F

    build_run(tmp_path / "r", world_size=world_size, steps=10, nvml_interval_ms=5, throttle_rank=1,
              device_type="cuda", device_name="NVIDIA H100 80GB HBM3")
    run = open_run(tmp_path / "r")
    fig = F.gpu_figure(F.make_context(run, analyze(run)))
    lay = fig.layout
    yaxes = sorted((k for k in lay if k.startswith("yaxis")), key=lambda k: -lay[k].domain[1])
    assert [lay[k].title.text for k in yaxes] == ["step time (ms)", "SM util (%)", "mem-bw util (%)", "power (W)",
                                                  "SM clock (MHz)", "temp (°C)"]
    xaxes = [k for k in lay if k.startswith("xaxis")]
    assert len(xaxes) == 6 and all(lay[k].matches in (None, "x") for k in xaxes)
    assert sum(1 for k in xaxes if lay[k].matches is None) == 1
    names = [t.name for t in fig.data if t.showlegend]
    assert len(names) == len(set(names)) and "job step time" in names
    clock_axis = "y" + yaxes[4][5:]
    clocks = [t for t in fig.data if (t.yaxis or "y") == clock_axis and t.hovertemplate]
    assert clocks and all("SM clock (MHz)" in t.hovertemplate for t in clocks)
    if world_size == 4:   # the throttled GPU's own line sits at its 1400 MHz
        assert len(names) == 5
        lows = {t.name: float(_values(t.y).min()) for t in clocks}
        assert lows == {"host0 · GPU 0": 1980.0, "host0 · GPU 1": 1400.0, "host0 · GPU 2": 1980.0,
                        "host0 · GPU 3": 1980.0}
    else:
        assert any(n.startswith("p10–p90 over 16 GPUs") for n in names) and "median GPU" in names


# ---- issue 13: numbers the page shows are the analysis' numbers -------------------------------------------------

@pytest.mark.browser
def test_tooltips_show_each_bars_length_as_its_duration(pipeline_page):
    # every horizontal bar chart with a base (timeline, pipeline schedule): the hover's duration is the bar's
    # length, not where it ends (an optimizer bar of 15.2 ms once read "duration 186.514 ms")
    page = pipeline_page.page
    checked = []
    for cid in ("fig-timeline", "fig-pipeline-schedule"):
        bars = page.evaluate(f"""() => document.getElementById('{cid}')._fullData   // arrays decoded
            .filter(t => t.type === 'bar' && t.orientation === 'h' && t.x.length)
            .map(t => [t.index, t.x.length - 1, t.xaxis + t.yaxis])""")
        for curve, point, subplot in bars:   # the last bar of each trace: far from 0, so end and length differ
            page.wait_for_timeout(60)   # plotly throttles hover events to one per 50 ms
            got = page.evaluate(f"""() => {{
                const div = document.getElementById('{cid}');
                Plotly.Fx.unhover(div);
                Plotly.Fx.hover(div, [{{curveNumber: {curve}, pointNumber: {point}}}], '{subplot}');
                // the bar plotly hovered (of overlapping bars, the closest wins)
                const hovered = (div._hoverdata || [])[0];
                if (!hovered) return null;
                const p = hovered.fullData, k = hovered.pointNumber;
                return [p.name, div.querySelector('.hoverlayer').textContent, Number(p.x[k]), Number(p.base[k])];
            }}""")
            if got:
                checked.append([cid, *got])
    assert {c[0] for c in checked} == {"fig-timeline", "fig-pipeline-schedule"}
    for fig, name, text, length, base in checked:
        m = re.search(r"duration:? ([\d.]+) ms", text)
        assert m, (fig, name, text)
        shown = float(m.group(1))
        assert shown == pytest.approx(length, abs=0.006), (fig, name, text)
        assert base > 1 and abs(shown - (base + length)) > 0.5, "the duration must not be the bar's end"


@pytest.mark.browser
def test_breakdown_bars_on_the_first_screen_add_up_to_each_ranks_step(pipeline_page, reports):
    page = pipeline_page.page
    assert "fig-breakdown" in page.evaluate("window.dtprofReport.times.firstScreen")
    summary = json.loads((reports["pipeline"][0].parent / "summary.json").read_text())
    bars = page.evaluate("""() => { const div = document.getElementById('fig-breakdown');
        return div._fullData.map(t => [t.name, Array.from(t.x), Array.from(t.y)]); }""")   # decoded arrays
    names = [b[0] for b in bars]
    # the synthetic run's ranks are GPU ranks: their breakdown has the waiting-for-the-GPU part
    assert names == ["forward", "backward", "optimizer", "waiting for the GPU", "exposed communication",
                     "data wait", "pipeline bubble", "other"]
    for r in summary["ranks"]:
        label = f"rank {r['rank']}"
        stacked = sum(y[x.index(label)] for _, x, y in bars)
        assert stacked == pytest.approx(r["step_time_s_mean"] * 1e3, rel=0.01)
        for (_, x, y), part in zip(bars, summary["breakdown"]["parts"]):
            assert y[x.index(label)] == pytest.approx(r["breakdown_s_per_step"][part] * 1e3, rel=1e-6)
    # the pipeline ranks' idle time is their bubble; the bubble finding says it is about that part and pp
    bubble = sum(r["breakdown_s_per_step"]["bubble"] for r in summary["ranks"])
    assert bubble > 0
    about = page.eval_on_selector_all("ol.findings li[data-id^=pipeline_]",
                                      "els => els.map(e => [e.dataset.part, e.dataset.dim, e.innerText])")
    assert about and all(p == "bubble" and d == "pp" and "About: part: bubble · mesh dimension: pp" in t
                         for p, d, t in about)


def _step_ticks(page, ids):
    return page.evaluate(f"""() => {json.dumps(list(ids))}.map(id =>
        [id, [...document.getElementById(id).querySelectorAll('.xtick text')].map(t => t.textContent)])""")


@pytest.mark.browser
def test_small_run_step_ticks_are_whole_numbers(browser, tmp_path):
    path, _ = _report(tmp_path / "small", world_size=2, steps=4, nvml=False)   # 3 measured steps: 1, 2, 3
    loaded = load(browser, path, "small-ticks")
    try:
        for cid, labels in _step_ticks(loaded.page, ["fig-step-time", "heatmap-step", "heatmap-compute"]):
            assert labels and all(re.fullmatch(r"\d+", t) for t in labels), (cid, labels)
    finally:
        loaded.page.close()


@pytest.mark.browser
def test_step_axes_whole_numbers_and_one_warmup_rule(pipeline_page, reports):
    page = pipeline_page.page
    for cid, labels in _step_ticks(page, ["fig-step-time", "heatmap-step", "fig-stragglers"]):
        assert labels and all(re.fullmatch(r"\d+", t) for t in labels), (cid, labels)
    summary = json.loads((reports["pipeline"][0].parent / "summary.json").read_text())
    measured = set(summary["steps"]["per_step_index"])
    for cid in ("heatmap-step", "heatmap-compute", "heatmap-exposed-comm", "fig-stragglers"):
        xs = page.evaluate(f"Array.from(document.getElementById('{cid}')._fullData[0].x)")
        assert set(xs) == measured, cid   # measured steps only, whatever table the heatmap reads


def test_step_time_axis_fits_the_measured_steps_not_the_warmup():
    # an FSDP-like run: step 0 takes 2.7 s of set-up, the measured steps ~0.2 s
    from types import SimpleNamespace

    import pandas as pd

    from dtprof.reports import figures as F

    d = [2.7] + [0.2, 0.21, 0.19, 0.2, 0.22]
    steps = pd.DataFrame({"rank": [0] * 6 + [1] * 6, "step": list(range(6)) * 2, "duration_s": d + d,
                          "warmup": [True] + [False] * 5 + [True] + [False] * 5})
    job = pd.DataFrame({"step": range(6), "time_s": d, "measured": [False] + [True] * 5})
    fig = F.step_time_figure(SimpleNamespace(steps=steps, job=job))
    lo, hi = fig.layout.yaxis.range
    assert lo == 0 and 220 <= hi < 300, "the axis must fit the measured steps' 190-220 ms"
    assert any("step 0 2,700 ms" in a.text for a in fig.layout.annotations), "the off-scale warm-up is named"
    assert fig.layout.xaxis.dtick == 1


def test_breakdown_groups_beyond_64_ranks_naming_the_worst():
    from dtprof.reports.breakdown import WORST_BARS, breakdown_table

    parts = ["forward", "backward", "optimizer", "exposed_comm", "data_wait", "bubble", "other"]

    def summary(n, hosts):
        ranks = []
        for r in range(n):
            b = dict.fromkeys(parts, 0.01)
            b["forward"] = 0.05 if r == 77 else 0.01
            ranks.append({"rank": r, "host": f"node{r * hosts // n}", "step_time_s_mean": sum(b.values()),
                          "compute_s_per_step": b["forward"] + b["backward"] + b["optimizer"],
                          "breakdown_s_per_step": b})
        return {"ranks": ranks, "breakdown": {"parts": parts}}

    by_host = breakdown_table(summary(128, 16))
    assert len(by_host) == 16 and by_host.loc[9, "label"] == "node9 · worst 77"
    assert by_host.loc[9, "ranks"] == "ranks 72–79" and by_host.loc[9, "worst_rank"] == 77
    assert by_host.loc[9, "forward"] == pytest.approx((0.05 + 0.01 * 7) / 8)   # the mean of the node's ranks
    # one host, no stage or mesh: the mean of all ranks, then the ranks computing longest, each its own bar
    bars = breakdown_table(summary(130, 1))
    assert bars.loc[0, "label"] == "all (mean)" and bars.loc[0, "n"] == 130 and bars.loc[0, "ranks"] == "ranks 0–129"
    assert bars.loc[0, "forward"] == pytest.approx((0.05 + 0.01 * 129) / 130)
    assert bars.loc[1, "label"] == "rank 77" and bars.loc[1, "ranks"] == "rank 77 (node0)"
    assert bars.loc[1, "forward"] == 0.05
    assert len(bars) == 1 + WORST_BARS
    assert len(breakdown_table(summary(64, 1))) == 64   # up to 64 ranks: a bar each


def test_breakdown_marks_each_ranks_wait_for_a_cpu_beside_its_bar():
    from dtprof.reports.breakdown import breakdown_figure

    parts = ["forward", "backward", "other"]
    ranks = [{"rank": r, "host": "h", "step_time_s_mean": 0.03, "compute_s_per_step": 0.02,
              "breakdown_s_per_step": dict.fromkeys(parts, 0.01), "cpu_wait_s_per_step": w}
             for r, w in enumerate([0.0005, 0.004])]
    fig = breakdown_figure({"ranks": ranks, "breakdown": {"parts": parts}})
    marks = [t for t in fig.data if t.name == "waiting for a CPU (inside the parts)"]
    assert len(marks) == 1 and list(marks[0].y) == pytest.approx([0.5, 4.0])   # ms, one per rank's bar
    for r in ranks:                                 # a run that did not measure it (not Linux, older run): no marker
        r["cpu_wait_s_per_step"] = None
    fig = breakdown_figure({"ranks": ranks, "breakdown": {"parts": parts}})
    assert [t.name for t in fig.data] == ["forward", "backward", "other"]


def test_imported_trace_header_has_no_empty_host_or_none(tmp_path, browser):
    from dtprof.reports.terminal import format_summary_text

    if not SHARED.exists():
        pytest.skip("shared Kineto traces not present")
    trace = SHARED
    run = open_run(import_kineto(tmp_path / "imp", trace / "cpu_only_rank34.json.gz"))
    analysis = analyze(run)
    text = format_summary_text(analysis.summary)
    assert "None" not in text.splitlines()[0] and "on unnamed hosts" in text
    out = save_report(analysis)
    loaded = load(browser, out, "imported")
    try:
        header = loaded.page.inner_text("header")
        assert "None" not in header and not re.search(r"hosts\s*1:\s*\n", header), header
        assert loaded.page.inner_text("#hosts") == "not recorded in an imported trace"
        assert loaded.page.inner_text("#duration").startswith("n/a (an imported trace")
    finally:
        loaded.page.close()


def test_collectives_rows_carry_their_mesh_dimension(tmp_path):
    # DDP-like synthetic run on a world group outside any mesh, then the same run with its group named "dp"
    run = build_run(tmp_path / "r", world_size=2, steps=4)
    opened = open_run(run)
    a = analyze(opened)
    assert {c["mesh_dim"] for c in a.summary["collectives"]} == {"(none)"}
    html_text = save_report(a).read_text()
    assert "<th class=\"t\">mesh dimension</th>" in html_text


@pytest.mark.browser
def test_what_if_list_on_the_first_screen_beside_the_breakdown(pipeline_page, reports):
    # the ranked what-if list is in the first viewport, beside the breakdown chart, row for row summary.json's
    page = pipeline_page.page
    page.evaluate("window.scrollTo(0, 0)")
    summary = json.loads((reports["pipeline"][0].parent / "summary.json").read_text())
    assert summary["what_if"]
    rows = page.eval_on_selector_all("#what-if tbody tr", "els => els.map(e => [...e.cells].map(c => c.innerText))")
    assert [r[2] for r in rows] == [f"{w['saving_frac']:.0%}" for w in summary["what_if"]]
    assert [r[1] for r in rows] == [f"{w['predicted_step_s'] * 1e3:.1f} ms" for w in summary["what_if"]]
    box = page.eval_on_selector("#what-if", "e => e.getBoundingClientRect().toJSON()")
    chart = page.eval_on_selector("#breakdown", "e => e.getBoundingClientRect().toJSON()")
    assert box["top"] < 900 and box["left"] >= chart["right"] - 1   # beside it, on the first screen


# ---- issue 19: beyond a few hundred ranks the per-rank charts group ranks and name the worst ----------------------

@pytest.mark.browser
def test_a_thousand_ranks_grouped_by_node_with_the_worst_ranks_named(tmp_path, browser):
    # 1,024 ranks on 128 nodes of 8 (beyond rankgroups.GROUP_ABOVE): rank 677 computes 1.3x longer (the straggler),
    # rank 300 arrives 8 ms late at every step's all-reduces. Per-rank charts show one group per node, and the
    # injected ranks are named, as a user would look for them, in the real page.
    from dtprof.reports import rankgroups as RG

    slow, late, n = 677, 300, 1024
    path = build_report_run(tmp_path / "k", world_size=n, steps=8, hosts=n // 8, slow_rank=slow, slow_factor=1.3,
                            late_rank=late, late_ms=8.0, jitter_frac=0.02, nvml=False)
    run = open_run(path)
    analysis = analyze(run)
    out = save_report(analysis)
    loaded = load(browser, out, "1024-ranks")
    page = loaded.page
    try:
        assert loaded.errors == [] and loaded.requests == [out.as_uri()]
        assert n > RG.GROUP_ABOVE
        # the ranks computing longest: the straggler first, with its node
        first = page.eval_on_selector("#worst-ranks tbody tr", "e => [...e.cells].map(c => c.innerText)")
        assert first[:2] == [str(slow), f"host{slow // 8}"]
        # by node: the straggler's node first, naming it as the worst rank
        by_node = page.eval_on_selector_all(".by-group[data-kind='node'] tbody tr",
                                            "els => els.map(e => [...e.cells].map(c => c.innerText))")
        assert by_node[0][0] == f"host{slow // 8}" and by_node[0][-1] == str(slow)
        assert by_node[0][1] == f"ranks {slow // 8 * 8}–{slow // 8 * 8 + 7}"
        # heatmaps: a row per node, each the worst of its 8 ranks; titles name the worst ranks
        figs = page.evaluate("""() => ['heatmap-compute', 'fig-stragglers', 'fig-overlap', 'fig-memory'].map(id => {
            const d = document.getElementById(id);
            const t = d._fullData[0];   // typed arrays decoded
            return [id, d.layout.title.text, Array.from(t.y), t.z ? Array.from(t.z, r => Array.from(r)) : null,
                    d.layout.yaxis.title.text, Array.from(t.x).length]; })""")
        compute, late_fig, overlap, memory = figs
        assert len(compute[2]) == n // 8 and compute[4] == "node (each row: its worst rank)"
        assert f"rank {slow} (" in compute[1].split("worst ranks")[1].split(",")[0]   # named first
        z = np.array([[np.nan if v is None else v for v in row] for row in compute[3]], dtype=float)
        row_means = np.nanmean(z, axis=1)
        hot = compute[2].index(f"host{slow // 8}")
        assert row_means[hot] > 1.2 * np.median(row_means), "the straggler's node row must stand out"
        named = late_fig[1].split("worst ranks")[1]
        assert f"rank {slow} (" in named and f"rank {late} (" in named   # the two that arrive late
        for fig in (overlap, memory):   # min/median/max per node
            assert fig[5] == n // 8 and "per node" in fig[1] and "worst ranks: rank " in fig[1]
        # the timeline is a bounded slice that includes the straggler, and says so
        note = page.inner_text("#timeline p.note")
        assert f"of the {n:,} ranks" in note and str(slow) in note.split("—")[0]
    finally:
        page.close()


def test_rank_groupings_by_stage_and_mesh_coordinate(reports):
    # the pipeline run (one host, 4 stages): grouping by pipeline stage; a mesh's coordinates give a grouping per
    # dimension (analyzers/mesh.py rank_coords); with neither, consecutive ranks
    from dtprof.reports import rankgroups as RG

    analysis = reports["pipeline"][1]
    g = RG.choose(analysis.summary, analysis.pipeline, range(4), 64)
    assert g.kind == "pipeline stage" and g.labels == ["stage 0", "stage 1", "stage 2", "stage 3"]
    summary = {"ranks": [{"rank": r, "host": "h"} for r in range(4)],
               "mesh": {"rank_coords": {"ranks": [0, 1, 2, 3], "coords": {"dp": [0, 0, 1, 1], "tp": [0, 1, 0, 1]}}}}
    kinds = {x.kind: x for x in RG.groupings(summary)}
    assert set(kinds) == {"dp coordinate", "tp coordinate"}
    assert kinds["tp coordinate"].codes.tolist() == [0, 1, 0, 1] and kinds["tp coordinate"].labels == ["tp 0", "tp 1"]
    t = RG.group_stats(pd.Series([1.0, 5.0, 2.0, 3.0], index=range(4)), kinds["tp coordinate"])
    assert t[["label", "n", "min", "max", "worst_rank"]].values.tolist() == [["tp 0", 2, 1.0, 2.0, 2],
                                                                             ["tp 1", 2, 3.0, 5.0, 1]]
    assert RG.choose({"ranks": summary["ranks"]}, None, range(4), 2).kind == "consecutive ranks"
