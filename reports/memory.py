"""The report's memory ledger: each rank's bytes stacked by category beside its device's capacity, and what would
fit (summary.json ``memory.ranks`` and ``memory.what_fits``: analyzers/memory.py). Formats only."""
from __future__ import annotations

import plotly.graph_objects as go

from dtprof.reports.figures import layout, rank_axis
from dtprof.reports.fmt import esc, fmt_bytes, plain

# (summary key, legend name, colour), bottom to top
CATEGORIES = (("params_bytes", "parameters", "#4C78A8"), ("grads_bytes", "gradients", "#F58518"),
              ("optimizer_state_bytes", "optimizer state", "#54A24B"),
              ("activations_peak_bytes", "activations and temporaries at the peak", "#B279A2"),
              ("fragmentation_bytes", "fragmentation (reserved − allocated)", "#BAB0AC"),
              ("non_pytorch_bytes", "outside PyTorch (NVML − reserved)", "#9D755D"))
NOTE = ("Per rank, what it holds at its peak: parameters, gradients and optimizer state counted from its tensors "
        "(a shard as its local bytes), activations and temporaries = peak − those; on a GPU the caching allocator's "
        "fragmentation and the memory outside PyTorch on top (docs/metrics.md, Memory ledger). On a CPU there is no "
        "per-step allocator peak: the peak is the largest tensor bytes read at backward's start or the optimizer step. "
        "Over the steps: the allocator's in-use bytes at each sampled optimizer step and, on a GPU, the step's "
        "allocated and reserved peaks.")


def ledger_figure(memory: dict) -> go.Figure | None:
    ranks = memory.get("ranks") or []
    if not ranks:
        return None
    gib = 2**30
    x = [r["rank"] for r in ranks]
    fig = go.Figure()
    for key, name, colour in CATEGORIES:
        ys = [max(0, r.get(key) or 0) / gib for r in ranks]
        if any(ys):
            fig.add_trace(go.Bar(x=x, y=ys, name=name, marker_color=colour,
                                 hovertemplate=f"rank %{{x}}<br>{name}: %{{y:.3f}} GiB<extra></extra>"))
    totals = [r.get("device_mem_total_bytes") for r in ranks]
    if any(t is not None for t in totals):
        fig.add_trace(go.Scatter(x=x, y=[t / gib if t is not None else None for t in totals], mode="lines",
                                 name="device memory", line={"color": "#E45756", "dash": "dash", "shape": "hvh"}))
    fig.update_layout(barmode="stack")
    rank_axis(fig, len(ranks))
    return layout(fig, "Memory ledger per rank", height=360, xtitle="rank", ytitle="memory (GiB)")


RANKS_DRAWN = 16      # beyond this many ranks, each step's largest value over the ranks
OVER_STEPS = (("allocated_bytes", "allocated at the optimizer step", "solid"),
              ("peak_bytes", "allocated peak", "dot"), ("reserved_peak_bytes", "reserved peak", "dash"))


def over_steps_figure(memory: dict) -> go.Figure | None:
    """Allocated and reserved memory per rank over the sampled steps (summary.json ``memory.per_step``); with more
    than ``RANKS_DRAWN`` ranks, each step's largest over the ranks."""
    rows = memory.get("per_step") or []
    if not rows:
        return None
    gib = 2**30
    by_rank: dict = {}
    for r in rows:
        by_rank.setdefault(r["rank"], []).append(r)
    if len(by_rank) > RANKS_DRAWN:
        top: dict = {}
        for r in rows:
            cur = top.setdefault(r["step"], {"step": r["step"]})
            for key, _, _ in OVER_STEPS:
                if r.get(key) is not None:
                    cur[key] = max(cur.get(key) or 0, r[key])
        by_rank = {"max": sorted(top.values(), key=lambda x: x["step"])}
    fig = go.Figure()
    for rank, rs in by_rank.items():
        who = "largest over ranks" if rank == "max" else f"rank {rank}"
        for key, name, dash in OVER_STEPS:
            pts = [(r["step"], r[key] / gib) for r in rs if r.get(key) is not None]
            if pts:
                fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers",
                                         name=f"{who}: {name}", line={"dash": dash}, legendgroup=str(rank),
                                         hovertemplate=f"{who}<br>step %{{x}}<br>{name}: %{{y:.3f}} GiB"
                                                       "<extra></extra>"))
    return layout(fig, "Memory over the sampled steps", height=340, xtitle="step", ytitle="memory (GiB)")


