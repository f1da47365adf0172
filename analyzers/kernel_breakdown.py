"""What the GPU did, from kernel spans (traces): GPU time per rank, top kernels, kernel-level comm/compute overlap.

HolisticTraceAnalysis' definitions (HTA 0.5/0.6 ``hta/analyzers/breakdown_analysis.py``, ``hta/utils/utils.py``;
docs/metrics.md "GPU time" cites them):
- kernel classes by name: analyzers/kernels.py (communication, memory, computation, other), the one definition
  shared with the overlap analyzer.
- kernel time = last kernel end − first kernel start; idle = kernel time − |union of all kernels|;
  compute = |union of computation kernels|; non-compute = kernel time − compute − idle. Shares of kernel time.
- idle causes, per CUDA stream, for the gap before each kernel after the stream's first: host wait when the
  kernel's CPU launch started after the previous kernel on that stream ended; kernel wait when not host wait and
  the gap is under ``KERNEL_WAIT_NS`` (HTA's ``consecutive_kernel_delay`` = 30 in trace units, µs); other
  otherwise. Summed over streams, given as shares of that summed idle time.
- overlap = |merged compute ∩ merged comm| ÷ |merged comm| per rank (NaN without comm kernels).

dtprof's additions (docs/metrics.md "Why the GPU is slow"):
- ``class_frac``: per class of analyzers/kernels.py ``kernel_class`` (matmul, attention, elementwise_norm,
  communication, memory, other), |union of its kernels| ÷ kernel time; with ``idle_frac`` it answers where the
  GPU's time went (classes on concurrent streams overlap, so the shares can sum past 1).
- ``launch_idle_frac``: the idle stretches of the rank (no kernel on any stream) after which the next kernel was
  launched by the host (its CPU launch) only after the GPU had gone idle, summed ÷ kernel time: the GPU waiting
  for the host to launch work (launch-bound). None without launch times.
- ``kernels_per_step``: kernels ÷ the steps they ran in; ``median_kernel_s``: the median kernel duration.
- ``misaligned_matmul_frac``: |union of the tensor-core GEMMs built for misaligned operands| (kernels.py
  ``misaligned_matmul``) ÷ kernel time.
- ``step_idle_frac`` and ``launch_idle_step_frac``: the same two idle figures for an ordinary step. The profiler
  slows the host in the steps it traces, so their gaps overstate a host-bound job's (41 % against at most 28 % on
  the compiled GPT-2 in tests/data/gpu). Kernel durations stay as they are, so an ordinary step (the median of the
  rank's timed steps outside the window, ``typical_step_s``) idles at most that step less the kernels' busy time
  per traced step; ``launch_idle_step_frac`` is the traced steps' launch gaps per step, capped by that, ÷ the
  ordinary step. None without such steps (an imported trace has only traced ones).

Windows (``window=``): "all" (dtprof's default: every kernel span of the rank, the last step included because
it is real work) or "hta": kernels launched before the start of the rank's last ProfilerStep, as HTA filters
(a kernel without a recorded launch is dropped, as HTA's join on the correlation id drops it; on a run without
launch times the kernel's own start is used). Pure vectorised pandas/numpy over ``spans``.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from dtprof.analyzers.kernels import KERNEL_CLASSES, kernel_category, kernel_class, misaligned_matmul

KERNEL_WAIT_NS = 30_000
WINDOWS = ("all", "hta")
TOP_KERNELS = 20


def _union(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals as sorted, disjoint [start, end) arrays."""
    s, e, _ = _union_first(start, end)
    return s, e


def _covered(start: np.ndarray, end: np.ndarray) -> int:
    """|union of the intervals| (ns)."""
    s, e = _union(start, end)
    return int((e - s).sum())


