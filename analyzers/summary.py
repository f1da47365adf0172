"""The analysis of a run end to end, and summary.json (docs/summary-schema.md).

``analyze(run)`` runs every analyzer over the run's tables and returns an ``Analysis``: the summary dict plus the
DataFrames behind each figure (BRIEF §4). ``write_summary(run_dir)`` also writes ``summary.json`` into the run.
``format_summary_text(summary)`` is the short per-rank table the launcher prints at the end of a job.

Options default to the launcher's record in ``node.json`` ``config`` (keys ``flops_per_step``, ``peak_tflops``,
``dtype``, ``transformer``, ``warmup``) and are overridden by explicit arguments.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from dtprof.analyzers import clock as clock_mod
from dtprof.analyzers import collectives as coll_mod
from dtprof.analyzers import findings as findings_mod
from dtprof.analyzers import gpu as gpu_mod
from dtprof.analyzers import mfu as mfu_mod
from dtprof.analyzers import overlap as overlap_mod
from dtprof.analyzers import pipeline as pipeline_mod
from dtprof.analyzers import steps as steps_mod
from dtprof.analyzers import stragglers as strag_mod

SUMMARY_SCHEMA = "dtprof.summary/1"
SUMMARY_FILE = "summary.json"
STATUS_ORDER = ("hung", "killed", "failed", "interrupted", "running", "completed")


@dataclass
class Analysis:
    summary: dict
    steps: pd.DataFrame          # per rank × step
    collectives: pd.DataFrame    # per op × group × size bucket
    arrivals: pd.DataFrame       # per collective instance × rank
    stragglers: pd.DataFrame     # per rank
    pipeline: pd.DataFrame | None  # per stage × step
    gpu: pd.DataFrame            # per GPU
    memory: pd.DataFrame         # per rank
    clock: pd.DataFrame          # per host
    findings: list = field(default_factory=list)
    job_steps: pd.DataFrame | None = None   # per step: step, time_s, warmup, tokens, samples
    instances: pd.DataFrame | None = None   # per collective instance: transfer time, bytes
    pipeline_ops: pd.DataFrame | None = None  # per compute op of a pipeline rank: measured and replayed times


def _node_config(run) -> dict:
    cfg: dict = {}
    for n in run.nodes:
        c = n.get("config")
        if isinstance(c, dict):
            for k, v in c.items():
                cfg.setdefault(k, v)
    return cfg


def _run_block(run) -> dict:
    statuses = [str(n.get("status", "")) for n in run.nodes if n.get("status")]
    status = next((s for s in STATUS_ORDER if s in statuses), statuses[0] if statuses else None)
    codes = [n.get("exit_code") for n in run.nodes if n.get("exit_code") is not None]
    exit_code = next((c for c in codes if c != 0), codes[0] if codes else None)
    out = {"world_size": int(run.world_size), "hosts": run.hosts, "status": status, "exit_code": exit_code,
           "path": str(run.path), "nodes": len(run.nodes)}
    if status == "interrupted":
        out["status_reason"] = next(n["status_reason"] for n in run.nodes if n.get("status") == "interrupted")
    if status is None:
        out["status_reason"] = "no node.json records the job's end (still running, or the launcher was killed)"
    return out


def _per_rank_block(run, steps: pd.DataFrame, strag: pd.DataFrame) -> list[dict]:
    meas = steps[~steps["warmup"]]
    if len(meas) == 0:
        meas = steps
    g = meas.groupby("rank")
    agg = g.agg(steps=("step", "size"), step_time_s_p50=("duration_s", "median"),
                compute_s_per_step=("compute_s", "mean"), comm_s_per_step=("comm_s", "mean"),
                exposed_comm_s_per_step=("exposed_comm_s", "mean"), comm_wait_s_per_step=("comm_wait_s", "mean"),
                data_wait_s_per_step=("data_wait_s", "mean"), overlap_s=("overlap_s", "sum"),
                comm_s=("comm_s", "sum"), peak_mem_bytes=("peak_mem_bytes", "max"))
    agg["overlap_ratio"] = np.where(agg["comm_s"] > 0, agg["overlap_s"] / agg["comm_s"].where(agg["comm_s"] > 0, 1),
                                    np.nan)
    r = run.ranks
    out = pd.DataFrame({"rank": r["rank"].to_numpy(np.int64), "host": r["host"].astype(str).to_numpy(),
                        "device": r["device_name"].astype(str).to_numpy()})
    extra = sorted(set(agg.index) - set(out["rank"]))  # ranks with steps but no identity row
    if extra:
        out = pd.concat([out, pd.DataFrame({"rank": extra, "host": None, "device": None})], ignore_index=True)
    out = out.sort_values("rank").reset_index(drop=True)
    out["steps_recorded"] = steps.groupby("rank").size().reindex(out["rank"]).fillna(0).astype(int).to_numpy()
    out["steps"] = agg["steps"].reindex(out["rank"]).fillna(0).astype(int).to_numpy()
    for k in ("step_time_s_p50", "compute_s_per_step", "comm_s_per_step", "exposed_comm_s_per_step",
              "overlap_ratio", "comm_wait_s_per_step", "data_wait_s_per_step", "peak_mem_bytes"):
        out[k] = agg[k].reindex(out["rank"]).astype(float).to_numpy()
    score = strag.set_index("rank")["compute_score"] if len(strag) else pd.Series(dtype=float)
    out["compute_score"] = score.reindex(out["rank"]).astype(float).to_numpy()
    return out.to_dict("records")


def _clean(x: Any) -> Any:
    """JSON-safe: numpy scalars to Python, NaN/NA to None."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if x is None or x is pd.NA or x is pd.NaT:
        return None
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return None if math.isnan(float(x)) or math.isinf(float(x)) else float(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def analyze(run, *, warmup: int | None = None, flops_per_step: float | None = None,
            peak_tflops: float | None = None, dtype: str | None = None, transformer: dict | None = None,
            progress: Callable[[str], None] | None = None) -> Analysis:
    """Analyse a run (a ``Run`` or a path). ``dtype`` None means node.json config's dtype, else "bf16".
    ``progress`` is called with a short message before each stage."""
    from dtprof.reader import Run, open_run

    run = run if isinstance(run, Run) else open_run(run)
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    cfg = _node_config(run)
    warmup = warmup if warmup is not None else cfg.get("warmup")
    flops_per_step = flops_per_step if flops_per_step is not None else cfg.get("flops_per_step")
    peak_tflops = peak_tflops if peak_tflops is not None else cfg.get("peak_tflops")
    dtype = dtype or cfg.get("dtype") or "bf16"
    transformer = transformer if transformer is not None else cfg.get("transformer")

    say("reading tables")
    _ = run.steps, run.spans, run.collectives
    say("steps")
    st = steps_mod.step_times(run, warmup)
    say("compute/communication overlap")
    ov = overlap_mod.rank_step_overlap(run, st.per_rank)
    steps = st.per_rank.copy()
    for c in ("compute_s", "comm_s", "exposed_comm_s", "comm_wait_s", "data_wait_s", "overlap_ratio", "overlap_s",
              "level"):
        steps[c] = ov.per_step[c].to_numpy()
    steps = steps[["rank", "step", "start_ns", "end_ns", "duration_s", "compute_s", "comm_s", "exposed_comm_s",
                   "comm_wait_s", "data_wait_s", "overlap_ratio", "warmup", "peak_mem_bytes", "overlap_s", "level",
                   "tokens", "samples", "model_flops", "executed_flops"]]
    measured = steps[~steps["warmup"]]
    step_block = steps_mod.step_stats(st)

    say("clock alignment")
    clk = clock_mod.fit_clocks(run)
    say("collective arrivals and stragglers")
    measured_steps = set(st.job.loc[~st.job["warmup"], "step"].tolist())
    arr = strag_mod.arrivals(run, clk, measured_steps)
    strag = strag_mod.classify(run, arr, steps, step_block["time_s"]["p50"])
    say("GPU and memory")
    gpus = gpu_mod.gpu_stats(run)
    rg = gpu_mod.rank_gpu(run, gpus)
    mem = gpu_mod.memory(run, steps, gpus)
    evidence = strag_mod.nvml_evidence(strag, rg, gpus)
    say("collective bandwidth")
    inst = coll_mod.instances(run)
    coll = coll_mod.collective_table(run, inst)
    say("pipeline")
    pp = pipeline_mod.analyze_pipeline(run, steps)
    say("MFU")
    mfu = mfu_mod.compute_mfu(run, st.per_rank, st.job, flops_per_step=flops_per_step, peak_tflops=peak_tflops,
                              dtype=dtype, transformer=transformer)

    stragglers_list = []
    for s in strag[strag["kind"] != "none"].itertuples(index=False):  # flagged ranks only
        stragglers_list.append({"rank": int(s.rank), "host": s.host, "device": s.device, "kind": s.kind,
                                "time_lost_s": float(s.time_lost_s), "score": s.compute_score,
                                "late_frac": float(s.late_frac), "delay_s_per_step": float(s.delay_s_per_step),
                                "reason": s.reason, "evidence": evidence.get(int(s.rank), [])})
    problems = list(run.problems)
    if ov.unassigned:
        problems.append(f"{ov.unassigned} span(s)/collective(s) started outside every step window and were not "
                        f"counted in per-step figures")
    arr_out = arr.drop(columns=["inst", "measured"], errors="ignore")
    summary = {
        "schema": SUMMARY_SCHEMA,
        "generated_by": "dtprof.analyzers",
        "run": _run_block(run),
        "steps": step_block,
        "ranks": _per_rank_block(run, steps, strag),
        "mfu": mfu,
        "overlap": overlap_mod.whole_run(measured if len(measured) else steps),
        "pipeline": pp.summary if pp else None,
        "stragglers": stragglers_list,
        "collectives": coll.to_dict("records"),
        "clock": clk.to_dict("records"),
        "gpus": gpus.to_dict("records"),
        "memory": {"peak_mem_bytes_max": (float(mem["peak_mem_bytes"].max())
                                          if mem["peak_mem_bytes"].notna().any() else None),
                   "headroom_frac_min": (float(mem["headroom_frac"].min())
                                         if mem["headroom_frac"].notna().any() else None)},
        "options": {"warmup": warmup, "flops_per_step": flops_per_step, "peak_tflops": peak_tflops, "dtype": dtype,
                    "transformer": transformer},
        "problems": problems,
    }
    _add_mesh(summary, run, steps)
    if pp is None:
        summary["pipeline_reason"] = "no pipeline stage spans (pp_forward/pp_backward) inside this run's steps"
    if not stragglers_list:
        summary["stragglers_reason"] = "no rank is a straggler by compute score or collective arrival"
    if summary["memory"]["headroom_frac_min"] is None:
        summary["memory"]["headroom_frac_min_reason"] = "device memory size unknown"
    analysis = Analysis(summary=summary, steps=steps, collectives=coll, arrivals=arr_out, stragglers=strag,
                        pipeline=pp.table if pp else None, pipeline_ops=pp.ops if pp else None, gpu=gpus,
                        memory=mem, clock=clk, job_steps=st.job, instances=inst)
    say("findings")
    summary["findings"] = findings_mod.find(summary, analysis)
    analysis.findings = summary["findings"]
    summary["analysis_s"] = time.perf_counter() - t0
    analysis.summary = _clean(summary)
    return analysis


def _add_mesh(summary: dict, run, steps) -> None:
    """Hybrid parallelism (analyzers/mesh.py): communication and exposed communication per DeviceMesh dimension,
    the costliest dimension, the bubble of each pipeline group, and each straggler's group in every dimension."""
    from dtprof.analyzers import mesh

    block = mesh.mesh_summary(run.groups, run.collectives, steps, run.events)
    if block is None:
        summary["mesh"] = None
        summary["mesh_reason"] = "no DeviceMesh dimensions recorded (groups.mesh_dim is empty)"
        return
    pp = mesh.pipeline_bubble_by_group(run.groups, run.spans, steps)
    block["pipeline_groups"] = [
        {"group": str(r.group), "ranks": [int(x) for x in str(r.ranks).split(",")], "stages": int(r.stages),
         "bubble_frac": float(r.bubble_frac), "bubble_frac_max": float(r.bubble_frac_max)}
        for r in pp.itertuples()]
    summary["mesh"] = block
    for s in summary["stragglers"]:
        s["mesh_groups"] = mesh.mesh_groups_of_rank(run.groups, s["rank"])


def save_summary(run_dir, summary: dict) -> Path:
    """Write ``summary`` as ``run_dir/summary.json`` (atomically: a reader sees the old file or the new one)."""
    from dtprof.runformat import write_json_atomic

    path = Path(run_dir) / SUMMARY_FILE
    write_json_atomic(path, summary)
    return path


def write_summary(run_dir, *, warmup=None, flops_per_step=None, peak_tflops=None, dtype=None, transformer=None,
                  progress=None) -> dict:
    """Analyse the run at ``run_dir`` and write ``run_dir/summary.json`` (atomically). Returns the summary."""
    from dtprof.reader import open_run

    run = open_run(run_dir)
    a = analyze(run, warmup=warmup, flops_per_step=flops_per_step, peak_tflops=peak_tflops, dtype=dtype,
                transformer=transformer, progress=progress)
    save_summary(run.path, a.summary)
    return a.summary


def _fmt_s(x) -> str:
    if x is None:
        return "—"
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e6:.0f} µs"


