"""A single-process job as a user first profiles one: `dtprof run -- python examples/train_tiny.py`, no launcher and
no torch.distributed (the example trains alone when started without RANK in its environment): no collective at all.
"""
from __future__ import annotations

import re
import sys

import pytest

from breakdown_checks import assert_breakdown_adds_up
from conftest import EXAMPLES, dtprof_run
from dtprof.reports.fmt import MISSING

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    d = tmp_path_factory.mktemp("single")
    p = dtprof_run(d / "run", "--no-nvml", "--", sys.executable, EXAMPLES / "train_tiny.py", "--steps", "30", cwd=d)
    return d / "run", p


def test_exposed_communication_of_a_job_without_communication_is_na(single):
    """No communication recorded: exposed communication is n/a (summary.json null, with its reason), as the overlap
    ratio is, in the terminal and on the report's card; "0 %" would be a share of nothing."""
    run_dir, p = single
    summary = assert_breakdown_adds_up(run_dir)
    ov = summary["overlap"]
    assert ov["comm_s_total"] == 0 and ov["ratio"] is None, ov
    assert ov["exposed_comm_frac"] is None and ov["exposed_comm_frac_reason"], ov
    assert all(r["breakdown_s_per_step"]["exposed_comm"] == 0 for r in summary["ranks"]), summary["ranks"]
    line = next(ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("overlap:"))
    assert f"exposed communication {MISSING} of step time" in line, line
    html = (run_dir / "report.html").read_text()
    card = re.search(r'<div class="card( na)?" id="card-exposed_comm"[^>]*>.*?<div class="value">(.*?)</div>', html)
    assert card is not None and card[1] == " na" and card[2] == MISSING, card and card[0]
