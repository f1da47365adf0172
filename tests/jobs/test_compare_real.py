"""`dtprof compare` on real torchrun jobs (gloo, CPU) recorded with `dtprof run`.

Runs of one configuration must pass the default gate; runs whose rank 1 sleeps inside backward in every step must
fail the step-time gate with exit code 1 and name backward and rank 1 as what moved; the same configuration run
while CPU-hogging processes load the machine is inconclusive with the machine named (exit 3, not 1); a run of
another world size is inconclusive unless --allow-different; a corrupt summary must exit 2 naming the file. See
`runs` for why the slowdown here is several times a step and not 10 %.

(A bigger model is not comparable: tests/jobs/test_analyzers_real.py, on its jobs.) CPU runs record no GPU probe and
say why; compare's handling of a GPU probe that moved is run on these real runs with GPU
probe rows written into node.json as the launcher records them on a GPU node (this machine has no GPU).

The machine probe (run.probe) can flag a real change of this shared machine's load between two recordings (other
jobs start or stop): then a comparison is rightly inconclusive (exit 3, the machine named) rather than a pass or a
fail, and the tests below accept exactly that outcome besides the expected one -- never the other verdict.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import conftest
from conftest import REPO
from dtprof.analyzers.regression import SATURATED_CPU_WAIT

EXAMPLE = REPO / "examples" / "train_ddp.py"
STEPS = 40
N_RUNS = 3
SLOWDOWN = 3.0   # rank 1's sleep, in base steps (see `runs`)

pytestmark = [
    pytest.mark.slow,
    # a hang guard above the default 600 s: the `runs` fixture records twelve jobs, 380 s on a VM ~3x slower than
    # a quiet one, and counts towards the first test's time
    pytest.mark.timeout(1500),
    pytest.mark.skipif(not EXAMPLE.exists(), reason="examples/train_ddp.py is missing (lands with the launcher)"),
    pytest.mark.skipif(importlib.util.find_spec("dtprof.launcher") is None,
                       reason="dtprof.launcher is missing (dtprof run lands with the launcher)"),
]


def dtprof(*args, check=True, timeout=300):
    r = conftest.dtprof(*args, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"dtprof {' '.join(map(str, args))} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


# ~30 ms steps: big enough that scheduler jitter on a 2-core machine is a small part of a step
MODEL = ("--dim", 128, "--seq", 64)


def record(out: Path, *train_args, nproc: int = 2) -> Path:
    """A run recorded into ``out``."""
    conftest.record(out, EXAMPLE, "--steps", STEPS, *MODEL, *train_args, nproc=nproc)
    return out


def p50_s(run: Path) -> float:
    from dtprof.compare import load_summary

    return float(load_summary(run)[1]["steps"]["time_s"]["p50"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three runs a side, recorded in turn (base, same, slow, same, base, slow, ...), pooled as a CI job should pool
    them.

    This machine (a 2-core VM) has a run-to-run spread of the median step time of about ±6 % (measured: 30-36 ms
    for one configuration, 34-41 ms on another day), so a ~10 % slowdown is at its noise floor: with three runs a
    side the default gate caught it in about half of our trials, which would make a flaky test. A sleep on one of
    two ranks sharing two cores also slows the step by less than its length (the other rank's threads use the
    freed core): sleeping a quarter of a step measured +11 %, +16 %; half a step inside forward +20-25 %, but half
    a step inside backward (the rank-1 sleep of this fixture, where peers overlap it with their own backward and
    the all-reduce) once passed the gate, and so did a whole step's length once in CI, on a machine whose other load
    slowed some runs ~2x: with three runs a side, one base run at 2x widens the run-level interval (a t interval on 4
    degrees of freedom) past a doubling. So rank 1 sleeps three steps' length in backward here (the step ~4x), which
    the gate must catch every time, whatever the load did to single runs; the 5 % case under a realistic noise model
    is measured by benchmarks/gate_power.py. Pooling makes run-to-run spread part of the interval, so identical
    configurations pass.
    """
    root = tmp_path_factory.mktemp("compare_real")
    base0 = record(root / "base0")
    slow_ms = max(1, round(SLOWDOWN * p50_s(base0) * 1e3))   # a share of a step, every step, on rank 1
    base, same, slow = [base0], [], []
    for i in range(N_RUNS):
        if i % 2:   # 'same' first in every other pair, so that neither side is always the later run of a pair
            same.append(record(root / f"same{i}"))
            base.append(record(root / f"base{i}"))
        else:
            if i:
                base.append(record(root / f"base{i}"))
            same.append(record(root / f"same{i}"))
        if i == N_RUNS - 1:   # right after the last 'same' run: the machine's other load is as alike as it gets
            hog = record_while_hogged(root / "hog")
            # issue 50: every rank sleeps a quarter of a base step more per step (idle host time, 'other'), recorded
            # right after the hogged run, as a head would be after a base recorded on a busy machine
            sleep_ms = max(1, round(0.25 * p50_s(base0) * 1e3))
            sleep = record(root / "sleep", "--sleep-ms", sleep_ms)
        slow.append(record(root / f"slow{i}", "--slow-rank", 1, "--slow-ms", slow_ms, "--slow-in", "backward"))
    ws1 = record(root / "ws1", nproc=1)
    return {"base": base, "same": same, "slow": slow, "slow_ms": slow_ms, "hog": hog, "sleep": sleep,
            "sleep_ms": sleep_ms, "ws1": ws1}


