"""A fake `pynvml` for tests: the real module's constants, error classes and structs, with the device functions
replaced by ones that read a table of per-GPU values. Only what this machine cannot have (a GPU) is faked.

    nv = make(gpus=2, unsupported={1: {"power"}})
    monkeypatch.setitem(sys.modules, "pynvml", nv)      # or pass nvml=nv to NvmlSampler

Values per GPU (override with ``values={gpu: {...}}``): util_gpu, util_mem (percent), mem_used, mem_total (bytes),
power_mw, temp_c, sm_mhz, mem_mhz, pcie_tx_kbs, pcie_rx_kbs, nvlink_tx_kib, nvlink_rx_kib (cumulative counters,
advanced by nvlink_step_kib on every read), throttle (bitmask), ecc.
``unsupported`` names the fake's functions per GPU that raise NVMLError_NotSupported: "utilization", "memory",
"power", "temperature", "clock", "pcie", "nvlink", "throttle", "ecc".
"""
from __future__ import annotations

import types
from collections import Counter

import pynvml as _real

DEFAULTS = dict(util_gpu=87, util_mem=41, mem_used=30 * 2**30, mem_total=80 * 2**30, power_mw=312_500, temp_c=66,
                sm_mhz=1980, mem_mhz=2619, pcie_tx_kbs=1500, pcie_rx_kbs=2500, nvlink_tx_kib=0, nvlink_rx_kib=0,
                nvlink_step_kib=1024, throttle=0, ecc=0)


def make(gpus: int = 1, values: dict | None = None, unsupported: dict | None = None, old_throttle_api=False,
         init_error: type | None = None):
    nv = types.ModuleType("pynvml")
    for name in dir(_real):
        if name.startswith(("NVML_", "NVMLError", "c_nvml")):
            setattr(nv, name, getattr(_real, name))
    state = [dict(DEFAULTS, **((values or {}).get(i, {}))) for i in range(gpus)]
    unsup = {i: set((unsupported or {}).get(i, ())) for i in range(gpus)}
    nv.calls = Counter()      # function name -> number of calls, for "not asked again" checks
    nv.state = state

    def api(fname, kind=None):
        def deco(fn):
            def wrapper(handle, *args):
                nv.calls[fname] += 1
                if kind and kind in unsup[handle]:
                    raise _real.NVMLError_NotSupported()
                return fn(state[handle], *args)
            setattr(nv, fname, wrapper)
            return wrapper
        return deco

    def nvmlInit():
        nv.calls["nvmlInit"] += 1
        if init_error is not None:
            raise init_error()
    nv.nvmlInit = nvmlInit
    nv.nvmlShutdown = lambda: nv.calls.update(["nvmlShutdown"])
    nv.nvmlDeviceGetCount = lambda: gpus
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlDeviceGetUUID = lambda h: f"GPU-fake-{h:04d}"
    nv.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    nv.nvmlSystemGetDriverVersion = lambda: "550.54.15"

    @api("nvmlDeviceGetUtilizationRates", "utilization")
    def _(s):
        return types.SimpleNamespace(gpu=s["util_gpu"], memory=s["util_mem"])

    @api("nvmlDeviceGetMemoryInfo", "memory")
    def _(s):
        return types.SimpleNamespace(used=s["mem_used"], total=s["mem_total"], free=s["mem_total"] - s["mem_used"])

    @api("nvmlDeviceGetPowerUsage", "power")
    def _(s):
        return s["power_mw"]

    @api("nvmlDeviceGetTemperature", "temperature")
    def _(s, sensor):
        assert sensor == _real.NVML_TEMPERATURE_GPU
        return s["temp_c"]

    @api("nvmlDeviceGetClockInfo", "clock")
    def _(s, which):
        return {_real.NVML_CLOCK_SM: s["sm_mhz"], _real.NVML_CLOCK_MEM: s["mem_mhz"]}[which]

    @api("nvmlDeviceGetPcieThroughput", "pcie")
    def _(s, counter):
        return {_real.NVML_PCIE_UTIL_TX_BYTES: s["pcie_tx_kbs"],
                _real.NVML_PCIE_UTIL_RX_BYTES: s["pcie_rx_kbs"]}[counter]

    @api("nvmlDeviceGetFieldValues", "nvlink")
    def _(s, field_ids):
        out = (_real.c_nvmlFieldValue_t * len(field_ids))()
        s["nvlink_tx_kib"] += s["nvlink_step_kib"]
        s["nvlink_rx_kib"] += 2 * s["nvlink_step_kib"]
        for i, (fid, scope) in enumerate(field_ids):
            out[i].fieldId, out[i].scopeId = fid, scope
            out[i].valueType = _real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            out[i].value.ullVal = {_real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: s["nvlink_tx_kib"],
                                   _real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: s["nvlink_rx_kib"]}[fid]
        return out

    if old_throttle_api:
        @api("nvmlDeviceGetCurrentClocksThrottleReasons", "throttle")
        def _(s):
            return s["throttle"]
    else:
        @api("nvmlDeviceGetCurrentClocksEventReasons", "throttle")
        def _(s):
            return s["throttle"]

    @api("nvmlDeviceGetTotalEccErrors", "ecc")
    def _(s, error_type, counter_type):
        assert (error_type, counter_type) == (_real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, _real.NVML_VOLATILE_ECC)
        return s["ecc"]

    return nv
