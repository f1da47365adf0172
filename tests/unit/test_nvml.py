"""The node's NVML sampler: units, columns, NaN for unsupported metrics, throttle bitmask, and the real no-GPU path.

NVML is faked only at the pynvml boundary (tests/fake_pynvml.py); everything after it (the sampler, the JSON-lines
writer, the reader) is the real code.
"""
from __future__ import annotations

import time

import pytest

import fake_pynvml
from dtprof.collectors.nvml import NvmlSampler
from dtprof.reader import open_run
from dtprof.rundir.schema import columns
from dtprof.rundir.writer import NodeTableWriter, create_node_dir, create_run_dir


@pytest.fixture
def node_dir(tmp_path):
    run = create_run_dir(tmp_path / "run", {"command": ["test"]})
    return create_node_dir(run, host="hostA")


class FakeClock:
    def __init__(self, start_ns=10**12):
        self.t = start_ns

    def __call__(self):
        return self.t


def _sampler(node_dir, nv, clock=None):
    return NvmlSampler(node_dir, interval_s=0.05, host="hostA", nvml=nv, clock=clock or time.monotonic_ns)


def _start_without_thread(s):
    """start() but with the loop thread replaced, so the test drives ticks itself."""
    s._loop = lambda: None
    status = s.start()
    s._thread.join()
    return status


def test_units_and_columns_written_and_read_back(node_dir):
    nv = fake_pynvml.make(gpus=2, values={1: {"power_mw": 700_000, "pcie_tx_kbs": 4, "throttle": 0x4 | 0x20}})
    s = _sampler(node_dir, nv)
    status = s.start()
    assert status["available"] is True and [g["uuid"] for g in status["gpus"]] == ["GPU-fake-0000", "GPU-fake-0001"]
    time.sleep(0.4)
    final = s.stop()
    assert final["samples"] >= 3 and final["sample_cost_us_mean"] > 0

    df = open_run(node_dir.parent).nvml
    assert list(df.columns) == columns("nvml")
    assert set(df["gpu"]) == {0, 1} and set(df["host"].astype(str)) == {"hostA"}
    assert set(df["node"].astype(str)) == {node_dir.name}
    g0, g1 = df[df.gpu == 0].iloc[0], df[df.gpu == 1].iloc[0]
    assert g0.power_w == pytest.approx(312.5) and g1.power_w == pytest.approx(700.0)   # mW -> W
    assert g0.sm_util_pct == 87 and g0.mem_bw_util_pct == 41
    assert g0.mem_used_bytes == 30 * 2**30 and g0.mem_total_bytes == 80 * 2**30
    assert g0.temp_c == 66 and g0.sm_clock_mhz == 1980 and g0.mem_clock_mhz == 2619
    assert g0.pcie_tx_bytes_s == 1_500_000 and g0.pcie_rx_bytes_s == 2_500_000       # KB/s -> bytes/s
    assert g1.pcie_tx_bytes_s == 4000
    assert int(g1.throttle_reasons) == 0x24 and int(g0.throttle_reasons) == 0
    assert int(g0.ecc_errors) == 0
    assert (df.groupby("gpu")["t_ns"].diff().dropna() > 0).all()
    assert nv.calls["nvmlShutdown"] == 1


def test_nvlink_rate_from_counter_deltas_and_pcie_at_most_1hz(node_dir):
    clock = FakeClock()
    nv = fake_pynvml.make(gpus=1, values={0: {"nvlink_step_kib": 1000}})
    s = _sampler(node_dir, nv, clock)
    _start_without_thread(s)
    rows = []
    for _ in range(12):          # 12 ticks, 100 ms apart
        rows += s.sample_once()
        clock.t += 100_000_000
    cols = columns("nvml")
    tx = [r[cols.index("nvlink_tx_bytes_s")] for r in rows]
    rx = [r[cols.index("nvlink_rx_bytes_s")] for r in rows]
    assert tx[0] is None                                   # no rate before the second reading
    assert tx[1] == pytest.approx(1000 * 1024 / 0.1)       # KiB delta over 0.1 s, in bytes/s
    assert rx[1] == pytest.approx(2000 * 1024 / 0.1)
    pcie = [r[cols.index("pcie_tx_bytes_s")] for r in rows]
    assert [i for i, v in enumerate(pcie) if v is not None] == [0, 10]   # once per second (20 ms call)
    s.stop()


