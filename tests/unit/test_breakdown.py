"""The step breakdown (analyzers/breakdown.py) on hand-built intervals with worked answers, and on synthetic runs:
every instant of a rank-step goes to exactly one part by the documented priority, so the parts add up."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dtprof.analyzers import whatif  # noqa: E402
from dtprof.analyzers.breakdown import PARTS  # noqa: E402
from dtprof.analyzers.intervals import split_over_windows  # noqa: E402
from dtprof.analyzers.options import AnalysisOptions  # noqa: E402
from dtprof.analyzers.runmodel import RunModel  # noqa: E402
from dtprof.analyzers.summary import analyze  # noqa: E402
from dtprof.reader import open_run  # noqa: E402
from synth import build_run, hand_run  # noqa: E402


def _parts_ms(a, rank=0, step=0) -> dict:
    row = a.steps[(a.steps["rank"] == rank) & (a.steps["step"] == step)].iloc[0]
    parts = {p: round(float(row[f"{p}_s"]) * 1e3, 6) for p in PARTS}
    assert parts.pop("gpu_wait") == 0   # these hand-made ranks are CPU ranks: they never wait for a GPU
    return parts


def test_overlapping_spans_and_comm_partitioned_by_priority(tmp_path):
    # step [0,100): data_wait [0,10), forward [10,40), backward [40,90) with comm_wait [70,90) nested in it,
    # optimizer [90,95); all_reduce in flight [30,50) (under compute: hidden) and [60,98).
    # exposed = [70,90) blocked + [95,98) comm with no compute = 23; backward = [40,70) = 30; other = [98,100)
    run = hand_run(tmp_path / "r", [(0, "data_wait", 0, 10), (0, "forward", 10, 40), (0, "backward", 40, 90),
                                    (0, "comm_wait", 70, 90), (0, "optimizer", 90, 95)],
                   [(0, "all_reduce", 0, 30, 50, 1024, 1), (0, "all_reduce", 1, 60, 98, 1024, 1)])
    a = analyze(run, AnalysisOptions(warmup=0))
    assert _parts_ms(a) == {"forward": 30, "backward": 30, "optimizer": 5, "exposed_comm": 23,
                            "data_wait": 10, "bubble": 0, "other": 2}
    r = a.summary["ranks"][0]
    assert r["step_time_s_mean"] == pytest.approx(0.1)
    assert sum(r["breakdown_s_per_step"].values()) == pytest.approx(0.1, rel=1e-12)
    assert r["exposed_comm_s_per_step_by_op"] == {"all_reduce": pytest.approx(0.023)}


def test_phases_nested_in_optimizer_step_closure_are_the_innermost(tmp_path):
    # Lightning's step: optimizer.step(closure) runs forward and backward inside the optimizer span.
    # Rank 0, step [0,100): data_wait [0,10), optimizer [10,95) holding forward [15,35) and backward [40,90); DDP's
    # all_reduce in flight [60,88) (hidden under backward), the rank blocked on it [75,90) (comm_wait in backward).
    # forward 20, backward [40,75) = 35, exposed 15, optimizer [10,15)+[35,40)+[90,95) = 15, other [95,100) = 5.
    # Rank 1: spans that cross rather than nest, forward [10,40) and optimizer [30,60): the one that began last
    # wins where both run (forward 20, optimizer 30).
    run = hand_run(tmp_path / "r", [(0, "data_wait", 0, 10), (0, "optimizer", 10, 95), (0, "forward", 15, 35),
                                    (0, "backward", 40, 90), (0, "comm_wait", 75, 90),
                                    (1, "forward", 10, 40), (1, "optimizer", 30, 60)],
                   [(0, "all_reduce", 0, 60, 88, 1024, 1)], ranks=(0, 1))
    a = analyze(run, AnalysisOptions(warmup=0))
    assert _parts_ms(a) == {"forward": 20, "backward": 35, "optimizer": 15, "exposed_comm": 15,
                            "data_wait": 10, "bubble": 0, "other": 5}
    assert _parts_ms(a, rank=1) == {"forward": 20, "backward": 0, "optimizer": 30, "exposed_comm": 0,
                                    "data_wait": 0, "bubble": 0, "other": 50}
    # the what-if model cuts the same timeline into the same work (its blocked time is waits, not work)
    g = whatif.build(RunModel.of(open_run(run)))
    work = g.kind == whatif.WORKI
    for rank, want in ((0, {"forward": 20, "backward": 35, "optimizer": 15}), (1, {"forward": 20, "optimizer": 30})):
        mine = work & (g.windows["rank"].to_numpy()[g.win] == rank)
        got = {whatif.WORK_PARTS[p]: g.dur[mine & (g.part == p)].sum() / 1e6 for p in whatif.COMPUTE_PARTS}
        assert got == {p: want.get(p, 0) for p in ("forward", "backward", "optimizer")}


def test_collective_issued_between_steps_is_exposed_communication_split_by_where_it_was_issued(tmp_path):
    # step [0,100): data_wait [0,10), forward [10,40), backward [40,80), optimizer [80,85); DDP's all_reduce issued
    # in backward, in flight [50,90); a framework's broadcast issued after the optimizer, in flight [88,95), the rank
    # blocked on it [90,95) (comm_wait); the next batch's DataLoader.__next__ [92,100).
    # exposed_comm = all_reduce alone [85,88) + half of [88,90) = 4, plus the broadcast's other half + [90,95)
    # = 6 (it outranks the data_wait span it overlaps): 10, issued 4 in backward and 6 between steps;
    # data_wait = 10 + [95,100) = 15.
    run = hand_run(tmp_path / "r", [(0, "data_wait", 0, 10), (0, "forward", 10, 40), (0, "backward", 40, 80),
                                    (0, "optimizer", 80, 85), (0, "comm_wait", 90, 95), (0, "data_wait", 92, 100)],
                   [(0, "all_reduce", 0, 50, 90, 1024, 1), (0, "broadcast", 1, 88, 95, 8, 1)])
    a = analyze(run, AnalysisOptions(warmup=0))
    assert _parts_ms(a) == {"forward": 30, "backward": 40, "optimizer": 5, "exposed_comm": 10,
                            "data_wait": 15, "bubble": 0, "other": 0}
    r = a.summary["ranks"][0]
    assert sum(r["breakdown_s_per_step"].values()) == pytest.approx(r["step_time_s_mean"], rel=1e-12)
    assert r["exposed_comm_s_per_step_by_op"] == {"all_reduce": pytest.approx(0.004),
                                                  "broadcast": pytest.approx(0.006)}
    assert r["exposed_comm_s_per_step_by_issued"] == {"backward": pytest.approx(0.004),
                                                      "between steps": pytest.approx(0.006)}
    assert a.summary["overlap"]["exposed_comm_frac"] == pytest.approx(0.10)


def test_reduction_after_backward_is_exposed_and_said_to_be_issued_there(tmp_path):
    # DeepSpeed ZeRO's shape: forward [0,20), backward [20,50), then the engine's gradient all_reduce issued after
    # backward returns, in flight [52,80) with nothing else; optimizer [80,90); the updated partitions all-gathered
    # after it, [90,100). Exposed: 28 issued after backward, 10 between steps; 38 % of the step, in the headline,
    # the breakdown and the finding alike.
    run = hand_run(tmp_path / "r", [(0, "forward", 0, 20), (0, "backward", 20, 50), (0, "optimizer", 80, 90)],
                   [(0, "all_reduce", 0, 52, 80, 1024, 1), (0, "all_gather", 1, 90, 100, 1024, 1)])
    a = analyze(run, AnalysisOptions(warmup=0))
    assert _parts_ms(a) == {"forward": 20, "backward": 30, "optimizer": 10, "exposed_comm": 38,
                            "data_wait": 0, "bubble": 0, "other": 2}
    s = a.summary
    assert s["ranks"][0]["exposed_comm_s_per_step_by_issued"] == {"after backward": pytest.approx(0.028),
                                                                  "between steps": pytest.approx(0.010)}
    assert s["overlap"]["exposed_comm_frac"] == pytest.approx(0.38)
    found = [f for f in s["findings"] if f["id"] == "exposed_comm"]
    assert found and found[0]["evidence"]["exposed_comm_frac"] == pytest.approx(0.38)
    assert "after backward" in found[0]["recommendation"] or "after backward" in found[0]["message"]


def test_concurrent_collectives_split_equally_by_mesh_dimension_and_op(tmp_path):
    # no compute; dp all_reduce [0,40) and tp all_gather [20,60) in flight: [20,40) is split half and half
    groups = pd.DataFrame({"rank": [0, 0], "group": ["1", "2"], "ranks": ["0", "0"], "size": [1, 1],
                           "backend": "gloo", "desc": "", "mesh_dim": ["dp", "tp"]})
    run = hand_run(tmp_path / "r", [], [(0, "all_reduce", 0, 0, 40, 8, 1, "1"),
                                        (0, "all_gather", 0, 20, 60, 8, 1, "2")], groups=groups)
    r = analyze(run, AnalysisOptions(warmup=0)).summary["ranks"][0]
    assert r["breakdown_s_per_step"]["exposed_comm"] == pytest.approx(0.060)
    assert r["exposed_comm_s_per_step_by_dim"] == {"dp": pytest.approx(0.030), "tp": pytest.approx(0.030)}
    assert r["exposed_comm_s_per_step_by_op"] == {"all_reduce": pytest.approx(0.030),
                                                  "all_gather": pytest.approx(0.030)}
    assert r["breakdown_s_per_step"]["other"] == pytest.approx(0.040)


def test_pipeline_fill_is_bubble_not_data_wait(tmp_path):
    # rank 1 is a last pipeline stage: its data_wait [0,30) holds the recv of stage 0's first activation [5,30);
    # the rest of its step besides its pipeline ops [30,40) and [60,70) idles: bubble = 25 + 20 + 30 ms. Rank 0
    # (no pipeline spans) sends at [80,90) with nothing else: that is exposed communication, not bubble.
    run = hand_run(tmp_path / "r", [(1, "data_wait", 0, 30), (1, "pp_forward", 30, 40), (1, "pp_backward", 60, 70)],
                   [(1, "recv", 0, 5, 30, 64, 2), (0, "send", 0, 80, 90, 64, 2)], ranks=(0, 1))
    a = analyze(run, AnalysisOptions(warmup=0))
    assert _parts_ms(a, rank=1) == {"forward": 10, "backward": 10, "optimizer": 0, "exposed_comm": 0,
                                    "data_wait": 5, "bubble": 75, "other": 0}
    assert _parts_ms(a, rank=0)["exposed_comm"] == 10 and _parts_ms(a, rank=0)["bubble"] == 0
    assert a.summary["breakdown"]["pipeline_ranks"] == [1]


def test_interval_crossing_a_step_boundary_counts_in_both_steps(tmp_path):
    run = hand_run(tmp_path / "r", [], [(0, "all_reduce", 0, 40, 60, 8, 1)], steps=((0, 0, 50), (1, 50, 100)))
    a = analyze(run, AnalysisOptions(warmup=0))
    assert _parts_ms(a, step=0)["exposed_comm"] == 10 and _parts_ms(a, step=1)["exposed_comm"] == 10


def test_split_over_windows_cuts_and_drops_outside_parts():
    # key 0 has windows [0,10) and [10,20); key 1 has [0,5). Interval 0 crosses both windows of key 0, interval 1
    # lies before every window, interval 2 belongs to key 1 and is clipped to [3,5).
    item, win, s, e = split_over_windows(np.array([0, 0, 1]), np.array([0, 10, 0]), np.array([10, 20, 5]),
                                         np.array([0, 0, 1]), np.array([5, -9, 3]), np.array([15, -1, 9]))
    assert list(zip(item, win, s, e)) == [(0, 0, 5, 10), (0, 1, 10, 15), (2, 2, 3, 5)]


def test_ddp_synth_breakdown_is_the_built_step(tmp_path):
    # synth.py's DDP step: data 1, forward 10, backward 20 (then 4 ms blocked on the last bucket), optimizer 2 ms
    a = analyze(build_run(tmp_path / "r", world_size=4, steps=6))
    for r in a.summary["ranks"]:
        b = {k: round(v * 1e3, 6) for k, v in r["breakdown_s_per_step"].items()}
        assert b.pop("gpu_wait") == 0   # a CPU rank
        assert b == {"forward": 10, "backward": 20, "optimizer": 2, "exposed_comm": 4,
                     "data_wait": 1, "bubble": 0, "other": 0}
        assert r["step_time_s_mean"] == pytest.approx(0.037)


def test_pipeline_synth_bubble_is_the_schedule_idle_time(tmp_path):
    # uniform GPipe, 2 stages, 4 microbatches, no transfer time: each stage idles (p-1)(f+b) = 1 × (10 + 20) ms
    a = analyze(build_run(tmp_path / "r", world_size=2, steps=6, pipeline_stages=2, microbatches=4))
    for r in a.summary["ranks"]:
        b = r["breakdown_s_per_step"]
        assert b["bubble"] == pytest.approx(0.030) and b["forward"] == pytest.approx(0.040)
        assert b["backward"] == pytest.approx(0.080) and b["other"] == pytest.approx(0.0, abs=1e-12)
        assert sum(b.values()) == pytest.approx(r["step_time_s_mean"], rel=1e-12)
