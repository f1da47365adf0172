"""A long run's analysis reads the detail of a sample of its detailed steps (analyzers/steps.py detail_every):
every node and the whole run pick the same blocks, the figures from the stored node summaries equal those from the
raw tables, every step's time still counts, and the summary says what was read. The limits are lowered here so
that a small synthetic run is "long"."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from dtprof import reader
from dtprof.analyzers import steps as steps_mod
from dtprof.analyzers.runmodel import RunModel
from dtprof.reader import open_run
from dtprof.rundir import run as rundir_run
from dtprof.rundir import writer
from dtprof.rundir.schema import SUMMARY_COMPLETE, SUMMARY_DIR, TABLES_DIR
from dtprof.rundir.writer import create_run_dir
from dtprof.summarize import summarize_node
from scale_checks import assert_summaries_equal_raw
from synth import build_ddp_node

STEPS, PERIOD = 400, 8


@pytest.fixture
def long_run(tmp_path, monkeypatch):
    monkeypatch.setattr(steps_mod, "ANALYSED_RANK_STEPS", 256)
    monkeypatch.setattr(steps_mod, "ANALYSED_MIN_STEPS", 16)
    monkeypatch.setattr(writer, "ROW_GROUP_ROWS", 100)   # tables of many row groups, read a few at a time
    monkeypatch.setattr(rundir_run, "READ_CHUNK_ROWS", 250)   # where Run.read_rows reads it
    run = create_run_dir(tmp_path / "run", {"command": ["synthetic"]})
    nodes = [build_ddp_node(run, n, 2, 4, STEPS, slow_rank=3, slow_factor=1.3, seed=1, detail_period=PERIOD)
             for n in range(2)]
    return run, nodes


def _detailed(steps):
    return [s for s in steps if s < 32 or s % PERIOD < 4]


def test_the_run_reads_every_kth_detailed_block_and_counts_every_step(long_run):
    run, _ = long_run
    model = RunModel.of(open_run(run), source="raw")
    # 215 timed detailed steps of 4 ranks, at most 256 // 4 = 64 read: the blocks at multiples of 4k steps, k = 8
    assert model.detail_every == 8
    timed = model.job.loc[model.job["timed"], "step"].tolist()
    assert sorted(model.measured_steps) == [s for s in _detailed(timed) if s % 32 < 4]
    assert len(timed) == STEPS - 1                      # every step's time counts (1 warm-up step)
    spans = model.spans
    assert set(spans["step"].dropna().astype(int)) <= set(model.measured_steps) | set(range(32))


def test_stored_node_summaries_equal_the_raw_tables(long_run):
    run, nodes = long_run
    for nd in nodes:
        summarize_node(str(nd))
        facts = json.loads((nd / SUMMARY_DIR / SUMMARY_COMPLETE).read_text())
        assert facts["detail_every"] == 4     # a node has 2 ranks: at most 128 of its steps are read (a superset)
    s = assert_summaries_equal_raw(run)
    st = s["steps"]
    assert st["detail_read_every"] == 8 and st["detailed_count"] == len(RunModel.of(open_run(run)).measured_steps)
    assert st["detailed_count"] + st["detail_skipped_count"] == len(_detailed(range(1, STEPS)))
    assert st["boundary_only_count"] == STEPS - 1 - len(_detailed(range(1, STEPS)))
    assert "the analysis read the detail of" in st["sampling"]["statement"]
    assert s["stragglers"] and s["stragglers"][0]["rank"] == 3
    # the breakdown's sample set beside the rest: the mean step time of the detailed steps read, and of the others
    job = RunModel.of(open_run(run)).job
    detailed, others = job.loc[job["measured"], "time_s"], job.loc[job["timed"] & job["boundary_only"], "time_s"]
    assert st["sampling"]["detailed_step_mean_s"] == pytest.approx(detailed.mean())
    assert st["sampling"]["boundary_step_mean_s"] == pytest.approx(others.mean())
    assert f"the detailed steps took {detailed.mean() * 1e3:.3g} ms on average" in st["sampling"]["statement"]


def test_a_long_table_is_read_in_chunks_as_a_slice_of_the_whole(long_run):
    run, nodes = long_run
    one = reader.Run(run, [nodes[1]])
    model = RunModel.of(one)
    skipped = model.skipped_steps
    files = pq.ParquetFile(nodes[1] / TABLES_DIR / "collectives.parquet").metadata
    assert len(skipped) and files.num_rows > 4 * rundir_run.READ_CHUNK_ROWS and files.num_row_groups > 4
    for table in ("spans", "collectives"):
        whole = reader.Run(run, [nodes[1]]).table(table)
        keep = ~whole["step"].astype("Int64").isin(skipped).fillna(False).to_numpy(bool)
        pd.testing.assert_frame_equal(one.read_rows(table, skip_steps=skipped), whole[keep])
        cols = ["rank", "op", "seq"] if table == "collectives" else ["kind", "end_ns"]
        pd.testing.assert_frame_equal(one.read_rows(table, columns=cols), whole[cols])
    assert table not in one._loaded   # never read whole


def test_rank_steps_met_by_nothing_are_filled_in_as_measuring_them_gives(long_run, monkeypatch):
    from dtprof.analyzers import nodesummary

    run, nodes = long_run
    model = RunModel.of(reader.Run(run, [nodes[0]]))
    tables, facts = nodesummary.node_tables(model)
    touched = nodesummary._touched(model, model.steps)
    assert touched.any() and not touched.all()    # boundary-only steps and skipped detail: met by nothing
    monkeypatch.setattr(nodesummary, "_touched", lambda m, w: np.ones(len(w), bool))
    measured, measured_facts = nodesummary.node_tables(model)
    assert facts == measured_facts and tables.keys() == measured.keys()
    for t in tables:
        pd.testing.assert_frame_equal(tables[t].reset_index(drop=True), measured[t].reset_index(drop=True))


def test_short_runs_read_all_their_detail():
    assert steps_mod.detail_every(np.arange(1000), 8) == 1
    assert steps_mod.detail_every(np.arange(64), 16_384) == 1      # at least ANALYSED_MIN_STEPS steps
    big = steps_mod.detail_every(np.arange(1_000_000), 8)
    assert big & (big - 1) == 0 and np.count_nonzero(steps_mod.detail_read(np.arange(1_000_000), big)) <= 16_384


def test_a_job_that_ended_in_its_calibration_says_which_steps_are_sampled():
    # a 60-step Lightning job of 7 ms steps ended before the ranks' first sampling decision (no sampling rows): 16
    # steps of the calibration blocks had their times only, and the summary must say so beside "42 steps" a rank
    meta = pd.DataFrame({"rank": [0], "kind": ["flops"], "value": [{}]})
    st = steps_mod.sampling(meta, detailed=42, boundary_only=16, means=(0.0069, 0.0081))
    assert st["statement"] == ("42 step(s) in full detail, 16 with their times only; step times and throughput use "
                               "every step, the breakdown, overlap, what-if and stragglers the detailed ones; the "
                               "detailed steps took 6.9 ms on average, the others 8.1 ms")
    assert steps_mod.sampling(meta, detailed=58, boundary_only=0) is None   # every step in detail: nothing to say
