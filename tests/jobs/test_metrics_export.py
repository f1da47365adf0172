"""`dtprof run --metrics SINK`: live per-step metrics in Prometheus, TensorBoard, W&B and MLflow
(docs/metrics-export.md).

Real jobs with the real libraries, each job shared by several checks: a 2-rank DDP job under torchrun (rank 1 slowed,
so the live straggler fires; two GPUs faked at the pynvml boundary in the launcher, as in test_launcher.py, since this
machine has none) publishing to all four sinks plus a Prometheus sink whose port is taken (the failing sink), scraped
over HTTP while it trains; and a Lightning job publishing to all four. What each sink stored is read back with its
own library: Prometheus's text parser, TensorBoard's EventAccumulator, W&B's record protobufs from the offline run
file (wandb 0.31 ships no Python reader of its own for that file; its framing is LevelDB's log format), and MLflow's
client on a file store. The live reader's lateness, lead and hang rules are checked on hand-made rows.
"""
from __future__ import annotations

import json
import os
import re
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import RECORD_ATTEMPTS, REPO, TESTS, dtprof, free_port
from dtprof.live import LiveNode
from dtprof.reader import open_run
from dtprof.rundir.writer import RankWriter, write_json_atomic
from torch_abort import aborted_at_exit, returncode

BIN = Path(sys.executable).parent
# The jobs run with --full-detail: these tests read every step's parts and lateness in each sink (with sampling,
# boundary-only steps publish their times only: docs/metrics-export.md)
DDP_STEPS = 120   # ~12 s of training: steps are published ~3 s after they end, and the scrape must come before the end
LR = 1e-3         # examples/model.py's default --lr
BOOT_FAKE_GPUS = ("import sys, fake_pynvml; "
                  "sys.modules['pynvml'] = fake_pynvml.make(gpus=2, values={1: {'throttle': 4}}); "
                  "from dtprof.cli import main; main()")


def scrape(port: int) -> dict[tuple, float] | None:
    """The endpoint's samples as {(name, (label, value), ...): value}, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    return {(s.name, *sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def rank_value(samples: dict, name: str, rank: int, **labels) -> float | None:
    for key, v in samples.items():
        if key[0] == name and ("rank", str(rank)) in key[1:] and all((k, v2) in key[1:] for k, v2 in labels.items()):
            return v
    return None


def sinks(tmp: Path, port: int) -> list[str]:
    return ["--metrics", f"prometheus:{port}", "--metrics", f"tensorboard:{tmp / 'tb'}", "--metrics", "wandb",
            "--metrics", f"mlflow:file:{tmp / 'mlruns'}"]


def run_live(cmd: list, tmp: Path, port: int, ranks: int, timeout_s: float = 240):
    """Start ``cmd``; scrape the endpoint until every rank has published steps while the job still runs (the job's
    command is still alive); return (CompletedProcess-like, the scrape taken while it ran)."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp), "WANDB_SILENT": "true",
           "PYTHONPATH": str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    live = None
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        got = scrape(port)
        if got and all((rank_value(got, "dtprof_steps_total", r) or 0) >= 3 for r in range(ranks)):
            if _job_running(tmp):
                live = got
                break
        time.sleep(0.3)
    out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), live


def _job_running(tmp: Path) -> bool:
    """No rank's heartbeat marks its exit yet: the scrape was taken while the ranks trained, not after them."""
    from dtprof.watchdog import read_heartbeats

    beats = [b for node in (tmp / "run").glob("node-*") for b in read_heartbeats(node).values()]
    return bool(beats) and all(b.get("exit") is None for b in beats)


# ---- a 2-rank DDP job under torchrun --------------------------------------------------------------------------

