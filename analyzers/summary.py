"""The analysis of a run end to end, and summary.json (docs/summary-schema.md).

``analyze(run)`` runs every analyzer over the run's tables and returns an ``Analysis``: the summary dict plus the
DataFrames behind each figure; dtprof/rundir/writer.py ``save_summary`` writes summary.json into the run (the commands
do: they open the run and analyse it, dtprof/options.py ``open_and_analyze``).

The analysis depends only on the run's tables and one ``AnalysisOptions`` (analyzers/options.py), resolved at the
command-line edge (dtprof/options.py ``resolve_options``: command line, then node.json ``config``, then defaults;
device peaks with their sources) and recorded in summary.json ``options``.
"""
from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple, Protocol

import numpy as np
import pandas as pd

from dtprof.analyzers import breakdown as breakdown_mod
from dtprof.analyzers import collectives as coll_mod
from dtprof.analyzers import findings as findings_mod
from dtprof.analyzers import gpu as gpu_mod
from dtprof.analyzers import kernel_breakdown as kernels_mod
from dtprof.analyzers import memory as memory_mod
from dtprof.analyzers import mesh as mesh_mod
from dtprof.analyzers import mfu as mfu_mod
from dtprof.analyzers import nodesummary as nodesummary_mod
from dtprof.analyzers import overlap as overlap_mod
from dtprof.analyzers import pipeline as pipeline_mod
from dtprof.analyzers import steps as steps_mod
from dtprof.analyzers import stragglers as strag_mod
from dtprof.analyzers import whatif as whatif_mod
from dtprof.analyzers.options import AnalysisOptions
from dtprof.analyzers.runmodel import RunModel
from dtprof.rundir.writer import UNIDENTIFIED_EVENT

SUMMARY_SCHEMA = "dtprof.summary/1"
# the spans the summaries path reads (besides every span of a pipeline rank): GPU kernels, for the kernel views
SLICE_KINDS = ("kernel", "evaluation")
STATUS_ORDER = ("hung", "killed", "failed", "interrupted", "running", "completed", "imported")   # worst first


def worst_status(statuses) -> str | None:
    """The job's status from its nodes' statuses: the worst by STATUS_ORDER (the one place it is decided)."""
    statuses = [str(s) for s in statuses if s]
    return next((s for s in STATUS_ORDER if s in statuses), statuses[0] if statuses else None)


@dataclass
class Analysis:
    summary: dict
    steps: pd.DataFrame          # per rank × step
    collectives: pd.DataFrame    # per op × group × size bucket
    arrivals: pd.DataFrame       # per collective instance: its last arriver (stragglers.arrivals)
    stragglers: pd.DataFrame     # per rank
    pipeline: pd.DataFrame | None  # per stage × step
    gpu: pd.DataFrame            # per GPU
    memory: pd.DataFrame         # per rank
    clock: pd.DataFrame          # per host
    findings: list = field(default_factory=list)
    job_steps: pd.DataFrame | None = None   # per step: step, time_s, warmup, tokens, samples
    instances: pd.DataFrame | None = None   # per collective instance: transfer time, bytes
    pipeline_ops: pd.DataFrame | None = None  # per compute op of a pipeline rank: measured and replayed times
    model: Any = None            # the run model (analyzers/runmodel.py): derived columns every view reads
    exposed: pd.DataFrame | None = None   # per rank × step × mesh dim × op: exposed communication (breakdown.py)
    triage: dict | None = None   # the incident verdict with its evidence (analyzers/triage.py), None if it failed
    notices: list = field(default_factory=list)   # what the report lists under "Notices" (run_notices)
    flagged: pd.DataFrame | None = None   # the rows of ``stragglers`` whose rank is flagged (stragglers.flagged)
    # indexes into summary ``what_if`` of the entries that remove a rank the straggler rule does not name: shown
    # "(not a straggler)" (is_unnamed_suspect)
    unnamed_suspects: list = field(default_factory=list)
    # one line per earlier attempt of a restarted rank and what the statistics cover (triage.restart_lines of
    # summary ``run``): the terminal's "[restart]" lines
    restart_lines: list = field(default_factory=list)
    run: Any = None              # the dtprof.rundir.run.Run analysed (raw spans: the timeline)
    # the run's identity from its manifests, as the page's header shows it (run_identity); made from ``run``
    identity: dict | None = None

    def __post_init__(self):
        if self.flagged is None and self.stragglers is not None:
            self.flagged = strag_mod.flagged(self.stragglers)
        if self.identity is None and self.run is not None:
            self.identity = run_identity(self.run)


def run_identity(run) -> dict:
    """What names the run beside summary.json's ``run`` block: its directory's name, the command that ran it (the
    first node's, else the manifest's), the devices of its ranks (name -> count) and the versions its nodes
    recorded (later nodes' over earlier ones')."""
    node = (run.nodes or [{}])[0]
    ranks = run.ranks
    devices = ranks.groupby(ranks["device_name"].astype(str)).size() if len(ranks) else {}
    versions: dict = {}
    for n in run.nodes:
        versions.update(n.get("versions") or {})
    return {"name": run.path.name, "command": node.get("command") or run.manifest.get("command") or "",
            "devices": {str(k): int(v) for k, v in devices.items()}, "versions": versions}


