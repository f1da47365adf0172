"""GPU time per rank and top kernels (analyzers/kernel_breakdown.py) on the shared real traces, against
HolisticTraceAnalysis' own figures.

HTA is not a dependency: its figures were measured with HolisticTraceAnalysis 0.5.0 by
benchmarks/hta_figures.py run in a venv of its own (output and command in docs/interop.md, "GPU time against HTA";
HTA 0.6.1 gives the same temporal breakdown and overlap, see the README beside the traces, conftest.SHARED).
Tolerance: 1 percentage point (issue 17), since HTA rounds times to whole µs.
"""
from __future__ import annotations

import gzip
import json
from collections import defaultdict

import pytest
from click.testing import CliRunner

from conftest import SHARED, import_kineto, needs_shared
from dtprof.cli import main

pytestmark = needs_shared

# benchmarks/hta_figures.py with HTA 0.5.0: temporal breakdown (%) and idle causes summed over streams (shares).
HTA = {
    "nccl_single_rank.json.gz": {"idle": 77.78, "compute": 17.26, "non_compute": 4.97, "overlap": 14.31,
                                 "host_wait": (357247 + 381499) / (357247 + 2155 + 381499),
                                 "kernel_wait": 2155 / (357247 + 2155 + 381499), "other": 0.0},
    "amd_mi250_minitoy.json.gz": {"idle": 98.53, "compute": 1.08, "non_compute": 0.39, "overlap": None,
                                  "host_wait": 1.0, "kernel_wait": 0.0, "other": 0.0},
}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu")
    out = {}
    for name in HTA:
        out[name] = import_kineto(d / name, SHARED / name)
    return out


def _summary(run_dir, *args):
    res = CliRunner().invoke(main, ["summary", str(run_dir), "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.output[res.output.index("{"):])


@pytest.mark.parametrize("name", list(HTA))
def test_gpu_time_in_hta_window_matches_hta(imported, name):
    g = _summary(imported[name], "--gpu-window", "hta")["ranks"][0]["gpu_time"]
    h = HTA[name]
    assert g["idle_frac"] * 100 == pytest.approx(h["idle"], abs=1)
    assert g["compute_frac"] * 100 == pytest.approx(h["compute"], abs=1)
    assert g["non_compute_frac"] * 100 == pytest.approx(h["non_compute"], abs=1)
    if h["overlap"] is None:
        assert g["comm_compute_overlap_frac"] is None and g["comm_frac"] == 0
    else:
        assert g["comm_compute_overlap_frac"] * 100 == pytest.approx(h["overlap"], abs=1)
    for cause in ("host_wait", "kernel_wait", "other"):
        assert g["idle_causes"][cause] == pytest.approx(h[cause], abs=0.01)
    assert g["idle_causes"]["launch_known_frac"] == 1.0   # every kernel's launch was joined by correlation id
    assert g["window"]["name"] == "hta"


def test_default_window_counts_every_kernel_and_says_so(imported):
    name = "nccl_single_rank.json.gz"
    trace = json.loads(gzip.decompress((SHARED / name).read_bytes()))["traceEvents"]
    kernels = [e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    steps = sorted(int(e["name"].split("#")[1]) for e in trace if str(e.get("name")).startswith("ProfilerStep#"))
    s = _summary(imported[name])
    g = s["ranks"][0]["gpu_time"]
    assert s["options"]["gpu_window"] == "all"
    assert g["window"]["name"] == "all" and g["window"]["kernels"] == len(kernels)
    assert g["window"]["steps"] == steps
    assert g["window"]["streams"] == sorted({f"cuda:{e['args']['stream']}" for e in kernels})
    hta = _summary(imported[name], "--gpu-window", "hta")["ranks"][0]["gpu_time"]["window"]
    assert hta["steps"] == steps[:-1] and hta["kernels"] < len(kernels)   # HTA drops the last ProfilerStep
    # the parts of kernel time: idle + compute + non-compute = 1; comm and memory are inside non-compute + overlap
    assert g["idle_frac"] + g["compute_frac"] + g["non_compute_frac"] == pytest.approx(1)
    assert 0 < g["comm_frac"] and 0 < g["memory_frac"]
    assert g["comm_frac"] * (1 - g["comm_compute_overlap_frac"]) <= g["non_compute_frac"] + 1e-9


def test_top_kernels_by_total_time_from_the_trace(imported):
    name = "nccl_single_rank.json.gz"
    trace = json.loads(gzip.decompress((SHARED / name).read_bytes()))["traceEvents"]
    total = defaultdict(float)
    count = defaultdict(int)
    for e in trace:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            total[e["name"]] += e["dur"] * 1e-6
            count[e["name"]] += 1
    expected = sorted(total, key=total.get, reverse=True)[:20]
    k = _summary(imported[name])["kernels"]
    assert len(k) == 20 and [x["name"] for x in k] == expected
    assert [x["time_s"] for x in k] == sorted((x["time_s"] for x in k), reverse=True)
    all_time = sum(total.values())
    for x in k:
        assert x["time_s"] == pytest.approx(total[x["name"]], rel=1e-6)
        assert x["count"] == count[x["name"]] and x["mean_s"] == pytest.approx(x["time_s"] / x["count"])
        assert x["share"] == pytest.approx(total[x["name"]] / all_time, rel=1e-6)
    cats = {x["name"]: x["category"] for x in k}
    assert cats[expected[0]] == "communication" and expected[0].startswith("ncclKernel_AllReduce")
    assert all(c in ("communication", "memory", "computation", "other") for c in cats.values())


def test_cpu_only_trace_has_no_gpu_time(tmp_path):
    s = _summary(import_kineto(tmp_path / "run", SHARED / "cpu_only_rank34.json.gz"))
    assert s["ranks"][0]["gpu_time"] is None and s["kernels"] == []


def test_summary_terminal_shows_gpu_time_overlaps_and_kernel_table(imported):
    res = CliRunner().invoke(main, ["summary", str(imported["nccl_single_rank.json.gz"]), "--no-write"])
    assert res.exit_code == 0, res.output
    s = _summary(imported["nccl_single_rank.json.gz"], "--no-write")
    lines = res.output.splitlines()
    g = s["ranks"][0]["gpu_time"]
    row = next(x for x in lines if x.split()[:1] == ["0"] and "%" in x and x.split()[-1] == str(g["window"]["kernels"]))
    assert row.split()[1] == f"{100 * g['idle_frac']:.1f}%"
    assert any(x.startswith("overlap per step, collective records: ") and f"{100 * s['overlap']['ratio']:.1f}%" in x
               for x in lines)
    assert any(x.startswith("overlap of kernels only (HTA): ")
               and f"{100 * g['comm_compute_overlap_frac']:.1f}%" in x for x in lines)
    i = lines.index("top 20 kernels by total time:")
    table = lines[i + 2:i + 22]
    assert len(table) == 20
    for line, k in zip(table, s["kernels"]):
        assert k["category"] in line and (k["name"] in line or k["name"][:79] + "…" in line)
