"""The pending table of async collectives: GPU-side durations (the flusher reads NCCL's Work._get_duration() once
the GPU has finished the work) and completions that arrive late.

A CUDA/NCCL Work is what this machine cannot have, so a stand-in with the same method stands at that boundary; the
rest (pending table, completion, flusher retries, rows in the run) is the real code. The real NCCL path is part of
the GPU validation (docs/validation.md)."""
from __future__ import annotations

import pytest
import torch

from dtprof.collectors import collective_rows
from dtprof.collectors import runtime as rt
from dtprof.collectors.records import collective_row
from dtprof.reader import open_run
from dtprof.rundir.writer import RankWriter, create_node_dir, create_run_dir


class NcclWorkStandIn:
    """Raises like WorkNCCL::getDuration until its end event has completed, then returns milliseconds."""

    def __init__(self, ready_after: int, ms: float):
        self.calls, self.ready_after, self.ms = 0, ready_after, ms

    def _get_duration(self):
        self.calls += 1
        if self.calls <= self.ready_after:
            raise RuntimeError("CUDA error: device not ready")
        return self.ms


class FutureWork:
    """A c10d Work as the collector sees it: its completion is a real torch Future."""

    def __init__(self, fut):
        self.fut = fut

    def get_future(self):
        return self.fut


@pytest.fixture
def hc():
    """The collective tables of the rank, as its start makes them (no torch.distributed function is wrapped: the
    tables are what is tested)."""
    hooks = collective_rows.CollectiveRows(rt.STATE.ctx)
    hooks.nccl_timing = True
    return hooks


@pytest.fixture
def writer(tmp_path, monkeypatch):
    create_run_dir(tmp_path / "run", {"command": ["test"]})
    node = create_node_dir(tmp_path / "run")
    w = RankWriter(node, 0)
    w.write_identity({"rank": 0, "local_rank": 0, "world_size": 1, "host": "h", "pid": 1, "device_type": "cuda"})
    monkeypatch.setattr(rt.STATE, "writer", w)
    yield w, tmp_path / "run"


def _row(seq, source="user"):
    return collective_row(rank=0, step=0, op="all_reduce", api="all_reduce", source=source, group="0", group_size=2,
                          seq=seq, in_bytes=64, out_bytes=64, dtype="float32", peer=None, async_op=True,
                          issue_ns=1000, return_ns=1100, end_ns=None, gpu_duration_ns=None, bucket=None, stage=None,
                          microbatch=None)


def test_duration_filled_once_the_gpu_has_finished(writer, hc):
    w, run_dir = writer
    slow, never = NcclWorkStandIn(ready_after=2, ms=1.5), NcclWorkStandIn(ready_after=10**6, ms=0)
    hc.add_pending(id(slow), slow, [_row(0)])
    hc.add_pending(id(never), never, [_row(1)])
    hc.complete(id(slow), 2000)
    hc.complete(id(never), 2100)
    for _ in range(collective_rows.MAX_TIMED_TRIES):   # flushes
        hc.resolve_gpu_durations()
    w.flush()
    c = open_run(run_dir).collectives.set_index("seq")
    assert c.loc[0, "gpu_duration_ns"] == 1_500_000 and c.loc[0, "end_ns"] == 2000
    # a work whose events never complete is written anyway, without a duration, after the retries
    assert c.loc[1, "end_ns"] == 2100 and c["gpu_duration_ns"].isna().loc[1]
    assert not hc.timed


def test_rows_wait_for_their_duration_but_exit_writes_them(writer, hc):
    w, run_dir = writer
    work = NcclWorkStandIn(ready_after=10**6, ms=0)
    hc.add_pending(id(work), work, [_row(0)])
    hc.complete(id(work), 2000)
    hc.resolve_gpu_durations()
    w.flush()
    assert len(open_run(run_dir).collectives) == 0        # still waiting for the GPU
    hc.resolve_gpu_durations(final=True)                  # the flusher at exit
    w.flush()
    assert len(open_run(run_dir).collectives) == 1


def test_a_late_completion_callback_does_not_end_the_op_that_reused_its_key(writer, hc):
    # An async op's future completes; its callback waits for the GIL while the main thread ends the backward
    # (complete_ddp) and issues the next op, whose new object can get the freed one's id, the pending key. The old
    # callback must not give the new op its end (it did: a DDP bucket ended 40 ms before its peers arrived)
    w, run_dir = writer
    fut = torch.futures.Future()
    work = FutureWork(fut)
    hc.track(work, [_row(0, "ddp")])                  # as a collective's wrapper registers it
    key = id(work)
    hc.complete_ddp(1500)                              # the main thread, at the end of the backward
    hc.add_pending(key, NcclWorkStandIn(ready_after=0, ms=0), [_row(1, "ddp")])   # the next op, same key
    fut.set_result(None)                               # the old callback runs now, late
    assert hc.pending_rows(key) == [_row(1, "ddp")]    # the new op is still in flight
    hc.complete(key, 9000)
    hc.resolve_gpu_durations(final=True)
    w.flush()
    c = open_run(run_dir).collectives.set_index("seq")
    assert c.loc[0, "end_ns"] == 1500 and c.loc[1, "end_ns"] == 9000
