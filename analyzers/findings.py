"""Findings: small rules over the analysis, each returning findings with a severity, the part of the step and the
mesh dimension they are about, the numbers that triggered them (evidence) and a recommendation.

A finding is ``{id, severity, message, part, dim, evidence, recommendation, chart}``: ``part`` names the step
breakdown's part it is about (breakdown.PARTS, or None), ``dim`` its mesh dimension (or None). ``RULES`` lists
the rules in order; ``find`` runs them all. Rules read only the summary and the analysis' tables.

Thresholds come from docs/metrics.md (the seeds' rules of thumb) and are module constants so a report can cite them:
- ``pipeline_bubble``: measured bubble > 20 % while microbatches < 4 × stages (docs/metrics.md: m >= 4p keeps the GPipe
  bubble under 25 %);
- ``exposed_comm``: exposed communication (the step breakdown's part, mean over ranks) > 30 % of step time
  (communication-to-compute ratio above ~30 % calls the parallelism strategy into question); the finding names the
  mesh dimension, op and place of issue with the most exposed time, and its advice fits them (``COMM_ADVICE``:
  by dimension, then by where it was issued, e.g. a gradient reduction after backward, then by op);
- ``low_busbw``: a collective bucket carrying >= 5 % of the communication time at busbw < 50 % of the link's peak;
- ``pipeline_overhead``: the measured bubble exceeds the schedule replayed on its own op times (pipeline.py) by
  more than 10 % of the step: idle time that more microbatches would not remove (p2p transfers, other communication,
  host gaps);
- ``straggler``: a persistent straggler (stragglers.py: removing it would save >= 5 % of the step);

Each finding whose fix has a what-if scenario (analyzers/whatif.py) cites its saving in its message and evidence
(``saving_frac``): exposed_comm -> perfect_overlap, data_wait -> no_data_wait, pipeline_bubble -> balanced_stages,
pipeline_overhead -> no_pipeline_gaps, straggler -> straggler_removed (its reason).
- ``memory_high``: peak memory above 70 % of the device's memory (warning above 90 %);
- ``memory_imbalance``: a rank holding more than 10 % (and 16 MiB) more than its peers in the layout (the ranks of its
  pipeline stage, or all ranks): the category of the excess and its likely cause (analyzers/memory.py ``imbalance``);
- ``low_gpu_util``: mean SM utilisation below 50 % on a GPU, with the likeliest cause among data wait, exposed
  communication, throttling, else host overhead;
- ``data_wait``: waiting for input (the step breakdown's part, mean over ranks) above 10 % of step time;
- why the GPU is slow, from a kernel-level sample (summary ``gpu_time``, analyzers/kernel_breakdown.py), when MFU
  is below ``LOW_MFU`` (30 %) or unknown; each names the fix and its gain, how it was derived and that it is an
  upper bound: ``gpu_elementwise`` (elementwise and normalisation kernels >= 10 % of the GPU's kernel time: fusing
  them, as torch.compile does, saves at most that share), ``gpu_misaligned_matmul`` (tensor-core GEMMs built for
  misaligned operands >= 5 % of the GPU's kernel time: aligned shapes save at most that share),
  ``gpu_launch_bound`` (the GPU idles >= 10 % of its kernel
  time waiting for the host to launch the next kernel: CUDA graphs or a larger batch save at most that share),
  ``gpu_busy_slow`` (MFU known and low while the GPU idles < 10 %: the kernels are slow, not the host; at most
  1 − MFU, the step at the peak); ``low_mfu_no_kernel_sample`` (MFU low on a GPU and no kernel-level sample to
  say why);
- ``cpu_contention``: the ranks' training threads waited for a CPU (summary ``cpu_wait``: runnable but not running)
  more than 10 % of the mean step: the cores are oversubscribed, and a rank slowed by it is not a straggler of its
  own (stragglers.py does not count that wait as its work).
"""
from __future__ import annotations

import math

import pandas as pd

