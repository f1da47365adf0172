"""The ranks' JSON-lines table files (run format 1.6): gzip streams a killed rank leaves readable up to its last
flush, the next file for a restarted rank, and files of runs written before 1.6 (plain text) still read."""
from __future__ import annotations

import gzip
import json

from dtprof.reader import open_run, read_node_raw
from dtprof.rundir.writer import RankWriter, create_node_dir, create_run_dir


def _step(rank, step):
    return (rank, step, step * 10, step * 10 + 9, None, None, None, None, None, None, 1)


def _steps(node):
    return read_node_raw(node)["steps"]["step"].tolist()


def test_a_killed_ranks_file_reads_up_to_its_last_flush(tmp_path):
    node = create_node_dir(create_run_dir(tmp_path / "run", {}), "h")
    w = RankWriter(node, 0)
    for s in range(3):
        w.append("steps", _step(0, s))
    w.flush()
    w.append("steps", _step(0, 3))      # appended, never flushed: the process is killed here (no close)
    assert _steps(node) == [0, 1, 2]


def test_a_closed_file_is_a_whole_gzip_file(tmp_path):
    node = create_node_dir(create_run_dir(tmp_path / "run", {}), "h")
    w = RankWriter(node, 0)
    w.append("steps", _step(0, 0))
    w.close()
    lines = gzip.decompress((node / "rank-0" / "steps.jsonl.gz").read_bytes()).decode().splitlines()
    assert json.loads(lines[0])["dtprof_table"] == "steps" and json.loads(lines[1])[:2] == [0, 0]


def test_a_restarted_rank_writes_the_next_file_and_both_are_read(tmp_path):
    node = create_node_dir(create_run_dir(tmp_path / "run", {}), "h")
    first = RankWriter(node, 0)
    first.append("steps", _step(0, 0))
    first.flush()                          # killed: its stream never ended
    second = RankWriter(node, 0)
    second.append("steps", _step(0, 1))
    second.close()
    assert sorted(p.name for p in (node / "rank-0").glob("steps*")) == ["steps.1.jsonl.gz", "steps.jsonl.gz"]
    assert _steps(node) == [0, 1]


def test_plain_files_of_older_runs_still_read(tmp_path):
    run = create_run_dir(tmp_path / "run", {})
    node = create_node_dir(run, "h")
    w = RankWriter(node, 0)
    w.append("steps", _step(0, 0))
    w.write_identity({"rank": 0, "local_rank": 0, "world_size": 1, "host": "h", "pid": 1, "device_type": "cpu"})
    w.close()
    for p in (node / "rank-0").glob("*.jsonl.gz"):    # as a 1.5 rank wrote them
        p.with_name(p.name[:-3]).write_bytes(gzip.decompress(p.read_bytes()))
        p.unlink()
    assert open_run(run).steps["step"].tolist() == [0]


def test_compression_pays(tmp_path):
    """What lets a week-long job keep every step: steps rows of one rank shrink several times."""
    node = create_node_dir(create_run_dir(tmp_path / "run", {}), "h")
    w = RankWriter(node, 0)
    t = 1_700_000_000_000_000
    for s in range(2000):
        w.append("steps", (0, s, t + s * 100_000_123, t + (s + 1) * 100_000_123 - 7, None, 4096, 8, None, None,
                           s % 97 * 1000, 0))
    w.close()
    raw = len(gzip.decompress((node / "rank-0" / "steps.jsonl.gz").read_bytes()))
    assert raw / w.bytes_written() > 3
