"""The what-if model (analyzers/whatif.py) on synthetic runs with hand-worked answers (tests/synth.py).

The synthetic DDP step (build_run defaults): data 1 ms, forward 10, backward 20 (two 4 ms all-reduce buckets issued
at its middle and end), a comm_wait for the last bucket, optimizer 2: 37 ms, every rank leaving the last all-reduce
together. Each answer below is worked from those numbers.
"""
import pandas.testing as pd_testing
import pytest

from dtprof.analyzers import whatif
from dtprof.analyzers.runmodel import RunModel
from dtprof.analyzers.summary import analyze
from dtprof.reader import open_run
from dtprof.reports import terminal
from dtprof.reports.whatif import whatif_html
from synth import build_run

KEYS = {"scenario", "ranks", "predicted_step_s", "measured_step_s", "saving_frac", "basis"}


def _entry(summary, scenario, ranks=None):
    return next(w for w in summary["what_if"] if w["scenario"] == scenario and (ranks is None or w["ranks"] == ranks))


def test_identity_replay_reproduces_the_measured_steps(tmp_path):
    # the unmodified model replays each step exactly: all ranks leave the last bucket at the last arrival + 4 ms
    a = analyze(build_run(tmp_path / "r", world_size=3, steps=8, slow_rank=1, slow_factor=1.5))
    assert a.summary["replay"]["error_frac"] == pytest.approx(0.0, abs=1e-6)
    assert a.summary["replay"]["steps"] == a.summary["steps"]["count"]


def test_straggler_removed_predicts_the_step_without_the_slow_rank(tmp_path):
    # rank 1's phases are 1.5× (data 1.5, forward 15, backward 30, optimizer 3): the step is 46.5 + 4 + 3 = 53.5 ms.
    # With rank 1 at its peers' median: every rank arrives at the last bucket at 31 ms, leaves at 35, optimizer
    # 2 ms, and ranks 0 and 2 keep the 1 ms idle tail they had after their optimizer (the synthetic step ends with the
    # slowest optimizer): 38 ms
    a = analyze(build_run(tmp_path / "r", world_size=3, steps=8, slow_rank=1, slow_factor=1.5))
    w = _entry(a.summary, "straggler_removed", [1])
    assert set(w) == KEYS
    assert w["measured_step_s"] == pytest.approx(0.0535)
    assert w["predicted_step_s"] == pytest.approx(0.038, rel=1e-6)
    assert w["saving_frac"] == pytest.approx(1 - 38 / 53.5, rel=1e-6)
    # the fast ranks save nothing, so only rank 1 is a suspect; it is named persistent by its impact
    assert [x["ranks"] for x in a.summary["what_if"] if x["scenario"] == "straggler_removed"] == [[1]]
    assert [(s["rank"], s["kind"]) for s in a.summary["stragglers"]] == [(1, "persistent")]
    # its finding cites the saving (1 - 38 / 53.5 = 29 %)
    f = next(f for f in a.findings if f["id"] == "straggler")
    assert "removing its extra work would save about 29% of the step" in f["message"]
    assert [x["saving_frac"] for x in a.summary["what_if"]] == sorted(
        (x["saving_frac"] for x in a.summary["what_if"]), reverse=True)


