"""Out-of-memory messages (dtprof/oom.py) from real reports, the what-fits levers (analyzers/memory.py) on a
hand-worked ledger, and triage's ``oom`` verdict from a CUDA out-of-memory exception dump (this machine has no GPU:
the messages are CUDA's own texts, c10/cuda/CUDACachingAllocator.cpp, as users reported them)."""
from __future__ import annotations

import pytest

from dtprof import oom
from dtprof.analyzers import memory as memory_mod
from dtprof.analyzers.triage import triage
from dtprof.reader import Incident

GiB, MiB = 2**30, 2**20
# torch >= 2.1 (a user's report of torch.OutOfMemoryError)
CUDA_NEW = ("CUDA out of memory. Tried to allocate 19.68 GiB. GPU 0 has a total capacity of 23.68 GiB of which 11.88 "
            "GiB is free. Including non-PyTorch memory, this process has 11.79 GiB memory in use. Of the allocated "
            "memory 11.44 GiB is allocated by PyTorch, and 43.59 MiB is reserved by PyTorch but unallocated. If "
            "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            "to avoid fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
# torch 2.1 ("capacty"), another process on the GPU
CUDA_21 = ("CUDA out of memory. Tried to allocate 5.96 GiB. GPU 0 has a total capacty of 23.69 GiB of which 5.25 GiB "
           "is free. Process 2006998 has 256.00 MiB memory in use. Including non-PyTorch memory, this process has "
           "18.17 GiB memory in use. Of the allocated memory 17.88 GiB is allocated by PyTorch, and 0 bytes is "
           "reserved by PyTorch but unallocated.")
# torch < 2.1
CUDA_OLD = ("CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; 130.35 MiB already "
            "allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch) If reserved memory is >> allocated "
            "memory try setting max_split_size_mb to avoid fragmentation.")
CPU = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
       "allocate 2147483648 bytes. Error code 12 (Cannot allocate memory)")


def test_oom_messages_give_the_request_and_the_allocator_state():
    new = oom.parse(CUDA_NEW)
    assert new["kind"] == "cuda" and new["gpu"] == 0
    assert new["requested_bytes"] == int(19.68 * GiB)
    assert new["device_total_bytes"] == int(23.68 * GiB) and new["device_free_bytes"] == int(11.88 * GiB)
    assert new["allocated_bytes"] == int(11.44 * GiB)
    assert new["reserved_unallocated_bytes"] == int(43.59 * MiB)
    assert new["reserved_bytes"] == new["allocated_bytes"] + new["reserved_unallocated_bytes"]
    assert new["process_bytes"] == int(11.79 * GiB)
    v21 = oom.parse(CUDA_21)
    assert v21["device_total_bytes"] == int(23.69 * GiB) and v21["reserved_unallocated_bytes"] == 0
    assert v21["process_bytes"] == int(18.17 * GiB)       # this process's, not the other process's 256 MiB
    old = oom.parse(CUDA_OLD)
    assert old["requested_bytes"] == 36 * MiB and old["device_free_bytes"] == int(47.06 * MiB)
    assert old["allocated_bytes"] == int(130.35 * MiB) and old["reserved_bytes"] == 188 * MiB
    assert old["device_total_bytes"] == int(7.93 * GiB)
    assert oom.parse(CPU) == {"kind": "cpu", "requested_bytes": 2**31}
    assert oom.parse("RuntimeError: Expected all tensors to be on the same device") is None


def test_an_oom_wrapped_by_another_exception_is_found_in_its_chain():
    """torch.distributed.pipelining's stage raises RuntimeError("... failed to run forward ...") from the model's own
    error: the out-of-memory error is the wrapped one."""
    try:
        try:
            raise RuntimeError(CPU)
        except RuntimeError as inner:
            raise RuntimeError("[Stage 2] failed to run forward") from inner
    except RuntimeError as outer:
        exc, parsed = oom.in_chain(outer)
        assert exc is outer.__cause__ and parsed == {"kind": "cpu", "requested_bytes": 2**31}
    assert oom.in_chain(RuntimeError("a shape mismatch")) == (None, None)


