"""Findings: rules over the analysis with a severity, the numbers that triggered them and a recommendation.

Thresholds come from docs/metrics.md (the seeds' rules of thumb) and are module constants so a report can cite them:
- ``pipeline_bubble``: measured bubble > 20 % while microbatches < 4 × stages (docs/metrics.md: m >= 4p keeps the GPipe
  bubble under 25 %);
- ``exposed_comm``: exposed communication > 30 % of step time (communication-to-compute ratio above ~30 % calls
  the parallelism strategy into question);
- ``low_busbw``: a collective bucket carrying >= 5 % of the communication time at busbw < 50 % of the link's peak;
- ``pipeline_overhead``: the measured bubble exceeds the schedule replayed on its own op times (pipeline.py) by
  more than 10 % of the step: idle time that more microbatches would not remove (p2p transfers, other communication,
  host gaps);
- ``straggler``: a persistent straggler (stragglers.py);
- ``memory_high``: peak memory above 70 % of the device's memory (warning above 90 %);
- ``low_gpu_util``: mean SM utilisation below 50 % on a GPU, with the likeliest cause among data wait, exposed
  communication, throttling, else host overhead;
- ``data_wait``: waiting for input above 10 % of step time.
"""
from __future__ import annotations

import math

import pandas as pd

BUBBLE_FRAC = 0.20
MICROBATCH_PER_STAGE = 4
PIPELINE_OVERHEAD_FRAC = 0.10
EXPOSED_COMM_FRAC = 0.30
BUSBW_LINK_FRAC = 0.50
BUSBW_MIN_SHARE = 0.05
MEMORY_FRAC = 0.70
MEMORY_FRAC_CRITICAL = 0.90
GPU_UTIL_PCT = 50.0
DATA_WAIT_FRAC = 0.10


def _ok(x) -> bool:
    """A known number (not None, NaN or pandas NA)."""
    if x is None or x is pd.NA:
        return False
    try:
        return not math.isnan(float(x))
    except (TypeError, ValueError):
        return False


