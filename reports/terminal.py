"""The terminal summary: the short per-rank table and headline lines printed at the end of a run and by
`dtprof summary`. Formats the analysis only: ``render(analysis)``, the renderer contract (docs/architecture.md)."""
from __future__ import annotations

from dtprof.analyzers import breakdown as breakdown_mod
from dtprof.reports.fmt import MISSING, count, fixed, ljust, mib, pct, pct1, rjust, saving, short_s
from dtprof.reports.gpu import summary_lines as gpu_summary_lines


def render(analysis, options: dict | None = None) -> str:
    """The terminal text of ``analysis`` (analyzers/summary.py ``Analysis``): what `dtprof run` and
    `dtprof summary` print."""
    return format_summary_text(analysis.summary, analysis.unnamed_suspects, analysis.restart_lines)


def format_summary_text(summary: dict, unnamed_suspects=(), restart_lines=()) -> str:
    """The short per-rank table printed at the end of a run and by `dtprof summary` (the same text), the headline
    lines, and with a kernel trace the GPU time per rank and the top kernels. ``unnamed_suspects``: the what-if
    entries marked "(not a straggler)" (Analysis.unnamed_suspects); ``restart_lines``: Analysis.restart_lines."""
    lines = []
    run = summary.get("run") or {}
    st = summary.get("steps") or {}
    t = st.get("time_s") or {}
    hosts = f"on {len(run['hosts'])} host(s)" if run.get("hosts") else "on unnamed hosts"
    code = f", exit code {run['exit_code']}" if run.get("exit_code") is not None else ""
    lines.append(f"dtprof summary: {run.get('world_size', '?')} rank(s) {hosts}, "
                 f"status {run.get('status') or 'unknown'}{code}")
    if run.get("ranks_missing"):
        lines.append(f"[error] rank(s) {', '.join(map(str, run['ranks_missing']))} left no record")
    for msg in run.get("unidentified_processes") or []:
        lines.append(f"[error] {msg}")
    if run.get("status") == "interrupted":
        lines.append(run.get("status_reason") or "interrupted")
    lines += [f"[restart] {line}" for line in restart_lines]
    tri = summary.get("triage")
    if tri and tri.get("verdict") != "healthy":
        lines.append(f"triage: {tri['message']}")
    lines.append(f"steps: {st.get('count', 0)} measured ({st.get('warmup_steps', 0)} warm-up excluded); "
                 f"step time p50 {short_s(t.get('p50'))}, p90 {short_s(t.get('p90'))}, "
                 f"p99 {short_s(t.get('p99'))}")
    if (st.get("sampling") or {}).get("statement") and (st.get("boundary_only_count")
                                                         or st.get("detail_skipped_count")):
        lines.append(f"sampling: {st['sampling']['statement']}")
    # where the step went (breakdown.py): one column per part, summing to the mean step time
    parts = (summary.get("breakdown") or {}).get("parts") or list(breakdown_mod.PARTS)
    short = {"exposed_comm": "exposed", "data_wait": "data wait",
             "optimizer": "optim", "gpu_wait": "GPU wait"}
    # waiting for a CPU happens inside the parts: a column after them, where the ranks reported it
    cpu_col = summary.get("cpu_wait") is not None
    lines.append(f"{rjust('rank', 5)} {ljust('host', 14)} {rjust('steps', 5)} {rjust('step mean', 10)} "
                 + " ".join(rjust(short.get(p, p), 9) for p in parts) + f" {rjust('overlap', 8)}"
                 + (f" {rjust('cpu wait', 9)}" if cpu_col else ""))
    for r in summary.get("ranks") or []:
        b = r.get("breakdown_s_per_step") or {}
        lines.append(f"{rjust(r['rank'], 5)} {ljust(str(r.get('host') or '')[:14], 14)} {rjust(r.get('steps', 0), 5)} "
                     f"{rjust(short_s(r.get('step_time_s_mean')), 10)} "
                     + " ".join(rjust(short_s(b.get(p)), 9) for p in parts)
                     + f" {rjust(pct(r.get('overlap_ratio')), 8)}"
                     + (f" {rjust(short_s(r.get('cpu_wait_s_per_step')), 9)}" if cpu_col else ""))
    bd = summary.get("breakdown") or {}
    by_dim = {k: v for k, v in (bd.get("exposed_comm_by_dim_s_per_step") or {}).items() if v > 0}
    by_op = {k: v for k, v in (bd.get("exposed_comm_by_op_s_per_step") or {}).items() if v > 0}
    by_issued = {k: v for k, v in (bd.get("exposed_comm_by_issued_s_per_step") or {}).items() if v > 0}
    if by_op:
        dims = ", ".join(f"{k} {short_s(v)}" for k, v in by_dim.items()) if set(by_dim) != {"(none)"} else ""
        lines.append("exposed communication per step (mean over ranks): "
                     + (f"by mesh dimension {dims}; " if dims else "")
                     + "by op " + ", ".join(f"{k} {short_s(v)}" for k, v in by_op.items())
                     + ("; issued " + ", ".join(f"{k} {short_s(v)}" for k, v in by_issued.items())
                        if by_issued else ""))
    wif = summary.get("what_if") or []
    if wif:   # the what-if model's top three (analyzers/whatif.py)
        rep = summary.get("replay") or {}
        err = f", replay error {pct1(rep['error_frac'])}" if rep.get("error_frac") is not None else ""
        lines.append(f"what if (predicted mean step; measured {short_s(wif[0]['measured_step_s'])}{err}): " + "; ".join(
            f"{w['scenario']}{' rank ' + ','.join(map(str, w['ranks'])) if w['ranks'] else ''}"
            f"{' (not a straggler)' if i in unnamed_suspects else ''} "
            f"{short_s(w['predicted_step_s'])} ({saving(w['saving_frac'])})" for i, w in enumerate(wif[:3])))
    m = summary.get("mfu") or {}
    if m.get("value") is not None:
        lines.append(f"MFU: {pct1(m['value'])} ({m.get('flops_source')}; peak: {m.get('peak_source')})")
    else:
        lines.append(f"MFU: {MISSING} ({m.get('value_reason') or m.get('peak_reason') or m.get('flops_reason')})")
    rates = [f"{count(st[k])} {what}/s ({st.get(k + '_source')})" for k, what in
             (("tokens_per_s", "tokens"), ("samples_per_s", "samples")) if st.get(k) is not None]
    if rates:
        lines.append("throughput: " + "; ".join(rates))
    ov = summary.get("overlap") or {}
    why = f" ({ov['exposed_comm_frac_reason']})" if ov.get("exposed_comm_frac_reason") else ""
    lines.append(f"overlap: {pct(ov.get('ratio'))} of communication hidden behind compute; exposed "
                 f"communication {pct(ov.get('exposed_comm_frac'))} of step time{why}")
    ev = summary.get("evaluation")
    if ev:
        lines.append(f"evaluation between steps (not in step times, throughput or MFU): {ev['stretches']} "
                     f"stretch(es), {short_s(ev['total_s'])} on rank {ev['rank']}"
                     + (f" ({pct1(ev['wall_frac'])} of its run)" if ev.get("wall_frac") is not None else ""))
    outside = summary.get("collectives_outside_steps") or []
    if outside:
        lines.append(f"collectives outside every step (set-up, checkpointing, evaluation): "
                     f"{sum(c['count'] for c in outside)}, {mib(sum(c['bytes'] for c in outside))}, "
                     f"{short_s(sum(c['total_s'] for c in outside))}")
    pp = summary.get("pipeline")
    if pp:
        lines.append(f"pipeline: {pp['stages']} stages × {pp['microbatches']} microbatches ({pp['schedule']}), "
                     f"bubble {pct(pp.get('bubble_frac'))} = theoretical "
                     f"{pct(pp.get('theoretical_bubble_frac'))} + overhead {pct(pp.get('overhead_frac'))}"
                     f" of the step, imbalance "
                     f"{fixed(pp.get('imbalance'), 2)}×")
    sl = summary.get("stragglers") or []
    if sl:
        lines.append("stragglers: " + "; ".join(
            f"rank {s['rank']} ({s['host']}) {s['kind']}, saves {pct(s['saving_frac'])} of the step if fixed, "
            f"peers' arrival wait {short_s(s['time_lost_s'])}" for s in sl))
    else:
        lines.append("stragglers: none")
    tl = summary.get("transient_lateness") or []
    if tl:
        lines.append("transient lateness (not a straggler): " + "; ".join(
            f"rank {s['rank']} held its peers up in a few steps (peers' arrival wait "
            f"{short_s(s['time_lost_s'])})"
            for s in tl))
    for f in summary.get("findings") or []:
        lines.append(f"[{f['severity']}] {f['message']}")
    lines += gpu_summary_lines(summary)
    return "\n".join(lines)