def _run_block(run) -> dict:
    status = worst_status(n.get("status") for n in run.nodes)
    codes = [n.get("exit_code") for n in run.nodes if n.get("exit_code") is not None]
    exit_code = next((c for c in codes if c != 0), codes[0] if codes else None)
    durations = [n["duration_s"] for n in run.nodes if isinstance(n.get("duration_s"), (int, float))]
    starts = sorted(str(n["start_time"]) for n in run.nodes if n.get("start_time"))
    out = {"world_size": int(run.world_size), "hosts": [h for h in run.hosts if h], "status": status,
           "exit_code": exit_code, "path": str(run.path), "nodes": len(run.nodes),
           "duration_s": max(durations) if durations else None, "start_time": starts[0] if starts else None}
    out.update(_machine_block(run.nodes))
    out["model"] = _model_block(run.meta)
    if status == "interrupted":
        out["status_reason"] = next(n["status_reason"] for n in run.nodes if n.get("status") == "interrupted")
    if status is None:
        out["status_reason"] = "no node.json records the job's end (still running, or the launcher was killed)"
    if exit_code is None:
        out["exit_code_reason"] = ("an imported trace has no job exit code" if status == "imported" else
                                   "no node.json records the job's exit code")
    if not durations:
        out["duration_s_reason"] = ("an imported trace records no job duration" if status == "imported" else
                                    "no node.json records the job's end")
    if not out["hosts"]:
        out["hosts_reason"] = "not recorded" + (" in an imported trace" if status == "imported" else "")
    out.update(_rank_coverage(run))
    out["restarts"] = run.restarts
    out["attempts"] = {str(r): a for r, a in sorted(run.attempts.items())}
    return out



def _rank_coverage(run) -> dict:
    """Ranks of the world that left no record, and processes that could not be recorded as a rank
    (collectors/identity.py writes one error event for each)."""
    recorded = set(run.ranks["rank"].astype(int)) if len(run.ranks) else set()
    ev = run.events
    unidentified = (ev.loc[ev["message"].astype(str).str.startswith(UNIDENTIFIED_EVENT), "message"].astype(str)
                    .tolist() if len(ev) else [])
    return {"ranks_recorded": len(recorded),
            "ranks_missing": sorted(set(range(int(run.world_size))) - recorded),
            "unidentified_processes": unidentified}


def _machine_block(nodes: list[dict]) -> dict:
    """``identity``, ``versions`` and ``probe`` of the run from its nodes' node.json (dtprof/machine.py): the first
    node's identity and versions; the CPU probe's timings pooled over nodes (before, during and after the job)."""
    ident = next((n["identity"] for n in nodes if isinstance(n.get("identity"), dict)), None)
    vers = next((n["versions"] for n in nodes if isinstance(n.get("versions"), dict)), None)
    probes = [n["probe"] for n in nodes if isinstance(n.get("probe"), dict)]
    start = [float(x) for p in probes for x in (p.get("cpu_start_s") or [])]
    end = [float(x) for p in probes for x in (p.get("cpu_end_s") or [])]
    probe = None
    if start or end:
        probe = {"work": probes[0].get("work"), "cpu_start_s": start, "cpu_end_s": end,
                 "cpu_s_median": float(np.median(start + end))}
        probe.update(_gpu_probe(probes))
        job = [float(x) for p in probes for x in (p.get("cpu_job_s") or [])]   # during the job (older runs: none)
        probe.update(cpu_job_s=job or None, job_work=next((p.get("job_work") for p in probes if p.get("cpu_job_s")),
                                                         None))
    out: dict = {"identity": ident, "versions": vers, "probe": probe}
    if probe is None:
        out["probe_reason"] = "no node.json records a machine probe (imported, or recorded by an older dtprof)"
    return out


def _model_block(meta: pd.DataFrame) -> dict:
    """The model each rank ran (``model`` meta rows, collectors/runtime.py): ``parameters`` when every recorded rank
    holds the same count (data parallel, DTensor-sharded), else null beside ``parameters_by_rank`` (pipeline
    stages, plain tensor-parallel shards); ``parameters_reason`` when no rank recorded one."""
    rows = meta.loc[meta["kind"].astype(str) == "model", ["rank", "value"]] if len(meta) else meta
    by_rank = {int(r): int(v["parameters"]) for r, v in zip(rows["rank"], rows["value"]) if isinstance(v, dict)}
    if not by_rank:
        return {"parameters": None, "parameters_by_rank": None,
                "parameters_reason": "no rank recorded its model (no module forward in step 0, an imported trace, "
                                     "or recorded by an older dtprof)"}
    counts = set(by_rank.values())
    modules = sorted({m for v in rows["value"] if isinstance(v, dict) for m in v.get("modules") or []})
    return {"parameters": counts.pop() if len(counts) == 1 else None,
            "parameters_by_rank": {str(r): n for r, n in sorted(by_rank.items())}, "modules": modules}


def _gpu_probe(probes: list[dict]) -> dict:
    """The GPU probe's timings pooled over nodes and devices (``gpu_start_s``, ``gpu_end_s``, the ``gpu_devices``
    probed as "node N:index name", N the node's position in the run), or ``gpu_reason``: why there is none (the
    first node's reason)."""
    start: list[float] = []
    end: list[float] = []
    devices: list[str] = []
    for i, p in enumerate(probes):
        for key, pooled in (("gpu_start", start), ("gpu_end", end)):
            for d in p.get(key) or []:
                pooled += [float(x) for x in d.get("timings_s") or []]
                if key == "gpu_start":
                    devices.append(f"node {i}:{d.get('index')} {d.get('name')}")
    if not start and not end:
        reason = next((p["gpu_reason"] for p in probes if p.get("gpu_reason")),
                      "no node.json records a GPU probe (recorded by an older dtprof)")
        return {"gpu_start_s": None, "gpu_end_s": None, "gpu_reason": reason}
    out = {"gpu_work": next(p.get("gpu_work") for p in probes if p.get("gpu_start")), "gpu_start_s": start,
           "gpu_end_s": end, "gpu_s_median": float(np.median(start + end)), "gpu_devices": devices}
    end_reasons = [p["gpu_end_reason"] for p in probes if p.get("gpu_end_reason")]
    if end_reasons:
        out["gpu_end_reason"] = end_reasons[0]
    return out


