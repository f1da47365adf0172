"""The injected sitecustomize: cheap at start-up, inert without dtprof, and polite to an existing sitecustomize."""
import os
import subprocess
import sys
from pathlib import Path

import dtprof._inject

INJECT = Path(dtprof._inject.__file__).parent


def _python(code, env_extra, tmp_path, extra_path=()):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTPROF_", "RANK", "LOCAL_RANK"))}
    env["PYTHONPATH"] = os.pathsep.join([str(INJECT), *map(str, extra_path)])
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)


def test_does_not_import_torch_at_startup_and_chains_original_sitecustomize(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins; builtins.ORIGINAL_SITECUSTOMIZE_RAN = True\n")
    node = tmp_path / "node"
    node.mkdir()
    code = "import sys, builtins; print('torch' in sys.modules, getattr(builtins, 'ORIGINAL_SITECUSTOMIZE_RAN', 0))"
    r = _python(code, {"DTPROF_NODE_DIR": str(node)}, tmp_path, [other])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"]
    assert list(node.iterdir()) == []        # nothing recorded by a process that never imports torch


def test_inert_without_node_dir(tmp_path):
    r = _python("import torch, sys; print('dtprof.collectors.runtime' in sys.modules)", {}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_torchrun_launcher_is_not_a_rank(monkeypatch):
    from dtprof.collectors import runtime

    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                           "train.py"], raising=False)
    assert runtime._is_torchrun_launcher()
    monkeypatch.setattr(sys, "orig_argv", ["/usr/bin/python3", "/venv/bin/torchrun", "train.py"], raising=False)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/torchrun", "train.py"])
    assert runtime._is_torchrun_launcher()
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "train.py"], raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    assert not runtime._is_torchrun_launcher()


def test_a_fault_at_start_up_is_recorded_not_printed(tmp_path):
    """dtprof fails in a process before it has a rank writer (here its config cannot be read): the job runs on with
    nothing of dtprof in its output, and the fault is an events row of the run, which `dtprof run` names at the
    end."""
    from dtprof.launcher import own_faults_line
    from dtprof.reader import read_node_raw

    node = tmp_path / "node"
    node.mkdir()
    code = "import torch; print(torch.nn.Linear(2, 1)(torch.ones(1, 2)).shape)"
    r = _python(code, {"DTPROF_NODE_DIR": str(node), "DTPROF_CONFIG": "{not json", "RANK": "0"}, tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "torch.Size([1, 1])" and r.stderr == "", r.stderr
    ev = read_node_raw(node)["events"]
    assert len(ev) == 1 and ev["level"].iloc[0] == "error"
    assert ev["message"].iloc[0].startswith("dtprof disabled in pid ") and "JSONDecodeError" in ev["message"].iloc[0]
    assert own_faults_line(node).startswith("dtprof disabled in pid ")


def test_a_fault_of_the_heartbeat_thread_is_named_at_the_end(tmp_path):
    """The heartbeat never raises: it keeps its faults in its heartbeat.json (chaos hb_raise); `dtprof run` names
    them with the rank, as it names a rank's disabled recorder."""
    import json

    from dtprof.launcher import own_faults_line

    rank_dir = tmp_path / "node" / "rank-1"
    rank_dir.mkdir(parents=True)
    (rank_dir / "heartbeat.json").write_text(json.dumps({"rank": 1, "faults": ["heartbeat: OSError: disk gone"]}))
    line = own_faults_line(tmp_path / "node")
    assert line.startswith("dtprof's heartbeat thread on rank 1: heartbeat: OSError: disk gone"), line
    assert "the job and its recording ran on" in line