def test_levers_from_a_hand_worked_ledger():
    # a replicated 1 G-parameter fp32 model with Adam on 8 ranks: 4, 4 and 8 GiB; 10 GiB of activations
    rec = {"params_bytes": 4 * GiB, "grads_bytes": 4 * GiB, "optimizer_state_bytes": 8 * GiB,
           "activations_bytes": 10 * GiB, "fragmentation_bytes": 3 * GiB, "peak_bytes": 30 * GiB}
    got = {x["lever"]: x for x in memory_mod.levers(rec, 8, False, shortfall=9 * GiB)}
    assert got["zero1"]["predicted_saving_bytes"] == 7 * GiB            # 8 × 7/8
    assert got["zero2"]["predicted_saving_bytes"] == int(10.5 * GiB)    # 12 × 7/8
    assert got["zero3_fsdp_full_shard"]["predicted_saving_bytes"] == 14 * GiB
    assert got["half_micro_batch"]["predicted_saving_bytes"] == 5 * GiB
    assert got["expandable_segments"]["predicted_saving_bytes"] == 3 * GiB
    assert got["bf16_optimizer_state"]["predicted_saving_bytes"] == 4 * GiB
    assert got["zero3_fsdp_full_shard"]["predicted_peak_bytes"] == 16 * GiB
    assert got["activation_checkpointing"]["predicted_saving_bytes"] == int(10 * GiB * 32 / 34)   # 9.41 GiB
    assert list(got) == ["zero3_fsdp_full_shard", "zero2", "activation_checkpointing", "zero1", "half_micro_batch",
                         "bf16_optimizer_state", "expandable_segments"]     # ranked by saving
    assert [k for k, x in got.items() if x["covers_shortfall"]] == ["zero3_fsdp_full_shard", "zero2",
                                                                       "activation_checkpointing"]
    sharded = {x["lever"] for x in memory_mod.levers(rec, 8, True)}   # FSDP already shards: no ZeRO lever
    assert not sharded & {"zero1", "zero2", "zero3_fsdp_full_shard"}
    # the same model under ZeRO-2 on 8 ranks: grads and the optimizer's partition (fp32 master + moments) are 1/8,
    # the parameters whole: ZeRO-3 would shard the parameters only, ZeRO-1/2 have nothing left to shard
    zero2 = rec | {"grads_bytes": GiB // 2, "optimizer_state_bytes": int(1.5 * GiB), "params_full_bytes": 4 * GiB,
                   "optimizer_shard_frac": 1 / 8}
    got = {x["lever"]: x for x in memory_mod.levers(zero2, 8, False)}
    assert got["zero3_fsdp_full_shard"]["predicted_saving_bytes"] == int(3.5 * GiB)
    assert not {"zero1", "zero2"} & set(got)
    assert memory_mod.replicated(zero2, 8, False) == (1, 0, 0)
    replicated = rec | {"params_full_bytes": 4 * GiB, "optimizer_shard_frac": 1.0}      # DDP: all of it whole
    assert memory_mod.levers(replicated, 8, False) == memory_mod.levers(rec, 8, False)


def _dump(message: str, step: int, wall_ns: int, funcs=("<module>", "forward")) -> dict:
    return {"exception": {"step": step, "wall_ns": wall_ns, "request": "exception", "exception": {
        "type": "OutOfMemoryError", "message": message,
        "frames": [{"file": "/job/train.py", "line": 10 + i, "func": f, "code": ""} for i, f in enumerate(funcs)]}}}


@pytest.mark.parametrize("message", [CUDA_NEW, CUDA_21, CUDA_OLD])
def test_triage_names_a_cuda_oom_from_the_exception_dump(message):
    inc = Incident(dumps={3: _dump(message, 7, 5), 0: {"sigterm": {"step": 7, "request": "sigterm"}}})
    res = triage(None, {"incident": inc})
    parsed = oom.parse(message)
    assert res["verdict"] == "oom" and res["culprit_ranks"] == [3]
    assert res["step"] == 7 and res["phase"] == "forward"
    assert res["requested_bytes"] == parsed["requested_bytes"]
    assert res["shortfall_bytes"] == parsed["requested_bytes"] - parsed["device_free_bytes"]
    assert res["stopped_ranks"] == [0]
    top = res["levers"][0]
    assert top["lever"] == "half_micro_batch" and top["predicted_saving_bytes"] == parsed["requested_bytes"] // 2