def _per_rank_block(run, steps: pd.DataFrame, strag: pd.DataFrame, bd, gpu_time: dict) -> list[dict]:
    """summary.json ``ranks``: per rank its step figures, breakdown and GPU time (``gpu_time``: kernels.gpu_time)."""
    mask = steps["measured"].to_numpy(bool)
    if not mask.any():
        mask = np.ones(len(steps), bool)
    g = steps_mod.ByRank(steps["rank"].to_numpy(), mask)   # per rank over the measured rows
    parts = breakdown_mod.rank_means(bd, g, steps["duration_s"])

    def by_rank(col: str, how: str) -> pd.Series:
        return g.agg(steps[col], how)

    agg = pd.DataFrame({"steps": g.size(), "step_time_s_p50": by_rank("duration_s", "median")})
    for c in ("compute_s", "comm_s", "exposed_comm_s", "comm_wait_s", "data_wait_s", "cpu_wait_s"):
        agg[f"{c}_per_step"] = by_rank(c, "mean")
    agg["overlap_s"], agg["comm_s"] = by_rank("overlap_s", "sum"), by_rank("comm_s", "sum")
    agg["peak_mem_bytes"] = by_rank("peak_mem_bytes", "max")
    agg["overlap_ratio"] = np.where(agg["comm_s"] > 0, agg["overlap_s"] / agg["comm_s"].where(agg["comm_s"] > 0, 1),
                                    np.nan)
    r = run.ranks
    out = pd.DataFrame({"rank": r["rank"].to_numpy(np.int64), "host": r["host"].astype(str).to_numpy(),
                        "device": r["device_name"].astype(str).to_numpy()})
    extra = sorted(set(agg.index) - set(out["rank"]))  # ranks with steps but no identity row
    if extra:
        out = pd.concat([out, pd.DataFrame({"rank": extra, "host": None, "device": None})], ignore_index=True)
    out = out.sort_values("rank").reset_index(drop=True)
    out["steps_recorded"] = (pd.Series(g.recorded, index=pd.Index(g.ranks)).reindex(out["rank"]).fillna(0)
                             .astype(int).to_numpy())
    out["steps"] = agg["steps"].reindex(out["rank"]).fillna(0).astype(int).to_numpy()
    for k in ("step_time_s_p50", "compute_s_per_step", "comm_s_per_step", "exposed_comm_s_per_step",
              "overlap_ratio", "comm_wait_s_per_step", "data_wait_s_per_step", "peak_mem_bytes",
              "cpu_wait_s_per_step"):
        out[k] = agg[k].reindex(out["rank"]).astype(float).to_numpy()
    score = strag.set_index("rank")["compute_score"] if len(strag) else pd.Series(dtype=float)
    out["compute_score"] = score.reindex(out["rank"]).astype(float).to_numpy()
    records = out.to_dict("records")
    parts_of = parts.to_dict("index")   # one dict per rank, not a lookup per rank and part
    for rec in records:   # the step breakdown (breakdown.py): parts that sum to step_time_s_mean
        p = parts_of.get(rec["rank"])
        rec["step_time_s_mean"] = float(p["step_time_s_mean"]) if p else None
        rec["breakdown_s_per_step"] = {q: float(p[f"{q}_s"]) for q in breakdown_mod.PARTS} if p else None
        rec["exposed_comm_s_per_step_by_dim"] = p["exposed_by_dim"] if p else None
        rec["exposed_comm_s_per_step_by_op"] = p["exposed_by_op"] if p else None
        rec["exposed_comm_s_per_step_by_issued"] = p["exposed_by_issued"] if p else None
        rec["gpu_time"] = gpu_time.get(int(rec["rank"]))
    return records


def _cpu_wait_block(ranks: list[dict], step_block: dict) -> dict | None:
    """summary.json ``cpu_wait``: how long the ranks' training threads waited for a CPU (runnable, not running: other
    processes or threads held the cores) per measured step, as a share of the mean step; None where no rank
    reported it (not Linux, or a run recorded before dtprof measured it)."""
    got = [r for r in ranks if r.get("cpu_wait_s_per_step") is not None and np.isfinite(r["cpu_wait_s_per_step"])]
    mean_step = (step_block.get("time_s") or {}).get("mean")
    if not got or not mean_step:
        return None
    worst = max(got, key=lambda r: r["cpu_wait_s_per_step"])
    per_step = float(np.mean([r["cpu_wait_s_per_step"] for r in got]))
    return {"s_per_step": per_step, "frac_of_step": per_step / mean_step, "ranks": len(got),
            "worst_rank": int(worst["rank"]), "worst_s_per_step": float(worst["cpu_wait_s_per_step"])}


def _evaluation_block(spans: pd.DataFrame, steps: pd.DataFrame) -> dict | None:
    """summary.json ``evaluation``: the evaluation stretches between steps (``evaluation`` spans: forwards of the
    trained model without gradients; collectors/runtime.py), of the rank that spent longest in them: how many,
    their total time and its share of that rank's time from its first step's start to its last
    step's or evaluation's end. None when the run has none."""
    ev = spans[spans["kind"].astype(str) == "evaluation"]
    if ev.empty:
        return None
    dur = (ev["end_ns"] - ev["start_ns"]).to_numpy(np.int64)
    total = pd.Series(dur).groupby(ev["rank"].to_numpy(np.int64)).sum()
    rank = int(total.idxmax())
    mine = ev[ev["rank"].to_numpy(np.int64) == rank]
    st = steps[steps["rank"].to_numpy(np.int64) == rank]
    first = int(min(st["start_ns"].min(), mine["start_ns"].min())) if len(st) else int(mine["start_ns"].min())
    last = int(max(st["end_ns"].max(), mine["end_ns"].max())) if len(st) else int(mine["end_ns"].max())
    total_s = float(total.loc[rank]) / 1e9
    return {"rank": rank, "stretches": len(mine), "total_s": total_s,
            "wall_frac": total_s / ((last - first) / 1e9) if last > first else None}


