"""What the GPU did, formatted: the GPU time and top-kernel tables (terminal and HTML) and the timeline's kernel lanes.

Only formats ``summary["gpu_time"]``, ``summary["ranks"][i]["gpu_time"]``, ``summary["kernels"]`` (computed in
analyzers/kernel_breakdown.py) and draws the run's kernel spans; kernel classes come from that module too.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from dtprof.analyzers.kernels import kernel_category
from dtprof.reports.fmt import MISSING, count, esc, fine_s, ljust, pct1, rjust

# timeline categories for kernels (one legend entry each) and the CPU-side spans drawn as an outline above them
KERNEL_COLORS = {"GPU compute kernel": "#2E7D32", "GPU communication kernel": "#D84315",
                 "GPU memory copy/set": "#8E24AA", "GPU other kernel": "#757575"}
CPU_OUTLINE = "CPU-side span (outline)"
_KERNEL_CAT = {"computation": "GPU compute kernel", "communication": "GPU communication kernel",
               "memory": "GPU memory copy/set", "other": "GPU other kernel"}
MAX_KERNEL_BARS = 50_000  # the longest kernels of the window are drawn beyond this (the title says so)


def _short(name: str, n: int = 100) -> str:
    """A kernel name cut to ``n`` characters (templated names run to hundreds); the full name is the tooltip."""
    return name if len(name) <= n else name[:n - 1] + "…"


def overlap_labels(summary: dict) -> list[tuple[str, str, object]]:
    """(label, source, value) of both overlap figures: per step from collective records (analyzers/overlap.py)
    and kernels only (HTA's definition, analyzers/kernel_breakdown.py)."""
    ov = summary.get("overlap") or {}
    gt = summary.get("gpu_time") or {}
    src = ("compute kernels vs NCCL kernels and collective records [issue, end], clipped to each step"
           if ov.get("level") == "kernel" else "compute spans vs collective records [issue, end], per step")
    out = [("overlap per step, collective records", src, ov.get("ratio"))]
    if gt:
        out.append(("overlap of kernels only (HTA)", f"NCCL kernels vs computation kernels, window "
                    f"{gt.get('window')}", gt.get("comm_compute_overlap_frac")))
    return out


def summary_lines(summary: dict) -> list[str]:
    """Lines for the terminal summary: GPU time per rank, both overlap figures and the top kernels (empty without a
    kernel trace)."""
    ranks = [r for r in summary.get("ranks") or [] if r.get("gpu_time")]
    if not ranks:
        return []
    lines = [f"GPU time (kernels; window {ranks[0]['gpu_time']['window']['name']}, "
             f"HTA's definitions: docs/metrics.md):",
             " ".join(rjust(h, w) for h, w in (("rank", 5), ("idle", 7), ("compute", 8), ("non-comp", 9),
                                                ("comm", 7), ("memory", 7), ("host wait", 10), ("steps", 8),
                                                ("kernels", 8)))]
    for r in ranks:
        g = r["gpu_time"]
        st = g["window"]["steps"]
        lines.append(f"{rjust(r['rank'], 5)} {rjust(pct1(g['idle_frac']), 7)} {rjust(pct1(g['compute_frac']), 8)} "
                     f"{rjust(pct1(g['non_compute_frac']), 9)} {rjust(pct1(g['comm_frac']), 7)} "
                     f"{rjust(pct1(g['memory_frac']), 7)} {rjust(pct1(g['idle_causes']['host_wait']), 10)} "
                     f"{rjust(f'{st[0]}-{st[-1]}' if st else MISSING, 8)} {rjust(g['window']['kernels'], 8)}")
    lines += class_lines(ranks)
    st = summary.get("steps") or {}
    if st.get("traced_cost_s") is not None and st.get("traced_steps"):
        lines.append(f"kernel sample: steps {st['traced_steps'][0]}-{st['traced_steps'][-1]} kept out of the step "
                     f"statistics; it cost the job {fine_s(max(st['traced_cost_s'], 0.0))} (those steps' time over "
                     f"the median measured step)")
    for label, src, v in overlap_labels(summary):
        lines.append(f"{label}: {pct1(v)} ({src})")
    kernels = summary.get("kernels") or []
    if kernels:
        lines.append(f"top {len(kernels)} kernels by total time:")
        lines.append(f"{rjust('time', 10)} {rjust('share', 6)} {rjust('count', 6)} {rjust('mean', 10)}  "
                     f"{ljust('category', 13)} name")
        for k in kernels:
            name = _short(k["name"], 80)
            lines.append(f"{rjust(fine_s(k['time_s']), 10)} {rjust(pct1(k['share']), 6)} {rjust(k['count'], 6)} "
                         f"{rjust(fine_s(k['mean_s']), 10)}  {ljust(k['category'], 13)} {name}")
    return lines


CLASS_LABELS = {"matmul": "matmul", "attention": "attention", "elementwise_norm": "elem+norm",
                "communication": "comm", "memory": "memcpy", "other": "other"}


def class_lines(ranks: list[dict]) -> list[str]:
    """Where each rank's GPU time went by kernel class, and whether it is launch-bound (docs/metrics.md "Why the
    GPU is slow")."""
    lines = ["GPU time by kernel class (share of kernel time; launch gaps: idle waiting for the host to launch):",
             f"{rjust('rank', 5)} " + " ".join(rjust(v, 9) for v in CLASS_LABELS.values())
             + f" {rjust('idle', 7)} {rjust('launch gaps', 12)} {rjust('kernels/step', 13)} "
             f"{rjust('median kernel', 14)}"]
    for r in ranks:
        g = r["gpu_time"]
        cf = g.get("class_frac") or {}
        lines.append(f"{rjust(r['rank'], 5)} " + " ".join(rjust(pct1(cf.get(c)), 9) for c in CLASS_LABELS)
                     + f" {rjust(pct1(g['idle_frac']), 7)} {rjust(pct1(g.get('launch_idle_frac')), 12)} "
                     f"{rjust(count(g.get('kernels_per_step')), 13)} {rjust(fine_s(g.get('median_kernel_s')), 14)}")
    return lines


def tables_html(summary: dict) -> str:
    """The report's GPU time per rank and top kernels tables ('' without a kernel trace)."""
    ranks = [r for r in summary.get("ranks") or [] if r.get("gpu_time")]
    if not ranks:
        return ""
    rows = "".join(
        f"<tr><td>{esc(r['rank'])}</td><td>{pct1(g['idle_frac'])}</td><td>{pct1(g['compute_frac'])}</td>"
        f"<td>{pct1(g['non_compute_frac'])}</td><td>{pct1(g['comm_frac'])}</td><td>{pct1(g['memory_frac'])}</td>"
        f"<td>{pct1(g['idle_causes']['host_wait'])} / {pct1(g['idle_causes']['kernel_wait'])} / "
        f"{pct1(g['idle_causes']['other'])}</td><td>{pct1(g['comm_compute_overlap_frac'])}</td>"
        f"<td>{esc(', '.join(map(str, g['window']['steps'])))}</td><td>{count(g['window']['kernels'])}</td></tr>"
        for r in ranks for g in [r["gpu_time"]])
    out = ('<table class="data" id="gpu-time-table"><thead><tr><th>rank</th><th>idle</th><th>compute</th>'
           "<th>non-compute</th><th>communication</th><th>memory copy/set</th>"
           "<th>idle causes: host wait / kernel wait / other</th><th>overlap (kernels only, HTA)</th><th>steps</th>"
           f"<th>kernels</th></tr></thead><tbody>{rows}</tbody></table>")
    rows = "".join(
        f"<tr><td>{esc(r['rank'])}</td>" + "".join(f"<td>{pct1((g.get('class_frac') or {}).get(c))}</td>"
                                                 for c in CLASS_LABELS)
        + f"<td>{pct1(g['idle_frac'])}</td><td>{pct1(g.get('launch_idle_frac'))}</td>"
        f"<td>{count(g.get('kernels_per_step'))}</td><td>{fine_s(g.get('median_kernel_s'))}</td></tr>"
        for r in ranks for g in [r["gpu_time"]])
    out += ('<h3>GPU time by kernel class</h3><table class="data" id="gpu-class-table"><thead><tr><th>rank</th>'
            + "".join(f"<th>{esc(v)}</th>" for v in CLASS_LABELS.values())
            + "<th>idle</th><th>launch gaps (idle waiting for the host)</th><th>kernels per step</th>"
            f"<th>median kernel</th></tr></thead><tbody>{rows}</tbody></table>")
    kernels = summary.get("kernels") or []
    if kernels:
        rows = "".join(
            f'<tr><td class="t" title="{esc(k["name"])}">{esc(_short(k["name"]))}</td>'
            f'<td class="t">{esc(k["category"])}</td><td>{count(k["count"])}</td><td>{fine_s(k["time_s"])}</td>'
            f"<td>{pct1(k['share'])}</td><td>{fine_s(k['mean_s'])}</td></tr>" for k in kernels)
        out += (f'<h3>Top {len(kernels)} kernels by total time</h3><table class="data" id="kernel-table"><thead><tr>'
                '<th class="t">kernel</th><th class="t">category</th><th>count</th><th>total time</th>'
                "<th>share of kernel time</th><th>mean</th></tr></thead><tbody>" + rows + "</tbody></table>")
    return out


def kernel_lanes(spans: pd.DataFrame, bars: pd.DataFrame, order: list[str], window: list[int], ranks: list[int],
                 align, t0: int, esc) -> tuple[pd.DataFrame, list[str], int]:
    """Add the window's kernels to the timeline's ``bars``: a lane per CUDA stream under each rank that has kernels
    there, coloured by kernel class; that rank's CPU-side spans become an outline lane above them (they say what
    the host ran, not that the GPU was busy). ``align(t, rank)`` is the run model's host alignment.
    Returns bars, lane order and the number of kernels not drawn."""
    k = spans[(spans["kind"] == "kernel").to_numpy() & np.isin(spans["rank"].to_numpy(), ranks)
              & np.isin(spans["step"].fillna(-1).to_numpy("int64"), window)]
    if not len(k):
        return bars, order, 0
    dropped = max(0, len(k) - MAX_KERNEL_BARS)
    if dropped:
        k = k.loc[(k["end_ns"] - k["start_ns"]).sort_values(ascending=False, kind="stable").index[:MAX_KERNEL_BARS]]
    lane = [f"rank {r} · GPU {ln}" for r, ln in zip(k["rank"], k["lane"].astype(str))]
    cat = pd.Series(kernel_category(k["name"])).map(_KERNEL_CAT).to_numpy()
    start = align(k["start_ns"].to_numpy(np.int64), k["rank"].to_numpy(np.int64))   # the run model's alignment
    kb = pd.DataFrame({"cat": cat, "lane": lane, "start": (start - t0) / 1e6,
                       "dur": (k["end_ns"] - k["start_ns"]).to_numpy() / 1e6,
                       "name": [esc(n) for n in k["name"].astype(str)], "op": "kernel",
                       "group": [esc(x) for x in k["lane"].astype(str)], "bytes": "", "label": ""})
    with_kernels = sorted(set(int(r) for r in k["rank"]))
    cpu_lane = {f"rank {r} · compute": f"rank {r} · CPU" for r in with_kernels}
    bars = bars.copy()
    # the host's phases and the trace's CPU annotations ("## forward ##", user spans) become outlines
    is_cpu = bars["lane"].isin(list(cpu_lane)) & bars["cat"].isin(["compute", "user span"])
    bars.loc[is_cpu, "cat"] = CPU_OUTLINE
    bars["lane"] = bars["lane"].replace(cpu_lane)
    streams = kb.groupby("lane", sort=True).size().index.tolist()
    new_order = []
    for ln in order:
        new_order.append(cpu_lane.get(ln, ln))
        if ln in cpu_lane:
            r = ln.split(" ")[1]
            new_order += [s for s in streams if s.split(" ")[1] == r]
    return pd.concat([bars, kb], ignore_index=True), new_order, dropped
