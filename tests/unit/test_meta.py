"""The run format's ``meta`` table (issue 13 item 2): structured facts round-trip as Python objects through both
stored forms, and a run written before the table (events messages only) still yields the same meta rows."""
from __future__ import annotations

import json

import pandas as pd

from dtprof.reader import open_run
from dtprof.rundir.schema import SCHEMA_MINOR, SCHEMA_VERSION
from dtprof.rundir.writer import RankWriter, compact_node, create_node_dir, create_run_dir, write_node_tables

SCHEDULE = {"schedule": "Schedule1F1B", "stages": 2, "microbatches": 4, "stage_indices": [1]}
CAPTURE = {"steps": [3, 4], "start_ns": 5_000, "end_ns": 9_000}


def test_meta_rows_round_trip_through_json_lines_and_parquet(tmp_path):
    run_dir = create_run_dir(tmp_path / "run", {"command": ["t"]})
    node = create_node_dir(run_dir, "h0")
    w = RankWriter(node, 1)
    w.append("meta", (1, "h0", 10, "pipeline_schedule", json.dumps(SCHEDULE)))
    w.append("meta", (1, "h0", 20, "trace_capture", json.dumps(CAPTURE)))
    w.close()
    for form in ("jsonl", "parquet"):
        if form == "parquet":
            compact_node(node)
        meta = open_run(run_dir).meta
        assert list(meta["kind"].astype(str)) == ["pipeline_schedule", "trace_capture"], form
        assert meta["value"].tolist() == [SCHEDULE, CAPTURE], form
    manifest = json.loads((run_dir / "run.json").read_text())
    assert (manifest["schema_version"], manifest["schema_minor"]) == (SCHEMA_VERSION, SCHEMA_MINOR)


def test_legacy_event_messages_become_meta_rows(tmp_path):
    # a run as format 1.0 wrote it: no meta table, the facts in events messages
    run_dir = create_run_dir(tmp_path / "old", {"command": ["t"]})
    (run_dir / "run.json").write_text(json.dumps({"schema": "dtprof.run/1", "schema_version": 1}))
    node = run_dir / "node-h0"
    node.mkdir()
    ev = pd.DataFrame({"rank": [0, 1, 1], "host": "h0", "t_ns": [1, 2, 3], "level": ["info", "info", "error"],
                       "source": "rank", "message": [
                           "pipeline schedule: Schedule1F1B, stages=2, microbatches=4, stage_indices=1",
                           "device mesh: shape=(2, 2), dims=(dp, pp)",
                           "dtprof disabled on this rank after a fault in hooks: boom: x"]})
    write_node_tables(node, {"events": ev})
    (node / "tables" / "meta.parquet").unlink()   # the old version had no such file
    meta = open_run(run_dir).meta
    got = dict(zip(meta["kind"].astype(str), meta["value"]))
    assert got == {"pipeline_schedule": SCHEDULE, "mesh": {"shape": [2, 2], "dims": ["dp", "pp"]},
                   "fault": {"where": "hooks", "error": "boom: x"}}
    assert meta["rank"].tolist() == [0, 1, 1]
