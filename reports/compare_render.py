"""Renderers for `dtprof compare`: text table, Markdown (PR comment), JSON and JUnit XML.

Each takes the comparison as a plain dict (``comparison_dict``) so that adding a format touches nothing else.
"""
from __future__ import annotations

import json
import math
from xml.sax.saxutils import escape, quoteattr

from dtprof.analyzers.regression import FAIL, INCONCLUSIVE, NA, PASS, WARN, GateResult

EXIT_MEANING = {0: "all gates passed", 1: "regression: a gate failed", 3: "inconclusive: too few steps to decide"}


def comparison_dict(results: list[GateResult], base_names: list[str], head_names: list[str], exit_code: int,
                    settings: dict) -> dict:
    return {"schema": "dtprof.compare/1", "exit_code": exit_code, "outcome": EXIT_MEANING[exit_code],
            "base": base_names, "head": head_names, "settings": settings,
            "gates": [r.to_dict() for r in results]}


def _num(x: float | None, key: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if key.startswith("steps.time_s") or key.endswith("_s"):
        return f"{x * 1e3:.2f} ms" if abs(x) < 10 else f"{x:.2f} s"
    if key.endswith("_frac") or key == "mfu.value":
        return f"{x * 100:.1f} %"
    if float(x).is_integer():
        return f"{int(x)}"
    return f"{x:.4g}"


def _change(g: dict) -> str:
    c, ci, mode, key = g["change"], g["ci"], g["mode"], g["key"]
    if c is None:
        return "—"
    if mode == "ratio":
        s = f"{c * 100:+.1f} %"
        if ci:
            s += f" [{ci[0] * 100:+.1f}, {ci[1] * 100:+.1f}]"
        return s
    if mode == "absolute":
        s = _num(c, key)
        if ci:
            s += f" [{_num(ci[0], key)}, {_num(ci[1], key)}]"
        return s
    if key.endswith("_frac") or key == "mfu.value":
        s = f"{c * 100:+.1f} pp"
        if ci:
            s += f" [{ci[0] * 100:+.1f}, {ci[1] * 100:+.1f}]"
        return s
    s = f"{c:+.4g}"
    if ci:
        s += f" [{ci[0]:+.4g}, {ci[1]:+.4g}]"
    return s


_MARK = {PASS: "pass", FAIL: "FAIL", WARN: "warn", INCONCLUSIVE: "inconclusive", NA: "n/a"}


def _rows(d: dict) -> list[list[str]]:
    rows = []
    for g in d["gates"]:
        verdict = _MARK[g["verdict"]] + (" (advisory)" if g["advisory"] else "")
        rows.append([g["gate"], _num(g["base"], g["key"]), _num(g["head"], g["key"]), _change(g), verdict,
                     g["note"]])
    return rows


HEADER = ["gate", "base", "head", "change [CI]", "verdict", "note"]


def render_text(d: dict) -> str:
    rows = [HEADER] + _rows(d)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    s = d["settings"]
    lines += ["", f"base: {', '.join(d['base'])}", f"head: {', '.join(d['head'])}",
              f"step-time gates: {s['test']} test, {s['confidence']:.0%} CI; a gate fails only when its whole "
              f"interval is past its limit",
              f"result: {d['outcome']} (exit {d['exit_code']})"]
    return "\n".join(lines) + "\n"


def render_markdown(d: dict) -> str:
    icon = {0: "✅", 1: "❌", 3: "⚠️"}[d["exit_code"]]
    out = [f"### {icon} dtprof compare: {d['outcome']}", "", "| " + " | ".join(HEADER) + " |",
           "|" + "---|" * len(HEADER)]
    for r in _rows(d):
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |")
    s = d["settings"]
    out += ["", f"Base: {', '.join(f'`{b}`' for b in d['base'])} · Head: {', '.join(f'`{h}`' for h in d['head'])}"
            f" · step-time test: {s['test']}, {s['confidence']:.0%} CI (a gate fails only when the whole interval "
            f"is past its limit)"]
    return "\n".join(out) + "\n"


def render_json(d: dict) -> str:
    return json.dumps(d, indent=1) + "\n"


def render_junit(d: dict) -> str:
    """One <testcase> per gate; failed gates are <failure>, inconclusive and n/a ones <skipped>."""
    gates = d["gates"]
    failures = sum(g["verdict"] == FAIL for g in gates)
    skipped = sum(g["verdict"] in (INCONCLUSIVE, NA) for g in gates)
    out = ['<?xml version="1.0" encoding="UTF-8"?>',
           f'<testsuites name="dtprof compare" tests="{len(gates)}" failures="{failures}">',
           f'  <testsuite name="dtprof compare" tests="{len(gates)}" failures="{failures}" errors="0" '
           f'skipped="{skipped}">']
    for g, row in zip(gates, _rows(d)):
        detail = f"base {row[1]}, head {row[2]}, change {row[3]}" + (f"; {g['note']}" if g["note"] else "")
        out.append(f'    <testcase classname="dtprof.compare" name={quoteattr(g["gate"])}>')
        if g["verdict"] == FAIL:
            out.append(f'      <failure message={quoteattr("regression: " + detail)}>{escape(detail)}</failure>')
        elif g["verdict"] in (INCONCLUSIVE, NA):
            out.append(f'      <skipped message={quoteattr(g["verdict"] + ": " + detail)}/>')
        out.append(f"      <system-out>{escape(g['verdict'] + ': ' + detail)}</system-out>")
        out.append("    </testcase>")
    out += ["  </testsuite>", "</testsuites>"]
    return "\n".join(out) + "\n"


RENDERERS = {"text": render_text, "markdown": render_markdown, "json": render_json, "junit": render_junit}


def render_scaling_text(d: dict) -> str:
    """Text table for `dtprof compare --scaling`."""
    head = ["run", "GPUs", "step p50", "work/step", "per-GPU throughput", "efficiency", "lost/step",
            "comm", "bubble", "stragglers", "other"]
    rows = [head]
    for r in d["runs"]:
        def ms(x):
            return "—" if x is None else f"{x * 1e3:.1f} ms"
        rows.append([r["name"], str(r["world_size"]), ms(r["step_time_s"]),
                     "—" if r["work_per_step"] is None else f"{r['work_per_step']:.4g} {r['work_unit']}",
                     f"{r['throughput_per_gpu']:.4g} {r['throughput_unit']}",
                     "—" if r["efficiency"] is None else f"{r['efficiency'] * 100:.1f} %",
                     ms(r["lost_s"]), ms(r["lost_comm_s"]), ms(r["lost_bubble_s"]), ms(r["lost_straggler_s"]),
                     ms(r["lost_other_s"])])
    widths = [max(len(x[i]) for x in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += ["", d["explanation"]]
    return "\n".join(lines) + "\n"


def render_scaling_markdown(d: dict) -> str:
    text = render_scaling_text(d).split("\n\n")
    return "### dtprof scaling\n\n```\n" + text[0] + "\n```\n\n" + d["explanation"] + "\n"
