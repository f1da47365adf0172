"""Synthetic runs with known truth, written in the real run format (Parquet tables via write_node_tables).

Used by analyzer, report and compare tests and by the scale benchmarks. Everything is vectorised so a 1,024-rank,
200-step run builds in seconds.

The default run is DDP-like: each step is data_wait, forward, backward (during which `buckets` all-reduces run,
overlapping the backward), a comm_wait for the last bucket, then optimizer. All durations are exact integers of ns.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from dtprof.runformat import create_run_dir, write_node_tables

MS = 1_000_000


@dataclass
class SynthSpec:
    world_size: int = 2
    steps: int = 20
    hosts: int = 1                      # ranks are spread evenly over hosts
    data_ms: float = 1.0
    fwd_ms: float = 10.0
    bwd_ms: float = 20.0
    opt_ms: float = 2.0
    buckets: int = 2                    # all-reduces per step, issued evenly through the backward
    bucket_ms: float = 4.0              # transfer time of one bucket
    bucket_bytes: int = 25 * 2**20
    jitter_frac: float = 0.0            # lognormal-ish multiplicative noise on compute phases
    slow_rank: int | None = None        # this rank's compute is slow_factor× longer
    slow_factor: float = 1.0
    host_offset_ns: list[int] = field(default_factory=list)  # per host clock offset added to its timestamps
    device_name: str = "cpu"
    device_type: str = "cpu"
    seed: int = 0


def build_run(path: Path, spec: SynthSpec | None = None, **kw) -> Path:
    """Write a synthetic run to ``path`` and return it. kwargs override SynthSpec fields."""
    spec = spec or SynthSpec()
    for k, v in kw.items():
        setattr(spec, k, v)
    rng = np.random.default_rng(spec.seed)
    W, S = spec.world_size, spec.steps
    ranks = np.arange(W)
    per_host = max(1, W // spec.hosts)
    host_of = np.minimum(ranks // per_host, spec.hosts - 1)

    def phase(ms):
        base = np.full((W, S), ms * MS, dtype=float)
        if spec.jitter_frac:
            base *= np.exp(rng.normal(0, spec.jitter_frac, size=(W, S)))
        if spec.slow_rank is not None:
            base[spec.slow_rank] *= spec.slow_factor
        return base.astype(np.int64)

    data, fwd, bwd, opt = phase(spec.data_ms), phase(spec.fwd_ms), phase(spec.bwd_ms), phase(spec.opt_ms)
    # Collectives synchronise ranks: a step on all ranks lasts as long as the slowest rank's compute + last bucket.
    bucket_ns = int(spec.bucket_ms * MS)
    compute_to_last_issue = data + fwd + bwd
    step_len = compute_to_last_issue.max(axis=0) + bucket_ns + opt.max(axis=0)  # (S,)
    step_start = np.concatenate([[0], np.cumsum(step_len)[:-1]]).astype(np.int64) + 10**9
    t0 = np.broadcast_to(step_start, (W, S))
    d_end = t0 + data
    f_end = d_end + fwd
    b_end = f_end + bwd                      # last bucket is ready when backward compute ends
    last_exit = b_end.max(axis=0) + bucket_ns  # every rank leaves the last all-reduce together
    wait_end = np.broadcast_to(last_exit, (W, S))
    o_end = wait_end + opt
    s_end = np.broadcast_to(step_start + step_len, (W, S))

    offs = np.array(spec.host_offset_ns or [0] * spec.hosts, dtype=np.int64)[host_of][:, None]
    rk = np.repeat(ranks, S)
    st = np.tile(np.arange(S), W)

    def flat(a):
        return (a + offs).ravel()

    steps = pd.DataFrame({"rank": rk, "step": st, "start_ns": flat(t0), "end_ns": flat(s_end),
                          "peak_mem_bytes": 2**30, "tokens": 4096, "samples": 8})
    spans = []
    for kind, a, b in (("data_wait", t0, d_end), ("forward", d_end, f_end), ("backward", f_end, wait_end),
                       ("comm_wait", b_end, wait_end), ("optimizer", wait_end, o_end)):
        spans.append(pd.DataFrame({"rank": rk, "step": st, "kind": kind, "name": kind,
                                   "start_ns": flat(a), "end_ns": flat(b), "lane": "main", "source": "hook"}))
    spans = pd.concat(spans, ignore_index=True)

    # Buckets: bucket j of B is issued at f_end + bwd*(j+1)/B; the instance ends when its last rank issued + transfer.
    colls = []
    B = spec.buckets
    for j in range(B):
        issue = f_end + (bwd * (j + 1)) // B
        end = np.broadcast_to(issue.max(axis=0) + bucket_ns, (W, S))
        colls.append(pd.DataFrame({
            "rank": rk, "step": st, "op": "all_reduce", "api": "ddp_bucket", "source": "ddp", "group": "0",
            "group_size": W, "seq": st * B + j, "in_bytes": spec.bucket_bytes, "out_bytes": spec.bucket_bytes,
            "dtype": "float32", "async_op": True, "issue_ns": flat(issue), "return_ns": flat(issue) + 10_000,
            "end_ns": flat(end), "bucket": j}))
    colls = pd.concat(colls, ignore_index=True)

    rank_tbl = pd.DataFrame({"rank": ranks, "local_rank": ranks % per_host, "world_size": W,
                             "node_rank": host_of, "host": [f"host{h}" for h in host_of], "pid": 1000 + ranks,
                             "device_type": spec.device_type, "device_index": ranks % per_host,
                             "device_name": spec.device_name, "device_uuid": "", "backend": "gloo"})
    groups = pd.DataFrame({"rank": ranks, "group": "0", "ranks": ",".join(map(str, ranks)), "size": W,
                           "backend": "gloo", "desc": "default_pg", "mesh_dim": ""})
    wall0 = time.time_ns()
    clock = pd.DataFrame({"rank": ranks, "host": rank_tbl["host"], "mono_ns": 10**9 + offs[:, 0],
                          "wall_ns": wall0})

    create_run_dir(path, {"command": ["synthetic"], "created": "synthetic"})
    tables = {"ranks": rank_tbl, "steps": steps, "spans": spans, "collectives": colls, "groups": groups,
              "clock": clock}
    node = Path(path) / "node-synthetic"
    node.mkdir()
    write_node_tables(node, tables, {"host": "synthetic", "command": ["synthetic"], "status": "completed",
                                     "exit_code": 0})
    return Path(path)
