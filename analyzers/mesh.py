"""Hybrid-parallel analysis: communication split by DeviceMesh dimension, pipeline bubble per pipeline group, and
the mesh groups a slow rank belongs to. Pure pandas/numpy (no torch), vectorised; inputs are the run's tables
(``dtprof.rundir.run.open_run``) and, when given, the analyzers' per-rank step DataFrame (``Analysis.steps``).

Where dimensions come from: the rank side (collectors/mesh.py) writes a ``groups`` row with ``mesh_dim`` for the
group each rank has along each DeviceMesh dimension, and a ``meta`` row of kind ``mesh``
(``{"shape": [2, 2], "dims": ["dp", "tp"]}``). A group's dimension is its last non-empty ``mesh_dim``
(docs/run-format.md). Collectives on groups with no
dimension (the world group, groups made outside a mesh) are reported under the dimension ``"(none)"``.

Definitions (docs/metrics.md)
- Communication time of a collective row = ``exit_ns − issue_ns`` (the run model's collectives), as
  the rank experienced it (peers' lateness included). Bytes = the nccl-tests message size ``max(in_bytes,
  out_bytes)``. ``*_per_step`` = mean over (rank, step) pairs of the ranks that have the dimension, steps with no
  traffic in the dimension counting as 0.
- Exposed communication per dimension comes from the step breakdown (analyzers/breakdown.py), which splits each
  exposed instant between the collectives in flight; pipeline p2p on pipeline ranks is bubble there, not exposed.
- ``costliest_dim``: the dimension with the largest exposed communication per step when the breakdown's is
  given, else the largest communication time per step.
- Pipeline bubble ("Pipeline bubble and stage imbalance"): for stage s in step k, 1 − |union of s's pp_forward
  and pp_backward spans in k| ÷ step k's duration; a pipeline group's bubble is the mean over its stages (ranks)
  and steps. Pipeline groups are the groups of the ``pp`` dimension.
- Slow rank: the rank whose compute per step (forward, backward, optimizer, pp_forward, pp_backward spans) is
  largest relative to the median rank ("Stragglers": compare compute, not step time); ``mesh_groups_of_rank``
  names its group in every dimension.

Proposed summary.json block (the integrator wires ``mesh_summary`` into ``summary.json``):

    "mesh": {
      "shape": [2, 2], "dims": ["dp", "tp"],
      "per_dim": [{"dim": "tp", "comm_s_per_step": 0.012, "exposed_comm_s_per_step": 0.011,
                   "bytes_per_step": 32768, "groups": ["3", "4"]}, ...],
      "costliest_dim": "tp"
    }
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from dtprof.rundir.schema import COMPUTE_KINDS

NO_DIM = "(none)"
PP_DIM = "pp"


def group_dims(groups: pd.DataFrame) -> pd.DataFrame:
    """One row per group: group, mesh_dim (last non-empty per group, else NO_DIM), ranks, size."""
    g = groups.assign(group=groups["group"].astype(str), mesh_dim=groups["mesh_dim"].astype("string").fillna(""))
    base = g.drop_duplicates("group", keep="first")[["group", "ranks", "size"]]
    named = g[g["mesh_dim"] != ""].drop_duplicates("group", keep="last")[["group", "mesh_dim"]]
    out = base.merge(named, on="group", how="left")
    out["mesh_dim"] = out["mesh_dim"].fillna(NO_DIM).astype(str)
    out["ranks"] = out["ranks"].astype(str)
    return out.reset_index(drop=True)


def named_dims(groups: pd.DataFrame) -> bool:
    """Whether any group of ``groups`` (the groups table) names a DeviceMesh dimension."""
    return bool(len(groups)) and bool((group_dims(groups)["mesh_dim"] != NO_DIM).any())


def mesh_dim_of(groups: pd.DataFrame, group: pd.Series) -> pd.Series:
    """The mesh dimension of each group named in ``group`` (NO_DIM for groups outside a DeviceMesh)."""
    dims = group_dims(groups) if len(groups) else pd.DataFrame(columns=["group", "mesh_dim"])
    dim_of = dict(zip(dims["group"].astype(str), dims["mesh_dim"].astype(str)))
    g = group if isinstance(group.dtype, pd.CategoricalDtype) else group.astype(str)
    dim = g.map(dim_of)   # on a categorical column this maps its categories only
    return dim.astype(object).where(dim.notna(), NO_DIM)


def mesh_shape(meta: pd.DataFrame | None) -> tuple[list[int], list[str]] | None:
    """(shape, dims) from the first ``mesh`` meta row, or None."""
    if meta is None or meta.empty:
        return None
    for v in meta.loc[meta["kind"].astype(str) == "mesh", "value"]:
        if isinstance(v, dict) and v.get("shape") is not None:
            return [int(x) for x in v["shape"]], [str(d) for d in v.get("dims") or []]
    return None


# per rank, step (-1: none) and group: the communication time (Σ exit_ns - issue_ns) and bytes (Σ max(in, out)) of
# the rank's collectives: rank-local, so a node summary stores its ranks' (``rank_group_comm``) and the dimensions
# are applied by the global analysis
RANK_GROUP_COMM_COLUMNS = ("rank", "step", "group", "comm_ns", "bytes")


def rank_group_comm(collectives: pd.DataFrame) -> pd.DataFrame:
    """RANK_GROUP_COMM_COLUMNS of ``collectives`` (the run model's, with ``exit_ns``), sorted by rank, step, group."""
    c = collectives
    if len(c) == 0:
        return pd.DataFrame({k: pd.Series(dtype=object if k == "group" else "int64") for k in RANK_GROUP_COMM_COLUMNS})
    df = pd.DataFrame({"rank": c["rank"].to_numpy(np.int64), "step": c["step"].astype("Int64").fillna(-1).to_numpy(
        np.int64), "group": c["group"].astype(str).to_numpy(),
        "comm_ns": c["exit_ns"].to_numpy(np.int64) - c["issue_ns"].to_numpy(np.int64),
        "bytes": np.maximum(c["in_bytes"].to_numpy(np.int64), c["out_bytes"].to_numpy(np.int64))})
    return df.groupby(["rank", "step", "group"], sort=True, as_index=False)[["comm_ns", "bytes"]].sum()


def _rank_step_comm(groups: pd.DataFrame, comm: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step, mesh_dim) of ``comm`` (``rank_group_comm``; rows without a step left out): comm_s and
    bytes, sorted by rank, step, mesh_dim."""
    dims = group_dims(groups)[["group", "mesh_dim"]]
    c = comm[comm["step"].to_numpy(np.int64) >= 0].astype({"group": str})
    c = c.merge(dims, on="group", how="left")
    c["mesh_dim"] = c["mesh_dim"].fillna(NO_DIM)
    c["step"] = c["step"].astype("float64")
    out = c.groupby(["rank", "step", "mesh_dim"], sort=True, as_index=False)[["comm_ns", "bytes"]].sum()
    out["comm_s"] = out.pop("comm_ns").astype("float64") / 1e9
    return out


def comm_by_dim(groups: pd.DataFrame, comm: pd.DataFrame, steps: pd.DataFrame | None = None,
                exposed: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per mesh dimension: dim, comm_s_per_step, exposed_comm_s_per_step (NaN without ``exposed``),
    bytes_per_step, groups (sorted list of group names), ranks (count of ranks with traffic in it).

    ``comm``: ``rank_group_comm`` of the run's collectives (its node summaries'). ``steps``: per rank × step (with
    ``measured``: only those rows count); without it every step seen in the collectives counts. ``exposed``: rank,
    step, mesh_dim, exposed_s (breakdown.exposed_by_dim_rank_step)."""
    rs = _rank_step_comm(groups, comm)
    if steps is not None:
        keep = steps if "measured" not in steps else steps[steps["measured"].astype(bool)]
        frame = keep[["rank", "step"]].copy()
        frame["step"] = frame["step"].astype("float64")
    else:
        frame = rs[["rank", "step"]].drop_duplicates()
    # every (rank, step) of the frame × every dimension the rank has traffic in; missing traffic = 0
    rank_dims = rs[["rank", "mesh_dim"]].drop_duplicates()
    grid = frame.merge(rank_dims, on="rank", how="inner")
    grid = grid.merge(rs, on=["rank", "step", "mesh_dim"], how="left").fillna({"comm_s": 0.0, "bytes": 0})
    if exposed is not None:
        ex = exposed.astype({"step": "float64"})[["rank", "step", "mesh_dim", "exposed_s"]]
        grid = grid.merge(ex, on=["rank", "step", "mesh_dim"], how="left").fillna({"exposed_s": 0.0})
    else:
        grid["exposed_s"] = np.nan
    per = grid.groupby("mesh_dim", sort=False).agg(
        comm_s_per_step=("comm_s", "mean"), exposed_comm_s_per_step=("exposed_s", "mean"),
        bytes_per_step=("bytes", "mean"), ranks=("rank", "nunique")).reset_index()
    dims = group_dims(groups)
    used = comm["group"].astype(str).unique()
    names = dims[dims["group"].isin(used)].groupby("mesh_dim")["group"].agg(lambda s: sorted(s.tolist()))
    per["groups"] = per["mesh_dim"].map(names)
    per = per.rename(columns={"mesh_dim": "dim"})
    return per.sort_values("comm_s_per_step", ascending=False, ignore_index=True)


def costliest_dim(per_dim: pd.DataFrame) -> str | None:
    """The mesh dimension (not NO_DIM) costing the most: exposed comm per step if known, else comm per step."""
    named = per_dim[per_dim["dim"] != NO_DIM]
    if named.empty:
        return None
    col = "exposed_comm_s_per_step" if named["exposed_comm_s_per_step"].notna().any() else "comm_s_per_step"
    return str(named.loc[named[col].idxmax(), "dim"])


def _union_s(spans: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """|union of intervals| per ``keys`` (sorted sweep: a span adds what extends past the running end)."""
    s = spans.sort_values(keys + ["start_ns"], kind="stable")
    start, end = s["start_ns"].to_numpy("int64"), s["end_ns"].to_numpy("int64")
    run_end = s.groupby(keys, sort=False)["end_ns"].cummax()
    prev = run_end.groupby([s[k] for k in keys], sort=False).shift(1).to_numpy("float64")
    lo = np.where(np.isnan(prev), start, np.maximum(start, prev))
    s = s.assign(covered_s=np.maximum(end - lo, 0) / 1e9)
    return s.groupby(keys, sort=False, as_index=False)["covered_s"].sum()


def pipeline_bubble_by_group(groups: pd.DataFrame, spans: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per pipeline group (the ``pp`` dimension's groups): group, ranks, stages, steps, bubble_frac,
    bubble_frac_max (worst stage-step), compute_s_per_step, step_s (mean step duration).

    ``steps``: per rank-step rank, step, duration_s (the run model's steps) and, when given, ``measured`` (only
    those rows count)."""
    dims = group_dims(groups)
    pp = dims[dims["mesh_dim"] == PP_DIM]
    cols = ["group", "ranks", "stages", "steps", "bubble_frac", "bubble_frac_max", "compute_s_per_step", "step_s"]
    if pp.empty:
        return pd.DataFrame(columns=cols)
    members = pp.assign(rank=pp["ranks"].str.split(",")).explode("rank")
    members["rank"] = members["rank"].astype("int64")
    st = steps if "measured" not in steps else steps[steps["measured"].astype(bool)]
    st = st[["rank", "step", "duration_s"]].astype({"step": "int64"}).rename(columns={"duration_s": "step_s"})
    sp = spans[spans["kind"].astype(str).isin(["pp_forward", "pp_backward"]) & spans["step"].notna()]
    sp = sp[["rank", "step", "start_ns", "end_ns"]].astype({"step": "int64"})
    covered = _union_s(sp, ["rank", "step"]) if not sp.empty else pd.DataFrame(columns=["rank", "step", "covered_s"])
    per = members[["group", "ranks", "rank"]].merge(st, on="rank").merge(covered, on=["rank", "step"], how="left")
    per["covered_s"] = per["covered_s"].astype("float64").fillna(0.0)
    per["bubble_frac"] = (1.0 - per["covered_s"] / per["step_s"]).clip(lower=0.0)
    out = per.groupby(["group", "ranks"], sort=False).agg(
        stages=("rank", "nunique"), steps=("step", "nunique"), bubble_frac=("bubble_frac", "mean"),
        bubble_frac_max=("bubble_frac", "max"), compute_s_per_step=("covered_s", "mean"),
        step_s=("step_s", "mean")).reset_index()
    return out[cols]


def mesh_groups_of_rank(groups: pd.DataFrame, rank: int) -> dict[str, dict]:
    """{dim: {"group": name, "ranks": [..]}} for every mesh dimension ``rank`` has a group in."""
    dims = group_dims(groups)
    dims = dims[dims["mesh_dim"] != NO_DIM]
    member = ("," + dims["ranks"] + ",").str.contains(f",{int(rank)},", regex=False)
    return {row.mesh_dim: {"group": row.group, "ranks": [int(r) for r in row.ranks.split(",")]}
            for row in dims[member].itertuples()}


def slowest_compute_rank(spans: pd.DataFrame) -> dict | None:
    """The rank with the most compute per step and its ratio to the median rank: {rank, compute_s_per_step,
    ratio_to_median}; None without compute spans."""
    sp = spans[spans["kind"].astype(str).isin(COMPUTE_KINDS) & spans["step"].notna()]
    if sp.empty:
        return None
    covered = _union_s(sp[["rank", "step", "start_ns", "end_ns"]].astype({"step": "int64"}), ["rank", "step"])
    per_rank = covered.groupby("rank")["covered_s"].mean()
    median = float(per_rank.median())
    rank = int(per_rank.idxmax())
    return {"rank": rank, "compute_s_per_step": float(per_rank.max()),
            "ratio_to_median": float(per_rank.max() / median) if median > 0 else float("inf")}


def attribute_slow_rank(groups: pd.DataFrame, spans: pd.DataFrame, rank: int | None = None) -> dict | None:
    """The slow rank (``rank`` if given, e.g. from the stragglers table, else ``slowest_compute_rank``) with its
    group in each mesh dimension: {rank, compute_s_per_step, ratio_to_median, groups: {dim: {group, ranks}}}."""
    found = slowest_compute_rank(spans) or {}
    if rank is not None and found.get("rank") != rank:
        found = {"rank": int(rank)}
    if "rank" not in found:
        return None
    return {**found, "groups": mesh_groups_of_rank(groups, found["rank"])}


def rank_coords(groups: pd.DataFrame) -> dict:
    """Each rank's coordinate along every mesh dimension: its index in its group of that dimension (groups list
    their ranks sorted, which is the mesh order of a mesh laid out in rank order, as ``init_device_mesh`` does):
    ``{"ranks": [sorted ranks], "coords": {dim: [coordinate per rank, -1 where it has no group in dim]}}``. The
    report groups ranks by these beyond a few hundred ranks (reports/rankgroups.py)."""
    dims = group_dims(groups)
    dims = dims[dims["mesh_dim"] != NO_DIM]
    members = dims.assign(rank=dims["ranks"].str.split(",")).explode("rank")
    members["rank"] = members["rank"].astype("int64")
    members["coord"] = members.groupby("group", sort=False).cumcount()
    ranks = np.sort(members["rank"].unique())
    coords = {}
    for dim, m in members.groupby("mesh_dim", sort=False):
        c = m.drop_duplicates("rank").set_index("rank")["coord"].reindex(ranks).fillna(-1).astype(int)
        coords[str(dim)] = c.tolist()
    return {"ranks": ranks.tolist(), "coords": coords}


def mesh_summary(groups: pd.DataFrame, comm: pd.DataFrame, steps: pd.DataFrame | None = None,
                 meta: pd.DataFrame | None = None, exposed: pd.DataFrame | None = None) -> dict | None:
    """The proposed ``summary.json`` ``mesh`` block (module docstring); None when the run has no mesh dims.
    ``comm``: ``rank_group_comm`` of the run's collectives."""
    per = comm_by_dim(groups, comm, steps, exposed)
    if (per["dim"] != NO_DIM).sum() == 0:
        return None
    found = mesh_shape(meta)
    shape, dims = found if found else ([], [d for d in per["dim"] if d != NO_DIM])

    def num(x):
        return None if pd.isna(x) else float(x)

    return {
        "shape": shape, "dims": dims,
        "per_dim": [{"dim": r.dim, "comm_s_per_step": num(r.comm_s_per_step),
                     "exposed_comm_s_per_step": num(r.exposed_comm_s_per_step),
                     "bytes_per_step": num(r.bytes_per_step), "groups": list(r.groups or [])}
                    for r in per.itertuples()],
        "costliest_dim": costliest_dim(per),
        "rank_coords": rank_coords(groups),
    }
