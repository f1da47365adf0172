"""The check that a run analysed from its node summaries equals the same run analysed from its raw tables
(docs/scale.md), shared by the synthetic tests (test_scale.py) and the real jobs' test modules."""
from __future__ import annotations

import pandas as pd

from dtprof.analyzers.summary import analyze
from dtprof.reader import open_run
from dtprof.rundir.writer import SUMMARY_COMPLETE, SUMMARY_DIR


def differences(a, b, path: str = "") -> list[str]:
    """Every field where two summary.json trees differ (the time the analysis took is not a result)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str) if k != "analysis_s"
                for d in differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def assert_summaries_equal_raw(run_dir, stored: bool = True) -> dict:
    """analyze(source="raw") and analyze() from the node summaries agree field by field, and so do the per
    rank-step table and the exposed communication behind the figures. ``stored``: every node has a summary on disk
    (the launcher wrote it). Returns the summary."""
    run = open_run(run_dir)
    if stored:
        missing = [nd.name for nd in run.node_dirs if not (nd / SUMMARY_DIR / SUMMARY_COMPLETE).exists()]
        assert not missing, f"no node summary in {missing}"
    raw = analyze(open_run(run_dir), source="raw")
    from_summaries = analyze(run)
    diff = differences(raw.summary, from_summaries.summary)
    assert not diff, f"{len(diff)} field(s) differ, e.g. {diff[:5]}"
    pd.testing.assert_frame_equal(raw.steps, from_summaries.steps)
    pd.testing.assert_frame_equal(raw.exposed.sort_values(["rank", "step", "dim", "op"], ignore_index=True),
                                  from_summaries.exposed.sort_values(["rank", "step", "dim", "op"],
                                                                     ignore_index=True))
    if stored:
        assert "spans" not in run._loaded, "the analysis from summaries read every span"
        assert "collectives" not in run._loaded, "the analysis from summaries read every collective"
        assert "steps" not in run._loaded, "the analysis from summaries read the steps table"
    return from_summaries.summary
