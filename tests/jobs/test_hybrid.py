"""Hybrid parallelism (issue 8): real 4-rank torchrun jobs (gloo, CPU) of examples/train_hybrid.py under
`dtprof run`, checked the way a user would: every tensor-parallel collective is recorded on both ranks of its TP
group with equal bytes, DP and TP traffic are split by mesh dimension with the bytes the model's shapes imply,
DP×PP reports a bubble per pipeline group, and a slowed rank is attributed to its DP and PP groups.
Plus fast checks of the analyzer on hand-made tables and of the op proxy's transparency."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import REPO, record
from dtprof.analyzers import mesh as M
from dtprof.analyzers.runmodel import RunModel, with_exit
from scale_checks import assert_summaries_equal_raw

SIZES = dict(batch=2, seq=16, dim=32, layers=2, vocab=256, steps=3)
SLOW_RANK, SLOW_MS = 1, 300


def _dtprof_run(out: Path, mode: str, *extra: str):
    s = SIZES
    p = record(out, "train_hybrid.py", "--mode", mode, "--steps", s["steps"], "--seq", s["seq"], "--dim", s["dim"],
               "--layers", s["layers"], "--vocab", s["vocab"], *extra, nproc=4)
    losses = [float(line.split()[-1]) for line in p.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == s["steps"]
    from dtprof.reader import open_run

    return open_run(out)


def _measured_steps(run):
    """The steps table with step 0 (set-up collectives, pipeline shape inference) marked as warm-up."""
    return run.steps.assign(warmup=run.steps["step"] == 0, measured=run.steps["step"] != 0,
                            duration_s=(run.steps["end_ns"] - run.steps["start_ns"]) / 1e9)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    return _dtprof_run(tmp_path_factory.mktemp("tp") / "run", "tp_dp", "--batch", str(SIZES["batch"]))


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory):
    return _dtprof_run(tmp_path_factory.mktemp("pp") / "run", "dp_pp", "--batch", "4", "--microbatches", "4",
                       "--slow-rank", str(SLOW_RANK), "--slow-ms", str(SLOW_MS))


def _local_param_bytes_tp(tp: int) -> int:
    """Bytes of one TP rank's parameters: the TP plan shards qkv/mlp.0 (Colwise: weight and bias rows) and
    proj/mlp.2 (Rowwise: weight columns, bias replicated); everything else is replicated."""
    import torch  # noqa: F401  (the model module needs it)

    sys.path.insert(0, str(REPO / "examples"))
    from model import TinyLM

    s = SIZES
    m = TinyLM(s["vocab"], s["dim"], s["layers"], seq=s["seq"])
    total = 0
    for name, p in m.named_parameters():
        parts = name.split(".")
        sub, leaf = ".".join(parts[2:-1]), parts[-1]
        sharded = parts[0] == "blocks" and (sub in ("qkv", "mlp.0") or (sub in ("proj", "mlp.2") and leaf == "weight"))
        total += p.numel() // tp if sharded else p.numel()
    return total * 4   # float32


@pytest.mark.slow
def test_mesh_dims_named_and_announced(tp_run, pp_run):
    for run, second, second_groups in ((tp_run, "tp", {"0,1", "2,3"}), (pp_run, "pp", {"0,1", "2,3"})):
        dims = M.group_dims(run.groups)
        assert set(dims.loc[dims.mesh_dim == "dp", "ranks"]) == {"0,2", "1,3"}
        assert set(dims.loc[dims.mesh_dim == second, "ranks"]) == second_groups
        assert (run.meta["kind"].astype(str) == "mesh").sum() == 4   # one per rank
        assert M.mesh_shape(run.meta) == ([2, 2], ["dp", second])


@pytest.mark.slow
def test_every_tp_collective_matched_across_its_group(tp_run):
    c = tp_run.collectives
    f = c[c["source"].astype(str) == "functional"]
    tp_groups = M.group_dims(tp_run.groups).query("mesh_dim == 'tp'")["group"]
    assert len(f) and set(f["group"].astype(str)) <= set(tp_groups)
    inst = f.groupby(["group", "seq"], observed=True).agg(
        ranks=("rank", "nunique"), size=("group_size", "first"), bytes=("in_bytes", "nunique"),
        ops=("op", "nunique"), out=("out_bytes", "nunique"))
    assert (inst["ranks"] == inst["size"]).all() and (inst["size"] == 2).all()
    assert (inst["bytes"] == 1).all() and (inst["ops"] == 1).all() and (inst["out"] == 1).all()
    assert f["end_ns"].notna().all()
    assert ((f["issue_ns"] <= f["return_ns"]) & (f["return_ns"] <= f["end_ns"].astype("int64"))).all()
    # RowwiseParallel all-reduces its output in forward (proj, mlp.2), ColwiseParallel its input's gradient in
    # backward (qkv, mlp.0): 4 all-reduces of one activation (batch x seq x dim float32) per block per step.
    s = SIZES
    per_rank_step = f.groupby(["rank", "step"]).agg(n=("seq", "size"), b=("in_bytes", "unique"))
    assert (per_rank_step["n"] == 4 * s["layers"]).all()
    assert set(f["op"].astype(str)) == {"all_reduce"}
    assert set(f["in_bytes"]) == {s["batch"] * s["seq"] * s["dim"] * 4}
    # each wait_tensor that completed a collective is a comm_wait span
    waits = tp_run.spans[(tp_run.spans["kind"].astype(str) == "comm_wait")
                         & (tp_run.spans["name"].astype(str) == "wait_tensor")]
    assert len(waits) == len(f)


@pytest.mark.slow
def test_dp_and_tp_traffic_split_with_model_bytes(tp_run):
    s = SIZES
    per = M.comm_by_dim(tp_run.groups, M.rank_group_comm(RunModel.of(tp_run).collectives),
                        _measured_steps(tp_run)).set_index("dim")
    assert set(per.index) == {"dp", "tp"}
    assert per.loc["tp", "bytes_per_step"] == 4 * s["layers"] * s["batch"] * s["seq"] * s["dim"] * 4
    assert per.loc["dp", "bytes_per_step"] == _local_param_bytes_tp(tp=2)
    assert (per["comm_s_per_step"] > 0).all()
    summary = M.mesh_summary(tp_run.groups, M.rank_group_comm(RunModel.of(tp_run).collectives),
                             _measured_steps(tp_run), tp_run.meta)
    assert summary["shape"] == [2, 2] and summary["dims"] == ["dp", "tp"]
    assert summary["costliest_dim"] == max(summary["per_dim"], key=lambda d: d["comm_s_per_step"])["dim"]
    assert sorted(d["dim"] for d in summary["per_dim"]) == ["dp", "tp"]


@pytest.mark.slow
def test_dp_pp_bubble_per_pipeline_group_and_slow_rank(pp_run):
    steps = _measured_steps(pp_run)
    bubble = M.pipeline_bubble_by_group(pp_run.groups, pp_run.spans, steps).set_index("ranks")
    assert set(bubble.index) == {"0,1", "2,3"}
    assert (bubble["stages"] == 2).all() and (bubble["steps"] == SIZES["steps"] - 1).all()
    assert ((bubble["bubble_frac"] > 0) & (bubble["bubble_frac"] < 1)).all()
    # the slowed rank computes SLOW_MS more per step than its DP peer on the same stage (same work): the job's own
    # sleep. Each group's compute is the mean over its stages' ranks, so the slowed group computes more; not by a
    # fixed share of SLOW_MS on a busy machine, where each rank's wall-clock compute stretches with its
    # preemption and the other group has two ranks computing where the slowed one has one (0.037-0.077 s of the
    # 0.1 s it had at load ~20, where the rank-level difference still holds)
    sp = pp_run.spans[pp_run.spans["kind"].astype(str).isin(["pp_forward", "pp_backward"])]
    sp = sp[sp["step"].isin(steps.loc[steps["measured"], "step"])]
    per_rank = ((sp["end_ns"] - sp["start_ns"]) / 1e9).groupby(sp["rank"]).sum() / (SIZES["steps"] - 1)
    peer = 3    # stage 1 of the other pipeline group, the slowed rank's DP peer
    assert per_rank[SLOW_RANK] - per_rank[peer] > 0.8 * SLOW_MS / 1000, per_rank.to_dict()
    extra = bubble.loc["0,1", "compute_s_per_step"] - bubble.loc["2,3", "compute_s_per_step"]
    assert extra > 0, (bubble, per_rank.to_dict())
    assert extra == pytest.approx((per_rank[0] + per_rank[1] - per_rank[2] - per_rank[3]) / 2, abs=1e-3)
    slow = M.attribute_slow_rank(pp_run.groups, pp_run.spans)
    assert slow["rank"] == SLOW_RANK and slow["ratio_to_median"] > 2
    assert slow["groups"]["pp"]["ranks"] == [0, 1] and slow["groups"]["dp"]["ranks"] == [1, 3]
    # DP traffic: one all-reduce of the stage's gradients; PP traffic: activations and their gradients
    per = M.comm_by_dim(pp_run.groups, M.rank_group_comm(RunModel.of(pp_run).collectives), steps).set_index("dim")
    assert set(per.index) == {"dp", "pp"}
    pp_rows = pp_run.collectives[pp_run.collectives["op"].astype(str).isin(["send", "recv"])]
    pp_groups = set(M.group_dims(pp_run.groups).query("mesh_dim == 'pp'")["group"])
    assert set(pp_rows["group"].astype(str)) <= pp_groups
    act = 1 * SIZES["seq"] * SIZES["dim"] * 4     # one microbatch (batch 4 / 4) of activations
    measured = pp_rows[pp_rows["step"] > 0]
    assert set(np.maximum(measured["in_bytes"], measured["out_bytes"])) == {act}


def test_summary_json_splits_by_mesh_dim(tp_run, pp_run):
    """What `dtprof run` wrote: summary.json says which dimension costs the most, the bubble per pipeline group,
    and the slowed rank's DP and PP groups beside its straggler entry."""
    import json

    tp = json.loads((tp_run.path / "summary.json").read_text())["mesh"]
    assert tp["dims"] == ["dp", "tp"] and {d["dim"] for d in tp["per_dim"]} == {"dp", "tp"}
    assert tp["costliest_dim"] in ("dp", "tp") and tp["pipeline_groups"] == []
    pp = json.loads((pp_run.path / "summary.json").read_text())
    groups = {tuple(g["ranks"]): g for g in pp["mesh"]["pipeline_groups"]}
    assert set(groups) == {(0, 1), (2, 3)} and all(0 < g["bubble_frac"] < 1 for g in groups.values())
    slow = [s for s in pp["stragglers"] if s["rank"] == SLOW_RANK]
    assert slow and slow[0]["mesh_groups"]["pp"]["ranks"] == [0, 1] and slow[0]["mesh_groups"]["dp"]["ranks"] == [1, 3]
    # and the report shows the split (its browser checks are in test_report.py)
    from dtprof.options import open_and_analyze
    from dtprof.report import save_report

    page = save_report(open_and_analyze(pp_run.path)[1]).read_text()
    section = page[page.index('<section id="mesh">'):]
    section = section[:section.index("</section>")]
    assert f"costliest dimension is <b>{pp['mesh']['costliest_dim']}</b>" in section
    assert "Pipeline groups" in section and "<td class=\"t\">0, 1</td>" in section


