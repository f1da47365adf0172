"""The fast Kineto parser (chunked, numpy-located events, only kept events decoded) gives exactly the tables of
the plain ``json`` reference path, on a real NCCL trace and on synthetic traces built to trip a byte scanner."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pandas as pd
import pytest

from conftest import SHARED
from dtprof.collectors import kineto
from dtprof.collectors.kineto import KinetoError, parse_trace, rank_tables, trace_identity

TRICKY = 'a "quoted" {brace} }close ]bracket[ \\back\\ \\"esc\\" é ✓'


def _events() -> list:
    ev = [{"ph": "M", "name": "process_labels", "pid": 7, "args": {"labels": "CPU"}}]
    t = 1000.0
    for s in range(3):
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 7, "tid": 7,
                   "ts": t, "dur": 90.0, "args": {"External id": s}})
        ev.append({"ph": "X", "cat": "cpu_op", "name": 'aten::mm "cat": "kernel" {', "pid": 7, "tid": 7,
                   "ts": t + 1, "dur": 2.0, "args": {"Input Dims": [[8, 64], [64, 32]], "note": TRICKY}})
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 7, "tid": 7,
                   "ts": t + 2, "dur": 1.0, "args": {"External id": 10 + s, "cbid": 211, "correlation": s}})
        # laid out unlike Kineto (args first): read by json, not by the launch regex; same rows expected
        ev.append({"args": {"correlation": 100 + s}, "ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel",
                   "pid": 7, "tid": 7, "ts": t + 2.5, "dur": 0.5})
        ev.append({"ph": "X", "cat": "kernel", "name": f"gemm<{s}> {TRICKY}", "pid": 0, "tid": 7,
                   "ts": t + 3, "dur": 5.5, "args": {"stream": 7, "External id": 10 + s, "correlation": s}})
        ev.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "pid": 0,
                   "tid": 40, "ts": t + 4, "dur": 20.0,
                   "args": {"stream": 40, "External id": 20 + s, "Collective name": "allreduce",
                            "In msg nelems": 1024, "Out msg nelems": 1024, "dtype": "Float", "Group size": 2,
                            "Process Group Name": "0", "Seq": s}})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 7, "tid": 7, "ts": t + 3.5,
                   "dur": 3.0, "args": {"External id": 20 + s, "Collective name": "allreduce"}})
        ev.append({"ph": "X", "cat": "user_annotation", "name": "forward}{", "pid": 7, "tid": 9, "ts": t + 5,
                   "dur": 30.0, "args": {}})
        ev.append({"ph": "X", "cat": "ESCAPED_KERNEL", "name": "memcpy HtoD", "pid": 0, "tid": 7, "ts": t + 40,
                   "dur": 1.0, "args": {"stream": 7}})
        ev.append({"ph": "i", "cat": "kernel", "name": "instant, not a span", "pid": 0, "tid": 7, "ts": t + 41})
        ev.append({"ph": "f", "id": s, "pid": 0, "tid": 7, "ts": t + 42, "cat": "ac2g", "name": "ac2g"})
        t += 100
    return ev


def _trace_text(compact: bool) -> str:
    head = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "GPU {x}", "totalGlobalMem": 80}],
            "distributedInfo": {"backend": "nccl", "rank": 1, "world_size": 2,
                                "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "pg_size": 2,
                                               "ranks": [0, 1]}]}}
    tail = {"traceName": 'x "]}" y', "displayTimeUnit": "ms", "baseTimeNanoseconds": 1_700_000_000_000_000_000}
    doc = {**head, "traceEvents": _events(), **tail}
    text = json.dumps(doc, separators=(",", ":")) if compact else json.dumps(doc, indent=2, ensure_ascii=False)
    # a category spelled with an escape: a byte test for "kernel" misses it, json decodes it to "kernel"
    return text.replace('"ESCAPED_KERNEL"', '"kern\\u0065l"')


def _same(path: Path) -> dict:
    fast, ref = parse_trace(path, fast=True), parse_trace(path, fast=False)
    assert fast["meta"] == ref["meta"]
    assert (fast["n_events"], fast["other"], fast["pids"]) == (ref["n_events"], ref["other"], ref["pids"])
    for part in ("kernels", "cpu", "launch"):
        pd.testing.assert_frame_equal(fast[part], ref[part])
    tf, tr = rank_tables(fast, trace_identity(fast, True)), rank_tables(ref, trace_identity(ref, True))
    for table in tr:
        pd.testing.assert_frame_equal(tf[table], tr[table], obj=table)
    return fast


@pytest.mark.parametrize("compact", [False, True], ids=["pretty", "compact"])
@pytest.mark.parametrize("chunk", [64, 1000, None], ids=["chunk64", "chunk1000", "default"])
def test_fast_path_equals_json_reference_on_tricky_trace(tmp_path, monkeypatch, compact, chunk):
    if chunk:  # tiny chunks put event, string and escape boundaries at every possible cut
        monkeypatch.setattr(kineto, "CHUNK", chunk)
    p = tmp_path / "rank1.pt.trace.json.gz"
    p.write_bytes(gzip.compress(_trace_text(compact).encode()))
    got = _same(p)
    k = got["kernels"]
    assert len(k) == 9 and (k["name"] == "memcpy HtoD").sum() == 3  # the escaped category was decoded
    assert k["name"].str.contains('"quoted" {brace}', regex=False).sum() == 3
    assert not got["cpu"]["name"].str.startswith("aten::").any()  # "cat": "kernel" inside a name is not a cat
    assert got["meta"]["baseTimeNanoseconds"] == 1_700_000_000_000_000_000
    assert got["meta"]["distributedInfo"]["rank"] == 1 and got["meta"]["traceName"] == 'x "]}" y'
    # 34 - 9 kernels - 9 CPU rows (3 steps: ProfilerStep, forward, record_param_comms); launches count as other
    assert got["n_events"] == 34 and got["other"] == 16
    assert sorted(got["launch"]["corr"]) == [0, 1, 2, 100, 101, 102]  # both launch layouts read
    assert got["pids"] == {7}


def test_fast_path_equals_json_reference_on_bare_array(tmp_path):
    p = tmp_path / "rank0.json"
    p.write_text(json.dumps(_events()))
    assert len(_same(p)["kernels"]) == 6  # no escaped category here


@pytest.mark.skipif(not SHARED.exists(), reason=f"shared Kineto traces not found at {SHARED}")
@pytest.mark.parametrize("name", ["nccl_single_rank.json.gz", "cpu_only_rank34.json.gz",
                                  "amd_mi250_minitoy.json.gz"])
def test_fast_path_equals_json_reference_on_shared_traces(name):
    got = _same(SHARED / name)
    assert got["n_events"] > 0


@pytest.mark.parametrize("text, why", [
    ('{"traceEvents": [{"ph": "X", "name": "a"}}, {"ph": "X"}]}', "invalid JSON"),
    ('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "a",}]}', "invalid JSON"),
    ('{"traceEvents": [{"ph": "X", "name": "a"}', "truncated JSON"),
    ('{"traceEvents": [{"ph": "X", "name": "a"}], "baseTimeNanoseconds": }', "invalid JSON around"),
    ('{"other": []}', "no \"traceEvents\""),
])
def test_fast_path_bad_json_names_the_file(tmp_path, text, why):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(KinetoError, match=why) as e:
        parse_trace(p)
    assert str(e.value).startswith(str(p)) and "\n" not in str(e.value)
