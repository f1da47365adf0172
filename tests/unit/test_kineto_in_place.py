"""Kernels and launches read in place (kineto._read_flat, no json) give the json reference path's tables, and
anything laid out unlike Kineto's events falls back to json: each case below is one kernel or launch event that a
byte reader could misread, among events it reads in place (pretty and compact JSON, small and default chunks)."""
from __future__ import annotations

import gzip
import json
import re

import pandas as pd
import pytest

from dtprof.collectors import kineto
from dtprof.collectors.kineto import KinetoError, check_times, parse_trace, rank_tables, trace_identity


def _kernel(i: int, **top) -> dict:
    ev = {"ph": "X", "cat": "kernel", "name": f"gemm<{i}>", "pid": 0, "tid": 7, "ts": 1000.5 + i, "dur": 2.25,
          "args": {"External id": 10 + i, "queued": 0, "device": 0, "stream": 7, "correlation": 100 + i,
                   "grid": [1, 1, 1]}}
    ev.update(top)
    return ev


def _launch(i: int, **top) -> dict:
    ev = {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 7, "tid": 7, "ts": 999.25 + i,
          "dur": 1.0, "args": {"External id": 10 + i, "cbid": 211, "correlation": 100 + i}}
    ev.update(top)
    return ev


ODD = {  # name -> an event unlike the plain ones (each is read by json, or read in place to the same values)
    "stream_at_top": _kernel(0, stream=9, args={"External id": 1, "correlation": 2}),
    "no_stream": _kernel(0, args={"External id": 1, "correlation": 2}),
    "no_external_id": _kernel(0, args={"stream": 7, "correlation": 2}),
    "two_nested": _kernel(0, extra={"stream": 3}),
    "stream_only_deeper": _kernel(0, args={"External id": 1, "correlation": 2, "x": {"stream": 8}}),
    "args_nested_stream": _kernel(0, args={"External id": 1, "correlation": 2, "stream": 7, "x": {"stream": 8}}),
    "name_is_a_key": _kernel(0, name="ts"),
    "name_unicode": _kernel(0, name="gemm ✓ é {}[],:"),
    "stream_as_text": _kernel(0, args={"External id": 1, "correlation": 2, "stream": "7"}),
    "id_as_float": _kernel(0, args={"External id": 1.0, "correlation": 2, "stream": 7}),
    "ts_as_int": _kernel(0, ts=1000, dur=3),
    "ts_missing": {k: v for k, v in _kernel(0).items() if k != "ts"},
    "big_ids": _kernel(0, args={"External id": 12345678, "correlation": 2**53 + 1, "stream": 9999999}),
    "negative_stream": _kernel(0, args={"External id": 0, "correlation": 2, "stream": -1}),
    "ts_exponent": _kernel(0, ts=1.5e3),
    "ts_null": _kernel(0, ts=None),
    # tests/jobs/test_fuzz_inputs.py's damaged values (check_times then refuses them, on either path's tables)
    "ts_nan": _kernel(0, ts=float("nan")),
    "ts_inf": _kernel(0, ts=float("inf")),
    "dur_minus_inf": _kernel(0, dur=float("-inf")),
    "ts_negative": _kernel(0, ts=-1e6, dur=-3),
    "ts_text": _kernel(0, ts="yesterday"),
    "args_text": _kernel(0, args="not a dict"),
    "instant": {"ph": "i", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 5.0,
                "args": {"stream": 7, "External id": 1, "correlation": 2}},
    "cat_in_name_only": _kernel(0, cat="cpu_op", name="kernel"),
    "nccl": _kernel(0, args={"External id": 1, "correlation": 2, "stream": 7, "Collective name": "allreduce",
                             "dtype": "Float", "In msg nelems": 4, "Out msg nelems": 4, "Group size": 2}),
    "dtype_only": _kernel(0, args={"External id": 1, "correlation": 2, "stream": 7, "dtype": "Float"}),
    "nccl_seq_at_top": _kernel(0, Seq=4, args={"External id": 1, "correlation": 2, "stream": 7,
                                               "Collective name": "allreduce"}),
    "nccl_name_twice": _kernel(0, name="Seq", args={"External id": 1, "correlation": 2, "stream": 7, "Seq": 3}),
    "nccl_dtype_null": _kernel(0, args={"External id": 1, "correlation": 2, "stream": 7, "dtype": None}),
    # (a number where text is expected is typed by pandas per batch of rows, _tidy: not compared here)
    "nccl_size_as_text": _kernel(0, args={"External id": 1, "correlation": 2, "stream": 7, "Group size": "2"}),
    "memcpy": _kernel(0, cat="gpu_memcpy", name="Memcpy HtoD"),
    "launch_corr_at_top": _launch(0, correlation=5, args={"cbid": 1}),
    "launch_instant": {"ph": "i", "cat": "cuda_runtime", "name": "x", "ts": 3.0, "args": {"correlation": 7}},
    "launch_no_args": _launch(0, args=None),
    "launch_driver": _launch(0, cat="cuda_driver"),
}