@pytest.mark.slow
def test_hybrid_breakdown_adds_up_and_names_each_dimension(tp_run, pp_run):
    """Issue 13 on both hybrid jobs: each rank's parts sum to its step; DP×PP's pipeline p2p waits are bubble, so
    its exposed communication is DP's all-reduce only, and no finding about it advises DDP buckets for pp; TP×DP
    exposes tensor-parallel all-reduces under tp; every collectives row names its dimension."""
    from breakdown_checks import assert_breakdown_adds_up

    tp = assert_breakdown_adds_up(tp_run.path)
    assert set(tp["breakdown"]["exposed_comm_by_dim_s_per_step"]) <= {"dp", "tp"}
    assert tp["breakdown"]["exposed_comm_by_dim_s_per_step"].get("tp", 0) > 0
    assert {c["mesh_dim"] for c in tp["collectives"]} == {"dp", "tp"}
    pp = assert_breakdown_adds_up(pp_run.path)
    assert pp["breakdown"]["pipeline_ranks"] == [0, 1, 2, 3]
    for r in pp["ranks"]:
        assert r["breakdown_s_per_step"]["bubble"] > 0
        assert set(r["exposed_comm_s_per_step_by_dim"]) <= {"dp"}, r["exposed_comm_s_per_step_by_dim"]
    assert {c["mesh_dim"] for c in pp["collectives"]} == {"dp", "pp"}
    # the mesh table's exposed communication per dimension is the breakdown's: pp's waits are bubble there too
    per_dim = {d["dim"]: d for d in pp["mesh"]["per_dim"]}
    assert per_dim["pp"]["exposed_comm_s_per_step"] == 0
    for f in pp["findings"]:
        if f["id"] == "exposed_comm":
            assert f["dim"] == "dp" and "bucket_cap_mb" in f["recommendation"]
        if f["id"] in ("pipeline_bubble", "pipeline_overhead"):
            assert f["part"] == "bubble" and f["dim"] == "pp" and "bucket" not in f["recommendation"]


