"""Pipelines recognised by what ranks do (analyzers/pipeinfer.py, issue 47): a GPipe run recorded without schedule
hooks -- plain forward and backward spans, point-to-point send/recv with their peer, no schedule meta row -- reads
as the same run recorded by torch.distributed.pipelining's hooks: the same stages, micro-batches, bubble and its
theory, imbalance, bottleneck stage, breakdown and balanced-stages what-if."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dtprof.analyzers.options import AnalysisOptions
from dtprof.analyzers.summary import analyze
from synth import build_run


def _with_p2p(path, stages=3, microbatches=4, hooks=True):
    """synth.py's GPipe run with each activation and gradient exchanged as a send/recv pair (the receiver's recv
    posted when the sender's op ends, returning when its own op starts); ``hooks=False``: its pp spans turned into
    the plain forward/backward spans a rank without schedule hooks records, and no schedule meta row."""
    build_run(path, world_size=stages, steps=6, pipeline_stages=stages, microbatches=microbatches, p2p_ms=1.0,
              fwd_ms=10.0, bwd_ms=20.0)
    tables = path / "node-synthetic" / "tables"
    sp = pd.read_parquet(tables / "spans.parquet")
    pp = sp[sp["kind"].isin(["pp_forward", "pp_backward"])]
    rows, seq = [], {}
    for r in pp.itertuples():
        to = r.stage + (1 if r.kind == "pp_forward" else -1)
        if not 0 <= to < stages:
            continue
        peer_op = sp[(sp["rank"] == to) & (sp["step"] == r.step) & (sp["kind"] == r.kind)
                     & (sp["microbatch"] == r.microbatch)].iloc[0]
        for rank, op, peer, t0, t1 in ((r.rank, "send", to, r.end_ns, r.end_ns + 10_000),
                                       (to, "recv", r.rank, r.end_ns, peer_op.start_ns)):
            n = seq.setdefault((rank, op, peer), 0)
            seq[(rank, op, peer)] = n + 1
            rows.append({"rank": rank, "step": r.step, "op": op, "api": op, "source": "user", "group": "0",
                         "group_size": stages, "seq": n, "in_bytes": 4096, "out_bytes": 4096, "dtype": "float32",
                         "peer": peer, "async_op": False, "issue_ns": t0, "return_ns": t1, "end_ns": t1})
    pd.DataFrame(rows).to_parquet(tables / "collectives.parquet", index=False)
    if not hooks:
        sp["kind"] = sp["kind"].astype(str).replace({"pp_forward": "forward", "pp_backward": "backward"})
        sp.loc[sp["kind"].isin(["forward", "backward"]), ["stage", "microbatch"]] = np.nan
        sp.to_parquet(tables / "spans.parquet", index=False)
        (tables / "meta.parquet").unlink()
    return path


KEYS = ("stages", "microbatches", "bubble_frac", "theoretical_bubble_frac", "overhead_frac", "imbalance",
        "bottleneck_stage", "replicas")


@pytest.mark.parametrize("stages", [2, 3])
def test_pipeline_without_schedule_hooks_reads_as_with_them(tmp_path, stages):
    opts = AnalysisOptions(warmup=0)
    hooked = analyze(_with_p2p(tmp_path / "hooked", stages), opts).summary
    plain = analyze(_with_p2p(tmp_path / "plain", stages, hooks=False), opts).summary
    assert hooked["pipeline"] and plain["pipeline"], plain.get("pipeline_reason")
    for k in KEYS:
        assert plain["pipeline"][k] == pytest.approx(hooked["pipeline"][k], rel=1e-9), k
    assert plain["pipeline"]["schedule"] == "unknown"   # nothing recorded its name
    assert [s["stage"] for s in plain["pipeline"]["per_stage"]] == list(range(stages))
    assert plain["breakdown"]["pipeline_ranks"] == list(range(stages))
    for a, b in zip(hooked["ranks"], plain["ranks"]):
        assert a["breakdown_s_per_step"] == pytest.approx(b["breakdown_s_per_step"], rel=1e-9, abs=1e-12)
    bal = {w["scenario"]: w["predicted_step_s"] for w in plain["what_if"]}
    assert bal["balanced_stages"] == pytest.approx(
        next(w["predicted_step_s"] for w in hooked["what_if"] if w["scenario"] == "balanced_stages"), rel=1e-9)


def test_several_forwards_without_point_to_point_are_not_a_pipeline(tmp_path):
    # gradient accumulation: four forwards a step, an all-reduce, no send/recv
    run = build_run(tmp_path / "ddp", world_size=2, steps=6)
    tables = run / "node-synthetic" / "tables"
    sp = pd.read_parquet(tables / "spans.parquet")
    fwd = sp[sp["kind"] == "forward"]
    sp = pd.concat([sp] + [fwd.assign(start_ns=fwd["start_ns"] + k, end_ns=fwd["end_ns"] + k) for k in (1, 2)],
                   ignore_index=True)
    sp.to_parquet(tables / "spans.parquet", index=False)
    s = analyze(run, AnalysisOptions(warmup=0)).summary
    assert s["pipeline"] is None and s["breakdown"]["pipeline_ranks"] == []
