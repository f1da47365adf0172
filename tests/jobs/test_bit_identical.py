"""dtprof never changes training numerics (issue 14): the final weights of DDP (plain, gradient_as_bucket_view,
static_graph, no_sync accumulation, a comm hook registered by the user after the first step) and FSDP2 are
bit-identical with and without dtprof, at world sizes 2, 3 and 4 (3 is where a replacement comm hook's division
would round differently). The profiled job must still record DDP's buckets: their bytes add up to the gradient
bytes of every synchronised backward pass."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dtprof._inject
from conftest import TESTS
from dtprof.reader import open_run
from dtprof.rundir.writer import create_node_dir, create_run_dir
from torch_abort import returncode

pytestmark = pytest.mark.slow

JOB = TESTS / "numerics_jobs" / "variants.py"
INJECT = Path(dtprof._inject.__file__).parent
VARIANTS = ["plain", "gradient_as_bucket_view", "static_graph", "no_sync", "late_user_hook", "fsdp2"]
SYNCED_BACKWARDS = 5 * 6        # the five DDP variants x 6 steps, each with one synchronised backward
_port = [29300 + os.getpid() % 300]


def _run(tmp: Path, world: int, node_dir=None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTPROF_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                   "MASTER_", "TORCHELASTIC"))}
    env["OMP_NUM_THREADS"] = "1"
    if node_dir is not None:
        env["DTPROF_NODE_DIR"] = str(node_dir)
        env["DTPROF_CONFIG"] = json.dumps({"flush_interval_s": 0.5})
        env["PYTHONPATH"] = os.pathsep.join([str(INJECT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    _port[0] += 1
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--master_port",
                        str(_port[0]), str(JOB)], env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
    assert returncode(p) == 0, p.stderr[-3000:]
    out = {}
    for line in p.stdout.splitlines():
        parts = line.split()
        if parts and parts[0] == "digest":
            out[parts[1]] = parts[2]
        elif parts and parts[0] == "param_bytes":
            out["param_bytes"] = int(parts[1])
    out["stderr"] = p.stderr
    return out


@pytest.fixture(scope="module", params=[2, 3, 4])
def bare_and_profiled(request, tmp_path_factory):
    world = request.param
    tmp = tmp_path_factory.mktemp(f"world{world}")
    bare = _run(tmp, world)
    run_dir = create_run_dir(tmp / "run", {"test": "bit identical"})
    profiled = _run(tmp, world, create_node_dir(run_dir))
    return world, bare, profiled, open_run(run_dir)


def test_final_weights_bit_identical(bare_and_profiled):
    world, bare, profiled, _ = bare_and_profiled
    assert sorted(k for k in bare if k in VARIANTS) == sorted(VARIANTS)
    for v in VARIANTS:
        assert profiled[v] == bare[v], f"world {world}, {v}: weights differ under dtprof"


def test_ddp_buckets_still_recorded(bare_and_profiled):
    world, _, profiled, run = bare_and_profiled
    assert len(run.ranks) == world
    assert run.meta[run.meta["kind"].astype(str) == "fault"].empty and not (run.events.level == "error").any()
    b = run.collectives[run.collectives.api == "ddp_bucket"]
    per_rank = b.groupby("rank").in_bytes.sum()
    assert (per_rank == SYNCED_BACKWARDS * profiled["param_bytes"]).all(), per_rank
    assert b.end_ns.notna().all() and (b.end_ns >= b.issue_ns).all()
    assert b.groupby(["rank", "step"]).size().max() > 1          # several buckets per backward, each indexed
    assert (b.source == "ddp").all() and b.bucket.notna().all()
    assert "dtprof" not in profiled["stderr"]
