"""Scaling efficiency across runs of one job at different world sizes. Pure python/numpy over summary dicts.

Definition (docs/metrics.md, "Scaling efficiency"): for the same global work per step (strong scaling)
η = T₁ ÷ (N·T_N); for work per GPU held constant (weak scaling) η = T₁ ÷ T_N. Both are the per-GPU throughput of
the N-GPU run divided by that of the reference run, which is how it is computed here, with the run of the smallest
world size N₀ as the reference (T₁ is rarely measured on one GPU): η = (W_N / (N·T_N)) ÷ (W₀ / (N₀·T₀)).
(The project's seed notes call T₁ ÷ (N·T_N) "weak scaling efficiency for the same global work"; same global work
is strong scaling, so dtprof labels it strong.)

Where the lost time went, per step: the ideal step time is T_ideal = T₀·(N₀/N)·(W_N/W₀); lost = T_N − T_ideal is
split into the growth of each part of the step (compute, exposed communication, bubble, data wait, other: the
means of summary.json ``breakdown.per_step``, the critical rank's partition of each measured step, whose sum is
the step time used here), each against the reference's share scaled by the same ideal factor, so the parts add
up to the lost time exactly. A summary without ``breakdown.per_step`` uses its p50 step time, exposed comm and
bubble from their fractions, and "other" the rest. Straggler wait (Σ ``stragglers[].time_lost_s`` ÷ measured
steps) is context, not a part: the time peers wait for a straggler is already their exposed communication.

Summary keys read (docs/summary-schema.md); a missing optional key counts as 0 and is named in the notes.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dtprof.analyzers.regression import _MISSING, lookup

WORLD_KEYS = ("world_size", "run.world_size", "job.world_size", "ranks.world_size")
WORK_KEYS = (("throughput.tokens_per_step", "tokens"), ("steps.tokens_per_step", "tokens"),
             ("throughput.samples_per_step", "samples"), ("steps.samples_per_step", "samples"))
RATE_KEYS = (("throughput.tokens_per_s", "tokens"), ("throughput.samples_per_s", "samples"))


class ScalingError(ValueError):
    """A run cannot be used for scaling analysis (one line)."""


def _first(summary: dict, keys):
    for k in keys:
        v = lookup(summary, k)
        if v is not _MISSING and v is not None:
            return v, k
    return None, None


def run_facts(name: str, summary: dict) -> dict:
    ws, _ = _first(summary, WORLD_KEYS)
    if ws is None:
        raise ScalingError(f"{name}: summary has no world size ({' or '.join(WORLD_KEYS)})")
    samples = lookup(summary, "steps.per_step_time_s")
    samples = [] if samples is _MISSING or samples is None else list(samples)
    t, _ = _first(summary, ("steps.time_s.p50",))
    if t is None and samples:
        t = float(np.median(samples))
    if not t:
        raise ScalingError(f"{name}: summary has no step time (steps.time_s.p50)")
    t = float(t)
    work, unit = None, None
    for key, u in WORK_KEYS:
        v = lookup(summary, key)
        if v not in (_MISSING, None):
            work, unit = float(v), u
            break
    if work is None:
        for key, u in RATE_KEYS:
            v = lookup(summary, key)
            if v not in (_MISSING, None):
                work, unit = float(v) * t, u
                break
    notes = []
    parts = _critical_part_means(summary)
    comm_frac = lookup(summary, "overlap.exposed_comm_frac")
    bubble_frac = lookup(summary, "pipeline.bubble_frac")
    strag = lookup(summary, "stragglers")
    if comm_frac in (_MISSING, None):
        notes.append("no exposed-comm figure")
        comm_frac = 0.0
    bubble_frac = 0.0 if bubble_frac in (_MISSING, None) else float(bubble_frac)
    n_steps = lookup(summary, "steps.count")
    n_steps = len(samples) if n_steps in (_MISSING, None) else int(n_steps)
    lost_strag = 0.0
    if isinstance(strag, list) and n_steps:
        lost_strag = sum(float(s.get("time_lost_s") or 0.0) for s in strag if isinstance(s, dict)) / n_steps
    if parts is not None:   # the partition of the step (breakdown.per_step): lost time splits into its parts exactly
        t = sum(parts.values())
        # a GPU rank's host waiting for its GPU is the GPU's compute (docs/metrics.md, "Waiting for the GPU")
        compute = parts["forward"] + parts["backward"] + parts["optimizer"] + parts.get("gpu_wait", 0.0)
        part_s: dict[str, float | None] = {"compute": compute,
                  "comm": parts["exposed_comm"], "bubble": parts["bubble"], "data_wait": parts["data_wait"],
                  "other": parts["other"]}
        basis = "mean step of the critical rank (breakdown.per_step)"
    else:
        comm_s, bubble_s = float(comm_frac) * t, bubble_frac * t
        part_s = {"compute": None, "comm": comm_s, "bubble": bubble_s, "data_wait": None,
                  "other": t - comm_s - bubble_s}
        basis = "step time p50 (no breakdown.per_step: comm and bubble from their fractions, the rest 'other')"
    return {"name": name, "world_size": int(ws), "step_time_s": t, "step_time_basis": basis,
            "work_per_step": work, "work_unit": unit, "parts_s": part_s, "straggler_s": lost_strag, "notes": notes}


def _critical_part_means(summary: dict) -> dict[str, float] | None:
    ps = lookup(summary, "breakdown.per_step")
    if not isinstance(ps, dict) or not ps.get("parts") or not ps.get("step"):
        return None
    return {p: float(np.mean(v)) for p, v in ps["parts"].items()}


def scaling(runs: Sequence[tuple[str, dict]]) -> dict:
    """Per-run throughput per GPU, efficiency against the smallest run, and the lost time's breakdown."""
    facts = sorted((run_facts(n, s) for n, s in runs), key=lambda f: f["world_size"])
    if len(facts) < 2:
        raise ScalingError("scaling needs at least two runs")
    ref = facts[0]
    have_work = all(f["work_per_step"] for f in facts)
    if have_work:
        units = {f["work_unit"] for f in facts}
        if len(units) > 1:
            have_work = False
    if have_work:
        rel = [f["work_per_step"] / ref["work_per_step"] for f in facts]
        per_n = [f["work_per_step"] / f["world_size"] for f in facts]
        if np.allclose(rel, 1.0, rtol=0.01):
            mode = "strong"
        elif np.allclose(per_n, per_n[0], rtol=0.01):
            mode = "weak"
        else:
            mode = "mixed"
    else:
        rel = [1.0] * len(facts)
        mode = "strong (assumed: no tokens or samples per step in the summaries)"
    out = []
    for f, w in zip(facts, rel):
        scale = (ref["world_size"] / f["world_size"]) * w        # ideal T_N / T_0
        ideal = ref["step_time_s"] * scale
        # each part's growth beyond the reference's share scaled by the ideal factor; they sum to `lost` exactly
        lost_parts = {k: (None if v is None or ref["parts_s"][k] is None else v - ref["parts_s"][k] * scale)
                      for k, v in f["parts_s"].items()}
        lost = f["step_time_s"] - ideal
        known = sum(v for k, v in lost_parts.items() if v is not None and k != "other")
        lost_parts["other"] = lost - known   # exact remainder (float rounding, or the fallback's 'the rest')
        if have_work:
            tput, tunit = f["work_per_step"] / (f["world_size"] * f["step_time_s"]), f"{f['work_unit']}/s/GPU"
        else:
            tput, tunit = 1.0 / (f["world_size"] * f["step_time_s"]), "steps/s/GPU"
        out.append({**f, "throughput_per_gpu": tput, "throughput_unit": tunit, "ideal_step_time_s": ideal,
                    "efficiency": ideal / f["step_time_s"], "lost_s": lost,
                    **{f"lost_{k}_s": v for k, v in lost_parts.items()},
                    "lost_straggler_s": f["straggler_s"] - ref["straggler_s"] * scale})
    explanation = (f"Scaling mode: {mode}. Efficiency = per-GPU throughput ÷ that of the {ref['world_size']}-GPU "
                   f"run (strong scaling: T₀·N₀ ÷ (N·T_N); weak: T₀ ÷ T_N). Lost time per step = step time − ideal, "
                   f"split into each part's growth beyond the reference's share (compute, exposed comm, bubble, data "
                   f"wait, other): the parts add up to the lost time. Straggler wait is not a part of its own (the "
                   f"ranks waiting for a straggler spend it in exposed comm); it is shown as context.")
    return {"schema": "dtprof.scaling/1", "mode": mode, "reference": ref["name"], "runs": out,
            "explanation": explanation}
