"""A fixed-seed subset of benchmarks/chaos.py's faults (issue 50), each into a real 3-rank DDP job (or a two-agent
torchrun) under `dtprof run` and the same fault without dtprof: the job's fate is the same, every row flushed before
the fault is still read after it, no process is left, and triage names the cause and the rank.

The faults here are those no other test injects (a rank SIGKILLed or raising, a frozen rank, a killed agent, a
killed `dtprof run` and a full disk are in test_triage_e2e.py and test_faults.py); the full campaign is the
benchmark (docs/triage.md, "Fault campaign").
"""
from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import chaos  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FAULTS = [chaos.Fault("rank_exit", 2, 5, 14), chaos.Fault("flusher_raise", 2, 4, 14)]


@pytest.mark.parametrize("fault", FAULTS, ids=[f.kind for f in FAULTS])
def test_fault_leaves_the_job_unharmed_and_is_named(fault, tmp_path):
    row = chaos.run_fault(fault, tmp_path, quiet=True)
    assert row["unharmed"], row            # the same exit code (and weights) as without dtprof
    assert row["rows_lost"] == 0 and row["rows_seen"] > 0 and not row["read_error"], row
    assert row["leftovers"] == 0, row
    assert row["named"], row               # triage's verdict, culprit and cause (and dtprof's own fault)