from dtprof.analyzers.regression import gpu_idle_share

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
CPU_WAIT_FRAC = 0.10
LOW_MFU = 0.30
ELEMENTWISE_FRAC = 0.10
LAUNCH_IDLE_FRAC = 0.10
BUSY_IDLE_FRAC = 0.10
MISALIGNED_MATMUL_FRAC = 0.05


def _ok(x) -> bool:
    """A known number (not None, NaN or pandas NA)."""
    if x is None or x is pd.NA:
        return False
    try:
        return not math.isnan(float(x))
    except (TypeError, ValueError):
        return False


def finding(id_: str, severity: str, message: str, evidence: dict, recommendation: str, chart: str,
            part: str | None = None, dim: str | None = None) -> dict:
    return {"id": id_, "severity": severity, "message": message, "part": part, "dim": dim, "evidence": evidence,
            "recommendation": recommendation, "chart": chart}


def _part_frac(summary: dict, part: str) -> float | None:
    """A breakdown part's share of the step: mean over ranks of the part ÷ mean over ranks of the step time."""
    bd = summary.get("breakdown") or {}
    parts, step = bd.get("mean_over_ranks_s_per_step"), bd.get("step_time_s_mean")
    if not parts or not _ok(step) or step <= 0:
        return None
    return parts[part] / step


def saving_of(summary: dict, scenario: str, rank: int | None = None) -> dict | None:
    """The what-if entry (analyzers/whatif.py) of ``scenario`` (for ``rank``), or None."""
    for w in summary.get("what_if") or []:
        if w["scenario"] == scenario and (rank is None or w["ranks"] == [rank]):
            return w
    return None


def _cite(summary: dict, scenario: str, what: str) -> tuple[str, float | None]:
    """(", <what> would save about X % of the step", the saving) from the what-if list, or ("", None)."""
    w = saving_of(summary, scenario)
    if w is None or not _ok(w["saving_frac"]):
        return "", None
    return f"; {what} would save about {max(w['saving_frac'], 0):.0%} of the step", w["saving_frac"]


def pipeline_bubble(summary: dict, analysis) -> list[dict]:
    pp = summary.get("pipeline")
    if not (pp and _ok(pp.get("bubble_frac")) and pp["bubble_frac"] > BUBBLE_FRAC and
            pp["microbatches"] < MICROBATCH_PER_STAGE * pp["stages"]):
        return []
    theo = f"; theoretical {pp['theoretical_bubble_frac']:.0%}" if _ok(pp.get("theoretical_bubble_frac")) else ""
    cite, saving = _cite(summary, "balanced_stages", "balancing the stages")
    return [finding(
        "pipeline_bubble", "warning",
        f"Pipeline bubble {pp['bubble_frac']:.0%} of the step with {pp['microbatches']} microbatches over "
        f"{pp['stages']} stages (schedule {pp['schedule']}{theo}){cite}",
        {"bubble_frac": pp["bubble_frac"], "microbatches": pp["microbatches"], "stages": pp["stages"],
         "saving_frac": saving,
         "threshold_bubble_frac": BUBBLE_FRAC, "theoretical_bubble_frac": pp.get("theoretical_bubble_frac"),
         "breakdown_bubble_frac": _part_frac(summary, "bubble")},
        f"Use at least {MICROBATCH_PER_STAGE * pp['stages']} microbatches ({MICROBATCH_PER_STAGE} × stages), "
        "or an interleaved / zero-bubble schedule.", "pipeline", part="bubble", dim="pp")]


def pipeline_overhead(summary: dict, analysis) -> list[dict]:
    pp = summary.get("pipeline")
    if not (pp and _ok(pp.get("overhead_frac")) and pp["overhead_frac"] > PIPELINE_OVERHEAD_FRAC):
        return []
    cite, saving = _cite(summary, "no_pipeline_gaps", "removing the transfers and gaps between ops")
    return [finding(
        "pipeline_overhead", "warning",
        f"Pipeline stages idle {pp['overhead_frac']:.0%} of the step beyond what the schedule needs (measured "
        f"bubble {pp['bubble_frac']:.0%}, the schedule on these op times {pp['theoretical_bubble_frac']:.0%}){cite}",
        {"overhead_frac": pp["overhead_frac"], "saving_frac": saving, "bubble_frac": pp["bubble_frac"],
         "theoretical_bubble_frac": pp["theoretical_bubble_frac"], "threshold_overhead_frac": PIPELINE_OVERHEAD_FRAC},
        "The stages wait on something other than each other's compute: p2p transfers (put adjacent stages on "
        "one node or NVLink), communication outside the schedule such as a data-parallel gradient reduction "
        "that does not overlap, or host work between microbatches (gaps in the timeline).", "pipeline",
        part="bubble", dim="pp")]


