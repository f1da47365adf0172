"""Incident triage: heartbeat, watchdog, Flight Recorder reader and verdicts, proven on real torchrun gloo jobs.

The jobs (tests/triage_jobs/job.py) run under a harness that does what `dtprof run --hang-timeout` does (tee'd
logs, a Watchdog with a SIGTERM-then-SIGKILL stop); tests/jobs/test_triage_e2e.py repeats the key cases through the
real launcher once it exists.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "triage_jobs"))

from dtprof.analyzers.triage import frozen_ranks, match_across_ranks, ranks_text, where  # noqa: E402
from dtprof.flight_recorder import DumpError, load_dump, load_dumps  # noqa: E402
from dtprof.reader import open_run  # noqa: E402
from dtprof.rundir.writer import NodeTableWriter  # noqa: E402
from dtprof.triage import triage_command  # noqa: E402
from dtprof.watchdog import parse_torchrun_failures  # noqa: E402

# Small for test speed (real jobs use minutes: more than the longest gap between steps), but above the 6-10 s a
# healthy job can go without progress on a loaded 2-core CI machine (start-up, Flight Recorder dumps, exit): 6 s once
# stopped the healthy job in a full-suite run.
HANG_TIMEOUT_S = 15.0


def cli(*args):
    return CliRunner().invoke(triage_command, [str(a) for a in args])


def cli_json(*args):
    res = cli(*args, "--json")
    assert res.exit_code in (0, 1), res.output
    return json.loads(res.stdout)


# ----------------------------------------------------------------------------------------- heartbeat (fast)
HB_SCRIPT = textwrap.dedent('''
    import os, signal, sys, time, types
    from pathlib import Path
    from dtprof.collectors import heartbeat
    rank_dir = Path(sys.argv[1]) / "rank-0"
    if sys.argv[2] == "user-handler":
        def on_term(signum, frame):
            print("user handler ran", flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, on_term)
    state = types.SimpleNamespace(rank=0, step=5, last_progress_ns=time.monotonic_ns(), rank_dir=rank_dir,
                                  collective={"op": "all_reduce", "group": "0", "seq": 42, "in_bytes": 1024,
                                              "dtype": "float32", "peer": None, "entered_ns": time.monotonic_ns()})
    heartbeat.start(rank_dir, state)
    def stuck_in_user_code():
        from dtprof.watchdog import request_dumps   # atomic, as the launcher writes it
        request_dumps(Path(sys.argv[1]), "t1", "test")
        deadline = time.time() + 10
        while not (rank_dir / "dump-t1.json").exists() and time.time() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
        print("SIGTERM did not stop us", flush=True)
    stuck_in_user_code()
''')


def _run_hb(tmp_path, variant):
    script = tmp_path / "hb.py"
    script.write_text(HB_SCRIPT)
    return subprocess.run([sys.executable, str(script), str(tmp_path), variant], capture_output=True, text=True,
                          timeout=30)


def test_heartbeat_answers_dump_requests_and_keeps_sigterm_default(tmp_path):
    proc = _run_hb(tmp_path, "default")
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr  # died of SIGTERM, as without dtprof
    rd = tmp_path / "rank-0"
    hb = json.loads((rd / "heartbeat.json").read_text())
    assert hb["rank"] == 0 and hb["step"] == 5 and hb["collective"]["seq"] == 42 and hb["pid"] > 0
    dump = json.loads((rd / "dump-t1.json").read_text())
    assert dump["reason"] == "test" and dump["collective"]["op"] == "all_reduce"
    main = next(s for s in dump["stacks"] if s["main"])
    assert main["frames"][-2]["func"] == "stuck_in_user_code" or any(
        f["func"] == "stuck_in_user_code" for f in main["frames"])
    assert any(s["name"] == "dtprof-heartbeat" for s in dump["stacks"])
    assert dump["flight_recorder"] is None and "torch not imported" in dump["flight_recorder_error"]
    assert (rd / "dump-sigterm.json").exists()
    assert where(dump).startswith("hb.py:")


RACE_SCRIPT = textwrap.dedent('''
    import os, signal, sys, time, types
    from pathlib import Path
    from dtprof.collectors import heartbeat
    rank_dir = Path(sys.argv[1]) / "rank-0"
    real_write_dump = heartbeat.write_dump
    def slow_write_dump(*a, **k):   # a dump that takes a while (many threads, a long Flight Recorder buffer)
        time.sleep(1.0)
        return real_write_dump(*a, **k)
    heartbeat.write_dump = slow_write_dump
    state = types.SimpleNamespace(rank=0, step=5, last_progress_ns=time.monotonic_ns(), rank_dir=rank_dir,
                                  collective=None)
    heartbeat.start(rank_dir, state)
    time.sleep(0.2)
    # the main thread is away in C code: SIGTERM reaches the heartbeat thread, which starts the dump ...
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.3)
    # ... and the main thread's handler runs while that dump is still being written
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    time.sleep(10)
    print("SIGTERM did not stop us", flush=True)
''')


def test_sigterm_waits_for_a_dump_the_heartbeat_thread_is_writing(tmp_path):
    script = tmp_path / "race.py"
    script.write_text(RACE_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    dump = json.loads((tmp_path / "rank-0" / "dump-sigterm.json").read_text())
    assert dump["reason"] == "SIGTERM received" and dump["stacks"]


def test_heartbeat_defers_to_the_users_sigterm_handler(tmp_path):
    proc = _run_hb(tmp_path, "user-handler")
    assert proc.returncode == 7 and "user handler ran" in proc.stdout, proc.stdout + proc.stderr
    assert (tmp_path / "rank-0" / "dump-sigterm.json").exists()


def test_heartbeat_never_raises_into_training(tmp_path):
    from dtprof.collectors import heartbeat
    blocker = tmp_path / "file"
    blocker.write_text("x")
    # a rank dir that cannot be created: start() returns False instead of raising
    code = ("import sys; from dtprof.collectors import heartbeat; "
            f"print(heartbeat.start({str(blocker / 'rank-0')!r}, object()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
    assert heartbeat.snapshot(object())["rank"] is None  # a state without the attributes still snapshots


# ------------------------------------------------------------------------------------ parsing (fast)
TORCHRUN_REPORT = """
Failures:
[1]:
  time      : 2026-11-22_02:20:57
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 7973)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 7973
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_02:20:57
  host      : localhost
  rank      : 5 (local_rank: 1)
  exitcode  : -9 (pid: 7974)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 7974