def _rows(head: list[str], rows: list[list[str]]) -> str:
    h = "".join(f"<th>{esc(c)}</th>" for c in head)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="data"><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>'


def ledger_html(memory: dict) -> str:
    """The ledger per rank as a table, the ranks holding more than their layout explains and, for a pipeline, each
    stage's activations per micro-batch in flight, then the levers of the rank with the least headroom (else the
    largest peak), ranked by predicted saving."""
    ranks = memory.get("ranks") or []
    if not ranks:
        return ""
    out = [_rows(["rank", "params", "grads", "optimizer state", "activations (fwd → bwd)", "peak",
                  "reserved peak", "fragmentation", "outside PyTorch", "alloc retries", "headroom"],
                 [[str(r["rank"]), fmt_bytes(r.get("params_bytes")), fmt_bytes(r.get("grads_bytes")),
                   fmt_bytes(r.get("optimizer_state_bytes")), fmt_bytes(r.get("activations_bytes")),
                   fmt_bytes(r.get("peak_bytes")), fmt_bytes(r.get("reserved_peak_bytes")),
                   fmt_bytes(r.get("fragmentation_bytes")), fmt_bytes(r.get("non_pytorch_bytes")),
                   plain(r.get("alloc_retries")),
                   fmt_bytes(r.get("headroom_bytes"))] for r in ranks])]
    imb = memory.get("imbalance") or {}
    if imb.get("ranks"):
        out.append(f"<h3>Imbalance: ranks holding more than their peers ({esc(imb.get('peer_groups', ''))})</h3>")
        out.append(_rows(["rank", "peers", "more than their median", "in", "likely cause"],
                         [[str(x["rank"]), ", ".join(map(str, x["peers"])), fmt_bytes(x["excess_bytes"]),
                           f"{x['category'].removesuffix('_bytes').replace('_', ' ')} "
                           f"(+{fmt_bytes(x['category_excess_bytes'])})", x["cause"]] for x in imb["ranks"]]))
    if imb.get("stages"):
        out.append("<h3>Pipeline stages: activations per micro-batch in flight</h3>")
        out.append(_rows(["stage", "ranks", "activations", "micro-batches in flight", "per micro-batch"],
                         [[str(x["stage"]), ", ".join(map(str, x["ranks"])), fmt_bytes(x.get("activations_bytes")),
                           plain(x.get("in_flight_microbatches")),
                           fmt_bytes(x.get("activations_per_microbatch_bytes"))] for x in imb["stages"]]))
    focus = memory.get("least_headroom_rank", memory.get("largest_peak_rank"))
    fits = next((f for f in memory.get("what_fits") or [] if f["rank"] == focus), None)
    if fits and fits["levers"]:
        out.append(f"<h3>What would fit: rank {esc(focus)}'s predicted peak under each lever (peak "
                   f"{esc(fmt_bytes(fits['peak_bytes']))})</h3>")
        out.append(_rows(["lever", "saving", "predicted peak", "formula", "assumes", "cost in step time"],
                         [[x["lever"], fmt_bytes(x["predicted_saving_bytes"]),
                           fmt_bytes(x.get("predicted_peak_bytes")), x["formula"], x["assumes"], x["step_time_cost"]]
                          for x in fits["levers"]]))
    return "".join(out)
