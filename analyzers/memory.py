"""The memory ledger per rank (docs/metrics.md "Memory ledger"; summary.json ``memory.ranks``). No torch.

From the ``memory`` table (collectors/memory.py: one row per rank and sampled step), the ranks table and, on GPUs,
the NVML samples. Per rank:

- ``params_bytes``, ``grads_bytes``, ``optimizer_state_bytes``: its last row's counts (the tensors it holds, each
  storage once, a shard as its local bytes); ``persistent_bytes`` their sum.
- ``activations_bytes``: what the forward left for backward, over the rank's rows (the largest on a GPU, the median
  on a CPU, whose heap also holds other threads' passing allocations) of the allocator's in-use bytes at backward's
  start less the tensors that persist then (parameters, optimizer state, the grads present) and less the
  allocator's bytes that were no counted tensor at the previous sampled optimizer step (its in-use bytes less
  params, grads and optimizer state: on a CPU the interpreter's and libraries' own heap): activations saved for
  backward, the batch and the outputs.
- ``peak_bytes``: on a GPU the caching allocator's peak allocated bytes, the largest over the rows; on a CPU (no
  allocator peak) the largest tensor bytes read at backward's start or at the optimizer step (in-use bytes less that
  same non-tensor base), with ``peak_source`` saying which.
- ``activations_peak_bytes``: ``peak_bytes`` less the persistent bytes (activations and temporaries at the peak).
- GPU: ``reserved_peak_bytes``; ``fragmentation_bytes`` = reserved − allocated at the peak (the row of the largest
  peak: its reserved peak less its allocated peak); ``alloc_retries`` and ``ooms`` (the allocator's cumulative counts
  at the last row); ``non_pytorch_bytes`` = NVML's largest used memory of the rank's GPU less the reserved peak (CUDA
  context, NCCL buffers, other processes on that GPU).
- GPU, by phase: ``forward_activations_peak_bytes``, ``backward_activations_peak_bytes``,
  ``optimizer_activations_peak_bytes``: the allocator's peak by the end of that phase (read at backward's start, at
  the optimizer step's start and at the step's end) less what persists then (params, optimizer state, the grads
  present), at the row of the largest peak among those with the phase readings; ``peak_phase``: the phase whose
  peak is the step's.
- ``params_full_bytes``, ``optimizer_shard_frac``: the last row's (which categories a ZeRO lever can still shard);
  ``kept_unsharded_bytes``, ``kept_unsharded_max_bytes``: the last row's (FSDP2 groups not resharded after forward).
- ``other_bytes``: the allocator's in-use bytes at the last sampled optimizer step less params, grads and optimizer
  state: what the rank keeps besides its model states between steps (tensors the loop keeps, caches; on a CPU also
  the interpreter's and libraries' own heap).
- ``rss_peak_bytes``: the process's resident high-water mark; ``device_mem_total_bytes``, ``headroom_bytes`` =
  device memory − (reserved peak + non-PyTorch bytes) on a GPU, null on a CPU.

Imbalance (``imbalance``): ranks that the layout says hold the same bytes (peers: the ranks of one pipeline stage, or
every rank without a pipeline: data-parallel replicas, ZeRO/FSDP and tensor-parallel shards hold equal shares) are
compared category by category with the median of their peers; a rank holding more than ``IMBALANCE_FRAC`` of its
peers' bytes and at least ``IMBALANCE_MIN_BYTES`` more is named, with the category that holds the excess and its
likely cause (``IMBALANCE_CAUSES``). Between pipeline stages the model states differ by design; their activations
are set against the micro-batches each stage keeps in flight.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

RANK_KEYS = ("rank", "params_bytes", "grads_bytes", "optimizer_state_bytes", "persistent_bytes", "activations_bytes",
             "other_bytes", "activations_peak_bytes", "peak_bytes", "peak_source", "rss_peak_bytes",
             "reserved_peak_bytes", "fragmentation_bytes", "non_pytorch_bytes", "alloc_retries", "ooms",
             "device_mem_total_bytes", "headroom_bytes", "rows", "params_full_bytes", "optimizer_shard_frac",
             "forward_activations_peak_bytes", "backward_activations_peak_bytes", "optimizer_activations_peak_bytes",
             "peak_phase", "kept_unsharded_bytes", "kept_unsharded_max_bytes")
PHASES = ("forward", "backward", "optimizer")
GPU_PEAK = "CUDA caching allocator peak (torch.cuda.memory_stats allocated_bytes.all.peak)"
CPU_PEAK = ("tensor bytes at backward's start and at the optimizer step (glibc mallinfo2 in-use bytes less the "
            "non-tensor base; a CPU has no per-step allocator peak)")


def _int(v):
    return None if v is None or pd.isna(v) else int(v)


def ledger(run) -> pd.DataFrame:
    """Per rank: the keys of ``RANK_KEYS`` (None where not measured); empty when the run has no memory rows."""
    m = run.memory
    if not len(m):
        return pd.DataFrame(columns=list(RANK_KEYS))
    m = m.sort_values(["rank", "step"])
    ranks = run.ranks
    total_of = dict(zip(ranks["rank"].astype(int), ranks["device_mem_total_bytes"])) if len(ranks) else {}
    used_of = _nvml_used_by_rank(run)
    out = []
    for rank, g in m.groupby("rank", sort=True):
        last = g.iloc[-1]
        params, grads, state = (_int(last[c]) for c in ("params_bytes", "grads_bytes", "optimizer_state_bytes"))
        persistent = sum(x or 0 for x in (params, grads, state))
        held = g["params_bytes"] + g["optimizer_state_bytes"]
        # the allocator's bytes that are no counted tensor, at the previous sampled optimizer step
        base = (g["allocated_bytes"] - held - g["grads_bytes"]).shift(1)
        fwd = (g["bwd_allocated_bytes"] - held - g["bwd_grads_bytes"] - base).astype("Float64").dropna()
        gpu = g["peak_bytes"].notna().any()
        # a GPU's allocator holds tensors only: the largest row; a CPU's heap also counts the other threads'
        # passing allocations (a megabyte of one row, in CI): the median row
        activations = _int(fwd.max() if gpu else fwd.median()) if len(fwd) else None
        other = last["allocated_bytes"] - persistent if pd.notna(last["allocated_bytes"]) else None
        frac = last.get("optimizer_shard_frac")
        rec = {"rank": int(rank), "params_bytes": params, "grads_bytes": grads, "optimizer_state_bytes": state,
               "params_full_bytes": _int(last.get("params_full_bytes")),
               "kept_unsharded_bytes": _int(last.get("kept_unsharded_bytes")),
               "kept_unsharded_max_bytes": _int(last.get("kept_unsharded_max_bytes")),
               "optimizer_shard_frac": float(frac) if frac is not None and pd.notna(frac) else None,
               "persistent_bytes": persistent, "activations_bytes": activations, "other_bytes": _int(other),
               "rows": len(g),
               "rss_peak_bytes": _int(g["rss_peak_bytes"].max()), "reserved_peak_bytes": None,
               "fragmentation_bytes": None, "non_pytorch_bytes": None, "alloc_retries": None, "ooms": None}
        if gpu:
            at = g.loc[g["peak_bytes"].astype("Float64").idxmax()]
            rec.update(peak_bytes=_int(at["peak_bytes"]), peak_source=GPU_PEAK,
                       reserved_peak_bytes=_int(g["reserved_peak_bytes"].max()),
                       fragmentation_bytes=_int(at["reserved_peak_bytes"] - at["peak_bytes"])
                       if pd.notna(at["reserved_peak_bytes"]) else None,
                       alloc_retries=_int(last["alloc_retries"]), ooms=_int(last["ooms"]))
            phased = g[g["forward_peak_bytes"].notna()]    # step 0's backward comes before any optimizer is known
            if len(phased):
                rec.update(_phases(phased.loc[phased["peak_bytes"].astype("Float64").idxmax()]))
            used = used_of.get(int(rank))
            if used is not None and rec["reserved_peak_bytes"] is not None:
                rec["non_pytorch_bytes"] = max(0, int(used) - rec["reserved_peak_bytes"])
        else:
            tensors = pd.concat([g["bwd_allocated_bytes"] - base, g["allocated_bytes"] - base]).astype("Float64")
            tensors = tensors.dropna()
            rec.update(peak_bytes=_int(tensors.max()) if len(tensors) else None, peak_source=CPU_PEAK)
        rec["activations_peak_bytes"] = (rec["peak_bytes"] - persistent if rec["peak_bytes"] is not None else None)
        total = total_of.get(int(rank))
        rec["device_mem_total_bytes"] = _int(total) if total is not None else None
        rec["headroom_bytes"] = (rec["device_mem_total_bytes"] - rec["reserved_peak_bytes"]
                                 - (rec["non_pytorch_bytes"] or 0)
                                 if gpu and rec["device_mem_total_bytes"] and rec["reserved_peak_bytes"] is not None
                                 else None)
        out.append(rec)
    return pd.DataFrame(out, columns=list(RANK_KEYS))


def _phases(at) -> dict:
    """A GPU row's activations and temporaries by each phase's end (the allocator's peak since the step's start,
    read at backward's start, the optimizer step's start and the step's end, less what persists then: params,
    optimizer state and the grads present) and the phase whose peak is the step's."""
    held = at["params_bytes"] + at["optimizer_state_bytes"]
    peaks = {"forward": (at.get("forward_peak_bytes"), at.get("bwd_grads_bytes")),
             "backward": (at.get("backward_peak_bytes"), at["grads_bytes"]),
             "optimizer": (at["peak_bytes"], at["grads_bytes"])}
    out: dict = {f"{ph}_activations_peak_bytes": _int(pk - held - (0 if pd.isna(g) else g))
                 if pk is not None and pd.notna(pk) else None for ph, (pk, g) in peaks.items()}
    out["peak_phase"] = next((ph for ph, (pk, _) in peaks.items() if pk is not None and pd.notna(pk)
                              and pk >= at["peak_bytes"]), None)
    return out