"""


def test_deaths_seen_in_one_poll_put_the_rank_that_lost_a_peer_last(tmp_path):
    # A SIGKILLed rank leaves a stale heartbeat and no exit status; its peers die of the broken connection
    # milliseconds later, or torchrun stops them with SIGTERM, all before the watchdog's next poll (a busy machine
    # delays the poll). Found together, the killed rank must come first whatever order the file system lists the
    # rank directories in, and even when a stopped survivor's last heartbeat is older than the killed rank's.
    from dtprof.watchdog import Watchdog
    lost = "exception: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer."
    beats = {0: (lost, 300, None), 1: (None, 100, None), 2: (lost, 310, None),
             3: ("exception: ValueError: bad batch", 200, None), 4: (None, 50, 400)}
    for rank, (exit_status, t, sigterm_ns) in beats.items():
        d = tmp_path / f"rank-{rank}"
        d.mkdir()
        # pids that do not exist: dead
        (d / "heartbeat.json").write_text(json.dumps({"rank": rank, "pid": 2**22 + rank, "step": 3, "t_ns": t,
                                                       "exit": exit_status, "sigterm_ns": sigterm_ns}))
    wd = Watchdog(tmp_path, timeout_s=60, stop_job=lambda: None)
    wd._check_crashes()
    dead = json.loads((tmp_path / "triage" / "crash.json").read_text())["dead"]
    assert [d["rank"] for d in dead] == [1, 3, 0, 2, 4]
    assert [d["lost_peer"] for d in dead] == [False, False, True, True, False]
    assert (tmp_path / "dump-request-crash").exists()   # the survivors were asked for their state at once


def test_watchdog_leaves_other_hosts_ranks_alone(tmp_path):
    # DeepSpeed's pdsh launch has the ranks of every host record into the launching host's node directory
    # (dtprof/launch_deepspeed.py): a rank of another host, whose pid means nothing here, is not taken for dead
    import socket

    from dtprof.watchdog import Watchdog
    for rank, host in ((0, socket.gethostname()), (1, "another-host")):
        d = tmp_path / f"rank-{rank}"
        d.mkdir()
        (d / "heartbeat.json").write_text(json.dumps({"rank": rank, "pid": 2**22 + rank, "step": 3, "t_ns": 100,
                                                       "exit": None, "host": host}))
    wd = Watchdog(tmp_path, timeout_s=60, stop_job=lambda: None)
    wd._check_crashes()
    dead = json.loads((tmp_path / "triage" / "crash.json").read_text())["dead"]
    assert [d["rank"] for d in dead] == [0]


def test_watchdog_names_a_stalled_heartbeat_thread_not_a_frozen_rank(tmp_path):
    # rank 1's process runs but its heartbeat is 8 s old while rank 0's is fresh: dtprof's own thread stopped
    # (a fault of dtprof's, named once); rank 2's is as old but its process is SIGSTOPped: the hang's to name
    from dtprof.watchdog import Watchdog
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)]
    try:
        procs[2].send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        now = time.monotonic_ns()
        for rank, age_s in ((0, 0.3), (1, 8.0), (2, 8.0)):
            d = tmp_path / f"rank-{rank}"
            d.mkdir()
            (d / "heartbeat.json").write_text(json.dumps({"rank": rank, "pid": procs[rank].pid, "step": 3,
                                                           "t_ns": now - int(age_s * 1e9), "exit": None}))
        wd = Watchdog(tmp_path, timeout_s=60, stop_job=lambda: None)
        wd._check_beats()
        wd._check_beats()
        assert len(wd.beat_faults) == 1 and "rank 1's heartbeat thread stopped" in wd.beat_faults[0], wd.beat_faults
    finally:
        for pr in procs:
            pr.kill()
            pr.wait()


def test_the_hang_clock_starts_with_training_not_at_start_up(tmp_path):
    # chaos: a Lightning job's ranks were all still in `import lightning` 20 s after their first heartbeat, and the
    # watchdog (--hang-timeout 20) stopped the job as hung. Start-up is not a hang; once a rank is past its first
    # step, the clock runs from then.
    from dtprof.watchdog import Watchdog
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        init = time.monotonic_ns() - 30 * 10**9     # the ranks started 30 s ago

        def beat(step, progress_ns):
            for rank, pr in enumerate(procs):
                d = tmp_path / f"rank-{rank}"
                d.mkdir(exist_ok=True)
                (d / "heartbeat.json").write_text(json.dumps({
                    "rank": rank, "pid": pr.pid, "step": step, "t_ns": time.monotonic_ns(), "exit": None,
                    "collective": None, "last_progress_ns": progress_ns}))
        stops = []
        wd = Watchdog(tmp_path, timeout_s=1.0, stop_job=lambda: stops.append(1))
        beat(0, init)
        assert wd._check_hang() is False and not wd.fired     # 30 s without progress, but still starting up
        beat(1, init + 29 * 10**9)                             # training: a step ended 1 s ago
        assert wd._check_hang() is False
        time.sleep(1.2)
        assert wd._check_hang() is True and wd.fired and stops == [1]   # then no progress for the timeout
    finally:
        for pr in procs:
            pr.kill()
            pr.wait()


def test_parse_torchrun_failures_names_root_cause_and_signal():
    f = parse_torchrun_failures(TORCHRUN_REPORT)
    assert [(x["rank"], x["exit_code"], x["signal"], x["root_cause"]) for x in f] == [
        (5, -9, "SIGKILL", True), (0, -15, "SIGTERM", False)]


def test_frozen_ranks_from_the_watchdogs_record_and_live_heartbeats():
    # the process state names a stopped rank; without one (another host), a heartbeat far older than the others'
    rec = {"ranks": {"0": {"heartbeat_age_s": 0.4, "process_state": "S"},
                     "1": {"heartbeat_age_s": 14.0, "process_state": "T"},
                     "2": {"heartbeat_age_s": 0.3, "process_state": "S"},
                     "3": {"heartbeat_age_s": 12.0, "process_state": None}}}
    got = frozen_ranks([rec], {}, None)
    assert sorted(got) == [1, 3] and "stopped (SIGSTOP)" in got[1] and "heartbeat stopped 12 s" in got[3], got
    # every rank's beat equally old (a machine stalled as a whole, a slow reader): none stands out
    assert frozen_ranks([{"ranks": {"0": {"heartbeat_age_s": 9.0}, "1": {"heartbeat_age_s": 8.0}}}], {}, None) == {}
    # live: heartbeats' own times against now; a rank that exited is not frozen
    now = 100_000_000_000
    hbs = {0: {"t_ns": now - 200_000_000, "exit": None}, 1: {"t_ns": now - 20_000_000_000, "exit": None},
           2: {"t_ns": now - 30_000_000_000, "exit": "clean"}}
    assert list(frozen_ranks([], hbs, now)) == [1]


def test_a_stopped_rank_is_the_culprit_whatever_its_last_beat_was_inside():
    # Lightning, rank 2 SIGSTOPped (chaos): its last beat, 21 s old, says all_reduce #37; the others wait in two
    # later collectives. Counting in-flight collectives named ranks 1 and 2 "inside barrier #56".
    from dtprof.analyzers.triage import triage
    from dtprof.reader import Incident

    def beat(rank, op, seq, t_ns):
        return {"rank": rank, "pid": 10 + rank, "step": 12, "t_ns": t_ns, "exit": None, "collective":
                {"op": op, "group": "0", "seq": seq, "in_bytes": 8, "dtype": "int64", "peer": None, "entered_ns": 1}}
    hbs = {0: beat(0, "broadcast", 55, 100), 1: beat(1, "barrier", 56, 100), 2: beat(2, "all_reduce", 37, 50)}
    rec = {"detected_ns": 2 * 10**10, "timeout_s": 20, "idle_s": 20, "ranks": {
        "0": {"heartbeat_age_s": 0.4, "process_state": "S"}, "1": {"heartbeat_age_s": 0.3, "process_state": "S"},
        "2": {"heartbeat_age_s": 20.7, "process_state": "T"}}}
    res = triage(None, {"incident": Incident(heartbeats=hbs, watchdog={"hang": [rec], "crash": [], "exit": []})})
    assert res["verdict"] == "hang" and res["culprit_ranks"] == [2], res
    assert "rank 2 froze: its process is stopped (SIGSTOP)" in res["message"] and "ranks 0–1 wait" in res["message"]


def test_a_collective_timeout_names_the_rank_that_never_entered_not_the_first_that_timed_out():
    # chaos coll_timeout: rank 2 sleeps past the process group's timeout; ranks 0 and 1 raise gloo's timeout in
    # all_reduce (rank 0 first), torchrun stops rank 2. It was "crash: rank 0 ... Timed out waiting".
    from dtprof.analyzers.triage import triage
    from dtprof.reader import Incident

    msg = ("[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv "
           "operation to complete")
    frames = [{"file": "/job/train.py", "line": 142, "func": "end_of_step"},
              {"file": "/site-packages/torch/distributed/distributed_c10d.py", "line": 2900, "func": "all_reduce"}]

    def raised(rank, t):
        return {"exception": {"rank": rank, "t_ns": t, "reason": f"exception: RuntimeError: {msg}",
                              "exception": {"type": "RuntimeError", "message": msg, "frames": frames}}}
    dumps = {0: raised(0, 100), 1: raised(1, 200), 2: {"sigterm": {"rank": 2, "t_ns": 300, "reason": "SIGTERM"}}}
    hbs = {r: {"rank": r, "pid": 10 + r, "step": 6, "t_ns": 100, "exit": None if r == 2 else "exception: ..."}
           for r in range(3)}
    res = triage(None, {"incident": Incident(heartbeats=hbs, dumps=dumps)})
    assert res["verdict"] == "hang" and res["culprit_ranks"] == [2], res
    assert res["collective"]["op"] == "all_reduce" and "rank 2" in res["message"], res["message"]


def test_a_collective_timeout_tells_a_rank_that_lost_its_peer_from_the_late_one():
    # chaos coll_timeout #90 (3-rank DDP, rank 2 asleep past the 10 s timeout, loaded VM): rank 1's timeout fired
    # first and rank 0, waiting beside it, raised "Connection closed by peer" 2.5 ms before rank 1's dump; rank 2 woke,
    # entered, and raised the same 5 s later. It was "rank 0, rank 2 never entered".
    from dtprof.analyzers.triage import triage
    from dtprof.reader import Incident

    timeout = "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete"
    closed = ("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:20876. This is typically "
              "caused by a remote worker crashing.")
    frames = [{"file": "/job/train.py", "line": 146, "func": "end_of_step"},
              {"file": "/site-packages/torch/distributed/distributed_c10d.py", "line": 2900, "func": "all_reduce"}]

    def raised(rank, t, msg):
        return {"exception": {"rank": rank, "t_ns": t, "reason": f"exception: RuntimeError: {msg}",
                              "exception": {"type": "RuntimeError", "message": msg, "frames": frames}}}
    s = 10**9
    dumps = {0: raised(0, 100 * s, closed), 1: raised(1, 100 * s + 2_500_000, timeout), 2: raised(2, 105 * s, closed)}
    hbs = {r: {"rank": r, "pid": 10 + r, "step": 6, "t_ns": 100 * s, "exit": "exception: ..."} for r in range(3)}
    res = triage(None, {"incident": Incident(heartbeats=hbs, dumps=dumps)})
    assert res["verdict"] == "hang" and res["culprit_ranks"] == [2], res
    assert "ranks 0–1 wait" in res["message"], res["message"]
    assert "never entered all_reduce;" in res["message"], res["message"]   # gloo's error gives no sequence number
    # the late rank raising within the window too: nothing tells the two apart, both stay named
    dumps[2] = raised(2, 101 * s, closed)
    assert triage(None, {"incident": Incident(heartbeats=hbs, dumps=dumps)})["culprit_ranks"] == [0, 2]


def test_ranks_text():
    assert ranks_text([0, 1, 2, 4, 5, 6, 7]) == "0–2, 4–7"
    assert ranks_text([3]) == "3"


def test_bad_input_is_one_line_exit_2(tmp_path):
    res = cli(tmp_path / "nope")
    assert res.exit_code == 2 and "no such run directory" in res.output
    (tmp_path / "empty").mkdir()
    res = cli(tmp_path / "empty")
    assert res.exit_code == 2 and "run.json" in res.output
    bad = tmp_path / "fr_trace_rank_0"
    bad.write_bytes(b"\x80garbage")
    res = cli("--fr", bad)
    assert res.exit_code == 2 and str(bad) in res.output and "Traceback" not in res.output
    with pytest.raises(DumpError, match="not a Flight Recorder dump"):
        (tmp_path / "x.json").write_text("{}")
        load_dump(tmp_path / "x.json")


def test_triage_path_never_imports_torch():
    code = ("import sys, dtprof.triage, dtprof.analyzers.triage, dtprof.watchdog, dtprof.flight_recorder;"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_pickle_dump_that_would_run_code_is_refused(tmp_path):
    import pickle
    evil = tmp_path / "fr_trace_rank_0"
    evil.write_bytes(pickle.dumps({"entries": [], "x": os.system}))
    with pytest.raises(DumpError, match="refusing"):
        load_dump(evil)


# --------------------------------------------------------------------- straggler with NVML (synthetic, fast)
def _nvml_rows(node_dir, slow_gpu, gpus=4, samples=20):
    w = NodeTableWriter(node_dir, "nvml")
    for g in range(gpus):
        for i in range(samples):
            slow = g == slow_gpu
            w.append(["host0", node_dir.name, g, f"GPU-{g}", 10**9 + i * 10**8, 90.0, 50.0, 1e9, 8e10,
                      180.0 if slow else 350.0, 91.0 if slow else 60.0, 900.0 if slow else 1980.0, 1593.0,
                      0, 0, 0, 0, 0x40 if slow else 0, 0])
    w.close()


def test_straggler_named_with_nvml_evidence(tmp_path):
    from synth import build_run
    run = build_run(tmp_path / "run", world_size=4, steps=12, slow_rank=2, slow_factor=2.0,
                    device_type="cuda", device_name="H100")
    node = run / "node-synthetic"
    # the synthetic run is compacted; add the sampler's rows next to it as the compaction would
    import dtprof.reader as reader
    from dtprof.rundir.schema import TABLES
    tables = {name: reader._read_node_table(node, name) for name in TABLES}
    _nvml_rows(node, slow_gpu=2)
    tables["nvml"] = reader.read_node_raw(node)["nvml"]
    from dtprof.rundir.writer import write_node_tables
    write_node_tables(node, tables)
    out = cli_json(run)
    assert out["verdict"] == "straggler" and out["culprit_ranks"] == [2]
    nv = next(e for e in out["evidence"] if e["kind"] == "nvml")
    assert nv["gpu"] == 2 and "hw_thermal_slowdown" in nv["throttle_reasons"]
    assert nv["sm_clock_mhz_mean"] == 900.0 and nv["others_sm_clock_mhz_mean"] == 1980.0
    assert "rank 2 (host host0, GPU 2)" in out["message"] and "hw_thermal_slowdown" in out["message"]


def test_synthetic_even_run_is_healthy(tmp_path):
    from synth import build_run
    run = build_run(tmp_path / "run", world_size=4, steps=12)
    res = cli(run)
    assert res.exit_code == 0 and res.output.startswith("healthy")


# ------------------------------------------------------------------------- real torchrun gloo jobs (slow)
@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Each failure mode once, lazily, shared by the tests below."""
    from harness import run_job
    cache = {}

    def get(mode, nproc=4, **kw):
        key = (mode, nproc)
        if key not in cache:
            base = tmp_path_factory.mktemp(mode)
            cache[key] = run_job(base / "run", mode, nproc, HANG_TIMEOUT_S,
                                 ["--fr-dir", str(base / "fr")] + kw.get("args", []))
            cache[key]["fr_dir"] = base / "fr"
        return cache[key]
    return get


