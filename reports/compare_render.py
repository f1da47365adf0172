"""Renderers for `dtprof compare`: text table, Markdown (PR comment), JSON and JUnit XML.

Each takes the comparison result as a plain dict (analyzers/regression.py ``comparison``: the gates, the verdict
and the rows that explain it) and only formats it, so that adding a format touches nothing else.
"""
from __future__ import annotations

import json
from xml.sax.saxutils import escape, quoteattr

from dtprof.analyzers.regression import FAIL, INCONCLUSIVE, NA, PASS, WARN
from dtprof.reports.fmt import MISSING, fixed, fmt_frac, missing, ms, pct, pct1, sig, signed_ms, signed_pct


def part_lines(d: dict) -> list[str]:
    """One line per part that moved, largest first: change [CI] per step, and the rank that moved most."""
    p = d["parts"]
    out = []
    for r in p["rows"]:
        who = f"; most on rank {r['rank']} ({signed_ms(r['rank_change_s'])})" if r.get("rank") is not None else ""
        out.append(f"{r['part']}: {signed_ms(r['change_s'])} per step "
                   f"[{signed_ms(r['ci_s'][0])}, {signed_ms(r['ci_s'][1])}]{who}")
    return out


def straggler_lines(d: dict) -> list[str]:
    return [f"stragglers: rank {r['rank']} {r['what']} ({r['base']} -> {r['head']}): {_MARK[r['verdict']]}"
            for r in d["stragglers"]]


def identity_lines(d: dict) -> list[str]:
    return [f"differs: {x['key']}: {x['base']} -> {x['head']}" + (" (makes the runs not comparable)"
                                                                  if x.get("blocking") else "")
            for x in d["identity"]]


def _probe_text(p: dict) -> str:
    """The probe's line; a probe that moved but does not explain the verdict (regression.verdict) says so, and so does
    one not used because its device does not bound the steps."""
    if p.get("used") is False:
        return p["line"] + "; not used: its device does not bound the steps"
    if p.get("explains_verdict") is False:
        return p["line"] + (", but a slower machine cannot hide a slowdown behind a pass" if p["ratio"] > 1 else
                            ", but a faster machine does not explain a slower head")
    return p["line"]


def probe_line(d: dict) -> str | None:
    p = d.get("probe")
    return None if not p else _probe_text(p)


def job_probe_line(d: dict) -> str | None:
    """The CPU probe during the job (both sides recorded it), which decides which side ran on the slower machine."""
    p = d.get("job_probe")
    return None if not p else p["line"] + ("; not used: its device does not bound the steps"
                                           if p.get("used") is False else "")


def gpu_probe_line(d: dict) -> str | None:
    """The GPU probe's change, or why there is none (a CPU-only node, an older run)."""
    p = d.get("gpu_probe")
    if p:
        return _probe_text(p)
    return f"machine probe (GPU): none -- {d['gpu_probe_reason']}" if d.get("gpu_probe_reason") else None


def drift_lines(d: dict) -> list[str]:
    """A side recorded on a busy machine, and the step's waits against its compute (regression.machine_drift)."""
    x = d.get("drift") or {}
    out = list(x.get("lines") or [])
    w, c = x.get("waits"), x.get("compute")
    if w and c:
        out.append(f"waits (time a faster machine does not shorten) {signed_ms(w['change_s'])} per step "
                   f"[{signed_ms(w['ci_s'][0])}, {signed_ms(w['ci_s'][1])}]; compute {signed_ms(c['change_s'])} "
                   f"[{signed_ms(c['ci_s'][0])}, {signed_ms(c['ci_s'][1])}]")
    return out


def explain_lines(d: dict) -> list[str]:
    """Everything beside the gate table, in the order a reader needs it: what moved, stragglers, machine, config."""
    out = []
    parts = part_lines(d)
    if parts:
        floor = d["parts"]["floor_s"]
        out += [f"what moved (the critical rank's step parts, interval beyond ±{ms(floor)}), largest first:"]
        out += ["  " + x for x in parts]
    elif d["parts"].get("note"):
        out.append("what moved: " + d["parts"]["note"])
    else:
        out.append("what moved: no part of the step moved beyond the noise")
    out += straggler_lines(d)
    out += drift_lines(d)
    out += [f"numerics: head run {r['run']}: {r['what']}: {r['detail']}: {_MARK[r['verdict']]}"
            for r in d.get("health") or []]
    out += [x for x in (probe_line(d), job_probe_line(d), gpu_probe_line(d)) if x]
    if d.get("bound"):
        used = {"gpu": "the GPU probe", "cpu": "the CPU probe", "both": "both probes"}[d["bound"]["device"]]
        out.append(f"machine probe used: {used} ({d['bound']['why']})")
    out += identity_lines(d)
    return out