def test_triage_oom_in_backward_with_fragmentation_names_expandable_segments():
    # 15.5 GiB reserved but unallocated (the SkyRL #1470 shape): returning the fragmentation alone covers it
    msg = ("CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.00 GiB "
           "is free. Including non-PyTorch memory, this process has 78.17 GiB memory in use. Of the allocated memory "
           "62.00 GiB is allocated by PyTorch, and 15.50 GiB is reserved by PyTorch but unallocated.")
    inc = Incident(dumps={0: _dump(msg, 2, 1, ("<module>", "backward", "_engine_run_backward"))})
    res = triage(None, {"incident": inc})
    assert res["phase"] == "backward" and res["shortfall_bytes"] == 3 * GiB
    covering = [x["lever"] for x in res["levers"] if x["covers_shortfall"]]
    assert covering == ["expandable_segments"]
    assert "expandable_segments alone would cover" in res["message"]


def _summary(peaks: dict, opt_state: int) -> dict:
    ranks = [{"rank": r, "peak_bytes": p, "params_bytes": 4 * MiB, "grads_bytes": 4 * MiB,
              "optimizer_state_bytes": opt_state, "activations_peak_bytes": p - 8 * MiB - opt_state}
             for r, p in peaks.items()]
    return {"memory": {"ranks": ranks, "peak_bytes_max": max(peaks.values())}}


def test_compare_gates_peak_memory_per_rank_and_names_the_rank_and_category():
    from dtprof.analyzers import regression as rg

    gate = rg.parse_gate("memory.ranks.peak_bytes < +5%")
    assert "memory.ranks.peak_bytes < +5%" in rg.DEFAULT_ADVISORY
    base = _summary({0: 100 * MiB, 1: 80 * MiB}, 8 * MiB)
    same = rg.evaluate_gate(gate, [base], [_summary({0: 101 * MiB, 1: 80 * MiB}, 8 * MiB)])
    assert same.verdict == rg.PASS and same.change == pytest.approx(0.01)
    # rank 1 keeps fp32 moments it did not before (+12 MiB of optimizer state): +15 % on its own peak, while
    # rank 0 still holds the largest peak: the largest-over-ranks key does not move, the per-rank gate fails
    head = _summary({0: 100 * MiB, 1: 92 * MiB}, 8 * MiB)
    head["memory"]["ranks"][1] |= {"optimizer_state_bytes": 20 * MiB, "activations_peak_bytes": 64 * MiB}
    grown = rg.evaluate_gate(gate, [base], [head])
    assert grown.verdict == rg.FAIL and grown.change == pytest.approx(0.15)
    assert (grown.base, grown.head) == (80 * MiB, 92 * MiB)
    assert grown.note == "rank 1's peak +15.0% (most in optimizer state: +12.0 MiB)"
    assert rg.evaluate_gate(rg.parse_gate("memory.peak_bytes_max < +5%"), [base], [head]).verdict == rg.PASS
    other = rg.evaluate_gate(rg.parse_gate("memory.ranks.optimizer_state_bytes <= +0"), [base], [head])
    assert other.verdict == rg.FAIL and other.note == "rank 1's optimizer_state_bytes +12.0 MiB (of 2 ranks)"


def test_report_ledger_bars_add_up_to_the_summary_peak():
    from dtprof.reports import memory as report_memory

    mem = _summary({0: 100 * MiB, 1: 120 * MiB}, 8 * MiB)["memory"]
    fig = report_memory.ledger_figure(mem)
    stacked = [sum(t.y[i] for t in fig.data if t.type == "bar") for i in range(2)]
    assert stacked == pytest.approx([100 / 1024, 120 / 1024])       # GiB: the stack is the rank's peak
    html = report_memory.ledger_html(mem)
    assert html.count("<tr>") == 3 and "100.0 MiB" in html and "120.0 MiB" in html   # a header, a row per rank


def _led(rows):
    import pandas as pd

    keys = ("params_bytes", "grads_bytes", "optimizer_state_bytes", "activations_bytes", "other_bytes")
    return pd.DataFrame([{"rank": r, **dict(zip(keys, v))} for r, v in rows.items()])


