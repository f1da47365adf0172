"""Compute / communication overlap per rank and step (docs/metrics.md, "Compute / communication overlap", dtprof).

For each rank and step, with every set merged first (a union, so nested or concurrent intervals count once):
- compute = union of compute spans (forward, backward, optimizer, pp_forward, pp_backward) minus the union of
  ``comm_wait`` spans: time blocked on communication is not compute, or the overlap ratio would mean nothing; a
  compute span timed on the GPU (source ``cuda_event``) is not cut by host waits (the host waiting does not stop
  the GPU);
- comm = union of collective intervals ``[comm_start_ns, exit_ns]`` of the run model's collectives that are
  communication (``runmodel.device_comm``: on a CPU rank from the call's issue; on a GPU rank NCCL's device-side
  duration where timed, and never a one-rank group's);
- overlap ratio = |comm ∩ compute| / |comm| (null for a step without communication);
- exposed communication = |comm \\ compute|, the time the rank could only communicate;
- comm_wait_s = union length of ``comm_wait`` spans;
- data_wait_s = union length of ``data_wait`` spans, minus the time that is not waiting for input: on a pipeline
  rank everything from the start of its schedule in that step (its first pipeline op or point-to-point transfer:
  from then on it waits for its upstream stage -- pipeline fill, part of the bubble), and every interval a trace
  capture disturbed (the run model's ``captures``: the profiler's own start, stop and export).

Kernel level: for a rank-step that has ``kernel`` spans (a captured or imported GPU trace), compute is its
computation kernels and comm its communication kernels (classes in analyzers/kernels.py, shared with the kernel
breakdown) plus collectives whose source is ``kineto``; comm_wait is not subtracted there (host waits
do not stop the GPU). Every other rank-step uses the hook spans. The ``level`` column says which was used.

Intervals are attributed to the rank's step whose window holds their start and clipped to that window; intervals
starting outside every step (before step 0, after the last) and outside every ``evaluation`` span (whose data
waits and collectives belong to the evaluation) are counted in ``unassigned``.

Whole-run figures are time-weighted over the measured steps: ratio = Σ overlap / Σ comm,
exposed fraction = Σ exposed / Σ step duration.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from dtprof.analyzers.intervals import assign_to_windows, measure
from dtprof.analyzers.kernels import kernel_classes
from dtprof.rundir.schema import COMPUTE_KINDS, P2P_OPS

NS = 1e9

COMPUTE, COMM_WAIT, COMM, DATA_WAIT, NOT_INPUT, DEVICE = 0, 1, 2, 3, 4, 5
PP_KINDS = ("pp_forward", "pp_backward")


@dataclass
class OverlapResult:
    # rank, step, compute_s, comm_s, exposed_comm_s, comm_wait_s, data_wait_s, overlap_ratio, level
    per_step: pd.DataFrame
    unassigned: int          # intervals that fell outside every step window


def _codes(cat: pd.Series, wanted) -> np.ndarray:
    """Boolean mask of a categorical (or string) series being one of ``wanted``, without materialising strings."""
    return cat.isin(list(wanted)).to_numpy()


def _not_input(sp_win, sp_start, is_pp, co_win, co_start, is_p2p, windows, captures) -> tuple:
    """(window, start, end) of the intervals that are not waiting for input (module docstring)."""
    n_win = len(windows)
    wr = windows["rank"].to_numpy(np.int64)
    ws = windows["start_ns"].to_numpy(np.int64)
    we = windows["end_ns"].to_numpy(np.int64)
    never = np.iinfo(np.int64).max
    first = np.full(n_win, never, np.int64)
    m = is_pp & (sp_win >= 0)
    np.minimum.at(first, sp_win[m], sp_start[m])
    m = is_p2p & (co_win >= 0)
    np.minimum.at(first, co_win[m], co_start[m])
    sched = np.flatnonzero(first < never)
    wins, starts, ends = [sched], [first[sched]], [we[sched]]
    for c in captures.itertuples(index=False):   # a handful per run
        hit = np.flatnonzero((wr == c.rank) & (ws < c.end_ns) & (we > c.start_ns))
        wins.append(hit)
        starts.append(np.maximum(ws[hit], c.start_ns))
        ends.append(np.minimum(we[hit], c.end_ns))
    return np.concatenate(wins), np.concatenate(starts), np.concatenate(ends)


def _outside_steps_and_evaluation(outside: np.ndarray, spans: pd.DataFrame, rank: np.ndarray,
                                  start: np.ndarray) -> int:
    """How many of the intervals ``outside`` every step window also start outside every ``evaluation`` span of
    their rank: evaluation's own data waits and collectives are expected there, not a problem to report."""
    ev = spans[_codes(spans["kind"], ["evaluation"])]
    if ev.empty or not outside.any():
        return int(outside.sum())
    idx = np.flatnonzero(outside)
    in_eval = assign_to_windows(ev["rank"].to_numpy(np.int64), ev["start_ns"].to_numpy(np.int64),
                                ev["end_ns"].to_numpy(np.int64) + 1, rank[idx], start[idx]) >= 0
    return int((~in_eval).sum())


