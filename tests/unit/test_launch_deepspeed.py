"""dtprof/launch_deepspeed.py: which DeepSpeed launches start ranks on other hosts, and the environment file that
gives them dtprof's settings through pdsh (the real pdsh launch: tests/jobs/test_deepspeed.py)."""
from __future__ import annotations

import json
import subprocess

import pytest

from dtprof import launch_deepspeed as ld


@pytest.fixture
def hostfile(tmp_path):
    (tmp_path / "hosts").write_text("# the cluster\nnodeA slots=8\n\nnodeB slots=8\nnodeC slots=8\n")
    (tmp_path / "one").write_text("localhost slots=2\n")
    return tmp_path


@pytest.mark.parametrize("command, expected", [
    (["deepspeed", "--hostfile", "hosts", "train.py"], ("pdsh", ["nodeA", "nodeB", "nodeC"])),
    (["/v/bin/deepspeed", "-H=hosts", "--master_addr", "a", "train.py", "--no_ssh"],
     ("pdsh", ["nodeA", "nodeB", "nodeC"])),                      # the script's own --no_ssh is not the runner's
    (["deepspeed", "--hostfile", "hosts", "--launcher", "OpenMPI", "train.py"],
     ("openmpi", ["nodeA", "nodeB", "nodeC"])),
    (["deepspeed", "--hostfile", "hosts", "--include", "nodeA:0,1@nodeC", "train.py"], ("pdsh", ["nodeA", "nodeC"])),
    (["deepspeed", "--hostfile", "hosts", "--exclude", "nodeA@nodeB:3", "train.py"], ("pdsh", ["nodeB", "nodeC"])),
    (["deepspeed", "--hostfile", "hosts", "--num_nodes", "2", "train.py"], ("pdsh", ["nodeA", "nodeB"])),
    (["deepspeed", "--hostfile", "one", "--force_multi", "train.py"], ("pdsh", ["localhost"])),
    # launched here only: one host, one host left by the filter, per-node launches, no hostfile, not DeepSpeed
    (["deepspeed", "--hostfile", "one", "--no_ssh_check", "train.py"], None),
    (["deepspeed", "--hostfile", "hosts", "--include", "nodeB", "train.py"], None),
    (["deepspeed", "--hostfile", "hosts", "--no_ssh", "--node_rank", "1", "train.py"], None),
    (["deepspeed", "--num_gpus", "2", "train.py"], None),
    (["torchrun", "--hostfile", "hosts", "train.py"], None),
])
def test_remote_launch(hostfile, command, expected):
    assert ld.remote_launch(command, hostfile) == expected


def test_env_file_keeps_the_users_lines_and_survives_deepspeeds_shell(tmp_path, monkeypatch):
    """The file holds the user's .deepspeed_env lines (home first, then the current directory, as DeepSpeed reads
    them) and dtprof's; each dtprof value, put through DeepSpeed's own quoting (multinode_runner.py ``add_export``)
    into the shell command pdsh runs, reaches the rank unchanged."""
    home, cwd, node = tmp_path / "home", tmp_path / "work", tmp_path / "node dir"
    for d in (home, cwd, node):
        d.mkdir()
    monkeypatch.setenv("HOME", str(home))
    (home / ".deepspeed_env").write_text("NCCL_IB_DISABLE=1\nA=home\n")
    (cwd / ".deepspeed_env").write_text("A=cwd")
    config = json.dumps({"trace_steps": "10:12", "note": 'a "b" $HOME `x` \\n', "x": None})
    job_env = {"DTPROF_NODE_DIR": str(node), "DTPROF_CONFIG": config, "TORCH_NCCL_ENABLE_TIMING": "1",
               "PYTHONPATH": "/inject"}
    path = ld.write_env_file(node, {"TORCH_NCCL_ENABLE_TIMING": "1"}, job_env, cwd)
    lines = path.read_text().splitlines()
    assert lines[:3] == ["NCCL_IB_DISABLE=1", "A=home", "A=cwd"]
    assert [x.split("=", 1)[0] for x in lines[3:]] == ["DTPROF_NODE_DIR", "DTPROF_CONFIG"]   # the user's own kept

    # DeepSpeed's runner: each line split at its first "=", the value quoted by add_export, then "export K=V; "
    MultiNodeRunner = pytest.importorskip("deepspeed.launcher.multinode_runner").MultiNodeRunner

    class Runner(MultiNodeRunner):
        def backend_exists(self):
            return True

        def get_cmd(self, environment, active_resources):
            return []

    runner = Runner.__new__(Runner)
    runner.exports = {}
    for line in path.read_text().splitlines(True):
        key, val = line.split("=", maxsplit=1)
        runner.add_export(key, val)
    exports = "".join(f"export {k}={v}; " for k, v in runner.exports.items())
    got = subprocess.run(["sh", "-c", exports + 'printf "%s\\n%s" "$DTPROF_NODE_DIR" "$DTPROF_CONFIG"'],
                         capture_output=True, text=True, check=True).stdout.split("\n", 1)
    assert got == [str(node), config]


def test_env_file_named_by_ds_env_file(tmp_path, monkeypatch):
    """DS_ENV_FILE names the user's file: an absolute name is that one file (read once)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "mine").write_text("X=1\n")
    path = ld.write_env_file(tmp_path, {"DS_ENV_FILE": str(tmp_path / "mine")},
                             {"DTPROF_NODE_DIR": "/n", "DTPROF_CONFIG": "{}"}, tmp_path)
    assert path.read_text() == 'X=1\nDTPROF_NODE_DIR=/n\nDTPROF_CONFIG={}\n'
