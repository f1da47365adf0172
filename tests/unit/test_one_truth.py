"""Issue 13's listed defects, each with the test that would have caught it: one definition per quantity, and the
numbers that were wrong (data wait on pipeline and traced runs, the persistent-straggler wording)."""
from __future__ import annotations

import html
import json

import numpy as np
import pandas as pd
import pytest

from dtprof.analyzers.kernel_breakdown import gpu_time
from dtprof.analyzers.options import AnalysisOptions
from dtprof.analyzers.stragglers import PERSISTENT_RULE
from dtprof.analyzers.summary import analyze
from dtprof.reader import open_run
from dtprof.report import save_report
from dtprof.reports import html as H
from dtprof.rundir.writer import create_run_dir, write_json_atomic, write_node_tables
from synth import build_run

MS = 1_000_000


def _one_rank_run(path, spans: list[tuple], step_ms=100):
    create_run_dir(path, {"command": ["hand"]})
    node = path / "node-hand"
    node.mkdir()
    sp = pd.DataFrame([{"rank": 0, "step": 0, "kind": k, "name": n, "start_ns": a * MS, "end_ns": e * MS,
                        "lane": lane, "source": "kineto"} for k, n, a, e, lane in spans])
    write_node_tables(node, {"ranks": pd.DataFrame({"rank": [0], "local_rank": [0], "world_size": [1],
                                                    "host": ["h0"], "pid": [1],
                                                    "device_type": ["cuda"], "device_name": ["gpu"]}),
                             "steps": pd.DataFrame({"rank": [0], "step": [0], "start_ns": [0],
                                                    "end_ns": [step_ms * MS]}),
                             "spans": sp}, {"host": "h0", "status": "completed", "exit_code": 0})
    return path


def test_overlap_and_kernel_breakdown_classify_kernels_alike(tmp_path):
    # a GEMM under an NCCL kernel, a copy, and an RCCL kernel: both analyzers must see 40 ms of compute and
    # 40 ms of communication, 10 ms of it hidden under compute (before, one of them called the RCCL kernel compute)
    run = _one_rank_run(tmp_path / "r", [
        ("kernel", "sm90_xmma_gemm_bf16", 0, 40, "cuda:7"),
        ("kernel", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 30, 60, "cuda:13"),
        ("kernel", "Memcpy DtoD (Device -> Device)", 60, 70, "cuda:7"),
        ("kernel", "rcclAllReduce_kernel", 70, 80, "cuda:13")])
    a = analyze(run, AnalysisOptions(warmup=0))
    row = a.steps.iloc[0]
    assert row["level"] == "kernel"
    kb = gpu_time(open_run(run).spans)[0]
    assert row["compute_s"] == pytest.approx(0.040) == kb["compute_frac"] * kb["kernel_time_s"]
    assert row["comm_s"] == pytest.approx(0.040)
    assert row["overlap_ratio"] == pytest.approx(0.25) == kb["comm_compute_overlap_frac"]


def test_worst_node_status_is_the_same_in_summary_and_report(tmp_path):
    run_dir = build_run(tmp_path / "r", world_size=2, steps=6)
    for name, status in (("node-b", "failed"), ("node-c", "hung")):
        (run_dir / name).mkdir()
        write_json_atomic(run_dir / name / "node.json", {"host": name, "status": status, "exit_code": 1})
    a = analyze(open_run(run_dir))
    summary = a.summary
    assert summary["run"]["status"] == "hung"
    assert 'id="status">hung<' in H._header(a.identity, summary)


def test_compute_kinds_have_one_meaning(tmp_path):
    # a user span is not compute to the analyzers, so the timeline must not paint it as compute either
    from dtprof.reports import figures as F
    from dtprof.rundir.schema import COMPUTE_KINDS

    assert F.COMPUTE_KINDS is COMPUTE_KINDS and "user" not in COMPUTE_KINDS   # one name, one tuple
    run_dir = build_run(tmp_path / "r", world_size=2, steps=6)
    tbl = run_dir / "node-synthetic/tables/spans.parquet"
    sp = pd.read_parquet(tbl)
    fwd = sp[(sp["kind"] == "forward")].copy()
    sp = pd.concat([sp, fwd.assign(kind="user", name="my_span")], ignore_index=True)
    sp.to_parquet(tbl, index=False)
    run = open_run(run_dir)
    a = analyze(run)
    fig, _, _ = F.timeline_figure(F.make_context(run, a))
    names = {d.name: list(d.customdata[:, 0]) for d in fig.data}
    assert "my_span" in names["user span"] and "my_span" not in names["compute"]


def test_persistent_straggler_one_criterion_one_wording(tmp_path):
    # rank 3 waits 20 ms longer for its input every step, so every all-reduce waits for it: removing that saves
    # 20 of the 57 ms step (35 %) in every step -- persistent by the one rule (impact), and every view says why in
    # its words
    run_dir = build_run(tmp_path / "r", world_size=4, steps=12, buckets=10, late_rank=3, late_ms=20.0)
    a = analyze(run_dir)
    s = a.summary["stragglers"]
    assert [x["rank"] for x in s] == [3] and s[0]["kind"] == "persistent"
    assert s[0]["saving_frac"] == pytest.approx(20 / 57, abs=0.01) and s[0]["saving_step_frac"] == 1.0
    assert "(100% of measured steps save at least 5%; a typical step does 20.0 ms more work than its peers)" \
        in s[0]["reason"]
    finding = next(f for f in a.findings if f["id"] == "straggler")
    assert s[0]["reason"] in finding["message"]
    page = save_report(a).read_text()
    assert html.escape(s[0]["reason"]) in page and html.escape(PERSISTENT_RULE.capitalize()) in page
    from click.testing import CliRunner

    from dtprof.cli import main
    res = CliRunner().invoke(main, ["triage", str(run_dir), "--json"])
    verdict = json.loads(res.stdout)
    assert verdict["verdict"] == "straggler" and s[0]["reason"] in verdict["message"]