def recorded(tmp_path_factory, name: str, command) -> tuple:
    """``command(tmp, port)``'s job run live into a fresh folder; one whose rank hit torch's exit abort is recorded
    again (conftest.RECORD_ATTEMPTS): the module's tests share it, so a rerun of one test would meet the same abort."""
    for _ in range(RECORD_ATTEMPTS):
        tmp, port = tmp_path_factory.mktemp(name), free_port()
        proc, live = command(tmp, port)
        if not aborted_at_exit(proc):
            break
    return tmp, proc, live


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    def command(tmp, port):
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cmd = [sys.executable, "-c", BOOT_FAKE_GPUS, "run", "--out", str(tmp / "run"), "--no-report",
               "--nvml-interval", "0.2", "--metrics-interval", "0", "--full-detail", *sinks(tmp, port),
               "--metrics", f"prometheus:{taken.getsockname()[1]}", "--",
               str(BIN / "torchrun"), "--nproc_per_node=2", str(REPO / "examples" / "train_ddp.py"), "--steps",
               str(DDP_STEPS), "--dim", "64", "--seq", "32", "--slow-rank", "1", "--slow-ms", "80"]
        try:
            return run_live(cmd, tmp, port, ranks=2)
        finally:
            taken.close()
    return recorded(tmp_path_factory, "metrics-ddp", command)


@pytest.mark.slow
def test_ddp_job_unharmed_and_failing_sink_dropped_in_one_line(ddp):
    tmp, proc, _ = ddp
    assert returncode(proc) == 0, proc.stderr[-3000:]
    failed = [line for line in proc.stderr.splitlines() if "metrics sink prometheus:" in line]
    assert len(failed) == 1 and "failed" in failed[0] and "dropped, the job and the run go on" in failed[0], failed
    assert "Traceback" not in proc.stderr
    run = open_run(tmp / "run")
    assert run.steps.groupby("rank").size().to_dict() == {0: DDP_STEPS, 1: DDP_STEPS}
    assert (tmp / "run" / "summary.json").exists()
    rec = run.nodes[0]["metrics"]     # node.json: how each sink fared, what publishing cost
    status = {name.split(":")[0] + (":taken" if "failed" in v["status"] else ""): v["status"]
              for name, v in rec["sinks"].items()}
    assert sorted(status) == ["mlflow", "prometheus", "prometheus:taken", "tensorboard", "wandb"], status
    assert status["prometheus:taken"].startswith("failed: OSError")
    assert rec["steps_published"] == 2 * DDP_STEPS and rec["read_cpu_s"] > 0


@pytest.mark.slow
def test_prometheus_scraped_while_the_job_trains(ddp):
    tmp, proc, live = ddp
    assert live is not None, f"no scrape while the job ran\n{proc.stderr[-3000:]}"
    host = socket.gethostname()
    for r in (0, 1):
        n = rank_value(live, "dtprof_steps_total", r, host=host)
        assert 3 <= n <= DDP_STEPS
        assert rank_value(live, "dtprof_step_duration_seconds_count", r) == n
        assert rank_value(live, "dtprof_step_duration_seconds_sum", r) > 0
        parts = {p: rank_value(live, "dtprof_step_part_seconds_total", r, part=p)
                 for p in ("forward", "backward", "optimizer", "exposed_comm", "data_wait", "other")}
        assert all(v is not None for v in parts.values()), parts
        # the parts partition the steps: their sum is the steps' summed time
        total = sum(v for k, v in live.items() if k[0] == "dtprof_step_part_seconds_total" and ("rank", str(r)) in k)
        assert total == pytest.approx(rank_value(live, "dtprof_step_duration_seconds_sum", r), rel=1e-6)
        assert rank_value(live, "dtprof_step_tokens_total", r) == 8 * 32 * n       # --batch 8 x --seq 32
        assert rank_value(live, "dtprof_step_samples_per_second", r) > 0
        assert rank_value(live, "dtprof_step_peak_memory_bytes", r) > 0
        assert rank_value(live, "dtprof_step_collective_lateness_seconds", r) is not None
        assert rank_value(live, "dtprof_loss", r) > 0 and rank_value(live, "dtprof_learning_rate", r) == LR
        assert rank_value(live, "dtprof_grad_norm", r) > 0     # the job does not clip: the norm dtprof computed
    # rank 1 sleeps 80 ms in each forward (over half a step even with another test file running beside it): it
    # arrives late at the all-reduces, rank 0 waits in exposed communication
    assert rank_value(live, "dtprof_collective_lateness_seconds_total", 1) > \
        5 * rank_value(live, "dtprof_collective_lateness_seconds_total", 0)
    gpu = {k: v for k, v in live.items() if k[0].startswith("dtprof_gpu_")}
    assert gpu[("dtprof_gpu_power_watts", ("gpu", "0"), ("host", host), ("uuid", _uuid(gpu, "0")))] == 312.5
    assert gpu[("dtprof_gpu_utilization_ratio", ("gpu", "0"), ("host", host), ("uuid", _uuid(gpu, "0")))] == 0.87
    assert gpu[("dtprof_gpu_sm_clock_hertz", ("gpu", "0"), ("host", host), ("uuid", _uuid(gpu, "0")))] == 1980e6
    assert gpu[("dtprof_gpu_throttled", ("gpu", "1"), ("host", host), ("uuid", _uuid(gpu, "1")))] == 1
    assert gpu[("dtprof_gpu_throttled", ("gpu", "0"), ("host", host), ("uuid", _uuid(gpu, "0")))] == 0
    assert live[("dtprof_hang", ("host", host))] == 0
    assert live[("dtprof_ranks", ("host", host))] == 2