def test_a_rank_slowed_by_waiting_for_a_cpu_is_not_a_straggler_and_the_contention_is_named(tmp_path):
    # the same 1.5x slower rank 1, but its extra 16.5 ms a step is time its training thread waited for a CPU
    # (another process held its core): removing it still saves 29 %, yet it is not the rank's own work, so the
    # rank is not named; the finding names the contention instead (rank 1: 16.5 of 53.5 ms, its peers 0: a mean of
    # 5.5 ms over 3 ranks, 10.3 % of the step)
    a = analyze(build_run(tmp_path / "r", world_size=3, steps=8, slow_rank=1, slow_factor=1.5,
                          slow_by_cpu_wait=True))
    assert _entry(a.summary, "straggler_removed", [1])["saving_frac"] == pytest.approx(1 - 38 / 53.5, rel=1e-6)
    assert a.summary["stragglers"] == []
    assert "waits 16.5 ms more for a CPU (not its own work)" in _entry(a.summary, "straggler_removed", [1])["basis"]
    c = a.summary["cpu_wait"]
    assert c["worst_rank"] == 1 and c["worst_s_per_step"] == pytest.approx(0.0165, rel=1e-6)
    assert c["frac_of_step"] == pytest.approx(0.0165 / 3 / 0.0535, rel=1e-6)
    f = next(f for f in a.findings if f["id"] == "cpu_contention")
    assert "rank 1 most: 16.5 ms per step" in f["message"]
    assert not any(f["id"] == "straggler" for f in a.findings)
    # the terminal's per-rank table shows each rank's wait for a CPU after the breakdown's parts
    rows = terminal.render(a).splitlines()
    header = next(i for i, line in enumerate(rows) if line.split()[:2] == ["rank", "host"])
    assert rows[header].endswith("cpu wait")
    assert rows[header + 2].endswith("16.5 ms") and rows[header + 1].endswith(" 0"), rows[header:header + 4]


def test_perfect_overlap_removes_the_exposed_last_bucket(tmp_path):
    # the last bucket's 4 ms after the last arrival is the only exposed communication: 37 -> 33 ms
    a = analyze(build_run(tmp_path / "r", world_size=2, steps=8))
    w = _entry(a.summary, "perfect_overlap")
    assert w["ranks"] == [] and w["predicted_step_s"] == pytest.approx(0.033, rel=1e-6)
    assert w["saving_frac"] == pytest.approx(4 / 37, rel=1e-6)
    assert not any(f["id"] == "exposed_comm" for f in a.findings)   # 11 % exposed: under the finding's 30 %
    # a 20 ms last bucket: 53 -> 33 ms, 38 % exposed; the finding fires and cites the scenario's saving
    a = analyze(build_run(tmp_path / "big", world_size=2, steps=8, bucket_ms=20.0))
    assert _entry(a.summary, "perfect_overlap")["saving_frac"] == pytest.approx(20 / 53, rel=1e-6)
    f = next(f for f in a.findings if f["id"] == "exposed_comm")
    assert f["evidence"]["saving_frac"] == pytest.approx(20 / 53, rel=1e-6)
    assert "would save about 38% of the step" in f["message"]


def test_no_data_wait_removes_the_input_wait(tmp_path):
    # data 6 ms: 42 ms step; without it 36 ms. The data_wait finding cites the saving
    a = analyze(build_run(tmp_path / "r", world_size=2, steps=8, data_ms=6.0))
    w = _entry(a.summary, "no_data_wait")
    assert w["predicted_step_s"] == pytest.approx(0.036, rel=1e-6)
    f = next(f for f in a.findings if f["id"] == "data_wait")
    assert f["evidence"]["saving_frac"] == pytest.approx(6 / 42, rel=1e-6)
    assert "would save about 14% of the step" in f["message"]


def test_late_rank_saving_holds_in_every_step_and_symmetric_noise_names_nobody(tmp_path):
    # jitter on every rank (symmetric): each rank is sometimes the last, none saves 5 % in 75 % of the steps
    a = analyze(build_run(tmp_path / "r", world_size=4, steps=16, jitter_frac=0.03, seed=3))
    assert [s for s in a.summary["stragglers"] if s["kind"] == "persistent"] == []
    # a suspect's what-if still shows what removing its excess would save, and says it is not a straggler and why
    suspects = [w for w in a.summary["what_if"] if w["scenario"] == "straggler_removed"]
    assert suspects and all("not named a straggler: the saving held" in w["basis"] for w in suspects), suspects
    text = terminal.render(a)
    assert text.count("(not a straggler)") == min(len(suspects), text.count("straggler_removed"))
    assert whatif_html(a.summary, a.unnamed_suspects).count("(not a straggler)") == len(suspects)


