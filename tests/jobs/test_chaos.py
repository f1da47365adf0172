"""A fixed subset of benchmarks/chaos.py's faults (issue 50), each into a real 2-rank job (DDP, FSDP2, a
torch.distributed.pipelining pipeline or Lightning) under `dtprof run` and the same fault without dtprof: the job's
fate is the same (exit code, and every finishing rank's final weights), every row flushed before the fault is
still read after it, no process is left, and triage names the cause, the rank (and for an out-of-memory error or a
NaN, the step), or for a fault of dtprof's own, no false verdict while `dtprof run` names it.

The eleven cover a frozen rank (SIGSTOP), torchrun's agent killed, a node lost (one agent of a two-node torchrun,
one rank each), a collective timeout, an out-of-memory error (the CPU allocator's in a pipeline stage, CUDA's text
in FSDP2), a NaN, dtprof's own heartbeat thread stalled, `dtprof run` killed and its run directory full or read-
only: most of them kinds the campaign missed before a fix (docs/triage.md, "Fault campaign"). Each job has two ranks
(the campaign's three: each rank's start-up is most of a fault's time); all but two run in the DDP job, so that the
faults of dtprof's own share one bare run (chaos.bare_key); Lightning's (its start-up alone takes most of a minute
here) is left to the campaign. A rank SIGKILLed or raising on DDP is in test_triage_e2e.py and test_faults.py.
"""
from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import chaos  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

F = chaos.Fault
FAULTS = [
    F("rank_stop", 1, 5, 12, "ddp", 2),         # frozen: the rank whose process cannot run (was no culprit)
    F("agent_kill", 1, 5, 12, "ddp", 2),        # torchrun's agent, not a rank, named (was "rank 1 exited")
    F("node_lost", 1, 5, 12, "ddp", 2),         # the same fate as bare (#45 raced the survivor's end; a 300 s wait)
    F("coll_timeout", 1, 5, 12, "ddp", 2),      # the rank that never entered (was the first rank that timed out)
    F("oom", 1, 5, 12, "pipeline", 2),          # the stage's RuntimeError wraps the allocator's (was a crash)
    F("oom_cuda", 1, 5, 12, "fsdp2", 2),        # CUDA's message, raised at the library boundary (no GPU here)
    F("nan", 1, 5, 12, "ddp", 2),               # the rank's own loss went NaN at that step
    F("hb_stall", 1, 5, 12, "ddp", 2),          # dtprof's heartbeat thread blocked (was silent)
    F("dtprof_kill", 0, 5, 12, "ddp", 2),       # the job trains on to its end, same weights
    F("dir_full", 0, 5, 12, "ddp", 2),          # (was "interrupted": node.json's end not written)
    F("dir_readonly", 0, 5, 12, "ddp", 2),      # (exited 1 after a job that finished: the reserve's removal raised)
]


@pytest.mark.parametrize("fault", FAULTS, ids=[f"{f.job}-{f.kind}" for f in FAULTS])
def test_fault_leaves_the_job_unharmed_and_is_named(fault, tmp_path):
    row = chaos.run_fault(fault, tmp_path, quiet=True)
    if "skipped" in row:
        pytest.skip(row["skipped"])
    assert row["unharmed"], row            # the same exit code (and weights) as without dtprof
    assert row["rows_lost"] == 0 and row["rows_seen"] > 0 and not row["read_error"], row
    assert row["leftovers"] == 0, row
    assert row["named"], row               # triage's verdict, culprit and cause (and dtprof's own fault)