def test_unsupported_metric_is_nan_for_that_gpu_and_reported_once(node_dir):
    nv = fake_pynvml.make(gpus=2, unsupported={1: {"power", "nvlink", "ecc"}})
    s = _sampler(node_dir, nv)
    _start_without_thread(s)
    for _ in range(5):
        s.sample_once()
    status = s.stop()
    run = open_run(node_dir.parent)
    df = run.nvml
    g0, g1 = df[df.gpu == 0], df[df.gpu == 1]
    assert g1["power_w"].isna().all() and g1["nvlink_tx_bytes_s"].isna().all() and g1["ecc_errors"].isna().all()
    assert g0["power_w"].notna().all() and g0["ecc_errors"].notna().all()
    assert g1["sm_util_pct"].notna().all()                  # the other metrics of that GPU still come
    ev = run.events
    assert (ev["source"].astype(str) == "nvml").all() and (ev["rank"] == -1).all()
    msgs = list(ev["message"].astype(str))
    assert len(msgs) == 3, msgs                            # one row per (gpu, metric), not one per sample
    assert all(m.startswith("GPU 1: ") and "not supported" in m for m in msgs)
    assert set(ev["level"].astype(str)) == {"info"}
    assert nv.calls["nvmlDeviceGetPowerUsage"] == 5 + 1     # GPU 0 every tick, GPU 1 once, then not asked again
    assert status["unsupported"] == {"1": ["ecc_errors", "nvlink", "power"]}


def test_older_driver_throttle_reasons_api(node_dir):
    nv = fake_pynvml.make(gpus=1, values={0: {"throttle": 0x8}}, old_throttle_api=True)
    s = _sampler(node_dir, nv)
    _start_without_thread(s)
    row = s.sample_once()[0]
    s.stop()
    assert row[columns("nvml").index("throttle_reasons")] == 0x8
    assert nv.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 1


def test_other_nvml_error_becomes_nan_and_a_warning(node_dir):
    import pynvml

    nv = fake_pynvml.make(gpus=1)

    def lost(handle):
        raise pynvml.NVMLError_GpuIsLost()
    nv.nvmlDeviceGetTemperature = lambda h, sensor: lost(h)
    s = _sampler(node_dir, nv)
    _start_without_thread(s)
    rows = s.sample_once() + s.sample_once()
    s.stop()
    i = columns("nvml").index("temp_c")
    assert rows[0][i] is None and rows[1][i] is None
    ev = open_run(node_dir.parent).events
    assert list(ev["level"].astype(str)) == ["warning"] and "temperature" in ev["message"].iloc[0]


def test_init_failure_is_one_event_and_status(node_dir):
    import pynvml

    nv = fake_pynvml.make(init_error=pynvml.NVMLError_DriverNotLoaded)
    status = _sampler(node_dir, nv).start()
    assert status["available"] is False and "DriverNotLoaded" in status["reason"]


def test_real_pynvml_without_gpu(node_dir):
    """This machine has no NVIDIA driver: the real pynvml must fail in nvmlInit, and we say so once."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVML; the no-GPU path cannot be exercised for real here")
    events = NodeTableWriter(node_dir, "events")
    s = NvmlSampler(node_dir, interval_s=0.1, events=events, host="hostA")   # real pynvml
    status = s.start()
    assert status == {"available": False, "reason": status["reason"]}
    assert "LibraryNotFound" in status["reason"]
    s.stop()
    events.close()
    ev = open_run(node_dir.parent).events
    assert len(ev) == 1 and ev["rank"].iloc[0] == -1 and str(ev["source"].iloc[0]) == "nvml"
    assert "NVML not available" in ev["message"].iloc[0]
    assert not list(node_dir.glob("nvml.*"))