def _union_first(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_union`` and, per merged interval, the input interval that opens it (its index)."""
    if not len(start):
        return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64)
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    prev_end = np.maximum.accumulate(e)
    new = np.ones(len(s), bool)
    new[1:] = s[1:] > prev_end[:-1]
    idx = np.flatnonzero(new)
    return s[idx], np.maximum.reduceat(e, idx), order[idx]


def _launch_idle_ns(s: np.ndarray, e: np.ndarray, launch: np.ndarray) -> int | None:
    """The rank's idle stretches whose next kernel the host launched after the GPU went idle, summed (ns); None
    when no kernel has a launch time."""
    if np.isnan(launch).all():
        return None
    us, ue, first = _union_first(s, e)
    gap = us[1:] - ue[:-1]
    late = launch[first[1:]] > ue[:-1]   # NaN (launch unknown) compares False: not counted
    return int(gap[late].sum())


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
    if window not in WINDOWS:
        raise ValueError(f"window must be one of {WINDOWS}, not {window!r}")
    cols = ["rank", "name", "start_ns", "end_ns", "lane", "step"] + (["launch_ns"] if "launch_ns" in spans else [])
    k = spans[spans["kind"] == "kernel"][cols]
    if "launch_ns" not in k:
        k = k.assign(launch_ns=pd.array([None] * len(k), dtype="Int64"))
    if window == "hta" and steps is not None and len(steps):
        last = k["rank"].map(steps.groupby("rank")["start_ns"].max()).astype("Float64").fillna(np.inf).to_numpy()
        has_launch = k.groupby("rank")["launch_ns"].transform(lambda s: s.notna().any()).to_numpy(bool)
        t = np.where(has_launch, k["launch_ns"].astype("Float64").fillna(np.inf).to_numpy(float),
                     k["start_ns"].to_numpy(float))
        k = k[t < last]
    return k.assign(category=kernel_category(k["name"]), kernel_class=kernel_class(k["name"]),
                    misaligned=misaligned_matmul(k["name"]))


def _idle_causes(g: pd.DataFrame) -> dict:
    """HTA's idle time breakdown of one rank's kernels: per stream, summed; shares of the summed idle time."""
    g = g.sort_values(["lane", "start_ns"], kind="stable")
    prev_end = g.groupby("lane", observed=True)["end_ns"].shift(1)
    gap = (g["start_ns"] - prev_end).to_numpy(float)
    launch = g["launch_ns"].astype("Float64").to_numpy(float, na_value=np.nan)
    has = ~np.isnan(gap)
    host = has & (launch > prev_end.to_numpy(float))
    kernel = has & ~host & (gap < KERNEL_WAIT_NS)
    other = has & ~host & ~kernel
    total = float(np.nansum(gap[has]))
    sums = {"host_wait": float(gap[host].sum()), "kernel_wait": float(gap[kernel].sum()),
            "other": float(gap[other].sum())}
    return {k: (v / total if total else None) for k, v in sums.items()} | {
        "stream_idle_s": total / 1e9, "launch_known_frac": float(g["launch_ns"].notna().mean()) if len(g) else None}


def _rank_time(g: pd.DataFrame) -> dict:
    s, e = g["start_ns"].to_numpy(np.int64), g["end_ns"].to_numpy(np.int64)
    cat = g["category"].to_numpy()
    us, ue = _union(s, e)
    kernel_time = int(ue.max() - us.min()) if len(us) else 0
    busy = int((ue - us).sum())
    parts = {c: _union(s[cat == c], e[cat == c]) for c in ("computation", "communication", "memory")}
    length = {c: int((pe - ps).sum()) for c, (ps, pe) in parts.items()}
    cs, ce = parts["computation"]
    ms, me = parts["communication"]
    idle = kernel_time - busy
    frac = (lambda x: x / kernel_time) if kernel_time else (lambda x: None)
    cls = g["kernel_class"].to_numpy()
    class_frac = {c: frac(_covered(s[cls == c], e[cls == c])) for c in KERNEL_CLASSES}
    mis = g["misaligned"].to_numpy(bool)
    launch_idle = _launch_idle_ns(s, e, g["launch_ns"].astype("Float64").to_numpy(float, na_value=np.nan))
    return {"class_frac": class_frac, "launch_idle_frac": None if launch_idle is None else frac(launch_idle),
            "misaligned_matmul_frac": frac(_covered(s[mis], e[mis])),
            "median_kernel_s": float(np.median(e - s)) / 1e9 if len(s) else None,
            "kernel_time_s": kernel_time / 1e9, "idle_frac": frac(idle), "compute_frac": frac(length["computation"]),
            "non_compute_frac": frac(kernel_time - length["computation"] - idle),
            "comm_frac": frac(length["communication"]), "memory_frac": frac(length["memory"]),
            "comm_compute_overlap_frac": (_intersection_length(ms, me, cs, ce) / length["communication"]
                                          if length["communication"] else None),
            "start_ns": int(us.min()) if len(us) else None, "end_ns": int(ue.max()) if len(ue) else None}


def _timed_steps(steps: pd.DataFrame | None) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """rank -> (step, duration_s) of its timed steps (neither warm-up nor traced nor FLOP-counted), grouped once."""
    if steps is None or "timed" not in steps or "duration_s" not in steps:
        return {}
    timed = steps["timed"].to_numpy(bool)   # the three columns read, not the whole frame (16.4 M rank-steps)
    step, dur = steps["step"].to_numpy(np.int64)[timed], steps["duration_s"].to_numpy(float)[timed]
    rank = steps["rank"].to_numpy(np.int64)[timed]
    return {int(r): (step[i], dur[i]) for r, i in pd.Series(rank).groupby(rank).indices.items()}


def _typical_step(timed: tuple[np.ndarray, np.ndarray] | None, traced: list[int]) -> float | None:
    """The median duration (s) of a rank's ordinary steps: timed and without kernels in the window. None without
    one (an imported trace: every step is a traced one)."""
    if timed is None:
        return None
    step, dur = timed
    d = dur[~np.isin(step, traced)]
    return float(np.median(d)) if len(d) else None


def _per_ordinary_step(t: dict, n_steps: int, typical: float | None) -> dict:
    """``step_idle_frac``, ``launch_idle_step_frac`` and ``typical_step_s`` (module docstring)."""
    if not (typical and n_steps and t["kernel_time_s"] and t["idle_frac"] is not None):
        return {"step_idle_frac": None, "launch_idle_step_frac": None, "typical_step_s": typical}
    busy = t["kernel_time_s"] * (1 - t["idle_frac"]) / n_steps
    idle = max(0.0, typical - busy)
    launch = None if t["launch_idle_frac"] is None else \
        min(t["launch_idle_frac"] * t["kernel_time_s"] / n_steps, idle) / typical
    return {"step_idle_frac": idle / typical, "launch_idle_step_frac": launch, "typical_step_s": typical}


def gpu_time(spans: pd.DataFrame, steps: pd.DataFrame | None = None, window: str = "all") -> dict:
    """rank -> ``gpu_time`` dict (docs/summary-schema.md) for every rank with kernel spans."""
    k = _kernels(spans, steps, window)
    timed = _timed_steps(steps) if len(k) else {}   # a run without kernel spans has no gpu_time to type
    out = {}
    for rank, g in k.groupby("rank", sort=True):
        t = _rank_time(g)
        counted_steps = sorted(int(x) for x in g["step"].dropna().unique())
        out[int(rank)] = {
            **_per_ordinary_step(t, len(counted_steps), _typical_step(timed.get(int(rank)), counted_steps)),
            "idle_frac": t["idle_frac"], "compute_frac": t["compute_frac"],
            "non_compute_frac": t["non_compute_frac"], "comm_frac": t["comm_frac"],
            "memory_frac": t["memory_frac"], "comm_compute_overlap_frac": t["comm_compute_overlap_frac"],
            "kernel_time_s": t["kernel_time_s"], "class_frac": t["class_frac"],
            "launch_idle_frac": t["launch_idle_frac"], "median_kernel_s": t["median_kernel_s"],
            "misaligned_matmul_frac": t["misaligned_matmul_frac"],
            "kernels_per_step": len(g) / len(counted_steps) if counted_steps else None,
            "window": {"name": window, "steps": counted_steps, "kernels": int(len(g)),
                       "streams": sorted(str(x) for x in g["lane"].unique()),
                       "start_ns": t["start_ns"], "end_ns": t["end_ns"],
                       "rule": ("every kernel span of the rank" if window == "all" else
                                "kernels launched before the rank's last ProfilerStep starts (HTA)")},
            "idle_causes": _idle_causes(g)}
    return out


def top_kernels(spans: pd.DataFrame, n: int = TOP_KERNELS) -> list[dict]:
    """The ``n`` kernels with the most total time over all ranks, descending: name, category, count, time_s,
    share (of all kernel time summed, not of wall time), mean_s."""
    k = spans[spans["kind"] == "kernel"]
    if not len(k):
        return []
    d = pd.DataFrame({"name": k["name"].astype(str).to_numpy(),
                      "dur": (k["end_ns"] - k["start_ns"]).to_numpy(np.int64)})
    agg = d.groupby("name", sort=False)["dur"].agg(["count", "sum"]).sort_values(
        ["sum", "count"], ascending=[False, False], kind="stable").head(n)
    total = int(d["dur"].sum())
    cat = kernel_category(pd.Series(agg.index))
    cls = kernel_class(pd.Series(agg.index))
    return [{"name": name, "category": str(c), "class": str(k), "count": int(r["count"]),
             "time_s": int(r["sum"]) / 1e9, "share": int(r["sum"]) / total if total else None,
             "mean_s": int(r["sum"]) / int(r["count"]) / 1e9}
            for (name, r), c, k in zip(agg.iterrows(), cat, cls)]


def _weighted(values: list, w: np.ndarray) -> float | None:
    """The ``w``-weighted mean of the known ``values`` (None where none is known)."""
    v = np.array([np.nan if x is None else x for x in values], float)
    ok = ~np.isnan(v) & (w > 0)
    return float(np.sum(v[ok] * w[ok]) / np.sum(w[ok])) if ok.any() else None


def job_gpu_time(per_rank: dict) -> dict | None:
    """The job's GPU time from ``gpu_time``'s per-rank dicts: shares weighted by each rank's kernel time, overlap by
    its communication time, idle causes by its summed stream idle time. None without kernel spans."""
    ranks = [g for g in per_rank.values() if g["kernel_time_s"]]
    if not ranks:
        return None
    kt = np.array([g["kernel_time_s"] for g in ranks])

    def mean(key, w):
        return _weighted([g[key] for g in ranks], w)

    comm_w = kt * np.array([g["comm_frac"] for g in ranks])
    idle_w = np.array([g["idle_causes"]["stream_idle_s"] for g in ranks])
    causes = {c: (float(np.sum(idle_w * [g["idle_causes"][c] or 0 for g in ranks]) / idle_w.sum())
                  if idle_w.sum() else None) for c in ("host_wait", "kernel_wait", "other")}
    return {**{k: mean(k, kt) for k in ("idle_frac", "compute_frac", "non_compute_frac", "comm_frac",
                                        "memory_frac", "launch_idle_frac", "median_kernel_s", "kernels_per_step",
                                        "step_idle_frac", "launch_idle_step_frac", "misaligned_matmul_frac")},
            "class_frac": {c: _weighted([g["class_frac"][c] for g in ranks], kt) for c in KERNEL_CLASSES},
            "comm_compute_overlap_frac": mean("comm_compute_overlap_frac", comm_w),
            "idle_causes": causes, "ranks": len(ranks), "window": ranks[0]["window"]["name"]}