def _breakdown_block(ranks: list[dict], pipeline_ranks: list[int], gpu_ranks: list[int]) -> dict:
    """summary.json ``breakdown``: the parts' order (``gpu_wait`` only where a rank has a GPU: a CPU rank's is 0 by
    definition) and the mean over ranks of each rank's breakdown."""
    rows = [r for r in ranks if r.get("breakdown_s_per_step")]
    parts = [p for p in breakdown_mod.PARTS if p != "gpu_wait" or gpu_ranks]
    out: dict = {"parts": parts, "pipeline_ranks": pipeline_ranks, "gpu_ranks": gpu_ranks}
    if not rows:
        out["mean_over_ranks_s_per_step"] = None
        out["mean_over_ranks_s_per_step_reason"] = "no measured steps"
        return out
    n = len(rows)
    out["step_time_s_mean"] = sum(r["step_time_s_mean"] for r in rows) / n
    out["mean_over_ranks_s_per_step"] = {p: sum(r["breakdown_s_per_step"][p] for r in rows) / n
                                         for p in breakdown_mod.PARTS}
    for key, col in (("exposed_comm_by_dim_s_per_step", "exposed_comm_s_per_step_by_dim"),
                     ("exposed_comm_by_op_s_per_step", "exposed_comm_s_per_step_by_op"),
                     ("exposed_comm_by_issued_s_per_step", "exposed_comm_s_per_step_by_issued")):
        tot: dict = {}
        for r in rows:
            for k, v in (r[col] or {}).items():
                tot[k] = tot.get(k, 0.0) + v / n
        out[key] = dict(sorted(tot.items(), key=lambda kv: -kv[1]))
    return out



def _critical_series(bd, steps: pd.DataFrame) -> dict:
    """summary.json ``breakdown.per_step``: per measured step, the critical rank's parts (breakdown.py
    ``critical_per_step``) as series aligned with ``steps.per_step_index``; what `dtprof compare` decides on."""
    crit = breakdown_mod.critical_per_step(bd, steps["measured"].to_numpy(), steps["duration_s"].to_numpy())
    out: dict = {"step": crit["step"].astype(int).tolist(), "critical_rank": crit["rank"].astype(int).tolist(),
                 "parts": {p: crit[f"{p}_s"].astype(float).tolist() for p in breakdown_mod.PARTS}}
    for what, key in (("dim", "exposed_comm_by_dim"), ("op", "exposed_comm_by_op"),
                      ("issued", "exposed_comm_by_issued")):
        prefix = f"exposed:{what}:"
        out[key] = {c[len(prefix):-2]: crit[c].astype(float).tolist() for c in crit.columns if c.startswith(prefix)}
    return out


def _clean(x: Any) -> Any:
    """JSON-safe: numpy scalars to Python, NaN/NA to None."""
    t = type(x)   # the common leaves first: at 16,384 ranks the summary holds ~0.5 M values
    if t is float:
        return x if math.isfinite(x) else None
    if t is int or t is str or t is bool:
        return x
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


# summary.json's top-level keys in the order its readers find them (docs/summary-schema.md); a key a stage returns
# that is not listed follows them, in the stages' order
SUMMARY_ORDER = (
    "schema", "generated_by", "run", "steps", "ranks", "mfu", "overlap", "pipeline", "stragglers",
    "transient_lateness", "collectives", "collectives_outside_steps", "clock", "gpus", "memory", "options",
    "problems", "cpu_wait", "evaluation", "breakdown", "replay", "what_if", "what_if_skipped", "critical_path",
    "what_if_reason", "mesh", "mesh_reason", "kernels", "gpu_time", "gpu_time_reason", "pipeline_reason",
    "stragglers_reason", "health", "health_reason", "triage", "triage_reason", "findings")


class Stage(NamedTuple):
    """One stage of ``analyze``. ``fn(got)`` reads what the stages before it returned (``got``, read-only: the
    command's inputs ``run``, ``options``, ``source``, ``given_incident``, ``live``, ``stale_s``, ``reduce``; the
    summary so far is ``got["summary"]``) and returns the names it owns: values for the stages after it and the
    Analysis, and under ``"summary"`` its keys of summary.json. No name is set twice. ``message``: the progress line
    before it (a function of ``got`` where it depends on the inputs)."""
    name: str
    fn: Callable[[Mapping[str, Any]], dict]
    message: str | Callable[[Mapping[str, Any]], str] | None = None


class Reduce(Protocol):
    """Starts the per-instance reductions of a run model and its node summaries: (a future of
    ``stragglers.arrivals``, a future of ``collectives.instances_of`` of the measured steps)."""

    def __call__(self, model: RunModel, ns: nodesummary_mod.NodeSummary) -> tuple[Future, Future]: ...