# ---- fast checks (no jobs) ---------------------------------------------------------------------------------

def _groups(rows):
    return pd.DataFrame(rows, columns=["rank", "group", "ranks", "size", "backend", "desc", "mesh_dim"])


def test_analyzer_on_hand_made_tables():
    groups = _groups([(0, "1", "0,1", 2, "gloo", "", ""), (0, "1", "0,1", 2, "gloo", "", "pp"),
                      (1, "1", "0,1", 2, "gloo", "", "pp"), (0, "0", "0,1", 2, "gloo", "", "")])
    ms = 1_000_000
    coll = pd.DataFrame({
        "rank": [0, 0, 1], "step": [0, 0, 0], "group": ["1", "0", "1"], "issue_ns": [0, 10 * ms, 0],
        "return_ns": [5 * ms, 30 * ms, 5 * ms], "end_ns": pd.array([None, 40 * ms, 10 * ms], dtype="Int64"),
        "in_bytes": [8, 100, 0], "out_bytes": [0, 100, 8]})
    coll = with_exit(coll)
    steps = pd.DataFrame({"rank": [0, 1], "step": [0, 0], "start_ns": [0, 0], "end_ns": [100 * ms, 100 * ms],
                          "duration_s": [0.1, 0.1]})
    exposed = pd.DataFrame({"rank": [0, 0], "step": [0, 0], "mesh_dim": ["pp", M.NO_DIM], "exposed_s": [0.005, 0.03]})
    per = M.comm_by_dim(groups, M.rank_group_comm(coll), steps, exposed).set_index("dim")
    # rank 0: pp 5 ms (no end seen: return used), (none) 30 ms; rank 1: pp 10 ms
    assert per.loc["pp", "comm_s_per_step"] == pytest.approx((0.005 + 0.010) / 2)
    assert per.loc[M.NO_DIM, "comm_s_per_step"] == pytest.approx(0.030)
    # exposed per dimension is the breakdown's, averaged over the rank-steps of ranks with traffic in it
    assert per.loc["pp", "exposed_comm_s_per_step"] == pytest.approx((0.005 + 0.0) / 2)
    assert per.loc["pp", "bytes_per_step"] == 8
    assert M.costliest_dim(per.reset_index()) == "pp"
    spans = pd.DataFrame({"rank": [0, 0, 0, 1], "step": pd.array([0, 0, 0, 0], dtype="Int64"),
                          "kind": ["pp_forward", "pp_forward", "pp_backward", "pp_forward"],
                          "start_ns": [0, 10 * ms, 50 * ms, 0], "end_ns": [20 * ms, 30 * ms, 60 * ms, 50 * ms]})
    b = M.pipeline_bubble_by_group(groups, spans, steps).iloc[0]
    # rank 0 covers [0,30] + [50,60] = 40 ms of 100 -> 0.6; rank 1 covers 50 ms -> 0.5
    assert b["bubble_frac"] == pytest.approx((0.6 + 0.5) / 2) and b["stages"] == 2
    assert M.mesh_groups_of_rank(groups, 1) == {"pp": {"group": "1", "ranks": [0, 1]}}
    assert M.mesh_summary(groups.assign(mesh_dim=""), M.rank_group_comm(coll)) is None


