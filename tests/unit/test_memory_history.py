"""`dtprof run --memory-history N`: the memory ledger part (collectors/memory.py) keeps the CUDA allocator's history
ring only when asked, starts it once with N entries, and writes it beside the ``oom`` row when the rank runs out of
memory. This machine has no GPU: the part runs for real on a CPU model and optimizer, and only torch.cuda's functions
(the library boundary) are stood in for, the out-of-memory error being CUDA's own text."""
from __future__ import annotations

import sys

import pytest
import torch

from dtprof.collectors.memory import MemoryLedger
from dtprof.collectors.parts import RankContext

OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which 1.23 GiB "
       "is free. Of the allocated memory 70.00 GiB is allocated by PyTorch, and 5.00 GiB is reserved by PyTorch but "
       "unallocated.")


class FakeCuda:
    """torch.cuda as a GPU rank sees it: initialised, its allocator's history calls noted."""

    def __init__(self, tmp_path):
        self.history: list[int] = []
        self.dumped: list[str] = []

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        for name, value in (("is_available", lambda: True), ("is_initialized", lambda: True),
                            ("memory_stats", lambda: {}), ("memory_allocated", lambda: 0),
                            ("max_memory_allocated", lambda: 0), ("memory_reserved", lambda: 0),
                            ("mem_get_info", lambda: (1, 2))):
            monkeypatch.setattr(cuda, name, value)
        monkeypatch.setattr(cuda.memory, "_record_memory_history",
                            lambda max_entries=None, **kw: self.history.append(max_entries))

        def dump(path):
            self.dumped.append(path)
            with open(path, "wb") as f:
                f.write(b"snapshot")
        monkeypatch.setattr(cuda.memory, "_dump_snapshot", dump)


def _ledger(tmp_path, **options):
    metas: list[tuple] = []
    ctx = RankContext(0, "host", str(tmp_path), dict(options), add=lambda row: None, fault=None, event=None,
                      meta=lambda kind, value: metas.append((kind, value)))
    part = MemoryLedger()
    part.install(ctx)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    for step in range(3):
        ctx.step = step
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        part.on_optimizer_step(opt)
    return part, metas


@pytest.mark.parametrize("history", [None, 5000])
def test_history_ring_only_when_asked_and_dumped_at_oom(tmp_path, monkeypatch, history):
    cuda = FakeCuda(tmp_path)
    cuda.install(monkeypatch)
    opts = {"memory_history": history} if history else {}
    part, metas = _ledger(tmp_path, **opts)
    assert cuda.history == ([history] if history else [])      # started once, with N entries
    monkeypatch.setattr(sys, "last_value", torch.OutOfMemoryError(OOM), raising=False)
    monkeypatch.setattr(sys, "last_traceback", None, raising=False)
    part.on_exit()
    oom = dict(metas)["oom"]
    assert oom["requested_bytes"] == 2 * 2**30
    if history:
        assert cuda.dumped == [str(tmp_path / "memory_snapshot.pickle")] and oom["snapshot"] == "memory_snapshot.pickle"
        assert (tmp_path / "memory_snapshot.pickle").read_bytes() == b"snapshot"
    else:
        assert cuda.dumped == [] and "snapshot" not in oom
