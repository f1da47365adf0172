"""Node-level GPU sampler: every GPU of the node through NVML, in a thread of the `dtprof run` launcher.

The launcher starts one ``NvmlSampler`` before the job and stops it after; the training processes never touch
NVML. Each tick reads every GPU and appends one row per GPU to the node's ``nvml`` table
(``node_dir/nvml.jsonl.gz`` through ``NodeTableWriter``, flushed every second; columns in ``dtprof.rundir.schema``):

=====================  ===============================================  ===========================
column                 NVML call                                        unit conversion
=====================  ===============================================  ===========================
sm_util_pct            nvmlDeviceGetUtilizationRates().gpu              percent, as given
mem_bw_util_pct        nvmlDeviceGetUtilizationRates().memory           percent, as given
mem_used/total_bytes   nvmlDeviceGetMemoryInfo().used / .total          bytes, as given
power_w                nvmlDeviceGetPowerUsage                          mW / 1000
temp_c                 nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)   °C, as given
sm/mem_clock_mhz       nvmlDeviceGetClockInfo(NVML_CLOCK_SM / _MEM)     MHz, as given
pcie_tx/rx_bytes_s     nvmlDeviceGetPcieThroughput(TX / RX)             KB/s * 1000 (at most 1 Hz)
nvlink_tx/rx_bytes_s   field values THROUGHPUT_DATA_TX / _RX, all links KiB counter delta * 1024 / dt
throttle_reasons       nvmlDeviceGetCurrentClocksEventReasons           bitmask (older drivers:
                                                                        ...ClocksThrottleReasons)
ecc_errors             nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE) count
=====================  ===============================================  ===========================

Decisions
- A metric that raises ``NVML_ERROR_NOT_SUPPORTED`` (or ``FUNCTION_NOT_FOUND``) on a GPU is null (NaN once read)
  for that GPU from then on and is not asked again; this is recorded once as an ``info`` row in the events table.
  Any other NVML error on one metric makes that value null and is recorded once as a ``warning``.
- ``nvmlDeviceGetPcieThroughput`` measures over a 20 ms window inside the call, so it is read at most once per
  second per GPU (null on the ticks in between) to keep the sampling cadence.
- NVLink throughput fields are cumulative KiB counters; they are asked with scopeId UINT_MAX (sum over all links)
  and turned into a rate from two consecutive ticks (null on the first tick).
- No NVML (no driver, no GPU, pynvml missing): ``start()`` returns ``{"available": False, "reason": ...}`` and
  writes one events row (rank -1, source "nvml"); nothing else changes.
- The sampler never raises into the launcher: a fault in the loop is recorded as an ``error`` event and sampling
  stops.
"""
from __future__ import annotations

import math
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from dtprof.rundir.writer import NodeTableWriter

UINT_MAX = 0xFFFFFFFF
PCIE_MIN_PERIOD_NS = 1_000_000_000
FLUSH_PERIOD_NS = 1_000_000_000

# Metric groups read per tick; each name is what gets reported once as unsupported.
METRICS = ("utilization", "memory", "power", "temperature", "sm_clock", "mem_clock", "pcie", "nvlink",
           "throttle_reasons", "ecc_errors")

# Row layout: same order as dtprof.rundir.schema.TABLES["nvml"].
_VALUE_COLUMNS = ("sm_util_pct", "mem_bw_util_pct", "mem_used_bytes", "mem_total_bytes", "power_w", "temp_c",
                  "sm_clock_mhz", "mem_clock_mhz", "pcie_tx_bytes_s", "pcie_rx_bytes_s", "nvlink_tx_bytes_s",
                  "nvlink_rx_bytes_s", "throttle_reasons", "ecc_errors")


def _import_pynvml():
    import pynvml  # package nvidia-ml-py

    return pynvml


class _Gpu:
    """Per-GPU state: handle, identity, what is unsupported, and counters kept between ticks."""

    def __init__(self, index: int, handle: Any, uuid: str, name: str):
        self.index = index
        self.handle = handle
        self.uuid = uuid
        self.name = name
        self.skip: set[str] = set()         # metrics not supported here: never asked again
        self.reported: set[str] = set()     # metrics whose failure is already in the events table
        self.last_pcie_ns = -PCIE_MIN_PERIOD_NS
        self.last_nvlink: tuple[int, float, float] | None = None   # (t_ns, tx_kib, rx_kib)