def reduce_here(model: RunModel, ns: nodesummary_mod.NodeSummary) -> tuple[Future, Future]:
    """The per-instance reductions in this process: DuckDB releases the GIL, so they run in a thread, one after the
    other (one query's working memory at a time), beside the pandas work of the analysis."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="dtprof-reduce")
    arrivals_done = pool.submit(strag_mod.arrivals, model, ns.arrival_parts, ns.arrival_counts)
    instances_done = pool.submit(coll_mod.instances_of, ns.instance_rows, model.measured_steps)
    pool.shutdown(wait=False)
    return arrivals_done, instances_done


def analyze(run, options: AnalysisOptions | None = None, *,
            progress: Callable[[str], None] | None = None, source: str = "summaries", incident=None,
            live: bool = False, stale_s: float = 60.0, reduce: Reduce | None = None) -> Analysis:
    """Analyse a run (a ``Run`` or a path) with ``options`` (default: ``AnalysisOptions()``, no device peaks):
    ``STAGES`` in order. ``progress``: called with a short message before each stage. ``source``: "summaries" (the
    rank-local figures from the node summaries, made here for nodes that have none) or "raw" (the whole run's tables
    at once): equal results (docs/scale.md). ``incident``: the incident files as `dtprof triage` read them (its
    ``--fr`` dumps; default: read here); ``live``, ``stale_s``: a job still running. ``reduce``: where the
    per-instance reductions run (default ``reduce_here``; dtprof/cluster.py: on a Dask cluster). The verdict is
    made here: ``Analysis.triage``."""
    from dtprof.rundir.run import Run, open_run

    t0 = time.perf_counter()
    got = run_stages(STAGES, {"run": run if isinstance(run, Run) else open_run(run),
                              "options": options or AnalysisOptions(), "source": source, "given_incident": incident,
                              "live": live, "stale_s": stale_s, "reduce": reduce or reduce_here},
                     progress or (lambda msg: None))
    summary = {k: got["summary"][k] for k in SUMMARY_ORDER if k in got["summary"]}
    summary.update((k, v) for k, v in got["summary"].items() if k not in summary)
    summary["analysis_s"] = time.perf_counter() - t0
    return dataclasses.replace(got["analysis"], summary=_clean(summary), findings=summary["findings"])


def run_stages(stages, got: dict, say: Callable[[str], None]) -> dict:
    """Run ``stages`` in order over ``got`` (the inputs); returns every name they set, the summary's keys under
    ``"summary"``."""
    summary: dict = {}
    got = {**got, "summary": MappingProxyType(summary)}
    view = MappingProxyType(got)
    for st in stages:
        if st.message:
            say(st.message if isinstance(st.message, str) else st.message(view))
        out = dict(st.fn(view))
        keys = out.pop("summary", {})
        twice = sorted((set(out) & set(got)) | (set(keys) & set(summary)))
        if twice:
            raise RuntimeError(f"analyze stage {st.name!r} sets {', '.join(twice)}, set by a stage before it")
        got.update(out)
        summary.update(keys)
    return {**got, "summary": summary}


# ---- the stages, in STAGES order ---------------------------------------------------------------------------------

def _model_stage(g) -> dict:
    return {"model": RunModel.of(g["run"], g["options"].warmup, "raw" if g["source"] == "raw" else "summaries")}


def _node_summaries_stage(g) -> dict:
    """The rank-local figures: from the node summaries, or (``source="raw"``) of the whole run at once."""
    run, model = g["run"], g["model"]
    if g["source"] == "raw":
        return {"ns": nodesummary_mod.summarize(model), "spans_view": model}
    ns = nodesummary_mod.of_run(run, model)
    # the stages read only these spans (the Analysis keeps the whole model for the renderers)
    return {"ns": ns, "spans_view": model.sliced(run.read_spans(kinds=SLICE_KINDS, ranks=ns.pipeline_ranks))}


def _incident_stage(g) -> dict:
    """The rest of what the analysis reads, read once: the run's incident files (the command's own when it read them:
    `dtprof triage --fr`) and the collectives rows of the instances the node summaries flag as mismatched, for
    triage. A read that fails fails only triage (``inputs_error``), never the rest of the analysis."""
    from dtprof.analyzers.triage import mismatch_candidates

    run = g["run"]
    try:
        incident = g["given_incident"] if g["given_incident"] is not None else run.incident()
        rows = run.read_collectives(mismatch_candidates(g["ns"].arrival_parts))
    except Exception as e:  # noqa: BLE001  (reported by the triage stage)
        return {"incident": None, "mismatch_rows": None, "inputs_error": e}
    return {"incident": incident, "mismatch_rows": rows, "inputs_error": None}


def _reductions_stage(g) -> dict:
    """The per-instance reductions (``reduce``: in a thread here, ``reduce_here``, or on a Dask cluster) run beside
    the stages after this one, which take their ``result()``."""
    arrivals_done, instances_done = g["reduce"](g["model"], g["ns"])   # reduce_here, or on a Dask cluster
    return {"arrivals_done": arrivals_done, "instances_done": instances_done}


def _rank_steps_stage(g) -> dict:
    """Per rank × step: the run model's steps with overlap and breakdown; the job's step statistics."""
    model, ns = g["model"], g["ns"]
    ov, bd = ns.overlap(), ns.breakdown()
    steps = _rank_step_table(model, ov, bd)
    overlap_cols = steps[["comm_s", "duration_s", "overlap_s", "exposed_comm_s", "level"]]
    measured = overlap_cols[steps["measured"].to_numpy(bool)]
    step_block = steps_mod.step_stats(model)
    return {"ov": ov, "bd": bd, "steps": steps,
            "summary": {"steps": {**step_block, **_step_input_sources(step_block, g["run"].meta)},
                        "overlap": overlap_mod.whole_run(measured if len(measured) else overlap_cols)}}


def _run_stage(g) -> dict:
    run, options = g["run"], g["options"]
    run_block = _run_block(run)
    return {"summary": {"schema": SUMMARY_SCHEMA, "generated_by": "dtprof.analyzers", "run": run_block,
                        "clock": g["model"].clock.to_dict("records"), "options": options.record(),
                        "problems": _problems(run, run_block, g["ov"].unassigned)}}


def _what_if_stage(g) -> dict:
    run, ns = g["run"], g["ns"]
    on_gpu = bool((run.ranks["device_type"].astype(str) == "cuda").any())
    return {"wi": whatif_mod.analyze_whatif(g["model"], ns.whatif_items(), on_gpu=on_gpu, work=ns.work())}


def _stragglers_stage(g) -> dict:
    wi, options = g["wi"], g["options"]
    arr, rows_per_rank = g["arrivals_done"].result()
    strag = strag_mod.classify(g["run"], arr, rows_per_rank, g["steps"], g["summary"]["steps"]["time_s"]["p50"],
                               wi.straggler_savings if wi else None, options.straggler_min_saving,
                               wi.typical_excess if wi else None, wi.typical_cpu_wait if wi else None)
    return {"arr": arr, "strag": strag}


def _gpu_stage(g) -> dict:
    run = g["run"]
    gpus = gpu_mod.gpu_stats(run, g["model"].steps)
    rg = gpu_mod.rank_gpu(run, gpus)
    return {"gpus": gpus, "mem": gpu_mod.memory(run, g["steps"], gpus),
            "evidence": strag_mod.nvml_evidence(g["strag"], rg, gpus), "summary": {"gpus": gpus.to_dict("records")}}


def _collectives_stage(g) -> dict:
    model, groups = g["model"], g["run"].groups
    inst = g["instances_done"].result()
    coll = coll_mod.collective_table(model, inst[inst["window"] == "measured"])
    coll["mesh_dim"] = mesh_mod.mesh_dim_of(groups, coll["group"]).to_numpy()
    coll_outside = coll_mod.collective_table(model, inst[inst["window"] == "outside"])
    coll_outside["mesh_dim"] = mesh_mod.mesh_dim_of(groups, coll_outside["group"]).to_numpy()
    return {"instances": inst, "coll": coll, "summary": {"collectives": coll.to_dict("records"),
                                                         "collectives_outside_steps": coll_outside.to_dict("records")}}


def _pipeline_stage(g) -> dict:
    pp = pipeline_mod.analyze_pipeline(g["spans_view"], g["steps"])
    keys: dict = {"pipeline": pp.summary if pp else None}
    if pp is None:
        keys["pipeline_reason"] = "no pipeline stage spans (pp_forward/pp_backward) inside this run's steps"
    return {"pp": pp, "summary": keys}


def _mfu_stage(g) -> dict:
    model = g["model"]
    return {"summary": {"mfu": mfu_mod.compute_mfu(g["run"], model.steps, model.job, g["options"])}}


def _memory_stage(g) -> dict:
    """summary.json ``memory``: the steps' peaks and headroom, and the memory ledger (analyzers/memory.py)."""
    mem = g["mem"]
    block = {"peak_mem_bytes_max": float(mem["peak_mem_bytes"].max()) if mem["peak_mem_bytes"].notna().any() else None,
             "headroom_frac_min": float(mem["headroom_frac"].min()) if mem["headroom_frac"].notna().any() else None,
             **memory_mod.memory_block(g["run"], g["pp"])}
    if block["headroom_frac_min"] is None:
        block["headroom_frac_min_reason"] = "device memory size unknown"
    return {"summary": {"memory": block}}