def _same(path) -> None:
    try:
        ref = parse_trace(path, fast=False)
    except Exception as e:   # a trace the reference path cannot read: the fast path fails the same way
        with pytest.raises(type(e)):
            parse_trace(path, fast=True)
        return
    fast = parse_trace(path, fast=True)
    assert (fast["n_events"], fast["other"]) == (ref["n_events"], ref["other"])
    for part in ("kernels", "cpu", "launch"):
        pd.testing.assert_frame_equal(fast[part], ref[part], obj=part)
    try:   # what the import does next: impossible times refuse the file, with the same message
        check_times(ref)
    except KinetoError as e:
        with pytest.raises(KinetoError, match=re.escape(str(e))):
            check_times(fast)
        return
    tf, tr = rank_tables(fast, trace_identity(fast, True)), rank_tables(ref, trace_identity(ref, True))
    for table in tr:
        pd.testing.assert_frame_equal(tf[table], tr[table], obj=table)


@pytest.mark.parametrize("chunk", [200, None], ids=["chunk200", "default"])
@pytest.mark.parametrize("compact", [False, True], ids=["pretty", "compact"])
@pytest.mark.parametrize("case", sorted(ODD))
def test_odd_kernel_or_launch_gives_the_reference_tables(tmp_path, monkeypatch, case, compact, chunk):
    if chunk:
        monkeypatch.setattr(kineto, "CHUNK", chunk)
    events = [e for i in range(6) for e in (_launch(i), _kernel(i))]
    events.insert(5, ODD[case])
    doc = {"traceEvents": events, "baseTimeNanoseconds": 1_700_000_000_000_000_000}
    p = tmp_path / "rank0.json"
    p.write_text(json.dumps(doc, separators=(",", ":")) if compact else json.dumps(doc, indent=1,
                                                                                    ensure_ascii=False))
    _same(p)


def test_kineto_layout_is_read_in_place(tmp_path, monkeypatch):
    """Kineto's own spacing (several keys a line, "key": value): the plain kernels and launches never reach json."""
    text = ",\n".join('  {\n    "ph": "X", "cat": "kernel", "name": "k<%d>", "pid": 0, "tid": 7,\n'
                      '    "ts": %d.5, "dur": 1.25,\n    "args": {\n      "External id": %d,      "queued": 0, '
                      '"stream": 7, "correlation": %d,      "grid": [1, 1, 1]\n    }\n  }' % (i, i, i, i)
                      for i in range(50))
    p = tmp_path / "rank0.json"
    p.write_text('{\n  "traceEvents": [\n' + text + '\n]}')
    decoded = []
    real = kineto._reduce_batch
    monkeypatch.setattr(kineto, "_reduce_batch", lambda ev, parts, order=None: (decoded.extend(ev),
                                                                                  real(ev, parts, order)))
    got = parse_trace(p)
    assert decoded == [] and len(got["kernels"]) == 50
    _same(p)


@pytest.mark.parametrize("gunzip", ["zlib", "isal"])
def test_gzip_read_with_zlib_or_isal(tmp_path, monkeypatch, gunzip):
    """ISA-L's gunzip (the optional "fast" extra) and zlib's give the same tables and name a damaged file."""
    if gunzip == "isal":
        monkeypatch.setattr(kineto, "_GzipFile", pytest.importorskip("isal.igzip").GzipFile)
    else:
        monkeypatch.setattr(kineto, "_GzipFile", gzip.GzipFile)
    monkeypatch.setattr(kineto, "CHUNK", 300)
    doc = {"traceEvents": [e for i in range(40) for e in (_launch(i), _kernel(i))]}
    data = gzip.compress(json.dumps(doc, indent=1).encode())
    p = tmp_path / "rank0.json.gz"
    p.write_bytes(data)
    _same(p)
    assert len(parse_trace(p)["kernels"]) == 40
    for damaged in (data[: len(data) // 2], data[:30] + b"\xff" * 8 + data[38:], data[:-8] + bytes(4) + data[-4:]):
        p.write_bytes(damaged)
        with pytest.raises(KinetoError, match=f"^{re.escape(str(p))}: damaged gzip"):
            parse_trace(p)


def test_kernel_name_not_utf8_is_refused_like_the_reference(tmp_path):
    events = [_launch(0), _kernel(0, name="gemm@"), _kernel(1)]
    text = json.dumps({"traceEvents": events}, indent=1).encode().replace(b"gemm@", b"gemm\xff")
    p = tmp_path / "rank0.json"
    p.write_bytes(text)
    with pytest.raises(KinetoError, match=re.escape(str(p))):
        parse_trace(p)
    _same(p)