def test_pipeline_fill_is_bubble_not_data_wait(tmp_path):
    # 4 stages: each waits 1 ms for input, then stage s waits s hops for its first activations (pipeline fill);
    # the collector's data_wait span runs to the first forward, so it holds the fill too
    a = analyze(build_run(tmp_path / "r", pipeline_stages=4, microbatches=4, steps=6, fwd_ms=10, bwd_ms=20,
                          p2p_ms=10, pp_data_ms=1))
    waits = [r["data_wait_s_per_step"] for r in a.summary["ranks"]]
    assert waits == pytest.approx([0.001] * 4)
    assert not any(f["id"] == "data_wait" for f in a.findings)
    raw = open_run(tmp_path / "r").spans
    dw = raw[raw["kind"] == "data_wait"].groupby("rank")["end_ns"].first() - \
        raw[raw["kind"] == "data_wait"].groupby("rank")["start_ns"].first()
    assert dw.loc[3] == 61 * MS   # the span really held the fill: the fix is in the analysis, not the data


def test_trace_capture_is_neither_data_wait_nor_a_measured_step(tmp_path):
    # --trace-steps 4:6: the profiler's stop and export (170 ms) runs before step 6's first forward
    a = analyze(build_run(tmp_path / "r", world_size=2, steps=12, trace_steps=(4, 6), trace_export_ms=170))
    st = a.summary["steps"]
    assert st["traced_steps"] == [4, 5, 6] and 6 not in st["per_step_index"] and 4 not in st["per_step_index"]
    assert st["time_s"]["max"] == pytest.approx(0.037)   # no step of the statistics carries the export
    assert [r["data_wait_s_per_step"] for r in a.summary["ranks"]] == pytest.approx([0.001, 0.001])
    assert not any(f["id"] == "data_wait" for f in a.findings)
    # the traced steps are still in the per-step table, flagged, with the raw data wait kept out of data_wait_s
    six = a.steps[a.steps["step"] == 6]
    assert six["traced"].all() and not six["measured"].any() and (six["data_wait_s"] == 0.0).all()


def test_bubble_parts_add_up_everywhere(tmp_path):
    a = analyze(build_run(tmp_path / "r", pipeline_stages=4, microbatches=6, steps=6, fwd_ms=10, bwd_ms=20,
                          p2p_ms=3, opt_ms=2, jitter_frac=0.1, seed=2))
    pp = a.summary["pipeline"]
    assert pp["theoretical_bubble_frac"] + pp["overhead_frac"] == pytest.approx(pp["bubble_frac"], abs=1e-12)
    for s in pp["per_stage"]:
        assert s["theoretical_bubble_frac"] + s["overhead_frac"] == pytest.approx(s["bubble_frac"], abs=1e-12)
    from dtprof.reports.terminal import format_summary_text
    line = next(x for x in format_summary_text(a.summary).splitlines() if x.startswith("pipeline:"))
    pct = lambda v: f"{v:.0%}"  # noqa: E731
    assert (f"bubble {pct(pp['bubble_frac'])} = theoretical {pct(pp['theoretical_bubble_frac'])} + overhead "
            f"{pct(pp['overhead_frac'])}") in line
    page = save_report(a).read_text()
    assert f"theoretical (the schedule itself) {H.fmt_frac(pp['theoretical_bubble_frac'])}" in page
    from dtprof.reports import figures as F
    _, bub = F.pipeline_figures(F.make_context(open_run(tmp_path / "r"), a))
    theo_bars = next(d for d in bub.data if d.name.startswith("theoretical"))
    assert np.allclose(np.array(theo_bars.y) / 100, [s["theoretical_bubble_frac"] for s in pp["per_stage"]])


def test_nvml_evidence_is_the_same_in_summary_and_triage(tmp_path):
    # one record per flagged rank, built by the analysis; triage shows that record, not one of its own
    run_dir = build_run(tmp_path / "r", world_size=4, steps=8, slow_rank=2, slow_factor=1.6, nvml_interval_ms=5,
                        throttle_rank=2, device_type="cuda", device_name="NVIDIA H100 80GB HBM3")
    s = analyze(run_dir).summary["stragglers"][0]
    assert s["rank"] == 2 and s["nvml"]["gpu"] == 2 and s["nvml"]["throttle_reasons"] == ["hw_thermal_slowdown"]
    from click.testing import CliRunner

    from dtprof.cli import main
    verdict = json.loads(CliRunner().invoke(main, ["triage", str(run_dir), "--json"]).stdout)
    nv = next(e for e in verdict["evidence"] if e["kind"] == "nvml")
    assert {k: nv[k] for k in s["nvml"]} == s["nvml"]
    assert nv["message"] == "; ".join(s["evidence"])
