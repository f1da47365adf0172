"""`dtprof compare` on real torchrun jobs (gloo, CPU) recorded with `dtprof run`.

Two runs of one configuration must pass the default gate; a run whose rank 1 sleeps ~10 % of a step in every step
must fail the step-time gate with exit code 1; a corrupt summary must exit 2 naming the file.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train_ddp.py"
STEPS = 60

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not EXAMPLE.exists(), reason="examples/train_ddp.py is missing (lands with the launcher)"),
    pytest.mark.skipif(importlib.util.find_spec("dtprof.launcher") is None,
                       reason="dtprof.launcher is missing (dtprof run lands with the launcher)"),
]


def dtprof(*args, check=True, timeout=300):
    r = subprocess.run([sys.executable, "-m", "dtprof.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, cwd=REPO)
    if check and r.returncode != 0:
        raise AssertionError(f"dtprof {' '.join(map(str, args))} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


def record(out: Path, *train_args) -> Path:
    dtprof("run", "--out", out, "--", sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--standalone", EXAMPLE, "--steps", STEPS, *train_args)
    return out


def p50_s(run: Path) -> float:
    from dtprof.compare import load_summary

    return float(load_summary(run)[1]["steps"]["time_s"]["p50"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare_real")
    base = record(root / "base")
    same = record(root / "same")
    slow_ms = max(1, round(0.10 * p50_s(base) * 1e3))   # ~10 % of a step, every step, on rank 1
    slow = record(root / "slow", "--slow-rank", 1, "--slow-ms", slow_ms)
    return {"base": base, "same": same, "slow": slow, "slow_ms": slow_ms}


def test_two_runs_of_one_configuration_pass(runs):
    r = dtprof("compare", runs["base"], "--head", runs["same"], "--format", "json", check=False)
    d = json.loads(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert d["gates"][0]["key"] == "steps.time_s.p50" and d["gates"][0]["verdict"] == "pass"


def test_a_slow_rank_fails_the_step_time_gate(runs):
    r = dtprof("compare", runs["base"], "--head", runs["slow"], "--format", "json", check=False)
    d = json.loads(r.stdout)
    assert r.returncode == 1, r.stdout + r.stderr
    g = d["gates"][0]
    assert g["key"] == "steps.time_s.p50" and g["verdict"] == "fail"
    assert g["ci"][0] > 0.02            # confidently slower than the tolerance
    assert 0.04 < g["change"] < 0.30    # and by about the injected ~10 %


def test_junit_output_of_a_real_comparison(runs, tmp_path):
    out = tmp_path / "gates.xml"
    r = dtprof("compare", runs["base"], "--head", runs["slow"], "--format", "junit", "-o", out, check=False)
    assert r.returncode == 1
    assert "<failure" in out.read_text() and 'name="steps.time_s.p50 &lt; +' in out.read_text()


def test_corrupt_summary_exits_2_naming_the_file(runs, tmp_path):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(runs["same"], corrupt)
    summary = corrupt / "summary.json"
    text = summary.read_text() if summary.exists() else json.dumps({"steps": {}})
    summary.write_text(text[: len(text) // 2])
    r = dtprof("compare", runs["base"], "--head", corrupt, check=False)
    assert r.returncode == 2
    assert str(summary) in r.stderr and len(r.stderr.strip().splitlines()) == 1
