"""`dtprof run` around real torchrun jobs: single node with two workers, and two "nodes" (two launchers on this
machine, one rendezvous) writing one run directory.

The worker script reports what dtprof gave it; with TRAIN=1 it also trains a few steps, so the rank runtime
records them and the two "nodes" read back as one run.
"""
from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

import dtprof._inject
from conftest import dtprof_popen, free_port
from dtprof.reader import open_run
from scale_checks import assert_summaries_equal_raw
from torch_abort import TEARDOWN_ABORT, TorchExitAbort

pytestmark = pytest.mark.slow

WORKER = """
import json, os, pathlib
node = pathlib.Path(os.environ["DTPROF_NODE_DIR"])
print(f"worker rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} node={node.name}", flush=True)
(pathlib.Path("seen") / f"rank{os.environ['RANK']}.json").write_text(json.dumps(
    {"node_dir": str(node), "pythonpath": os.environ["PYTHONPATH"], "config": os.environ["DTPROF_CONFIG"]}))
if os.environ.get("TRAIN"):  # a few real training steps, so the rank runtime records something
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.ones(4, 8)).sum()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
"""


def _two_launchers(d: Path):
    """Two `dtprof run` launchers of one 2-node torchrun job in ``d``: (procs, results). When a rank hits torch's exit
    abort (tests/torch_abort.py) the other node's agent waits 300 s at torchelastic's exit barrier, so the launchers
    are stopped (SIGTERM, which `dtprof run` passes on) as soon as a node's stderr.log shows the abort, and
    ``TorchExitAbort`` has pytest run the test again."""
    (d / "worker.py").write_text(textwrap.dedent(WORKER))
    (d / "seen").mkdir()
    port = free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=job42", "worker.py"]
    env = {**os.environ, "TRAIN": "1"}
    procs = [dtprof_popen("run", "--out", "shared_run", "--no-report", "--", *torchrun, cwd=d, env=env)
             for _ in range(2)]
    deadline = time.monotonic() + 180
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.5)
        if any(TEARDOWN_ABORT in log.read_text(errors="replace") for log in d.glob("shared_run/node-*/stderr.log")):
            for p in procs:
                p.terminate()
            for p in procs:
                p.communicate(timeout=60)
            raise TorchExitAbort(f"a rank of the 2-node job in {d} aborted in torch's teardown")
    return procs, [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs]


@pytest.fixture(scope="module")
def multinode(tmp_path_factory):
    d = tmp_path_factory.mktemp("multinode")
    return d, *_two_launchers(d)


def test_two_nodes_one_run(multinode):
    d, procs, results = multinode
    for p, (_out, err) in zip(procs, results):
        assert p.returncode == 0, err
    run_dir = d / "shared_run"
    nodes = sorted(run_dir.glob("node-*"))
    assert len(nodes) == 2
    run = open_run(run_dir)
    assert len(run.nodes) == 2 and run.manifest["join_id"] == "job42"
    infos = [json.loads((n / "node.json").read_text()) for n in nodes]
    assert all(i["status"] == "completed" and i["join_id"] == "job42" for i in infos)
    assert all((n / "tables" / "_complete").exists() for n in nodes)
    # each worker was pointed at its own launcher's node directory
    seen = {int(p.stem[4:]): json.loads(p.read_text()) for p in (d / "seen").glob("rank*.json")}
    assert sorted(seen) == [0, 1]
    assert {Path(s["node_dir"]).name for s in seen.values()} == {n.name for n in nodes}
    inject = str(Path(dtprof._inject.__file__).resolve().parent)
    assert all(s["pythonpath"].split(os.pathsep)[0] == inject for s in seen.values())
    # each node's own log holds its worker's output
    logs = sorted((n / "stdout.log").read_text() for n in nodes)
    assert any("worker rank=0 world=2" in x for x in logs) and any("worker rank=1 world=2" in x for x in logs)


def test_two_nodes_ranks_read_as_one_run(multinode):
    d, procs, _ = multinode
    run = open_run(d / "shared_run")
    assert sorted(run.ranks["rank"]) == [0, 1]
    assert run.ranks["node"].nunique() == 2
    assert run.steps.groupby("rank").size().to_dict() == {0: 3, 1: 3}
    # the all-reduces of both "nodes" match up by (group, seq) with equal bytes
    ar = run.collectives[run.collectives["op"] == "all_reduce"]
    per_instance = ar.groupby(["group", "seq"], observed=True).agg(n=("rank", "nunique"), b=("in_bytes", "nunique"))
    assert len(per_instance) == 6 and (per_instance["n"] == 2).all() and (per_instance["b"] == 1).all()


def test_single_node_torchrun_two_workers(tmp_path):
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    (tmp_path / "seen").mkdir()
    p = dtprof_popen("run", "--no-report", "--", sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc_per_node=2", "worker.py", cwd=tmp_path)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    assert "worker rank=0 world=2" in out and "worker rank=1 world=2" in out     # passed through live
    (run_dir,) = (tmp_path / "dtprof-runs").iterdir()
    assert run_dir.name.endswith("-worker")
    (node,) = run_dir.glob("node-*")
    assert {json.loads(s.read_text())["node_dir"] for s in (tmp_path / "seen").glob("*.json")} == {str(node)}


def test_two_nodes_analysed_from_their_summaries_equal_raw(multinode):
    """Each of the two launchers summarised its own node; the run analysed from both summaries equals the run
    analysed from the raw tables (docs/scale.md)."""
    d, _, _ = multinode
    s = assert_summaries_equal_raw(d / "shared_run")
    assert s["run"]["nodes"] == 2 and s["run"]["ranks_recorded"] == 2
