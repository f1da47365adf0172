"""torch.profiler (Kineto) traces into the run format: `dtprof import kineto` and the merge of traces that
``TraceCapture`` left in rank directories (``merge_captured_traces``, called by the launcher).

What becomes what (docs/interop.md has the full table):
- GPU kernels, memcpy and memset -> ``spans`` kind "kernel", lane "cuda:<stream>", source "kineto".
- CPU ``user_annotation`` ranges other than ProfilerStep / gloo / nccl -> ``spans`` kind "user", lane "cpu:<tid>".
- NCCL kernels carrying "Collective name" -> ``collectives`` (dtype, element counts, group, size, "Seq" when the
  trace has it), issue/return from the launching ``record_param_comms`` op (same "External id"), end and
  ``gpu_duration_ns`` from the kernel.
- gloo: ``c10d::*`` ops on the calling thread are matched in order (per op, the first ``gloo:<op>`` on a gloo
  thread that starts at or after the call) to give the real completion time; unmatched ones still become rows.
- ``ProfilerStep#N`` -> ``steps`` (step N); spans and collectives get the step whose window holds their start.
- ``distributedInfo`` -> rank, world size, backend and the ``groups`` table.

Clock: Kineto's ``ts`` (µs, float) plus the trace's ``baseTimeNanoseconds`` is CLOCK_REALTIME in ns. Checked with
torch 2.13 on Linux by bracketing ``record_function`` ranges with ``time.time_ns()`` / ``time.monotonic_ns()``:
every range's start and end fell inside the brackets (docs/interop.md). Imported traces keep that wall clock as
their time base (no monotonic reference exists); captured traces are shifted onto the rank's CLOCK_MONOTONIC with
the (monotonic, wall) pair TraceCapture recorded next to the trace.

Parsing (see "parsing" below): the (gzip) stream is read in chunks and events are located with numpy; kernels and
launches laid out as Kineto writes them are read in place with numpy, the other events dtprof keeps are decoded
with stdlib ``json``; files are parsed in parallel worker processes. A plain ``json`` reference path
(``parse_trace(path, fast=False)``) is kept and tested to give identical tables.
"""
from __future__ import annotations

import gzip
import json
import re
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
BATCH = 100_000

# Canonical op from c10d / gloo / NCCL names once lower-cased and stripped of "_" (see _op_key).
_OPS = {
    "allreduce": "all_reduce", "allreducecoalesced": "all_reduce", "allgather": "all_gather",
    "allgatherbase": "all_gather", "allgatherintotensorcoalesced": "all_gather", "allgathercoalesced": "all_gather",
    "allgatherintotensor": "all_gather", "reducescatter": "reduce_scatter", "reducescatterbase": "reduce_scatter",
    "reducescattertensorcoalesced": "reduce_scatter", "reducescattertensor": "reduce_scatter",
    "broadcast": "broadcast", "reduce": "reduce", "alltoall": "all_to_all", "alltoallbase": "all_to_all",
    "barrier": "barrier", "gather": "gather", "scatter": "scatter", "send": "send", "recv": "recv",
    "recvanysource": "recv",
}
_DTYPE = {  # Kineto/c10 scalar type names -> (dtprof dtype, bytes)
    "float": ("float32", 4), "double": ("float64", 8), "half": ("float16", 2), "bfloat16": ("bfloat16", 2),
    "c10::bfloat16": ("bfloat16", 2), "c10::half": ("float16", 2), "int": ("int32", 4), "long int": ("int64", 8),
    "long": ("int64", 8), "int64": ("int64", 8), "int32": ("int32", 4), "char": ("int8", 1),
    "signed char": ("int8", 1), "unsigned char": ("uint8", 1), "byte": ("uint8", 1), "bool": ("bool", 1),
    "short": ("int16", 2), "float8_e4m3fn": ("float8_e4m3fn", 1), "float8_e5m2": ("float8_e5m2", 1),
}


class KinetoError(Exception):
    """A trace file cannot be imported. The message is one line naming the file."""


def _op_key(name: str) -> str:
    return _OPS.get(name.split(":")[-1].lower().replace("_", ""), "")


# ---------------------------------------------------------------- parsing
#
# The fast path (``scan_trace``) never holds the whole text and never decodes an event dtprof drops. It reads the
# (gzip) stream in CHUNK-byte pieces and finds each event's byte range with numpy: the positions of quotes
# (escaped ones removed), then of braces outside strings, whose running depth opens an event at 1 and closes it at
# 0. An event is a candidate only if it holds a string starting like a kept value (_KEEP, _LAUNCH), or any
# backslash (so an escaped spelling cannot hide an event). Kernels and launches laid out as Kineto writes them are
# read in place (``_read_flat``); the other candidates are decoded with ``json`` and the same filter as the
# reference path (``_reduce_batch``) runs on the dicts, so both give the same tables (tests/unit/test_interop_fast.py
# and test_kineto_in_place.py check it). Skipped events are checked for balanced strings and braces only.

# Bytes of JSON text per step: numpy's work arrays and the decoded dicts scale with it. A rank of
# benchmarks/import_speed.py's trace parsed in 3-5% less CPU than with 4 MiB (and than with 1 MiB: more calls).
CHUNK = 2 * 2**20
_TRACE_EVENTS_B = re.compile(rb'"traceEvents"\s*:\s*\[')
_QUOTE, _BACKSLASH, _OPEN, _CLOSE, _END, _COMMA, _COLON, _SPACE = 34, 92, 123, 125, 93, 44, 58, 32
# An event holding a string that starts with one of these is a candidate (whatever its key: a superset of what
# _reduce_batch keeps). A trailing quote means the whole string.
_KEEP = (b'kernel"', b'gpu_memcpy"', b'gpu_memset"', b'user_annotation"', b"c10d::", b"record_param",
         b'process_labels"')
_KERNEL = tuple(c.encode() + b'"' for c in KERNEL_CATS)
# CUDA runtime/driver calls: only their start and correlation id are kept (a kernel's CPU launch, ``launch_ns``).
_LAUNCH = tuple(c.encode() + b'"' for c in LAUNCH_CATS)
# Kernels and launches are most of what dtprof keeps (a third of the events each in benchmarks/import_speed.py's
# trace). Those laid out as Kineto writes them are read in place, vectorised (``_read_flat``), rather than decoded
# with json: decoding the kernels was half of the parse (json and the dicts' fields: 0.47 of 1.22 s CPU for a
# 500k-event rank) and decoding the launches made a whole import 1.7x as long. Field: (depth, type); depth 1 is the
# event's own key, 2 a key of its "args". The reference path reads the same fields (_reduce_batch).
_KERNEL_FIELDS = {"name": (1, "str"), "ts": (1, "float"), "dur": (1, "float"),
                  "stream": (2, "int"), "External id": (2, "int"), "correlation": (2, "int")}
# NCCL's collective args, when a kernel has them (at most once each)
_KERNEL_NCCL = {"Collective name": (2, "str"), "dtype": (2, "str"), "In msg nelems": (2, "int"),
                "Out msg nelems": (2, "int"), "Process Group Name": (2, "str"), "Group size": (2, "int"),
                "Seq": (2, "int")}
# the kernels' columns (as _reduce_batch makes them) and the field each is read from
_KERNEL_COLUMNS = {"name": "name", "ts": "ts", "dur": "dur", "stream": "stream", "ext": "External id",
                   "coll": "Collective name", "dtype": "dtype", "in_nelems": "In msg nelems",
                   "out_nelems": "Out msg nelems", "group": "Process Group Name", "group_size": "Group size",
                   "seq": "Seq", "corr": "correlation"}
_LAUNCH_FIELDS = {"ts": (1, "float"), "correlation": (2, "int")}


try:   # ISA-L's gunzip, where installed (the optional "fast" extra): a third of zlib's CPU time, 0.03 s instead of
    # 0.08 s for a 500k-event rank of benchmarks/import_speed.py's trace (a tenth of its parse); zlib otherwise
    from isal.igzip import GzipFile as _GzipFile
    from isal.isal_zlib import error as _gzip_error
