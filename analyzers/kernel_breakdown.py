"""Kernel-level temporal breakdown and comm/compute overlap, HolisticTraceAnalysis-compatible.

Definitions (docs/metrics.md, "Compute / communication overlap", HTA ``get_comm_comp_overlap``
and HTA's temporal breakdown):
- kernel classes by name: analyzers/kernels.py (communication, memory, computation), shared with the overlap
  analyzer.
- overlap = |merged compute ∩ merged comm| ÷ |merged comm| per rank (NaN without comm kernels).
- kernel time = last kernel end − first kernel start; idle = kernel time − |union of all kernels|;
  compute = |union of computation kernels|; non-compute = kernel time − compute − idle. Shares of kernel time.

Window (``window=``): "all" (every kernel span of the rank, dtprof's default) or "hta": kernels that start
before the start of the rank's last step, which is how HTA filters (it drops the last ProfilerStep; it selects by
the CPU launch time, which the run format does not keep, so a kernel launched in the next-to-last step but run
after the last step began is left out here and kept by HTA). Pure vectorised pandas/numpy over ``spans``.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from dtprof.analyzers.kernels import kernel_classes


def _union(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals as sorted, disjoint [start, end) arrays."""
    if not len(start):
        return np.empty(0, np.int64), np.empty(0, np.int64)
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    prev_end = np.maximum.accumulate(e)
    new = np.ones(len(s), bool)
    new[1:] = s[1:] > prev_end[:-1]
    idx = np.flatnonzero(new)
    return s[idx], np.maximum.reduceat(e, idx)


def _intersection_length(a_s, a_e, b_s, b_e) -> int:
    """|A ∩ B| for two disjoint sorted interval sets, by sweeping their boundaries."""
    t = np.concatenate([a_s, a_e, b_s, b_e])
    d = np.concatenate([np.ones(len(a_s)), -np.ones(len(a_e)), 2 * np.ones(len(b_s)), -2 * np.ones(len(b_e))])
    if not len(t):
        return 0
    order = np.lexsort((d, t))  # ends (negative) before starts at the same time
    t, level = t[order], np.cumsum(d[order])
    return int(np.sum(np.diff(t)[level[:-1] == 3]))


def _kernels(spans: pd.DataFrame, steps: pd.DataFrame | None, window: str) -> pd.DataFrame:
    k = spans[spans["kind"] == "kernel"][["rank", "name", "start_ns", "end_ns"]]
    if window == "hta" and steps is not None and len(steps):
        last = steps.groupby("rank")["start_ns"].max()
        k = k[k["start_ns"].to_numpy() < k["rank"].map(last).fillna(np.inf).to_numpy()]
    elif window not in ("all", "hta"):
        raise ValueError(f"window must be 'all' or 'hta', not {window!r}")
    comm, compute = kernel_classes(k["name"])
    return k.assign(comm=comm, compute=compute)


def kernel_breakdown(spans: pd.DataFrame, steps: pd.DataFrame | None = None, window: str = "all") -> pd.DataFrame:
    """Per rank: kernel_time_s, idle_frac, compute_frac, non_compute_frac, comm_compute_overlap_frac.

    One group per rank (ranks are few); inside, all interval work is vectorised.
    """
    k = _kernels(spans, steps, window)
    rows = []
    for rank, g in k.groupby("rank", sort=True):
        s, e = g["start_ns"].to_numpy(np.int64), g["end_ns"].to_numpy(np.int64)
        us, ue = _union(s, e)
        kernel_time = int(ue.max() - us.min()) if len(us) else 0
        busy = int((ue - us).sum())
        cs, ce = _union(s[g["compute"].to_numpy()], e[g["compute"].to_numpy()])
        ms, me = _union(s[g["comm"].to_numpy()], e[g["comm"].to_numpy()])
        compute = int((ce - cs).sum())
        comm = int((me - ms).sum())
        idle = kernel_time - busy
        rows.append({"rank": rank, "kernel_time_s": kernel_time / 1e9,
                     "idle_frac": idle / kernel_time if kernel_time else np.nan,
                     "compute_frac": compute / kernel_time if kernel_time else np.nan,
                     "non_compute_frac": (kernel_time - compute - idle) / kernel_time if kernel_time else np.nan,
                     "comm_compute_overlap_frac": _intersection_length(ms, me, cs, ce) / comm if comm else np.nan})
    return pd.DataFrame(rows, columns=["rank", "kernel_time_s", "idle_frac", "compute_frac", "non_compute_frac",
                                       "comm_compute_overlap_frac"])