def test_critical_path_runs_through_the_slow_rank(tmp_path):
    # the slow rank's work sets every step: the path is rank 1's data, forward and backward (46.5 ms), the last
    # bucket's 4 ms (the transfer rank 1's arrival started), then the end of rank 0 (all ranks end together; the
    # lowest rank's end is taken): its optimizer 2 ms and idle tail 1 ms
    run = open_run(build_run(tmp_path / "r", world_size=3, steps=8, slow_rank=1, slow_factor=1.5))
    w = whatif.analyze_whatif(RunModel.of(run))
    cp = w.summary["critical_path"]
    assert cp["by_rank"] == pytest.approx({"1": 50.5 / 53.5, "0": 3 / 53.5})
    assert cp["by_part"]["backward"] == pytest.approx(30 / 53.5, rel=1e-3)
    assert cp["by_part"]["exposed_comm"] == pytest.approx(4 / 53.5, rel=1e-3)


def test_scenarios_are_pure_edits(tmp_path):
    run = open_run(build_run(tmp_path / "r", world_size=3, steps=6, slow_rank=2, slow_factor=1.3))
    g = whatif.build(RunModel.of(run))
    before = g.dur.copy(), g.lag.copy()
    whatif.straggler_removed(g, [2], whatif.peers_of(g))
    whatif.perfect_overlap(g)
    whatif.no_data_wait(g)
    assert (g.dur == before[0]).all() and (g.lag == before[1]).all()


def test_terminal_summary_prints_the_top_three(tmp_path):

    a = analyze(build_run(tmp_path / "r", world_size=3, steps=8, slow_rank=1, slow_factor=1.5, data_ms=4.0))
    line = next(ln for ln in terminal.render(a).splitlines() if ln.startswith("what if"))
    top = a.summary["what_if"][:3]
    assert len(a.summary["what_if"]) > 3 or len(top) == len(a.summary["what_if"])
    for w in top:
        assert f"{w['scenario']}" in line and f"(-{w['saving_frac']:.0%})" in line
    assert line.index(top[0]["scenario"]) < line.index(top[-1]["scenario"]) or len(top) == 1


def test_a_wait_that_returned_before_its_collective_exit_was_recorded_still_waits_for_the_straggler(tmp_path):
    # On a busy machine the completion callback that records a DDP all-reduce's exit runs after ddp_final_wait has
    # returned (seen: 1.2-1.5 ms later). The comm_wait still waited for that collective: removing the slow rank
    # must save the same as when the exit is recorded on time (the hand-worked 53.5 -> 38 ms of the test above)
    import pandas as pd
    run = build_run(tmp_path / "r", world_size=3, steps=8, slow_rank=1, slow_factor=1.5)
    f = next(run.glob("node-*")) / "tables" / "collectives.parquet"
    co = pd.read_parquet(f)
    last = co["bucket"] == co["bucket"].max()
    co.loc[last, "end_ns"] += 1_500_000
    co.to_parquet(f)
    a = analyze(run)
    assert a.summary["replay"]["error_frac"] == pytest.approx(0.0, abs=1e-6)
    w = _entry(a.summary, "straggler_removed", [1])
    assert w["saving_frac"] == pytest.approx(1 - 38 / 53.5, rel=1e-6)