def rank_step_overlap(run, windows: pd.DataFrame) -> OverlapResult:
    """``run``: the run model (analyzers/runmodel.py); ``windows``: rank, step, start_ns, end_ns (one row per
    rank-step, the order of the result)."""
    n_win = len(windows)
    wr = windows["rank"].to_numpy(np.int64)
    ws = windows["start_ns"].to_numpy(np.int64)
    we = windows["end_ns"].to_numpy(np.int64)

    sp = run.spans
    kind = sp["kind"]
    is_kernel = _codes(kind, ["kernel"])
    names = sp["name"]
    if is_kernel.any():
        comm, compute = kernel_classes(names.astype(str).where(is_kernel, ""))
        k_comm = is_kernel & comm
        k_compute = is_kernel & compute
    else:
        k_comm = k_compute = np.zeros(len(sp), bool)
    h_compute = _codes(kind, COMPUTE_KINDS)
    h_wait = _codes(kind, ["comm_wait"])
    h_data = _codes(kind, ["data_wait"])

    co = run.collectives
    co = co[co["comm"].to_numpy(bool)]
    c_kineto = _codes(co["source"], ["kineto"])
    c_end = co["exit_ns"].to_numpy(np.int64)

    # Which rank-steps have kernel data.
    sp_rank = sp["rank"].to_numpy(np.int64)
    sp_start = sp["start_ns"].to_numpy(np.int64)
    sp_end = sp["end_ns"].to_numpy(np.int64)
    sp_win = assign_to_windows(wr, ws, we, sp_rank, sp_start)
    has_kernel = np.zeros(n_win + 1, bool)   # the last slot stands for "no window" (-1), and is never set
    if is_kernel.any():
        has_kernel[sp_win[is_kernel & (sp_win >= 0)]] = True
    sp_kernel_win = has_kernel[sp_win]

    co_rank = co["rank"].to_numpy(np.int64)
    co_issue = co["issue_ns"].to_numpy(np.int64)
    co_start = co["comm_start_ns"].to_numpy(np.int64)
    co_win = assign_to_windows(wr, ws, we, co_rank, co_issue)
    co_kernel_win = has_kernel[co_win]

    # Set membership of each span (-1 = not used).
    sp_set = np.full(len(sp), -1, np.int8)
    sp_set[h_compute & ~sp_kernel_win] = COMPUTE
    sp_set[h_compute & ~sp_kernel_win & _codes(sp["source"], ["cuda_event"])] = DEVICE
    sp_set[h_wait & ~sp_kernel_win] = COMM_WAIT
    sp_set[h_data] = DATA_WAIT
    sp_set[k_compute] = COMPUTE
    sp_set[k_comm] = COMM
    co_set = np.where(c_kineto == co_kernel_win, COMM, -1).astype(np.int8)

    ni_win, ni_start, ni_end = _not_input(sp_win, sp_start, _codes(kind, PP_KINDS), co_win, co_issue,
                                          _codes(co["op"], P2P_OPS), windows, run.captures)
    win = np.concatenate([sp_win, co_win, ni_win])
    sset = np.concatenate([sp_set, co_set, np.full(len(ni_win), NOT_INPUT, np.int8)])
    start = np.concatenate([sp_start, co_start, ni_start])
    end = np.concatenate([sp_end, c_end, ni_end])
    used = sset >= 0
    unassigned = _outside_steps_and_evaluation(used & (win < 0), sp, np.concatenate([sp_rank, co_rank, wr[ni_win]]),
                                               start)
    m = used & (win >= 0)
    win, sset, start, end = win[m], sset[m], start[m], end[m]
    start = np.maximum(start, ws[win])
    end = np.minimum(end, we[win])

    r = measure(win, sset, start, end, n_win, 6, {
        "compute": lambda c: (c[COMPUTE] & ~c[COMM_WAIT]) | c[DEVICE],
        "comm": lambda c: c[COMM],
        "overlap": lambda c: c[COMM] & ((c[COMPUTE] & ~c[COMM_WAIT]) | c[DEVICE]),
        "comm_wait": lambda c: c[COMM_WAIT],
        "data_wait": lambda c: c[DATA_WAIT] & ~c[NOT_INPUT],
    })
    comm = r["comm"]
    out = pd.DataFrame({
        "rank": wr, "step": windows["step"].to_numpy(np.int64),
        "compute_s": r["compute"] / NS, "comm_s": comm / NS,
        "exposed_comm_s": (comm - r["overlap"]) / NS,
        "comm_wait_s": r["comm_wait"] / NS, "data_wait_s": r["data_wait"] / NS,
        "overlap_s": r["overlap"] / NS,
        "overlap_ratio": np.divide(r["overlap"], comm, out=np.full(n_win, np.nan), where=comm > 0),
        "level": np.where(has_kernel[:n_win], "kernel", "hook"),
    })
    return OverlapResult(out, unassigned)


def whole_run(per_step: pd.DataFrame) -> dict:
    """summary.json ``overlap``: time-weighted over the measured rank-steps given."""
    comm = float(per_step["comm_s"].sum())
    dur = float(per_step["duration_s"].sum())
    exposed = float(per_step["exposed_comm_s"].sum())
    # no communication at all (a single-process job): not "0 % exposed", as the ratio is not "0 % hidden"
    silent = comm <= 0 and exposed <= 0
    out = {"ratio": float(per_step["overlap_s"].sum() / comm) if comm > 0 else None,
           "exposed_comm_frac": exposed / dur if dur > 0 and not silent else None,
           "comm_s_total": comm, "level": "kernel" if (per_step["level"] == "kernel").any() else "hook"}
    if comm <= 0:
        out["ratio_reason"] = "no communication recorded in the measured steps"
    if dur <= 0:
        out["exposed_comm_frac_reason"] = "no measured steps"
    elif silent:
        out["exposed_comm_frac_reason"] = "no communication recorded in the measured steps"
    return out
