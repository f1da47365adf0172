"""The live path (`dtprof run --metrics`, dtprof/live.py) gives the after-run analysis's answers on the same
tables: each rank-step's lateness and lead at collectives, which steps held the peers up, who is a straggler, and
whether the job hangs. The rows are written by hand with the ranks' own writer (times in ms, so the truth is known
without dtprof): three ranks, 30 steps of 100 ms, two all-reduces a step; rank 2 arrives 60 ms after the others at
its first all-reduce in 24 steps, rank 1 as late in 3 (a late step of a peer, not a straggler), and every rank a
little later than rank 0 at the second one."""
from __future__ import annotations

import os

import numpy as np
import pytest

from dtprof.analyzers.options import AnalysisOptions
from dtprof.analyzers.summary import analyze
from dtprof.analyzers.triage import triage
from dtprof.live import LiveNode
from dtprof.reader import open_run
from dtprof.rundir.incident import read_incident
from dtprof.rundir.writer import RankWriter, create_run_dir, write_json_atomic

MS = 1_000_000
STEPS = 30
STEP_MS = 100
RANKS = (0, 1, 2)
LATE = {2: set(range(3, 27)), 1: {0, 1, 29}}     # rank -> steps it is 60 ms late at the first all-reduce


def _arrival_ms(rank: int, step: int, k: int) -> int:
    """When ``rank`` enters all-reduce ``k`` (0, 1) of ``step``, in ms."""
    t0 = step * STEP_MS
    if k == 0:
        return t0 + 10 + (60 if step in LATE.get(rank, ()) else 0)
    return t0 + 80 + rank         # rank r arrives r ms after rank 0: a lead of 1 ms for rank 2, never material


def _write(run_dir):
    create_run_dir(run_dir, {"command": ["hand"]})
    node = run_dir / "node-h-1"
    for rank in RANKS:
        w = RankWriter(node, rank)
        w.write_identity({"rank": rank, "local_rank": rank, "host": "h", "world_size": len(RANKS), "pid": 1,
                          "device_type": "cpu", "device_name": "cpu", "device_index": rank, "backend": "gloo"})
        for step in range(STEPS):
            s, e = step * STEP_MS * MS, (step + 1) * STEP_MS * MS
            w.append("steps", (rank, step, s, e, None, 100, 2, None, None, None, None))
            w.append("spans", (rank, step, "forward", "forward", s, e - 5 * MS, None, None, "main", "hook", None))
            for k in (0, 1):
                seq = 2 * step + k
                end = (step * STEP_MS + (71 if k == 0 else 83)) * MS
                w.append("collectives", (rank, step, "all_reduce", "all_reduce", "user", "0", len(RANKS), seq, 8, 8,
                                         "float32", None, False, _arrival_ms(rank, step, k) * MS, end, end, None,
                                         None, None, None))
        w.close()
    return node


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("live") / "run"
    node = _write(run_dir)
    live = LiveNode(node, {}, "h")
    steps = live.poll(final=True).steps
    analysis = analyze(open_run(run_dir), AnalysisOptions(warmup=0))
    return run_dir, node, live, steps, analysis


def test_each_rank_steps_lateness_is_the_written_truth_and_its_lead_the_analysis(both):
    _, _, _, steps, analysis = both
    assert len(steps) == STEPS * len(RANKS)
    for s in steps:   # lateness: its arrival minus the first arrival, summed over the step's two all-reduces
        first = [min(_arrival_ms(r, s.step, k) for r in RANKS) for k in (0, 1)]
        want = sum(_arrival_ms(s.rank, s.step, k) - first[k] for k in (0, 1)) * MS / 1e9
        assert s.lateness_s == pytest.approx(want, abs=1e-12), (s.rank, s.step)
    arr = analysis.arrivals
    last = arr[arr["last"]]
    after = last.groupby(["rank", "step"])["lead_s"].sum()
    for s in steps:
        assert s.lead_s == pytest.approx(float(after.get((s.rank, s.step), 0.0)), abs=1e-12), (s.rank, s.step)
    # the written leads: rank 2 is 60 ms ahead of the second-latest in its late steps (+1 ms at the second)
    lead2 = {s.step: s.lead_s for s in steps if s.rank == 2}
    assert lead2[5] == pytest.approx(0.061) and lead2[0] == pytest.approx(0.001)


def test_late_steps_and_the_straggler_are_the_analysis_ones(both):
    _, _, live, _, analysis = both
    table = analysis.stragglers.set_index("rank")
    live_late = {r: sum(q) for r, q in live.late.items()}
    assert live_late == {0: 0, 1: 3, 2: 24}
    assert live_late == {int(r): int(n) for r, n in table["late_steps"].items()}
    assert set(live.stragglers()) == {2}
    assert table.loc[2, "kind"] == "transient" and set(table.index[table["kind"] != "none"]) == {2}
    assert [t["rank"] for t in analysis.summary["transient_lateness"]] == [2]


def test_hang_is_triages_live_hang(both):
    """No rank progressed for the timeout: the live status and `dtprof triage --live` say hang at the same
    instants, and neither before."""
    run_dir, node, _, _, _ = both
    t0 = 5_000 * 10**9
    for rank in RANKS:
        write_json_atomic(node / f"rank-{rank}" / "heartbeat.json",
                          {"beat": 1, "beat_end": 1, "rank": rank, "pid": os.getpid(), "exit": None, "step": 30,
                           "last_progress_ns": t0 - rank * 10**9})
    for age_s in (10, 29.5, 30, 31, 400):
        now = t0 + int(age_s * 1e9)
        st = LiveNode(node, {"hang_timeout_s": 30}, "h", clock=lambda now=now: now).poll().status
        verdict = triage(open_run(run_dir), {"incident": read_incident(run_dir), "live": True, "stale_s": 30,
                                              "now_ns": now})["verdict"]
        assert st.progress_age_s == pytest.approx(age_s)
        assert st.hang is (age_s >= 30) and (verdict == "hang") is st.hang, (age_s, verdict)
    assert np.isclose(st.hang_after_s, 30)
