"""A run as one Chrome JSON trace (loadable by Perfetto's UI / trace processor and chrome://tracing).

Layout: one process per rank ("rank N · host", pid = rank), one thread per lane (steps, each span lane such as
"main" or "cuda:7", collectives); GPU samples as counter tracks in one process per host ("GPUs · host"); every
collective instance seen on two or more ranks, i.e. the same (group, seq) and op, is chained across its ranks
with flow events (s → t … → f), lowest rank first.

Clock: each host's CLOCK_MONOTONIC times are put on that host's wall clock through the median (wall − mono) of its
``clock`` rows, so several hosts line up to within NTP accuracy; one host (or an imported run, whose time base is
already the wall clock) is unchanged. Timestamps are written in µs from the run's first event.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pandas as pd

NVML_COUNTERS = ("sm_util_pct", "mem_bw_util_pct", "power_w", "temp_c", "sm_clock_mhz", "mem_used_bytes")
GPU_PID_BASE = 1_000_000


def _host_offsets(run) -> dict:
    c = run.clock
    if not len(c) or c["host"].astype(str).nunique() < 2:
        return {}
    d = (c["wall_ns"] - c["mono_ns"]).groupby(c["host"].astype(str), observed=True).median()
    return (d - d.min()).astype("int64").to_dict()


def _x_events(df: pd.DataFrame, pid, tid, name, start, end, t0, cat: str, args=None) -> list:
    ts = (start - t0) / 1000.0
    dur = np.maximum(end - start, 0) / 1000.0
    out = pd.DataFrame({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur})
    if args is not None:
        out["args"] = args
    return out.to_dict("records")


def build_trace(run) -> dict:
    """The Chrome trace dict for ``run`` (a dtprof.reader.Run)."""
    offsets = _host_offsets(run)
    host_of = run.ranks.set_index("rank")["host"].astype(str).to_dict() if len(run.ranks) else {}
    shift = lambda ranks: np.array([offsets.get(host_of.get(r, ""), 0) for r in ranks], dtype=np.int64)  # noqa

    spans, steps, coll = run.spans, run.steps, run.collectives
    starts = [s["start_ns"].min() for s in (spans, steps) if len(s)] + ([coll["issue_ns"].min()] if len(coll) else [])
    t0 = int(min(starts)) if starts else 0
    events: list = []
    ranks = sorted(set(run.ranks["rank"]) | set(spans["rank"]) | set(steps["rank"]) | set(coll["rank"]))
    lanes: dict = {}  # (rank, lane) -> tid

    def tid(rank, lane):
        return lanes.setdefault((rank, lane), len([k for k in lanes if k[0] == rank]) + 1)

    for r in ranks:
        events.append({"ph": "M", "name": "process_name", "pid": int(r), "tid": 0,
                       "args": {"name": f"rank {r}" + (f" · {host_of[r]}" if host_of.get(r) else "")}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": int(r), "tid": 0,
                       "args": {"sort_index": int(r)}})
    if len(steps):
        st = steps.assign(lane="steps")
        s0 = st["start_ns"].to_numpy() + shift(st["rank"])
        st_tid = [tid(r, "steps") for r in st["rank"]]
        events += _x_events(st, st["rank"].to_numpy(), st_tid, "step " + st["step"].astype(str), s0,
                            st["end_ns"].to_numpy() + shift(st["rank"]), t0, "step")
    if len(spans):
        lane = spans["lane"].astype(str).where(spans["lane"].astype(str) != "", "main")
        keys = pd.MultiIndex.from_arrays([spans["rank"], lane]).unique()
        for r, name in keys:
            tid(r, name)
        tids = [lanes[(r, name)] for r, name in zip(spans["rank"], lane)]
        sh = shift(spans["rank"])
        events += _x_events(spans, spans["rank"].to_numpy(), tids, spans["name"].astype(str),
                            spans["start_ns"].to_numpy() + sh, spans["end_ns"].to_numpy() + sh, t0,
                            "span", args=[{"kind": k, "source": s, "step": (None if pd.isna(x) else int(x))}
                                          for k, s, x in zip(spans["kind"], spans["source"], spans["step"])])
    if len(coll):
        c = coll.reset_index(drop=True)
        end = c["end_ns"].astype("float64").fillna(c["return_ns"].astype("float64")).to_numpy().astype(np.int64)
        sh = shift(c["rank"])
        ctid = [tid(r, "collectives") for r in c["rank"]]
        start = c["issue_ns"].to_numpy() + sh
        args = c[["op", "group", "seq", "in_bytes", "out_bytes", "dtype", "source"]].astype(object).to_dict("records")
        events += _x_events(c, c["rank"].to_numpy(), ctid, c["op"].astype(str), start, end + sh, t0, "collective",
                            args=args)
        # flows: one chain per (group, seq, op, source) seen on >= 2 ranks
        key = c[["group", "seq", "op", "source"]].astype(str).agg("|".join, axis=1)
        c = c.assign(key=key, ts=(start - t0) / 1000.0, tid=ctid).sort_values(["key", "rank"])
        n = c.groupby("key")["rank"].transform("size")
        c = c[n >= 2]
        if len(c):
            flow_id = c["key"].astype("category").cat.codes + 1
            first = ~c["key"].duplicated()
            last = ~c["key"].duplicated(keep="last")
            ph = np.where(first, "s", np.where(last, "f", "t"))
            fl = pd.DataFrame({"ph": ph, "cat": "collective", "name": c["op"].astype(str), "id": flow_id,
                               "pid": c["rank"], "tid": c["tid"], "ts": c["ts"], "bp": "e"})
            events += fl.to_dict("records")
    for (r, name), t in lanes.items():
        events.append({"ph": "M", "name": "thread_name", "pid": int(r), "tid": t, "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": int(r), "tid": t, "args": {"sort_index": t}})
    nv = run.nvml
    if len(nv):
        hosts = sorted(nv["host"].astype(str).unique())
        for i, h in enumerate(hosts):
            events.append({"ph": "M", "name": "process_name", "pid": GPU_PID_BASE + i, "tid": 0,
                           "args": {"name": f"GPUs · {h}"}})
        pid = nv["host"].astype(str).map({h: GPU_PID_BASE + i for i, h in enumerate(hosts)}).to_numpy()
        ts = (nv["t_ns"].to_numpy() + np.array([offsets.get(h, 0) for h in nv["host"].astype(str)]) - t0) / 1000.0
        for col in NVML_COUNTERS:
            v = nv[col]
            ok = v.notna().to_numpy()
            if not ok.any():
                continue
            events += pd.DataFrame({"ph": "C", "name": "gpu" + nv["gpu"].astype(str)[ok] + " " + col,
                                    "pid": pid[ok], "tid": 0, "ts": ts[ok],
                                    "args": [{col: float(x)} for x in v[ok]]}).to_dict("records")
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"dtprof_run": str(run.path), "t0_ns": t0, "clock": "per-host monotonic on wall clock"}}


def _clean(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (np.bool_,)):
        return bool(o)
    if o is pd.NA or o is None:
        return None
    return str(o)


def write_perfetto(run, out: Path) -> Path:
    """Write ``run`` as a Chrome JSON trace to ``out`` (gzip when it ends in .gz)."""
    out = Path(out)
    data = json.dumps(build_trace(run), default=_clean, separators=(",", ":")).encode()
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_bytes(gzip.compress(data, 6) if out.name.endswith(".gz") else data)
    tmp.replace(out)
    return out
