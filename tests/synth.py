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

from dtprof.rundir.writer import create_run_dir, write_node_tables

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
    slow_by_cpu_wait: bool = False      # the slow rank's extra time is its training thread waiting for a CPU
                                        # (steps.cpu_wait_ns; the other ranks report 0): a busy machine, no slow work
    host_offset_ns: list[int] = field(default_factory=list)  # per host clock offset added to its timestamps
    device_name: str = "cpu"
    device_type: str = "cpu"
    seed: int = 0
    # --- added for the analyzer tests (all default to "off") ---
    host_drift_ppm: list[float] = field(default_factory=list)  # per host clock drift: t_host += ppm·1e-6·(t - 1 s)
    module_spans: int = 0               # nested per-module forward/backward spans per step (bulk for benchmarks)
    late_rank: int | None = None        # this rank's data wait is late_ms longer: it arrives late at collectives
    late_ms: float = 0.0
    nvml_interval_ms: float = 0.0       # >0: NVML samples for every rank's GPU at this interval
    throttle_rank: int | None = None    # this rank's GPU reports HW thermal slowdown and a lower SM clock
    device_mem_total_bytes: int | None = None
    pipeline_stages: int = 0            # >0: a GPipe pipeline run, one stage per rank (world_size = stages)
    microbatches: int = 4               # pipeline microbatches; fwd_ms/bwd_ms are per microbatch per stage
    p2p_ms: float = 0.0                 # pipeline: transfer time between stages, per hop
    pp_data_ms: float = 0.0             # pipeline: >0: every rank waits this long for input before its schedule,
                                        # recorded as the collector does (data_wait to its first forward) with the
                                        # first microbatch's recv on stages > 0
    trace_steps: tuple | None = None    # (a, b): a trace capture of steps a..b-1 (meta trace_capture rows) ...
    trace_export_ms: float = 0.0        # ... whose stop and export delay step b's first forward by this much


def build_run(path: Path, spec: SynthSpec | None = None, **kw) -> Path:
    """Write a synthetic run to ``path`` and return it. kwargs override SynthSpec fields."""
    spec = spec or SynthSpec()
    for k, v in kw.items():
        setattr(spec, k, v)
    if spec.pipeline_stages:
        return _build_pipeline_run(path, spec)
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
    if spec.trace_steps:   # the profiler's stop/export runs after step b-1 ends, before step b's first forward
        data[:, spec.trace_steps[1]] += int(spec.trace_export_ms * MS)
    if spec.late_rank is not None:
        data[spec.late_rank] += int(spec.late_ms * MS)
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

    drift = np.array(spec.host_drift_ppm or [0.0] * spec.hosts, dtype=float)[host_of][:, None]

    def flat(a):
        a = np.asarray(a, dtype=np.int64)
        skew = np.rint(drift * 1e-6 * (a - 10**9)).astype(np.int64) if spec.host_drift_ppm else 0
        return (a + offs + skew).ravel()

    steps = pd.DataFrame({"rank": rk, "step": st, "start_ns": flat(t0), "end_ns": flat(s_end),
                          "peak_mem_bytes": 2**30, "tokens": 4096, "samples": 8})
    if spec.slow_by_cpu_wait and spec.slow_rank is not None:
        extra = np.zeros((W, S))
        extra[spec.slow_rank] = (data + fwd + bwd + opt)[spec.slow_rank] * (1 - 1 / spec.slow_factor)
        steps["cpu_wait_ns"] = np.rint(extra).astype(np.int64).ravel()
    spans = []
    for kind, a, b in (("data_wait", t0, d_end), ("forward", d_end, f_end), ("backward", f_end, wait_end),
                       ("comm_wait", b_end, wait_end), ("optimizer", wait_end, o_end)):
        spans.append(pd.DataFrame({"rank": rk, "step": st, "kind": kind, "name": kind,
                                   "start_ns": flat(a), "end_ns": flat(b), "lane": "main", "source": "hook"}))
    for i in range(spec.module_spans):  # layer i's share of forward and backward, nested inside the phase
        k = spec.module_spans
        for kind, a, dur in (("forward", d_end, fwd), ("backward", f_end, bwd)):
            s0 = a + (dur * i) // k
            spans.append(pd.DataFrame({"rank": rk, "step": st, "kind": kind, "name": f"layers.{i}",
                                       "start_ns": flat(s0), "end_ns": flat(a + (dur * (i + 1)) // k),
                                       "lane": "main", "source": "hook"}))
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
                             "device_name": spec.device_name, "device_uuid": "", "backend": "gloo",
                             "device_mem_total_bytes": spec.device_mem_total_bytes})
    groups = pd.DataFrame({"rank": ranks, "group": "0", "ranks": ",".join(map(str, ranks)), "size": W,
                           "backend": "gloo", "desc": "default_pg", "mesh_dim": ""})
    wall0 = time.time_ns()
    clock = pd.DataFrame({"rank": ranks, "host": rank_tbl["host"], "mono_ns": 10**9 + offs[:, 0],
                          "wall_ns": wall0})

    create_run_dir(path, {"command": ["synthetic"], "created": "synthetic"})
    tables = {"ranks": rank_tbl, "steps": steps, "spans": spans, "collectives": colls, "groups": groups,
              "clock": clock}
    if spec.trace_steps:
        a, b = spec.trace_steps
        cap_start, cap_end = flat(t0)[np.arange(W) * S + a], flat(d_end)[np.arange(W) * S + b]
        tables["meta"] = pd.DataFrame({"rank": ranks, "host": rank_tbl["host"], "t_ns": cap_end,
                                       "kind": "trace_capture",
                                       "value": [{"steps": list(range(a, b + 1)), "start_ns": int(s0),
                                                  "end_ns": int(e0)}
                                                 for s0, e0 in zip(cap_start, cap_end)]})
    if spec.nvml_interval_ms:
        tables["nvml"] = _nvml_samples(spec, rank_tbl, int(step_start[0]), int(step_start[-1] + step_len[-1]))
    node = Path(path) / "node-synthetic"
    node.mkdir()
    write_node_tables(node, tables, {"host": "synthetic", "command": ["synthetic"], "status": "completed",
                                     "exit_code": 0})
    return Path(path)