except ImportError:
    _GzipFile, _gzip_error = gzip.GzipFile, zlib.error


def _open_stream(path: Path):
    """A binary stream of the trace's JSON, gunzipped when it starts with gzip's magic bytes."""
    try:
        f = open(path, "rb")
        magic = f.read(2)
        f.seek(0)
    except OSError as e:
        raise KinetoError(f"{path}: cannot read ({e.strerror or e})") from None
    return _GzipFile(fileobj=f, mode="rb") if magic == b"\x1f\x8b" else f


def _read(stream, path, n: int) -> bytes:
    try:
        return stream.read(n)
    except (OSError, EOFError, zlib.error, _gzip_error) as e:
        if isinstance(stream, gzip.GzipFile):
            raise KinetoError(f"{path}: damaged gzip ({e})") from None
        raise KinetoError(f"{path}: cannot read ({e.strerror or e})") from None


def _unescaped(q: np.ndarray, bs: np.ndarray) -> np.ndarray:
    """The quotes of ``q`` not escaped by the backslashes at ``bs``."""
    escaped = []
    i = 0
    while i < len(bs):  # a run of L backslashes escapes every second one and, if L is odd, the next byte
        j = i
        while j + 1 < len(bs) and bs[j + 1] == bs[j] + 1:
            j += 1
        if (j - i + 1) % 2:
            escaped.append(int(bs[j]) + 1)
        i = j + 1
    return q[~np.isin(q, escaped)] if escaped else q


def _layout(buf: bytes, n: int) -> dict:
    """Where the events are in ``buf[:n]``, which starts inside the traceEvents array at depth 0 and outside any
    string: the complete events (``opens``/``closes``: positions of their outer braces), the closing "]"
    (``array_end``, None if not in the text), the backslashes (``bs``) and unescaped quotes (``q``) in the complete
    events, and the braces outside strings (``st``, ``sch``: which) with the depth after each (``depth``)."""
    a = np.frombuffer(buf, np.uint8, count=n)
    q = np.flatnonzero(a == _QUOTE)
    bs = np.flatnonzero(a == _BACKSLASH) if buf.find(b"\\", 0, n) >= 0 else np.empty(0, np.int64)
    if len(bs):
        q = _unescaped(q, bs)
    st = np.flatnonzero((a == _OPEN) | (a == _CLOSE) | (a == _END))
    st = st[np.searchsorted(q, st) % 2 == 0]  # an even number of quotes before it: outside strings
    sch = a[st]
    depth = np.cumsum((sch == _OPEN).astype(np.int64) - (sch == _CLOSE))  # depth after each; "]" keeps it
    ends = st[(sch == _END) & (depth == 0)]
    array_end = int(ends[0]) if len(ends) else len(a)
    inside = st < array_end
    if (depth[inside] < 0).any():
        raise ValueError(f"unbalanced '}}' at byte {int(st[np.argmax(depth < 0)])} of the array")
    opens = st[inside & (sch == _OPEN) & (depth == 1)]
    closes = st[inside & (sch == _CLOSE) & (depth == 0)]
    hi = int(closes[-1]) if len(closes) else 0
    cut = np.searchsorted(st, hi)   # the arrays are sorted: those of the complete events are a prefix
    return {"opens": opens[: len(closes)], "closes": closes, "array_end": array_end if len(ends) else None,
            "bs": bs[:np.searchsorted(bs, hi)], "q": q[:np.searchsorted(q, hi)], "st": st[:cut], "sch": sch[:cut],
            "depth": depth[:cut]}


_PAD = bytes(64)   # zeros after each chunk's text (scan_trace): 8-byte words and number windows read past its end


def _words(buf: bytes) -> np.ndarray:
    """The 8 bytes from each position of ``buf`` as one little-endian integer (a view with a stride of one byte):
    compares up to 8 bytes at a position in one integer operation."""
    return np.ndarray((len(buf) - 7,), "<u8", buf, strides=(1,))


def _matching(w: np.ndarray, at: np.ndarray, prefixes, first: np.ndarray | None = None) -> np.ndarray:
    """Which strings, of those whose opening quote is at each position of ``at``, start with one of ``prefixes``
    (bytes, at most 24 long), compared 8 bytes at a time: their indices into ``at`` (in order for one prefix; the
    callers index with them rather than with a mask, which numpy turns into indices again each time). ``first``:
    ``w[at + 1]`` when the caller has it."""
    first = w[at + 1] if first is None else first
    hits = []
    for p in prefixes:
        word = np.uint64(int.from_bytes(p[:8], "little"))
        masked = first if len(p) >= 8 else first & np.uint64((1 << 8 * len(p)) - 1)   # a whole word: no copy
        hit = np.flatnonzero(masked == word)
        for k in range(8, len(p), 8):  # the rest, on the few that matched so far
            part = p[k:k + 8]
            mask = np.uint64((1 << 8 * len(part)) - 1)
            hit = hit[(w[at[hit] + 1 + k] & mask) == np.uint64(int.from_bytes(part, "little"))]
        hits.append(hit)
    return hits[0] if len(hits) == 1 else np.concatenate(hits)


def _starting(w: np.ndarray, at: np.ndarray, prefixes) -> np.ndarray:
    """``_matching`` as a mask over ``at``."""
    found = np.zeros(len(at), bool)
    found[_matching(w, at, prefixes)] = True
    return found