def _nvml_used_by_rank(run) -> dict:
    """rank -> NVML's largest used memory of its GPU (matched by host and device index), where sampled."""
    nv, ranks = run.nvml, run.ranks
    if not len(nv) or not len(ranks):
        return {}
    used = nv.groupby([nv["host"].astype(str), nv["gpu"].astype(int)])["mem_used_bytes"].max()
    out = {}
    for r in ranks.itertuples(index=False):
        if str(r.device_type) != "cuda" or pd.isna(r.device_index):
            continue
        v = used.get((str(r.host), int(r.device_index)))
        if v is not None and np.isfinite(v):
            out[int(r.rank)] = float(v)
    return out


def _cost(meta: pd.DataFrame) -> float | None:
    """The ledger's own time on the training thread per row written, over the ranks (``memory_ledger`` meta rows,
    written at exit)."""
    vals = [v for v in meta.loc[meta["kind"].astype(str) == "memory_ledger", "value"] if isinstance(v, dict)] \
        if len(meta) else []
    rows = sum(int(v.get("rows") or 0) for v in vals)
    return sum(int(v.get("cost_ns") or 0) for v in vals) / rows / 1e9 if rows else None


# ---- imbalance against the layout ----------------------------------------------------------------------------------
IMBALANCE_FRAC = 0.10             # a rank holding 10 % more than its peers' median ...
IMBALANCE_MIN_BYTES = 16 * 2**20  # ... and at least this much more (a CPU rank's heap differs by a few MiB)
IMBALANCE_CATEGORIES = ("params_bytes", "grads_bytes", "optimizer_state_bytes", "activations_bytes", "other_bytes")
IMBALANCE_CAUSES = {
    "params_bytes": "uneven sharding: parameters this rank holds whole that its peers shard (a module left out of "
                    "fully_shard/ZeRO, tied or buffer-like weights) or an uneven partition",
    "grads_bytes": "gradients kept unsharded or not freed on this rank (a module outside the sharding, grads "
                   "accumulated without zero_grad)",
    "optimizer_state_bytes": "optimizer state of parameters its peers do not hold state for (an uneven optimizer "
                             "partition, a second optimizer on this rank)",
    "activations_bytes": "a larger micro-batch or longer sequences on this rank (uneven data or packing), or "
                         "micro-batches in flight its peers do not keep",
    "other_bytes": "tensors the training loop keeps across steps on this rank (outputs or losses kept for logging "
                   "without .item()/detach, a cache, an evaluation buffer) or work only this rank does "
                   "(checkpointing, logging)",
}


