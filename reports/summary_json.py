"""summary.json as `dtprof summary --json` prints it: the Analysis' summary as it is (docs/summary-schema.md);
dtprof/rundir/writer.py ``save_summary`` writes the same keys into the run."""
from __future__ import annotations

import json


def render(analysis, options: dict | None = None) -> str:
    return json.dumps(analysis.summary, indent=2)
