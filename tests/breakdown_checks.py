"""Checks of the step breakdown on a real recorded run, shared by the real-job test modules (DDP, FSDP, pipeline,
hybrid): what `dtprof run` wrote to summary.json adds up, rank by rank, against the run's own step table."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtprof.analyzers.breakdown import PARTS
from dtprof.reader import open_run

ADD_UP_REL = 0.01   # issue 13: the parts sum to the rank's mean step time within 1 % (exact up to float rounding)


def assert_breakdown_adds_up(run_dir: Path) -> dict:
    """summary.json's per-rank breakdown: every part present and >= 0, the parts sum to ``step_time_s_mean``, and
    that mean is the mean of the rank's measured step durations in the steps table. Returns the summary."""
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    steps = open_run(run_dir).steps
    measured = steps[steps["step"].isin(summary["steps"]["per_step_index"])]
    dur = ((measured["end_ns"] - measured["start_ns"]) / 1e9).groupby(measured["rank"]).mean()
    assert summary["ranks"] and len(summary["ranks"]) == summary["run"]["world_size"]
    for r in summary["ranks"]:
        b = r["breakdown_s_per_step"]
        assert list(b) == list(PARTS), r["rank"]
        assert all(v >= 0 for v in b.values()), (r["rank"], b)
        assert r["step_time_s_mean"] == pytest.approx(float(dur[r["rank"]]), rel=1e-9)
        assert sum(b.values()) == pytest.approx(r["step_time_s_mean"], rel=ADD_UP_REL), (r["rank"], b)
        by_dim = r["exposed_comm_s_per_step_by_dim"]
        by_op = r["exposed_comm_s_per_step_by_op"]
        assert sum(by_dim.values()) == pytest.approx(b["exposed_comm"], rel=1e-6, abs=1e-12)
        assert sum(by_op.values()) == pytest.approx(b["exposed_comm"], rel=1e-6, abs=1e-12)
    return summary
