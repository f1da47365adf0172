"""Node summaries and `dtprof summarize` on synthetic multi-node runs (docs/scale.md): the analysis from the node
summaries equals the analysis from the raw tables, with summaries made by a local process pool, by a Dask cluster
(a real dask.distributed LocalCluster), for some nodes only, or none; the span slices views read; bad summaries.
The real jobs' equality checks sit beside their fixtures (test_analyzers_real.py, test_hybrid.py,
test_launcher_torchrun.py)."""
from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest

from conftest import dtprof
from dtprof.analyzers.collectives import INSTANCE_KEY, instances_of, merge_instances
from dtprof.analyzers.runmodel import RunModel
from dtprof.options import open_and_analyze
from dtprof.reader import open_run
from dtprof.rundir.rows import Rows
from dtprof.rundir.writer import SUMMARY_COMPLETE, SUMMARY_DIR, write_node_tables
from dtprof.summarize import make_summaries, summarize_node
from scale_checks import assert_summaries_equal_raw, differences
from synth import build_run, split_by_host

# 4 hosts of 2 ranks, a slow rank on host 2, host clocks apart: every cross-node part of the analysis is exercised
SPEC = dict(world_size=8, steps=12, hosts=4, buckets=3, jitter_frac=0.05, slow_rank=5, slow_factor=1.3,
            module_spans=2, host_offset_ns=[0, 1_000_000, 2_000_000, 3_000_000])


@pytest.fixture
def four_nodes(tmp_path):
    return split_by_host(build_run(tmp_path / "run", **SPEC))


def summarised(run_dir) -> list[str]:
    return sorted(nd.name for nd in open_run(run_dir).node_dirs if (nd / SUMMARY_DIR / SUMMARY_COMPLETE).exists())


def test_summarize_local_pool_then_analysis_from_summaries_equals_raw(four_nodes):
    r = dtprof("summarize", str(four_nodes), "--workers", "2")
    assert r.returncode == 0, r.stderr
    assert "summarised 4 node(s) locally" in r.stdout
    assert summarised(four_nodes) == ["node-host0", "node-host1", "node-host2", "node-host3"]
    s = assert_summaries_equal_raw(four_nodes)
    assert [x["rank"] for x in s["stragglers"]] == [5]
    again = dtprof("summarize", str(four_nodes))   # nothing left to do; --force redoes them
    assert again.returncode == 0 and "summarised 0 node(s)" in again.stdout
    forced = dtprof("summarize", str(four_nodes), "--force", "--workers", "1")
    assert forced.returncode == 0 and "summarised 4 node(s)" in forced.stdout


def test_summarize_on_a_dask_cluster(four_nodes):
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as c:
        r = dtprof("summarize", str(four_nodes), "--address", c.scheduler_address)
    assert r.returncode == 0, r.stderr
    assert f"summarised 4 node(s) on {c.scheduler_address}" in r.stdout
    assert_summaries_equal_raw(four_nodes)


@pytest.fixture(scope="module")
def dask_client():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as c, \
            distributed.Client(c) as client:
        yield client


def test_summary_on_a_dask_cluster_equals_one_machine(four_nodes, dask_client):
    """`dtprof summary --address`: the node summaries and the per-instance reductions on a Dask cluster of two
    worker processes give the one-machine analysis, every field of summary.json."""
    from distributed import get_task_stream

    with get_task_stream(dask_client) as ts:
        r = dtprof("summary", str(four_nodes), "--json", "--address",
                   dask_client.scheduler.address)
    assert r.returncode == 0, r.stderr
    ran = [t["key"] for t in ts.data]
    assert any("summarize_node" in str(k) for k in ran), "the node summaries were not made on the cluster"
    assert len(summarised(four_nodes)) == 4
    assert sum("instance_arrivals" in str(k) for k in ran) == 2, "the arrivals were not reduced in two partitions"
    assert sum("instances_of" in str(k) for k in ran) == 2
    on_dask = json.loads(r.stdout)
    _, one = open_and_analyze(four_nodes)   # the command's own options, in this process
    diff = differences(json.loads(json.dumps(one.summary)), on_dask)
    assert not diff, f"{len(diff)} field(s) differ, e.g. {diff[:5]}"
    assert [x["rank"] for x in on_dask["stragglers"]] == [5]
    assert on_dask["what_if"] and on_dask["breakdown"]["mean_over_ranks_s_per_step"]


