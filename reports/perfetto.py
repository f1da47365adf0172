"""A run as one Chrome JSON trace (loadable by Perfetto's UI / trace processor and chrome://tracing).

Layout: one process per rank ("rank N · host", pid = rank), one thread per lane (steps, each span lane such as
"main" or "cuda:7", collectives); GPU samples as counter tracks in one process per host ("GPUs · host"); every
collective instance seen on two or more ranks, i.e. the same (group, seq) and op, is chained across its ranks
with flow events (s → t … → f), lowest rank first.

Clock: every time is put on the reference host's clock through the run model (``RunModel.align``: each host's
offset + drift fitted on collective exits, analyzers/runmodel.py), the same alignment as the HTML report's
timeline, so a span sits at the same aligned time in both. Timestamps are written in µs from the run's first
aligned event (``otherData.t0_ns``, in the reference host's monotonic ns).
"""
from __future__ import annotations

import gzip
import json

import numpy as np
import pandas as pd

NVML_COUNTERS = ("sm_util_pct", "mem_bw_util_pct", "power_w", "temp_c", "sm_clock_mhz", "mem_used_bytes")
GPU_PID_BASE = 1_000_000


def _x_events(df: pd.DataFrame, pid, tid, name, start, end, t0, cat: str, args=None) -> list:
    ts = (start - t0) / 1000.0
    dur = np.maximum(end - start, 0) / 1000.0
    out = pd.DataFrame({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur})
    if args is not None:
        out["args"] = args
    return out.to_dict("records")


def render(analysis, options: dict | None = None) -> bytes:
    """The Chrome JSON trace of ``analysis``' run (``build_trace``), gzipped with ``options["gzip"]``."""
    data = json.dumps(build_trace(analysis), default=_clean, separators=(",", ":")).encode()
    return gzip.compress(data, 6) if (options or {}).get("gzip") else data


def build_trace(analysis) -> dict:
    """The Chrome trace dict of ``analysis.run`` (a dtprof.rundir.run.Run) on its run model's aligned clock
    (``analysis.model``: analyzers/runmodel.py ``RunModel``). ``analysis``: an ``Analysis``, or anything with its
    ``run`` and ``model`` (`dtprof export perfetto` needs only those)."""
    run, model = analysis.run, analysis.model
    host_of = run.ranks.set_index("rank")["host"].astype(str).to_dict() if len(run.ranks) else {}

    def aligned(t, ranks):
        return model.align(np.asarray(t, np.int64), np.asarray(ranks, np.int64))

    spans, steps, coll = run.spans, run.steps, model.collectives
    sp_start, sp_end = aligned(spans["start_ns"], spans["rank"]), aligned(spans["end_ns"], spans["rank"])
    st_start, st_end = aligned(steps["start_ns"], steps["rank"]), aligned(steps["end_ns"], steps["rank"])
    co_start, co_end = aligned(coll["issue_ns"], coll["rank"]), aligned(coll["exit_ns"], coll["rank"])
    starts = [a.min() for a in (sp_start, st_start, co_start) if len(a)]
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
        st_tid = [tid(r, "steps") for r in st["rank"]]
        events += _x_events(st, st["rank"].to_numpy(), st_tid, "step " + st["step"].astype(str), st_start,
                            st_end, t0, "step")
    if len(spans):
        lane = spans["lane"].astype(str).where(spans["lane"].astype(str) != "", "main")
        keys = pd.MultiIndex.from_arrays([spans["rank"], lane]).unique()
        for r, lane_name in keys:
            tid(r, lane_name)
        tids = [lanes[(r, lane_name)] for r, lane_name in zip(spans["rank"], lane)]
        events += _x_events(spans, spans["rank"].to_numpy(), tids, spans["name"].astype(str), sp_start, sp_end, t0,
                            "span", args=[{"kind": k, "source": s, "step": (None if pd.isna(x) else int(x))}
                                          for k, s, x in zip(spans["kind"], spans["source"], spans["step"])])
    if len(coll):
        c = coll.reset_index(drop=True)
        ctid = [tid(r, "collectives") for r in c["rank"]]
        start = co_start
        args = c[["op", "group", "seq", "in_bytes", "out_bytes", "dtype", "source"]].astype(object).to_dict("records")
        events += _x_events(c, c["rank"].to_numpy(), ctid, c["op"].astype(str), start, co_end, t0, "collective",
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
        ts = (model.align_host(nv["t_ns"].to_numpy(np.int64), nv["host"].astype(str).to_numpy()) - t0) / 1000.0
        for col in NVML_COUNTERS:
            v = nv[col]
            ok = v.notna().to_numpy()
            if not ok.any():
                continue
            events += pd.DataFrame({"ph": "C", "name": "gpu" + nv["gpu"].astype(str)[ok] + " " + col,
                                    "pid": pid[ok], "tid": 0, "ts": ts[ok],
                                    "args": [{col: float(x)} for x in v[ok]]}).to_dict("records")
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"dtprof_run": str(run.path), "t0_ns": t0,
                          "clock": "reference host's monotonic clock (offset + drift per host)"}}


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