def _uuid(gpu: dict, index: str) -> str:
    return next(dict(k[1:])["uuid"] for k in gpu if dict(k[1:]).get("gpu") == index)


def tb_scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(path), size_guidance={"tensors": 0})   # 0: every point (default: a sample of 10)
    acc.Reload()
    return {tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]}


@pytest.mark.slow
def test_tensorboard_reads_every_step(ddp):
    tmp, proc, _ = ddp
    run = open_run(tmp / "run")
    for r in (0, 1):
        tb = tb_scalars(tmp / "tb" / f"rank-{r}")
        mine = run.steps[run.steps["rank"] == r].sort_values("step")
        want = dict(zip(mine["step"], (mine["end_ns"] - mine["start_ns"]) / 1e9))
        got = dict(tb["step_duration_seconds"])
        assert got.keys() == want.keys()                        # --metrics-interval 0: every step a point
        assert all(got[s] == pytest.approx(want[s], rel=1e-6) for s in want)   # float32 in the event file
        for tag in ("step_forward_seconds", "step_backward_seconds", "step_exposed_comm_seconds",
                    "step_tokens_per_second", "step_mfu_ratio", "step_peak_memory_bytes",
                    "step_collective_lateness_seconds", "straggler"):
            assert tag in tb, (tag, sorted(tb))
        assert all(0 < v < 1 for _, v in tb["step_mfu_ratio"])
        # numerics health: every step's local loss and gradient norm (the job does not clip: dtprof's) as the run's
        # health table has them, the job's learning rate
        h = run.health[run.health["rank"] == r]
        assert dict(tb["loss"]) == pytest.approx(dict(zip(h["step"], h["loss"])), rel=1e-6)   # float32 in the file
        assert set(h["grad_norm_source"]) == {"dtprof"} and len(h) == DDP_STEPS
        assert dict(tb["grad_norm"]) == pytest.approx(dict(zip(h["step"], h["grad_norm"])), rel=1e-6)
        assert len(tb["learning_rate"]) == DDP_STEPS
        assert all(v == pytest.approx(LR) for _, v in tb["learning_rate"])     # float32 in the file
    # rank 0's as the job printed it (6 decimals)
    printed = {int(s): float(v) for s, v in re.findall(r"^step (\d+) loss ([0-9.]+)", proc.stdout, re.M)}
    tb0 = dict(tb_scalars(tmp / "tb" / "rank-0")["loss"])
    assert len(printed) == DDP_STEPS and all(tb0[s] == pytest.approx(v, abs=2e-6) for s, v in printed.items())
    gpu = tb_scalars(tmp / "tb" / f"gpu-{socket.gethostname()}-1")
    assert {v for _, v in gpu["gpu_power_watts"]} == {312.5} and {v for _, v in gpu["gpu_throttled_ratio"]} == {1.0}
    assert tb_scalars(tmp / "tb" / "rank-1")["straggler"][-1][1] == 1.0