def _fmt_frac(x) -> str:
    return "—" if x is None else f"{x:.0%}"


def format_summary_text(summary: dict) -> str:
    """The short per-rank table printed at the end of a run, plus the headline lines."""
    lines = []
    run = summary.get("run") or {}
    st = summary.get("steps") or {}
    t = st.get("time_s") or {}
    lines.append(f"dtprof summary: {run.get('world_size', '?')} rank(s) on {len(run.get('hosts') or [])} host(s), "
                 f"status {run.get('status') or 'unknown'}, exit code {run.get('exit_code')}")
    if run.get("status") == "interrupted":
        lines.append(run.get("status_reason") or "interrupted")
    lines.append(f"steps: {st.get('count', 0)} measured ({st.get('warmup_steps', 0)} warm-up excluded); "
                 f"step time p50 {_fmt_s(t.get('p50'))}, p90 {_fmt_s(t.get('p90'))}, "
                 f"p99 {_fmt_s(t.get('p99'))}")
    hdr = f"{'rank':>5} {'host':<14} {'steps':>5} {'step p50':>10} {'compute/step':>13} {'comm/step':>10} " \
          f"{'exposed/step':>13} {'overlap':>8}"
    lines.append(hdr)
    for r in summary.get("ranks") or []:
        lines.append(f"{r['rank']:>5} {str(r.get('host') or '')[:14]:<14} {r.get('steps', 0):>5} "
                     f"{_fmt_s(r.get('step_time_s_p50')):>10} {_fmt_s(r.get('compute_s_per_step')):>13} "
                     f"{_fmt_s(r.get('comm_s_per_step')):>10} {_fmt_s(r.get('exposed_comm_s_per_step')):>13} "
                     f"{_fmt_frac(r.get('overlap_ratio')):>8}")
    m = summary.get("mfu") or {}
    if m.get("value") is not None:
        lines.append(f"MFU: {m['value']:.1%} ({m.get('flops_source')}; peak: {m.get('peak_source')})")
    else:
        lines.append(f"MFU: n/a ({m.get('value_reason') or m.get('peak_reason') or m.get('flops_reason')})")
    ov = summary.get("overlap") or {}
    lines.append(f"overlap: {_fmt_frac(ov.get('ratio'))} of communication hidden behind compute; exposed "
                 f"communication {_fmt_frac(ov.get('exposed_comm_frac'))} of step time")
    pp = summary.get("pipeline")
    if pp:
        lines.append(f"pipeline: {pp['stages']} stages × {pp['microbatches']} microbatches ({pp['schedule']}), "
                     f"bubble {_fmt_frac(pp.get('bubble_frac'))} (theoretical "
                     f"{_fmt_frac(pp.get('theoretical_bubble_frac'))}), imbalance "
                     f"{'—' if pp.get('imbalance') is None else format(pp['imbalance'], '.2f')}×")
    sl = summary.get("stragglers") or []
    if sl:
        lines.append("stragglers: " + "; ".join(
            f"rank {s['rank']} ({s['host']}) {s['kind']}, peers lost {_fmt_s(s['time_lost_s'])}" for s in sl))
    else:
        lines.append("stragglers: none")
    for f in summary.get("findings") or []:
        lines.append(f"[{f['severity']}] {f['message']}")
    return "\n".join(lines)