# Advice for exposed communication, by mesh dimension first (what the dimension does), else by op (what the
# traffic is: all_reduce of gradients is DDP's, all_gather/reduce_scatter FSDP's).
COMM_ADVICE_BY_DIM = {
    "tp": "Tensor parallelism communicates inside every layer: keep each tp group inside one node (NVLink), use "
          "sequence parallelism or async tensor parallelism to overlap it, or use a smaller tp degree.",
    "pp": "Pipeline point-to-point transfers are exposed: put adjacent stages on one node or NVLink, send fewer "
          "bytes per microbatch (activation size), or use more microbatches so transfers overlap compute.",
    "cp": "Context parallelism's ring exchanges are exposed: keep the cp group on fast links or use a smaller cp "
          "degree; make sure the ring attention overlaps its send/recv with compute.",
    "ep": "Expert parallelism's all-to-all is exposed: keep the ep group inside a node, lower the capacity factor "
          "or the number of experts per token, or overlap dispatch with shared-expert compute.",
}
COMM_ADVICE_BY_OP = {
    "all_reduce": "The gradient all-reduce is exposed: let DDP overlap it with backward (bucket_cap_mb, "
                  "gradient_as_bucket_view, no_sync() over accumulation steps), or communicate less often with a "
                  "larger per-rank batch.",
    "all_gather": "FSDP's parameter all-gathers are exposed: prefetch them (forward_prefetch / backward_prefetch, "
                  "reshard_after_forward=False for the last blocks), wrap larger units, or use HSDP so they stay "
                  "inside a node.",
    "reduce_scatter": "FSDP's gradient reduce-scatters are exposed: wrap larger units so they overlap backward, "
                      "or use HSDP so they stay inside a node.",
    "all_to_all": COMM_ADVICE_BY_DIM["ep"],
    "send": COMM_ADVICE_BY_DIM["pp"], "recv": COMM_ADVICE_BY_DIM["pp"],
}
# where the most exposed communication was issued (breakdown.ISSUED), when that says more than its op
COMM_ADVICE_BY_ISSUED = {
    "after backward": "The gradient reduction runs after backward returns, so no backward compute can hide it "
                      "(DeepSpeed ZeRO reduces in engine.backward() after loss.backward(); a hand-written "
                      "all-reduce loop does the same): overlap it with backward (ZeRO's overlap_comm, DDP's "
                      "bucketed hooks), use larger buckets (DDP's bucket_cap_mb, ZeRO's reduce_bucket_size), or "
                      "reduce less often (gradient accumulation).",
    "between steps": "Communication between steps (after the optimizer: ZeRO's all-gather of the updated "
                     "partitions; a framework's logging collective) hides behind nothing: overlap it with the next "
                     "step's forward (ZeRO's overlap_comm / prefetching), log less often, or use larger buckets "
                     "(allgather_bucket_size).",
}
# a DeepSpeed ZeRO-1/2 run whose what-if has the one-bucket scenario: its gradient buckets, not DDP's
COMM_ADVICE_ZERO_BUCKETS = ("DeepSpeed ZeRO reduces the gradients bucket by bucket, each a reduction the training "
                            "thread waits for: raise reduce_bucket_size so fewer, larger buckets meet (the "
                            "zero_one_bucket what-if), and on a GPU turn on overlap_comm to hide them behind "
                            "backward.")
COMM_ADVICE_DEFAULT = ("Overlap this communication with compute (async collectives), cut its volume, or rethink "
                       "the parallelism layout.")


