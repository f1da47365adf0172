"""Synthetic runs for the report tests: tests/synth.build_run plus what a report also shows.

Additions over ``synth.build_run`` (kept here so synth.py stays shared and small):
- node.json with a real-looking command, host, start/end, versions and status;
- NVML samples (10 Hz per GPU) covering the run;
- optionally a pipeline-parallel section (pp_forward/pp_backward spans per stage and microbatch, send/recv);
- optionally hostile names (``<script>``, ``onerror=``, ``</script>``) in every string a run can carry.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from dtprof.reader import open_run
from dtprof.rundir.writer import write_node_tables
from synth import MS, build_run

# Strings that must show up as text and never execute. Each would run code if pasted raw into HTML or a <script>.
HOSTILE = {
    "host": "<img src=x onerror=\"window.__pwned=1\">",
    "span": "</script><script>window.__pwned=2</script><b>bold?</b>",
    "group": "<svg onload=window.__pwned=3>",
    "command": "train.py --name '</script><script>window.__pwned=4</script>'",
    "device": "<b onmouseover=window.__pwned=5>GPU</b>",
}


FAILED_STDERR = """\
[rank1]: RuntimeError: NCCL timeout: Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1042, \
OpType=ALLREDUCE, NumelIn=6553600, NumelOut=6553600, Timeout(ms)=600000) ran for 600012 milliseconds
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_10:16:01
  host      : host0
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 4242)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def _rewrite(path: Path, tables: dict, node_info: dict) -> None:
    node = Path(path) / "node-synthetic"
    write_node_tables(node, tables, node_info)


def build_report_run(path: Path, *, world_size: int = 4, steps: int = 12, pipeline: bool = False,
                     nvml: bool = True, hostile: bool = False, status: str = "completed", **kw) -> Path:
    """A synthetic run with node metadata and NVML samples (and pipeline spans, hostile names if asked)."""
    if pipeline:  # room for a 4-microbatch GPipe schedule inside each step's forward + backward
        kw.setdefault("fwd_ms", 20.0)
        kw.setdefault("bwd_ms", 30.0)
    build_run(path, world_size=world_size, steps=steps, **kw)
    run = open_run(path)
    tables = {t: run.table(t).copy() for t in ("ranks", "steps", "spans", "collectives", "groups", "clock",
                                                  "events")}
    for name in tables:   # back to plain strings so we can assign anything
        df = tables[name]
        for c in df.columns:
            if df[c].dtype == "category":
                df[c] = df[c].astype(str)
    ranks = tables["ranks"]
    steps_tbl = tables["steps"]
    ranks["device_type"] = "cuda"
    ranks["device_name"] = "NVIDIA H100 80GB HBM3"
    ranks["device_mem_total_bytes"] = 80 * 2**30
    steps_tbl["peak_mem_bytes"] = (20 + 5 * (steps_tbl["rank"] % 4)).astype("int64") * 2**30
    t0, t1 = int(steps_tbl["start_ns"].min()), int(steps_tbl["end_ns"].max())

    if pipeline:
        tables["spans"], tables["collectives"] = _add_pipeline(tables["spans"], tables["collectives"],
                                                               steps_tbl, world_size)
    if nvml:
        tables["nvml"] = _nvml(ranks, t0, t1)
    command = ["torchrun", f"--nproc_per_node={world_size}", "train.py", "--steps", str(steps)]
    if hostile:
        ranks["host"] = HOSTILE["host"]
        ranks["device_name"] = HOSTILE["device"]
        tables["clock"]["host"] = HOSTILE["host"]
        tables["spans"]["name"] = np.where(tables["spans"]["kind"] == "forward", HOSTILE["span"],
                                           tables["spans"]["name"])
        tables["collectives"]["group"] = HOSTILE["group"]
        tables["groups"]["group"] = HOSTILE["group"]
        if "nvml" in tables:
            tables["nvml"]["host"] = HOSTILE["host"]
        command = ["torchrun", HOSTILE["command"]]
    node_info = {
        "command": command, "cwd": "/home/user/proj", "host": ranks["host"].iloc[0],
        # the keys dtprof/launcher.py writes
        "start_mono_ns": t0 - 2 * 10**9, "end_mono_ns": t1 + 10**9, "duration_s": 62.0,
        "start_time": "2026-11-22T10:15:00Z", "end_time": "2026-11-22T10:16:02Z",
        "exit_code": 0 if status == "completed" else 1, "status": status,
        "versions": {"python": "3.11.9", "torch": "2.13.0", "nccl": "2.27.3", "dtprof": "0.1.0",
                     "driver": "560.35.03", "cuda": "12.8"},
        "env": {"NCCL_DEBUG": "WARN"}, "config": {"trace_steps": None, "count_flops": False},
    }
    _rewrite(path, tables, node_info)
    if status != "completed":  # what torchrun prints when a rank fails: the report says why from it (triage)
        (Path(path) / "node-synthetic" / "stderr.log").write_text(FAILED_STDERR)
    return Path(path)