class NvmlSampler:
    """Sample every GPU of this node every ``interval_s`` seconds into ``node_dir/nvml.jsonl.gz``.

    >>> s = NvmlSampler(node_dir, interval_s=0.1, events=events_writer)
    >>> status = s.start()          # {"available": bool, "reason": str|None, "gpus": [...], ...}
    >>> ...                         # the job runs
    >>> status = s.stop()           # adds samples, sample_cost_us_mean (per tick, all GPUs)

    ``events`` is the node's events ``NodeTableWriter`` (shared with the launcher); ``nvml`` replaces the pynvml
    module (tests pass a fake one at this boundary).
    """

    def __init__(self, node_dir: Path, interval_s: float = 0.1, events: NodeTableWriter | None = None,
                 host: str | None = None, nvml: Any = None, clock: Callable[[], int] = time.monotonic_ns):
        self.node_dir = Path(node_dir)
        self.interval_s = float(interval_s)
        self.host = host or socket.gethostname()
        self.node = self.node_dir.name
        self.events = events if events is not None else NodeTableWriter(self.node_dir, "events")
        self._own_events = events is None
        self._nv = nvml
        self._clock = clock
        self._gpus: list[_Gpu] = []
        self._writer: NodeTableWriter | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.samples = 0
        self.sample_cost_ns = 0
        self.status: dict = {"available": False, "reason": "not started"}

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> dict:
        """Initialise NVML and start the sampling thread. Never raises; returns the status for node.json."""
        try:
            nv = self._nv if self._nv is not None else _import_pynvml()
            self._nv = nv
        except ImportError as e:
            return self._unavailable(f"pynvml is not importable ({e}); install nvidia-ml-py")
        try:
            nv.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound (no driver), DriverNotLoaded, ...
            return self._unavailable(f"nvmlInit failed: {type(e).__name__}: {e}")
        try:
            gpus = []
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                gpus.append(_Gpu(i, h, _text(nv.nvmlDeviceGetUUID(h)), _text(nv.nvmlDeviceGetName(h))))
            driver = _text(nv.nvmlSystemGetDriverVersion())
        except Exception as e:
            self._shutdown()
            return self._unavailable(f"NVML device enumeration failed: {type(e).__name__}: {e}")
        if not gpus:
            self._shutdown()
            return self._unavailable("NVML found no GPU on this node")
        self._gpus = gpus
        self._writer = NodeTableWriter(self.node_dir, "nvml")
        self.status = {"available": True, "reason": None, "driver_version": driver, "interval_s": self.interval_s,
                       "gpus": [{"index": g.index, "name": g.name, "uuid": g.uuid} for g in gpus]}
        self._thread = threading.Thread(target=self._loop, name="dtprof-nvml", daemon=True)
        self._thread.start()
        return self.status

    def stop(self) -> dict:
        """Stop the thread, flush the table, shut NVML down. Returns the final status."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 3 * self.interval_s))
        if self._writer is not None:
            self._writer.close()
            self._shutdown()
        self.events.flush()
        if self._own_events:
            self.events.close()
        if self.status.get("available"):
            self.status["samples"] = self.samples
            self.status["sample_cost_us_mean"] = (
                round(self.sample_cost_ns / self.samples / 1000, 1) if self.samples else None)
            self.status["unsupported"] = {str(g.index): sorted(g.skip) for g in self._gpus if g.skip}
        return self.status

    def _unavailable(self, reason: str) -> dict:
        self.status = {"available": False, "reason": reason}
        self._event("info", f"NVML not available, no GPU samples: {reason}")
        self.events.flush()
        return self.status

    def _shutdown(self) -> None:
        try:
            self._nv.nvmlShutdown()
        except Exception:
            pass

    def _event(self, level: str, message: str) -> None:
        self.events.append((-1, self.host, self._clock(), level, "nvml", message))

    # ---- sampling --------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        interval_ns = int(self.interval_s * 1e9)
        next_ns = self._clock()
        last_flush = next_ns
        try:
            while not self._stop.is_set():
                t0 = time.perf_counter_ns()
                self.sample_once()
                self.sample_cost_ns += time.perf_counter_ns() - t0
                self.samples += 1
                now = self._clock()
                if now - last_flush >= FLUSH_PERIOD_NS:
                    self._writer.flush()
                    self.events.flush()
                    last_flush = now
                next_ns += interval_ns
                if next_ns < now:  # fell behind (slow NVML): skip missed ticks rather than burst
                    next_ns = now + interval_ns - (now - next_ns) % interval_ns
                self._stop.wait((next_ns - now) / 1e9)
        except Exception as e:  # never let the sampler take the launcher down
            self._event("error", f"NVML sampler stopped after {self.samples} samples: {type(e).__name__}: {e}")
            self.status["stopped_early"] = f"{type(e).__name__}: {e}"

    def sample_once(self) -> list[tuple]:
        """Read every GPU once and append the rows (returned too, for tests and cost measurement)."""
        rows = []
        for g in self._gpus:
            t_ns = self._clock()
            values = self._read_gpu(g, t_ns)
            row = (self.host, self.node, g.index, g.uuid, t_ns) + tuple(values[c] for c in _VALUE_COLUMNS)
            self._writer.append(row)
            rows.append(row)
        return rows

    def _read_gpu(self, g: _Gpu, t_ns: int) -> dict:
        nv, h = self._nv, g.handle
        v: dict[str, Any] = dict.fromkeys(_VALUE_COLUMNS)
        if self._want(g, "utilization"):
            u = self._call(g, "utilization", nv.nvmlDeviceGetUtilizationRates, h)
            if u is not None:
                v["sm_util_pct"], v["mem_bw_util_pct"] = float(u.gpu), float(u.memory)
        if self._want(g, "memory"):
            m = self._call(g, "memory", nv.nvmlDeviceGetMemoryInfo, h)
            if m is not None:
                v["mem_used_bytes"], v["mem_total_bytes"] = float(m.used), float(m.total)
        if self._want(g, "power"):
            p = self._call(g, "power", nv.nvmlDeviceGetPowerUsage, h)
            v["power_w"] = None if p is None else p / 1000.0        # milliwatts -> W
        if self._want(g, "temperature"):
            v["temp_c"] = _float(self._call(g, "temperature", nv.nvmlDeviceGetTemperature, h,
                                            nv.NVML_TEMPERATURE_GPU))
        if self._want(g, "sm_clock"):
            v["sm_clock_mhz"] = _float(self._call(g, "sm_clock", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM))
        if self._want(g, "mem_clock"):
            v["mem_clock_mhz"] = _float(self._call(g, "mem_clock", nv.nvmlDeviceGetClockInfo, h,
                                                   nv.NVML_CLOCK_MEM))
        if self._want(g, "pcie") and t_ns - g.last_pcie_ns >= PCIE_MIN_PERIOD_NS:
            g.last_pcie_ns = t_ns
            tx = self._call(g, "pcie", nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_TX_BYTES)
            rx = self._call(g, "pcie", nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_RX_BYTES)
            v["pcie_tx_bytes_s"] = None if tx is None else tx * 1000.0   # KB/s -> bytes/s
            v["pcie_rx_bytes_s"] = None if rx is None else rx * 1000.0
        if self._want(g, "nvlink"):
            v["nvlink_tx_bytes_s"], v["nvlink_rx_bytes_s"] = self._nvlink(g, t_ns)
        if self._want(g, "throttle_reasons"):
            fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                nv.nvmlDeviceGetCurrentClocksThrottleReasons
            r = self._call(g, "throttle_reasons", fn, h)
            v["throttle_reasons"] = None if r is None else int(r)
        if self._want(g, "ecc_errors"):
            e = self._call(g, "ecc_errors", nv.nvmlDeviceGetTotalEccErrors, h,
                           nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
            v["ecc_errors"] = None if e is None else int(e)
        return v

    def _nvlink(self, g: _Gpu, t_ns: int) -> tuple[float | None, float | None]:
        nv = self._nv
        fields = [(nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, UINT_MAX),
                  (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, UINT_MAX)]
        vals = self._call(g, "nvlink", nv.nvmlDeviceGetFieldValues, g.handle, fields)
        if vals is None:
            return None, None
        if any(fv.nvmlReturn != nv.NVML_SUCCESS for fv in vals):
            code = next(fv.nvmlReturn for fv in vals if fv.nvmlReturn != nv.NVML_SUCCESS)
            self._failed(g, "nvlink", code, f"field value returned NVML code {code}")
            return None, None
        tx_kib, rx_kib = (_field_value(nv, fv) for fv in vals)
        prev, g.last_nvlink = g.last_nvlink, (t_ns, tx_kib, rx_kib)
        if prev is None or t_ns <= prev[0]:
            return None, None
        dt_s = (t_ns - prev[0]) / 1e9
        return (tx_kib - prev[1]) * 1024 / dt_s, (rx_kib - prev[2]) * 1024 / dt_s

    @staticmethod
    def _want(g: _Gpu, metric: str) -> bool:
        return metric not in g.skip

    def _call(self, g: _Gpu, metric: str, fn: Callable, *args):
        try:
            return fn(*args)
        except Exception as e:
            code = getattr(e, "value", None)
            self._failed(g, metric, code, f"{type(e).__name__}: {e}")
            return None

    def _failed(self, g: _Gpu, metric: str, code, detail: str) -> None:
        nv = self._nv
        unsupported = code in (getattr(nv, "NVML_ERROR_NOT_SUPPORTED", 3),
                               getattr(nv, "NVML_ERROR_FUNCTION_NOT_FOUND", 13))
        if unsupported:
            g.skip.add(metric)
        if metric in g.reported:
            return
        g.reported.add(metric)
        if unsupported:
            self._event("info", f"GPU {g.index}: {metric} not supported, recorded as NaN ({detail})")
        else:
            self._event("warning", f"GPU {g.index}: reading {metric} failed, recorded as NaN ({detail}); "
                                   "further failures of this metric are not repeated here")


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _float(x) -> float | None:
    return None if x is None else float(x)


def _field_value(nv, fv) -> float:
    """The value of an nvmlFieldValue_t according to its valueType."""
    kind = fv.valueType
    val = fv.value
    if kind == nv.NVML_VALUE_TYPE_DOUBLE:
        return float(val.dVal)
    attr = {nv.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal", nv.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
            nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal", nv.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
            getattr(nv, "NVML_VALUE_TYPE_SIGNED_INT", 5): "siVal"}.get(kind, "ullVal")
    out = float(getattr(val, attr))
    return out if math.isfinite(out) else math.nan
