"""One page says one thing (issue 47): on every synthetic and stored run of tests/unit, the headline's exposed
communication is the breakdown's, the exposed-communication finding fires exactly when that share passes its
threshold, and no what-if saves more by overlapping communication than the ranks expose (tests/breakdown_checks.py
``assert_headline_agrees``, which every real job's breakdown check runs too)."""
from __future__ import annotations

import pytest

from breakdown_checks import assert_headline_agrees
from conftest import TESTS
from dtprof.analyzers.options import AnalysisOptions
from dtprof.analyzers.summary import analyze
from synth import build_run, hand_run


def _zero_shape(path):
    # DeepSpeed ZeRO's step on two ranks: the gradient reduction after backward, the partitions' all-gather after
    # the optimizer, nothing hides either (45 % of each 100 ms step)
    spans, colls = [], []
    for step in range(6):
        t = step * 100
        for r in (0, 1):
            spans += [(r, "forward", t, t + 20), (r, "backward", t + 20, t + 50), (r, "optimizer", t + 80, t + 85)]
            colls += [(r, "all_reduce", 2 * step, t + 50, t + 80, 1024, 2),
                      (r, "all_gather", 2 * step + 1, t + 85, t + 100, 1024, 2)]
    return hand_run(path, spans, colls, steps=tuple((s, s * 100, s * 100 + 100) for s in range(6)), ranks=(0, 1))


RUNS = {
    "ddp": lambda p: build_run(p, world_size=2, steps=8),
    "ddp_slow_rank": lambda p: build_run(p, world_size=4, steps=8, slow_rank=1, slow_factor=1.5),
    "ddp_comm_bound": lambda p: build_run(p, world_size=2, steps=8, bucket_ms=30.0),
    "pipeline": lambda p: build_run(p, world_size=2, steps=8, pipeline_stages=2, p2p_ms=1.0),
    "zero_shape": _zero_shape,
}
STORED = sorted(p for p in (TESTS / "data/gpu").iterdir() if p.is_dir())


@pytest.mark.parametrize("name", sorted(RUNS))
def test_synthetic_run_headline_agrees_with_its_breakdown(tmp_path, name):
    assert_headline_agrees(analyze(RUNS[name](tmp_path / name), AnalysisOptions(warmup=0)).summary)


@pytest.mark.parametrize("path", STORED, ids=[p.name for p in STORED])
def test_stored_run_headline_agrees_with_its_breakdown(path):
    assert_headline_agrees(analyze(path).summary)


def test_zero_shape_reads_exposed_everywhere(tmp_path):
    s = analyze(_zero_shape(tmp_path / "z"), AnalysisOptions(warmup=0)).summary
    assert s["overlap"]["exposed_comm_frac"] == pytest.approx(0.45)
    assert [f["id"] for f in s["findings"] if f["id"] == "exposed_comm"]
    assert s["breakdown"]["exposed_comm_by_issued_s_per_step"] == {"after backward": pytest.approx(0.030),
                                                                   "between steps": pytest.approx(0.015)}
    overlap = next(w for w in s["what_if"] if w["scenario"] == "perfect_overlap")
    assert overlap["saving_frac"] == pytest.approx(0.45, abs=0.02)
