"""``dtprof calibrate``: measure the present device's dense GEMM peak and store it for MFU.

Times a large square matmul (after warm-up) with torch on the chosen device and dtype and reports
2·n³ / time as TFLOP/s. The figure is stored in ``$XDG_CACHE_HOME/dtprof/calibration.json`` (default
``~/.cache/dtprof/calibration.json``) under ``"<device name>|<dtype>"`` with the date; the MFU analyzer uses it for
runs on a device of that name when no ``--peak-tflops`` is given, labelled "calibrated on <date>".
This is the one CLI path allowed to import torch.
"""
from __future__ import annotations

import datetime as _dt
import json
import time

import click

from dtprof.cli import InputError

_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "tf32": "float32"}


def device_name(torch, device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def measure_tflops(device: str = "cpu", dtype: str = "bf16", n: int | None = None, seconds: float = 2.0) -> dict:
    import torch

    from dtprof.analyzers.mfu import norm_dtype

    dt = norm_dtype(dtype)
    if dt not in _TORCH_DTYPES:
        raise InputError(f"dtype {dtype!r} cannot be calibrated; use one of {', '.join(_TORCH_DTYPES)}")
    tdtype = getattr(torch, _TORCH_DTYPES[dt])
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("no CUDA device available; use --device cpu")
    n = n or (8192 if device.startswith("cuda") else 1024)
    if dt == "tf32" and device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    a = torch.randn(n, n, device=device, dtype=tdtype)
    b = torch.randn(n, n, device=device, dtype=tdtype)

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for _ in range(3):
        a @ b
    sync()
    iters, t0 = 0, time.perf_counter()
    while True:
        a @ b
        iters += 1
        if iters % 4 == 0:
            sync()
            if time.perf_counter() - t0 >= seconds:
                break
    elapsed = time.perf_counter() - t0
    tflops = 2.0 * n ** 3 * iters / elapsed / 1e12
    return {"device_name": device_name(torch, device), "dtype": dt, "tflops": tflops, "n": n, "iters": iters,
            "date": _dt.date.today().isoformat(), "torch": torch.__version__}


RUN_CALIBRATION_S = 1.0
_MEASURE = ("import json, sys, torch; torch.set_num_threads(int(sys.argv[3])); "
            "from dtprof.calibrate import measure_tflops; "
            "print(json.dumps(measure_tflops(sys.argv[1], sys.argv[2], seconds=float(sys.argv[4]))))")


def calibrate_for_run(node_dir, dtype: str, python: str) -> list[dict]:
    """`dtprof run`, after the job: a ~1 s GEMM calibration of each device its ranks used that has neither a spec
    peak nor a stored calibration (a CPU, an unlisted GPU), in a subprocess so the launcher never imports torch.
    A CPU rank's device is its share of the host's cores (cores // ranks on the node), so each rank's peak is
    measured with that many threads. ``python``: the job's Python (it has the job's torch and dtprof). Returns the
    results for node.json's ``config.peak_calibration``."""
    import os
    import subprocess
    from pathlib import Path

    from dtprof.analyzers.mfu import spec_peak_tflops
    from dtprof.options import calibration_key, load_calibrations

    idents = [json.loads(p.read_text()) for p in sorted(Path(node_dir).glob("rank-*/rank.json"))]
    stored = load_calibrations()
    out, seen = [], set()
    for ident in idents:
        name, kind = str(ident.get("device_name") or "cpu"), str(ident.get("device_type") or "cpu")
        if name in seen or calibration_key(name, dtype) in stored or (kind != "cpu" and spec_peak_tflops(name, dtype)):
            continue
        seen.add(name)
        device = "cpu" if kind == "cpu" else f"cuda:{ident.get('device_index') or 0}"
        threads = max(1, (os.cpu_count() or 1) // len(idents)) if kind == "cpu" else 1
        proc = subprocess.run([python, "-c", _MEASURE, device, dtype, str(threads), str(RUN_CALIBRATION_S)],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"calibration on {device} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        res.update(device_name=name, threads=threads, seconds=RUN_CALIBRATION_S)
        out.append(res)
    return out


def store(result: dict) -> str:
    from dtprof.options import calibration_key, calibration_path, load_calibrations
    from dtprof.rundir.writer import write_json_atomic

    cal = load_calibrations()
    key = calibration_key(result["device_name"], result["dtype"])
    cal[key] = result
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, cal)
    return str(path)


@click.command("calibrate")
@click.option("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available, else cpu).")
@click.option("--dtype", default="bf16", show_default=True, help="bf16, fp16, tf32 or fp32.")
@click.option("--size", "n", type=click.IntRange(min=64), default=None, help="Matrix size n (n×n @ n×n).")
@click.option("--seconds", type=float, default=2.0, show_default=True, help="How long to time the matmul.")
def calibrate_command(device, dtype, n, seconds):
    """Measure this device's GEMM peak (TFLOP/s) and store it for MFU.

    \b
    dtprof calibrate                      # the first GPU, bf16
    dtprof calibrate --device cpu --dtype fp32
    """
    try:
        import torch
    except ImportError:
        raise InputError("dtprof calibrate times a matmul with torch, which this Python cannot import; run it "
                         "with the Python of your training jobs") from None

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    res = measure_tflops(device, dtype, n, seconds)
    path = store(res)
    click.echo(f"{res['device_name']} {res['dtype']}: {res['tflops']:.3f} TFLOP/s "
               f"(n={res['n']}, {res['iters']} matmuls); stored in {path}")
    click.echo(json.dumps(res), err=True)