# Busy-looping processes, twice as many as this machine has cores plus one, so that the probe (one thread) gets a
# clearly smaller share of a core while they run (measured with 3 hogs on the 2-core VM, other helpers' jobs also
# running: the probe's median 3-4x slower). Other load on this shared machine varies from run to run, so the hog
# run is compared with the 'same' run recorded just before it (same configuration, nearest in time).
HOGS = 2 * (os.cpu_count() or 2) + 1


def record_while_hogged(out: Path) -> Path:
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(HOGS)]
    try:
        return record(out)
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def compare_json(*args) -> tuple[int, dict]:
    r = dtprof("compare", *args, "--format", "json", check=False)
    assert r.returncode in (0, 1, 3), r.stdout + r.stderr
    return r.returncode, json.loads(r.stdout)


def machine_changed(d: dict) -> bool:
    """Inconclusive only because the machine changed between recordings (this shared machine's load): its probe
    moved, or one side's ranks waited for a CPU more (analyzers/regression.py machine_drift)."""
    busy = (d["drift"] or {}).get("busy") or {}
    saturated = min(busy.get("base") or 0, busy.get("head") or 0) >= SATURATED_CPU_WAIT
    job = d.get("job_probe") or {}   # the probe during the job, which decides where both sides have it
    return d["exit_code"] == 3 and bool(d["probe"]) and (d["probe"]["moved"] or d["probe"]["changed"] or
                                                         bool(job.get("changed")) or bool(busy.get("busier")) or
                                                         saturated) and all(
        "machine ran" in x or "busy machine" in x for x in d["reasons"])


def saturated_only(d: dict) -> bool:
    """Inconclusive only because the run(s) were recorded on a saturated machine (this shared VM's load): both sides'
    ranks waited for a CPU SATURATED_CPU_WAIT of the step or more, a pass as much as a fail."""
    return d["exit_code"] == 3 and bool(d["reasons"]) and all("saturated" in x for x in d["reasons"])


def test_two_runs_of_one_configuration_pass(runs):
    # This VM's run-to-run spread of the median step (per-run p50 27.9-36.2 ms in four fixtures, a sigma of ~6-8 %)
    # is over ten times the 0.5 % the default 90 % interval was tuned for (docs/compare.md): there even the honest
    # run-level interval fails identical configurations in ~3 % of comparisons (benchmarks/gate_power.py's model
    # at sigma 7 %, three 40-step runs a side: 2.8 % of 400), and CI once failed here at +8.0 % on the bootstrap
    # alone. So this test decides at 99 %, as the docs advise on such a machine (0 of those 400 failed); the
    # slowdown tests below keep the default confidence.
    code, d = compare_json(*runs["base"], "--head", *runs["same"], "--confidence", 0.99)
    assert code == 0 or machine_changed(d), d
    g = d["gates"][0]
    assert g["key"] == "steps.time_s.p50", g
    if code == 3:
        # the machine's load changed between the recordings and explains the outcome: it ran slower for
        # the head runs, whose gate then failed, or faster, whose pass could have hidden a slowdown. Either the
        # probe moved beyond its band, or the ranks' own CPU wait (machine_drift) named the busier side
        if d["probe"].get("explains_verdict"):
            slower = d["probe"]["ratio"] > 1
        else:
            assert d["drift"]["verdict"] == "inconclusive", (d["drift"], d["probe"])
            slower = d["drift"]["head_machine"] == "slower"
        # both sides saturated: inconclusive whatever the gate said (the step times are the scheduler's)
        saturated = "saturated" in ((d["drift"] or {}).get("reason") or "")
        assert saturated or (g["verdict"] == "fail") == slower, (g, d["probe"], d["drift"])
    else:
        assert g["verdict"] == "pass", g
    assert d["identity"] == []          # same command, script, world size and devices


