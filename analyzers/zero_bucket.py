"""DeepSpeed ZeRO-1/2: the step with every gradient in one bucket, from a run with several bucket flushes a step
(issue 47 point 4; docs/what-if.md, "DeepSpeed ZeRO").

The rank side writes each engine's ZeRO config (``deepspeed_zero`` meta) and a ``zero_bucket`` span around each
bucket flush (collectors/engine_deepspeed.py). The bucket reductions are the collectives a rank issued inside its
flush spans. Model (benchmarks/zero_bucket_whatif.py, validated there: within 25 % of the measured saving in 13 of
14 alternating jobs on this CPU):

- each rank's work in a step = its step less the time its training thread was blocked in the step's bucket
  reductions (issue to end; every other collective is kept);
- one bucket costs one transfer after its last arrival at the step's small calls' mean (on a CPU, gloo's transfer
  of a bucket does not grow with its bytes: a per-call cost);
- predicted step = the slowest rank's work + that transfer once per reduction round (one meeting instead of one per
  bucket). A round is a backward's reduction: ZeRO-2 reduces after every micro-batch's backward (its flushes a step
  are at least ``gradient_accumulation_steps`` however large the bucket), ZeRO-1 once a step, at the boundary.

The engine's own work per flush (the span less the collectives in it) is not in the model: it grows with the
parameters a bucket holds, and the benchmark measured its change at about a tenth of the saving. CPU only: on a GPU a
bucket's transfer grows with its bytes and ``overlap_comm`` hides buckets behind backward, neither of which the
model has.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from dtprof.analyzers.intervals import assign_to_windows

SCENARIO = "zero_one_bucket"
GPU_REASON = ("GPU run: a bucket's transfer grows with its bytes there, and overlap_comm hides buckets behind "
              "backward on the GPU's streams; the one-bucket model (a per-call transfer, every reduction blocking "
              "the training thread) holds on a CPU only")


def zero_configs(meta: pd.DataFrame) -> list[dict]:
    """The run's DeepSpeed engines' ZeRO configs (``deepspeed_zero`` meta rows)."""
    rows = meta[meta["kind"].astype(str) == "deepspeed_zero"]
    return [v for v in rows["value"] if isinstance(v, dict)]


def zero_stages(meta: pd.DataFrame) -> set[int]:
    """The ZeRO stages of the run's DeepSpeed engines."""
    return {int(v["stage"]) for v in zero_configs(meta) if "stage" in v}


def reduction_rounds(meta: pd.DataFrame) -> int:
    """Gradient reductions a step that no bucket size merges (module docstring): the most over the run's engines;
    1 for runs whose meta predates ``gradient_accumulation_steps``."""
    return max([int(v.get("gradient_accumulation_steps", 1)) if int(v.get("stage", 0)) >= 2 else 1
                for v in zero_configs(meta)] or [1])


def flush_spans(model) -> pd.DataFrame:
    """The run's ``zero_bucket`` spans (one per bucket flush)."""
    sp = model.spans
    return sp[sp["kind"].astype(str) == "zero_bucket"]


def bucket_calls(model) -> pd.DataFrame:
    """The bucket reductions of the run's measured steps: each collective a rank issued inside one of its
    ``zero_bucket`` spans of the same step, with its ``in_bytes``, ``blocked_ns`` (issue to end on that rank) and
    ``transfer_ns`` (end after the instance's last arrival, on the reference clock)."""
    sp = flush_spans(model)
    co = model.collectives
    cols = ["rank", "step", "group", "seq", "in_bytes", "blocked_ns", "transfer_ns"]
    if not len(sp) or not len(co):
        return pd.DataFrame(columns=cols)
    co = co[co["step"].notna() & co["exit_ns"].notna()]
    ranks = co["rank"].to_numpy(np.int64)
    steps = co["step"].to_numpy(np.int64)
    # each call's flush span (a rank's flushes never overlap): the window holding its issue, then the same step
    win = assign_to_windows(sp["rank"].to_numpy(np.int64), sp["start_ns"].to_numpy(np.int64),
                            sp["end_ns"].to_numpy(np.int64), ranks, co["issue_ns"].to_numpy(np.int64))
    inside = win >= 0
    inside[inside] = sp["step"].to_numpy(np.int64)[win[inside]] == steps[inside]
    m = co[inside]
    if not len(m):
        return pd.DataFrame(columns=cols)
    ranks = ranks[inside]
    issue = model.align(m["issue_ns"].to_numpy(np.int64), ranks)
    exit_ = model.align(m["exit_ns"].to_numpy(np.int64), ranks)
    last = pd.Series(issue, index=m.index).groupby([m["group"].astype(str), m["seq"]]).transform("max")
    return pd.DataFrame({"rank": ranks, "step": steps[inside], "group": m["group"].astype(str),
                         "seq": m["seq"].to_numpy(np.int64), "in_bytes": m["in_bytes"].to_numpy(np.int64),
                         "blocked_ns": (m["exit_ns"] - m["issue_ns"]).to_numpy(np.int64),
                         "transfer_ns": np.maximum(exit_ - last.to_numpy(), 0)})


