"""GPU utilisation and memory (NVML samples; docs/metrics.md has no formula beyond these definitions).

Per GPU (host, gpu index) over the samples of the run:
- ``sm_util_mean_pct`` / ``mem_bw_util_mean_pct``: mean of NVML's utilisation samples;
- ``idle_frac``: fraction of the sampled time with SM utilisation below 5 %;
- ``throttled_s``: sampled time whose ``throttle_reasons`` (NVML clocksEventReasons) carry a slowdown bit --
  SW power cap 0x4, HW slowdown 0x8, SW thermal 0x20, HW thermal 0x40, HW power brake 0x80 (idle, application
  clock settings, sync boost and display clock bits are not throttling);
- each sample stands for the time until the next sample of that GPU (the last one for the median interval).

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
               "ecc_errors_max", "sampled_s"]


def gpu_stats(run) -> pd.DataFrame:
    nv = run.nvml
    if len(nv) == 0:
        return pd.DataFrame(columns=GPU_COLUMNS)
    d = pd.DataFrame({"host": nv["host"].astype(str).to_numpy(), "gpu": nv["gpu"].to_numpy(np.int64),
                      "uuid": nv["uuid"].astype(str).to_numpy(), "t_ns": nv["t_ns"].to_numpy(np.int64)})
    for c in ("sm_util_pct", "mem_bw_util_pct", "power_w", "temp_c", "sm_clock_mhz"):
        d[c] = nv[c].to_numpy(float)
    d["reasons"] = nv["throttle_reasons"].astype("Int64").fillna(0).to_numpy(np.int64)
    d["ecc"] = nv["ecc_errors"].astype("float64").to_numpy()
    d = d.sort_values(["host", "gpu", "t_ns"], kind="stable").reset_index(drop=True)
    host, gpu = d["host"].to_numpy(), d["gpu"].to_numpy()
    same = (host[1:] == host[:-1]) & (gpu[1:] == gpu[:-1])
    dt = np.full(len(d), np.nan)
    dt[:-1] = np.where(same, np.diff(d["t_ns"].to_numpy()), np.nan)
    d["dt_s"] = dt / 1e9
    med = d.groupby(["host", "gpu"], sort=False)["dt_s"].transform("median").fillna(0.0)
    d["dt_s"] = d["dt_s"].fillna(med)
    d["idle_s"] = np.where(d["sm_util_pct"] < IDLE_PCT, d["dt_s"], 0.0)
    d["thr"] = (d["reasons"] & THROTTLE_MASK) != 0
    d["thr_s"] = np.where(d["thr"], d["dt_s"], 0.0)
    g = d.groupby(["host", "gpu"], sort=True)
    out = g.agg(uuid=("uuid", "first"), samples=("t_ns", "size"), sm_util_mean_pct=("sm_util_pct", "mean"),
                mem_bw_util_mean_pct=("mem_bw_util_pct", "mean"), sampled_s=("dt_s", "sum"),
                idle_s=("idle_s", "sum"), throttled_s=("thr_s", "sum"), power_w_mean=("power_w", "mean"),
                temp_c_max=("temp_c", "max"), sm_clock_mhz_mean=("sm_clock_mhz", "mean"), ecc_errors_max=("ecc", "max"),
                reasons_any=("reasons", lambda s: int(np.bitwise_or.reduce(s.to_numpy())) if len(s) else 0))
    out = out.reset_index()
    sampled = out["sampled_s"].where(out["sampled_s"] > 0)   # NaN where nothing was sampled
    out["idle_frac"] = out["idle_s"] / sampled
    out["throttled_frac"] = out["throttled_s"] / sampled
    out["throttle_reasons"] = [",".join(n for b, n in THROTTLE_BITS.items() if r & b) for r in out["reasons_any"]]
    return out[GPU_COLUMNS]


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
    u_idx = pd.Series(np.arange(len(g)), index=g["uuid"].where(g["uuid"] != "", None))
    u_idx = u_idx[u_idx.index.notna() & ~u_idx.index.duplicated()]
    by_uuid = u_idx.reindex(out["uuid"].where(out["uuid"] != "", None)).to_numpy()
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