def test_a_rank_slowed_in_backward_fails_naming_backward_and_the_rank(runs):
    code, d = compare_json(*runs["base"], "--head", *runs["slow"])
    assert code == 1 or machine_changed(d), d
    top = d["parts"]["rows"][0]
    assert top["part"] == "backward" and top["rank"] == 1, d["parts"]
    assert top["ci_s"][0] > 0        # confidently longer; the sleep is slow_ms, the step grows by less (see runs)
    assert not any(r["blocking"] for r in d["identity"])   # only the command differs (its --slow-* flags)


def test_a_cpu_hog_during_the_head_run_is_the_machine_not_a_regression(runs):
    code, d = compare_json(runs["same"][-1], "--head", runs["hog"])
    # the hogs slowed the machine (its probe) and, by anything from 0 to +27 % on a quiet machine, the steps (ranks
    # waiting on communication keep much of their share): never a regression. Where the steps failed a gate the
    # slower machine explains it (inconclusive); where they passed, a slower machine cannot have hidden a slowdown
    assert d["probe"]["ratio"] > 1 + d["probe"]["tolerance"] and d["probe"]["moved"]
    failed = any(g["verdict"] == "fail" for g in d["gates"])
    # (a pass between two saturated recordings is inconclusive too: saturated_only; and so is one whose steps ran
    # confidently faster on the slower machine: they did not follow the machine)
    against = not failed and d["gates"][0]["ci"][1] < 0
    # a pass is inconclusive too where the probe during the job says the head's CPUs ran faster beyond its band
    # (the hogs queue the ranks, they need not slow a CPU; the base's machine may have had slower ones)
    job = d["job_probe"] or {}
    cpus_faster = not failed and job.get("moved") and job["ratio"] < 1 and any(
        "faster on the probe during the job" in x for x in d["reasons"])
    assert code == (3 if failed or against or cpus_faster else 0) or (not failed and saturated_only(d)), (
        d["outcome"], d["probe"], d["gates"])
    if not against:   # (a pass against the machine may be inconclusive for another machine reason first)
        assert d["probe"]["explains_verdict"] is failed
    if failed:
        assert any("the machine ran" in x and "slower on the probe" in x for x in d["reasons"]), d["reasons"]


def test_a_sleeping_head_after_a_busy_base_never_passes(runs):
    # issue 50: a head whose every rank sleeps a quarter of a step more (idle host time: the breakdown's 'other'),
    # its base recorded beside CPU hogs. The faster machine shortened the head's compute and hid the sleep in the
    # step time (the gate passed, "other +8.5 ms [+8.3, +9.6]" beside it); a sleep does not shorten on a faster
    # machine, so the step's waits are judged apart: the comparison fails, or is inconclusive naming the machine
    code, d = compare_json(runs["hog"], "--head", runs["sleep"])
    assert code in (1, 3), (d["outcome"], d["gates"][0], d["drift"], d["probe"])
    if code == 3:   # the machine changed between the recordings, and is named
        assert all("machine ran" in x or "busy machine" in x for x in d["reasons"]), d["reasons"]
    elif d["gates"][0]["verdict"] == "pass":   # hidden in the step time: found in the waits
        assert d["drift"]["waits"]["grew"] and any("waits" in x for x in d["reasons"]), d["reasons"]
    # The sleep is in the waits. Not necessarily against the hogged base: there the ranks' waits on a descheduled
    # peer grow too (CI once saw 23.2 ms of waits in the hogged base against 18.2 ms in the sleeping head), so it is
    # checked against the pooled base runs, by the job's own sleep: the waits grew by at least half of it
    code, d = compare_json(*runs["base"], "--head", runs["sleep"])
    waits = d["drift"]["waits"]
    assert waits["change_s"] > 0.5 * runs["sleep_ms"] / 1e3, (waits, runs["sleep_ms"])