def test_a_host_clock_far_from_the_others_changes_no_rank_items_and_the_straggler_is_still_seen(tmp_path,
                                                                                                monkeypatch):
    # rank_items reads each rank's own records only: host 1's clock 2^60 ns (36 years) ahead shifts its ranks' items
    # and changes nothing else. Its 32 rank-steps × that time range pass 2^63, as 1.6M rank-steps of a 200,000-step
    # run's 9,400 s did: (window, time) keys packed from absolute times wrapped, the searches for collective exits
    # missed them, whole ranks stopped waiting and the what-if lost the straggler (here: no what-if at all)
    import numpy as np

    def run(off):
        return build_run(tmp_path / f"r{off}", world_size=4, hosts=2, steps=8, slow_rank=2, slow_factor=1.5,
                         host_offset_ns=[0, off])

    def items(r, off=0):
        it = whatif.rank_items(RunModel.of(open_run(r), source="raw")).items
        shift = np.where(it["rank"].to_numpy() >= 2, off, 0)
        return it.assign(t=it["t"] - shift, release=np.where(it["kind"] == whatif.WAIT, it["release"] - shift, 0))

    near, far = run(0), run(2**60)
    expected = items(near)
    assert len(expected[expected["kind"] == whatif.WAIT].groupby(["rank", "step"])) == 4 * 8   # every rank-step waits
    pd_testing.assert_frame_equal(items(far, 2**60), expected)
    # the packing's fallback (times replaced by their rank) where even a window's range would not fit
    monkeypatch.setattr(whatif, "_INT64_SAFE", 1)
    pd_testing.assert_frame_equal(items(far, 2**60), expected)
    monkeypatch.undo()
    # the hand-worked saving of the straggler test above (53.5 -> 38 ms), and rank 2 named
    a = analyze(far)
    assert _entry(a.summary, "straggler_removed", [2])["saving_frac"] == pytest.approx(1 - 38 / 53.5, rel=1e-6)
    assert [(s["rank"], s["kind"]) for s in a.summary["stragglers"]] == [(2, "persistent")]


def test_collectives_at_link_peak_on_a_gpu_run(tmp_path):
    # Two A100s (NVLink 3: 300 GB/s per GPU, analyzers/collectives.py): the last 25 MiB bucket's 4 ms after the last
    # arrival becomes 25 MiB × 2(n-1)/n ÷ 300 GB/s = 87.4 µs, so the 37 ms step becomes 33.087 ms. The first
    # bucket completes during backward and nobody waits for it, so it changes nothing
    a = analyze(build_run(tmp_path / "r", world_size=2, steps=8, device_type="cuda",
                          device_name="NVIDIA A100-SXM4-40GB"))
    w = _entry(a.summary, "collectives_at_link_peak")
    at_peak_ms = 25 * 2**20 * 1.0 / 300e9 * 1e3
    assert w["ranks"] == [] and "A100 link peak 300 GB/s" in w["basis"]
    assert w["predicted_step_s"] * 1e3 == pytest.approx(33 + at_peak_ms, rel=1e-4)
    assert "collectives_at_link_peak" not in {x["scenario"] for x in a.summary["what_if_skipped"]}


def test_collectives_at_link_peak_is_absent_on_cpu_and_unknown_links_say_why(tmp_path):
    a = analyze(build_run(tmp_path / "cpu", world_size=2, steps=8))
    assert "collectives_at_link_peak" not in {x["scenario"] for x in a.summary["what_if"]}
    skip = next(x for x in a.summary["what_if_skipped"] if x["scenario"] == "collectives_at_link_peak")
    assert skip["reason"].startswith("CPU run")
    b = analyze(build_run(tmp_path / "gpu", world_size=2, steps=8, device_type="cuda", device_name="Tesla T4"))
    skip = next(x for x in b.summary["what_if_skipped"] if x["scenario"] == "collectives_at_link_peak")
    assert "no link peak known for device 'Tesla T4'" in skip["reason"]


def test_the_pipeline_schedule_replay_runs_on_the_what_if_engine_and_detects_a_cycle():
    # one engine (whatif.relax) replays both models. Stage 0 runs B(mb 0) before F(mb 0) while stage 1 runs F then B:
    # B(0) waits for stage 1's B, which follows stage 1's F, which waits for stage 0's F, which follows B(0): a cycle
    import numpy as np

    from dtprof.analyzers.pipeline import replay_schedule
    rank = np.array([0, 0, 1, 1])
    kind = np.array(["pp_backward", "pp_forward", "pp_forward", "pp_backward"])
    args = (rank, np.zeros(4, np.int64), rank, np.zeros(4, np.int64), kind, np.array(["x"] * 4),
            np.full(4, 10, np.int64), np.zeros(4, np.int64))
    assert replay_schedule(*args) is None
    kind_ok = np.array(["pp_forward", "pp_backward", "pp_forward", "pp_backward"])
    # F0 0-10, F1 10-20, B1 20-30, B0 30-40
    assert replay_schedule(rank, *args[1:4], kind_ok, *args[5:]).tolist() == [10, 40, 20, 30]


