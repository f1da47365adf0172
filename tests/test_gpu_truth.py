"""A GPU rank's host waiting for its GPU is not communication (docs/metrics.md, "Step breakdown", "Waiting for the
GPU"): on the real H100 run the issue names (../shared/data/gpu-h100, read in place), on the real H200 DDP run
(tests/data/gpu) checked against its own spans, and on a hand-made GPU run with a hand-worked answer."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dtprof.analyzers.options import AnalysisOptions
from dtprof.analyzers.summary import analyze
from dtprof.reader import open_run
from dtprof.runformat import create_run_dir, write_node_tables

MS = 1_000_000
_REPO = Path(__file__).resolve().parent.parent
# CI: <repo>/../shared; a worktree under /work/wt/<name>: two levels up
H100 = next((p for p in (_REPO.parent / "shared/data/gpu-h100", _REPO.parent.parent / "shared/data/gpu-h100")
             if p.exists()), _REPO.parent / "shared/data/gpu-h100")
needs_h100 = pytest.mark.skipif(not H100.exists(), reason=f"shared H100 runs not found at {H100}")
H200_DDP = _REPO / "tests/data/gpu/ddp-h200"


@needs_h100
def test_one_rank_hf_trainer_has_no_communication_and_no_overlap_saving():
    # the Trainer's logging all_gather on a one-rank NCCL group: its first call blocked the host 578 ms (step 50)
    # while the GPU had finished the step (its CUDA-event optimizer span ended 1 ms before the call): not
    # communication, and no overlap can save it
    s = analyze(open_run(H100 / "hf-gpt2-eager")).summary
    b = s["ranks"][0]["breakdown_s_per_step"]
    assert b["comm_outside_fwd_bwd"] == 0 and b["exposed_comm"] == 0
    assert b["gpu_wait"] == 0   # the GPU ran nothing during those calls
    assert b["other"] > 3.5e-3  # 578 ms over 148 measured steps: the host's own time
    assert "gpu_wait" in s["breakdown"]["parts"] and s["breakdown"]["gpu_ranks"] == [0]
    assert not [w for w in s["what_if"] if w["scenario"] == "perfect_overlap" and w["saving_frac"] > 0]
    assert s["overlap"]["comm_s_total"] == 0
    assert not [f for f in s["findings"] if f.get("part") in ("exposed_comm", "comm_outside_fwd_bwd")]


def _intersection_ns(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    return sum(max(0, min(e0, e1) - max(s0, s1)) for s0, e0 in a for s1, e1 in b)


def test_ddp_final_wait_while_backward_runs_is_gpu_wait():
    # one-rank DDP on an H200: DDP's final wait blocks the host while the GPU still runs backward. The breakdown's
    # gpu_wait is, per measured step, the wait's intersection with the CUDA-event compute spans (computed here
    # with plain loops), and nothing of the step is communication
    run = open_run(H200_DDP)
    a = analyze(run)
    sp = run.spans
    steps = a.steps[a.steps["measured"].to_numpy(bool)]
    expect = []
    for st in steps.itertuples():
        mine = sp[(sp["step"] == st.step) & (sp["rank"] == 0)]
        win = [(st.start_ns, st.end_ns)]
        waits = [(max(x.start_ns, st.start_ns), min(x.end_ns, st.end_ns)) for x in mine.itertuples()
                 if x.kind == "comm_wait"]
        dev = [(x.start_ns, x.end_ns) for x in sp[sp["rank"] == 0].itertuples()
               if str(x.source) == "cuda_event" and _intersection_ns([(x.start_ns, x.end_ns)], win) > 0]
        expect.append(_intersection_ns(waits, dev) / 1e9)
    assert np.mean(expect) > 0.5e-3
    assert steps["gpu_wait_s"].to_numpy() == pytest.approx(np.asarray(expect), abs=1e-9)
    b = a.summary["ranks"][0]["breakdown_s_per_step"]
    assert b["exposed_comm"] == 0 and b["comm_outside_fwd_bwd"] == 0
    assert a.summary["overlap"]["comm_s_total"] == 0


def _gpu_run(path: Path, group_size: int, gpu_duration_ms: float | None) -> Path:
    """One GPU rank, one step [0, 100) ms: forward [0, 40) and backward [40, 70) timed on the GPU (CUDA events); the
    host blocked in an all_reduce (comm_wait) over [30, 90), issued at 30, completed at 90."""
    create_run_dir(path, {"command": ["hand"]})
    node = path / "node-hand"
    node.mkdir()
    st = pd.DataFrame([{"rank": 0, "step": 0, "start_ns": 0, "end_ns": 100 * MS}])
    sp = pd.DataFrame([{"rank": 0, "step": 0, "kind": k, "name": k, "start_ns": a * MS, "end_ns": b * MS,
                        "lane": lane, "source": src}
                       for k, a, b, lane, src in (("forward", 0, 40, "cuda", "cuda_event"),
                                                  ("backward", 40, 70, "cuda", "cuda_event"),
                                                  ("comm_wait", 30, 90, "main", "hook"))])
    co = pd.DataFrame([{"rank": 0, "op": "all_reduce", "seq": 0, "issue_ns": 30 * MS, "return_ns": 90 * MS,
                        "end_ns": 90 * MS, "in_bytes": 4096, "out_bytes": 4096, "group_size": group_size,
                        "group": "0", "api": "all_reduce", "source": "user", "dtype": "float32", "async_op": False,
                        "gpu_duration_ns": None if gpu_duration_ms is None else int(gpu_duration_ms * MS)}])
    rk = pd.DataFrame({"rank": [0], "local_rank": [0], "world_size": group_size, "host": "h0", "pid": 1,
                       "device_type": "cuda", "device_index": [0], "device_name": "NVIDIA H100 80GB HBM3",
                       "backend": "nccl"})
    write_node_tables(node, {"ranks": rk, "steps": st, "spans": sp, "collectives": co},
                      {"host": "h0", "status": "completed", "exit_code": 0})
    return path


def _parts_ms(path: Path) -> dict:
    a = analyze(open_run(path), AnalysisOptions(warmup=0))
    row = a.steps.iloc[0]
    return {p: round(float(row[f"{p}_s"]) * 1e3, 6) for p in a.summary["breakdown"]["parts"]}


@pytest.mark.parametrize("group_size, gpu_ms, expect", [
    # [30, 70): the GPU runs forward and backward while the host waits; [70, 90): the GPU is idle, and a one-rank
    # group communicates nothing: the host's own time
    (1, None, {"forward": 30, "backward": 0, "gpu_wait": 40, "exposed_comm": 0, "other": 30}),
    # two ranks, NCCL timed 15 ms on the device, ending at the completion: [75, 90) communicates, [70, 75) is idle
    (2, 15, {"forward": 30, "backward": 0, "gpu_wait": 40, "exposed_comm": 15, "other": 15}),
    # two ranks, no device timing: the host's call is all there is to go by
    (2, None, {"forward": 30, "backward": 0, "gpu_wait": 40, "exposed_comm": 20, "other": 10}),
])
def test_gpu_rank_host_wait_is_split_by_what_the_device_did(tmp_path, group_size, gpu_ms, expect):
    parts = _parts_ms(_gpu_run(tmp_path / "r", group_size, gpu_ms))
    assert {k: parts[k] for k in expect} == expect
    assert sum(parts.values()) == pytest.approx(100)