def test_rank_coordinates_along_each_mesh_dimension():
    # a 2 (dp) x 2 (tp) mesh laid out in rank order: tp groups {0,1} {2,3}, dp groups {0,2} {1,3}; rank 4 is in
    # no mesh (only the world group)
    rows = [(r, "0", "0,1,2,3,4", 5, "gloo", "", "") for r in range(5)]
    rows += [(r, g, rk, 2, "gloo", "", dim) for dim, g, rk, members in
             (("tp", "1", "0,1", (0, 1)), ("tp", "2", "2,3", (2, 3)), ("dp", "3", "0,2", (0, 2)),
              ("dp", "4", "1,3", (1, 3))) for r in members]
    coords = M.rank_coords(_groups(rows))
    assert coords == {"ranks": [0, 1, 2, 3], "coords": {"tp": [0, 1, 0, 1], "dp": [0, 0, 1, 1]}}


def test_op_proxy_is_transparent():
    torch = pytest.importorskip("torch")
    from dtprof.collectors import hooks_functional
    from dtprof.collectors.runtime import Recorder

    ns = torch.ops._c10d_functional
    packet = ns.all_reduce
    hooks = hooks_functional.FunctionalHooks(Recorder(), None)
    hooks.install_functional()
    try:
        proxy = ns.all_reduce
        assert isinstance(proxy, hooks_functional._OpProxy)
        assert proxy.default is packet.default                 # code holding overloads is unaffected
        assert proxy == packet and hash(proxy) == hash(packet)  # dicts keyed by packets (CommDebugMode) still match
        assert {packet: 1}.get(proxy) == 1
        assert isinstance(ns.wait_tensor, hooks_functional._OpProxy)
    finally:
        hooks.remove()
    assert ns.all_reduce is packet                             # remove() puts torch's packets back


def test_hybrid_runs_analysed_from_node_summaries_equal_raw(tp_run, pp_run):
    """TP x DP and DP x PP on a DeviceMesh: the analysis from the launcher's node summaries equals the one from the
    raw tables field by field (docs/scale.md), mesh block and pipeline groups included."""
    for run in (tp_run, pp_run):
        s = assert_summaries_equal_raw(run.path)
        assert s["mesh"] is not None
