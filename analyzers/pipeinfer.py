"""Pipelines recognised by what ranks do (docs/metrics.md, "Pipelines recognised by what ranks do", dtprof).

``torch.distributed.pipelining`` is recorded as ``pp_forward``/``pp_backward`` spans by its schedule's hooks. Engines
that run their own schedule (DeepSpeed's PipelineEngine, Megatron-core's schedules, a hand-written loop) leave
only what every rank leaves: ``forward`` spans (the top-level module's forward, once per micro-batch),
``backward`` spans (``torch.autograd.backward``) and point-to-point ``send``/``recv`` records with their peer
(``send``/``recv``, ``isend``/``irecv``, ``batch_isend_irecv``). A rank is a pipeline stage when, in at least half
of its steps that run several forwards, it also exchanges point-to-point with a peer; its forward and backward
spans then become ``pp_forward``/``pp_backward`` spans (named ``inferred_forward``/``inferred_backward``) with:

- ``microbatch``: the k-th forward (backward) of the rank in a step is micro-batch k (GPipe and 1F1B run the
  backwards in the forwards' order);
- ``stage``: 0 for a rank that receives nothing before its forwards; else its upstream peer's stage + 1, the
  upstream peer being the one whose ``recv`` most often comes right before one of its forwards (activations; a
  ``recv`` right before a backward brings gradients from downstream). Stages are numbered along that chain among
  the ranks analysed together (in a node summary of a pipeline spread over nodes, a chain that leaves the node is
  numbered as if the first peer outside were stage 0).

Everything downstream (the breakdown's bubble, the pipeline analyzer's bubble, theory, imbalance and bottleneck,
the what-if's balanced stages) then reads these spans as it reads torch pipelining's. Ranks that already have
``pp_*`` spans are left as they are. ``RunModel`` applies this to the spans it serves (analyzers/runmodel.py), so
it is derived in one place.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from dtprof.rundir.schema import P2P_OPS

PP_KINDS = ("pp_forward", "pp_backward")
INFERRED = {"forward": ("pp_forward", "inferred_forward"), "backward": ("pp_backward", "inferred_backward")}


def may_hold_pipeline(spans: pd.DataFrame) -> bool:
    """Cheap test on the spans alone: some rank runs several forwards in one step and has no pp spans."""
    if not len(spans):
        return False
    kind = spans["kind"].astype(str).to_numpy()
    fwd = (kind == "forward") & spans["step"].notna().to_numpy()
    if not fwd.any():
        return False
    r, s = spans["rank"].to_numpy(np.int64)[fwd], spans["step"].astype("Int64").to_numpy(np.int64, na_value=-1)[fwd]
    _, counts = np.unique(np.stack([r, s]), axis=1, return_counts=True)
    return bool((counts >= 2).any())


def stages(spans: pd.DataFrame, collectives: pd.DataFrame) -> dict[int, int]:
    """rank -> stage of the ranks recognised as pipeline stages (module docstring); empty when none."""
    kind = spans["kind"].astype(str).to_numpy()
    rank = spans["rank"].to_numpy(np.int64)
    step = spans["step"].astype("Int64").to_numpy(np.int64, na_value=-1)
    has_pp = set(np.unique(rank[np.isin(kind, PP_KINDS)]).tolist())
    fwd = (kind == "forward") & (step >= 0) & ~np.isin(rank, list(has_pp))
    if not fwd.any() or not len(collectives):
        return {}
    per = pd.Series(1, index=pd.MultiIndex.from_arrays([rank[fwd], step[fwd]])).groupby(level=[0, 1]).size()
    multi = per[per >= 2]
    if multi.empty:
        return {}
    co = collectives
    p2p = co[co["op"].astype(str).isin(P2P_OPS).to_numpy() & co["peer"].notna().to_numpy()
             & co["rank"].isin(multi.index.get_level_values(0).unique()).to_numpy()]
    if p2p.empty:
        return {}
    p_rank = p2p["rank"].to_numpy(np.int64)
    p_step = p2p["step"].astype("Int64").to_numpy(np.int64, na_value=-1)
    with_p2p = set(zip(p_rank.tolist(), p_step.tolist()))
    hits = pd.Series([(r, s) in with_p2p for r, s in multi.index], index=multi.index)
    share = hits.groupby(level=0).mean()
    ranks = sorted(int(r) for r in share.index[share >= 0.5])
    if not ranks:
        return {}
    # each recv's next compute span on its rank: a forward after it means the peer sent activations (upstream)
    comp = np.isin(kind, ("forward", "backward")) & np.isin(rank, ranks)
    nxt = pd.DataFrame({"rank": rank[comp], "t": spans["start_ns"].to_numpy(np.int64)[comp], "next": kind[comp]})
    recv = p2p[(p2p["op"].astype(str) == "recv").to_numpy() & np.isin(p_rank, ranks)]
    rv = pd.DataFrame({"rank": recv["rank"].to_numpy(np.int64), "t": recv["issue_ns"].to_numpy(np.int64),
                       "peer": recv["peer"].astype("Int64").to_numpy(np.int64)})
    joined = pd.merge_asof(rv.sort_values("t"), nxt.sort_values("t"), on="t", by="rank", direction="forward")
    acts = joined[joined["next"] == "forward"]
    upstream = acts.groupby("rank")["peer"].agg(lambda p: int(p.mode().iloc[0])).to_dict() if len(acts) else {}
    out: dict[int, int] = {}
    for r in ranks:
        hops, cur, seen = 0, r, {r}
        while cur in upstream and upstream[cur] not in seen:
            cur = upstream[cur]
            seen.add(cur)
            hops += 1
        out[r] = hops
    return out


def with_pipeline_spans(spans: pd.DataFrame, collectives: pd.DataFrame) -> pd.DataFrame:
    """``spans`` with the forward and backward spans of the ranks recognised as pipeline stages turned into
    ``pp_forward``/``pp_backward`` spans with their stage and micro-batch (module docstring); unchanged when none."""
    st = stages(spans, collectives)
    if not st:
        return spans
    kind = spans["kind"].astype(str).to_numpy()
    rank = spans["rank"].to_numpy(np.int64)
    step = spans["step"].astype("Int64").to_numpy(np.int64, na_value=-1)
    pick = np.isin(kind, list(INFERRED)) & np.isin(rank, list(st)) & (step >= 0)
    idx = np.flatnonzero(pick)
    order = idx[np.lexsort((spans["start_ns"].to_numpy(np.int64)[idx], kind[idx], step[idx], rank[idx]))]
    key = pd.DataFrame({"r": rank[order], "s": step[order], "k": kind[order]})
    micro = key.groupby(["r", "s", "k"], sort=False).cumcount().to_numpy(np.int64)
    new_kind = kind.astype(object)
    names = spans["name"].astype(str).to_numpy(dtype=object)
    for k, (pp_kind, name) in INFERRED.items():
        m = pick & (kind == k)
        new_kind[m] = pp_kind
        names[m] = name
    stage = spans["stage"].astype("Int64").copy()
    mb = spans["microbatch"].astype("Int64").copy()
    stage.iloc[idx] = [st[int(r)] for r in rank[idx]]
    mb.iloc[order] = micro
    out = spans.copy(deep=False)
    out["kind"] = pd.Categorical(new_kind) if isinstance(spans["kind"].dtype, pd.CategoricalDtype) else new_kind
    out["name"] = pd.Categorical(names) if isinstance(spans["name"].dtype, pd.CategoricalDtype) else names
    out["stage"], out["microbatch"] = stage, mb
    return out