def find(summary: dict, analysis) -> list[dict]:
    out: list[dict] = []

    def add(id_, severity, message, evidence, recommendation, chart):
        out.append({"id": id_, "severity": severity, "message": message, "evidence": evidence,
                    "recommendation": recommendation, "chart": chart})

    pp = summary.get("pipeline")
    if pp and _ok(pp.get("bubble_frac")) and pp["bubble_frac"] > BUBBLE_FRAC and \
            pp["microbatches"] < MICROBATCH_PER_STAGE * pp["stages"]:
        add("pipeline_bubble", "warning",
            f"Pipeline bubble {pp['bubble_frac']:.0%} of the step with {pp['microbatches']} microbatches over "
            f"{pp['stages']} stages (schedule {pp['schedule']}; theoretical "
            f"{pp['theoretical_bubble_frac']:.0%})" if _ok(pp.get("theoretical_bubble_frac")) else
            f"Pipeline bubble {pp['bubble_frac']:.0%} of the step with {pp['microbatches']} microbatches over "
            f"{pp['stages']} stages (schedule {pp['schedule']})",
            {"bubble_frac": pp["bubble_frac"], "microbatches": pp["microbatches"], "stages": pp["stages"],
             "threshold_bubble_frac": BUBBLE_FRAC, "theoretical_bubble_frac": pp.get("theoretical_bubble_frac")},
            f"Use at least {MICROBATCH_PER_STAGE * pp['stages']} microbatches ({MICROBATCH_PER_STAGE} × stages), "
            "or an interleaved / zero-bubble schedule.", "pipeline")

    if pp and _ok(pp.get("overhead_frac")) and pp["overhead_frac"] > PIPELINE_OVERHEAD_FRAC:
        add("pipeline_overhead", "warning",
            f"Pipeline stages idle {pp['overhead_frac']:.0%} of the step beyond what the schedule needs (measured "
            f"bubble {pp['bubble_frac']:.0%}, the schedule on these op times {pp['theoretical_bubble_frac']:.0%})",
            {"overhead_frac": pp["overhead_frac"], "bubble_frac": pp["bubble_frac"],
             "theoretical_bubble_frac": pp["theoretical_bubble_frac"],
             "threshold_overhead_frac": PIPELINE_OVERHEAD_FRAC},
            "The stages wait on something other than each other's compute: p2p transfers (put adjacent stages on "
            "one node or NVLink), communication outside the schedule such as a data-parallel gradient reduction "
            "that does not overlap, or host work between microbatches (gaps in the timeline).", "pipeline")

    ov = summary.get("overlap") or {}
    if _ok(ov.get("exposed_comm_frac")) and ov["exposed_comm_frac"] > EXPOSED_COMM_FRAC:
        add("exposed_comm", "warning",
            f"Exposed communication is {ov['exposed_comm_frac']:.0%} of step time (overlap ratio "
            f"{ov['ratio']:.0%})" if _ok(ov.get("ratio")) else
            f"Exposed communication is {ov['exposed_comm_frac']:.0%} of step time",
            {"exposed_comm_frac": ov["exposed_comm_frac"], "overlap_ratio": ov.get("ratio"),
             "threshold_frac": EXPOSED_COMM_FRAC},
            "Overlap communication with compute (DDP bucket size, FSDP prefetch, async collectives), cut its "
            "volume (gradient compression, larger per-rank batch) or rethink the parallelism layout.", "overlap")

    for c in summary.get("collectives") or []:
        frac, share = c.get("link_peak_frac"), c.get("share_of_comm")
        if _ok(frac) and frac < BUSBW_LINK_FRAC and _ok(share) and share >= BUSBW_MIN_SHARE:
            add("low_busbw", "warning",
                f"{c['op']} on group {c['group']} ({c['size_bucket']}) reaches busbw {c['busbw_gbps']:.1f} GB/s, "
                f"{frac:.0%} of the link's {c['link_peak_gbps']:.0f} GB/s",
                {"op": c["op"], "group": c["group"], "size_bucket": c["size_bucket"], "busbw_gbps": c["busbw_gbps"],
                 "link_peak_gbps": c["link_peak_gbps"], "link_peak_frac": frac, "share_of_comm": share,
                 "threshold_frac": BUSBW_LINK_FRAC},
                "Check the topology (NCCL_DEBUG=INFO: NVLink vs PCIe/socket paths), use larger messages "
                "(bucket_cap_mb) and make sure the group's ranks sit on well-connected GPUs.", "collectives")

    for s in summary.get("stragglers") or []:
        if s.get("kind") != "persistent":
            continue
        add("straggler", "critical",
            f"Rank {s['rank']} ({s['host']}, {s['device']}) is a persistent straggler: {s['reason']}"
            + (f", compute score {s['score']:.2f}" if _ok(s.get("score")) else "")
            + f"; peers lost {s['time_lost_s']:.3f} s waiting for it",
            {"rank": s["rank"], "host": s["host"], "score": s.get("score"), "late_step_frac": s.get("late_step_frac"),
             "slow_step_frac": s.get("slow_step_frac"), "time_lost_s": s["time_lost_s"],
             "nvml": s.get("evidence", [])},
            "Look at the NVML evidence (clocks, temperature, power, throttling) and that rank's data loading; "
            "drain or replace the node if the GPU is degraded.", "stragglers")

    for m in analysis.memory.itertuples(index=False) if analysis.memory is not None else []:
        used = None
        if _ok(m.peak_mem_bytes) and _ok(m.device_mem_total_bytes) and m.device_mem_total_bytes:
            used = float(m.peak_mem_bytes) / float(m.device_mem_total_bytes)
        if used is not None and used > MEMORY_FRAC and m.device_type != "cpu":
            add("memory_high", "warning" if used > MEMORY_FRAC_CRITICAL else "info",
                f"Rank {m.rank} peaks at {used:.0%} of its device memory "
                f"({float(m.peak_mem_bytes) / 2**30:.1f} of {float(m.device_mem_total_bytes) / 2**30:.1f} GiB)",
                {"rank": int(m.rank), "peak_mem_bytes": float(m.peak_mem_bytes),
                 "device_mem_total_bytes": float(m.device_mem_total_bytes), "used_frac": used,
                 "threshold_frac": MEMORY_FRAC},
                "Little headroom for a larger batch or sequence: consider activation checkpointing, FSDP/ZeRO "
                "sharding or a smaller microbatch before scaling up.", "memory")

    gpu = analysis.gpu
    if gpu is not None and len(gpu):
        ranks = summary.get("ranks") or []
        dur = sum((r.get("step_time_s_p50") or 0) for r in ranks) or None
        data = sum((r.get("data_wait_s_per_step") or 0) for r in ranks)
        data_frac = data / dur if dur else None
        exposed = ov.get("exposed_comm_frac")
        for g in gpu.itertuples(index=False):
            if not (_ok(g.sm_util_mean_pct) and g.sm_util_mean_pct < GPU_UTIL_PCT):
                continue
            if _ok(g.throttled_frac) and g.throttled_frac > 0.2:
                cause = f"clock throttling ({g.throttle_reasons}) {g.throttled_frac:.0%} of the time"
            elif _ok(data_frac) and data_frac > DATA_WAIT_FRAC:
                cause = f"waiting for input data ({data_frac:.0%} of step time)"
            elif _ok(exposed) and exposed > EXPOSED_COMM_FRAC / 2:
                cause = f"exposed communication ({exposed:.0%} of step time)"
            else:
                cause = "host overhead or small kernels (the GPU waits for the CPU to launch work)"
            add("low_gpu_util", "warning",
                f"GPU {g.host}:{g.gpu} is busy {g.sm_util_mean_pct:.0f} % of the time; likely cause: {cause}",
                {"host": g.host, "gpu": int(g.gpu), "sm_util_mean_pct": float(g.sm_util_mean_pct),
                 "idle_frac": float(g.idle_frac) if _ok(g.idle_frac) else None, "cause": cause,
                 "threshold_pct": GPU_UTIL_PCT},
                "Remove the cause named: more data-loader workers/pinned memory, overlap communication, "
                "CUDA graphs or torch.compile for launch-bound steps, cooling/power for throttling.", "gpu")

    ranks = summary.get("ranks") or []
    tot = sum((r.get("step_time_s_p50") or 0) for r in ranks)
    dw = sum((r.get("data_wait_s_per_step") or 0) for r in ranks)
    if tot > 0 and dw / tot > DATA_WAIT_FRAC:
        add("data_wait", "warning", f"Ranks wait for input data {dw / tot:.0%} of the step",
            {"data_wait_frac": dw / tot, "threshold_frac": DATA_WAIT_FRAC},
            "Use more DataLoader workers, pin_memory and prefetching, or move preprocessing offline.", "steps")
    return out