def _in_flight(schedule: str, stages: int, microbatches: int, stage: int) -> int | None:
    """Micro-batches whose activations stage ``stage`` holds at once: GPipe all of them, 1F1B the warm-up depth
    (stages − stage, at most the micro-batches); None for schedules not modelled here."""
    name = schedule.lower()
    if "gpipe" in name:
        return microbatches
    if "1f1b" in name and "interleaved" not in name:
        return min(stages - stage, microbatches)
    return None


def imbalance(led: pd.DataFrame, stage_of: dict[int, int] | None = None, pipeline: dict | None = None) -> dict:
    """summary.json ``memory.imbalance`` (module docstring): ``ranks`` (the ranks holding more than their layout
    explains, largest excess first: ``{rank, peers, excess_bytes, category, category_excess_bytes, held_bytes,
    peers_median_bytes, cause}``), ``peer_groups`` (how the ranks were grouped) and, for a pipeline, ``stages``
    (per stage: its ranks, their largest activations, the micro-batches in flight under its schedule and the
    activations per micro-batch in flight)."""
    stage_of = stage_of or {}
    recs = {int(r["rank"]): r for r in led.to_dict("records")}
    groups: dict = {}
    for rank in recs:
        groups.setdefault(stage_of.get(rank), []).append(rank)

    def held(r: dict) -> int:
        return sum(int(r.get(c) or 0) for c in IMBALANCE_CATEGORIES)

    flagged = []
    for ranks in groups.values():
        if len(ranks) < 2:
            continue
        for rank in ranks:
            peers = [q for q in ranks if q != rank]
            median = float(np.median([held(recs[q]) for q in peers]))
            excess = held(recs[rank]) - median
            if excess < max(IMBALANCE_FRAC * median, IMBALANCE_MIN_BYTES):
                continue
            by_cat = {c: int(recs[rank].get(c) or 0) - float(np.median([int(recs[q].get(c) or 0) for q in peers]))
                      for c in IMBALANCE_CATEGORIES}
            cat = max(by_cat, key=lambda c: by_cat[c])
            flagged.append({"rank": rank, "peers": sorted(peers), "excess_bytes": int(excess), "category": cat,
                            "category_excess_bytes": int(by_cat[cat]), "held_bytes": held(recs[rank]),
                            "peers_median_bytes": int(median), "cause": IMBALANCE_CAUSES[cat]})
    flagged.sort(key=lambda x: -x["excess_bytes"])
    out: dict = {"ranks": flagged,
                 "peer_groups": "ranks of the same pipeline stage" if stage_of else "all ranks (no pipeline)"}
    if stage_of and pipeline:
        stages = []
        for st in sorted({s for s in stage_of.values()}):
            ranks = sorted(r for r in recs if stage_of.get(r) == st)
            act = [recs[r]["activations_bytes"] for r in ranks if recs[r].get("activations_bytes") is not None]
            n = _in_flight(str(pipeline.get("schedule") or ""), int(pipeline.get("stages") or 0),
                           int(pipeline.get("microbatches") or 0), st) if ranks else None
            top = int(max(act)) if act else None
            stages.append({"stage": st, "ranks": ranks, "activations_bytes": top, "in_flight_microbatches": n,
                           "activations_per_microbatch_bytes": top // n if top is not None and n else None})
        out["stages"] = stages
    return out


PER_STEP_MAX = 200_000   # rows of ``per_step`` written into summary.json at most


def per_step(m: pd.DataFrame) -> dict:
    """summary.json ``memory.per_step``: per rank and sampled step the allocator's in-use bytes at the optimizer
    step and, on a GPU, the step's allocated and reserved peaks (the report's memory over steps); ``per_step_reason``
    instead above ``PER_STEP_MAX`` rows."""
    if len(m) > PER_STEP_MAX:
        return {"per_step": [], "per_step_reason": f"{len(m)} rank-steps, over the {PER_STEP_MAX} written here (the "
                                                   "run's memory table has them all)"}
    m = m.sort_values(["rank", "step"])
    return {"per_step": [{"rank": int(r.rank), "step": int(r.step), "allocated_bytes": _int(r.allocated_bytes),
                          "peak_bytes": _int(r.peak_bytes), "reserved_peak_bytes": _int(r.reserved_peak_bytes)}
                         for r in m.itertuples(index=False)]}


def memory_block(run, pp=None) -> dict:
    """summary.json ``memory``'s ledger keys: ``ranks`` (per rank, ``RANK_KEYS``), the rank with the least headroom
    (GPU) or the largest peak, ``imbalance`` (``pp``: the pipeline analysis, analyzers/pipeline.py
    ``PipelineResult``, whose table gives each pipeline rank's stage), or ``ranks_reason`` when no rank recorded a
    ledger."""
    stage_of = pp.table.groupby("rank")["stage"].first().astype(int).to_dict() if pp is not None else None
    pipeline = pp.summary if pp is not None else None
    led = ledger(run)
    if not len(led):
        return {"ranks": [], "ranks_reason": "no memory ledger rows (no optimizer step in a sampled step, an "
                                             "imported trace, or recorded by an older dtprof)"}
    ranks: list[dict] = [{k: (None if v is None or (isinstance(v, float) and not np.isfinite(v)) else v)
                          for k, v in rec.items()} for rec in led.to_dict("records")]
    out: dict = {"ranks": ranks, "what_fits": what_fits(run, led), "ledger_cost_s_per_row": _cost(run.meta),
                 "imbalance": imbalance(led, stage_of, pipeline), **per_step(run.memory)}
    with_headroom = [r for r in ranks if r["headroom_bytes"] is not None]
    if with_headroom:
        worst = min(with_headroom, key=lambda r: int(r["headroom_bytes"]))
        out["least_headroom_rank"] = worst["rank"]
    peaks = [r for r in ranks if r["peak_bytes"] is not None]
    if peaks:
        top = max(peaks, key=lambda r: int(r["peak_bytes"]))
        out["largest_peak_rank"], out["peak_bytes_max"] = top["rank"], top["peak_bytes"]
    return out


# ---- what would fit: each lever's predicted saving from the ledger (docs/metrics.md "What would fit") -----------
# Activation checkpointing of every transformer block keeps each block's input (2·s·b·h bytes in 16 bits) of the
# 34·s·b·h + 5·a·s²·b it saves without recompute (Korthikanti et al. 2022, Table 2; the attention term left out)
CHECKPOINT_KEEP = 2 / 34


def layout(run) -> dict:
    """What the levers need to know of the job's layout: ``world`` (the data-parallel width assumed: the world
    size) and ``sharded`` (the run's collectives include FSDP's: parameters, grads and optimizer state are already
    sharded, so the ZeRO levers have nothing left to shard)."""
    return {"world": int(run.world_size), "sharded": run.has_collectives_from("fsdp")}


def levers(rec: dict, world: int, sharded: bool, *, shortfall: int | None = None,
           activations: int | None = None, request: int = 0, peak: int | None = None) -> list[dict]:
    """The levers that lower one rank's peak, ranked by predicted saving (largest first). ``rec``: the rank's
    ledger (``ledger`` keys); ``activations`` (default the ledger's ``activations_bytes``) and ``request`` (an
    allocation that failed in forward or backward, which scales with the micro-batch) for an out-of-memory case;
    ``shortfall``: the bytes that were missing, each lever then says whether it alone ``covers`` them; ``peak``
    (default the ledger's ``peak_bytes``): the peak each lever's ``predicted_peak_bytes`` is taken from."""
    p, g, o = (rec.get(k) or 0 for k in ("params_bytes", "grads_bytes", "optimizer_state_bytes"))
    act = activations if activations is not None else (rec.get("activations_bytes") or 0)
    keep = (world - 1) / world if world > 1 else 0.0
    # the categories already sharded (ZeRO, FSDP) have nothing left to shard: saving only from the replicated ones
    rep_p, rep_g, rep_o = replicated(rec, world, sharded)
    p, g, o = p * rep_p, g * rep_g, o * rep_o
    out: list[dict] = []

    def add(lever: str, saving: float, formula: str, assumes: str, cost: str) -> None:
        if saving > 0:
            out.append({"lever": lever, "predicted_saving_bytes": int(saving), "formula": formula,
                        "assumes": assumes, "step_time_cost": cost})

    if world > 1:
        n = f"N = {world} data-parallel ranks; only the categories this rank holds whole (not yet sharded)"
        add("zero1", o * keep, "optimizer_state × (1 − 1/N)", n, "an all-gather of the updated parameters per step")
        add("zero2", (o + g) * keep, "(optimizer_state + grads) × (1 − 1/N)", n,
            "reduce-scatter instead of all-reduce: about the same traffic")
        add("zero3_fsdp_full_shard", (o + g + p) * keep, "(optimizer_state + grads + params) × (1 − 1/N)",
            f"{n}; the one layer gathered at a time is left out",
            "parameters all-gathered in forward and backward: 1.5× the data-parallel traffic")
    kept = rec.get("kept_unsharded_bytes") or 0
    add("fsdp_reshard_after_forward", kept - 2 * (rec.get("kept_unsharded_max_bytes") or 0),
        "kept_unsharded − 2 × the largest kept group",
        "fully_shard(reshard_after_forward=True) on the groups that keep their parameters unsharded from forward to "
        "backward; backward then holds one group gathered and the next prefetched",
        "those groups' parameters all-gathered again in backward: one more all-gather of their bytes per step")
    add("activation_checkpointing", act * (1 - CHECKPOINT_KEEP), "activations × (1 − 2/34)",
        "every block checkpointed; transformer blocks (Korthikanti et al. Table 2: a block's input is 2 of its 34 "
        "s·b·h bytes)", "one more forward per step (about +33 % compute)")
    add("half_micro_batch", (act + request) / 2, "(activations + the failed request) / 2" if request else
        "activations / 2", "activations scale linearly with the micro-batch (same sequence length)",
        "twice the micro-batches per step (or half the global batch)")
    add("expandable_segments", rec.get("fragmentation_bytes") or 0, "reserved − allocated at the peak",
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True returns the fragmentation", "none measurable")
    add("bf16_optimizer_state", o / 2, "optimizer_state / 2", "fp32 optimizer state kept in bf16",
        "none measurable; numerics to check")
    out.sort(key=lambda x: -int(x["predicted_saving_bytes"]))
    peak = rec.get("peak_bytes") if peak is None else peak
    for x in out:
        x["predicted_peak_bytes"] = int(peak - x["predicted_saving_bytes"]) if peak is not None else None
        if shortfall is not None:
            x["covers_shortfall"] = int(x["predicted_saving_bytes"]) >= shortfall
    return out


def replicated(rec: dict, world: int, sharded: bool) -> tuple[int, int, int]:
    """(params, grads, optimizer state): 1 where the rank holds the category whole, 0 where it is already sharded.
    A category is sharded when the rank holds nearer 1/N than all of it: params and grads against the parameters'
    unsharded bytes (``params_full_bytes``), optimizer state by ``optimizer_shard_frac`` (the optimizers'
    parameters' local elements ÷ the parameters' full ones: ZeRO-1/2/3 and FSDP2 optimise a 1/N partition). A ledger
    without those (recorded by an older dtprof) is all sharded when FSDP's collectives show (``sharded``)."""
    full, frac = rec.get("params_full_bytes"), rec.get("optimizer_shard_frac")
    if world < 2 or not full or frac is None or not np.isfinite(frac):
        return (0, 0, 0) if sharded else (1, 1, 1)
    mid = (1 + 1 / world) / 2
    shares = ((rec.get("params_bytes") or 0) / full, (rec.get("grads_bytes") or 0) / full, frac)
    return tuple(int(x > mid) for x in shares)    # type: ignore[return-value]


def what_fits(run, led: pd.DataFrame | None = None) -> list[dict]:
    """summary.json ``memory.what_fits``: per rank, its peak and each lever's predicted peak (``levers``)."""
    led = ledger(run) if led is None else led
    if not len(led):
        return []
    lay = layout(run)
    return [{"rank": int(r["rank"]), "peak_bytes": _int(r["peak_bytes"]),
             "levers": levers(r, lay["world"], lay["sharded"])} for r in led.to_dict("records")]