class _Chunk:
    """A chunk's complete events as numpy arrays, for finding the kept ones and reading the flat ones in place:
    its bytes and 8-byte words (the text is followed by _PAD), the opening quote of each string with its first
    word and its event, and the objects nested in each event (``nested``: how many, ``nest_lo``/``nest_hi``: where
    the one at depth 2 opens and closes)."""

    def __init__(self, buf: bytes, lay: dict):
        self.buf, self.a, self.w = buf, np.frombuffer(buf, np.uint8), _words(buf)
        self.q, self.opens = lay["q"], lay["opens"]
        n = len(self.opens)
        self.s_open = self.q[0::2]
        self.s_first = self.w[self.s_open + 1]
        # each string's event: the events opening before it, less one (the few events looked up among the many
        # strings, then counted up, costs a third of looking up each string among the events)
        first = np.bincount(np.searchsorted(self.s_open, self.opens), minlength=len(self.s_open) + 1)
        self.s_ev = np.cumsum(first[:-1]) - 1
        st, sch, depth = lay["st"], lay["sch"], lay["depth"]
        nested = st[(depth >= 2) & (sch == _OPEN)]
        self.nested = np.bincount(np.searchsorted(self.opens, nested, side="right") - 1, minlength=n)
        lo, hi = st[(depth == 2) & (sch == _OPEN)], st[(depth == 1) & (sch == _CLOSE)]
        self.nest_lo, self.nest_hi = np.zeros(n, np.int64), np.zeros(n, np.int64)
        ev = np.searchsorted(self.opens, lo, side="right") - 1
        self.nest_lo[ev], self.nest_hi[ev] = lo, hi

    def holding(self, prefixes) -> np.ndarray:
        """Whether each event holds a string starting with one of ``prefixes``."""
        out = np.zeros(len(self.opens), bool)
        out[self.s_ev[_matching(self.w, self.s_open, prefixes, self.s_first)]] = True
        return out

    def strings(self, events: np.ndarray) -> _Strings:
        """The strings of ``events`` that can be keys: followed by a colon or white space (a key's duplicate with
        odd spacing is still counted; values are followed by a comma or a bracket, or white space)."""
        after = self.a[self.q[1::2] + 1]
        keys = (after == _COLON) | (after == _SPACE) | (after == 10) | (after == 13) | (after == 9)
        return _Strings(self, np.flatnonzero(keys & events[self.s_ev]))

    def value_at(self, key_at: np.ndarray, key_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(where the value starts, whether the string was a key) for keys opening at ``key_at``: its closing
        quote, then ":" or " :", then at most one space."""
        a = self.a
        colon = key_at + key_len + 2
        colon += a[colon] == _SPACE
        v = colon + 1
        v += a[v] == _SPACE
        return v, a[colon] == _COLON


class _Strings:
    """Some of a chunk's strings (``idx``: their numbers in the chunk), looked up by value."""

    def __init__(self, ch: _Chunk, idx: np.ndarray):
        self.ch, self.idx = ch, idx
        self.at, self.ev, self.first = ch.s_open[idx], ch.s_ev[idx], ch.s_first[idx]
        self._keys: dict = {}

    def subset(self, events: np.ndarray) -> _Strings:
        return _Strings(self.ch, self.idx[events[self.ev]])

    def key(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(how many strings equal to ``key`` each event holds, the number of the last of them)."""
        if key not in self._keys:
            ch = self.ch
            hit = _matching(ch.w, self.at, [key.encode() + b'"'], self.first)
            ev, n = self.ev[hit], len(ch.opens)
            last = np.zeros(n, np.int64)
            last[ev] = self.idx[hit]
            self._keys[key] = (np.bincount(ev, minlength=n), last)
        return self._keys[key]

    def holding(self, keys) -> np.ndarray:
        """Whether each event holds a string equal to one of ``keys``."""
        hit = _matching(self.ch.w, self.at, [k.encode() + b'"' for k in keys], self.first)
        out = np.zeros(len(self.ch.opens), bool)
        out[self.ev[hit]] = True
        return out


NUMBER_WIDTH = 24   # bytes read for a number read in place: a number in Kineto's JSON is far shorter
_PLACES = np.array([[10 ** (n - 1 - i) if i < n else 0 for i in range(8)] for n in range(9)], np.int64)
_ENDS_NUMBER = np.zeros(256, bool)
_ENDS_NUMBER[[_COMMA, _CLOSE, _SPACE, 9, 10, 13]] = True


def _numbers(ch: _Chunk, v: np.ndarray, dtype) -> np.ndarray:
    """The numbers starting at ``v`` in the chunk: the text up to the next comma or closing brace, within
    NUMBER_WIDTH bytes, converted (ValueError or OverflowError if one is not a number of ``dtype``). Integers of up
    to 7 digits (ids, streams) are summed from their digits, in a third of numpy's time."""
    w, a = ch.w, ch.a
    out, todo = np.empty(len(v), dtype), np.ones(len(v), bool)
    if dtype == np.int64:
        d = w[v].view(np.uint8).reshape(-1, 8) - np.uint8(48)   # each byte's digit, if it is one
        n = np.argmin(d < 10, axis=1)   # digits before the first other byte (0 if all 8 are digits)
        todo = (n == 0) | ~_ENDS_NUMBER[a[v + n]]
        out[~todo] = np.einsum("ij,ij->i", d, _PLACES[n])[~todo]
    if todo.any():
        v = v[todo]
        b = np.stack([w[v + i] for i in range(0, NUMBER_WIDTH, 8)], axis=1).view(np.uint8)  # a row of bytes each
        stop = np.argmax((b == _COMMA) | (b == _CLOSE), axis=1)
        if not (stop > 0).all():   # no separator in the window, or nothing before it
            raise ValueError("not a number")
        if dtype == np.float64:   # Arrow: a fourth of numpy's time (0.04 s of a 500k-event rank's 0.65 s parse,
            # most of it 17-digit timestamps); both round correctly, so the doubles are the same
            text = pc.ascii_rtrim_whitespace(_texts(ch.buf, v, v + stop))
            out[todo] = pc.cast(text, pa.float64()).to_numpy()
        else:   # numpy: Arrow would take hexadecimal, which JSON has not
            b[np.arange(NUMBER_WIDTH) >= stop[:, None]] = 0   # a NUL-padded fixed-width string each
            out[todo] = b.view(f"S{NUMBER_WIDTH}").ravel().astype(dtype)
    return out


def _texts(buf: bytes, start: np.ndarray, end: np.ndarray) -> pa.Array:
    """The texts ``buf[start:end]`` (in order, apart) as an Arrow array, without a Python string each (the kernel
    names: 1.5 ms per chunk as Python strings, which pandas then handed to Arrow one by one): ``buf`` becomes one
    Arrow array of the texts and the gaps between them, and Arrow copies out every other element. ValueError
    (ArrowInvalid) if one is not UTF-8."""
    bounds = np.empty(2 * len(start) + 2, np.int64)
    bounds[0], bounds[1:-1:2], bounds[2:-1:2], bounds[-1] = 0, start, end, len(buf)
    whole = pa.LargeStringArray.from_buffers(len(bounds) - 1, pa.py_buffer(bounds), pa.py_buffer(buf))
    texts = whole.take(pa.array(np.arange(1, len(bounds) - 1, 2)))
    texts.validate(full=True)
    return texts


def _read_flat(strs: _Strings, events: np.ndarray, cats: tuple, fields: dict,
               optional: dict | None = None) -> tuple[np.ndarray, dict]:
    """Read ``fields`` and ``optional`` fields of the ``events`` (a mask over the chunk's events, none holding a
    backslash; ``strs``: their strings) in place: (the events read, their values per field). An event is read only
    if laid out as Kineto writes it: "ph" "X", a "cat" of ``cats`` (bytes, ending in a quote), one nested object,
    its "args"; each field's key occurs once among the event's strings that can be keys (``_Chunk.strings``; an
    optional one at most once), at its depth, with a value of its type. Others are left to json, as are all of them
    if a number does not convert. An optional field absent from an event is None (text) or NaN (a number)."""
    ch, n, optional = strs.ch, len(events), optional or {}
    keys = {"ph": (1, "str"), "cat": (1, "str"), "args": (1, "object"), **fields}
    ok = events & (ch.nested == 1)
    for key in keys:
        ok &= strs.key(key)[0] == 1
    opt = strs.subset(ok & strs.holding(optional)) if optional else strs   # looked up where there is one
    has = {}
    for key in optional:
        count = opt.key(key)[0]
        ok &= count <= 1
        has[key] = count == 1
    read = np.flatnonzero(ok)
    lo, hi = ch.nest_lo[read], ch.nest_hi[read]   # the nested object: args, if it is args' value (checked below)
    good = np.ones(len(read), bool)
    found = {}   # key: (the rows of read holding it, None for all; where its value starts; the value's string)
    for key, (depth, kind) in {**keys, **optional}.items():
        rows = np.flatnonzero(has[key][read]) if key in optional else None   # few: only those holding it
        at = slice(None) if rows is None else rows
        s = (strs if key in keys else opt).key(key)[1][read[at]]
        p = ch.s_open[s]
        v, is_key = ch.value_at(p, len(key.encode()))
        good[at] &= (is_key & (((p > lo[at]) & (p < hi[at])) == (depth == 2))
                     & ((ch.a[v] == _QUOTE) == (kind == "str")))
        found[key] = (rows, v, s + 1)   # a string value is the key's next string
    w = ch.w
    good &= (found["args"][1] == lo) & _starting(w, found["ph"][1], [b'X"']) & _starting(w, found["cat"][1], cats)
    read, kept = read[good], np.cumsum(good) - 1   # kept: each row's number among the rows read
    out = {}
    try:
        for key, (_, kind) in {**fields, **optional}.items():
            rows, v, s = found[key]
            sel = good if rows is None else good[rows]
            v, s = v[sel], s[sel]
            if kind == "str" and rows is None:   # no backslash in the event: the bytes between the quotes
                x = _texts(ch.buf, v + 1, ch.q[2 * s + 1])
            elif kind == "str":
                x = np.array([ch.buf[i:j].decode() for i, j in zip((v + 1).tolist(), ch.q[2 * s + 1].tolist())],
                             object)
            else:
                x = _numbers(ch, v, np.float64 if kind == "float" else np.int64)
            if rows is None:
                out[key] = x
            else:   # an optional field: None or NaN where absent
                out[key] = np.full(len(read), None, object) if kind == "str" else np.full(len(read), np.nan)
                out[key][kept[rows[sel]]] = x
    except (ValueError, OverflowError):
        return np.zeros(n, bool), {}
    done = np.zeros(n, bool)
    done[read] = True
    return done, out


def _reduce_chunk(buf: bytes, lay: dict, parts: dict) -> None:
    """Count the chunk's events; read the kernels and launches laid out as Kineto writes them in place
    (``_read_flat``) and decode the other candidates (an event holding a ``_KEEP`` or launch string, or any
    backslash) with json, for ``_reduce_batch`` to filter exactly as the reference path does."""
    first_event = parts["n_events"]
    n = len(lay["opens"])
    parts["n_events"] += n
    ch = _Chunk(buf, lay)
    plain = np.ones(n, bool)   # no backslash
    plain[np.searchsorted(ch.opens, lay["bs"], side="right") - 1] = False
    is_kernel, is_launch = ch.holding(_KERNEL), ch.holding(_LAUNCH)
    is_cand = ~plain | is_kernel | ch.holding([p for p in _KEEP if p not in _KERNEL])
    is_launch &= ~is_cand
    is_cand |= is_launch
    strs = ch.strings((is_kernel | is_launch) & plain)
    done, k = _read_flat(strs, is_kernel & plain, _KERNEL, _KERNEL_FIELDS, _KERNEL_NCCL)
    if done.any():
        parts["flat_kernels"].append({**{c: k[f] for c, f in _KERNEL_COLUMNS.items()},
                                      "event": first_event + np.flatnonzero(done)})
        parts["kept"] += int(done.sum())
        is_cand &= ~done
    done, lt = _read_flat(strs, is_launch, _LAUNCH, _LAUNCH_FIELDS)
    if done.any():
        parts["flat_launch"].append((lt["correlation"], lt["ts"]))
        is_cand &= ~done
    cand = np.flatnonzero(is_cand)
    if len(cand):
        sl = [buf[o:c + 1] for o, c in zip(lay["opens"][cand].tolist(), lay["closes"][cand].tolist())]
        _reduce_batch(json.loads(b"[" + b",".join(sl) + b"]"), parts, first_event + cand)


def scan_trace(path: Path, parts: dict, chunk: int | None = None) -> dict:
    """Fast path: feed the events dtprof keeps to ``_reduce_batch``; return the top-level keys but traceEvents."""
    chunk = chunk or CHUNK
    stream = _open_stream(path)
    with stream:
        buf = _read(stream, path, chunk)
        head = buf.lstrip()[:1]
        m = _TRACE_EVENTS_B.search(buf)
        while head == b"{" and not m and len(buf) < 256 * 2**20:  # metadata before traceEvents is rarely large
            more = _read(stream, path, chunk)
            if not more:
                break
            buf += more
            m = _TRACE_EVENTS_B.search(buf)
        if head == b"[":
            prefix, pos = None, buf.index(b"[") + 1
        elif head == b"{" and m:
            prefix, pos = buf[:m.start()], m.end()
        elif head == b"{":
            raise KinetoError(f"{path}: no \"traceEvents\" in this JSON (not a torch.profiler trace?)")
        elif not buf.strip():
            raise KinetoError(f"{path}: empty file (no JSON text), not a trace")
        else:
            raise KinetoError(f"{path}: not JSON (starts with {buf[:20]!r})")
        buf = buf[pos:] + _PAD   # the text is buf[:n]
        eof = False
        while True:
            n = len(buf) - len(_PAD)
            try:
                lay = _layout(buf, n)
                closes, array_end = lay["closes"], lay["array_end"]
                if len(closes):
                    _reduce_chunk(buf, lay, parts)
            except ValueError as e:  # json's errors and UnicodeDecodeError included
                raise KinetoError(f"{path}: invalid JSON in traceEvents ({str(e).splitlines()[0]})") from None
            if array_end is not None:
                tail = buf[array_end + 1:n] + (b"" if eof else _read(stream, path, -1))
                break
            if eof:
                raise KinetoError(f"{path}: truncated JSON (traceEvents never closed)")
            more = _read(stream, path, chunk)
            eof = not more
            buf = b"".join((buf[int(closes[-1]) + 1 if len(closes) else 0:n], more, _PAD))   # one copy
    if prefix is None:
        return {}
    try:
        meta = json.loads(prefix + b'"traceEvents": []' + tail)
    except ValueError as e:
        raise KinetoError(f"{path}: invalid JSON around traceEvents ({e})") from None
    meta.pop("traceEvents", None)
    return meta


# ---------------------------------------------------------------- reference path
# Plain stdlib json over the whole text: slow, but obviously right. Kept to check the fast path against
# (``parse_trace(path, fast=False)``).

_TRACE_EVENTS = re.compile(r'"traceEvents"\s*:\s*\[')
_SEP = re.compile(r"[\s,]*")


def read_text(path: Path) -> str:
    """The trace's JSON text; gzip detected by its magic bytes. Errors name the file."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise KinetoError(f"{path}: cannot read ({e.strerror or e})") from None
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise KinetoError(f"{path}: damaged gzip ({e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KinetoError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def iter_event_batches(text: str, path, meta_out: dict, batch: int = BATCH):
    """Yield lists of event dicts (``batch`` at a time) from a Chrome/Kineto trace text.

    Fills ``meta_out`` with the top-level keys other than traceEvents once the whole text is read. A bare JSON
    array of events (the minimal Chrome trace format) is accepted too.
    """
    decoder = json.JSONDecoder()
    start = text.lstrip()[:1]
    m = _TRACE_EVENTS.search(text)
    if start == "[":
        pos, head_end = text.index("[") + 1, None
    elif start == "{" and m:
        pos, head_end = m.end(), m.start()
    elif start == "{":
        raise KinetoError(f"{path}: no \"traceEvents\" in this JSON (not a torch.profiler trace?)")
    elif not text.strip():
        raise KinetoError(f"{path}: empty file (no JSON text), not a trace")
    else:
        raise KinetoError(f"{path}: not JSON (starts with {text[:20]!r})")
    sep = _SEP.match
    raw = decoder.raw_decode
    out = []
    n = len(text)
    try:
        while True:
            pos = sep(text, pos).end()
            if pos >= n:
                raise KinetoError(f"{path}: truncated JSON (traceEvents never closed)")
            if text[pos] == "]":
                pos += 1
                break
            ev, pos = raw(text, pos)
            out.append(ev)
            if len(out) >= batch:
                yield out
                out = []
    except ValueError as e:
        raise KinetoError(f"{path}: invalid JSON in traceEvents ({str(e).splitlines()[0]})") from None
    if out:
        yield out
    if head_end is not None:  # the other top-level keys: before and after the array
        rest = text[:head_end] + '"traceEvents": []' + text[pos:]
        try:
            meta = json.loads(rest)
        except ValueError as e:
            raise KinetoError(f"{path}: invalid JSON around traceEvents ({e})") from None
        meta.pop("traceEvents", None)
        meta_out.update(meta)


def _reduce_batch(events: list, parts: dict, order=None) -> None:
    """Keep only the columns dtprof uses from one batch of complete ("X") events (one pass to sort them out).
    ``order``: each event's number in the file, kept with the kernels (the fast path reads kernels two ways and
    puts them back in file order)."""
    kern, kern_i, cpu, launch, pids = [], [], [], [], parts["pids"]
    for i, e in enumerate(events):
        ph = e.get("ph")
        if ph == "X":
            cat = e.get("cat")
            if cat in KERNEL_CATS:
                kern.append(e)
                kern_i.append(i)
            elif cat in LAUNCH_CATS:
                launch.append(e)
            elif cat == "user_annotation" or (cat == "cpu_op" and str(e.get("name", "")).startswith(
                    ("c10d::", "record_param"))):
                cpu.append(e)
        elif ph == "M" and e.get("name") == "process_labels" and "CPU" in str(e.get("args", {}).get("labels", "")):
            pids.add(e.get("pid"))
    if kern:
        args = [e.get("args") or {} for e in kern]
        parts["kernels"].append(pd.DataFrame({
            "name": [e.get("name", "") for e in kern],
            "ts": [e.get("ts") for e in kern], "dur": [e.get("dur", 0) for e in kern],
            "stream": [a.get("stream", e.get("tid")) for a, e in zip(args, kern)],
            "ext": [a.get("External id") for a in args],
            "coll": [a.get("Collective name") for a in args],
            "dtype": [a.get("dtype") for a in args],
            "in_nelems": [a.get("In msg nelems") for a in args],
            "out_nelems": [a.get("Out msg nelems") for a in args],
            "group": [a.get("Process Group Name") for a in args],
            "group_size": [a.get("Group size") for a in args],
            "seq": [a.get("Seq") for a in args],
            "corr": [a.get("correlation") for a in args],
            **({"event": np.asarray(order)[kern_i]} if order is not None else {}),
        }))
    if launch:  # the CPU side of each kernel launch, joined to its kernel by correlation id
        parts["launch"].append(pd.DataFrame({
            "corr": [(e.get("args") or {}).get("correlation") for e in launch], "ts": [e.get("ts") for e in launch]}))
    if cpu:
        args = [e.get("args") or {} for e in cpu]
        parts["cpu"].append(pd.DataFrame({
            "cat": [e.get("cat") for e in cpu], "name": [e.get("name", "") for e in cpu],
            "ts": [e.get("ts") for e in cpu], "dur": [e.get("dur", 0) for e in cpu],
            "pid": [e.get("pid") for e in cpu], "tid": [e.get("tid") for e in cpu],
            "ext": [a.get("External id") for a in args],
            "dims": [a.get("Input Dims") for a in args], "types": [a.get("Input type") for a in args],
        }))
    parts["kept"] += len(kern) + len(cpu)


_TIMES = ("ts", "dur")
_IDS = ("stream", "ext", "in_nelems", "out_nelems", "group_size", "seq", "pid", "tid", "corr")
_TEXT = ("cat", "name", "coll", "dtype", "group")


def _tidy(df: pd.DataFrame) -> pd.DataFrame:
    """Column dtypes that do not depend on how the events were batched (pandas infers each batch's: a batch where
    an arg is always absent gives object, another int64, their concat object or float64): times float64, ids
    Int64 when every value is a whole number, text str. A column holding anything else is left as it is."""
    for c in df.columns:
        s = df[c]
        if c in _TEXT and pd.api.types.infer_dtype(s, skipna=True) in ("string", "empty"):
            df[c] = s.astype("str")
        elif c in _IDS and s.dtype == np.int64:   # read in place, or json's whole numbers: as they are
            df[c] = s.astype("Int64")
        elif c in _TIMES + _IDS:
            n = pd.to_numeric(s, errors="coerce")
            if n.isna().sum() != s.isna().sum():  # some value was not a number: keep the column as read
                continue
            n = n.astype("float64")
            whole = c in _IDS and bool((n.dropna() % 1 == 0).all())
            df[c] = n.astype("Int64") if whole else n
    return df


_TEXT_DTYPE = pd.Series(["text"]).dtype   # what pandas makes of text: with pandas 3, str backed by Arrow


def _column(pieces: list):
    """A column read in place, from its pieces (one per chunk). Text (Arrow arrays, or object arrays of str and
    None) goes to pandas as Arrow arrays, which pandas would otherwise build value by value (a 166k-kernel rank's
    three NCCL text columns: 30 ms, now 5)."""
    arrow = getattr(_TEXT_DTYPE, "storage", "") == "pyarrow"   # pandas 3's str
    if isinstance(pieces[0], pa.Array):
        text = pa.concat_arrays(pieces)
        return pd.Series(text, dtype=_TEXT_DTYPE) if arrow else np.array(text.to_pylist(), object)
    x = np.concatenate(pieces)
    return pd.Series(pa.array(x, type=pa.large_string()), dtype=_TEXT_DTYPE) if x.dtype == object and arrow else x


def parse_trace(path: Path, fast: bool = True) -> dict:
    """One trace file -> {"meta": top-level keys, "kernels": DataFrame, "cpu": DataFrame, counts}.

    ``fast=False`` decodes every event with stdlib json (the reference the fast path is tested against).
    """
    parts = {"kernels": [], "flat_kernels": [], "cpu": [], "launch": [], "flat_launch": [], "n_events": 0, "kept": 0,
             "pids": set()}
    if fast:
        meta = scan_trace(Path(path), parts)
    else:
        text = read_text(path)
        meta = {}
        for batch in iter_event_batches(text, path, meta):
            parts["n_events"] += len(batch)
            _reduce_batch(batch, parts)
        del text
    if parts["n_events"] == 0:
        raise KinetoError(f"{path}: trace has no events")
    cat = lambda dfs: _tidy(pd.concat(dfs, ignore_index=True)) if dfs else pd.DataFrame()  # noqa: E731
    flat = parts["flat_launch"]   # the fast path's launches read in place: (correlation ids, starts)
    launch = cat(([pd.DataFrame({"corr": np.concatenate([c for c, _ in flat]),
                                 "ts": np.concatenate([t for _, t in flat])})] if flat else []) + parts["launch"])
    # a lookup by correlation id: sorted, so both paths give the same table
    if len(launch) and not (launch["corr"].is_monotonic_increasing and launch["corr"].is_unique):
        launch = launch.sort_values(["corr", "ts"], kind="stable").reset_index(drop=True)
    flat = parts["flat_kernels"]   # the fast path's kernels read in place: columns of arrays, one frame at the end
    kernels = cat(([pd.DataFrame({c: _column([f[c] for f in flat]) for c in flat[0]})] if flat else [])
                  + parts["kernels"])
    if "event" in kernels:   # back in file order, if some were decoded with json
        if not kernels["event"].is_monotonic_increasing:
            kernels = kernels.sort_values("event", kind="stable").reset_index(drop=True)
        kernels = kernels.drop(columns="event")
    return {"meta": meta, "kernels": kernels, "cpu": cat(parts["cpu"]), "launch": launch,
            "n_events": parts["n_events"], "other": parts["n_events"] - parts["kept"], "pids": parts["pids"],
            "path": Path(path)}


# ---------------------------------------------------------------- identity

_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


def trace_identity(parsed: dict, single: bool) -> dict:
    """rank, world size, backend and groups from distributedInfo (or, for the rank, the file name)."""
    meta, path = parsed["meta"], parsed["path"]
    info = meta.get("distributedInfo") or {}
    warnings = []
    rank = info.get("rank")
    if rank is None:
        m = _RANK_IN_NAME.search(path.name)
        if m:
            rank = int(m.group(1))
            warnings.append(f"{path}: no distributedInfo; rank {rank} taken from the file name")
        elif single:
            rank = 0
            warnings.append(f"{path}: no distributedInfo and no rank in the file name; imported as rank 0")
        else:
            raise KinetoError(f"{path}: missing rank (no distributedInfo, no 'rank<N>' in the file name); "
                              f"import it alone to take it as rank 0")
    world = int(info.get("world_size") or 1)
    backend = str(info.get("backend") or "")
    groups = info.get("pg_config") or []
    if isinstance(groups, dict):  # older traces: {pg_name: {...}}
        groups = [dict(v, pg_name=k) for k, v in groups.items()]
    return {"rank": int(rank), "world_size": world, "backend": backend, "groups": groups, "warnings": warnings}


def _default_group(groups: list) -> tuple[str, int]:
    for g in groups:
        if g.get("pg_desc") == "default_pg":
            return str(g.get("pg_name", "0")), int(g.get("pg_size") or len(g.get("ranks") or []))
    if groups:
        g = groups[0]
        return str(g.get("pg_name", "0")), int(g.get("pg_size") or len(g.get("ranks") or []))
    return "0", 0


# ---------------------------------------------------------------- rows

def _to_ns(us, base_ns: int) -> np.ndarray:
    return np.rint(pd.to_numeric(pd.Series(us), errors="coerce").fillna(0).to_numpy(float) * 1000).astype(
        np.int64) + base_ns


def _bytes_of(dims, types) -> tuple[int, str]:
    """Bytes of the first tensor input and its dtype from record_shapes' Input Dims / Input type."""
    if not isinstance(dims, list) or not dims:
        return 0, ""
    d, t = dims[0], (types[0] if isinstance(types, list) and types else "")
    while isinstance(d, list) and d and isinstance(d[0], list):  # a list of tensors: the first one
        d = d[0]
    if isinstance(t, str) and t.startswith("TensorList"):
        t = ""
    dtype, size = _DTYPE.get(str(t).lower(), ("", 0))
    n = int(np.prod(d)) if isinstance(d, list) and d else (1 if d == [] else 0)
    return n * size, dtype


def _assign_step(t_ns: np.ndarray, steps: pd.DataFrame) -> pd.Series:
    """The step whose [start, end) holds each time (null outside every step window)."""
    if not len(steps) or not len(t_ns):
        return pd.Series(pd.array([None] * len(t_ns), dtype="Int64"))
    st = steps.sort_values("start_ns")
    starts, ends = st["start_ns"].to_numpy(), st["end_ns"].to_numpy()
    i = np.searchsorted(starts, t_ns, side="right") - 1
    ok = (i >= 0) & (t_ns < ends[np.clip(i, 0, None)])
    out = pd.array(st["step"].to_numpy()[np.clip(i, 0, None)], dtype="Int64")
    out[~ok] = pd.NA
    return pd.Series(out)


def _launch_ns(kern: pd.DataFrame, launch: pd.DataFrame, base: int) -> pd.array:
    """Each kernel's CPU launch time (its cuda_runtime/cuda_driver call, same correlation id); null without one."""
    out = pd.arrays.IntegerArray(np.zeros(len(kern), np.int64), np.ones(len(kern), bool))   # all null
    if not len(launch) or "corr" not in kern.columns:
        return out
    lt = launch.dropna(subset=["corr"]).drop_duplicates("corr")
    at = pd.Index(lt["corr"]).get_indexer(kern["corr"])   # its launch's row, -1 for none (Series.map: 3x the time)
    t = lt["ts"].to_numpy()[np.maximum(at, 0)] if len(lt) else np.full(len(kern), np.nan)
    has = (at >= 0) & pd.notna(t)
    out[has] = _to_ns(t[has], base)
    return out


def _labels(prefix: str, values) -> pd.Categorical:
    """``prefix + str(value)`` per value, or ``prefix`` repeated when ``values`` is a count, as a Categorical: a
    span table's text columns repeat a few values over millions of rows, and the run format stores them as
    categories anyway (a plain string column costs one Python string per row when written)."""
    if isinstance(values, int):
        return pd.Categorical.from_codes(np.zeros(values, np.int8), [prefix])
    codes, uniq = pd.factorize(values, use_na_sentinel=False)
    return pd.Categorical.from_codes(codes, [prefix + str(u) for u in uniq])


def rank_tables(parsed: dict, ident: dict, shift_ns: int = 0, step_offset: int | None = None) -> dict:
    """One parsed trace -> run-format tables for its rank.

    ``shift_ns`` is added to every wall-clock time (captured traces: minus the rank's wall-monotonic offset).
    ``step_offset``: when given, ProfilerStep#N becomes step N - first N + step_offset (captured traces).
    """
    meta, rank = parsed["meta"], ident["rank"]
    base = int(meta.get("baseTimeNanoseconds") or 0) + shift_ns
    kern, cpu = parsed["kernels"], parsed["cpu"]
    events = [w for w in ident["warnings"]]

    # steps: ProfilerStep#N
    steps = pd.DataFrame(columns=["rank", "step", "start_ns", "end_ns"])
    if len(cpu):
        ps = cpu[(cpu["cat"] == "user_annotation") & cpu["name"].str.startswith("ProfilerStep#")]
        if len(ps):
            n = ps["name"].str.extract(r"#\s*(\d+)")[0].astype("int64").to_numpy()
            if step_offset is not None:
                n = n - n.min() + step_offset
            start = _to_ns(ps["ts"], base)
            steps = pd.DataFrame({"rank": rank, "step": n, "start_ns": start,
                                  "end_ns": start + _to_ns(ps["dur"], 0)}).sort_values("start_ns")

    # kernel spans
    spans = []
    if len(kern):
        ks = _to_ns(kern["ts"], base)
        spans.append(pd.DataFrame({
            "rank": rank, "step": _assign_step(ks, steps), "kind": _labels("kernel", len(kern)),
            "name": pd.Categorical(kern["name"]), "start_ns": ks, "end_ns": ks + _to_ns(kern["dur"], 0),
            "lane": _labels("cuda:", kern["stream"]), "source": _labels("kineto", len(kern)),
            "launch_ns": _launch_ns(kern, parsed["launch"], base)}))
    # user annotations on the CPU
    if len(cpu):
        ua = cpu[(cpu["cat"] == "user_annotation") & ~cpu["name"].str.startswith(("ProfilerStep#", "gloo:", "nccl:"))]
        if len(ua):
            us = _to_ns(ua["ts"], base)
            spans.append(pd.DataFrame({
                "rank": rank, "step": _assign_step(us, steps), "kind": _labels("user", len(ua)),
                "name": pd.Categorical(ua["name"]), "start_ns": us, "end_ns": us + _to_ns(ua["dur"], 0),
                "lane": _labels("cpu:", ua["tid"]), "source": _labels("kineto", len(ua))}))
    spans = pd.concat(spans, ignore_index=True) if spans else pd.DataFrame()

    group0, size0 = _default_group(ident["groups"])
    colls = [_nccl_collectives(kern, cpu, base, rank)]
    if colls[0] is None:  # with NCCL kernels the c10d calls are the same collectives again
        colls = [_gloo_collectives(cpu, base, rank, group0, size0, events)]
    colls = [c for c in colls if c is not None and len(c)]
    coll = pd.concat(colls, ignore_index=True) if colls else pd.DataFrame()
    if len(coll):
        coll["step"] = _assign_step(coll["issue_ns"].to_numpy(), steps).to_numpy()
        coll = coll.sort_values("issue_ns", kind="stable").reset_index(drop=True)
        counted = coll["seq"].isna()
        coll.loc[counted, "seq"] = coll[counted].groupby("group", sort=False).cumcount()
        coll["source"] = "kineto"

    groups = pd.DataFrame({
        "rank": rank, "group": [str(g.get("pg_name", "")) for g in ident["groups"]],
        "ranks": [",".join(str(r) for r in (g.get("ranks") or [])) for g in ident["groups"]],
        "size": [int(g.get("pg_size") or len(g.get("ranks") or [])) for g in ident["groups"]],
        "backend": [str(g.get("backend_config", ident["backend"])) for g in ident["groups"]],
        "desc": [str(g.get("pg_desc", "")) for g in ident["groups"]], "mesh_dim": ""})

    props = (meta.get("deviceProperties") or [{}])[0] if len(kern) else {}
    cpu_pid = next(iter(parsed["pids"]), None)
    if cpu_pid is None and len(cpu):
        cpu_pid = cpu["pid"].iloc[0]
    ranks = pd.DataFrame([{
        "rank": rank, "local_rank": -1, "world_size": ident["world_size"], "node_rank": None,
        "host": str(meta.get("host_name") or ""), "pid": int(cpu_pid or 0),
        "device_type": "cuda" if len(kern) else "cpu", "device_index": props.get("id"),
        "device_name": props.get("name", "cpu" if not len(kern) else ""), "device_uuid": "",
        "device_mem_total_bytes": props.get("totalGlobalMem"), "backend": ident["backend"]}])
    t0 = int(spans["start_ns"].min()) if len(spans) else (int(steps["start_ns"].min()) if len(steps) else base)
    summary = _import_line(parsed, rank, steps, spans, coll,
                           wall_clock=bool(meta.get("baseTimeNanoseconds")) and shift_ns == 0)
    events_df = pd.DataFrame({"rank": rank, "host": ranks["host"].iloc[0], "t_ns": t0,
                              "level": ["warning"] * len(events) + ["info"], "source": "kineto",
                              "message": events + [summary]})
    return {"ranks": ranks, "steps": steps, "spans": spans, "collectives": coll, "groups": groups,
            "events": events_df}


def _import_line(parsed: dict, rank: int, steps: pd.DataFrame, spans: pd.DataFrame, coll: pd.DataFrame,
                 wall_clock: bool) -> str:
    """What one file became, in one line: rank, steps, the rows kept by kind and the time window they cover."""
    kinds = spans["kind"].value_counts() if len(spans) else pd.Series(dtype="int64")
    step_text = (f"steps {int(steps['step'].min())}-{int(steps['step'].max())} ({len(steps)} ProfilerSteps)"
                 if len(steps) else "no ProfilerStep")
    times = [t for t in (spans, steps) if len(t)]
    if times:
        lo = min(int(t["start_ns"].min()) for t in times)
        hi = max(int(t["end_ns"].max()) for t in times)
        clock = " from " + pd.Timestamp(lo, unit="ns").strftime("%Y-%m-%d %H:%M:%S UTC") if wall_clock else ""
        window = f"window {(hi - lo) / 1e9:.3f} s{clock}"
    else:
        window = "no timed rows"
    return (f"{parsed['path'].name}: rank {rank}, {step_text}; kept {int(kinds.get('kernel', 0))} GPU kernels "
            f"(incl. memcpy/memset), {len(coll)} collectives, {int(kinds.get('user', 0))} annotations; {window}; "
            f"{parsed['other']} of {parsed['n_events']} events not represented (CPU ops, runtime calls, flows)")


def _nccl_collectives(kern: pd.DataFrame, cpu: pd.DataFrame, base: int, rank: int):
    if not len(kern) or kern["coll"].isna().all():
        return None
    k = kern[kern["coll"].notna()].copy()
    start = _to_ns(k["ts"], base)
    dur = _to_ns(k["dur"], 0)
    dt = k["dtype"].astype(str).str.lower().map(lambda s: _DTYPE.get(s, (s, 0)))  # per unique-ish value, few rows
    size = dt.str[1].astype("int64").to_numpy()
    out = pd.DataFrame({
        "rank": rank, "op": k["coll"].map(_op_key).to_numpy(), "api": k["coll"].astype(str).to_numpy(),
        "group": k["group"].fillna("").astype(str).to_numpy(),
        "group_size": pd.to_numeric(k["group_size"], errors="coerce").fillna(0).astype("int64").to_numpy(),
        "seq": pd.to_numeric(k["seq"], errors="coerce").astype("Int64").to_numpy(),
        "in_bytes": pd.to_numeric(k["in_nelems"], errors="coerce").fillna(0).astype("int64").to_numpy() * size,
        "out_bytes": pd.to_numeric(k["out_nelems"], errors="coerce").fillna(0).astype("int64").to_numpy() * size,
        "dtype": dt.str[0].to_numpy(), "async_op": True,
        "issue_ns": start, "return_ns": start, "end_ns": start + dur, "gpu_duration_ns": dur,
        "ext": k["ext"].to_numpy()})
    if len(cpu):  # the launching record_param_comms op gives the CPU issue/return times
        rp = cpu[cpu["name"] == "record_param_comms"]
        rp = pd.DataFrame({"ext": rp["ext"].to_numpy(), "c_ts": _to_ns(rp["ts"], base),
                           "c_end": _to_ns(rp["ts"], base) + _to_ns(rp["dur"], 0)}).drop_duplicates("ext")
        out = out.merge(rp, on="ext", how="left")
        has = out["c_ts"].notna()
        out.loc[has, "issue_ns"] = out.loc[has, "c_ts"].astype("int64")
        out.loc[has, "return_ns"] = out.loc[has, "c_end"].astype("int64")
    return out.drop(columns=[c for c in ("ext", "c_ts", "c_end") if c in out.columns])


def _gloo_collectives(cpu: pd.DataFrame, base: int, rank: int, group0: str, size0: int, events: list):
    """c10d::* calls matched to gloo:* runs (first gloo run of the same op starting at or after the call)."""
    if not len(cpu):
        return None
    calls = cpu[(cpu["cat"] == "cpu_op") & cpu["name"].str.startswith("c10d::")].copy()
    runs = cpu[(cpu["cat"] == "user_annotation") & cpu["name"].str.startswith("gloo:")].copy()
    if not len(calls) and not len(runs):
        return None
    for df in (calls, runs):
        df["op"] = df["name"].map(_op_key)
        df["t"] = _to_ns(df["ts"], base)
        df["t_end"] = df["t"] + _to_ns(df["dur"], 0)
    runs["run_id"] = np.arange(len(runs), dtype=float)
    calls = calls.sort_values("t")
    runs = runs.sort_values("t")
    m = pd.merge_asof(calls, runs[["t", "op", "t_end", "run_id", "dims", "types"]].rename(
        columns={"t": "r_t", "t_end": "r_end", "dims": "r_dims", "types": "r_types"}),
        left_on="t", right_on="r_t", by="op", direction="forward")
    dup = m["run_id"].notna() & m["run_id"].duplicated()
    m.loc[dup, ["r_t", "r_end", "run_id"]] = np.nan
    unmatched_runs = runs[~runs["run_id"].isin(m["run_id"].dropna())]
    if len(unmatched_runs):
        events.append(f"{len(unmatched_runs)} gloo run(s) without a c10d call in the trace (e.g. DDP's C++ "
                      f"reducer) imported with issue = start of the gloo run")
    rows = pd.concat([
        pd.DataFrame({"op": m["op"], "api": m["name"].str.replace("c10d::", "", regex=False),
                      "issue_ns": m["t"], "return_ns": m["t_end"],
                      "end_ns": m["r_end"].where(m["r_end"].notna(), m["t_end"]),
                      # the gloo run's shapes name the tensor; the c10d op's first input is a TensorList
                      "dims": m["r_dims"].where(m["r_dims"].notna(), m["dims"]),
                      "types": m["r_types"].where(m["r_types"].notna(), m["types"])}),
        pd.DataFrame({"op": unmatched_runs["op"], "api": unmatched_runs["name"], "issue_ns": unmatched_runs["t"],
                      "return_ns": unmatched_runs["t"], "end_ns": unmatched_runs["t_end"],
                      "dims": unmatched_runs["dims"], "types": unmatched_runs["types"]}),
    ], ignore_index=True)
    sizes = [_bytes_of(d, t) for d, t in zip(rows["dims"], rows["types"])]  # a few per step: not per span
    rows["in_bytes"] = [s[0] for s in sizes]
    rows["out_bytes"] = rows["in_bytes"]
    rows["dtype"] = [s[1] for s in sizes]
    rows["rank"], rows["group"], rows["group_size"], rows["async_op"] = rank, group0, size0, False
    rows["seq"] = pd.array([None] * len(rows), dtype="Int64")
    rows["end_ns"] = rows["end_ns"].astype("int64")
    return rows.drop(columns=["dims", "types"])


# ---------------------------------------------------------------- import and merge

def check_times(parsed: dict) -> None:
    """Refuse a trace whose kept events have times that cannot be true (absent, not numbers, NaN, inf, negative
    ts or dur, or beyond int64 nanoseconds): imported, they would become spans ending anywhere."""
    path = parsed["path"]
    for kind in ("kernels", "cpu"):
        df = parsed[kind]
        for c in ("ts", "dur"):
            if not len(df) or c not in df:
                continue
            v = pd.to_numeric(df[c], errors="coerce").to_numpy("float64")
            bad = ~np.isfinite(v) | (v < 0) | (v * 1000 >= 2.0**62)
            if bad.any():
                raise KinetoError(f"{path}: {int(bad.sum())} event(s) with an impossible {c} (missing, not a "
                                  f"number, NaN, inf, negative or too large; e.g. {df[c][bad].iloc[0]!r})")


def _load_one(f: Path, single: bool):
    """One file -> (parsed counts, identity, tables), or the KinetoError's message (picklable for a worker)."""
    try:
        parsed = parse_trace(f)
        check_times(parsed)
        ident = trace_identity(parsed, single=single)
        tables = rank_tables(parsed, ident)
    except KinetoError as e:
        return str(e)
    except RecursionError:
        return f"{f}: JSON nested too deeply (not a torch.profiler trace?)"
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as e:
        return f"{f}: unexpected trace content ({type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''})"
    parsed["kernels"] = parsed["cpu"] = parsed["launch"] = None
    return parsed, ident, tables


def _workers(n_files: int) -> int:
    """Processes to parse with: one per file up to the CPUs this process may use (1: parse here)."""
    import os
    import sys

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n_files, cpus)) if sys.platform == "linux" else 1


