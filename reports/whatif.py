"""The what-if list (analyzers/whatif.py) as the report's first-screen table beside the step breakdown: each
scenario's predicted mean step and saving, most first, with the replay's identity error and the critical path's
shares. Formats the analysis' summary only."""
from __future__ import annotations

from dtprof.reports.fmt import esc, ms, pct, pct1

NAMES = {"straggler_removed": "Straggler removed", "perfect_overlap": "Perfect overlap",
         "no_data_wait": "No data wait", "balanced_stages": "Balanced stages",
         "no_pipeline_gaps": "No pipeline gaps", "collectives_at_link_peak": "Collectives at link peak",
         "zero_one_bucket": "ZeRO: one gradient bucket"}


NOT_NAMED = ' <span class="note">(not a straggler)</span>'


def whatif_html(summary: dict, unnamed_suspects=()) -> str:
    """The ranked what-if table (``<div id="what-if">``), or "" when the run has none; ``unnamed_suspects``: the
    entries marked "(not a straggler)" (Analysis.unnamed_suspects)."""
    wif = summary.get("what_if") or []
    if not wif:
        return ""
    rows = "".join(
        f"<tr><td title=\"{esc(w['basis'])}\">{esc(NAMES.get(w['scenario'], w['scenario']))}"
        f"{' rank ' + esc(', '.join(map(str, w['ranks']))) if w['ranks'] else ''}"
        f"{NOT_NAMED if i in unnamed_suspects else ''}</td>"
        f"<td class=\"num\">{ms(w['predicted_step_s'])}</td><td class=\"num\">{pct(w['saving_frac'])}</td></tr>"
        for i, w in enumerate(wif))
    rep = summary.get("replay") or {}
    err = (f"replaying the unmodified model reproduces the measured steps within {pct1(rep['error_frac'])} (mean)"
           if rep.get("error_frac") is not None else "replay error unknown")
    cp = summary.get("critical_path") or {}
    path = ""
    if cp.get("by_part"):
        parts = ", ".join(f"{esc(k)} {pct(v)}" for k, v in sorted(cp["by_part"].items(), key=lambda kv: -kv[1]))
        ranks = ", ".join(f"rank {esc(k)} {pct(v)}" for k, v in list(cp["by_rank"].items())[:4])
        path = f"<p class=\"note\">Critical path: {parts}; {ranks}.</p>"
    return (f"<div id=\"what-if\"><h3>What if</h3><p class=\"note\">Predicted mean step (measured "
            f"{ms(wif[0]['measured_step_s'])}) if the fix were made; {esc(err)}.</p>"
            f"<table class=\"whatif\"><thead><tr><th>scenario</th><th>predicted step</th><th>saving</th></tr>"
            f"</thead><tbody>{rows}</tbody></table>{path}</div>")