def _nvml_samples(spec: SynthSpec, rank_tbl: pd.DataFrame, t0: int, t1: int) -> pd.DataFrame:
    """One sample per GPU per interval: 90 % SM busy, 1980 MHz, 60 °C; the throttled rank's GPU reports HW thermal
    slowdown (0x40), 1400 MHz and 88 °C in every sample."""
    ts = np.arange(t0, t1, int(spec.nvml_interval_ms * MS), dtype=np.int64)
    n, T = len(rank_tbl), len(ts)
    hot = np.zeros(n, bool)
    if spec.throttle_rank is not None:
        hot[spec.throttle_rank] = True
    hot = np.repeat(hot, T)
    return pd.DataFrame({
        "host": np.repeat(rank_tbl["host"].to_numpy(), T), "node": "node-synthetic",
        "gpu": np.repeat(rank_tbl["device_index"].to_numpy(), T), "uuid": "", "t_ns": np.tile(ts, n),
        "sm_util_pct": 90.0, "mem_bw_util_pct": 40.0, "mem_used_bytes": 2.0**30,
        "mem_total_bytes": float(spec.device_mem_total_bytes or 80 * 2**30),
        "power_w": np.where(hot, 250.0, 500.0), "temp_c": np.where(hot, 88.0, 60.0),
        "sm_clock_mhz": np.where(hot, 1400.0, 1980.0), "mem_clock_mhz": 2619.0,
        "throttle_reasons": np.where(hot, 0x40, 0)})