def engine_work(model, calls: pd.DataFrame | None = None) -> pd.Series:
    """Per (step, rank) with bucket flushes: the engine's own work in them (s), its flush spans less its time
    blocked in the bucket reductions inside them (``calls``: ``bucket_calls(model)``, if already made)."""
    sp = flush_spans(model)
    key = [sp["step"].astype(np.int64).rename("step"), sp["rank"].astype(np.int64).rename("rank")]
    span_s = (sp["end_ns"] - sp["start_ns"]).astype(float).groupby(key).sum() / 1e9
    calls = bucket_calls(model) if calls is None else calls
    blocked = calls.groupby(["step", "rank"])["blocked_ns"].sum().astype(float) / 1e9
    return span_s - blocked.reindex(span_s.index).fillna(0.0)


def flushes_per_step(model) -> pd.Series:
    """Per measured step: the most bucket flushes (``zero_bucket`` spans) any rank made in it."""
    n = flush_spans(model).groupby(["step", "rank"]).size().groupby(level="step").max()
    n.index = n.index.astype(np.int64)
    return n[n.index.isin(sorted(model.measured_steps))]


def one_bucket(model, steps, rounds: int = 1, calls: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per step of ``steps`` (measured steps of a ZeRO-1/2 run with bucket flush spans): ``measured_s`` (the job
    step), ``predicted_s`` (the step with every gradient in one bucket, ``rounds`` reductions a step: module
    docstring), ``transfer_s`` (the one bucket's transfer: the mean of the step's bucket transfers), ``buckets``
    (the most bucket reductions a rank issued in it). ``calls``: ``bucket_calls(model)``, if already made."""
    steps = np.asarray(sorted(steps), dtype=np.int64)
    calls = bucket_calls(model) if calls is None else calls
    calls = calls[calls["step"].isin(steps)]
    st = model.steps
    st = st[st["step"].isin(steps)]
    d = st.assign(rank=st["rank"].astype(np.int64), step=st["step"].astype(np.int64)).set_index(
        ["step", "rank"])["duration_s"].astype(float)
    blocked = calls.groupby(["step", "rank"])["blocked_ns"].sum().astype(float) / 1e9
    work = (d - blocked.reindex(d.index).fillna(0.0)).groupby(level="step").max()
    transfer = calls.groupby("step")["transfer_ns"].mean().astype(float) / 1e9
    job = model.job.set_index("step")["time_s"]
    predicted = work.reindex(steps) + rounds * transfer.reindex(steps).fillna(0.0)
    return pd.DataFrame({"measured_s": job.reindex(steps).to_numpy(float),
                         "predicted_s": predicted.to_numpy(float),
                         "transfer_s": transfer.reindex(steps).to_numpy(float),
                         "buckets": calls.groupby(["step", "rank"]).size().groupby(level="step").max()
                         .reindex(steps).fillna(0).astype(np.int64).to_numpy()}, index=pd.Index(steps, name="step"))


def what_if(model, on_gpu: bool, measured_step_s: float) -> tuple[dict | None, dict | None]:
    """(the ``zero_one_bucket`` what-if entry, or a ``what_if_skipped`` entry), either None: (None, None) for a run
    without ZeRO-1/2 engines. ``saving_frac`` is over the measured steps with more bucket flushes than reduction
    rounds (a job that alternates engines has steps of each kind): 1 - the median predicted step ÷ the median job
    step of those steps; ``predicted_step_s`` = ``measured_step_s`` (the run's mean measured step, as every
    entry's) × (1 - saving)."""
    if not zero_stages(model.meta) & {1, 2}:
        return None, None
    if on_gpu:
        return None, {"scenario": SCENARIO, "reason": GPU_REASON}
    n = flushes_per_step(model)
    rounds = reduction_rounds(model.meta)
    many = n[n > rounds].index.to_numpy(np.int64)
    if not len(many):
        per = "" if rounds == 1 else f" per micro-batch ({rounds} a step: ZeRO-2 reduces after each backward)"
        why = (f"every measured step reduces its gradients in one ZeRO bucket{per} already" if len(n) else
               "no ZeRO bucket flush recorded in the measured steps (runs before dtprof recorded them have none)")
        return None, {"scenario": SCENARIO, "reason": why}
    calls = bucket_calls(model)
    t = one_bucket(model, many, rounds, calls)
    t = t[np.isfinite(t["measured_s"]) & np.isfinite(t["predicted_s"])]
    if not len(t):
        return None, None
    merged = "one" if rounds == 1 else f"one per micro-batch ({rounds})"
    saving = 1.0 - float(t["predicted_s"].median()) / float(t["measured_s"].median())
    own = engine_work(model, calls)
    own_ms = float(own[own.index.get_level_values("step").isin(t.index)].groupby(level="step").max().median()) * 1e3
    return ({"scenario": SCENARIO, "ranks": [], "predicted_step_s": measured_step_s * (1.0 - saving),
             "measured_step_s": measured_step_s, "saving_frac": saving,
             "basis": f"ZeRO's {int(t['buckets'].median())} gradient bucket reductions a step (the collectives "
                      f"inside its bucket flushes, {len(t)} measured steps) made {merged}: each rank's "
                      f"step less its time blocked in them, the slowest rank's, plus one transfer a reduction at "
                      f"their mean "
                      f"({t['transfer_s'].mean() * 1e3:.2f} ms); the saving of the median step over those steps. CPU "
                      f"only: on a GPU a bucket's transfer grows with its bytes and overlap_comm hides buckets behind "
                      f"backward; the engine's own work in the flushes ({own_ms:.1f} ms a step, the busiest rank's, "
                      f"median) is kept as measured (fewer buckets shrink it: not modelled)"}, None)