def _nvml(ranks: pd.DataFrame, t0: int, t1: int) -> pd.DataFrame:
    """10 Hz samples per GPU; utilisation dips between steps are not modelled, a slow GPU runs hot and clocked down."""
    gpus = ranks[["host", "device_index"]].drop_duplicates()
    t = np.arange(t0, t1, 100 * MS, dtype=np.int64)
    rng = np.random.default_rng(1)
    rows = []
    for host, gpu in gpus.itertuples(index=False):
        n = len(t)
        rows.append(pd.DataFrame({
            "host": host, "node": "node-synthetic", "gpu": int(gpu), "uuid": f"GPU-{gpu}", "t_ns": t,
            "sm_util_pct": np.clip(85 + rng.normal(0, 5, n), 0, 100),
            "mem_bw_util_pct": np.clip(45 + rng.normal(0, 5, n), 0, 100),
            "mem_used_bytes": 30e9, "mem_total_bytes": 80e9,
            "power_w": 550 + rng.normal(0, 20, n), "temp_c": 62 + rng.normal(0, 1, n),
            "sm_clock_mhz": 1980.0, "mem_clock_mhz": 2619.0, "throttle_reasons": 0, "ecc_errors": 0}))
    return pd.concat(rows, ignore_index=True)


def _add_pipeline(spans, colls, steps_tbl, world_size, microbatches: int = 4, fwd_ms: float = 2.0,
                  bwd_ms: float = 4.0):
    """Replace forward/backward with a GPipe schedule: rank r is stage r, ``microbatches`` per step, send/recv
    between neighbouring stages. Times are laid out from each step's forward start."""
    p, m = world_size, microbatches
    fwd = spans[spans["kind"] == "forward"][["rank", "step", "start_ns"]].reset_index(drop=True)
    F, B = int(fwd_ms * MS), int(bwd_ms * MS)
    s = fwd["rank"].to_numpy()
    rows = []
    send = []
    for mb in range(m):
        f_start = fwd["start_ns"].to_numpy() + (mb + s) * F
        b_start = fwd["start_ns"].to_numpy() + (m + p - 1) * F + (mb + (p - 1 - s)) * B
        for kind, start, dur in (("pp_forward", f_start, F), ("pp_backward", b_start, B)):
            rows.append(pd.DataFrame({"rank": fwd["rank"], "step": fwd["step"], "kind": kind,
                                      "name": f"{kind[3:]} stage", "start_ns": start, "end_ns": start + dur,
                                      "stage": s, "microbatch": mb, "lane": "main", "source": "hook"}))
        has_next = s < p - 1
        send.append(pd.DataFrame({
            "rank": fwd["rank"][has_next], "step": fwd["step"][has_next], "op": "send", "api": "isend",
            "source": "pipeline", "group": "0", "group_size": p, "seq": fwd["step"][has_next] * m + mb,
            "in_bytes": 8 * 2**20, "out_bytes": 0, "dtype": "bfloat16", "peer": s[has_next] + 1,
            "async_op": True, "issue_ns": f_start[has_next] + F, "return_ns": f_start[has_next] + F + 10_000,
            "end_ns": f_start[has_next] + F + MS // 2, "stage": s[has_next], "microbatch": mb}))
    keep = spans[~spans["kind"].isin(["forward", "backward"])]
    return (pd.concat([keep, *rows], ignore_index=True),
            pd.concat([colls, *send], ignore_index=True))