def test_imbalance_compares_a_rank_with_its_layout_peers_only():
    """Four pipeline ranks, two per stage (DP x PP): stage 0 holds more activations (1F1B keeps more micro-batches in
    flight) and other params than stage 1 (its layers): no finding for that. Rank 2, a stage-1 replica of rank 3,
    holds 200 MiB of grads more: named, against rank 3 alone, with the grads' cause."""
    led = _led({0: (400 * MiB, 400 * MiB, 800 * MiB, 300 * MiB, 50 * MiB),
                1: (400 * MiB, 400 * MiB, 800 * MiB, 300 * MiB, 52 * MiB),
                2: (200 * MiB, 400 * MiB, 400 * MiB, 100 * MiB, 50 * MiB),
                3: (200 * MiB, 200 * MiB, 400 * MiB, 100 * MiB, 50 * MiB)})
    out = memory_mod.imbalance(led, {0: 0, 1: 0, 2: 1, 3: 1},
                               {"schedule": "Schedule1F1B", "stages": 2, "microbatches": 4})
    assert [(x["rank"], x["peers"], x["category"], x["excess_bytes"]) for x in out["ranks"]] == \
        [(2, [3], "grads_bytes", 200 * MiB)]
    assert out["ranks"][0]["cause"] == memory_mod.IMBALANCE_CAUSES["grads_bytes"]
    # 1F1B: stage 0 keeps 2 micro-batches in flight, stage 1 one: the same activations per micro-batch
    per = {s["stage"]: s for s in out["stages"]}
    assert (per[0]["in_flight_microbatches"], per[1]["in_flight_microbatches"]) == (2, 1)
    assert per[0]["activations_per_microbatch_bytes"] == 150 * MiB and \
        per[1]["activations_per_microbatch_bytes"] == 100 * MiB
    # without a pipeline every rank is a peer: the same ledger flags stage 0's ranks against the median
    flat = memory_mod.imbalance(led)
    assert {x["rank"] for x in flat["ranks"]} == {0, 1} and "stages" not in flat


def test_imbalance_leaves_small_differences_alone():
    """A few MiB between two replicas' heaps is noise (below IMBALANCE_MIN_BYTES), and so is 5 %."""
    led = _led({0: (4 * MiB, 4 * MiB, 8 * MiB, 4 * MiB, 60 * MiB), 1: (4 * MiB, 4 * MiB, 8 * MiB, 4 * MiB, 70 * MiB)})
    assert memory_mod.imbalance(led)["ranks"] == []
    big = _led({0: (GiB, GiB, 2 * GiB, GiB, 0), 1: (GiB, GiB, 2 * GiB, GiB + 200 * MiB, 0)})
    assert memory_mod.imbalance(big)["ranks"] == []


def test_report_names_the_imbalanced_rank_and_the_stages():
    from dtprof.reports import memory as report_memory

    led = _led({0: (4 * MiB, 4 * MiB, 8 * MiB, 4 * MiB, 10 * MiB), 1: (4 * MiB, 4 * MiB, 8 * MiB, 4 * MiB, 58 * MiB)})
    mem = {"ranks": [{"rank": r} for r in (0, 1)], "imbalance": memory_mod.imbalance(led)}
    html = report_memory.ledger_html(mem)
    assert "Imbalance" in html and "<td>1</td><td>0</td><td>48.0 MiB</td><td>other (+48.0 MiB)</td>" in html


def test_report_draws_allocated_and_reserved_over_the_steps():
    from dtprof.reports import memory as report_memory

    rows = [{"rank": r, "step": s, "allocated_bytes": (10 + s + r) * MiB, "peak_bytes": (20 + s) * MiB,
             "reserved_peak_bytes": (24 + s) * MiB} for r in (0, 1) for s in (0, 4, 8)]
    fig = report_memory.over_steps_figure({"per_step": rows})
    got = {t.name: (list(t.x), [round(y * 1024, 6) for y in t.y]) for t in fig.data}
    assert got["rank 1: allocated at the optimizer step"] == ([0, 4, 8], [11, 15, 19])     # MiB
    assert got["rank 0: reserved peak"] == ([0, 4, 8], [24, 28, 32])
    assert len(got) == 6
    many = [r | {"rank": k} for k in range(20) for r in rows[:3]]          # 20 ranks: the largest over them
    names = {t.name for t in report_memory.over_steps_figure({"per_step": many}).data}
    assert names == {f"largest over ranks: {n}" for _, n, _ in report_memory.OVER_STEPS}
