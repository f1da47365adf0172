"""`dtprof compare` on real torchrun jobs (gloo, CPU) recorded with `dtprof run`.

Runs of one configuration must pass the default gate; runs whose rank 1 sleeps in every step must fail the
step-time gate with exit code 1; a corrupt summary must exit 2 naming the file. See `runs` for why the slowdown is
about +20 % here and not 10 %.
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
STEPS = 40
N_RUNS = 3
SLOWDOWN = 0.50

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


# ~30 ms steps: big enough that scheduler jitter on a 2-core machine is a small part of a step
MODEL = ("--dim", 128, "--seq", 64)


def record(out: Path, *train_args) -> Path:
    dtprof("run", "--out", out, "--no-report", "--", sys.executable, "-m", "torch.distributed.run",
           "--nproc_per_node=2", "--standalone", EXAMPLE, "--steps", STEPS, *MODEL, *train_args)
    return out


def p50_s(run: Path) -> float:
    from dtprof.compare import load_summary

    return float(load_summary(run)[1]["steps"]["time_s"]["p50"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three runs a side, recorded in turn (base, same, slow, base, ...), pooled as a CI job should pool them.

    This machine (a 2-core VM) has a run-to-run spread of the median step time of about ±6 % (measured: 30-36 ms
    for one configuration, 34-41 ms on another day), so a ~10 % slowdown is at its noise floor: with three runs a
    side the default gate caught it in about half of our trials, which would make a flaky test. A sleep on one of
    two ranks sharing two cores also slows the step by less than its length (the other rank's threads use the
    freed core): sleeping a quarter of a step measured +11 %, +16 %. So rank 1 sleeps half a step here (about
    +20-25 % measured), which the gate must catch every time; the 5 % case under a realistic noise model is
    measured by benchmarks/gate_power.py. Pooling makes run-to-run spread part of the interval, so identical
    configurations pass.
    """
    root = tmp_path_factory.mktemp("compare_real")
    base0 = record(root / "base0")
    slow_ms = max(1, round(SLOWDOWN * p50_s(base0) * 1e3))   # a share of a step, every step, on rank 1
    base, same, slow = [base0], [], []
    for i in range(N_RUNS):
        if i:
            base.append(record(root / f"base{i}"))
        same.append(record(root / f"same{i}"))
        slow.append(record(root / f"slow{i}", "--slow-rank", 1, "--slow-ms", slow_ms))
    return {"base": base, "same": same, "slow": slow, "slow_ms": slow_ms}


def test_two_runs_of_one_configuration_pass(runs):
    r = dtprof("compare", *runs["base"], "--head", *runs["same"], "--format", "json", check=False)
    d = json.loads(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert d["gates"][0]["key"] == "steps.time_s.p50" and d["gates"][0]["verdict"] == "pass"


def test_a_slow_rank_fails_the_step_time_gate(runs):
    r = dtprof("compare", *runs["base"], "--head", *runs["slow"], "--format", "json", check=False)
    d = json.loads(r.stdout)
    assert r.returncode == 1, r.stdout + r.stderr
    g = d["gates"][0]
    assert g["key"] == "steps.time_s.p50" and g["verdict"] == "fail"
    assert g["ci"][0] > 0.02            # confidently slower than the tolerance
    assert g["change"] > 0.05          # slower; by how much varies a lot on this VM (+11 % to +117 % measured)


def test_junit_output_of_a_real_comparison(runs, tmp_path):
    out = tmp_path / "gates.xml"
    r = dtprof("compare", *runs["base"], "--head", *runs["slow"], "--format", "junit", "-o", out, check=False)
    assert r.returncode == 1
    assert "<failure" in out.read_text() and 'name="steps.time_s.p50 &lt; +' in out.read_text()


def test_corrupt_summary_exits_2_naming_the_file(runs, tmp_path):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(runs["same"][0], corrupt)
    summary = corrupt / "summary.json"
    text = summary.read_text() if summary.exists() else json.dumps({"steps": {}})
    summary.write_text(text[: len(text) // 2])
    r = dtprof("compare", runs["base"][0], "--head", corrupt, check=False)
    assert r.returncode == 2
    assert str(summary) in r.stderr and len(r.stderr.strip().splitlines()) == 1
