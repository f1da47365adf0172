"""`dtprof triage`'s output: the verdict line, then one line per piece of evidence, or (``--json``) the verdict as
it is. Formats ``Analysis.triage`` only (analyzers/triage.py ``triage``'s result)."""
from __future__ import annotations

import json


def render(analysis, options: dict | None = None) -> str:
    """The triage of ``analysis`` (an ``Analysis``, or where the command had none, anything with its ``triage``):
    the text, or with ``options["json"]`` the result as JSON (its keys: verdict, culprit_ranks, collective,
    message, evidence)."""
    res = analysis.triage
    if (options or {}).get("json"):
        return json.dumps(res, indent=1, default=str)
    lines = [res["message"]]
    lines += [f"  - {e['message']}" for e in res["evidence"]]
    return "\n".join(lines)