def _build_pipeline_run(path: Path, spec: SynthSpec) -> Path:
    """A GPipe run: stage s on rank s; microbatch j's forward on stage s starts s hops (forward + transfer) and j
    forwards after the step start, then all backwards in reverse stage order likewise, then the optimizer. Stages
    are uniform (fwd_ms, bwd_ms per microbatch), so without transfer time (p2p_ms=0) every stage's bubble is exactly
    (p-1)/(m+p-1) of the pipeline phase; each hop's transfer (p2p_ms) adds idle time the schedule does not need."""
    p, m = spec.pipeline_stages, spec.microbatches
    f, b, o = int(spec.fwd_ms * MS), int(spec.bwd_ms * MS), int(spec.opt_ms * MS)
    lat = int(spec.p2p_ms * MS)
    d = int(spec.pp_data_ms * MS)
    S = spec.steps
    fwd_phase = (p - 1) * (f + lat) + m * f
    step_len = d + fwd_phase + (p - 1) * (b + lat) + m * b + o
    step_start = 10**9 + np.arange(S, dtype=np.int64) * step_len
    st_i, s_i, j_i = np.meshgrid(np.arange(S), np.arange(p), np.arange(m), indexing="ij")
    st_i, s_i, j_i = st_i.ravel(), s_i.ravel(), j_i.ravel()
    base = step_start[st_i] + d
    f_start = base + s_i * (f + lat) + j_i * f
    b_start = base + fwd_phase + (p - 1 - s_i) * (b + lat) + j_i * b
    spans = [pd.DataFrame({"rank": s_i, "step": st_i, "kind": "pp_forward", "name": "forward_one_chunk",
                           "start_ns": f_start, "end_ns": f_start + f, "stage": s_i, "microbatch": j_i,
                           "lane": "main", "source": "hook"}),
             pd.DataFrame({"rank": s_i, "step": st_i, "kind": "pp_backward", "name": "backward_one_chunk",
                           "start_ns": b_start, "end_ns": b_start + b, "stage": s_i, "microbatch": j_i,
                           "lane": "main", "source": "hook"})]
    if o:
        rr, ss = np.repeat(np.arange(p), S), np.tile(np.arange(S), p)
        o_start = step_start[ss] + step_len - o
        spans.append(pd.DataFrame({"rank": rr, "step": ss, "kind": "optimizer", "name": "optimizer",
                                   "start_ns": o_start, "end_ns": o_start + o, "lane": "main", "source": "hook"}))
    rr, ss = np.repeat(np.arange(p), S), np.tile(np.arange(S), p)
    steps = pd.DataFrame({"rank": rr, "step": ss, "start_ns": step_start[ss], "end_ns": step_start[ss] + step_len})
    colls = pd.DataFrame()
    if d:   # the collector's data_wait: the step's start to the rank's first forward (after the fill on stage > 0)
        first_f = step_start[ss] + d + rr * (f + lat)
        spans.append(pd.DataFrame({"rank": rr, "step": ss, "kind": "data_wait", "name": "data_wait",
                                   "start_ns": step_start[ss], "end_ns": first_f, "lane": "main", "source": "hook"}))
        up = rr > 0   # stage s > 0 posts the recv of microbatch 0 when its schedule starts
        colls = pd.DataFrame({"rank": rr[up], "step": ss[up], "op": "recv", "api": "irecv", "source": "pipeline",
                              "group": "0", "group_size": 2, "seq": ss[up], "in_bytes": 0, "out_bytes": 4096,
                              "dtype": "float32", "peer": rr[up] - 1, "async_op": True,
                              "issue_ns": step_start[ss][up] + d, "return_ns": step_start[ss][up] + d + 10_000,
                              "end_ns": first_f[up], "stage": rr[up], "microbatch": 0})
    ranks = np.arange(p)
    rank_tbl = pd.DataFrame({"rank": ranks, "local_rank": ranks, "world_size": p, "node_rank": 0, "host": "host0",
                             "pid": 1000 + ranks, "device_type": spec.device_type, "device_index": ranks,
                             "device_name": spec.device_name, "device_uuid": "", "backend": "gloo"})
    meta = pd.DataFrame({"rank": ranks, "host": "host0", "t_ns": 10**9, "kind": "pipeline_schedule",
                         "value": [{"schedule": "ScheduleGPipe", "stages": p, "microbatches": m, "stage_indices": [r]}
                                   for r in ranks]})
    create_run_dir(path, {"command": ["synthetic-pipeline"], "created": "synthetic"})
    node = Path(path) / "node-synthetic"
    node.mkdir()
    write_node_tables(node, {"ranks": rank_tbl, "steps": steps, "spans": pd.concat(spans, ignore_index=True),
                             "collectives": colls, "meta": meta},
                      {"host": "synthetic", "command": ["synthetic-pipeline"], "status": "completed",
                       "exit_code": 0})
    return Path(path)