def _gpu_time_stage(g) -> dict:
    """GPU time per rank and for the job, and the top kernels, from the trace's kernel spans (analyzers/kernels)."""
    spans = g["spans_view"].spans
    gpu_time = kernels_mod.gpu_time(spans, g["model"].steps, g["options"].gpu_window)
    keys = {"kernels": kernels_mod.top_kernels(spans), "gpu_time": kernels_mod.job_gpu_time(gpu_time)}
    if keys["gpu_time"] is None:
        keys["gpu_time_reason"] = "no GPU kernel spans (no torch.profiler trace: dtprof run --trace-steps)"
    return {"gpu_time_by_rank": gpu_time, "summary": keys}


def _ranks_stage(g) -> dict:
    """Per rank, and what the job's blocks take from the ranks: CPU wait and the step breakdown."""
    bd, steps = g["bd"], g["steps"]
    ranks = _per_rank_block(g["run"], steps, g["strag"], bd, g["gpu_time_by_rank"])
    return {"summary": {"ranks": ranks, "cpu_wait": _cpu_wait_block(ranks, g["summary"]["steps"]),
                        "breakdown": {**_breakdown_block(ranks, bd.pipeline_ranks, g["model"].gpu_ranks.tolist()),
                                      "per_step": _critical_series(bd, steps)}}}


def _what_if_summary_stage(g) -> dict:
    wi = g["wi"]
    if wi is None:
        return {"summary": {"replay": None, "what_if": [], "critical_path": None,
                            "what_if_reason": "no measured steps to replay"}}
    return {"summary": {**wi.summary, "what_if": _not_straggler_basis(wi.summary["what_if"], g["strag"])}}


def _mesh_stage(g) -> dict:
    """Hybrid parallelism (analyzers/mesh.py): communication and exposed communication per DeviceMesh dimension,
    the costliest dimension, the bubble of each pipeline group."""
    view, ns, bd, steps = g["spans_view"], g["ns"], g["bd"], g["steps"]   # view: the run model
    block = None
    if mesh_mod.named_dims(view.groups):   # the summaries' rank_group_comm is read only then (nodesummary.of_run)
        block = mesh_mod.mesh_summary(view.groups, ns.rank_group_comm, steps, view.meta,
                                      exposed=breakdown_mod.exposed_by_dim_rank_step(bd))
    if block is None:
        return {"mesh_groups_of": None, "summary": {
            "mesh": None, "mesh_reason": "no DeviceMesh dimensions recorded (groups.mesh_dim is empty)"}}
    pp = mesh_mod.pipeline_bubble_by_group(view.groups, view.spans, steps)
    block["pipeline_groups"] = [
        {"group": str(r.group), "ranks": [int(x) for x in str(r.ranks).split(",")], "stages": int(r.stages),
         "bubble_frac": float(r.bubble_frac), "bubble_frac_max": float(r.bubble_frac_max)}
        for r in pp.itertuples()]
    return {"mesh_groups_of": lambda rank: mesh_mod.mesh_groups_of_rank(view.groups, rank),
            "summary": {"mesh": block}}


