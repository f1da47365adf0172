"""Scaling efficiency across runs of one job at different world sizes. Pure python/numpy over summary dicts.

Definition (docs/metrics.md, "Scaling efficiency"): for the same global work per step (strong scaling)
η = T₁ ÷ (N·T_N); for work per GPU held constant (weak scaling) η = T₁ ÷ T_N. Both are the per-GPU throughput of
the N-GPU run divided by that of the reference run, which is how it is computed here, with the run of the smallest
world size N₀ as the reference (T₁ is rarely measured on one GPU): η = (W_N / (N·T_N)) ÷ (W₀ / (N₀·T₀)).
(The project's seed notes call T₁ ÷ (N·T_N) "weak scaling efficiency for the same global work"; same global work
is strong scaling, so dtprof labels it strong.)

Where the lost time went, per step: the ideal step time is T_ideal = T₀·(N₀/N)·(W_N/W₀); lost = T_N − T_ideal is
split into the growth of exposed communication (``overlap.exposed_comm_frac`` × step time), of pipeline bubble
(``pipeline.bubble_frac`` × step time) and of straggler wait (Σ ``stragglers[].time_lost_s`` ÷ measured steps),
each against the reference's share scaled by the same ideal factor, and "other" (the remainder: compute that did
not shrink, framework overhead).

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
    return {"name": name, "world_size": int(ws), "step_time_s": t, "work_per_step": work, "work_unit": unit,
            "comm_s": float(comm_frac) * t, "bubble_s": bubble_frac * t, "straggler_s": lost_strag,
            "notes": notes}


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
        d_comm = f["comm_s"] - ref["comm_s"] * scale
        d_bubble = f["bubble_s"] - ref["bubble_s"] * scale
        d_strag = f["straggler_s"] - ref["straggler_s"] * scale
        lost = f["step_time_s"] - ideal
        if have_work:
            tput, tunit = f["work_per_step"] / (f["world_size"] * f["step_time_s"]), f"{f['work_unit']}/s/GPU"
        else:
            tput, tunit = 1.0 / (f["world_size"] * f["step_time_s"]), "steps/s/GPU"
        out.append({**f, "throughput_per_gpu": tput, "throughput_unit": tunit, "ideal_step_time_s": ideal,
                    "efficiency": ideal / f["step_time_s"], "lost_s": lost, "lost_comm_s": d_comm,
                    "lost_bubble_s": d_bubble, "lost_straggler_s": d_strag,
                    "lost_other_s": lost - d_comm - d_bubble - d_strag})
    explanation = (f"Scaling mode: {mode}. Efficiency = per-GPU throughput ÷ that of the {ref['world_size']}-GPU "
                   f"run (strong scaling: T₀·N₀ ÷ (N·T_N); weak: T₀ ÷ T_N). Lost time per step = step time − ideal; "
                   f"comm, bubble and stragglers are each one's growth beyond the reference's share, 'other' the "
                   f"rest.")
    return {"schema": "dtprof.scaling/1", "mode": mode, "reference": ref["name"], "runs": out,
            "explanation": explanation}