def split_by_host(path: Path) -> Path:
    """Rewrite a one-node synthetic run as one node directory per host (what a multi-node job's launchers write),
    each with only its ranks' rows."""
    import json
    import shutil

    from dtprof.reader import open_run
    from dtprof.rundir.writer import NODE_MANIFEST

    run = open_run(path)
    (src,) = run.node_dirs
    tables = {t: run.table(t) for t in ("ranks", "steps", "spans", "collectives", "groups", "nvml", "clock",
                                          "events", "meta")}
    info = json.loads((src / NODE_MANIFEST).read_text()) if (src / NODE_MANIFEST).exists() else {}
    shutil.rmtree(src)
    for host, rk in tables["ranks"].groupby("host", observed=True):
        ranks = set(rk["rank"].tolist())
        node = Path(path) / f"node-{host}"
        part = {t: (df[df["host"].astype(str) == str(host)] if t == "nvml" else
                    df[df["rank"].isin(ranks)] if "rank" in df.columns else df)
                for t, df in tables.items()}
        part["ranks"] = part["ranks"].assign(node=node.name)
        write_node_tables(node, part, {**info, "host": str(host)})
    return Path(path)


def build_ddp_node(run_dir: Path, node: int, ranks_per_node: int, world_size: int, steps: int, buckets: int = 8,
                   jitter_frac: float = 0.05, slow_rank: int | None = None, slow_factor: float = 1.0,
                   host_offset_ns: int = 0, seed: int = 0, detail_period: int = 0, jitter_period: int = 0) -> Path:
    """Write node ``node`` (ranks node*ranks_per_node ...) of a DDP-like job of ``world_size`` ranks, without
    building the other nodes: each rank's compute is its base × (1 + jitter_frac·u), u uniform in [0, 1) drawn from
    the rank's own seed, the slow rank's × slow_factor; collectives end at their last possible arrival (the slowest
    unslowed rank's bound, or the slow rank) + transfer, which every node computes alike. Per rank-step: data_wait,
    forward, backward, comm_wait, optimizer spans and ``buckets`` all-reduces. ``run_dir`` must exist (run.json).
    ``detail_period`` P > 0: sampled as the ranks sample (collectors/runtime.py): steps 0-31 and blocks of 4 steps
    every P in full detail, the others boundary-only (their steps row, ``detail`` 0, and nothing else).
    ``jitter_period`` K > 0: rank r draws rank r mod K's jitter (the same uniform draws, repeated every K ranks), so
    two nodes K ranks apart with the same host offset have the same tables but for rank numbers and host, and the
    later one's summary can be copied from the earlier one's (``copy_summary``)."""
    R, S, B = ranks_per_node, steps, buckets
    ranks = np.arange(node * R, (node + 1) * R)
    base = {"data": 1 * MS, "fwd": 10 * MS, "bwd": 20 * MS, "opt": 2 * MS}
    bucket_ns, top = 4 * MS, 1 + jitter_frac

    def phases(r: int) -> dict:
        u = np.random.default_rng([seed, int(r) % jitter_period if jitter_period else int(r)]).random((4, S))
        out = {k: (base[k] * (1 + jitter_frac * u[i])).astype(np.int64) for i, k in enumerate(base)}
        if r == slow_rank:
            out["fwd"] = (out["fwd"] * slow_factor).astype(np.int64)
            out["bwd"] = (out["bwd"] * slow_factor).astype(np.int64)
        return out

    # the job's schedule: what every node computes the same way (bounds of unslowed ranks, and the slow rank)
    bound = {k: np.full(S, int(v * top), np.int64) for k, v in base.items()}
    slow = phases(slow_rank) if slow_rank is not None else bound
    issue_rel = [np.maximum(bound["data"] + bound["fwd"] + bound["bwd"] * (j + 1) // B,
                            slow["data"] + slow["fwd"] + slow["bwd"] * (j + 1) // B) for j in range(B)]
    step_len = issue_rel[-1] + bucket_ns + np.maximum(bound["opt"], slow["opt"])
    step_start = np.concatenate([[0], np.cumsum(step_len)[:-1]]).astype(np.int64) + 10**9

    own = [phases(r) for r in ranks]
    ph = {k: np.stack([o[k] for o in own]) for k in base}       # (R, S)
    t0 = np.broadcast_to(step_start, (R, S))
    d_end = t0 + ph["data"]
    f_end = d_end + ph["fwd"]
    b_end = f_end + ph["bwd"]
    wait_end = np.broadcast_to(step_start + issue_rel[-1] + bucket_ns, (R, S))
    o_end = wait_end + ph["opt"]
    s_end = np.broadcast_to(step_start + step_len, (R, S))
    n = R * S
    rk, st = np.repeat(ranks, S), np.tile(np.arange(S), R)
    host = f"host{node:05d}"
    detailed = (st < 32) | (st % detail_period < 4) if detail_period else np.ones(n, bool)
    # the detailed rank-steps' rows only, never all of them first: a sampled run of 1,000,000 steps would hold 40 M
    # spans and 64 M collectives before the sampling (~18 GB to build)
    sel = np.flatnonzero(detailed)
    m, rks, sts = len(sel), rk[sel], st[sel]

    def flat(a):
        return (np.asarray(a, np.int64) + host_offset_ns).ravel()

    steps_t = _typed("steps", n, rank=rk, step=st, start_ns=flat(t0), end_ns=flat(s_end), peak_mem_bytes=2**30,
                     tokens=4096, samples=8, detail=detailed.astype(np.int64) if detail_period else None)
    # rows by kind, then rank, then step (one block of m rows per kind)
    kinds = ("data_wait", "forward", "backward", "comm_wait", "optimizer")
    kind = pd.Categorical.from_codes(np.repeat([sorted(kinds).index(k) for k in kinds], m), sorted(kinds))
    spans = _typed("spans", len(kinds) * m, rank=np.tile(rks, len(kinds)), step=np.tile(sts, len(kinds)),
                   kind=kind, name=kind, lane="main", source="hook",
                   start_ns=np.concatenate([flat(a)[sel] for a in (t0, d_end, f_end, b_end, wait_end)]),
                   end_ns=np.concatenate([flat(b)[sel] for b in (d_end, f_end, wait_end, wait_end, o_end)]))
    # rows by bucket, then rank, then step
    issue = np.concatenate([flat(f_end + ph["bwd"] * (j + 1) // B)[sel] for j in range(B)])
    colls = _typed("collectives", B * m, rank=np.tile(rks, B), step=np.tile(sts, B), op="all_reduce",
                   api="ddp_bucket", source="ddp", group="0", group_size=world_size,
                   seq=(sts[None, :] * B + np.arange(B)[:, None]).ravel(), in_bytes=25 * 2**20,
                   out_bytes=25 * 2**20, dtype="float32", async_op=True, issue_ns=issue, return_ns=issue + 10_000,
                   end_ns=np.concatenate([flat(np.broadcast_to(step_start + issue_rel[j] + bucket_ns, (R, S)))[sel]
                                          for j in range(B)]),
                   bucket=np.repeat(np.arange(B), m))
    rank_tbl = pd.DataFrame({"rank": ranks, "local_rank": ranks - node * R, "world_size": world_size,
                             "node_rank": node, "host": host, "pid": 1000 + ranks, "device_type": "cuda",
                             "device_index": ranks - node * R, "device_name": "NVIDIA H100 80GB HBM3",
                             "device_uuid": "", "backend": "nccl", "device_mem_total_bytes": 80 * 2**30})
    # the member list is left empty (all ranks): 16,384 comma-separated ranks in every rank's row would be GBs
    groups = pd.DataFrame({"rank": ranks, "group": "0", "ranks": "", "size": world_size,
                           "backend": "nccl", "desc": "default_pg", "mesh_dim": ""})
    clock = pd.DataFrame({"rank": ranks, "host": host, "mono_ns": 10**9 + host_offset_ns, "wall_ns": 0})
    nd = Path(run_dir) / f"node-{host}"
    nd.mkdir()
    write_node_tables(nd, {"ranks": rank_tbl, "steps": steps_t, "spans": spans, "collectives": colls,
                           "groups": groups, "clock": clock},
                      {"host": host, "command": ["synthetic"], "status": "completed", "exit_code": 0})
    return nd


# summary columns that hold a rank (-1: none), shifted by copy_summary
RANK_COLUMNS = ("rank", "rank_max", "sender", "receiver", "c_sender", "c_receiver")


def copy_summary(template: Path, node: Path, rank_shift: int, cache: dict | None = None) -> Path:
    """Write ``node``'s summary as ``template``'s (another node's directory) with every rank shifted by
    ``rank_shift`` and the template's host replaced by ``node``'s: exactly what summarize_node writes when ``node``'s
    tables are the template's but for those (build_ddp_node with ``jitter_period`` a multiple of ``rank_shift`` and
    the same host offset; tests/unit/test_scale.py checks it file by file). ~10x faster than summarize_node, which is
    what makes a 16,384 × 1,000 run buildable in minutes. ``cache``: a dict kept across calls, holding the
    template's tables once read."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from dtprof.rundir.schema import SUMMARY_TABLES, summary_file
    from dtprof.rundir.writer import PARQUET_COMPRESSION, SUMMARY_COMPLETE, SUMMARY_DIR, SUMMARY_ROW_GROUP_ROWS

    cache = {} if cache is None else cache
    if cache.get("template") != template:
        cache.clear()
        cache.update(template=template, tables={t: pq.read_table(summary_file(template, t)) for t in SUMMARY_TABLES},
                     complete=(template / SUMMARY_DIR / SUMMARY_COMPLETE).read_bytes())
    old_host, new_host = template.name.removeprefix("node-"), node.name.removeprefix("node-")
    out = node / SUMMARY_DIR
    out.mkdir(parents=True, exist_ok=True)
    (out / SUMMARY_COMPLETE).unlink(missing_ok=True)
    for table, t in cache["tables"].items():
        for i, name in enumerate(t.column_names):
            col = t.column(i)
            if name in RANK_COLUMNS:
                col = pc.if_else(pc.greater_equal(col, 0), pc.add(col, rank_shift), col)
            elif name == "host":
                col = pc.if_else(pc.equal(col, old_host), pa.scalar(new_host, col.type), col)
            else:
                continue
            t = t.set_column(i, t.field(i), col)
        pq.write_table(t, summary_file(node, table), row_group_size=SUMMARY_ROW_GROUP_ROWS.get(table),
                       compression=PARQUET_COMPRESSION)
    (out / SUMMARY_COMPLETE).write_bytes(cache["complete"])
    return out


def _typed(table: str, n: int, **cols) -> pd.DataFrame:
    """A table of ``n`` rows in the schema's column types (scalars repeated; strings of CATEGORICAL columns as
    categoricals; absent nullable columns as typed nulls), so that write_node_tables' conform takes its fast paths
    instead of checking object columns value by value (3/4 of a node's build time at 1,000 steps)."""
    from dtprof.rundir.schema import CATEGORICAL, TABLES

    out = {}
    for col, kind in TABLES[table]:
        v = cols.get(col)
        if v is None and kind == "Int":
            v = pd.arrays.IntegerArray(np.zeros(n, np.int64), np.ones(n, bool))
        elif v is None:
            v = np.full(n, np.nan) if kind == "float" else ""
        if isinstance(v, str) and col in CATEGORICAL:
            v = pd.Categorical.from_codes(np.zeros(n, np.int8), [v])
        out[col] = np.full(n, v) if np.isscalar(v) else v
    return pd.DataFrame(out)


def hand_run(path: Path, spans: list[tuple], colls: list[tuple], steps=((0, 0, 100),), ranks=(0,),
             device_name="cpu", device_type="cpu", groups=None) -> Path:
    """A run from hand-written rows; times in ms. spans: (rank, kind, start, end); colls: (rank, op, seq, start,
    end, bytes, group_size[, group])."""
    create_run_dir(path, {"command": ["hand"]})
    node = path / "node-hand"
    node.mkdir()
    st = pd.DataFrame([{"rank": r, "step": s, "start_ns": a * MS, "end_ns": b * MS} for r, (s, a, b) in
                       ((r, x) for r in ranks for x in steps)])
    sp = pd.DataFrame([{"rank": x[0], "step": 0, "kind": x[1], "name": x[4] if len(x) > 4 else x[1],
                        "start_ns": int(x[2] * MS), "end_ns": int(x[3] * MS), "lane": "main",
                        "source": "kineto" if x[1] == "kernel" else "hook"} for x in spans])
    co = pd.DataFrame([{"rank": c[0], "op": c[1], "seq": c[2], "issue_ns": int(c[3] * MS),
                        "return_ns": int(c[4] * MS), "end_ns": int(c[4] * MS), "in_bytes": c[5], "out_bytes": c[5],
                        "group_size": c[6], "group": c[7] if len(c) > 7 else "0", "api": c[1], "source": "user",
                        "dtype": "float32", "async_op": False} for c in colls])
    rk = pd.DataFrame({"rank": list(ranks), "local_rank": list(ranks), "world_size": len(ranks), "host": "h0",
                       "pid": 1, "device_type": device_type, "device_index": list(ranks),
                       "device_name": device_name, "backend": "gloo"})
    write_node_tables(node, {"ranks": rk, "steps": st, "spans": sp, "collectives": co, "groups": groups},
                      {"host": "h0", "status": "completed", "exit_code": 0})
    return path