def _dump(node_dir, rank, dump_id):
    p = node_dir / f"rank-{rank}" / f"dump-{dump_id}.json"
    return json.loads(p.read_text()) if p.exists() else None


@pytest.mark.slow
def test_hang_detected_culprit_and_collective_named(jobs):
    r = jobs("hang")
    assert r["fired"] and r["rc"] == 124
    hang = json.loads((r["node_dir"] / "triage" / "hang.json").read_text())
    newest_progress_s = max(v["last_progress_ns"] for v in hang["ranks"].values()) / 1e9
    # stopped within the timeout plus 15 s of the last progress on any rank
    assert hang["stopped_ns"] / 1e9 - newest_progress_s <= HANG_TIMEOUT_S + 15
    for rank in range(4):  # every rank's stacks were captured before the job was stopped
        d = _dump(r["node_dir"], rank, "hang")
        assert d is not None and d["stacks"], rank
        assert d["flight_recorder"]["entries"], rank  # gloo records FR entries in torch 2.13
    out = cli_json(r["run_dir"])
    assert out["verdict"] == "hang" and out["culprit_ranks"] == [1]
    assert out["collective"] == {"op": "all_reduce", "group": "0", "seq": 4}
    assert "rank 1" in out["message"] and "never entered all_reduce #4 of group 0" in out["message"]
    assert "job.py:" in out["message"] and "__next__" in out["message"]  # where the culprit is stuck
    assert "ranks 0, 2–3" in out["message"]
    events = open_run(r["run_dir"]).events
    assert events["message"].astype(str).str.contains("hang: no rank progressed").any()