def wandb_records(wandb_dir: Path) -> list:
    """The records of the one offline run in ``wandb_dir``, decoded with W&B's own protobuf (the file is LevelDB's
    log format: 32 KiB blocks of chunks, each a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle /
    4 last; a 7-byte ":W&B" file header first)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, out, buf = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (n == 0 and kind == 0):     # a block's zero padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def history(recs) -> list[dict]:
    """The logged rows (W&B stores a key with "/" as a nested key)."""
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in recs if r.WhichOneof("record_type") == "history"]


@pytest.mark.slow
def test_wandb_offline_run_has_steps_gpus_and_the_straggler_alert(ddp):
    tmp, _, _ = ddp
    recs = wandb_records(tmp)
    rows = history(recs)
    steps = sorted(r["rank1/step"] for r in rows if "rank1/step_duration_seconds" in r)
    assert steps == list(range(DDP_STEPS))
    assert any(r.get("gpu0/gpu_power_watts") == 312.5 for r in rows)
    alerts = [r.alert for r in recs if r.WhichOneof("record_type") == "alert"]
    assert [a.title for a in alerts] == ["dtprof: straggler"] and "rank 1" in alerts[0].text
    tags = [list(r.run.tags) for r in recs if r.WhichOneof("record_type") == "run"]
    assert "dtprof:straggler" in tags[-1]
    assert any(r.WhichOneof("record_type") == "exit" for r in recs)


@pytest.mark.slow
def test_mlflow_file_store_read_back(ddp):
    tmp, _, _ = ddp
    from mlflow import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=f"file:{tmp / 'mlruns'}")
    (run,) = client.search_runs([client.get_experiment_by_name("dtprof").experiment_id])
    assert run.info.status == "FINISHED"
    hist = client.get_metric_history(run.info.run_id, "rank0/step_duration_seconds")
    assert sorted(m.step for m in hist) == list(range(DDP_STEPS))
    assert {m.value for m in client.get_metric_history(run.info.run_id, "gpu1/gpu_throttled_ratio")} == {1.0}
    assert "rank 1" in run.data.tags["dtprof.straggler"] and "dtprof.hang" not in run.data.tags
    assert run.data.tags["dtprof.exit_code"] == "0"


# ---- Lightning --------------------------------------------------------------------------------------------------

LIGHTNING_STEPS = 300   # ~30 ms steps (a 25 ms sleep each): ~8-10 s of training, for the same reason as DDP_STEPS
LIGHTNING_SLEEP_MS = 25   # (3000 unslept 2-6 ms steps cost 10x the publishing and analysis for the same live window)


@pytest.fixture(scope="module")
def lightning(tmp_path_factory):
    def command(tmp, port):
        cmd = [sys.executable, "-m", "dtprof.cli", "run", "--out", str(tmp / "run"), "--no-report", "--no-nvml",
               "--metrics-interval", "0", "--full-detail", *sinks(tmp, port), "--", str(BIN / "torchrun"),
               "--nproc_per_node=2",
               str(REPO / "examples" / "frameworks" / "train_lightning.py"), "--steps", str(LIGHTNING_STEPS),
               "--sleep-ms", str(LIGHTNING_SLEEP_MS)]
        return run_live(cmd, tmp, port, ranks=2)
    return recorded(tmp_path_factory, "metrics-lightning", command)


@pytest.mark.slow
def test_lightning_job_in_all_four_sinks(lightning):
    tmp, proc, live = lightning
    assert returncode(proc) == 0, proc.stderr[-3000:]
    assert live is not None, f"no scrape while the job ran\n{proc.stderr[-3000:]}"
    assert all(rank_value(live, "dtprof_steps_total", r) >= 3 for r in (0, 1))
    run = open_run(tmp / "run")
    n = run.steps.groupby("rank").size().to_dict()
    assert n == {0: LIGHTNING_STEPS, 1: LIGHTNING_STEPS}
    for r in (0, 1):
        tb = tb_scalars(tmp / "tb" / f"rank-{r}")["step_duration_seconds"]
        assert [s for s, _ in tb] == list(range(LIGHTNING_STEPS))
    rows = history(wandb_records(tmp))
    assert sorted(r["rank0/step"] for r in rows if "rank0/step_duration_seconds" in r) == list(range(LIGHTNING_STEPS))
    from mlflow import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=f"file:{tmp / 'mlruns'}")
    (mrun,) = client.search_runs([client.get_experiment_by_name("dtprof").experiment_id])
    assert len(client.get_metric_history(mrun.info.run_id, "rank1/step_forward_seconds")) == LIGHTNING_STEPS


# ---- the option's edge --------------------------------------------------------------------------------------------

def test_missing_library_is_one_line_and_exit_2_before_anything_runs(tmp_path):
    boot = "import sys; sys.modules['wandb'] = None; from dtprof.cli import main; main()"
    (tmp_path / "job.py").write_text("open('ran', 'w').write('yes')\n")
    p = dtprof("run", "--out", "r", "--metrics", "wandb", "--", sys.executable, "job.py", boot=boot, cwd=tmp_path,
               timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "Error: --metrics wandb: the wandb library is not installed; pip install 'dtprof[wandb]' (nothing was run)"]
    assert not (tmp_path / "r").exists() and not (tmp_path / "ran").exists()


@pytest.mark.parametrize("spec", ["prometheus", "prometheus:x", "prometheus:99999", "tensorboard", "statsd:1"])
def test_bad_sink_is_one_line_and_exit_2(tmp_path, spec):
    p = dtprof("run", "--metrics", spec, "--", sys.executable, "-c", "pass", cwd=tmp_path, timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and spec in p.stderr, p.stderr
    assert not (tmp_path / "dtprof-runs").exists()


# ---- the live reader on hand-made rows -----------------------------------------------------------------------------

def _rank(node: Path, rank: int, steps, collectives) -> RankWriter:
    w = RankWriter(node, rank)
    w.write_identity({"rank": rank, "host": "h", "world_size": 2, "device_type": "cpu", "device_name": "cpu"})
    for step, (s, e) in enumerate(steps):
        w.append("steps", (rank, step, s, e, None, 100, 2, None, None, None, None))
        w.append("spans", (rank, step, "forward", "forward", s, e - 4, None, None, "main", "hook", None))
    for seq, (issue, end) in enumerate(collectives):
        w.append("collectives", (rank, 0, "all_reduce", "all_reduce", "user", "0", 2, seq, 8, 8, "float32", None,
                                 False, issue, end, end, None, None, None, None))
    return w


def test_live_lateness_lead_and_parts(tmp_path):
    """Rank 1 arrives 3 ns after rank 0 at both all-reduces of step 0; each blocks until 20 (a comm_wait-free sync
    collective: the breakdown's exposed time is the collective in flight outside compute)."""
    node = tmp_path / "node-h-1"
    node.mkdir()
    w0 = _rank(node, 0, [(0, 30)], [(10, 20), (26, 29)])
    w1 = _rank(node, 1, [(0, 30)], [(13, 20), (28, 29)])
    w0.flush()
    w1.flush()
    live = LiveNode(node, {}, "h")
    assert live.poll().steps == []               # seen, not yet settled
    steps = {s.rank: s for s in live.poll(final=True).steps}
    assert steps[1].lateness_s == pytest.approx(5e-9) and steps[1].lead_s == pytest.approx(5e-9)
    assert steps[0].lateness_s == 0 and steps[0].lead_s == 0
    assert steps[0].tokens == 100 and steps[0].duration_s == pytest.approx(30e-9)
    assert sum(steps[0].parts_s.values()) == pytest.approx(30e-9)
    assert steps[0].parts_s["forward"] == pytest.approx(26e-9)


def test_live_reader_keeps_a_torn_line_for_the_next_read(tmp_path):
    node = tmp_path / "node-h-1"
    node.mkdir()
    w = _rank(node, 0, [(0, 10)], [])
    w.flush()
    path = node / "rank-0" / "steps.jsonl.gz"
    first = path.stat().st_size
    w.append("steps", (0, 1, 10, 20, None, 100, 2, None, None, None, None))
    w.flush()
    data = path.read_bytes()
    path.write_bytes(data[:first + (len(data) - first) // 2])    # the second flush half written
    live = LiveNode(node, {}, "h")
    assert [s.step for s in live.poll(final=True).steps] == [0]
    path.write_bytes(data)
    assert [s.step for s in live.poll(final=True).steps] == [1]


def test_live_reader_follows_a_restarted_ranks_next_file(tmp_path):
    """A rank restarted in the same directory writes its tables' next files (steps.1.jsonl.gz): the live reader
    goes on with them."""
    node = tmp_path / "node-h-1"
    node.mkdir()
    _rank(node, 0, [(0, 10)], []).close()
    live = LiveNode(node, {}, "h")
    assert [s.step for s in live.poll(final=True).steps] == [0]
    w = RankWriter(node, 0)
    w.append("steps", (0, 1, 10, 20, None, 100, 2, None, None, None, None))
    w.flush()
    assert (node / "rank-0" / "steps.1.jsonl.gz").exists()
    assert [s.step for s in live.poll(final=True).steps] == [1]


def test_live_hang_from_heartbeats(tmp_path):
    node = tmp_path / "node-h-1"
    (node / "rank-0").mkdir(parents=True)
    now = [1_000 * 10**9]
    beat = {"beat": 1, "beat_end": 1, "rank": 0, "pid": os.getpid(), "exit": None, "last_progress_ns": now[0]}
    write_json_atomic(node / "rank-0" / "heartbeat.json", beat)
    live = LiveNode(node, {"hang_timeout_s": 30}, "h", clock=lambda: now[0])
    assert live.poll().status.hang is False
    now[0] += 31 * 10**9
    st = live.poll().status
    assert st.hang is True and st.progress_age_s == pytest.approx(31) and st.hang_after_s == 30


def test_tracker_alerts_once_per_straggler_and_hang(tmp_path):
    """A straggler or a hang, when it first shows, is one alert of the tracker (W&B's run.alert, MLflow's tag, ...);
    a status that goes on holding is not alerted again."""
    from dtprof.live import NodeStatus, Update
    from dtprof.sinks import Context, SinkSpec, Tracker

    class Recorder(Tracker):
        def __init__(self, *a):
            super().__init__(*a)
            self.alerts: list[tuple[str, str]] = []

        def alert(self, kind, text):
            self.alerts.append((kind, text))

    t = Recorder(SinkSpec("wandb", "", "wandb"), Context(tmp_path, tmp_path, "h", {}, 10.0, print))
    late = NodeStatus("h", {0: "h", 1: "h"}, progress_age_s=1.0, stragglers={1: "late in 30 of its last 50 steps"})
    hung = NodeStatus("h", {0: "h", 1: "h"}, progress_age_s=400.0, hang=True, hang_after_s=300.0,
                      stragglers={1: "late"})
    for st in (late, late, hung, hung):
        t.publish(Update([], [], st))
    assert [k for k, _ in t.alerts] == ["straggler", "hang"]
    assert "rank 1 on h" in t.alerts[0][1] and "400 s" in t.alerts[1][1] and "threshold 300 s" in t.alerts[1][1]
