"""Analyzers against synthetic runs with known truth (tests/synth.py) and hand-built intervals."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from dtprof.analyzers import findings as F  # noqa: E402
from dtprof.analyzers.intervals import (  # noqa: E402
    assign_to_windows,
    measure,
    split_over_windows,
    union_length,
    windows_touched,
)
from dtprof.analyzers.options import AnalysisOptions  # noqa: E402
from dtprof.analyzers.summary import analyze  # noqa: E402
from dtprof.options import resolve_options  # noqa: E402
from dtprof.reader import open_run  # noqa: E402
from dtprof.reports.terminal import format_summary_text  # noqa: E402
from dtprof.rundir.writer import create_run_dir, save_summary, write_node_tables  # noqa: E402
from synth import MS, build_run, hand_run  # noqa: E402

# ---------------------------------------------------------------- interval core

def test_measure_exact_on_hand_built_intervals():
    # group 0: compute [0,10)+[5,20) (union 20), wait [15,20), comm [8,30); group 1: comm only [0,4)
    g = np.array([0, 0, 0, 0, 1])
    sid = np.array([0, 0, 1, 2, 2])
    s = np.array([0, 5, 15, 8, 0])
    e = np.array([10, 20, 20, 30, 4])
    r = measure(g, sid, s, e, 2, 3, {"compute": lambda c: c[0] & ~c[1], "comm": lambda c: c[2],
                                     "overlap": lambda c: c[2] & c[0] & ~c[1]})
    assert r["compute"].tolist() == [15, 0]
    assert r["comm"].tolist() == [22, 4]
    assert r["overlap"].tolist() == [7, 0]          # [8,15)
    assert union_length(g, s, e, 2).tolist() == [30, 4]


def test_assign_to_windows():
    idx = assign_to_windows(np.array([0, 0, 1]), np.array([0, 10, 0]), np.array([10, 20, 50]),
                            np.array([0, 0, 0, 1, 1, 2]), np.array([5, 10, 25, 49, 50, 1]))
    assert idx.tolist() == [0, 1, -1, 2, -1, -1]


# ---------------------------------------------------------------- overlap

def test_windows_touched_covers_every_window_an_interval_reaches():
    rng = np.random.default_rng(3)
    # per rank, windows back to back with gaps, some of no length; intervals anywhere, some of no length
    wr = np.repeat(np.arange(3), 40)
    lengths = rng.integers(0, 5, len(wr)) * 10
    ws = np.concatenate([np.cumsum(np.r_[0, (lengths[r * 40:(r + 1) * 40] + rng.integers(0, 3, 40) * 5)[:-1]])
                         for r in range(3)])
    we = ws + lengths
    key = rng.integers(0, 4, 500)
    lo = rng.integers(-20, int(we.max()) + 20, 500)
    hi = lo + rng.integers(0, 30, 500) * rng.integers(0, 2, 500)
    got = windows_touched(wr, ws, we, key, lo, hi)
    want = np.array([((key == r) & (lo <= e) & (hi >= s)).any() for r, s, e in zip(wr, ws, we)])
    assert (got == want).all() and got.any() and not got.all()
    # a superset of what the per-window measures attribute: the windows of every time and every piece
    assert got[assign_to_windows(wr, ws, we, key, lo)[assign_to_windows(wr, ws, we, key, lo) >= 0]].all()
    assert got[split_over_windows(wr, ws, we, key, lo, hi)[1]].all()


def test_overlap_and_exposed_on_hand_built_run(tmp_path):
    # compute = forward [10,40) ∪ backward [40,90) minus comm_wait [70,90) = [10,70) -> 60 ms
    # comm = [30,50) ∪ [60,95) = 55 ms; overlap = [30,50) + [60,70) = 30 ms; exposed = 25 ms
    run = hand_run(tmp_path / "r", [(0, "forward", 10, 40), (0, "backward", 40, 90), (0, "comm_wait", 70, 90),
                                    (0, "data_wait", 0, 10)],
                   [(0, "all_reduce", 0, 30, 50, 1024, 1), (0, "all_reduce", 1, 60, 95, 1024, 1)])
    a = analyze(run, AnalysisOptions(warmup=0))
    row = a.steps.iloc[0]
    assert row["compute_s"] == pytest.approx(0.060)
    assert row["comm_s"] == pytest.approx(0.055)
    assert row["exposed_comm_s"] == pytest.approx(0.025)
    assert row["overlap_ratio"] == pytest.approx(30 / 55)
    assert row["comm_wait_s"] == pytest.approx(0.020)
    assert row["data_wait_s"] == pytest.approx(0.010)
    assert a.summary["overlap"]["ratio"] == pytest.approx(30 / 55)
    assert a.summary["overlap"]["exposed_comm_frac"] == pytest.approx(0.25)


def test_kernel_level_overlap_replaces_hook_spans(tmp_path):
    # GPU kernels in the step: compute [10,50), an NCCL kernel [40,70), a memcpy [0,5) that is not compute;
    # the host-side forward/comm_wait hook spans of the same step are ignored at kernel level
    run = hand_run(tmp_path / "r", [(0, "forward", 0, 100), (0, "comm_wait", 60, 90),
                                    (0, "kernel", 10, 50, "ampere_sgemm_128x64"),
                                    (0, "kernel", 40, 70, "ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
                                    (0, "kernel", 0, 5, "Memcpy HtoD (Pageable -> Device)")], [])
    row = analyze(run, AnalysisOptions(warmup=0)).steps.iloc[0]
    assert row["level"] == "kernel"
    assert row["compute_s"] == pytest.approx(0.040) and row["comm_s"] == pytest.approx(0.030)
    assert row["exposed_comm_s"] == pytest.approx(0.020) and row["overlap_ratio"] == pytest.approx(1 / 3)


def test_overlap_on_ddp_synth(tmp_path):
    # bucket 0 runs inside backward compute (4 ms overlapped), bucket 1 after it (4 ms exposed)
    a = analyze(build_run(tmp_path / "r", world_size=4, steps=6))
    s = a.steps[~a.steps["warmup"]]
    assert np.allclose(s["compute_s"], 0.032) and np.allclose(s["comm_s"], 0.008)
    assert np.allclose(s["exposed_comm_s"], 0.004) and np.allclose(s["overlap_ratio"], 0.5)
    assert a.summary["overlap"]["exposed_comm_frac"] == pytest.approx(0.004 / 0.037)


# ---------------------------------------------------------------- steps

def test_steps_warmup_detected_and_overridable(tmp_path):
    run = build_run(tmp_path / "r", world_size=2, steps=10)
    a = analyze(run)
    st = a.summary["steps"]
    assert st["warmup_steps"] == 1 and st["count"] == 9 and st["warmup_source"] == "detected"
    assert st["per_step_time_s"] == pytest.approx([0.037] * 9)
    assert st["time_s"]["p50"] == pytest.approx(0.037) and st["jitter_frac"] == pytest.approx(0.0, abs=1e-12)
    # tokens/samples are per rank: 2 ranks × 4096 tokens per 37 ms
    assert st["tokens_per_s"] == pytest.approx(2 * 4096 / 0.037)
    b = analyze(run, AnalysisOptions(warmup=3))
    assert b.summary["steps"]["count"] == 7 and b.summary["steps"]["warmup_source"] == "user"
    assert b.steps["warmup"].sum() == 2 * 3


def test_warmup_runs_through_the_flop_counting_step():
    # a compiled job: step 0 compiles, step 1 runs eager under FlopCounterMode (dtprof's, kept out anyway), step 2
    # compiles again for the steps after it; then 37 ms steps. Step 2 is warm-up too, not a measured 2 s step
    import pandas as pd

    from dtprof.analyzers.steps import warmup_of

    t = [3.0, 0.9, 2.0] + [0.037] * 12
    job = pd.DataFrame({"time_s": t, "traced": False, "flops_counted": [i == 1 for i in range(len(t))]})
    assert warmup_of(job, None) == (3, "detected")
    job.loc[2, "time_s"] = 0.037          # no second compile: warm-up is step 0 alone, not the FLOP-counted step
    assert warmup_of(job, None) == (1, "detected")
    job["flops_counted"] = False          # without dtprof's step between them, a fast step 1 ends the run
    job.loc[1:2, "time_s"] = [0.037, 2.0]
    assert warmup_of(job, None) == (1, "detected")


# ---------------------------------------------------------------- pipeline

@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (3, 12)])
def test_gpipe_uniform_bubble_matches_formula(tmp_path, p, m):
    a = analyze(build_run(tmp_path / "r", pipeline_stages=p, microbatches=m, steps=5, opt_ms=0))
    pp = a.summary["pipeline"]
    truth = (p - 1) / (m + p - 1)
    assert pp["stages"] == p and pp["microbatches"] == m and pp["schedule"] == "ScheduleGPipe"
    assert pp["bubble_frac"] == pytest.approx(truth)
    assert pp["theoretical_bubble_frac"] == pytest.approx(truth)
    assert all(s["bubble_frac"] == pytest.approx(truth) for s in pp["per_stage"])
    assert pp["imbalance"] == pytest.approx(1.0)
    assert len(a.pipeline) == p * 5


def test_pipeline_theory_includes_optimizer_time(tmp_path):
    # with a 5 ms optimizer after the pipeline the generalised formula still predicts the measured bubble
    a = analyze(build_run(tmp_path / "r", pipeline_stages=2, microbatches=8, steps=5, opt_ms=5))
    pp = a.summary["pipeline"]
    step = 9 * 0.030 + 0.005
    assert pp["bubble_frac"] == pytest.approx(1 - (8 * 0.030 + 0.005) / step)
    assert pp["theoretical_bubble_frac"] == pytest.approx(pp["bubble_frac"])
    assert pp["schedule_bubble_frac"] == pytest.approx(1 / 9)


def test_pipeline_p2p_time_is_overhead_not_schedule(tmp_path):
    # 3 ms per hop between stages: the measured bubble grows, the schedule's own share stays (p-1)/(m+p-1), and the
    # difference is reported as overhead
    p, m, f, b, lat = 4, 4, 10.0, 20.0, 3.0
    a = analyze(build_run(tmp_path / "r", pipeline_stages=p, microbatches=m, steps=5, opt_ms=0, p2p_ms=lat))
    pp = a.summary["pipeline"]
    step = (p - 1) * (f + lat) + m * f + (p - 1) * (b + lat) + m * b
    assert pp["bubble_frac"] == pytest.approx(1 - m * (f + b) / step)
    ideal = (m + p - 1) * (f + b)   # the replayed step: (p-1)/(m+p-1) of it is the schedule's own idle time
    assert pp["theoretical_bubble_frac"] == pytest.approx((ideal - m * (f + b)) / step)
    assert pp["overhead_frac"] == pytest.approx(1 - ideal / step)   # the share of the step the schedule does not need
    # the two parts add up to the bubble, pipeline-wide and per stage, in the same unit (share of the measured step)
    assert pp["theoretical_bubble_frac"] + pp["overhead_frac"] == pytest.approx(pp["bubble_frac"], abs=1e-12)
    for st in pp["per_stage"]:
        assert st["theoretical_bubble_frac"] + st["overhead_frac"] == pytest.approx(st["bubble_frac"], abs=1e-12)


def _pipeline_hand_run(path: Path, ops: list[tuple], step_end_ms: float, stage_of=None) -> Path:
    """GPipe steps from hand-written ops (rank, kind, microbatch, start ms, end ms[, step]); a rank's stage is
    ``stage_of[rank]`` (default: the rank). Every rank has the steps 0..max step, each [0, step_end_ms) long."""
    stage_of = stage_of or {r: r for r in {o[0] for o in ops}}
    ranks = sorted(stage_of)
    n_steps = max((o[5] if len(o) > 5 else 0) for o in ops) + 1
    create_run_dir(path, {"command": ["hand"]})
    node = path / "node-hand"
    node.mkdir()
    sp = pd.DataFrame([{"rank": o[0], "step": o[5] if len(o) > 5 else 0, "kind": o[1], "name": o[1][3:],
                        "start_ns": int((o[3] + step_end_ms * (o[5] if len(o) > 5 else 0)) * MS),
                        "end_ns": int((o[4] + step_end_ms * (o[5] if len(o) > 5 else 0)) * MS),
                        "stage": stage_of[o[0]], "microbatch": o[2], "lane": "main", "source": "hook"} for o in ops])
    st = pd.DataFrame([{"rank": r, "step": k, "start_ns": int(k * step_end_ms * MS),
                        "end_ns": int((k + 1) * step_end_ms * MS)} for r in ranks for k in range(n_steps)])
    rk = pd.DataFrame({"rank": ranks, "local_rank": ranks, "world_size": len(ranks), "host": "h0", "pid": 1,
                       "device_type": "cpu", "device_index": ranks, "device_name": "cpu", "backend": "gloo"})
    ev = pd.DataFrame({"rank": ranks, "host": "h0", "t_ns": 0, "level": "info", "source": "rank",
                       "message": "pipeline schedule: ScheduleGPipe, stages=2, microbatches=4"})
    write_node_tables(node, {"ranks": rk, "steps": st, "spans": sp, "events": ev},
                      {"host": "h0", "status": "completed", "exit_code": 0})
    return path


F_, B_ = "pp_forward", "pp_backward"
# 2-stage GPipe, f=10, b=20 ms, microbatch 2's forward on stage 0 takes 30 ms; ops placed with no gap (170 ms)
SLOW_MICROBATCH_STEP = [(0, F_, 0, 0, 10), (0, F_, 1, 10, 20), (0, F_, 2, 20, 50), (0, F_, 3, 50, 60),
    (1, F_, 0, 10, 20), (1, F_, 1, 20, 30), (1, F_, 2, 50, 60), (1, F_, 3, 60, 70),
    (1, B_, 0, 70, 90), (1, B_, 1, 90, 110), (1, B_, 2, 110, 130), (1, B_, 3, 130, 150),
    (0, B_, 0, 90, 110), (0, B_, 1, 110, 130), (0, B_, 2, 130, 150), (0, B_, 3, 150, 170)]


def test_pipeline_theory_replays_a_slow_microbatch(tmp_path):
    # f=10, b=20 ms, but microbatch 2's forward on stage 0 takes 30 ms; with no gap between ops the step lasts
    # 170 ms (worked by hand below). A closed formula on median op times would say 20 %; the replay matches.
    ops = SLOW_MICROBATCH_STEP
    pp = analyze(_pipeline_hand_run(tmp_path / "r", ops, 170), AnalysisOptions(warmup=0)).summary["pipeline"]
    assert pp["bubble_frac"] == pytest.approx(1 - (140 + 120) / 340)
    assert pp["theoretical_bubble_frac"] == pytest.approx(pp["bubble_frac"])
    assert pp["overhead_frac"] == pytest.approx(0.0, abs=1e-12)
    assert pp["schedule_bubble_frac"] == pytest.approx(0.2)
    # the same ops with each stage-1 op 5 ms later than needed: the replay still says 170 ms, so 5 ms is overhead
    late = [(r, k, j, a + 5 * r, e + 5 * r) for r, k, j, a, e in ops if r == 1] + [
        (r, k, j, a + (5 if k == B_ else 0), e + (5 if k == B_ else 0)) for r, k, j, a, e in ops if r == 0]
    pp2 = analyze(_pipeline_hand_run(tmp_path / "r2", late, 175), AnalysisOptions(warmup=0)).summary["pipeline"]
    assert pp2["theoretical_bubble_frac"] == pytest.approx((340 - 260) / 350)
    assert pp2["overhead_frac"] == pytest.approx(10 / 350)
    assert pp2["bubble_frac"] == pytest.approx(1 - 260 / 350)


def test_pipeline_replay_with_two_schedule_runs_per_step(tmp_path):
    # gradient accumulation: the schedule runs twice (m=2 each) before one optimizer step, back to back with no gap;
    # the second run's microbatch ids repeat, and each must wait for its own upstream op, not the first run's
    one = [(0, F_, 0, 0, 10), (0, F_, 1, 10, 20), (1, F_, 0, 10, 20), (1, F_, 1, 20, 30),
           (1, B_, 0, 30, 50), (1, B_, 1, 50, 70), (0, B_, 0, 50, 70), (0, B_, 1, 70, 90)]
    ops = one + [(r, k, j, a + 90, e + 90) for r, k, j, a, e in one]
    pp = analyze(_pipeline_hand_run(tmp_path / "r", ops, 180), AnalysisOptions(warmup=0)).summary["pipeline"]
    assert pp["bubble_frac"] == pytest.approx(1 / 3)
    assert pp["theoretical_bubble_frac"] == pytest.approx(1 / 3)
    assert pp["overhead_frac"] == pytest.approx(0.0, abs=1e-12)


def test_pipeline_replicas_and_an_idle_step(tmp_path):
    # DP x PP: two pipelines (ranks 0,1 and 2,3, stages 0,1), the slow-microbatch step of the test above in each.
    # Step 1 has the same ops except on rank 3, which ran nothing: its step is all bubble, and its replica's
    # replayed step is stage 0's ops alone.
    ops = [(r + 2 * rep, k, j, a, e, step) for rep in (0, 1) for step in (0, 1)
           for r, k, j, a, e in SLOW_MICROBATCH_STEP
           if not (rep == 1 and step == 1 and r == 1)]
    a = analyze(_pipeline_hand_run(tmp_path / "r", ops, 170, stage_of={0: 0, 1: 1, 2: 0, 3: 1}),
                AnalysisOptions(warmup=0))
    pp = a.summary["pipeline"]
    assert pp["replicas"] == 2 and pp["stages"] == 2 and pp["virtual_stages_per_rank"] == 1
    # busy: 140 + 120 ms per full pipeline-step, rank 2 alone in the last one (a 140 ms replay: stage 0 only)
    assert pp["bubble_frac"] == pytest.approx(1 - (3 * 260 + 140) / (8 * 170))
    ideal = 6 * 170 + 2 * 140
    assert pp["theoretical_bubble_frac"] == pytest.approx((ideal - (3 * 260 + 140)) / (8 * 170))
    assert pp["theoretical_bubble_frac"] + pp["overhead_frac"] == pytest.approx(pp["bubble_frac"], abs=1e-12)
    stage = {s["stage"]: s for s in pp["per_stage"]}
    assert stage[0]["compute_s_per_step"] == pytest.approx(0.140)
    assert stage[1]["compute_s_per_step"] == pytest.approx(3 * 0.120 / 4)
    idle = a.pipeline[(a.pipeline["rank"] == 3) & (a.pipeline["step"] == 1)]
    assert idle["bubble_frac"].tolist() == [1.0]


def test_no_pipeline_is_null_with_reason(tmp_path):
    a = analyze(build_run(tmp_path / "r", steps=5))
    assert a.summary["pipeline"] is None and a.pipeline is None and "pp_forward" in a.summary["pipeline_reason"]


# ---------------------------------------------------------------- collectives

def test_busbw_factors_per_op(tmp_path):
    n = 4
    size = 64 * 2**20
    ops = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]
    colls = []
    for i, op in enumerate(ops):
        for r in range(n):
            # rank r enters 1 ms late per rank; all leave at t+20: the transfer time is rank 3's 10 ms
            colls.append((r, op, i, 30 * i + r, 30 * i + 13, size, n))
    a = analyze(hand_run(tmp_path / "r", [], colls, steps=((0, 0, 200),), ranks=range(n)), AnalysisOptions(warmup=0))
    t = a.collectives.set_index("op")
    algbw = size / 0.010 / 1e9
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
               "all_to_all": (n - 1) / n, "broadcast": 1.0}
    for op, f in factors.items():
        assert t.at[op, "count"] == 1
        assert t.at[op, "transfer_s"] == pytest.approx(0.010)
        assert t.at[op, "algbw_gbps"] == pytest.approx(algbw)
        assert t.at[op, "busbw_gbps"] == pytest.approx(algbw * f)
        assert t.at[op, "size_bucket"] == "64-256 MiB"
        assert t.at[op, "total_s"] == pytest.approx(np.mean([0.013, 0.012, 0.011, 0.010]))
        assert pd.isna(t.at[op, "link_peak_frac"]) and "cpu" in t.at[op, "link_peak_reason"]


def test_link_peak_fraction_for_known_gpu(tmp_path):
    size = 2**20
    colls = [(r, "all_reduce", 0, 0, 1, size, 2) for r in range(2)]   # 1 MiB in 1 ms
    a = analyze(hand_run(tmp_path / "r", [], colls, ranks=range(2), device_name="NVIDIA H100 80GB HBM3",
                         device_type="cuda"), AnalysisOptions(warmup=0))
    row = a.collectives.iloc[0]
    assert row["busbw_gbps"] == pytest.approx(size / 1e-3 / 1e9 * 1.0)
    assert row["link_peak_gbps"] == 450 and row["link_peak_frac"] == pytest.approx(row["busbw_gbps"] / 450)
    assert row["size_bucket"] == "1-4 MiB"


# ---------------------------------------------------------------- stragglers and clocks

def test_straggler_of_known_rank_and_lateness(tmp_path):
    W, S = 6, 12
    a = analyze(build_run(tmp_path / "r", world_size=W, steps=S, late_rank=4, late_ms=5, hosts=2))
    arr = a.arrivals   # one row per collective instance: its last arriver
    assert len(arr) == S * 2 and (arr["rank"] == 4).all() and arr["last"].all()
    assert np.allclose(arr["lateness_s"], 0.005) and np.allclose(arr["lead_s"], 0.005)   # over the others' arrival
    st = a.stragglers.set_index("rank")
    assert st.at[4, "kind"] == "persistent" and st.at[4, "late_frac"] == 1.0
    assert (st.drop(index=4)["kind"] == "none").all()
    measured_instances = (S - 1) * 2
    assert st.at[4, "time_lost_s"] == pytest.approx((W - 1) * 0.005 * measured_instances)
    assert [s["rank"] for s in a.summary["stragglers"]] == [4]
    assert a.summary["stragglers"][0]["host"] == "host1"


def test_transient_straggler_late_in_two_steps_only(tmp_path):
    run = build_run(tmp_path / "r", world_size=4, steps=12)
    tbl = run / "node-synthetic/tables/collectives.parquet"
    co = pd.read_parquet(tbl)
    hit = (co["rank"] == 2) & co["step"].isin([4, 7])
    co.loc[hit, "issue_ns"] += 30 * MS   # rank 2 comes 30 ms late to both buckets of steps 4 and 7
    for col in ("return_ns", "end_ns"):   # a call never returns before it was issued
        co[col] = co[col].where(co[col] >= co["issue_ns"], co["issue_ns"])
    co.to_parquet(tbl, index=False)
    a = analyze(run)
    st = a.stragglers.set_index("rank")
    assert st.at[2, "kind"] == "transient" and st.at[2, "late_steps"] == 2
    assert (st.drop(index=2)["kind"] == "none").all()
    assert a.summary["stragglers"] == []   # transient lateness is listed apart, never named a straggler
    assert a.summary["transient_lateness"][0]["time_lost_s"] == pytest.approx(4 * 3 * 0.030)
    assert not any(f["id"] == "straggler" for f in a.findings)   # only persistent ones are findings


def test_set_up_lateness_is_not_a_late_step(tmp_path):
    # ranks start seconds apart: rank 2 reaches a set-up collective (no step, before step 0) 700 ms after the
    # others, and is late by 30 ms in one measured step. One late step is not transient lateness, and the set-up
    # wait is not counted among its peers' arrival wait (it counted as a late "step" and named rank 2 transient)
    run = build_run(tmp_path / "r", world_size=4, steps=12)
    tbl = run / "node-synthetic/tables/collectives.parquet"
    co = pd.read_parquet(tbl)
    setup = co[co["seq"] == co["seq"].min()].copy()
    setup["seq"] = co["seq"].max() + 1
    setup["step"] = pd.NA
    setup["issue_ns"] = np.where(setup["rank"] == 2, 900 * MS, 200 * MS)
    setup["return_ns"] = setup["end_ns"] = 901 * MS
    hit = (co["rank"] == 2) & (co["step"] == 4)
    co.loc[hit, "issue_ns"] += 30 * MS
    for col in ("return_ns", "end_ns"):
        co[col] = co[col].where(co[col] >= co["issue_ns"], co["issue_ns"])
    pd.concat([setup, co], ignore_index=True).astype(co.dtypes.to_dict()).to_parquet(tbl, index=False)
    a = analyze(run)
    st = a.stragglers.set_index("rank")
    assert (st["kind"] == "none").all() and st.at[2, "late_steps"] == 1
    assert st.at[2, "time_lost_s"] == pytest.approx(2 * 3 * 0.030)   # two buckets of step 4, three peers


def test_no_straggler_when_nobody_is_slow(tmp_path):
    a = analyze(build_run(tmp_path / "r", world_size=4, steps=10, jitter_frac=0.01, seed=3))
    assert a.summary["stragglers"] == [] and (a.stragglers["kind"] == "none").all()


def test_slow_compute_rank_scores_and_nvml_evidence(tmp_path):
    a = analyze(build_run(tmp_path / "r", world_size=4, steps=8, slow_rank=2, slow_factor=1.6,
                          nvml_interval_ms=5, throttle_rank=2, device_name="NVIDIA H100 80GB HBM3",
                          device_type="cuda"))
    st = a.stragglers.set_index("rank")
    assert st.at[2, "compute_score"] == pytest.approx(1 / 1.6)
    assert st.at[2, "kind"] == "persistent" and (st.drop(index=2)["compute_score"] == 1.0).all()
    ev = " | ".join(a.summary["stragglers"][0]["evidence"])
    assert "1400 MHz" in ev and "1980 MHz" in ev and "hw_thermal" in ev and "88" in ev
    g = a.gpu.set_index("gpu")
    assert g.at[2, "throttled_frac"] == pytest.approx(1.0) and g.drop(index=2)["throttled_s"].eq(0).all()
    assert any(f["id"] == "straggler" and f["evidence"]["rank"] == 2 for f in a.findings)


def test_skewed_host_clocks_recovered_within_residual(tmp_path):
    kw = dict(world_size=8, hosts=2, steps=30, jitter_frac=0.05, seed=1)
    truth = open_run(build_run(tmp_path / "t", **kw))
    skewed = build_run(tmp_path / "s", host_offset_ns=[0, -7_000_000], host_drift_ppm=[0.0, 40.0], **kw)
    a = analyze(skewed)
    c = a.clock.set_index("host")
    assert c.at["host1", "n_pairs"] > 0
    assert c.at["host1", "drift_ppm"] == pytest.approx(-40.0, abs=1.0)
    run = open_run(skewed)
    co = run.collectives
    aligned = a.model.align(co["issue_ns"].to_numpy(), co["rank"].to_numpy())
    err = np.abs(aligned - truth.collectives["issue_ns"].to_numpy())
    assert err.max() <= c.at["host1", "residual_ns"] + 2  # +2 ns integer rounding
    # arrivals are aligned: lateness matches the unskewed run's, so the skew invents no straggler
    key = ["group", "seq", "rank"]
    la = a.arrivals.sort_values(key)["lateness_s"].to_numpy()
    lt = analyze(truth).arrivals.sort_values(key)["lateness_s"].to_numpy()
    assert np.abs(la - lt).max() * 1e9 <= 2 * c.at["host1", "residual_ns"] + 4


@pytest.mark.parametrize("epoch_ns", [0, 1_763_000_000_000_000_000])
def test_clock_fit_of_a_host_reported_by_two_nodes_equals_one_nodes(tmp_path, epoch_ns):
    """Two launchers on one host: each node's summary reduces its own ranks' exits, and the fit merges them per
    (instance, host) to the same mean exit, so the clocks equal those fitted from all rows at once. Also with
    times counted from the epoch (an imported trace's clock), where rows x exit overflowed 64-bit integers."""
    from dtprof.analyzers.clock import exit_sums, fit_clocks
    from dtprof.analyzers.nodesummary import Rows
    from dtprof.analyzers.runmodel import with_exit

    run = open_run(build_run(tmp_path / "s", world_size=16, hosts=2, steps=12, jitter_frac=0.05, seed=3,
                             host_offset_ns=[0, -7_000_000], host_drift_ppm=[0.0, 40.0]))
    co = with_exit(run.collectives)
    unshifted = fit_clocks(run.ranks, Rows.of("clock_exits", exit_sums(run.ranks, co)))
    for c in ("issue_ns", "return_ns", "end_ns", "exit_ns"):
        co[c] = co[c] + epoch_ns
    whole = fit_clocks(run.ranks, Rows.of("clock_exits", exit_sums(run.ranks, co)))
    few = co["rank"].to_numpy() % 4 == 0   # each host's 8 ranks split over two "nodes": 2 and 6
    split = fit_clocks(run.ranks, Rows("clock_exits", frames=[("a", exit_sums(run.ranks, co[few])),
                                                             ("b", exit_sums(run.ranks, co[~few]))]))
    assert whole.set_index("host").at["host1", "n_pairs"] > 0
    pd.testing.assert_frame_equal(whole, split)
    pd.testing.assert_frame_equal(whole.drop(columns="ref_t_ns"), unshifted.drop(columns="ref_t_ns"))


# ---------------------------------------------------------------- MFU

def edge(path, **options):
    """Analyse as the command line does: the options (and device peaks) resolved at the edge."""
    run = open_run(path)
    return analyze(run, resolve_options(run, **options))


def test_mfu_given_flops_and_peak(tmp_path):
    run = build_run(tmp_path / "r", world_size=4, steps=6)
    a = edge(run, flops_per_step=2e12, peak_tflops=100)
    m = a.summary["mfu"]
    assert m["value"] == pytest.approx(2e12 / (0.037 * 100e12 * 4))
    assert m["peak_flops"] == pytest.approx(4 * 100e12) and "user" in m["peak_source"]


def test_mfu_spec_peak_for_known_gpu_and_null_for_unknown(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty"))   # no stored calibration (conftest.py stores one)
    a = edge(build_run(tmp_path / "h", world_size=2, steps=6, device_name="NVIDIA H100 80GB HBM3",
                       device_type="cuda"), flops_per_step=1e13)
    assert a.summary["mfu"]["value"] == pytest.approx(1e13 / (0.037 * 2 * 989.4e12))
    assert "spec sheet" in a.summary["mfu"]["peak_source"]
    u = edge(build_run(tmp_path / "u", world_size=2, steps=6, device_name="Mystery GPU 9000",
                       device_type="cuda"), flops_per_step=1e13)
    m = u.summary["mfu"]
    assert m["value"] is None and m["peak_flops"] is None and "Mystery GPU 9000" in m["value_reason"]
    c = edge(build_run(tmp_path / "c", world_size=2, steps=6), flops_per_step=1e13).summary["mfu"]
    assert c["value"] is None and "CPU has no spec peak" in c["value_reason"]


def test_mfu_uses_stored_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    from dtprof.calibrate import store
    store({"device_name": "cpu", "dtype": "fp32", "tflops": 0.5, "date": "2026-01-02"})
    a = edge(build_run(tmp_path / "r", world_size=2, steps=6), flops_per_step=1e9, dtype="fp32")
    m = a.summary["mfu"]
    assert m["value"] == pytest.approx(1e9 / (0.037 * 2 * 0.5e12))
    assert "calibrated on 2026-01-02" in m["peak_source"]
    assert json.loads((tmp_path / "cache/dtprof/calibration.json").read_text())["cpu|fp32"]["tflops"] == 0.5


def test_mfu_above_the_peak_is_refused_with_both_figures(tmp_path):
    # a calibration that ran while the machine was busier than during the job gives a peak below what the job did
    a = edge(build_run(tmp_path / "r", world_size=2, steps=6), flops_per_step=1e12, peak_tflops=1)
    m = a.summary["mfu"]
    achieved = 1e12 / 0.037 / 1e12
    assert m["value"] is None and m["achieved_flops_per_s"] == pytest.approx(1e12 / 0.037)
    assert f"{achieved / 2:.0%} of the peak" in m["value_reason"] and "too low" in m["value_reason"]
    assert "MFU: n/a (the job achieved" in format_summary_text(a.summary)


def test_mfu_from_transformer_shape_and_model_flops(tmp_path):
    run = build_run(tmp_path / "r", world_size=2, steps=6)
    tf = dict(n_params=1e6, layers=2, heads=4, head_dim=16, seq_len=128)
    a = edge(run, peak_tflops=1, transformer=tf)
    per_tok = 6 * 1e6 + 12 * 2 * 4 * 16 * 128
    assert a.summary["mfu"]["flops_per_step"] == pytest.approx(per_tok * 2 * 4096)
    assert "PaLM" in a.summary["mfu"]["flops_source"]
    # steps.model_flops is per rank: the job's figure is the sum over ranks
    p = tmp_path / "m"
    build_run(p, world_size=2, steps=6)
    tbl = p / "node-synthetic/tables/steps.parquet"
    s = pd.read_parquet(tbl)
    s["model_flops"] = 3_000_000_000
    s["executed_flops"] = 4_000_000_000
    s.to_parquet(tbl, index=False)
    m = edge(p, peak_tflops=1).summary["mfu"]
    assert m["flops_per_step"] == pytest.approx(6e9) and "summed over ranks" in m["flops_source"]
    assert m["hfu"] == pytest.approx(8e9 / (0.037 * 2e12)) and m["value"] == pytest.approx(6e9 / (0.037 * 2e12))


def test_options_default_from_node_config(tmp_path):
    run = build_run(tmp_path / "r", world_size=2, steps=6)
    nj = run / "node-synthetic/node.json"
    info = json.loads(nj.read_text())
    info["config"] = {"flops_per_step": 1e12, "peak_tflops": 50, "dtype": None}
    nj.write_text(json.dumps(info))
    s = edge(run).summary
    assert s["mfu"]["value"] == pytest.approx(1e12 / (0.037 * 2 * 50e12))
    # summary.json records the options as used, each peak with its source
    # an all-CPU run's dtype defaults to fp32 (a CPU has no bf16 peak worth dividing by)
    assert s["options"]["flops_per_step"] == 1e12 and s["options"]["dtype"] == "fp32"
    assert s["options"]["peaks"] == {"cpu": {"tflops": 50.0, "source": "user: 50 TFLOP/s per device", "reason": ""}}


def test_analysis_reads_nothing_outside_the_run(tmp_path, monkeypatch):
    # a calibration on this machine reaches the analysis only through the options resolved at the edge
    run = build_run(tmp_path / "r", world_size=2, steps=6)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    from dtprof.calibrate import store
    store({"device_name": "cpu", "dtype": "fp32", "tflops": 0.5, "date": "2026-01-02"})   # an all-CPU run: fp32
    plain = analyze(run, AnalysisOptions(flops_per_step=1e9)).summary
    assert plain["mfu"]["peak_flops"] is None and plain["options"]["peaks"] == {}
    at_edge = edge(run, flops_per_step=1e9).summary
    assert at_edge["mfu"]["peak_flops"] == pytest.approx(2 * 0.5e12)
    assert "calibrated on 2026-01-02" in at_edge["options"]["peaks"]["cpu"]["source"]


def test_options_are_validated():
    for bad in (dict(warmup=-1), dict(flops_per_step=0), dict(dtype="int4"), dict(transformer={"layers": 2})):
        with pytest.raises(ValueError):
            AnalysisOptions(**bad)


# ---------------------------------------------------------------- findings

def _fake(summary, memory=None, gpu=None):
    return SimpleNamespace(memory=memory if memory is not None else pd.DataFrame(
        columns=["rank", "peak_mem_bytes", "device_mem_total_bytes", "device_type"]),
        gpu=gpu if gpu is not None else pd.DataFrame())


def _ids(summary, **kw):
    return [f["id"] for f in F.find(summary, _fake(summary, **kw))]


def test_findings_fire_on_thresholds_and_not_below():
    pp = {"bubble_frac": 0.21, "microbatches": 4, "stages": 2, "schedule": "ScheduleGPipe",
          "theoretical_bubble_frac": 0.2}
    assert "pipeline_bubble" in _ids({"pipeline": pp})
    assert "pipeline_bubble" not in _ids({"pipeline": dict(pp, bubble_frac=0.19)})
    assert "pipeline_bubble" not in _ids({"pipeline": dict(pp, microbatches=8)})  # m >= 4p
    assert "pipeline_overhead" in _ids({"pipeline": dict(pp, bubble_frac=0.33, overhead_frac=0.13)})
    assert "pipeline_overhead" not in _ids({"pipeline": dict(pp, overhead_frac=0.01)})
    assert "exposed_comm" in _ids(_breakdown(exposed_comm=0.31))
    assert "exposed_comm" not in _ids(_breakdown(exposed_comm=0.29))
    c = {"op": "all_reduce", "group": "0", "size_bucket": "1-4 MiB", "busbw_gbps": 200.0, "link_peak_gbps": 450.0,
         "link_peak_frac": 0.44, "share_of_comm": 0.5}
    assert "low_busbw" in _ids({"collectives": [c]})
    assert "low_busbw" not in _ids({"collectives": [dict(c, link_peak_frac=0.55)]})
    assert "low_busbw" not in _ids({"collectives": [dict(c, link_peak_frac=None)]})
    s = {"rank": 3, "host": "h", "device": "d", "kind": "persistent", "score": 0.5, "late_step_frac": 0.9,
         "reason": "last to arrive, holding its peers up, in 90 % of measured steps", "time_lost_s": 1.0}
    assert "straggler" in _ids({"stragglers": [s]})
    assert "straggler" not in _ids({"stragglers": [dict(s, kind="transient")]})
    mem = pd.DataFrame({"rank": [0], "peak_mem_bytes": [0.71], "device_mem_total_bytes": [1.0],
                        "device_type": ["cuda"]})
    assert "memory_high" in _ids({}, memory=mem)
    assert "memory_high" not in _ids({}, memory=mem.assign(peak_mem_bytes=0.69))
    gpu = pd.DataFrame({"host": ["h"], "gpu": [0], "sm_util_mean_pct": [40.0], "idle_frac": [0.5],
                        "throttled_frac": [0.0], "throttle_reasons": [""]})
    waiting = _breakdown(data_wait=0.3)
    f = F.find(waiting, _fake({}, gpu=gpu))
    low = [x for x in f if x["id"] == "low_gpu_util"]
    assert low and "input data" in low[0]["evidence"]["cause"] and low[0]["part"] == "data_wait"
    assert "low_gpu_util" not in _ids(waiting, gpu=gpu.assign(sm_util_mean_pct=60.0))
    assert "data_wait" in _ids(_breakdown(data_wait=0.11)) and "data_wait" not in _ids(_breakdown(data_wait=0.09))


def _breakdown(by_dim=None, by_op=None, step=1.0, **parts):
    """A summary whose breakdown block has the given parts (seconds of a ``step`` s step, the rest "other")."""
    from dtprof.analyzers.breakdown import PARTS

    mean = {p: parts.get(p, 0.0) for p in PARTS}
    mean["other"] = step - sum(mean.values())
    return {"breakdown": {"parts": list(PARTS), "step_time_s_mean": step, "mean_over_ranks_s_per_step": mean,
                          "exposed_comm_by_dim_s_per_step": by_dim or {}, "exposed_comm_by_op_s_per_step": by_op or {}}}


def test_exposed_comm_advice_fits_the_exposed_dimension_and_op():
    # DP×PP (issue 13): 134 ms exposed on pp p2p, 14 ms on dp: pipeline advice, never DDP bucket sizes
    dp_pp = _breakdown(step=0.4, exposed_comm=0.148, by_dim={"pp": 0.134, "dp": 0.014},
                       by_op={"recv": 0.1, "send": 0.034, "all_reduce": 0.014})
    f = next(x for x in F.find(dp_pp, _fake({})) if x["id"] == "exposed_comm")
    assert f["part"] == "exposed_comm" and f["dim"] == "pp"
    assert "pp 134.0 ms" in f["message"] and "dp 14.0 ms" in f["message"]
    assert "bucket" not in f["recommendation"] and "stages" in f["recommendation"]
    ddp = _breakdown(exposed_comm=0.4, by_dim={"(none)": 0.4}, by_op={"all_reduce": 0.4})
    f = next(x for x in F.find(ddp, _fake({})) if x["id"] == "exposed_comm")
    assert f["dim"] is None and "bucket_cap_mb" in f["recommendation"]
    fsdp = _breakdown(exposed_comm=0.4, by_dim={"dp": 0.4}, by_op={"all_gather": 0.3, "reduce_scatter": 0.1})
    f = next(x for x in F.find(fsdp, _fake({})) if x["id"] == "exposed_comm")
    assert f["dim"] == "dp" and "prefetch" in f["recommendation"]
    tp = _breakdown(exposed_comm=0.4, by_dim={"tp": 0.3, "dp": 0.1}, by_op={"all_reduce": 0.4})
    f = next(x for x in F.find(tp, _fake({})) if x["id"] == "exposed_comm")
    assert f["dim"] == "tp" and "tp group" in f["recommendation"] and "bucket" not in f["recommendation"]


def test_exposed_comm_of_zero_buckets_cites_the_one_bucket_what_if():
    """A DeepSpeed ZeRO-2 run with many small buckets (its all-reduces issued in backward, as each bucket fills):
    the advice is ZeRO's bucket size with the one-bucket what-if's saving, not DDP's bucket_cap_mb."""
    zero = _breakdown(exposed_comm=0.5, by_dim={"(none)": 0.5}, by_op={"all_reduce": 0.5})
    zero["what_if"] = [{"scenario": "perfect_overlap", "saving_frac": 0.49},
                       {"scenario": "zero_one_bucket", "saving_frac": 0.48}]
    f = next(x for x in F.find(zero, _fake({})) if x["id"] == "exposed_comm")
    assert "one ZeRO gradient bucket would save about 48% of the step" in f["message"], f["message"]
    assert "reduce_bucket_size" in f["recommendation"] and "bucket_cap_mb" not in f["recommendation"]


def test_findings_end_to_end_memory_and_exposed_comm(tmp_path):
    # last bucket 30 ms exposed of a ~63 ms step; peak 1 GiB of a 1.25 GiB device (80 %)
    a = analyze(build_run(tmp_path / "r", world_size=2, steps=6, bucket_ms=30, device_type="cuda",
                          device_name="NVIDIA H100 80GB HBM3", device_mem_total_bytes=int(1.25 * 2**30)))
    ids = {f["id"] for f in a.findings}
    assert {"exposed_comm", "memory_high"} <= ids
    f = next(f for f in a.findings if f["id"] == "memory_high")
    assert f["evidence"]["used_frac"] == pytest.approx(0.8) and f["recommendation"]
    b = analyze(build_run(tmp_path / "b", world_size=2, steps=6, device_type="cuda",
                          device_name="NVIDIA H100 80GB HBM3", device_mem_total_bytes=2 * 2**30))
    assert not {"exposed_comm", "memory_high"} & {f["id"] for f in b.findings}
    assert b.memory["headroom_frac"].tolist() == pytest.approx([0.5, 0.5])


# ---------------------------------------------------------------- summary, text, CLI

def test_summary_schema_keys_and_text(tmp_path):
    run = build_run(tmp_path / "r", world_size=2, steps=6)
    opened = open_run(run)
    s = analyze(opened, resolve_options(opened, flops_per_step=1e9, peak_tflops=1)).summary
    save_summary(run, s)
    on_disk = json.loads((run / "summary.json").read_text())
    assert on_disk == s and s["schema"] == "dtprof.summary/1"
    for k in ("run", "steps", "ranks", "mfu", "overlap", "pipeline", "stragglers", "collectives", "findings"):
        assert k in s
    assert s["run"] == {**s["run"], "world_size": 2, "hosts": ["host0"], "status": "completed", "exit_code": 0}
    assert set(s["ranks"][0]) >= {"rank", "host", "device", "step_time_s_p50", "compute_s_per_step",
                                  "comm_s_per_step", "exposed_comm_s_per_step", "overlap_ratio"}
    assert set(s["ranks"][0]) >= {"step_time_s_mean", "breakdown_s_per_step"}
    text = format_summary_text(s)
    assert "MFU: " in text and "%" in text
    # the breakdown as columns: the synthetic step is data 1, forward 10, backward 20, exposed 4, optimizer 2 ms
    header = next(line for line in text.splitlines() if line.lstrip().startswith("rank"))
    assert header.split()[5:] == ["forward", "backward", "optim", "exposed", "data", "wait", "bubble", "other",
                                  "overlap"]
    row = next(line for line in text.splitlines() if line.split()[:2] == ["0", "host0"])
    assert row.split()[3:17] == ["37.0", "ms", "10.0", "ms", "20.0", "ms", "2.0", "ms", "4.0", "ms", "1.0", "ms",
                                 "0", "0"]
    assert "stragglers: none" in text


def test_summary_cli_json_and_bad_dir(tmp_path):
    from dtprof.cli import main
    run = build_run(tmp_path / "r", world_size=2, steps=6)
    res = CliRunner().invoke(main, ["summary", str(run), "--json", "--flops-per-step", "1e9", "--peak-tflops", "1"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["mfu"]["value"] == pytest.approx(1e9 / (0.037 * 2e12))
    assert (run / "summary.json").exists()
    res = CliRunner().invoke(main, ["summary", str(run), "--transformer", "n_params=1e6"])
    assert res.exit_code == 2 and "--transformer" in res.output
    bad = CliRunner().invoke(main, ["summary", str(tmp_path / "nope")])
    assert bad.exit_code == 2 and "no such run directory" in bad.output and "Traceback" not in bad.output


def test_analyzers_do_not_import_torch():
    code = ("import sys, dtprof.analyzers.summary, dtprof.summary; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_run_without_steps_gives_nulls_with_reasons(tmp_path):
    # a job that died before its first step: every figure is null with its reason, nothing raises
    run = hand_run(tmp_path / "r", [], [], steps=(), ranks=(0, 1))
    s = analyze(run).summary
    assert s["steps"]["count"] == 0 and s["steps"]["time_s"]["p50"] is None and s["steps"]["time_s_reason"]
    assert s["mfu"]["value"] is None and s["mfu"]["value_reason"]
    assert s["overlap"]["ratio"] is None and s["pipeline"] is None and s["stragglers"] == []
    assert "0 measured" in format_summary_text(s)


def test_window_step_and_instance_window():
    """collectives.window_step: a time is in the window ([start, end)) of its own rank that holds it, else in no
    step (-1); other ranks' windows never count. An instance is measured when one of its rows is in a measured
    step, else excluded when one is in a step, else outside (collectives.instances_of)."""
    from dtprof.analyzers.collectives import instances_of, window_step
    from dtprof.analyzers.nodesummary import Rows

    steps = pd.DataFrame({"rank": [1, 0, 0, 1], "step": [1, 0, 1, 0], "start_ns": [500, 100, 300, 100],
                          "end_ns": [600, 200, 400, 200]})
    rank = np.array([0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2])
    t = np.array([50, 100, 199, 200, 350, 450, 150, 350, 500, 700, 150])
    assert window_step(rank, t, steps).tolist() == [-1, 0, 0, -1, 1, -1, 0, -1, 1, -1, -1]
    rows = pd.DataFrame({"group": "0", "sender": -1, "receiver": -1, "seq": [0, 0, 1, 1, 2],
                         "wstep": [-1, 1, 0, -1, -1], "op": "all_reduce", "n": [1, 1, 1, 1, 2],
                         "dur_min_ns": [5, 3, 4, 4, 6], "dur_sum_ns": [5, 3, 4, 4, 14],
                         "bytes_max": 8, "group_size_max": 2})
    inst = instances_of(Rows.of("instance_rows", rows), measured_steps={1})
    assert inst["window"].tolist() == ["measured", "excluded", "outside"]
    assert inst["ranks"].tolist() == [2, 2, 2] and inst["transfer_s"].tolist() == [3e-9, 4e-9, 6e-9]
    assert inst["mean_s"].tolist() == [4e-9, 4e-9, 7e-9]