@pytest.mark.slow
def test_hang_from_flight_recorder_alone(jobs, tmp_path):
    """The same hang seen only through Flight Recorder entries (no in-flight collective state)."""
    r = jobs("hang")
    fr_dir = tmp_path / "fr"
    fr_dir.mkdir()
    for rank in range(4):
        d = _dump(r["node_dir"], rank, "hang")
        (fr_dir / f"nccl_trace_rank_{rank}.json").write_text(json.dumps(d["flight_recorder"]))
    entries = load_dumps([fr_dir])
    assert sorted(entries["rank"].unique()) == [0, 1, 2, 3]
    inst = match_across_ranks(entries)
    stuck = inst[inst["ranks_missing"].str.len() > 0]
    assert stuck.iloc[0]["seq"] == 4 and list(stuck.iloc[0]["ranks_missing"]) == [1]
    out = cli_json("--fr", fr_dir)
    # dumps alone (no run directory), as from TORCH_NCCL_DUMP_ON_TIMEOUT: rank 1 is behind the others
    assert out["verdict"] == "hang" and out["culprit_ranks"] == [1] and out["collective"]["seq"] == 4


@pytest.mark.slow
def test_raise_is_a_crash_with_others_state(jobs):
    r = jobs("raise")
    assert not r["fired"] and r["rc"] != 0
    out = cli_json(r["run_dir"])
    assert out["verdict"] == "crash" and out["culprit_ranks"] == [1]
    assert "exited with code 1" in out["message"] and "RuntimeError: loss is NaN" in out["message"]
    assert "step 3" in out["message"]
    states = [e for e in out["evidence"] if e["kind"] == "state"]
    assert sorted(e["rank"] for e in states) == [0, 2, 3]  # the survivors' state at that moment
    assert all("all_reduce #4" in e["message"] for e in states)
    assert _dump(r["node_dir"], 1, "exception")["reason"].startswith("exception: RuntimeError")