def test_a_different_world_size_is_inconclusive_unless_allowed(runs):
    code, d = compare_json(runs["base"][0], "--head", runs["ws1"])
    assert code == 3 and any("world size 2 -> 1" in x for x in d["reasons"]), d["reasons"]
    code, d = compare_json(runs["base"][0], "--head", runs["ws1"], "--allow-different")
    assert not any("not comparable" in x for x in d["reasons"])
    assert any(x["key"] == "world size" for x in d["identity"])   # still shown


def test_a_slow_rank_fails_the_step_time_gate(runs):
    code, d = compare_json(*runs["base"], "--head", *runs["slow"])
    assert code == 1 or machine_changed(d), d
    g = d["gates"][0]
    assert g["key"] == "steps.time_s.p50", g
    if g["verdict"] == "pass":
        # Only where the machine ran faster for the slow runs than for the base ones (CI once saw this on a machine
        # whose other load slowed it ~2x for part of the suite): a faster machine can hide a slowdown from the step
        # gate, and its probe shows it. The comparison still never passes: the rank that got worse fails it (exit
        # 1), or the faster machine makes it inconclusive (exit 3, the machine named)
        p = d["job_probe"] or d["probe"]   # the probe during the job decides where both sides have it
        assert (p["changed"] and p["ratio"] < 1) or d["drift"]["busy"]["busier"] == "base", (g, p, d["drift"])
        if code == 3:
            assert any("faster" in x or "busy machine" in x for x in d["reasons"]), d["reasons"]
        else:
            assert code == 1 and any("a straggler got worse" in x or "waits" in x for x in d["reasons"]), \
                (code, d["reasons"])
        return
    assert g["verdict"] == "fail", g
    assert g["ci"][0] > 0.02            # confidently slower than the tolerance
    assert g["change"] > 0.05          # slower; by how much varies a lot on this VM (+11 % to +117 % measured)


def test_junit_output_of_a_real_comparison(runs, tmp_path):
    out = tmp_path / "gates.xml"
    r = dtprof("compare", *runs["base"], "--head", *runs["slow"], "--format", "junit", "-o", out, check=False)
    assert r.returncode in (1, 3)       # 3 only when the machine probe moved (see the module docstring)
    text = out.read_text()
    assert "<failure" in text and 'name="steps.time_s.p50 &lt; +' in text
    assert '<testcase classname="dtprof.compare.parts" name="backward">' in text