def load_traces(paths: list, warn=lambda msg: None, info=lambda msg: None) -> tuple[list, list[str]]:
    """Parse every trace file (directories are searched for *.json and *.json.gz) into its rank's tables:
    [(parsed, identity, tables)] and the skipped files' messages. ``parsed`` keeps the path and counts only: each
    file's columns are turned into tables and dropped at once (peak memory is one file's per process).

    Files are parsed in parallel, one forked worker process per CPU (as HolisticTraceAnalysis does), each sending
    back only its rank's tables. ``info`` gets one line per imported file (what it became), ``warn`` one per
    skipped file (why); mixed jobs and duplicate ranks raise KinetoError, as does a set where nothing imports."""
    files, ignored = [], 0
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file())
            files += [f for f in found if f.name.endswith((".json", ".json.gz"))]
            ignored += len(found) - len([f for f in found if f.name.endswith((".json", ".json.gz"))])
        else:
            files.append(p)
    if not files:
        raise KinetoError(f"{', '.join(map(str, paths))}: no .json or .json.gz trace files")
    info(f"reading {len(files)} trace file(s)"
         + (f" ({ignored} other file(s) in the folder(s) ignored: not .json/.json.gz)" if ignored else ""))
    single = len(files) == 1
    n = _workers(len(files))
    if n > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork"))
        try:
            results = pool.map(_load_one, files, [single] * len(files))
            # what writing the run needs, imported while the workers parse
            import pyarrow.parquet  # noqa: F401

            import dtprof.rundir.run  # noqa: F401
            results = list(results)
        finally:   # the results are here: not waiting for the workers to exit (freeing their memory) saves 15 ms
            pool.shutdown(wait=False, cancel_futures=True)
    else:
        results = [_load_one(f, single) for f in files]
    out, failed = [], []
    for r in results:
        (failed if isinstance(r, str) else out).append(r)
    if not out:
        raise KinetoError(failed[0] if len(failed) == 1 else f"no trace could be imported: {'; '.join(failed)}")
    worlds = {i["world_size"] for _, i, _ in out}
    if len(worlds) > 1:
        raise KinetoError("traces come from different jobs (world sizes " + ", ".join(
            f"{p['path'].name}={i['world_size']}" for p, i, _ in out) + "); import each job's files separately")
    seen: dict[int, Path] = {}
    for p, i, _ in out:
        if i["rank"] in seen:
            raise KinetoError(f"{p['path']}: duplicate rank {i['rank']} (also in {seen[i['rank']]})")
        seen[i["rank"]] = p["path"]
    for msg in failed:
        warn(f"skipped {msg}")
    for _, i, t in out:
        for w in i["warnings"]:
            warn(w)
        info(t["events"]["message"].iloc[-1])
    return out, failed


