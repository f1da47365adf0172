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


class ScriptedCuda:
    """torch.cuda's allocator counters as a GPU rank would read them, set by the test at each phase of a step: the
    numbers it sets are the truth the ledger's GPU fields are checked against."""

    def __init__(self):
        self.allocated = self.peak = self.reserved_peak = self.retries = 0

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        for name, value in (("is_available", lambda: True), ("is_initialized", lambda: True),
                            ("memory_allocated", lambda: self.allocated), ("max_memory_allocated", lambda: self.peak),
                            ("memory_stats", lambda: {"allocated_bytes.all.peak": self.peak,
                                                      "reserved_bytes.all.peak": self.reserved_peak,
                                                      "num_alloc_retries": self.retries, "num_ooms": 0})):
            monkeypatch.setattr(cuda, name, value)


def test_gpu_fields_and_phases_from_the_allocator_counters(tmp_path, monkeypatch):
    """A GPU rank's summary fields (reserved peak, fragmentation, memory outside PyTorch from NVML, retries,
    headroom) and its activations by phase, from the caching allocator's counters as the rank reads them at
    backward's start, at the optimizer step's start (its pre-hook) and at the optimizer step's end: the part and the
    analysis run for real, only torch.cuda's counters and NVML's sample are stood in for."""
    import pandas as pd

    from dtprof.analyzers import memory as memory_mod
    from dtprof.collectors.memory import MemoryRow

    cuda = ScriptedCuda()
    cuda.install(monkeypatch)
    rows: list = []
    ctx = RankContext(0, "host", str(tmp_path), {}, add=rows.append, fault=None, event=None, meta=lambda k, v: None)
    part = MemoryLedger()
    part.install(ctx)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    n = sum(p.numel() for p in model.parameters())
    P, G, S = 4 * n, 4 * n, 8 * n + 4 * 2          # fp32 params, grads; AdamW's moments and two step tensors
    MiB = 2**20
    try:
        for step in range(3):
            ctx.step = step
            opt.zero_grad(set_to_none=True)
            cuda.allocated, cuda.peak = P + S + 200 * MiB, P + S + 300 * MiB    # forward left 200, peaked at 300
            part.on_backward(None)
            model(torch.randn(4, 256)).sum().backward()
            cuda.peak = P + S + G + 500 * MiB                                   # backward's peak
            part.on_optimizer_pre_step(opt)                   # as the step clock's optimizer pre-hook calls it
            opt.step()
            cuda.allocated, cuda.reserved_peak, cuda.retries = P + S + G, P + S + G + 564 * MiB, step
            part.on_optimizer_step(opt)
    finally:
        part.on_exit()
    frame = pd.DataFrame([r._asdict() for r in rows if isinstance(r, MemoryRow)])
    assert list(frame["step"]) == [0, 1, 2]

    class Run:
        memory = frame
        ranks = pd.DataFrame([{"rank": 0, "host": "host", "device_type": "cuda", "device_index": 0,
                               "device_mem_total_bytes": 80 * 2**30}])
        nvml = pd.DataFrame([{"host": "host", "gpu": 0, "mem_used_bytes": float(P + S + G + 1264 * MiB)}])
        meta = pd.DataFrame(columns=["kind", "value"])
        world_size = 1

        @staticmethod
        def has_collectives_from(source):
            return False

    block = memory_mod.memory_block(Run())
    r = block["ranks"][0]
    assert (r["params_bytes"], r["grads_bytes"], r["optimizer_state_bytes"]) == (P, G, S)
    assert r["peak_bytes"] == P + S + G + 500 * MiB and r["activations_peak_bytes"] == 500 * MiB
    assert r["reserved_peak_bytes"] == P + S + G + 564 * MiB and r["fragmentation_bytes"] == 64 * MiB
    assert r["non_pytorch_bytes"] == 700 * MiB and r["alloc_retries"] == 2 and r["ooms"] == 0
    assert r["headroom_bytes"] == 80 * 2**30 - (P + S + G + 564 * MiB) - 700 * MiB
    assert block["least_headroom_rank"] == 0
    assert r["activations_bytes"] == 200 * MiB            # what the forward left for backward
    assert (r["forward_activations_peak_bytes"], r["backward_activations_peak_bytes"],
            r["optimizer_activations_peak_bytes"]) == (300 * MiB, 500 * MiB, 500 * MiB)
    assert r["peak_phase"] == "backward"                  # the optimizer step added nothing above backward's peak
    fits = {x["lever"]: x for x in block["what_fits"][0]["levers"]}
    assert fits["expandable_segments"]["predicted_saving_bytes"] == 64 * MiB
