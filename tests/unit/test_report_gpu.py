"""The report on an imported real GPU trace (nccl_single_rank.json.gz of conftest.SHARED), in real headless
Chromium: GPU idle on the first screen, kernels drawn per CUDA stream under CPU-side outlines, the GPU time and
top-kernel tables, and both overlap figures labelled with their source."""
from __future__ import annotations

import json

import pytest

from conftest import SHARED, import_kineto, load, needs_shared
from dtprof.analyzers.summary import analyze
from dtprof.reader import open_run
from dtprof.report import save_report

pytestmark = [needs_shared, pytest.mark.browser]


@pytest.fixture(scope="module")
def gpu_report(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpureport")
    run = open_run(import_kineto(d / "run", SHARED / "nccl_single_rank.json.gz"))
    analysis = analyze(run)
    (d / "run" / "summary.json").write_text(json.dumps(analysis.summary))
    return save_report(analysis), analysis, run


@pytest.fixture(scope="module")
def gpu_page(browser, gpu_report):  # noqa: F811
    return load(browser, gpu_report[0], "gpu-trace")


def test_first_screen_states_gpu_idle(gpu_page, gpu_report):
    page = gpu_page.page
    assert gpu_page.errors == []
    g = gpu_report[1].summary["gpu_time"]
    card = page.query_selector("#card-gpu_idle")
    assert float(card.get_attribute("data-value")) == g["idle_frac"]
    assert card.query_selector(".value").inner_text() == f"{100 * g['idle_frac']:.1f} %"
    assert "host wait" in card.inner_text()
    page.evaluate("window.scrollTo(0, 0)")
    box = card.bounding_box()
    assert box["y"] + box["height"] <= 900, "the GPU idle card is below the first screen"


def test_timeline_draws_kernels_per_stream_under_cpu_outlines(gpu_page, gpu_report):
    page = gpu_page.page
    _, analysis, run = gpu_report
    traces = page.evaluate("""() => document.getElementById('fig-timeline').data.map(t =>
        ({name: t.name, lanes: [...new Set(t.y)], n: t.y.length, fill: t.marker.color}))""")
    by_name = {t["name"]: t for t in traces}
    title = page.evaluate("document.getElementById('fig-timeline').layout.title.text")
    window = [int(s) for s in title.split("steps ")[1].split(" ")[0].split("–")]
    k = run.spans[(run.spans["kind"] == "kernel") & run.spans["step"].between(window[0], window[-1])]
    drawn = sum(t["n"] for name, t in by_name.items() if name.startswith("GPU "))
    assert drawn == len(k)
    streams = sorted(f"rank 0 · GPU {ln}" for ln in k["lane"].astype(str).unique())
    assert sorted({ln for name, t in by_name.items() if name.startswith("GPU ") for ln in t["lanes"]}) == streams
    assert set(by_name["GPU communication kernel"]["lanes"]) < set(streams)   # NCCL runs on its own stream
    assert by_name["GPU compute kernel"]["n"] > by_name["GPU communication kernel"]["n"] > 0
    outline = by_name["CPU-side span (outline)"]
    assert outline["lanes"] == ["rank 0 · CPU"] and outline["fill"] == "rgba(0,0,0,0)"
    assert "compute" not in by_name    # the CPU annotations no longer paint the rank as busy
    # drawn in the page: one bar per kernel of each class
    bars = page.evaluate("""() => [...document.querySelectorAll('#fig-timeline .trace.bars')].map(g =>
        g.querySelectorAll('.point').length)""")
    assert sum(bars) >= drawn


def test_gpu_tables_and_labelled_overlaps(gpu_page, gpu_report):
    page = gpu_page.page
    s = gpu_report[1].summary
    rows = page.eval_on_selector_all("#kernel-table tbody tr", "els => els.map(e => e.cells[0].title)")
    assert rows == [k["name"] for k in s["kernels"]] and len(rows) == 20
    gt = page.query_selector("#gpu-time-table tbody tr").inner_text()
    assert f"{100 * s['ranks'][0]['gpu_time']['idle_frac']:.1f}%" in gt.replace(" ", "")
    sub = page.query_selector("#card-overlap .sub").inner_text()
    assert "collective records" in sub and "kernels only (HTA)" in sub
    assert f"{100 * s['gpu_time']['comm_compute_overlap_frac']:.1f} %" in sub
