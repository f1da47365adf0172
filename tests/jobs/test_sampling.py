"""Step sampling (collectors/runtime.py, "Sampling"): with detailed blocks, every step's time is still recorded on
every rank, the boundary-only steps carry no spans or collectives, the detailed blocks are the same steps on every
rank, the summary and the report say what was sampled, and the breakdown read from the detailed steps agrees with
the breakdown of the same job recorded in full detail."""
import json

import pytest

from conftest import dtprof_run, torchrun
from dtprof.reader import open_run

STEPS = 320


def _run(tmp_path, name, *opts):
    p = dtprof_run(tmp_path / name, "--no-nvml", *opts, "--", *torchrun("train_tiny.py", "--steps", STEPS),
                   cwd=tmp_path, timeout=600)
    return p, tmp_path / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("sampling")
    return _run(d, "sampled", "--sample-every", "16"), _run(d, "full", "--full-detail")


def test_every_step_timed_and_only_blocks_detailed(runs):
    (p, run_dir), _ = runs
    run = open_run(run_dir)
    steps = run.steps
    for rank in (0, 1):
        mine = steps[steps["rank"] == rank]
        assert sorted(mine["step"]) == list(range(STEPS))     # every step's time, boundary-only ones included
        assert (mine["end_ns"] > mine["start_ns"]).all()
        mine = mine.sort_values("step")
        assert (mine["start_ns"].to_numpy()[1:] == mine["end_ns"].to_numpy()[:-1]).all()   # each where the last ended
        assert (mine.loc[mine["step"] >= 32, "samples"] == 32).all()     # the job's batch, boundary-only steps too
        boundary = set(mine.loc[mine["detail"].fillna(1) == 0, "step"])
        # full detail before step 32, then blocks of 4 steps every 16
        assert boundary == {s for s in range(32, STEPS) if s % 16 >= 4}
    bsteps = steps.loc[steps["detail"].fillna(1) == 0, ["rank", "step"]]
    assert len(run.spans.merge(bsteps, on=["rank", "step"])) == 0
    colls = run.collectives
    assert len(colls) and len(colls.merge(bsteps, on=["rank", "step"])) == 0
    assert (colls["step"] >= 32).any()      # the detailed blocks after step 32 still record DDP's all-reduces
    summary = json.loads((run_dir / "summary.json").read_text())
    st = summary["steps"]
    assert st["boundary_only_count"] == len({s for s in range(32, STEPS) if s % 16 >= 4})
    # the FLOP-counted step may lie inside the warm-up (the leading slow steps run through it)
    kept_out = set(range(st["warmup_steps"])) | set(st["flops_counted_steps"])
    assert st["count"] == st["total_count"] - len(kept_out)
    assert st["sampling"]["period_steps"] == 16 and st["sampling"]["block_steps"] == 4
    assert "sampling: " in p.stdout and "with their times only" in p.stdout
    html = (run_dir / "report.html").read_text()
    assert "sampling: " in html and "with their times only" in html


def test_sampled_breakdown_agrees_with_full_detail(runs):
    (_, sampled), (_, full) = runs

    def shares(run_dir):
        ranks = json.loads((run_dir / "summary.json").read_text())["ranks"]
        out = {}
        for r in ranks:
            parts = r["breakdown_s_per_step"]
            total = sum(v for v in parts.values() if v)
            assert total == pytest.approx(r["step_time_s_mean"], rel=0.02)   # the parts add up to the step
            out[r["rank"]] = {k: (v or 0) / total for k, v in parts.items()}
        return out

    s, f = shares(sampled), shares(full)
    for rank in (0, 1):
        for part in f[rank]:
            # a boundary-only step read as detailed would put its whole time in "other" (~3/4 of the steps)
            assert abs(s[rank][part] - f[rank][part]) < 0.2, (rank, part, s[rank], f[rank])


def test_numerics_read_on_the_detailed_steps_only(runs):
    """The numerics part (collectors/numerics.py) reads nothing in boundary-only steps: the loss of every detailed
    step before its reads are priced (steps 0-9) and then of the detailed steps that are multiples of the
    ``read_every`` each rank priced; its fingerprints at steps 0, 4 and 8 and then at the detailed steps that are
    multiples of the interval each rank priced, equal on the two DDP replicas."""
    (_, run_dir), _ = runs
    run = open_run(run_dir)
    steps, h, meta = run.steps, run.health, run.meta
    detailed = {(int(r), int(s)) for r, s, d in zip(steps["rank"], steps["step"], steps["detail"].fillna(1)) if d}
    for rank in (0, 1):
        (fpv,) = meta[(meta["kind"] == "numerics") & (meta["rank"] == rank)]["value"]
        (rd,) = meta[(meta["kind"] == "numerics_reads") & (meta["rank"] == rank)]["value"]
        assert rd["from_step"] == 10 and rd["every"] >= 1 and not rd["full_detail"], rd
        mine = h[h["rank"] == rank]
        reads = {s for r, s in detailed if r == rank and (s < rd["from_step"] or s % rd["every"] == 0)}
        fps = {0, 4, 8} | {s for r, s in detailed if r == rank and s >= fpv["from_step"] and s % fpv["interval"] == 0}
        assert set(mine.loc[mine["loss"].notna(), "step"].astype(int)) == reads
        assert set(mine.loc[mine["param_fp"].notna(), "step"].astype(int)) == fps, (fpv, sorted(mine["step"]))
        assert set(mine["step"].astype(int)) == reads | fps       # no row for anything else
    fp = h.dropna(subset=["param_fp"])
    assert (fp.groupby("step")["param_fp"].nunique() == 1).all()


ANNOTATED_AND_MANUAL = """
import sys, torch
from dtprof.collectors import runtime
assert runtime.init(sys.argv[1], rank=0, sample_every=16)
m = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(m.parameters(), lr=0.01)
for i in range(200):                      # the optimizer ends each step
    m(torch.randn(8, 4)).sum().backward()
    if 100 <= i < 150:
        runtime.annotate(tokens=1000 + i)   # on detailed and boundary-only steps alike
    opt.step()
    opt.zero_grad()
for i in range(40):                       # the loop ends its steps itself: optimizer steps no longer do
    m(torch.randn(8, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    runtime.step()
"""


def test_boundary_only_steps_keep_annotations_and_the_manual_step_rule(tmp_path):
    """The boundary-only steps' own hook (collectors/boundary.py) leaves to the full one what it does not do: a
    step's annotations are on its row whether it was detailed or not, and once the loop calls dtprof.step() an
    optimizer step ends no step (one step per iteration of the loop, none doubled)."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", ANNOTATED_AND_MANUAL, str(tmp_path / "run")], check=True, timeout=300)
    steps = open_run(tmp_path / "run").steps.sort_values("step")
    assert list(steps["step"]) == list(range(240))          # 200 optimizer-ended steps, then one per iteration
    annotated = steps[(steps["step"] >= 100) & (steps["step"] < 150)]
    assert list(annotated["tokens"]) == [1000 + s for s in range(100, 150)]
    assert set(annotated["detail"].fillna(1)) == {0, 1}      # both kinds of step among them (null: detailed)
    assert (steps["start_ns"].to_numpy()[1:] == steps["end_ns"].to_numpy()[:-1]).all()