def comm_advice(dim: str | None, op: str | None) -> str:
    return COMM_ADVICE_BY_DIM.get(dim or "") or COMM_ADVICE_BY_OP.get(op or "") or COMM_ADVICE_DEFAULT


def exposed_comm(summary: dict, analysis) -> list[dict]:
    frac = _part_frac(summary, "exposed_comm")
    if not (_ok(frac) and frac > EXPOSED_COMM_FRAC):
        return []
    bd = summary["breakdown"]
    by_dim = bd.get("exposed_comm_by_dim_s_per_step") or {}
    by_op = bd.get("exposed_comm_by_op_s_per_step") or {}
    by_issued = bd.get("exposed_comm_by_issued_s_per_step") or {}
    dim = max(by_dim, key=by_dim.get) if by_dim else None
    op = max(by_op, key=by_op.get) if by_op else None
    issued = max(by_issued, key=by_issued.get) if by_issued else None
    where = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in by_dim.items() if v > 0)
    ops = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in by_op.items() if v > 0)
    when = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in by_issued.items() if v > 0)
    exposed_ms = bd["mean_over_ranks_s_per_step"]["exposed_comm"] * 1e3
    cite, saving = _cite(summary, "perfect_overlap", "overlapping it perfectly")
    zero_cite, _ = _cite(summary, "zero_one_bucket", "one ZeRO gradient bucket")
    return [finding(
        "exposed_comm", "warning",
        f"Exposed communication is {frac:.0%} of the step ({exposed_ms:.1f} ms a step, mean over ranks)"
        + (f"; by mesh dimension: {where}" if where and set(by_dim) != {"(none)"} else "")
        + (f"; by op: {ops}" if ops else "") + (f"; issued: {when}" if when else "") + cite + zero_cite,
        {"exposed_comm_frac": frac, "saving_frac": saving, "exposed_comm_s_per_step": exposed_ms / 1e3,
         "by_dim_s_per_step": by_dim, "by_op_s_per_step": by_op, "by_issued_s_per_step": by_issued,
         "threshold_frac": EXPOSED_COMM_FRAC},
        COMM_ADVICE_BY_DIM.get(dim or "") or (COMM_ADVICE_ZERO_BUCKETS if zero_cite else None)
        or COMM_ADVICE_BY_ISSUED.get(issued or "") or comm_advice(dim, op),
        "breakdown", part="exposed_comm", dim=None if dim == "(none)" else dim)]


def low_busbw(summary: dict, analysis) -> list[dict]:
    out = []
    for c in summary.get("collectives") or []:
        frac, share = c.get("link_peak_frac"), c.get("share_of_comm")
        if _ok(frac) and frac < BUSBW_LINK_FRAC and _ok(share) and share >= BUSBW_MIN_SHARE:
            out.append(finding(
                "low_busbw", "warning",
                f"{c['op']} on group {c['group']} ({c['size_bucket']}) reaches busbw {c['busbw_gbps']:.1f} GB/s, "
                f"{frac:.0%} of the link's {c['link_peak_gbps']:.0f} GB/s",
                {"op": c["op"], "group": c["group"], "size_bucket": c["size_bucket"],
                 "busbw_gbps": c["busbw_gbps"], "link_peak_gbps": c["link_peak_gbps"], "link_peak_frac": frac,
                 "share_of_comm": share, "threshold_frac": BUSBW_LINK_FRAC},
                "Check the topology (NCCL_DEBUG=INFO: NVLink vs PCIe/socket paths), use larger messages "
                "(bucket_cap_mb) and make sure the group's ranks sit on well-connected GPUs.", "collectives",
                part="exposed_comm", dim=c.get("mesh_dim")))
    return out