def test_instances_in_partitions_merge_to_the_whole():
    """Point-to-point instances (sender and receiver in the key) over several groups, reduced in three partitions
    by the instance's hash as the Dask path does (dtprof/cluster.py): merged, the frame of one query over all rows.
    An instance's rows from two nodes fall in one partition (its shortest and summed durations are whole)."""
    rng = np.random.default_rng(3)
    n = 400
    rows = pd.DataFrame({"group": rng.choice(["pp0", "pp1", "dp", "10"], n), "sender": rng.integers(-1, 4, n),
                         "receiver": rng.integers(-1, 4, n), "seq": rng.integers(0, 40, n),
                         "wstep": rng.integers(-1, 5, n), "op": rng.choice(["send", "recv", "all_reduce"], n),
                         "n": rng.integers(1, 3, n), "dur_min_ns": rng.integers(1, 100, n),
                         "dur_sum_ns": rng.integers(100, 1000, n), "bytes_max": rng.integers(1, 10, n),
                         "group_size_max": 2})
    whole = Rows("instance_rows", frames=[("node-a", rows[: n // 2]), ("node-b", rows[n // 2:])])
    one = instances_of(whole, measured_steps={1, 2})
    parts = [instances_of(whole.partition(INSTANCE_KEY, i, 3), {1, 2}, keys=True) for i in range(3)]
    assert all(len(p) for p in parts) and sum(map(len, parts)) == len(one) > 100
    pd.testing.assert_frame_equal(merge_instances(parts), one)


def test_some_nodes_without_summaries_and_none(four_nodes):
    assert_summaries_equal_raw(four_nodes, stored=False)   # none stored: each node summarised in memory
    summarize_node(str(four_nodes / "node-host2"))            # one stored, three made in memory
    assert summarised(four_nodes) == ["node-host2"]
    assert_summaries_equal_raw(four_nodes, stored=False)


def test_first_analysis_makes_the_summaries(four_nodes):
    r = dtprof("summary", str(four_nodes), "--json")
    assert r.returncode == 0, r.stderr
    assert len(summarised(four_nodes)) == 4
    assert [x["rank"] for x in json.loads(r.stdout)["stragglers"]] == [5]


def test_pipeline_run_from_summaries(tmp_path):
    run_dir = build_run(tmp_path / "pp", pipeline_stages=4, world_size=4, steps=10, microbatches=4, p2p_ms=1.0)
    make_summaries(open_run(run_dir), workers=1)
    s = assert_summaries_equal_raw(run_dir)
    assert s["pipeline"]["stages"] == 4 and s["breakdown"]["pipeline_ranks"] == [0, 1, 2, 3]


def test_read_spans_reads_the_slice(four_nodes):
    run = open_run(four_nodes)
    sl = run.read_spans(kinds=["optimizer"], ranks=[3])
    assert "spans" not in run._loaded
    sp = open_run(four_nodes).spans
    want = sp[(sp["kind"].astype(str) == "optimizer") | (sp["rank"] == 3)].reset_index(drop=True)
    assert len(want) and set(want["rank"]) == set(range(8))
    assert (sl[["rank", "kind", "start_ns", "end_ns"]].astype({"kind": str})
            .equals(want[["rank", "kind", "start_ns", "end_ns"]].astype({"kind": str})))
    # one rank's steps 3..4, as a timeline of a few steps reads them
    few = run.read_spans(ranks=[6], steps=(3, 4))
    mine = sp[(sp["rank"] == 6) & sp["step"].between(3, 4).fillna(False).astype(bool)]
    assert len(few) == len(mine) > 0 and set(few["step"]) == {3, 4}
    assert "spans" not in run._loaded


def test_report_reads_only_the_spans_it_draws(four_nodes, tmp_path):
    # a report of a summarised run draws its timeline from a few steps' spans; it must not load every span (at
    # 16,384 ranks x 1,000 steps they do not fit in memory), and the timeline still shows those steps' phases
    from dtprof.analyzers.summary import analyze
    from dtprof.reports.html import render

    make_summaries(open_run(four_nodes), workers=1)
    run = open_run(four_nodes)
    html = render(analyze(run), {"progress": False})
    assert "spans" not in run._loaded
    assert 'id="fig-timeline"' in html and re.search(r"rank 5 (·|\\u00b7) compute", html)


def test_damaged_summary_is_one_line(four_nodes):
    make_summaries(open_run(four_nodes), workers=1)
    (four_nodes / "node-host1" / SUMMARY_DIR / "rank_steps.parquet").write_text("not parquet")
    r = dtprof("summary", str(four_nodes), "--no-write")
    assert r.returncode == 2
    assert "node summaries' rank_steps tables" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_rewritten_tables_drop_the_stale_summary(four_nodes):
    make_summaries(open_run(four_nodes), workers=1)
    nd = four_nodes / "node-host1"
    node = open_run(four_nodes).node_run(nd)
    tables = {t: node.table(t) for t in ("ranks", "steps", "spans", "collectives", "groups", "clock")}
    write_node_tables(nd, tables)   # e.g. a trace merged into the node after the job
    assert summarised(four_nodes) == ["node-host0", "node-host2", "node-host3"]
    assert_summaries_equal_raw(four_nodes, stored=False)


def test_mismatch_found_from_summaries_reading_only_its_rows(four_nodes):
    """Triage's mismatch check from the node summaries: a rank whose all-reduce differs in size from its peers' is
    named, as from the raw tables, and only the flagged instance's rows are read."""
    nd = four_nodes / "node-host1"
    node = open_run(four_nodes).node_run(nd)
    tables = {t: node.table(t) for t in ("ranks", "steps", "spans", "collectives", "groups", "clock")}
    co = tables["collectives"]
    odd = co.index[(co["rank"] == 3) & (co["seq"] == int(co["seq"].median()))][0]
    co.loc[odd, "in_bytes"] = int(co.loc[odd, "in_bytes"]) * 2
    write_node_tables(nd, tables)
    make_summaries(open_run(four_nodes), workers=1)
    s = assert_summaries_equal_raw(four_nodes)
    assert s["triage"]["verdict"] == "mismatch" and s["triage"]["culprit_ranks"] == [3], s["triage"]


def test_summary_of_another_layout_is_remade(four_nodes):
    make_summaries(open_run(four_nodes), workers=1)
    mark = four_nodes / "node-host3" / SUMMARY_DIR / SUMMARY_COMPLETE
    facts = json.loads(mark.read_text())
    mark.write_text(json.dumps({**facts, "layout": facts["layout"] - 1}))   # written by an older dtprof
    assert_summaries_equal_raw(four_nodes, stored=False)   # that node summarised in memory, not misread
    r = dtprof("summarize", str(four_nodes))
    assert r.returncode == 0 and "summarised 1 node(s)" in r.stdout, r.stdout + r.stderr
    assert json.loads(mark.read_text())["layout"] == facts["layout"]


def test_replay_of_a_sample_of_steps(four_nodes, monkeypatch):
    """A run over the replay's budget of rank-steps replays an evenly spaced sample of its measured steps, reading
    only those steps' what-if items from the node summaries; the analysis from the summaries still equals the raw
    one, and the slowed rank is still the one straggler."""
    from dtprof.analyzers import whatif

    make_summaries(open_run(four_nodes), workers=1)
    monkeypatch.setattr(whatif, "REPLAY_RANK_STEPS", 8 * 5)   # 8 ranks: 5 steps
    monkeypatch.setattr(whatif, "REPLAY_MIN_STEPS", 2)
    run = open_run(four_nodes)
    measured = sorted(RunModel.of(run).measured_steps)
    sample = whatif.replay_steps(RunModel.of(run))
    assert len(measured) > 5 and len(sample) == 5 and set(sample) <= set(measured)
    assert sample[0] == measured[0] and sample[-1] == measured[-1]
    _, tables = run.node_summaries(sample)
    assert set(tables["whatif_items"]["step"]) == set(sample)
    s = assert_summaries_equal_raw(four_nodes)
    assert s["replay"]["steps"] == 5 and f"sample of 5 of the {len(measured)} measured steps" in s["replay"]["method"]
    assert [x["rank"] for x in s["stragglers"]] == [5]


def test_items_stored_step_by_step_in_small_row_groups(four_nodes, monkeypatch):
    """The what-if items are stored step by step in row groups of a few steps, which a read of the replay's sampled
    steps skips by their statistics; read back they are in rank-step order, each rank-step's items in their order,
    so the analysis from the summaries equals the raw one also when a rank-step's items span row groups (DuckDB
    returns row groups in any order)."""
    import pyarrow.parquet as pq

    from dtprof.rundir import writer

    monkeypatch.setitem(writer.SUMMARY_ROW_GROUP_ROWS, "whatif_items", 7)
    make_summaries(open_run(four_nodes), workers=1)
    meta = pq.ParquetFile(four_nodes / "node-host0" / SUMMARY_DIR / "whatif_items.parquet").metadata
    step = meta.schema.names.index("step")
    stats = [meta.row_group(i).column(step).statistics for i in range(meta.num_row_groups)]
    assert len(stats) > 20 and all(a.max <= b.min for a, b in zip(stats, stats[1:]))   # step by step
    assert_summaries_equal_raw(four_nodes)


def test_copied_summary_equals_the_nodes_own(tmp_path):
    """The scale benchmark's builder (benchmarks/analyze_scale.py) copies a node's summary from the node of its
    class (same host offset, same jitter draws, other ranks and host) instead of summarising it: the copy must be
    file for file what summarize_node writes from the node's own tables."""
    import pyarrow.parquet as pq

    from dtprof.rundir.schema import SUMMARY_TABLES, summary_file
    from dtprof.rundir.writer import create_run_dir
    from synth import build_ddp_node, copy_summary

    kw = dict(ranks_per_node=2, world_size=8, steps=12, slow_rank=1, slow_factor=1.3, seed=3, jitter_period=4)
    runs = {}
    for name in ("own", "copied"):   # node n's clock is (n % 2) ms off: nodes 1 and 3 are of one class
        create_run_dir(tmp_path / name, {"command": ["synthetic"]})
        runs[name] = [build_ddp_node(tmp_path / name, n, host_offset_ns=(n % 2) * 1_000_000, **kw) for n in range(4)]
    for nd in runs["own"] + runs["copied"][:3]:
        summarize_node(str(nd))
    copy_summary(runs["copied"][1], runs["copied"][3], rank_shift=4)   # ranks 2-3 -> 6-7
    own, copied = runs["own"][3], runs["copied"][3]
    for table in SUMMARY_TABLES:
        a, b = pq.ParquetFile(summary_file(own, table)), pq.ParquetFile(summary_file(copied, table))
        assert a.metadata.num_row_groups == b.metadata.num_row_groups, table
        assert a.read().equals(b.read()), table
    assert pd.read_parquet(summary_file(copied, "rank_steps"))["rank"].unique().tolist() == [6, 7]
    assert (copied / SUMMARY_DIR / SUMMARY_COMPLETE).read_text() == (own / SUMMARY_DIR / SUMMARY_COMPLETE).read_text()
    # and the analysis of the run with the copied summary is the analysis of the run with its own
    a, b = (open_and_analyze(tmp_path / name)[1].summary for name in ("own", "copied"))
    assert a["stragglers"] and not [d for d in differences(a, b) if not d.startswith(".run.path:")]