def test_collectives_at_link_peak_on_a_real_imported_nccl_trace(tmp_path):
    # rank 0 of a real 2-rank NCCL job on A100s (conftest.SHARED): the run records the device, so the link peak
    # is known (NVLink 3, 300 GB/s). Cutting transfers to their bytes at that peak saves something, and never more
    # than perfect_overlap, which removes the transfers altogether
    from conftest import SHARED, import_kineto
    if not SHARED.exists():
        pytest.skip(f"shared Kineto traces not found at {SHARED}")
    s = analyze(import_kineto(tmp_path / "k", SHARED / "nccl_single_rank.json.gz")).summary
    peak = _entry(s, "collectives_at_link_peak")
    assert "A100 link peak 300 GB/s" in peak["basis"]
    assert 0 < peak["saving_frac"] <= _entry(s, "perfect_overlap")["saving_frac"]


def test_compare_checks_a_prediction_against_the_run_that_applied_the_fix(tmp_path):
    # base: rank 1 slowed 1.5x (53.5 ms steps; straggler_removed predicts 38 ms, worked above); head: the same job
    # without the slowdown, 37 ms. The prediction's error: of the step (38 - 37) / 37, of the saving
    # (15.5 - 16.5) / 16.5 ms of 53.5
    import json

    from click.testing import CliRunner

    from dtprof.cli import main
    base = build_run(tmp_path / "base", world_size=3, steps=8, slow_rank=1, slow_factor=1.5)
    head = build_run(tmp_path / "head", world_size=3, steps=8)
    args = ["compare", str(base), "--head", str(head), "--check-prediction", "straggler_removed:1"]
    res = CliRunner().invoke(main, args + ["--format", "json"])
    p = json.loads(res.stdout)["prediction"]
    assert p["predicted_step_s"] == pytest.approx(0.038) and p["measured_step_s"] == pytest.approx(0.037)
    assert p["step_error_frac"] == pytest.approx(1 / 37)
    assert p["saving_error_frac"] == pytest.approx((15.5 - 16.5) / 16.5)
    assert p["ranks"] == [1] and p["kind"] == "estimate"
    text = CliRunner().invoke(main, args).stdout
    assert "prediction check: straggler_removed rank 1" in text and "error of the step +3%" in text
    md = CliRunner().invoke(main, args + ["--format", "markdown"]).stdout
    assert "- prediction check: straggler_removed rank 1" in md and "of the saving -6%" in md
    # a prediction the base run did not make: one line naming what it has, exit 2
    bad = CliRunner().invoke(main, args[:-1] + ["straggler_removed:0"])
    assert bad.exit_code == 2 and "not in the base run's what-if list (it has: straggler_removed:1" in bad.output
    # perfect_overlap is an upper bound of what better communication can give: 37 -> 33 ms on the unslowed job. A
    # head whose last bucket takes 0.5 ms instead of 4 (33.5 ms) does not beat it; a head that also made forward
    # faster (a different fix) does, and the check says so
    ok = build_run(tmp_path / "fast_comm", world_size=3, steps=8, bucket_ms=0.5)
    over = build_run(tmp_path / "fast_fwd", world_size=3, steps=8, bucket_ms=0.5, fwd_ms=5)
    check = ["--check-prediction", "perfect_overlap", "--format", "json"]
    held = json.loads(CliRunner().invoke(main, ["compare", str(head), "--head", str(ok), *check]).stdout)
    assert held["prediction"]["kind"] == "bound" and held["prediction"]["bound_held"] is True
    assert held["prediction"]["predicted_step_s"] == pytest.approx(0.033)
    assert held["prediction"]["measured_step_s"] == pytest.approx(0.0335)
    beaten = CliRunner().invoke(main, ["compare", str(head), "--head", str(over), *check[:2]]).stdout
    assert "an upper bound of the saving: BEATEN by the head run" in beaten
