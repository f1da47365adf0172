"""`dtprof run` end to end with small plain-Python jobs (no torch needed), run as a user would: a subprocess."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import TESTS, dtprof, dtprof_popen
from dtprof import _inject, launcher
from dtprof.reader import open_run


def write(path: Path, code: str) -> Path:
    path.write_text(textwrap.dedent(code))
    return path


def only_node(run_dir: Path) -> Path:
    nodes = sorted(run_dir.glob("node-*"))
    assert len(nodes) == 1, nodes
    return nodes[0]


@pytest.fixture(scope="module")
def exit3(tmp_path_factory):
    """One job shared by several checks: prints to both streams, reports its env, exits 3."""
    d = tmp_path_factory.mktemp("exit3")
    write(d / "job.py", """
        import json, os, sys
        print("to stdout", flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        json.dump({k: os.environ.get(k) for k in ("DTPROF_NODE_DIR", "DTPROF_CONFIG", "PYTHONPATH")},
                  open("seen_env.json", "w"))
        sys.exit(3)
    """)
    env = dict(os.environ, PYTHONPATH="/user/lib", NCCL_DEBUG="INFO", OMP_NUM_THREADS="3")
    proc = dtprof("run", "--out", "run", "--trace-steps", "2:4", "--count-flops", "--flops-per-step", "1e12",
                  "--dtype", "fp16", "--no-report", "--", sys.executable, "job.py", "--lr", "1", cwd=d, env=env)
    return d, proc


def test_exit_code_passes_through(exit3):
    _, proc = exit3
    assert proc.returncode == 3, proc.stderr


def test_output_passes_through_and_is_teed(exit3):
    d, proc = exit3
    assert "to stdout" in proc.stdout and "to stderr" in proc.stderr
    assert "to stderr" not in proc.stdout
    node = only_node(d / "run")
    assert (node / "stdout.log").read_text() == "to stdout\n"
    assert (node / "stderr.log").read_text() == "to stderr\n"


def test_job_environment_contract(exit3):
    d, _ = exit3
    seen = json.loads((d / "seen_env.json").read_text())
    node = only_node(d / "run")
    assert seen["DTPROF_NODE_DIR"] == str(node.resolve())
    inject = str(Path(_inject.__file__).resolve().parent)   # dtprof._inject (the name dtprof is conftest's)
    assert seen["PYTHONPATH"] == inject + os.pathsep + "/user/lib"
    assert json.loads(seen["DTPROF_CONFIG"]) == {"trace_steps": "2:4", "count_flops": True, "hang_timeout_s": None,
                                                 "flush_interval_s": 1.0}


def test_manifests(exit3):
    d, _ = exit3
    run = d / "run"
    info = json.loads((only_node(run) / "node.json").read_text())
    assert info["command"] == [sys.executable, "job.py", "--lr", "1"]
    assert info["cwd"] == str(d) and info["host"]
    assert info["status"] == "failed" and info["exit_code"] == 3 and info["signal"] is None
    iso = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z"
    assert re.fullmatch(iso, info["start_time"]) and re.fullmatch(iso, info["end_time"])
    assert info["end_time"] >= info["start_time"] and info["end_mono_ns"] > info["start_mono_ns"]
    from importlib.metadata import version
    assert info["versions"]["torch"] == version("torch") and info["versions"]["dtprof"]
    assert info["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert info["versions"]["nccl"] is not None or info["versions"]["nccl_reason"]
    assert info["env"]["NCCL_DEBUG"] == "INFO" and info["env"]["OMP_NUM_THREADS"] == "3"
    assert info["config"] == {"flops_per_step": 1e12, "peak_tflops": None, "dtype": "fp16", "count_flops": True,
                              "trace_steps": "2:4", "hang_timeout_s": None, "nvml_interval_s": 0.1}
    assert info["nvml"]["available"] is False and info["nvml"]["reason"]
    manifest = open_run(run).manifest
    assert manifest["command"] == info["command"] and manifest["cwd"] == str(d) and manifest["created"]
    # the missing NVML and the job's end are in the events table, from the launcher (rank -1)
    ev = open_run(run).events
    assert (ev["rank"] == -1).all()
    assert {"nvml", "launcher"} <= set(ev["source"].astype(str))
    assert (only_node(run) / "tables" / "_complete").exists()   # compacted


def test_post_steps_never_change_the_exit_code(exit3):
    """The analyzers/report may be missing or fail: one line each, and the job's code still comes out."""
    _, proc = exit3
    assert proc.returncode == 3
    assert "Traceback" not in proc.stderr
    assert re.search(r"^run: .*run$", proc.stderr, re.M)


def test_git_commit_and_dirty_flag(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    write(tmp_path / "ok.py", "print('ok')\n")
    subprocess.run(["git", "add", "ok.py"], cwd=tmp_path, check=True)
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x"], cwd=tmp_path,
                   check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert launcher.git_info(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "ok.py").write_text("print('changed')\n")
    assert launcher.git_info(tmp_path) == {"commit": head, "dirty": True}
    assert launcher.git_info(tmp_path.parent) is None or launcher.git_info(tmp_path.parent)["commit"] != head


def test_default_run_dir_name(tmp_path):
    write(tmp_path / "train_small.py", "print('hi')\n")
    proc = dtprof("run", "--no-nvml", "--no-report", "-q", "--", sys.executable, "train_small.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    runs = list((tmp_path / "dtprof-runs").iterdir())
    assert len(runs) == 1 and re.fullmatch(r"\d{8}T\d{6}Z-train_small", runs[0].name), runs
    info = json.loads((only_node(runs[0]) / "node.json").read_text())
    assert info["status"] == "completed" and info["exit_code"] == 0
    assert info["nvml"] == {"available": False, "reason": "disabled with --no-nvml"}
    assert proc.stdout == "hi\n"   # --quiet: only the job's output on stdout


def test_existing_run_is_refused_and_untouched(tmp_path):
    write(tmp_path / "mark.py", "open('ran', 'a').write('x')\n")
    first = dtprof("run", "--out", "r", "--no-nvml", "--no-report", "-q", "--", sys.executable, "mark.py",
                   cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (tmp_path / "r").rglob("*") if p.is_file()}
    second = dtprof("run", "--out", "r", "--", sys.executable, "mark.py", cwd=tmp_path)
    assert second.returncode == 2
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and "already holds a run" in lines[0] and "Traceback" not in second.stderr
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (tmp_path / "r").rglob("*") if p.is_file()}
    assert after == before
    assert (tmp_path / "ran").read_text() == "x"       # the job did not run again

    (tmp_path / "notarun").mkdir()
    (tmp_path / "notarun" / "data.txt").write_text("keep")
    third = dtprof("run", "--out", "notarun", "--", sys.executable, "mark.py", cwd=tmp_path)
    assert third.returncode == 2 and "not empty" in third.stderr
    assert sorted(p.name for p in (tmp_path / "notarun").iterdir()) == ["data.txt"]


def test_usage_errors_exit_2(tmp_path):
    bad = dtprof("run", "--trace-steps", "5:2", "--", sys.executable, "-c", "pass", cwd=tmp_path)
    assert bad.returncode == 2 and "--trace-steps" in bad.stderr
    assert not (tmp_path / "dtprof-runs").exists()
    helptext = dtprof("run", "--help", cwd=tmp_path)
    assert helptext.returncode == 0 and "124" in helptext.stdout and "dtprof run -- torchrun" in helptext.stdout


def _start_and_wait_ready(tmp_path, code, extra=()):
    write(tmp_path / "job.py", code)
    # SIGINT as in a terminal: a test suite started in the background (`make test &`) inherits SIGINT ignored, and
    # a job that starts with SIGINT ignored never installs Python's KeyboardInterrupt handler
    proc = dtprof_popen("run", "--out", "r", "--no-nvml", "--no-report", *extra, "--", sys.executable, "job.py",
                        cwd=tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    return proc


def test_sigterm_is_forwarded_and_the_jobs_status_comes_through(tmp_path):
    proc = _start_and_wait_ready(tmp_path, """
        import signal, sys, time
        def bye(sig, frame):
            open("got", "w").write(signal.Signals(sig).name)
            sys.exit(7)
        signal.signal(signal.SIGTERM, bye)
        open("ready", "w").close()
        time.sleep(60)
    """)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 7, err
    assert (tmp_path / "got").read_text() == "SIGTERM"
    info = json.loads((only_node(tmp_path / "r") / "node.json").read_text())
    assert info["status"] == "killed" and info["exit_code"] == 7 and info["signals_forwarded"] == ["SIGTERM"]


def test_job_dying_of_a_signal_exits_128_plus_n(tmp_path):
    proc = _start_and_wait_ready(tmp_path, """
        import time
        open("ready", "w").close()
        time.sleep(60)
    """)
    proc.send_signal(signal.SIGINT)    # the job has Python's default SIGINT handler: KeyboardInterrupt
    proc.communicate(timeout=60)
    # Python re-raises an uncaught KeyboardInterrupt as a death by SIGINT: 128 + 2
    assert proc.returncode == 130
    info = json.loads((only_node(tmp_path / "r") / "node.json").read_text())
    assert info["status"] == "killed" and info["signal"] == "SIGINT" and info["signals_forwarded"] == ["SIGINT"]


def test_second_signal_kills_the_job(tmp_path):
    proc = _start_and_wait_ready(tmp_path, """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open("ready", "w").close()
        time.sleep(60)
    """)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert proc.poll() is None            # the job ignores SIGTERM: still running
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL, err
    info = json.loads((only_node(tmp_path / "r") / "node.json").read_text())
    assert info["status"] == "killed" and info["signal"] == "SIGKILL"
    assert info["signals_forwarded"] == ["SIGTERM", "SIGKILL"]


def test_fake_gpus_sampled_through_the_launcher(tmp_path):
    """The whole launcher with NVML faked at the pynvml boundary: the nvml table lands in the run."""
    write(tmp_path / "job.py", "import time; time.sleep(0.6)\n")
    boot = ("import sys, fake_pynvml; sys.modules['pynvml'] = fake_pynvml.make(gpus=2, unsupported={1: {'nvlink'}});"
            "from dtprof.cli import main; main()")
    env = dict(os.environ, PYTHONPATH=str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = dtprof("run", "--out", "r", "--nvml-interval", "0.05", "--no-report", "--", sys.executable, "job.py",
                  boot=boot, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    run = open_run(tmp_path / "r")
    nvml = run.nvml
    assert set(nvml["gpu"]) == {0, 1} and (nvml.groupby("gpu").size() >= 5).all()
    assert (nvml["power_w"] == 312.5).all()
    assert nvml[nvml.gpu == 1]["nvlink_tx_bytes_s"].isna().all()
    info = run.nodes[0]["nvml"]
    assert info["available"] is True and len(info["gpus"]) == 2 and info["samples"] >= 5
    assert info["unsupported"] == {"1": ["nvlink"]}
    msgs = run.events[run.events["source"].astype(str) == "nvml"]["message"].astype(str)
    assert len(msgs) == 1 and "GPU 1: nvlink not supported" in msgs.iloc[0]


@pytest.mark.parametrize("command, name, join", [
    (["torchrun", "--nproc_per_node=8", "train.py", "--rdzv-id", "no"], "train", None),
    (["torchrun", "--nnodes=2", "--rdzv-id=exp1", "train.py"], "train", "exp1"),
    (["python", "-m", "torch.distributed.run", "--rdzv_id", "abc", "-m", "pkg.trainer"], "trainer", "abc"),
    (["python", "train_ddp.py"], "train_ddp", None),
    (["./run.sh"], "run.sh", None),
    # DeepSpeed's launcher on each node of a hostfile (--no_ssh): the nodes join on the master's address and port
    (["/v/bin/deepspeed", "--hostfile", "h", "--no_ssh", "--node_rank", "1", "--master_addr", "10.0.0.1",
      "--master_port=29600", "train.py", "--no_ssh"], "train", "deepspeed::10.0.0.1:29600"),
    (["deepspeed", "--hostfile", "h", "--no_ssh", "--node_rank", "0", "train.py"], "train", "deepspeed:::29500"),
    (["deepspeed", "--num_gpus", "2", "train.py", "--no_ssh"], "train", None),   # the script's own option
])
def test_command_parsing(command, name, join):
    assert launcher.script_name(command) == name
    assert launcher.join_id_for(command, {}) == join


FAKE_WATCHDOG = """
import sys, threading, types
class Watchdog:
    # stands in for dtprof.watchdog (another module): 'detects' a hang after 0.3 s and stops the job
    def __init__(self, node_dir, timeout_s, stop_job):
        self.node_dir, self.timeout_s, self.stop_job = node_dir, timeout_s, stop_job
        self.fired, self.exit_code = False, None
    def start(self):
        def fire():
            self.fired = True
            self.stop_job()
        threading.Timer(0.3, fire).start()
    def stop(self):
        pass
    def on_job_exit(self, exit_code):
        (self.node_dir / "watchdog_saw_exit").write_text(str(exit_code))
sys.modules["dtprof.watchdog"] = types.SimpleNamespace(Watchdog=Watchdog)
from dtprof.cli import main
main()
"""


def test_hang_watchdog_stop_exits_124(tmp_path):
    write(tmp_path / "job.py", "import time; open('ready', 'w').close(); time.sleep(60)\n")
    proc = dtprof("run", "--out", "r", "--no-nvml", "--no-report", "--hang-timeout", "5", "--", sys.executable,
                  "job.py", boot=FAKE_WATCHDOG, cwd=tmp_path, timeout=120)
    assert proc.returncode == 124, proc.stderr
    node = only_node(tmp_path / "r")
    info = json.loads((node / "node.json").read_text())
    assert info["status"] == "hung" and info["exit_code"] == 124 and info["config"]["hang_timeout_s"] == 5
    assert (node / "watchdog_saw_exit").read_text() == str(128 + signal.SIGTERM)


def test_launcher_never_imports_torch(tmp_path):
    boot = ("import atexit, sys; atexit.register(lambda: print('torch imported' if 'torch' in sys.modules "
            "else 'torch not imported', file=sys.stderr)); from dtprof.cli import main; main()")
    proc = dtprof("run", "--out", "r", "--count-flops", "--", sys.executable, "-c", "print(1)", boot=boot,
                  cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().endswith("torch not imported")


def test_command_not_found_exits_127_and_leaves_no_run_directory(tmp_path):
    """issue 15: a command that does not exist must not leave an (empty) run directory behind."""
    for args in (["--out", "r"], []):
        proc = dtprof("run", *args, "--no-nvml", "--", "no-such-command-xyz", cwd=tmp_path)
        assert proc.returncode == 127 and "cannot start 'no-such-command-xyz'" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists() and not (tmp_path / "dtprof-runs").exists()


def test_an_unknown_option_is_named_not_run_as_the_command(tmp_path):
    """`dtprof run -o DIR -- cmd` (a mistyped --out): the user's mistake named, exit 2, nothing recorded."""
    proc = dtprof("run", "-o", "r", "--", sys.executable, "-c", "print('ran')", cwd=tmp_path)
    assert proc.returncode == 2 and "no such option '-o'" in proc.stderr and "Traceback" not in proc.stderr
    assert "ran" not in proc.stdout
    assert not (tmp_path / "r").exists() and not (tmp_path / "dtprof-runs").exists()


def test_host_name_with_a_slash(tmp_path):
    """issue 15: a host name holding "/" must not break `dtprof run` (it becomes "_" in the node directory)."""
    boot = "import socket; socket.gethostname = lambda: 'rack/7'; from dtprof.cli import main; main()"
    proc = dtprof("run", "--out", "r", "--no-nvml", "--no-report", "--", sys.executable, "-c", "print('hi')",
                  boot=boot, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    node = only_node(tmp_path / "r")
    assert node.name.startswith("node-rack_7-")
    assert json.loads((node / "node.json").read_text())["host"] == "rack/7"


def test_processes_left_running_by_the_command_are_stopped_and_recorded(tmp_path):
    """issue 15: no process of the job outlives `dtprof run`, whatever its process group or session (here a child
    in a session of its own that the command leaves behind); the stop is recorded in node.json and on stderr."""
    write(tmp_path / "job.py", "import subprocess, sys\n"
          "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
          "open('child.pid', 'w').write(str(p.pid))\n")
    proc = dtprof("run", "--out", "r", "--no-nvml", "--no-report", "--", sys.executable, "job.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    pid = int((tmp_path / "child.pid").read_text())
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    stop = json.loads((only_node(tmp_path / "r") / "node.json").read_text())["stops"][0]
    assert stop["reason"] == "left running after the job's command ended" and stop["sigterm_sent_to"] == 1
    assert stop["survivors"] == [] and "none left running" in proc.stderr
