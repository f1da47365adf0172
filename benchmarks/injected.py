"""The environment of one worker process that records as a `dtprof run` rank would (dtprof injected through
PYTHONPATH, recording into a throwaway run under ``tmp``): shared by the benchmarks that price one rank-side part
in blocks inside one process (health_bench.py cost, memory_cost.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path


def rank_env(tmp: str, benchmark: str, full_detail: bool) -> dict[str, str]:
    import dtprof._inject
    from dtprof.rundir.writer import create_node_dir, create_run_dir

    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTPROF_", "RANK", "LOCAL_RANK"))}
    env["OMP_NUM_THREADS"] = "1"
    env["DTPROF_NODE_DIR"] = str(create_node_dir(create_run_dir(Path(tmp) / "run", {"benchmark": benchmark})))
    env["DTPROF_CONFIG"] = json.dumps({"flush_interval_s": 1.0, "full_detail": full_detail})
    env["PYTHONPATH"] = os.pathsep.join([str(Path(dtprof._inject.__file__).parent), env.get("PYTHONPATH", "")])
    return env