def straggler(summary: dict, analysis) -> list[dict]:
    out = []
    for s in summary.get("stragglers") or []:
        if s.get("kind") != "persistent":
            continue
        score = f", compute score {s['score']:.2f}" if _ok(s.get("score")) else ""
        out.append(finding(
            "straggler", "critical",
            f"Rank {s['rank']} ({s['host']}, {s['device']}) is a persistent straggler: {s['reason']}{score}; "
            f"its peers' arrival wait {s['time_lost_s']:.3f} s (summed over peers and collectives)",
            {"rank": s["rank"], "host": s["host"], "score": s.get("score"), "late_step_frac": s.get("late_step_frac"),
             "saving_frac": s.get("saving_frac"), "saving_step_frac": s.get("saving_step_frac"),
             "slow_step_frac": s.get("slow_step_frac"), "time_lost_s": s["time_lost_s"],
             "nvml": s.get("evidence", [])},
            "Look at the NVML evidence (clocks, temperature, power, throttling) and that rank's data loading; "
            "drain or replace the node if the GPU is degraded.", "stragglers", part="exposed_comm"))
    return out


def memory_high(summary: dict, analysis) -> list[dict]:
    out = []
    for m in analysis.memory.itertuples(index=False) if analysis.memory is not None else []:
        used = None
        if _ok(m.peak_mem_bytes) and _ok(m.device_mem_total_bytes) and m.device_mem_total_bytes:
            used = float(m.peak_mem_bytes) / float(m.device_mem_total_bytes)
        if used is not None and used > MEMORY_FRAC and m.device_type != "cpu":
            out.append(finding(
                "memory_high", "warning" if used > MEMORY_FRAC_CRITICAL else "info",
                f"Rank {m.rank} peaks at {used:.0%} of its device memory "
                f"({float(m.peak_mem_bytes) / 2**30:.1f} of {float(m.device_mem_total_bytes) / 2**30:.1f} GiB)",
                {"rank": int(m.rank), "peak_mem_bytes": float(m.peak_mem_bytes),
                 "device_mem_total_bytes": float(m.device_mem_total_bytes), "used_frac": used,
                 "threshold_frac": MEMORY_FRAC},
                "Little headroom for a larger batch or sequence: consider activation checkpointing, FSDP/ZeRO "
                "sharding or a smaller microbatch before scaling up.", "memory"))
    return out


MEMORY_CATEGORY_NAMES = {"params_bytes": "parameters", "grads_bytes": "gradients",
                         "optimizer_state_bytes": "optimizer state", "activations_bytes": "activations",
                         "other_bytes": "memory outside its parameters, gradients and optimizer state between steps"}


def memory_imbalance(summary: dict, analysis) -> list[dict]:
    """A rank holding more memory than its peers in the layout (analyzers/memory.py ``imbalance``)."""
    out = []
    for x in ((summary.get("memory") or {}).get("imbalance") or {}).get("ranks") or []:
        cat = MEMORY_CATEGORY_NAMES[x["category"]]
        peers = ("rank " if len(x["peers"]) == 1 else "ranks ") + ", ".join(map(str, x["peers"]))
        out.append(finding(
            "memory_imbalance", "warning",
            f"Rank {x['rank']} holds {x['excess_bytes'] / 2**20:,.0f} MiB more than its peers ({peers}, which its "
            f"layout says hold the same), {x['category_excess_bytes'] / 2**20:,.0f} MiB of it in {cat}",
            {k: x[k] for k in ("rank", "peers", "excess_bytes", "category", "category_excess_bytes", "held_bytes",
                               "peers_median_bytes")},
            f"Likely cause: {x['cause']}. The rank with the most memory sets the job's limit: even it out before "
            "scaling the batch.", "memory"))
    return out


