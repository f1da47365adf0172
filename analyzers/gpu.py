"""GPU utilisation and memory (NVML samples; docs/metrics.md has no formula beyond these definitions).

Per GPU (host, gpu index), over the **measured steps' window** of its host (``window`` "measured steps": from the
start of the first measured step to the end of the last of that host's ranks, in the host's own monotonic clock,
which the NVML sampler and the ranks share); over the whole sampled run where the host has no measured step
(``window`` "run": a job that failed or hung before its steps). A run's start-up (imports, CUDA and process-group
set-up, the FLOP-counted step) and its end (checkpointing, the job's exit) leave the GPU idle for seconds; over the
whole run a GPU that was 95 % busy in every step read as 7 % busy (the first real H200 run).
- each sample stands for the time since the previous sample of that GPU (NVML's utilisation is the share of its
  past sample period with a kernel running; the first sample stands for the median interval), weighted by how much
  of that period lies in the window; ``samples`` counts those with any;
- ``sm_util_mean_pct`` / ``mem_bw_util_mean_pct`` / ``power_w_mean`` / ``sm_clock_mhz_mean``: time-weighted means;
  ``temp_c_max`` / ``ecc_errors_max``: the largest of those samples;
- ``idle_frac``: fraction of the window's sampled time with SM utilisation below 5 %;
- ``throttled_s``: sampled time whose ``throttle_reasons`` (NVML clocksEventReasons) carry a slowdown bit --
  SW power cap 0x4, HW slowdown 0x8, SW thermal 0x20, HW thermal 0x40, HW power brake 0x80 (idle, application
  clock settings, sync boost and display clock bits are not throttling); ``sampled_s`` the window's sampled time.

Memory per rank: ``peak_mem_bytes`` is the maximum over the rank's steps (CUDA allocator peak on GPU, RSS on CPU);
headroom_frac = 1 - peak / device memory (``ranks.device_mem_total_bytes``, else NVML ``mem_total_bytes``).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

# NVML clocksEventReasons bits (nvml.h), named as NVML names them; the one table for naming a reasons bitmask.
CLOCK_EVENT_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
                       0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
                       0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}
THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80   # the reasons that slow the clocks down
THROTTLE_BITS = {b: n for b, n in CLOCK_EVENT_REASONS.items() if b & THROTTLE_MASK}
IDLE_PCT = 5.0

GPU_COLUMNS = ["host", "gpu", "uuid", "samples", "sm_util_mean_pct", "mem_bw_util_mean_pct", "idle_frac",
               "throttled_s", "throttled_frac", "throttle_reasons", "power_w_mean", "temp_c_max", "sm_clock_mhz_mean",
               "ecc_errors_max", "sampled_s", "window"]


def measured_windows(steps: pd.DataFrame, ranks: pd.DataFrame) -> dict[str, tuple[int, int]]:
    """host -> (first measured step's start, last measured step's end) of its ranks, in the host's monotonic ns
    (the run model's ``steps``: per rank-step ``start_ns``, ``end_ns``, ``measured``)."""
    m = steps[steps["measured"].to_numpy(bool)]
    if len(m) == 0:
        return {}
    host_of = pd.Series(ranks["host"].astype(str).to_numpy(), index=ranks["rank"].to_numpy(np.int64))
    host_of = host_of[~host_of.index.duplicated()]
    d = pd.DataFrame({"host": host_of.reindex(m["rank"].to_numpy(np.int64)).to_numpy(),
                      "start": m["start_ns"].to_numpy(np.int64), "end": m["end_ns"].to_numpy(np.int64)}).dropna()
    w = d.groupby("host").agg(start=("start", "min"), end=("end", "max"))
    return {str(h): (int(a), int(b)) for h, a, b in zip(w.index, w["start"], w["end"])}


def _weighted_mean(v: np.ndarray, w: np.ndarray) -> float:
    ok = ~np.isnan(v) & (w > 0)
    return float(np.sum(v[ok] * w[ok]) / np.sum(w[ok])) if ok.any() else float("nan")


def _max(v: np.ndarray) -> float:
    v = v[~np.isnan(v)]
    return float(v.max()) if len(v) else float("nan")


def gpu_stats(run, steps: pd.DataFrame) -> pd.DataFrame:
    """Per GPU, GPU_COLUMNS over its host's measured steps (module docstring); ``run`` has the ``nvml`` and
    ``ranks`` tables, ``steps`` is the run model's per rank-step table."""
    nv = run.nvml
    if len(nv) == 0:
        return pd.DataFrame(columns=GPU_COLUMNS)
    windows = measured_windows(steps, run.ranks)
    d = pd.DataFrame({"host": nv["host"].astype(str).to_numpy(), "gpu": nv["gpu"].to_numpy(np.int64),
                      "uuid": nv["uuid"].astype(str).to_numpy(), "t_ns": nv["t_ns"].to_numpy(np.int64)})
    for c in ("sm_util_pct", "mem_bw_util_pct", "power_w", "temp_c", "sm_clock_mhz"):
        d[c] = nv[c].to_numpy(float)
    d["reasons"] = nv["throttle_reasons"].astype("Int64").fillna(0).to_numpy(np.int64)
    d["ecc"] = nv["ecc_errors"].astype("float64").to_numpy()
    d = d.sort_values(["host", "gpu", "t_ns"], kind="stable").reset_index(drop=True)
    rows = []
    for (host, gpu), g in d.groupby(["host", "gpu"], sort=True):
        t = g["t_ns"].to_numpy(np.int64)
        dt = np.diff(t)
        first = float(np.median(dt)) if len(dt) else 0.0
        lo = np.concatenate([[t[0] - first], t[:-1]]).astype(float)   # each sample: the period since the last
        hi = t.astype(float)
        window = windows.get(str(host))
        if window is None:
            w = (hi - lo) / 1e9
        else:
            w = np.clip(np.minimum(hi, window[1]) - np.maximum(lo, window[0]), 0, None) / 1e9
        inside = w > 0
        sampled = float(w.sum())
        util = g["sm_util_pct"].to_numpy(float)
        idle = float(w[util < IDLE_PCT].sum())
        reasons = g["reasons"].to_numpy(np.int64)
        thr = float(w[(reasons & THROTTLE_MASK) != 0].sum())
        r_any = int(np.bitwise_or.reduce(reasons[inside])) if inside.any() else 0
        rows.append({
            "host": host, "gpu": int(gpu), "uuid": g["uuid"].iloc[0], "samples": int(inside.sum()),
            "sm_util_mean_pct": _weighted_mean(util, w),
            "mem_bw_util_mean_pct": _weighted_mean(g["mem_bw_util_pct"].to_numpy(float), w),
            "idle_frac": idle / sampled if sampled > 0 else float("nan"),
            "throttled_s": thr, "throttled_frac": thr / sampled if sampled > 0 else float("nan"),
            "throttle_reasons": ",".join(n for bit, n in THROTTLE_BITS.items() if r_any & bit),
            "power_w_mean": _weighted_mean(g["power_w"].to_numpy(float), w),
            "temp_c_max": _max(g["temp_c"].to_numpy(float)[inside]),
            "sm_clock_mhz_mean": _weighted_mean(g["sm_clock_mhz"].to_numpy(float), w),
            "ecc_errors_max": _max(g["ecc"].to_numpy(float)[inside]),
            "sampled_s": sampled, "window": "run" if window is None else "measured steps"})
    return pd.DataFrame(rows, columns=GPU_COLUMNS)


def _uuid_keys(uuids: pd.Series) -> pd.Series:
    """GPU uuids in one form for matching: torch names a device ``9150ffc6-...`` where NVML says
    ``GPU-9150ffc6-...`` (seen on an H200); empty -> None."""
    u = uuids.astype(str).str.lower().str.removeprefix("gpu-")
    return u.where(u != "", None)


def rank_gpu(run, gpus: pd.DataFrame) -> pd.DataFrame:
    """rank -> row of ``gpus`` (its GPU), matched by host + device uuid, else host + device_index; a rank without a
    device index (a CPU rank on a GPU host) maps to the GPU of its local rank, as torchrun assigns them. -1 if none."""
    r = run.ranks
    index = r["device_index"].astype("Int64").fillna(r["local_rank"].astype("Int64")).fillna(-1)
    out = pd.DataFrame({"rank": r["rank"].to_numpy(np.int64), "host": r["host"].astype(str).to_numpy(),
                        "device_index": index.to_numpy(np.int64),
                        "uuid": r["device_uuid"].astype(str).to_numpy()})
    if len(gpus) == 0:
        out["gpu_row"] = -1
        return out
    g = gpus.reset_index(drop=True)
    g_idx = pd.Series(np.arange(len(g)), index=pd.MultiIndex.from_arrays([g["host"], g["gpu"]]))
    by_index = g_idx.reindex(pd.MultiIndex.from_arrays([out["host"], out["device_index"]])).to_numpy()
    u_idx = pd.Series(np.arange(len(g)), index=_uuid_keys(g["uuid"]))
    u_idx = u_idx[u_idx.index.notna() & ~u_idx.index.duplicated()]
    by_uuid = u_idx.reindex(_uuid_keys(out["uuid"])).to_numpy()
    row = np.where(~np.isnan(by_uuid.astype(float)), by_uuid, by_index)
    out["gpu_row"] = np.nan_to_num(row.astype(float), nan=-1).astype(np.int64)
    return out


def memory(run, per_rank_steps: pd.DataFrame, gpus: pd.DataFrame) -> pd.DataFrame:
    r = run.ranks
    peak = per_rank_steps.groupby("rank")["peak_mem_bytes"].max()
    out = pd.DataFrame({"rank": r["rank"].to_numpy(np.int64)})
    out["peak_mem_bytes"] = peak.reindex(out["rank"]).astype("Float64").to_numpy()
    total = r["device_mem_total_bytes"].astype("Float64").to_numpy()
    if len(run.nvml):
        rg = rank_gpu(run, gpus)
        nv_tot = run.nvml.groupby(["host", "gpu"], observed=True)["mem_total_bytes"].max()
        g = gpus.reset_index(drop=True)
        gt = nv_tot.reindex(pd.MultiIndex.from_arrays([g["host"], g["gpu"]])).to_numpy(float)
        from_nvml = np.where(rg["gpu_row"].to_numpy() >= 0, gt[np.maximum(rg["gpu_row"].to_numpy(), 0)], np.nan)
        total = np.where(pd.isna(total), from_nvml, total)
    out["device_mem_total_bytes"] = pd.array(total, dtype="Float64")
    out["headroom_frac"] = 1.0 - out["peak_mem_bytes"] / out["device_mem_total_bytes"]
    out["device_type"] = r["device_type"].astype(str).to_numpy()
    return out