def _flagged_stage(g) -> dict:
    """summary.json ``stragglers`` (each in its group of every mesh dimension) and ``transient_lateness``."""
    named, transient = _flagged_ranks(g["strag"], g["evidence"], g["mesh_groups_of"])
    keys: dict = {"stragglers": named, "transient_lateness": transient}
    if not named:
        keys["stragglers_reason"] = "no rank is a persistent straggler (stragglers.PERSISTENT_RULE)"
    return {"summary": keys}


def _evaluation_stage(g) -> dict:
    return {"summary": {"evaluation": _evaluation_block(g["spans_view"].spans, g["model"].steps)}}


def _health_stage(g) -> dict:
    """Numerics health (analyzers/health.py): per-step loss, gradient norm and learning rate, and the incidents."""
    from dtprof.analyzers import health

    try:
        return {"summary": {"health": health.of_run(g["run"])}}
    except Exception as e:  # a damaged health table must not lose the rest of the analysis
        return {"summary": {"health": None, "health_reason": f"health analysis failed: {type(e).__name__}: {e}"}}


def _triage_stage(g) -> dict:
    """The incident verdict (analyzers/triage.py) from the run and what the analysis found before it (the inputs
    stage's incident files and mismatch rows, the stragglers and numerics health found here). ``triage``: the whole
    result (evidence included: `dtprof triage` prints it); summary.json keeps its headline keys."""
    from dtprof.analyzers import triage

    try:
        if g["inputs_error"] is not None:
            raise g["inputs_error"]
        res = triage.triage(g["run"], g)
    except Exception as e:  # a damaged run's triage must not lose the rest of its analysis
        return {"triage": None, "summary": {"triage": None,
                                            "triage_reason": f"triage failed: {type(e).__name__}: {e}"}}
    head = {k: res[k] for k in ("verdict", "message", "culprit_ranks", "collective")}
    if "step" in res:   # the verdict's step (analyzers/triage.py: numerics, divergence, oom)
        head["step"] = res["step"]
    return {"triage": res, "summary": {"triage": head}}


def _suspects_stage(g) -> dict:
    named = {s["rank"] for s in g["summary"]["stragglers"]}
    return {"unnamed_suspects": [i for i, w in enumerate(g["summary"]["what_if"]) if is_unnamed_suspect(w, named)]}


def _analysis_stage(g) -> dict:
    """The Analysis' tables (its summary is set when every stage has run)."""
    from dtprof.analyzers.triage import restart_lines

    pp, bd = g["pp"], g["bd"]
    return {"analysis": Analysis(
        summary={}, steps=g["steps"], collectives=g["coll"], arrivals=g["arr"].drop(columns=["measured"]),
        stragglers=g["strag"], pipeline=pp.table if pp else None, pipeline_ops=pp.ops if pp else None,
        gpu=g["gpus"], memory=g["mem"], clock=g["model"].clock, job_steps=g["model"].job, instances=g["instances"],
        model=g["model"], exposed=bd.exposed, notices=run_notices(g["run"]), triage=g["triage"],
        unnamed_suspects=g["unnamed_suspects"], restart_lines=restart_lines(g["summary"]["run"]), run=g["run"])}


def _findings_stage(g) -> dict:
    return {"summary": {"findings": findings_mod.find(dict(g["summary"]), g["analysis"])}}


def _node_summaries_message(g) -> str:
    return ("rank-local figures (overlap, breakdown, what-if items) of the whole run" if g["source"] == "raw"
            else "node summaries")


# The analysis, stage by stage: a new metric is a stage appended here (before "analysis" when the Analysis or the
# findings read it) and its key in SUMMARY_ORDER.
STAGES: list[Stage] = [
    Stage("model", _model_stage, "reading tables"),
    Stage("node summaries", _node_summaries_stage, _node_summaries_message),
    Stage("incident", _incident_stage),
    Stage("reductions", _reductions_stage),
    Stage("rank steps", _rank_steps_stage),
    Stage("run", _run_stage),
    Stage("what-if", _what_if_stage, "what-if replay"),
    Stage("stragglers", _stragglers_stage, "collective arrivals and stragglers"),
    Stage("gpu", _gpu_stage, "GPU and memory"),
    Stage("collectives", _collectives_stage, "collective bandwidth"),
    Stage("pipeline", _pipeline_stage, "pipeline"),
    Stage("mfu", _mfu_stage, "MFU"),
    Stage("memory", _memory_stage, "memory ledger"),
    Stage("gpu time", _gpu_time_stage, "GPU kernels"),
    Stage("ranks", _ranks_stage),
    Stage("what-if summary", _what_if_summary_stage),
    Stage("mesh", _mesh_stage),
    Stage("flagged", _flagged_stage),
    Stage("unnamed suspects", _suspects_stage),
    Stage("evaluation", _evaluation_stage),
    Stage("health", _health_stage, "numerics health"),
    Stage("triage", _triage_stage, "triage"),
    Stage("analysis", _analysis_stage),
    Stage("findings", _findings_stage, "findings"),
]


def run_notices(run) -> list[str]:
    """The run's read problems, its restarts (a restarted Ray Train group) and its events' warnings and errors
    (the first 30, then how many more)."""
    from dtprof.analyzers.triage import restart_lines

    notices = list(run.problems)
    notices += restart_lines({"restarts": run.restarts, "attempts": run.attempts})
    ev = run.events
    if len(ev):
        bad = ev[ev["level"].astype(str).isin(["warning", "error"])]
        notices += [f"{r['level']} from {r['source']} (rank {r['rank']}): {r['message']}"
                    for r in bad.head(30).to_dict("records")]
        if len(bad) > 30:
            notices.append(f"... and {len(bad) - 30} more warnings/errors in the events table")
    return notices