def low_gpu_util(summary: dict, analysis) -> list[dict]:
    gpu = analysis.gpu
    if gpu is None or not len(gpu):
        return []
    out = []
    data_frac = _part_frac(summary, "data_wait")
    exposed = _part_frac(summary, "exposed_comm")
    for g in gpu.itertuples(index=False):
        if not (_ok(g.sm_util_mean_pct) and g.sm_util_mean_pct < GPU_UTIL_PCT):
            continue
        part = None
        if _ok(g.throttled_frac) and g.throttled_frac > 0.2:
            cause = f"clock throttling ({g.throttle_reasons}) {g.throttled_frac:.0%} of the time"
        elif _ok(data_frac) and data_frac > DATA_WAIT_FRAC:
            cause, part = f"waiting for input data ({data_frac:.0%} of step time)", "data_wait"
        elif _ok(exposed) and exposed > EXPOSED_COMM_FRAC / 2:
            cause, part = f"exposed communication ({exposed:.0%} of step time)", "exposed_comm"
        else:
            cause = "host overhead or small kernels (the GPU waits for the CPU to launch work)"
        out.append(finding(
            "low_gpu_util", "warning",
            f"GPU {g.host}:{g.gpu} is busy {g.sm_util_mean_pct:.0f} % of the time; likely cause: {cause}",
            {"host": g.host, "gpu": int(g.gpu), "sm_util_mean_pct": float(g.sm_util_mean_pct),
             "idle_frac": float(g.idle_frac) if _ok(g.idle_frac) else None, "cause": cause,
             "threshold_pct": GPU_UTIL_PCT},
            "Remove the cause named: more data-loader workers/pinned memory, overlap communication, "
            "CUDA graphs or torch.compile for launch-bound steps, cooling/power for throttling.", "gpu", part=part))
    return out


def data_wait(summary: dict, analysis) -> list[dict]:
    frac = _part_frac(summary, "data_wait")
    if not (_ok(frac) and frac > DATA_WAIT_FRAC):
        return []
    cite, saving = _cite(summary, "no_data_wait", "removing the wait")
    return [finding("data_wait", "warning", f"Ranks wait for input data {frac:.0%} of the step{cite}",
                    {"data_wait_frac": frac, "threshold_frac": DATA_WAIT_FRAC, "saving_frac": saving},
                    "Use more DataLoader workers, pin_memory and prefetching, or move preprocessing offline.",
                    "breakdown", part="data_wait")]


def cpu_contention(summary: dict, analysis) -> list[dict]:
    c = summary.get("cpu_wait")
    if not c or c["frac_of_step"] <= CPU_WAIT_FRAC:
        return []
    return [finding(
        "cpu_contention", "warning",
        f"The ranks' training threads waited for a CPU {c['frac_of_step']:.0%} of the step (rank {c['worst_rank']} "
        f"most: {c['worst_s_per_step'] * 1e3:.1f} ms per step): other processes or threads hold their cores",
        {**c, "threshold_frac": CPU_WAIT_FRAC},
        "Give each rank its own cores: fewer DataLoader workers or intra-op threads (OMP_NUM_THREADS), no other "
        "jobs on the node, ranks pinned to cores (numactl, taskset).", "breakdown")]


def _low_mfu(summary: dict) -> tuple[bool, str]:
    """(MFU is low or unknown, how it reads in a message)."""
    mfu = (summary.get("mfu") or {}).get("value")
    if not _ok(mfu):
        return True, "MFU unknown"
    return mfu < LOW_MFU, f"MFU {mfu:.1%}"


def _sampled(gt: dict) -> str:
    return (f"{gt['ranks']} rank(s), {gt['kernels_per_step']:.0f} kernels per step, median kernel "
            f"{gt['median_kernel_s'] * 1e6:.1f} µs" if _ok(gt.get("kernels_per_step")) else f"{gt['ranks']} rank(s)")


def gpu_elementwise(summary: dict, analysis) -> list[dict]:
    gt, (low, mfu) = summary.get("gpu_time"), _low_mfu(summary)
    frac = ((gt or {}).get("class_frac") or {}).get("elementwise_norm")
    if not (low and _ok(frac) and frac >= ELEMENTWISE_FRAC):
        return []
    return [finding(
        "gpu_elementwise", "warning",
        f"Elementwise and normalisation kernels take {frac:.0%} of the GPU's time ({mfu}; kernel sample of "
        f"{_sampled(gt)}): fusing them saves at most that much of the GPU's time",
        {"elementwise_norm_frac": frac, "saving_frac": frac, "saving_is_upper_bound": True,
         "derived": "|union of elementwise and normalisation kernels| ÷ GPU kernel time of the sampled steps; an "
                    "upper bound: fused kernels still read and write their inputs once, and a host-bound step "
                    "gains nothing", "threshold_frac": ELEMENTWISE_FRAC, "mfu_threshold": LOW_MFU},
        "Fuse the memory-bound kernels: torch.compile (Inductor fuses elementwise, normalisation and softmax "
        "chains), fused optimizers (foreach/fused=True), fused attention (scaled_dot_product_attention).", "gpu")]