def _concat(tables: list[dict]) -> dict:
    keys = {k for t in tables for k in t}
    return {k: pd.concat([t[k] for t in tables if k in t and len(t[k])], ignore_index=True)
            if any(k in t and len(t[k]) for t in tables) else pd.DataFrame() for k in keys}


def import_kineto(paths: list, out_dir: Path, command: str = "", warn=lambda msg: None,
                  info=lambda msg: None) -> Path:
    """``dtprof import kineto``: trace files of one job -> a new run directory. Returns the run directory.
    ``info``/``warn``: see ``load_traces``."""
    import socket
    import time

    from dtprof.rundir.writer import create_node_dir, create_run_dir, write_node_tables

    loaded, failed = load_traces(paths, warn, info)
    tables = _concat([t for _, _, t in loaded])
    for _, _, t in loaded:  # the concatenated copies are all that is needed from here on
        t.clear()
    tables["events"] = pd.concat([tables["events"], pd.DataFrame({
        "rank": -1, "host": "", "t_ns": 0, "level": "warning", "source": "kineto", "message": failed})],
        ignore_index=True) if failed else tables["events"]
    # No monotonic clock exists for an imported trace: its time base is the trace's wall clock.
    r = tables["ranks"]
    tables["clock"] = pd.DataFrame({"rank": r["rank"], "host": r["host"], "mono_ns": 0, "wall_ns": 0})
    world = int(r["world_size"].max())
    run_dir = create_run_dir(Path(out_dir), {"source": "kineto-import", "command": command,
                                             "created_wall_ns": time.time_ns(), "world_size": world,
                                             "time_base": "wall_clock"})
    node_dir = create_node_dir(run_dir, host="import")
    write_node_tables(node_dir, tables, {"command": command, "host": socket.gethostname(), "status": "imported",
                                         "imported_files": [str(p["path"]) for p, _, _ in loaded],
                                         "skipped_files": failed, "time_base": "wall_clock"})
    return run_dir


