"""The command-line edge of the analysis: the one place that turns command-line values, the run's recorded launcher
config and this machine's stored calibrations into the ``AnalysisOptions`` the analyzers take (analyzers/options.py).

Precedence per option: the command line, else node.json ``config`` (what ``dtprof run`` was given), else the
default; the dtype defaults to fp32 when every rank ran on a CPU (bf16 otherwise). Device peaks (for MFU), per
device name of the run and the options' dtype: ``--peak-tflops``, else a figure stored by ``dtprof calibrate`` on
this machine ($XDG_CACHE_HOME/dtprof/calibration.json, "calibrated on <date>"), else the ~1 s calibration
``dtprof run`` made after the job for a device with no spec peak (node.json ``config.peak_calibration``,
"calibrated by dtprof run"), else the spec table (analyzers/mfu.py ``PEAK_TFLOPS``), else unknown with the reason.
The resolved peaks and their sources are recorded in summary.json ``options``, so the analysis of a run never
depends on the machine that reads it afterwards.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from dtprof.analyzers.mfu import norm_dtype, spec_peak_tflops
from dtprof.analyzers.options import AnalysisOptions, DevicePeak


def calibration_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dtprof" / "calibration.json"


def calibration_key(device_name: str, dtype: str) -> str:
    return f"{device_name}|{norm_dtype(dtype)}"


def load_calibrations() -> dict:
    try:
        return json.loads(calibration_path().read_text())
    except (OSError, ValueError):
        return {}


def _node_config(run) -> dict:
    cfg: dict = {}
    for n in run.nodes:
        c = n.get("config")
        if isinstance(c, dict):
            for k, v in c.items():
                cfg.setdefault(k, v)
    return cfg


def device_peak(name: str, device_type: str, dtype: str, peak_tflops: float | None, calibrations: dict,
                run_calibration: list | None = None) -> DevicePeak:
    if peak_tflops is not None:
        return DevicePeak(float(peak_tflops), f"user: {float(peak_tflops):g} TFLOP/s per device")
    entry = calibrations.get(calibration_key(name, dtype))
    if entry and entry.get("tflops"):
        return DevicePeak(float(entry["tflops"]), f"calibrated on {entry.get('date', '?')} ({name}, {dtype}: "
                                                  f"{float(entry['tflops']):g} TFLOP/s)")
    for c in run_calibration or []:   # dtprof/calibrate.py calibrate_for_run, recorded by the launcher
        if (isinstance(c, dict) and c.get("device_name") == name and c.get("tflops")
                and norm_dtype(str(c.get("dtype", ""))) == dtype):
            return DevicePeak(float(c["tflops"]), f"calibrated by dtprof run ({c.get('seconds', '?')} s {dtype} GEMM "
                                                  f"on {name}, {c.get('threads', '?')} thread(s) per rank: "
                                                  f"{float(c['tflops']):.4g} TFLOP/s)")
    if device_type == "cpu" or name in ("", "cpu"):
        return DevicePeak(None, reason=f"{name or 'cpu'}: a CPU has no spec peak (give --peak-tflops or run "
                                       f"dtprof calibrate)")
    spec = spec_peak_tflops(name, dtype)
    if spec is None:
        return DevicePeak(None, reason=f"{name}: no spec peak for dtype {dtype} (give --peak-tflops or run "
                                       f"dtprof calibrate)")
    return DevicePeak(float(spec), f"spec sheet ({name}, {dtype} dense: {spec:g} TFLOP/s)")


def open_and_analyze(run_dir, *, check_tables: bool = True, progress=None):
    """The commands' one way from a run directory to its analysis: open the run, resolve its options (below: the
    run's own configuration, then defaults) and analyse it once. Returns (run, analysis); raises
    dtprof.rundir.run.RunFormatError for an unreadable run."""
    from dtprof.analyzers.summary import analyze
    from dtprof.rundir.run import open_run

    run = open_run(run_dir, check_tables=check_tables)
    return run, analyze(run, resolve_options(run), progress=progress)


def resolve_options(run, *, warmup: int | None = None, flops_per_step: float | None = None,
                    peak_tflops: float | None = None, dtype: str | None = None,
                    transformer: dict | None = None, gpu_window: str = "all") -> AnalysisOptions:
    """The options for analysing ``run`` (a dtprof.rundir.run.Run). Raises ValueError on an invalid value."""
    cfg = _node_config(run)
    r = run.ranks
    devices = dict(zip(r["device_name"].astype(str), r["device_type"].astype(str)))
    cpu_only = len(r) > 0 and set(r["device_type"].astype(str)) == {"cpu"}
    dtype = norm_dtype(dtype or cfg.get("dtype") or ("fp32" if cpu_only else "bf16"))
    peak_tflops = peak_tflops if peak_tflops is not None else cfg.get("peak_tflops")
    calibrations = load_calibrations() if peak_tflops is None else {}
    return AnalysisOptions(
        warmup=warmup if warmup is not None else cfg.get("warmup"),
        flops_per_step=flops_per_step if flops_per_step is not None else cfg.get("flops_per_step"),
        dtype=dtype, transformer=transformer if transformer is not None else cfg.get("transformer"),
        peaks={name: device_peak(name, dtype_, dtype, peak_tflops, calibrations, cfg.get("peak_calibration"))
               for name, dtype_ in sorted(devices.items())},
        gpu_window=gpu_window)