def gpu_misaligned_matmul(summary: dict, analysis) -> list[dict]:
    gt, (low, mfu) = summary.get("gpu_time"), _low_mfu(summary)
    frac = (gt or {}).get("misaligned_matmul_frac")
    if not (low and _ok(frac) and frac >= MISALIGNED_MATMUL_FRAC):
        return []
    return [finding(
        "gpu_misaligned_matmul", "warning",
        f"Matrix multiplies on misaligned operands take {frac:.0%} of the GPU's time ({mfu}; kernel sample of "
        f"{_sampled(gt)}): cuBLAS ran tensor-core kernels built for 1- or 2-element alignment; aligned shapes save "
        f"at most that much of the GPU's time",
        {"misaligned_matmul_frac": frac, "saving_frac": frac, "saving_is_upper_bound": True,
         "derived": "|union of the tensor-core GEMM kernels named _align1/_align2| ÷ GPU kernel time of the sampled "
                    "steps; an upper bound: aligned kernels take time too, though several times less",
         "threshold_frac": MISALIGNED_MATMUL_FRAC, "mfu_threshold": LOW_MFU},
        "Make every matrix dimension a multiple of 8 (64 is better) for 16-bit matmuls: pad the vocabulary (GPT-2's "
        "50,257 to 50,304), the hidden and batch × sequence sizes; torch.compile pads some matmuls itself "
        "(Inductor's pad_mm).", "gpu")]


def gpu_launch_bound(summary: dict, analysis) -> list[dict]:
    gt, (low, mfu) = summary.get("gpu_time"), _low_mfu(summary)
    traced = (gt or {}).get("launch_idle_frac")
    step = (gt or {}).get("launch_idle_step_frac")
    frac = step if _ok(step) else traced     # an ordinary step's share where timed steps tell it
    if not (low and _ok(frac) and frac >= LAUNCH_IDLE_FRAC):
        return []
    of = (f"of a step waiting for the host to launch the next kernel ({mfu}; {_sampled(gt)}; the traced steps, "
          f"which the profiler slows, idle {traced:.0%} of their GPU time)" if _ok(step) else
          f"of its time waiting for the host to launch the next kernel ({mfu}; {_sampled(gt)})")
    return [finding(
        "gpu_launch_bound", "warning",
        f"The GPU idles {frac:.0%} {of}: the step is launch-bound; removing the gaps saves at most that much",
        {"launch_idle_frac": traced, "launch_idle_step_frac": step, "saving_frac": frac,
         "saving_is_upper_bound": True,
         "kernels_per_step": gt.get("kernels_per_step"), "median_kernel_s": gt.get("median_kernel_s"),
         "derived": "idle stretches (no kernel on any stream) whose next kernel's CPU launch came after the GPU went "
                    "idle, per traced step, at most an ordinary step less the kernels' busy time per traced step, "
                    "÷ the ordinary step (the median timed step; without one, ÷ the traced steps' GPU kernel "
                    "time); an upper bound: faster launching only removes the gaps",
         "threshold_frac": LAUNCH_IDLE_FRAC, "mfu_threshold": LOW_MFU},
        "Launch fewer, larger kernels: CUDA graphs (torch.compile mode=\"reduce-overhead\", torch.cuda.graphs), "
        "a larger batch per step, fewer host syncs (.item(), logging) inside the step.", "gpu")]