def prediction_lines(d: dict) -> list[str]:
    """--check-prediction: the base run's what-if prediction against the head run that applied the fix."""
    p = d.get("prediction")
    if not p:
        return []
    who = f" rank {','.join(map(str, p['ranks']))}" if p["ranks"] else ""
    line = (f"prediction check: {p['scenario']}{who} (base run's what-if): predicted {ms(p['predicted_step_s'])}"
            f" per step (saving {pct1(p['predicted_saving_frac'])}), head measured {ms(p['measured_step_s'])}"
            f" (saving {pct1(p['measured_saving_frac'])}); error of the step {signed_pct(p['step_error_frac'])}")
    if p["saving_error_frac"] is not None:
        line += f", of the saving {signed_pct(p['saving_error_frac'])}"
    if p["kind"] == "bound":
        line += ("; an upper bound of the saving: " + ("held" if p["bound_held"] else "BEATEN by the head run "
                                                       "(docs/what-if.md: where the model is wrong)"))
    return [line]


def _num(x: float | None, key: str = "") -> str:
    if x is None or missing(x):
        return MISSING
    if key.startswith("steps.time_s") or key.endswith("_s"):
        return ms(x, 2) if abs(x) < 10 else f"{fixed(x, 2)} s"
    if key.endswith("_frac") or key == "mfu.value":
        return fmt_frac(x)
    if float(x).is_integer():
        return str(int(x))
    return sig(x)


def _change(g: dict) -> str:
    c, ci, mode, key = g["change"], g["ci"], g["mode"], g["key"]
    if c is None:
        return MISSING
    if mode == "ratio":
        s = f"{fixed(c * 100, 1, signed=True)} %"
        if ci:
            s += f" [{fixed(ci[0] * 100, 1, signed=True)}, {fixed(ci[1] * 100, 1, signed=True)}]"
        return s
    if mode == "absolute":
        s = _num(c, key)
        if ci:
            s += f" [{_num(ci[0], key)}, {_num(ci[1], key)}]"
        return s
    if key.endswith("_frac") or key == "mfu.value":
        s = f"{fixed(c * 100, 1, signed=True)} pp"
        if ci:
            s += f" [{fixed(ci[0] * 100, 1, signed=True)}, {fixed(ci[1] * 100, 1, signed=True)}]"
        return s
    s = sig(c, signed=True)
    if ci:
        s += f" [{sig(ci[0], signed=True)}, {sig(ci[1], signed=True)}]"
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
    lines += [""] + explain_lines(d) + prediction_lines(d)
    lines += ["", f"base: {', '.join(d['base'])}", f"head: {', '.join(d['head'])}",
              f"step-time gates: {s['test']} test, {pct(s['confidence'])} CI; a gate fails only when its whole "
              f"interval is past its limit",
              f"result: {d['outcome']} (exit {d['exit_code']})"]
    return "\n".join(lines) + "\n"


def render_markdown(d: dict) -> str:
    icon = {0: "✅", 1: "❌", 3: "⚠️"}[d["exit_code"]]
    out = [f"### {icon} dtprof compare: {d['outcome']}", "", "| " + " | ".join(HEADER) + " |",
           "|" + "---|" * len(HEADER)]
    for r in _rows(d):
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |")
    out += [""] + [f"- {x.strip()}" for x in explain_lines(d) + prediction_lines(d)]
    s = d["settings"]
    out += ["", f"Base: {', '.join(f'`{b}`' for b in d['base'])} · Head: {', '.join(f'`{h}`' for h in d['head'])}"
            f" · step-time test: {s['test']}, {pct(s['confidence'])} CI (a gate fails only when the whole interval "
            f"is past its limit)"]
    return "\n".join(out) + "\n"