CAPTURE_DIR = "kineto"
CAPTURE_META = "capture.json"


def merge_captured_traces(node_dir: Path) -> int:
    """Append the rows of every trace TraceCapture left in ``node_dir/rank-*/kineto/`` to that rank's JSON-lines
    tables, shifted onto the rank's CLOCK_MONOTONIC; returns the number of traces merged.

    Steps are not duplicated (the hooks wrote them); spans and collectives come in with source "kineto". A trace
    that cannot be read, or an error TraceCapture recorded, becomes an ``events`` row: the job's own rows are never
    touched.
    """
    from dtprof.rundir.schema import columns
    from dtprof.rundir.writer import RankWriter

    merged = 0
    for cdir in sorted(Path(node_dir).glob(f"rank-*/{CAPTURE_DIR}")):
        rank = int(cdir.parent.name.split("-", 1)[1])
        writer = RankWriter(Path(node_dir), rank)
        notes = []
        try:
            err = cdir / "error.txt"
            if err.exists():
                notes.append(("warning", f"trace capture disabled itself: {err.read_text().strip()}"))
            meta_p = cdir / CAPTURE_META
            if meta_p.exists():
                cap = json.loads(meta_p.read_text())
                parsed = parse_trace(cdir / cap["trace"])
                ident = trace_identity(parsed, single=True)
                ident["rank"] = rank
                t = rank_tables(parsed, ident, shift_ns=int(cap["mono_ns"]) - int(cap["wall_ns"]),
                                step_offset=int(cap["start_step"]))
                from dtprof.rundir.conform import conform
                for table in ("spans", "collectives"):
                    df = conform(table, t[table])
                    if len(df):
                        rows = df.astype(object).where(df.notna(), None).to_numpy().tolist()
                        writer.extend(table, rows)
                notes.append(("info", t["events"]["message"].iloc[-1]))
                merged += 1
        except (KinetoError, OSError, ValueError, KeyError) as e:
            notes.append(("error", f"captured trace not merged: {str(e).splitlines()[0]}"))
        import time
        for level, msg in notes:
            writer.append("events", [rank, "", time.monotonic_ns(), level, "kineto", msg])
        writer.close()
        _ = columns
    return merged