def test_corrupt_summary_exits_2_naming_the_file(runs, tmp_path):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(runs["same"][0], corrupt)
    summary = corrupt / "summary.json"
    text = summary.read_text() if summary.exists() else json.dumps({"steps": {}})
    summary.write_text(text[: len(text) // 2])
    r = dtprof("compare", runs["base"][0], "--head", corrupt, check=False)
    assert r.returncode == 2
    assert str(summary) in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_scaling_across_world_sizes_parts_add_up_to_the_lost_time(runs):
    r = dtprof("compare", "--scaling", runs["ws1"], runs["base"][0], "--format", "json")
    two = json.loads(r.stdout)["runs"][1]
    assert two["world_size"] == 2
    parts = [two[f"lost_{k}_s"] for k in ("compute", "comm", "bubble", "data_wait", "other")]
    assert sum(parts) == pytest.approx(two["lost_s"], rel=1e-9, abs=1e-12)
    assert abs(two["lost_other_s"]) <= abs(two["lost_s"])   # a remainder, not a large negative correction


def summary_of(run: Path) -> dict:
    from dtprof.compare import load_summary

    return load_summary(run)[1]


def test_each_run_records_the_cpu_probe_during_the_job(runs):
    # the launcher's thread timed its ~3 ms work every 0.5 s while the job ran, in its own CPU time: a few timings
    # at least in a job of seconds, each under the 0.5 s between them, its duty cycle a small share of one core
    for run in runs["base"]:
        node = json.loads(next(Path(run).glob("node-*/node.json")).read_text())
        t = node["probe"]["cpu_job_s"]
        assert len(t) >= 2 and all(0 < x < 0.5 for x in t), t
        assert sum(t) / node["duration_s"] < 0.02, (sum(t), node["duration_s"])
        assert summary_of(run)["run"]["probe"]["cpu_job_s"] == t   # one node: the pooled timings are its own
    code, d = compare_json(runs["base"][0], "--head", runs["base"][1])
    assert d["job_probe"]["phase"] == "job" and d["job_probe"]["line"].startswith("machine probe (CPU, during the job)")


def test_cpu_runs_have_no_gpu_probe_and_say_so(runs):
    probe = summary_of(runs["base"][0])["run"]["probe"]
    assert probe["gpu_start_s"] is None and probe["gpu_end_s"] is None
    assert probe["gpu_reason"] == "no GPU on this node (no /dev/nvidia* or /dev/kfd device)"
    code, d = compare_json(runs["base"][0], "--head", runs["same"][0])
    assert d["gpu_probe"] is None and "no GPU on this node" in d["gpu_probe_reason"]
    assert not any("GPU" in x for x in d["reasons"])
    text = dtprof("compare", runs["base"][0], "--head", runs["same"][0], check=False).stdout
    assert "machine probe (GPU): none -- base: no GPU on this node" in text


# GPU probe rows as dtprof/machine.py records them on a GPU node: per device, 5 CUDA-event timings of the fixed
# matmul work (about 1.5 ms on an H100; the figure only sets the scale, the test is about the ratio).
def gpu_rows(seconds: float, seed: int) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [{"index": i, "name": "NVIDIA H100 80GB HBM3",
             "timings_s": (seconds * np.exp(rng.normal(0, 0.02, 5))).tolist()} for i in range(2)]


def with_gpu_probe(run: Path, out: Path, seconds: float, seed: int) -> Path:
    """A copy of a real run whose node.json carries GPU probe rows; summary.json is dropped so that compare
    analyses the run (node.json -> summary's run.probe -> compare)."""
    shutil.copytree(run, out)
    (out / "summary.json").unlink(missing_ok=True)
    for node_json in out.glob("node-*/node.json"):
        node = json.loads(node_json.read_text())
        node["probe"].update(gpu_work="test rows", gpu_start=gpu_rows(seconds, seed),
                             gpu_end=gpu_rows(seconds, seed + 1), gpu_reason=None)
        node_json.write_text(json.dumps(node))
    return out


def test_a_gpu_probe_that_moved_is_the_machine_not_a_regression(runs, tmp_path):
    run = runs["same"][0]          # one run on both sides: only the GPU probe rows differ
    base = with_gpu_probe(run, tmp_path / "base", 0.0015, seed=1)
    code, d = compare_json(base, "--head", with_gpu_probe(run, tmp_path / "same", 0.0015, seed=3))
    assert (code == 0 or saturated_only(d)) and d["gpu_probe"]["moved"] is False and d["gpu_probe_reason"] is None, \
        d["reasons"]
    assert summary_of(base)["run"]["probe"]["gpu_devices"] == ["node 0:0 NVIDIA H100 80GB HBM3",
                                                               "node 0:1 NVIDIA H100 80GB HBM3"]
    # faster GPUs could hide a slowdown behind this pass: inconclusive
    code, d = compare_json(base, "--head", with_gpu_probe(run, tmp_path / "fast", 0.0015 / 1.4, seed=5))
    assert code == 3 and len(d["reasons"]) == 1, d["reasons"]
    assert re.fullmatch(r"the GPUs ran (2\d|30) % faster on the GPU probe \(head vs base\)", d["reasons"][0])
    # slower GPUs could only have slowed the head: a head that passed on them passed (the probe's line still shows it)
    code, d = compare_json(base, "--head", with_gpu_probe(run, tmp_path / "slowgpu", 0.0015 * 1.4, seed=5))
    assert code == 0 or saturated_only(d), d["reasons"]
    assert d["gpu_probe"]["moved"] and d["gpu_probe"]["explains_verdict"] is False, d["reasons"]
    # a head slowed in backward on slower GPUs: the machine may explain the slowdown, so it is not called a regression
    code, d = compare_json(base, "--head", with_gpu_probe(runs["slow"][0], tmp_path / "slow", 0.0015 * 1.4, seed=7))
    assert code == 3, d["outcome"]
    assert any(re.fullmatch(r"the GPUs ran [34]\d % slower on the GPU probe \(head vs base\)", x)
               for x in d["reasons"]), d["reasons"]
    assert d["gpu_probe"]["ci"][0] > 1 + d["gpu_probe"]["tolerance"]