def _rank_step_table(model, ov, bd) -> pd.DataFrame:
    """Per rank × step: the run model's steps with the overlap's and the breakdown's columns (Analysis.steps)."""
    # copy-on-write: the model's and the summary's columns are shared, not copied (assigned as Series: pandas
    # copies a NumPy array it is given; 16.4 M rank-steps make each column 131 MB)
    steps = model.steps.copy(deep=False)
    for c in nodesummary_mod.OVERLAP_COLUMNS:
        steps[c] = ov.per_step[c]
    kernel = (steps["level"] == "kernel").to_numpy(bool)
    kernel_exposed = steps["exposed_comm_s"].where(kernel) if kernel.any() else None
    for p in breakdown_mod.PARTS:   # exposed_comm_s and data_wait_s: one value per rank-step, the breakdown's
        steps[f"{p}_s"] = bd.per_step[f"{p}_s"]
    # except where a trace has GPU kernels: there the overlap module's kernel view of exposed communication stays
    if kernel_exposed is not None:
        steps["exposed_comm_s"] = kernel_exposed.fillna(steps["exposed_comm_s"])
    return steps[["rank", "step", "start_ns", "end_ns", "aligned_start_ns", "aligned_end_ns", "duration_s",
                  "compute_s", "comm_s", "exposed_comm_s", "comm_wait_s", "data_wait_s", "overlap_ratio", "warmup",
                  "traced", "measured", "peak_mem_bytes", "overlap_s", "level", "tokens", "samples", "model_flops",
                  "executed_flops", "cpu_wait_s"]
                 + [f"{p}_s" for p in breakdown_mod.PARTS if p not in ("exposed_comm", "data_wait")]]


def _flagged_ranks(strag: pd.DataFrame, evidence: dict, mesh_groups_of) -> tuple[list[dict], list[dict]]:
    """(summary ``stragglers``, ``transient_lateness``): named stragglers are the persistent ones, each with its
    ``mesh_groups`` where the run has DeviceMesh dimensions (``mesh_groups_of``: rank -> its groups, or None);
    transient lateness is listed apart and never made a headline."""
    stragglers_list: list[dict] = []
    transient_list: list[dict] = []
    for s in strag_mod.flagged(strag).itertuples(index=False):
        (stragglers_list if s.kind == "persistent" else transient_list).append({
                                "rank": int(s.rank), "host": s.host, "device": s.device, "kind": s.kind,
                                "time_lost_s": float(s.time_lost_s), "score": s.compute_score,
                                "late_frac": float(s.late_frac), "late_step_frac": float(s.late_step_frac),
                                "slow_step_frac": float(s.slow_step_frac),
                                "delay_s_per_step": float(s.delay_s_per_step), "reason": s.reason,
                                "saving_frac": float(s.saving_frac), "saving_step_frac": float(s.saving_step_frac),
                                "saving_frac_median": float(s.saving_frac_median),
                                "typical_excess_s": float(s.typical_excess_s),
                                "typical_cpu_wait_s": float(s.typical_cpu_wait_s),
                                "evidence": evidence[int(s.rank)]["lines"],
                                "nvml": {k: v for k, v in evidence[int(s.rank)].items() if k != "lines"}})
    if mesh_groups_of is not None:
        stragglers_list = [{**s, "mesh_groups": mesh_groups_of(s["rank"])} for s in stragglers_list]
    return stragglers_list, transient_list


def _problems(run, run_block: dict, unassigned: int) -> list[str]:
    """summary ``problems``: what the reader found, ranks that left no record, unidentified processes, rows outside
    every step window."""
    problems = list(run.problems)
    if run_block["ranks_missing"]:
        problems.append(f"rank(s) {', '.join(map(str, run_block['ranks_missing']))} of world size "
                        f"{run_block['world_size']} left no record")
    problems += run_block["unidentified_processes"]
    if unassigned:
        problems.append(f"{unassigned} span(s)/collective(s) started outside every step window and were not "
                        f"counted in per-step figures")
    return problems


def _not_straggler_basis(what_if: list[dict], strag: pd.DataFrame) -> list[dict]:
    """A ``straggler_removed`` saving of a rank that the straggler rule does not name (stragglers.PERSISTENT_RULE)
    says so in its basis, with the numbers the rule weighed: with symmetric step-to-step noise, the rank that is
    slower on average still "saves" in the steps where it happened to be the slower one."""
    by_rank = strag.set_index("rank")
    out = []
    for w in what_if:
        s = (by_rank.loc[w["ranks"][0]] if w["scenario"] == "straggler_removed" and len(w["ranks"]) == 1
             and w["ranks"][0] in by_rank.index else None)
        if s is not None and s["kind"] != "persistent":
            w = {**w, "basis": w["basis"] + (f"; not named a straggler: the saving held (>= the threshold) in "
                                             f"{s['saving_step_frac']:.0%} of measured steps and a typical step "
                                             f"does {s['typical_excess_s'] * 1e3:.1f} ms more work than its peers"
                                             f"{strag_mod.cpu_wait_note(s['typical_cpu_wait_s'])}")}
        out.append(w)
    return out


def is_unnamed_suspect(w: dict, named: set) -> bool:
    """A what-if entry that removes a rank the straggler rule does not name (``named``: the ranks of
    summary.json ``stragglers``); Analysis.unnamed_suspects, which the terminal and the report mark
    "(not a straggler)"."""
    return w["scenario"] == "straggler_removed" and not set(w["ranks"]) <= named


def _step_input_sources(step_block: dict, meta: pd.DataFrame) -> dict:
    """``samples_per_s_source``/``tokens_per_s_source``: "inferred: ..." when a rank inferred them from its root
    module's input (a ``step_inputs`` meta row, collectors/inputs.py), else "dtprof.annotate"."""
    rows = meta.loc[meta["kind"].astype(str) == "step_inputs", "value"] if len(meta) else []
    inferred: dict = {}
    for v in rows:
        inferred.update(v if isinstance(v, dict) else {})
    return {f"{what}_per_s_source": inferred.get(what, "dtprof.annotate") for what in ("samples", "tokens")
            if step_block.get(f"{what}_per_s") is not None}
