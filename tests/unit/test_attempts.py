"""Restarted ranks in the run format, without Ray (tests/jobs/test_ray.py runs the real job): a rank recorded in two
node directories as attempts 1 and 2 (what collectors/raytrain.py writes for a Ray Train worker group restarted
after a failure) is one rank, its last attempt, with the first attempt described as a restart in the reader, the
summary and triage; without attempts, a rank recorded twice is still refused."""
from __future__ import annotations

import json
import shutil

import pytest

from dtprof.analyzers.summary import analyze
from dtprof.analyzers.triage import triage
from dtprof.reader import RunFormatError, open_run
from dtprof.reports import terminal
from synth import build_run


def _attempts_run(tmp_path, with_attempts=True):
    """Rank 0 of a one-rank job: attempt 1 failed at step 3 (4 steps recorded), attempt 2 ran 12 steps."""
    first, second = build_run(tmp_path / "a", world_size=1, steps=4), build_run(tmp_path / "b", world_size=1, steps=12)
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(second / "run.json", run / "run.json")
    for attempt, src in ((1, first), (2, second)):
        node = run / f"node-h-{attempt}"
        shutil.copytree(next(src.glob("node-*")), node)
        info = {"host": "h", "pid": attempt, "start_time": f"2026-01-01T00:00:{10 * attempt:02d}Z",
                "status": "failed" if attempt == 1 else "completed"}
        if with_attempts:
            info.update(attempt_rank=0, attempt=attempt)
        if attempt == 1:
            info["failure"] = {"step": 3, "exception": "RuntimeError: boom", "time": "2026-01-01T00:00:15Z"}
        (node / "node.json").write_text(json.dumps(info))
    return run


def test_a_restarted_rank_is_its_last_attempt_and_the_first_is_a_restart(tmp_path):
    run = open_run(_attempts_run(tmp_path))
    assert list(run.ranks["rank"]) == [0] and len(run.steps) == 12 and [n["node"] for n in run.nodes] == ["node-h-2"]
    assert run.attempts == {0: 2}
    assert run.restarts == [{"rank": 0, "attempt": 1, "host": "h", "pid": 1, "node": "node-h-1", "status": "failed",
                             "step": 3, "exception": "RuntimeError: boom", "ended": "2026-01-01T00:00:15Z",
                             "restarted": "2026-01-01T00:00:20Z", "restart_s": 5.0}]
    a = analyze(run)
    s = a.summary
    assert s["run"]["restarts"] == run.restarts and s["run"]["attempts"] == {"0": 2}
    assert s["run"]["status"] == "completed" and s["steps"]["count"] > 0
    text = terminal.render(a)
    assert ("[restart] rank 0 attempt 1 failed at step 3 (RuntimeError: boom); restarted at 2026-01-01T00:00:20Z, "
            "5.0 s after the failure") in text
    assert "[restart] statistics cover each rank's last attempt (rank 0: attempt 2)" in text
    res = triage(run, {"incident": run.incident()})
    assert res["verdict"] == "healthy" and "failed at step 3 (RuntimeError: boom) and was restarted" in res["message"]


def test_a_rank_recorded_twice_without_attempts_is_still_refused(tmp_path):
    with pytest.raises(RunFormatError, match="rank 0 is recorded more than once"):
        open_run(_attempts_run(tmp_path, with_attempts=False)).table("ranks")


def test_a_last_attempt_that_failed_is_a_crash(tmp_path):
    """Ray gave up (its failures exhausted): the last attempt's failure, recorded by the worker itself (node.json,
    the heartbeat's exception dump), is triage's crash, with the earlier attempt as a restart."""
    path = _attempts_run(tmp_path)
    node = path / "node-h-2"
    info = json.loads((node / "node.json").read_text())
    info.update(status="failed", exit_code=1, failure={"step": 5, "exception": "RuntimeError: again"})
    (node / "node.json").write_text(json.dumps(info))
    (node / "rank-0").mkdir(exist_ok=True)      # a synthetic run has its tables only
    (node / "rank-0" / "dump-exception.json").write_text(json.dumps(
        {"rank": 0, "step": 5, "wall_ns": 1, "request": "exception", "exception": {
            "type": "RuntimeError", "message": "again", "frames": [
                {"file": "train.py", "line": 9, "func": "train_func", "code": "raise RuntimeError('again')"}]}}))
    run = open_run(path)
    res = triage(run, {"incident": run.incident()})
    assert res["verdict"] == "crash" and res["culprit_ranks"] == [0], res
    assert "RuntimeError: again" in res["message"]
    assert [e["kind"] for e in res["evidence"]].count("restart") == 2


def test_a_rank_whose_collective_failed_after_its_peer_is_stopped_by_it():
    """Rank 1 raised first; rank 0's all-reduce then failed with gloo's peer-went-away error (which of the two Ray
    ends first is a race): one failure and one rank stopped by it, not two failures. An error of rank 0's own
    stays a failure."""
    from dtprof.reader import _peer_failures_stopped

    def entry(rank, ended, exception):
        return {"rank": rank, "attempt": 1, "status": "failed", "ended": ended, "exception": exception}

    gloo = ("RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:53905. This is "
            "typically caused by a remote worker crashing.")
    out = _peer_failures_stopped([entry(0, "2026-01-01T00:00:16Z", gloo),
                                  entry(1, "2026-01-01T00:00:15Z", "RuntimeError: injected failure at step 3")])
    assert [(r["rank"], r["status"], r.get("stopped_by")) for r in out] == [(0, "stopped", 1), (1, "failed", None)]
    own = _peer_failures_stopped([entry(0, "2026-01-01T00:00:16Z", "ValueError: bad batch"),
                                  entry(1, "2026-01-01T00:00:15Z", "RuntimeError: injected failure at step 3")])
    assert [r["status"] for r in own] == ["failed", "failed"]