def gpu_busy_slow(summary: dict, analysis) -> list[dict]:
    gt = summary.get("gpu_time")
    mfu = (summary.get("mfu") or {}).get("value")
    idle, _ = gpu_idle_share(gt)
    if not (_ok(mfu) and mfu < LOW_MFU and _ok(idle) and idle < BUSY_IDLE_FRAC):
        return []
    cf = gt.get("class_frac") or {}
    mm = sum(cf.get(c) or 0.0 for c in ("matmul", "attention"))
    return [finding(
        "gpu_busy_slow", "warning",
        f"The GPU is busy ({idle:.0%} idle) and still reaches MFU {mfu:.1%}: its kernels are slow, not the host "
        f"(matmul and attention {mm:.0%} of its time); faster kernels save at most {1 - mfu:.0%} of the step",
        {"mfu": mfu, "idle_frac": idle, "matmul_attention_frac": mm, "saving_frac": 1 - mfu,
         "saving_is_upper_bound": True,
         "derived": "1 − MFU: the step at the device's peak FLOP/s; an upper bound no real kernel reaches",
         "threshold_idle_frac": BUSY_IDLE_FRAC, "mfu_threshold": LOW_MFU},
        "Make the kernels efficient: bf16/fp16 autocast or TF32 matmuls (fp32 runs far below the tensor-core "
        "peak), matrix sizes in multiples of 64, fused attention, larger per-kernel work.", "gpu")]


def low_mfu_no_kernel_sample(summary: dict, analysis) -> list[dict]:
    mfu = (summary.get("mfu") or {}).get("value")
    on_gpu = bool((summary.get("breakdown") or {}).get("gpu_ranks"))
    if not (on_gpu and _ok(mfu) and mfu < LOW_MFU and summary.get("gpu_time") is None):
        return []
    return [finding(
        "low_mfu_no_kernel_sample", "info",
        f"MFU {mfu:.1%} on a GPU, and this run has no kernel-level sample to say why",
        {"mfu": mfu, "mfu_threshold": LOW_MFU},
        "Record again with `dtprof run` (on a GPU it samples a few steps' kernels by default) or `--trace-steps "
        "A:B`: the findings then name the cause (fusable kernels, launch gaps, slow kernels) and its gain.", "gpu")]


NUMERICS_ADVICE = {
    "nonfinite": "Look at the named rank's batch at that step and at the operations that can overflow (loss "
                 "scaling, log/exp, division); `torch.autograd.set_detect_anomaly` on a rerun of that step names "
                 "the operation.",
    "loss_spike": "If the learning rate changed, check the schedule (warm-up, restarts, a mis-scaled group); if the "
                  "gradient norm stayed normal, check the data of that step (shuffle order, a corrupt shard); "
                  "clipping or skipping outlier steps contains it.",
    "grad_norm_explosion": "Lower the learning rate or clip the gradients; check the step's data and the "
                           "learning-rate schedule.",
    "divergence": "Replicas must hold identical weights: rerun the step on the named rank's GPU (a faulty GPU or "
                  "HBM corrupts silently) and drain it if it differs again; check for rank-local parameter "
                  "updates outside the optimizer.",
}


def numerics(summary: dict, analysis) -> list[dict]:
    """One finding per numerics incident (analyzers/health.py), the first 5 by step."""
    incidents = ((summary.get("health") or {}).get("incidents") or [])[:5]
    return [finding(
        f"numerics_{i['kind']}", "critical" if i["kind"] in ("nonfinite", "divergence") else "warning",
        i["message"][:1].upper() + i["message"][1:],
        {k: i[k] for k in ("step", "ranks", "value", "median", "z", "cause") if k in i},
        NUMERICS_ADVICE[i["kind"]], "health") for i in incidents]


RULES = (pipeline_bubble, pipeline_overhead, exposed_comm, low_busbw, straggler, memory_high, low_gpu_util,
         data_wait, cpu_contention, gpu_elementwise, gpu_misaligned_matmul, gpu_launch_bound, gpu_busy_slow,
         low_mfu_no_kernel_sample, numerics, memory_imbalance)


def find(summary: dict, analysis) -> list[dict]:
    """Every rule's findings, in ``RULES`` order."""
    return [f for rule in RULES for f in rule(summary, analysis)]
