"""MFU and HFU (docs/metrics.md, "MFU and HFU", the dtprof convention).

    MFU = model FLOPs per step / (step time × Σ peak FLOP/s of the job's devices)

- Step time: the mean of the job's measured step times (so MFU × peak is the achieved FLOP/s over the run).
- FLOPs per step, **for the whole job**, from the first available of:
  1. the user: ``flops_per_step`` (``--flops-per-step``; the whole job's FLOPs per step, all ranks together),
     else the ``steps.model_flops`` column (``dtprof.annotate(model_flops=...)``, **per rank**: each rank's share
     of the step; the job's figure is the sum over ranks of each rank's median);
  2. a described transformer (PaLM convention, appendix B): FLOPs per token = 6·N + 12·L·H·Q·T, attention dense,
     recompute excluded; times the job's tokens per step (Σ over ranks of ``steps.tokens``);
  3. FlopCounterMode measured in the job on one step (``steps.executed_flops``, per rank, summed): labelled
     "executed FLOPs". It counts recomputation, so with activation checkpointing it is HFU rather than MFU.
  When a model source is used and executed FLOPs exist too, ``hfu`` is the executed figure over the same
  denominator; otherwise ``hfu`` is null.
- Peak per device: ``options.peaks``, resolved at the command-line edge (dtprof/options.py) from the first
  available of ``--peak-tflops`` (per device), a calibration stored by ``dtprof calibrate`` for the device name and
  dtype ("calibrated on <date>"), the ~1 s calibration `dtprof run` made after the job for a device with no spec
  peak ("calibrated by dtprof run"), the spec table below (dense, no sparsity) matched on the device name and
  dtype. Unknown device and no peak: MFU is null with the reason -- never a guess. On a CPU there is no spec peak.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from dtprof.analyzers.options import AnalysisOptions

# (substring of the device name, lowercase; {dtype: TFLOP/s}) -- first match wins, so specific names come first.
PEAK_TFLOPS = (
    ("h100 pcie", {"fp32": 51, "tf32": 378, "bf16": 756, "fp16": 756, "fp8": 1513}),
    ("h100 nvl", {"fp32": 60, "tf32": 417.5, "bf16": 835, "fp16": 835, "fp8": 1670}),
    ("h100", {"fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}),
    ("h200", {"fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}),
    ("b200", {"tf32": 1100, "bf16": 2250, "fp16": 2250, "fp8": 4500}),
    ("a100", {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312}),
    ("l4", {"fp32": 30.3, "tf32": 60, "bf16": 121, "fp16": 121, "fp8": 242.5}),
    ("a10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125}),
    ("v100-pcie", {"fp32": 14, "fp16": 112}),
    ("v100", {"fp32": 15.7, "fp16": 125}),
    ("mi300x", {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9}),
)
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
                 "tensorfloat32": "tf32", "float8": "fp8", "e4m3": "fp8", "e5m2": "fp8"}


def norm_dtype(dtype: str) -> str:
    d = str(dtype).lower().replace("torch.", "")
    return DTYPE_ALIASES.get(d, d)


def spec_peak_tflops(device_name: str, dtype: str) -> float | None:
    name = str(device_name).lower()
    for key, table in PEAK_TFLOPS:
        if key in name:
            return table.get(norm_dtype(dtype))
    return None


def transformer_flops_per_token(n_params: float, layers: int, heads: int, head_dim: int, seq_len: int) -> float:
    """PaLM appendix B: 6N + 12·L·H·Q·T (N non-embedding parameters)."""
    return 6.0 * n_params + 12.0 * layers * heads * head_dim * seq_len


def device_peaks(ranks: pd.DataFrame, options: AnalysisOptions) -> tuple[np.ndarray, str, str]:
    """Per rank peak FLOP/s (nan where unknown), the source label and a reason when any is unknown, from the peaks
    resolved at the command-line edge (``options.peaks``)."""
    names = ranks["device_name"].astype(str).to_numpy()
    peaks = np.full(len(names), np.nan)
    labels, missing = set(), set()
    for name in sorted(set(names)):  # one per distinct device name
        p = options.peaks.get(name)
        if p is None or p.tflops is None:
            missing.add(p.reason if p is not None else f"{name or 'device'}: no peak given (give --peak-tflops or "
                                                       f"run dtprof calibrate)")
            continue
        peaks[names == name] = p.tflops * 1e12
        labels.add(p.source)
    return peaks, "; ".join(sorted(labels)), "; ".join(sorted(missing))


def compute_mfu(run, per_rank: pd.DataFrame, job: pd.DataFrame, options: AnalysisOptions) -> dict:
    """summary.json ``mfu`` block. ``per_rank``/``job``: the run model's steps and job tables (``measured`` flagged)."""
    out = {"value": None, "hfu": None, "flops_per_step": None, "flops_source": None, "peak_flops": None,
           "peak_source": None, "dtype": options.dtype, "step_time_s": None, "achieved_flops_per_s": None}
    flops_per_step, transformer = options.flops_per_step, options.transformer
    rank = per_rank["rank"].to_numpy(np.int64)
    measured = per_rank["measured"].to_numpy(bool)
    jm = job[job["timed"]]
    step_time = float(jm["time_s"].mean()) if len(jm) else None
    out["step_time_s"] = step_time

    def per_rank_sum(col):
        """Σ over ranks of each rank's median ``col`` over its measured steps that report it (else over all its
        steps that do): a column at a time, so the rank-steps are never masked as a frame (16.4 M at 16,384 ranks)."""
        v = per_rank[col].to_numpy(np.float64, na_value=np.nan)
        known = ~np.isnan(v)
        rows = known & measured
        if not rows.any():
            rows = known  # executed FLOPs are often measured on one (warm-up) step
            if not rows.any():
                return None
        return float(pd.Series(v[rows]).groupby(rank[rows]).median().sum())

    executed = per_rank_sum("executed_flops")
    flops, source, reason = None, None, None
    if flops_per_step is not None:
        flops, source = float(flops_per_step), "user (--flops-per-step, whole job)"
    elif (mf := per_rank_sum("model_flops")) is not None:
        flops, source = mf, "user (steps.model_flops, summed over ranks)"
    elif transformer:
        tok = jm["tokens"].to_numpy(float) if len(jm) and (jm["tokens_known"] > 0).all() else None
        if tok is None or not len(tok):
            reason = "transformer described but the job reports no tokens per step (dtprof.annotate(tokens=...))"
        else:
            keys = ("n_params", "layers", "heads", "head_dim", "seq_len")
            missing = [k for k in keys if k not in transformer]
            if missing:
                reason = f"transformer description lacks {', '.join(missing)}"
            else:
                ftok = transformer_flops_per_token(*(float(transformer[k]) for k in keys))
                flops = ftok * float(np.mean(tok))
                source = (f"transformer formula (PaLM: 6N + 12LHQT = {ftok:.4g} FLOPs/token × "
                          f"{np.mean(tok):.0f} tokens/step)")
    elif executed is not None:
        flops, source = executed, "executed FLOPs (FlopCounterMode, summed over ranks)"
    else:
        reason = ("no FLOPs per step: give --flops-per-step, annotate model_flops, describe the transformer, or "
                  "run without --no-count-flops")
    out["flops_per_step"] = flops
    out["flops_source"] = source
    if reason:
        out["flops_reason"] = reason
    peaks, label, missing = device_peaks(run.ranks, options)
    if len(peaks) == 0:
        missing = "no ranks recorded"
    if missing:
        out["peak_reason"] = missing
    else:
        out["peak_flops"] = float(peaks.sum())
        out["peak_source"] = label
    if step_time is None or step_time <= 0:
        out["value_reason"] = "no measured steps"
        return out
    if flops is not None:
        out["achieved_flops_per_s"] = flops / step_time
    if out["peak_flops"] and flops is not None:
        value = flops / (step_time * out["peak_flops"])
        if value > 1:
            # Above the peak is impossible: the peak is too low (a calibration that ran while the machine was busier
            # than during the job) or the FLOPs are too high. Say so instead of printing an MFU over 100 %.
            out["value_reason"] = (f"the job achieved {value:.0%} of the peak ({flops / step_time / 1e12:.4g} of "
                                   f"{out['peak_flops'] / 1e12:.4g} TFLOP/s, {out['peak_source']}), so the peak is "
                                   f"too low or the FLOPs too high; give --peak-tflops or run dtprof calibrate on "
                                   f"a quiet machine")
            return out
        out["value"] = value
        if executed is not None and not source.startswith("executed"):
            out["hfu"] = executed / (step_time * out["peak_flops"])
    else:
        out["value_reason"] = "; ".join(x for x in (reason, missing) if x)
    if out["hfu"] is None:
        out["hfu_reason"] = ("executed FLOPs are the MFU source: they include any recomputation (activation "
                             "checkpointing), so with it the value is HFU, without it MFU"
                             if source and source.startswith("executed") else
                             "no executed FLOPs measured (--no-count-flops)")
    return out