def render_json(d: dict) -> str:
    return json.dumps(d, indent=1) + "\n"


def render_junit(d: dict) -> str:
    """One <testcase> per gate; failed gates are <failure>, inconclusive and n/a ones <skipped>."""
    gates = d["gates"]
    blocked = bool(d["reasons"]) and d["exit_code"] == 3
    n_tests = len(gates) + len(d["parts"]["rows"]) + len(d["stragglers"]) + blocked
    failures = sum(g["verdict"] == FAIL for g in gates) + sum(r["verdict"] == FAIL for r in d["stragglers"])
    skipped = sum(g["verdict"] in (INCONCLUSIVE, NA) for g in gates) + blocked
    out = ['<?xml version="1.0" encoding="UTF-8"?>',
           f'<testsuites name="dtprof compare" tests="{n_tests}" failures="{failures}">',
           f'  <testsuite name="dtprof compare" tests="{n_tests}" failures="{failures}" errors="0" '
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
    for r, line in zip(d["parts"]["rows"], part_lines(d)):   # what moved: context for a failure, never a failure
        out.append(f'    <testcase classname="dtprof.compare.parts" name={quoteattr(r["part"])}>')
        out.append(f"      <system-out>{escape(line)}</system-out>")
        out.append("    </testcase>")
    for r, line in zip(d["stragglers"], straggler_lines(d)):
        name = quoteattr(f"rank {r['rank']}")
        out.append(f'    <testcase classname="dtprof.compare.stragglers" name={name}>')
        if r["verdict"] == FAIL:
            out.append(f'      <failure message={quoteattr(line)}>{escape(line)}</failure>')
        out.append(f"      <system-out>{escape(line)}</system-out>")
        out.append("    </testcase>")
    if blocked:
        msg = "inconclusive: " + "; ".join(d["reasons"])
        out.append('    <testcase classname="dtprof.compare" name="comparable">')
        out.append(f'      <skipped message={quoteattr(msg)}/>')
        out.append("    </testcase>")
    out += ["  </testsuite>", "</testsuites>"]
    return "\n".join(out) + "\n"


RENDERERS = {"text": render_text, "markdown": render_markdown, "json": render_json, "junit": render_junit}


def render_scaling_text(d: dict) -> str:
    """Text table for `dtprof compare --scaling`."""
    head = ["run", "GPUs", "step", "work/step", "per-GPU throughput", "efficiency", "lost/step",
            "= compute", "+ comm", "+ bubble", "+ data wait", "+ other", "(straggler wait)"]
    rows = [head]
    for r in d["runs"]:
        rows.append([r["name"], str(r["world_size"]), ms(r["step_time_s"]),
                     MISSING if r["work_per_step"] is None else f"{sig(r['work_per_step'])} {r['work_unit']}",
                     f"{sig(r['throughput_per_gpu'])} {r['throughput_unit']}",
                     fmt_frac(r["efficiency"]),
                     ms(r["lost_s"]), ms(r["lost_compute_s"]), ms(r["lost_comm_s"]), ms(r["lost_bubble_s"]),
                     ms(r["lost_data_wait_s"]), ms(r["lost_other_s"]), ms(r["lost_straggler_s"])])
    widths = [max(len(x[i]) for x in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += ["", d["explanation"]]
    return "\n".join(lines) + "\n"


def render_scaling_markdown(d: dict) -> str:
    text = render_scaling_text(d).split("\n\n")
    return "### dtprof scaling\n\n```\n" + text[0] + "\n```\n\n" + d["explanation"] + "\n"


SCALING_RENDERERS = {"text": render_scaling_text, "markdown": render_scaling_markdown,
                     "json": lambda d: json.dumps(d, indent=1) + "\n"}


def render(comparison: dict, options: dict | None = None) -> str:
    """The output of `dtprof compare` for ``comparison`` (analyzers/regression.py ``comparison``, or with
    ``options["scaling"]`` analyzers/scaling.py ``scaling``) in ``options["format"]`` (default text; ``RENDERERS``,
    ``SCALING_RENDERERS``). Raises KeyError for a format the result has no renderer for."""
    options = options or {}
    renderers = SCALING_RENDERERS if options.get("scaling") else RENDERERS
    return renderers[options.get("format", "text")](comparison)
