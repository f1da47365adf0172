"""A stand-in for ``dtprof.analyzers.summary.analyze`` (BRIEF §4), for the report tests only.

It builds an object with exactly the fields and columns of ``Analysis`` from a run's tables with simple
computations (sums of spans instead of interval unions). It is a fixture, not an analyzer: the report tests use
the real ``analyze`` as soon as ``dtprof.analyzers.summary`` exists (see ``get_analysis``).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

COMPUTE = ["forward", "backward", "optimizer", "pp_forward", "pp_backward"]


@dataclass
class FakeAnalysis:
    summary: dict
    steps: pd.DataFrame
    collectives: pd.DataFrame
    arrivals: pd.DataFrame
    stragglers: pd.DataFrame
    pipeline: pd.DataFrame | None
    gpu: pd.DataFrame
    memory: pd.DataFrame
    clock: pd.DataFrame
    findings: list = field(default_factory=list)


def get_analysis(run):
    """The real analysis when the analyzers are installed, else this stand-in (the one line to swap)."""
    if importlib.util.find_spec("dtprof.analyzers.summary") is not None:
        from dtprof.analyzers.summary import analyze
        return analyze(run)
    return fake_analyze(run)


def _per_step(df, value, name):
    return df.assign(_v=value).groupby(["rank", "step"], observed=True)["_v"].sum().rename(name) / 1e9


def fake_analyze(run, warmup: int = 1, peak_tflops: float = 989.4) -> FakeAnalysis:
    steps = run.steps.copy()
    spans = run.spans.dropna(subset=["step"]).astype({"step": "int64"})
    colls = run.collectives.dropna(subset=["step"]).astype({"step": "int64"})
    dur = spans["end_ns"] - spans["start_ns"]
    kind = spans["kind"].astype(str)
    comm_end = colls["end_ns"].fillna(colls["return_ns"]).astype("int64")
    st = steps.set_index(["rank", "step"])
    st["duration_s"] = (st["end_ns"] - st["start_ns"]) / 1e9
    wait = _per_step(spans[kind == "comm_wait"], dur[kind == "comm_wait"], "w")
    st["compute_s"] = _per_step(spans[kind.isin(COMPUTE)], dur[kind.isin(COMPUTE)], "c").reindex(st.index,
                                                                                                   fill_value=0)
    st["compute_s"] -= wait.reindex(st.index, fill_value=0)
    st["comm_s"] = _per_step(colls, comm_end - colls["issue_ns"], "m").reindex(st.index, fill_value=0)
    st["exposed_comm_s"] = wait.reindex(st.index, fill_value=0)
    st["comm_wait_s"] = st["exposed_comm_s"]
    st["data_wait_s"] = _per_step(spans[kind == "data_wait"], dur[kind == "data_wait"], "d").reindex(
        st.index, fill_value=0)
    st["overlap_ratio"] = np.where(st["comm_s"] > 0, 1 - st["exposed_comm_s"] / st["comm_s"].where(
        st["comm_s"] > 0, 1), np.nan)
    st = st.reset_index()
    st["warmup"] = st["step"] < warmup
    steps_out = st[["rank", "step", "start_ns", "end_ns", "duration_s", "compute_s", "comm_s", "exposed_comm_s",
                    "comm_wait_s", "data_wait_s", "overlap_ratio", "warmup", "peak_mem_bytes"]]
    measured = steps_out[~steps_out["warmup"]]
    per_step = measured.groupby("step")["duration_s"].max()

    # collectives per op x group x size bucket
    c = colls.assign(dur_s=(comm_end - colls["issue_ns"]) / 1e9,
                     size=np.maximum(colls["in_bytes"], colls["out_bytes"]))
    c["size_bucket"] = pd.cut(c["size"], [-1, 2**20, 16 * 2**20, 64 * 2**20, 2**62],
                              labels=["<1 MiB", "1-16 MiB", "16-64 MiB", ">=64 MiB"]).astype(str)
    g = c.groupby(["op", "group", "size_bucket"], observed=True).agg(
        count=("dur_s", "size"), total_s=("dur_s", "sum"), size=("size", "mean"), n=("group_size", "max"))
    g["transfer_s"] = g["total_s"] * 0.8
    g["algbw_gbps"] = g["size"] * g["count"] / g["transfer_s"] / 1e9
    g["busbw_gbps"] = g["algbw_gbps"] * 2 * (g["n"] - 1) / g["n"]
    g["link_peak_frac"] = np.nan
    g["share_of_comm"] = g["total_s"] / g["total_s"].sum()
    coll_out = g.reset_index()[["op", "group", "size_bucket", "count", "total_s", "transfer_s", "algbw_gbps",
                                "busbw_gbps", "link_peak_frac", "share_of_comm"]]

    # arrivals: instance = (group, seq) of non-p2p collectives
    cc = colls[~colls["op"].astype(str).isin(["send", "recv"])]
    first = cc.groupby(["group", "seq"], observed=True)["issue_ns"].transform("min")
    last = cc.groupby(["group", "seq"], observed=True)["issue_ns"].transform("max")
    arrivals = pd.DataFrame({"group": cc["group"], "seq": cc["seq"], "op": cc["op"], "rank": cc["rank"],
                             "step": cc["step"], "arrival_ns": cc["issue_ns"],
                             "lateness_s": (cc["issue_ns"] - first) / 1e9,
                             "last": (cc["issue_ns"] == last) & (last > first)}).reset_index(drop=True)
    lost = (last - cc["issue_ns"]).groupby(cc["rank"]).sum()
    ranks = run.ranks.set_index("rank")
    strag = arrivals.groupby("rank").agg(late_frac=("last", "mean")).reindex(ranks.index, fill_value=0.0)
    strag["time_lost_s"] = 0.0
    med = measured.groupby("rank")["compute_s"].median()
    strag["compute_score"] = (med.min() / med).reindex(strag.index)
    strag["kind"] = np.where(strag["late_frac"] > 0.5, "persistent",
                             np.where(strag["late_frac"] > 0.1, "transient", "none"))
    if len(lost):  # time the others waited for this rank, charged to the last arriver
        strag.loc[strag["kind"] != "none", "time_lost_s"] = lost.sum() / 1e9 / max(1, (strag["kind"] != "none")
                                                                                   .sum())
    strag["host"] = ranks["host"].astype(str)
    strag["device"] = ranks["device_name"].astype(str) + ":" + ranks["device_index"].astype(str)
    strag_out = strag.reset_index()[["rank", "host", "device", "late_frac", "time_lost_s", "compute_score",
                                     "kind"]]

    # pipeline
    pp = spans[kind.isin(["pp_forward", "pp_backward"])]
    pipeline = None
    if len(pp):
        pc = pp.assign(d=(pp["end_ns"] - pp["start_ns"]) / 1e9).groupby(["stage", "rank", "step"])["d"].sum()
        pipeline = pc.rename("compute_s").reset_index()
        pipeline = pipeline.merge(steps_out[["rank", "step", "duration_s"]], on=["rank", "step"])
        pipeline["bubble_frac"] = 1 - pipeline["compute_s"] / pipeline["duration_s"]
        p = pipeline["stage"].nunique()
        m = int(pp["microbatch"].max()) + 1
        pipeline["theoretical_bubble_frac"] = (p - 1) / (m + p - 1)
        pipeline = pipeline[["stage", "rank", "step", "bubble_frac", "compute_s", "theoretical_bubble_frac"]]
        pipeline["stage"] = pipeline["stage"].astype("int64")

    nv = run.nvml
    gpu = nv.groupby(["host", "gpu"], observed=True).agg(
        sm_util_mean_pct=("sm_util_pct", "mean"), mem_bw_util_mean_pct=("mem_bw_util_pct", "mean"),
        power_w_mean=("power_w", "mean")).reset_index()
    gpu["idle_frac"] = 0.0
    gpu["throttled_s"] = 0.0
    gpu = gpu[["host", "gpu", "sm_util_mean_pct", "mem_bw_util_mean_pct", "idle_frac", "throttled_s",
               "power_w_mean"]]
    mem = steps_out.groupby("rank")["peak_mem_bytes"].max().astype("float").to_frame()
    mem["device_mem_total_bytes"] = ranks["device_mem_total_bytes"].astype("float")
    mem["headroom_frac"] = 1 - mem["peak_mem_bytes"] / mem["device_mem_total_bytes"]
    memory = mem.reset_index()
    clock = pd.DataFrame({"host": sorted(set(run.ranks["host"].astype(str))), "offset_ns": 0, "drift_ppm": 0.0,
                          "residual_ns": 0})

    step_p50 = float(np.percentile(per_step, 50))
    tokens = steps[steps["step"] >= warmup].groupby("step")["tokens"].sum().mean()
    flops = 6 * 1e9 * tokens
    W = run.world_size
    exposed = measured["exposed_comm_s"].sum()
    summary = {
        "run": {"path": str(run.path), "world_size": W, "hosts": run.hosts, "status": run.nodes[0].get("status"),
                "status_reason": run.nodes[0].get("status_reason", ""),
                "duration_s": (steps["end_ns"].max() - steps["start_ns"].min()) / 1e9},
        "steps": {"count": int(per_step.size), "warmup_steps": warmup, "per_step_time_s": per_step.tolist(),
                  "step_time_p50_s": step_p50, "step_time_p90_s": float(np.percentile(per_step, 90)),
                  "tokens_per_s": float(tokens / per_step.mean()),
                  "samples_per_s": float(steps[steps["step"] >= warmup].groupby("step")["samples"].sum().mean()
                                         / per_step.mean())},
        "mfu": {"mfu_frac": float(flops / (step_p50 * W * peak_tflops * 1e12)), "flops_per_step": flops,
                "flops_source": "user (--flops-per-step)", "peak_tflops": peak_tflops,
                "peak_source": "spec sheet: NVIDIA H100 SXM bf16 dense", "dtype": "bf16"},
        "comm": {"exposed_comm_s": float(exposed), "exposed_comm_frac": float(exposed / measured["duration_s"].sum()),
                 "overlap_ratio": float(1 - exposed / measured["comm_s"].sum())},
        "pipeline": None if pipeline is None else {
            "bubble_frac": float(pipeline["bubble_frac"].mean()),
            "theoretical_bubble_frac": float(pipeline["theoretical_bubble_frac"].mean())},
        "stragglers": [{"rank": int(r.rank), "host": r.host, "kind": r.kind, "time_lost_s": float(r.time_lost_s)}
                       for r in strag_out[strag_out["kind"] != "none"].itertuples()],
    }
    findings = [
        {"id": "exposed-comm", "severity": "warning",
         "message": f"{summary['comm']['exposed_comm_frac']:.0%} of step time is exposed communication",
         "evidence": "comm_wait spans per rank and step", "recommendation": "Increase bucket size or overlap.",
         "chart": "overlap"},
        {"id": "info-mfu", "severity": "info", "message": "MFU computed from user-supplied FLOPs",
         "evidence": "", "recommendation": "", "chart": "headline"},
    ]
    for s in summary["stragglers"]:
        findings.append({"id": f"straggler-{s['rank']}", "severity": "critical",
                         "message": f"rank {s['rank']} on {s['host']} is a {s['kind']} straggler",
                         "evidence": f"last to arrive; {s['time_lost_s']:.3f} s lost",
                         "recommendation": "Check the GPU's clocks and temperature.", "chart": "stragglers"})
    return FakeAnalysis(summary=summary, steps=steps_out, collectives=coll_out, arrivals=arrivals,
                        stragglers=strag_out, pipeline=pipeline, gpu=gpu, memory=memory, clock=clock,
                        findings=findings)