@pytest.mark.slow
def test_sigkill_named_with_its_signal(jobs):
    r = jobs("kill")
    out = cli_json(r["run_dir"])
    assert out["verdict"] == "crash" and out["culprit_ranks"] == [1]
    assert "killed by SIGKILL" in out["message"]
    crash = json.loads((r["node_dir"] / "triage" / "crash.json").read_text())
    assert crash["dead"][0]["rank"] == 1, crash  # the watchdog saw rank 1's process vanish first
    # every survivor's state was captured: by the watchdog's request, by torchrun's SIGTERM, or (a peer that died
    # of the broken connection before either reached it) by its own exception hook
    for k in (0, 2, 3):
        assert any(_dump(r["node_dir"], k, i) for i in ("crash", "sigterm", "exception")), k
    states = [e for e in out["evidence"] if e["kind"] == "state"]
    assert sorted(e["rank"] for e in states) == [0, 2, 3]


@pytest.mark.slow
def test_mismatched_sizes_named(jobs):
    r = jobs("mismatch")
    out = cli_json(r["run_dir"])
    assert out["verdict"] == "mismatch" and out["culprit_ranks"] == [1]
    assert out["collective"] == {"op": "broadcast", "group": "0", "seq": 4}
    per = next(e for e in out["evidence"] if e["kind"] == "mismatch")["per_rank"]
    assert per["1"]["in_bytes"] == 48 and per["0"]["in_bytes"] == 40


