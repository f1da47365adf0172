"""`dtprof triage`'s text: the verdict line, then one line per piece of evidence. Formats the result of
analyzers/triage.py ``triage`` only (its ``--json`` output is that result as it is)."""
from __future__ import annotations


def format_text(res: dict) -> str:
    lines = [res["message"]]
    lines += [f"  - {e['message']}" for e in res["evidence"]]
    return "\n".join(lines)