@pytest.mark.slow
def test_healthy_run_and_real_flight_recorder_files(jobs):
    r = jobs("healthy")
    assert r["rc"] == 0 and not r["fired"]
    assert not (r["node_dir"] / "triage" / "crash.json").exists()
    res = cli(r["run_dir"])
    assert res.exit_code == 0 and res.output.startswith("healthy"), res.output
    # pickle (even ranks) and JSON (odd ranks) dumps from torch itself
    pkl, js = load_dump(r["fr_dir"] / "fr_trace_rank_0"), load_dump(r["fr_dir"] / "fr_trace_rank_1.json")
    for df, rank in ((pkl, 0), (js, 1)):
        assert (df["rank"] == rank).all()
        ar = df[df["op"] == "all_reduce"]
        assert list(ar["seq"]) == list(range(1, 9)) and (ar["in_bytes"] == 256).all()
        assert set(ar["dtype"]) == {"float32"} and set(ar["group"]) == {"0"}
    cols = ["group", "seq", "op", "in_bytes", "dtype", "input_sizes"]
    assert pkl[cols].equals(js[cols])  # both formats read to the same table
    assert cli_json("--fr", r["fr_dir"])["verdict"] == "healthy"


@pytest.mark.slow
def test_live_triage_does_not_stop_the_job(tmp_path):
    from harness import Job
    job = Job(tmp_path / "run", "hang", 4, hang_timeout=None)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait for the hang: all four heartbeats, rank 1 stuck
            hbs = list((job.node_dir).glob("rank-*/heartbeat.json"))
            if len(hbs) == 4 and all(json.loads(p.read_text())["step"] == 3 for p in hbs):
                break
            time.sleep(0.5)
        time.sleep(3)
        out = cli_json("--live", job.run_dir, "--stale", 2)
        assert out["verdict"] == "hang" and out["culprit_ranks"] == [1]
        assert job.proc.poll() is None  # still running
        assert list(job.node_dir.glob("rank-1/dump-live-*.json"))
        # SIGTERM to a rank stuck inside gloo's all_reduce (C++, no Python handler can run): it dumps its state
        # and still dies of SIGTERM, as it would without dtprof
        hb0 = json.loads((job.node_dir / "rank-0" / "heartbeat.json").read_text())
        assert hb0["collective"]["op"] == "all_reduce"
        t0 = time.monotonic()
        os.kill(hb0["pid"], signal.SIGTERM)
        rc = job.proc.wait(30)
        assert rc != 0 and time.monotonic() - t0 < 15
        assert json.loads((job.node_dir / "rank-0" / "dump-sigterm.json").read_text())["collective"]["seq"] == 4
        for t in job.tees:
            t.join(5)
        fails = {f["rank"]: f for f in parse_torchrun_failures((job.node_dir / "stderr.log").read_text())}
        assert fails[0]["signal"] == "SIGTERM" and fails[0]["root_cause"], fails
    finally:
        if job.proc.poll() is None:
            job.stop_job()
        job.wait(30)
