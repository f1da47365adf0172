"""`dtprof compare` explains its verdict: which part of the step moved (with the rank that moved it), stragglers
that got worse, configurations that differ, and a machine that changed. Synthetic summary.json files with the
keys `dtprof summary` writes (breakdown.per_step, run.identity, run.probe); real jobs are in
test_compare_explain_real.py."""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from conftest import compare_cli, write_json
from dtprof.analyzers import regression as rg
from dtprof.analyzers.scaling import scaling

PARTS = ("forward", "backward", "optimizer", "exposed_comm", "data_wait", "bubble", "other")


def run_summary(seed, n=60, backward_extra=0.0, slow_rank=1, world=2, script="aaa", probe_s=0.010,
                stragglers=(), device="cpu"):
    """A run whose critical rank's parts per step are jittered; ``backward_extra`` seconds more backward on
    ``slow_rank`` (its peers wait that long in exposed comm, which the critical rank does not)."""
    rng = np.random.default_rng(seed)
    parts = {"forward": 0.030, "backward": 0.060, "optimizer": 0.010, "exposed_comm": 0.015, "data_wait": 0.002,
             "bubble": 0.0, "other": 0.003}
    series = {p: (v * np.exp(rng.normal(0, 0.03, n)) if v else np.zeros(n)) for p, v in parts.items()}
    series["backward"] = series["backward"] + backward_extra
    steps = sum(series.values())
    by_dim = {"(none)": series["exposed_comm"].tolist()}
    by_op = {"all_reduce": series["exposed_comm"].tolist()}
    ranks = []
    for r in range(world):
        b = dict(parts, backward=parts["backward"] + (backward_extra if r == slow_rank else 0.0),
                 exposed_comm=parts["exposed_comm"] + (0.0 if r == slow_rank else backward_extra))
        ranks.append({"rank": r, "device": device, "breakdown_s_per_step": b,
                      "exposed_comm_s_per_step_by_dim": {"(none)": b["exposed_comm"]},
                      "exposed_comm_s_per_step_by_op": {"all_reduce": b["exposed_comm"]}})
    probe = probe_s * np.exp(rng.normal(0, 0.05, 14))
    return {"steps": {"per_step_time_s": steps.tolist(), "time_s": {"p50": float(np.median(steps))},
                      "count": n},
            "run": {"world_size": world, "identity": {"command": "python train.py", "script_sha256": script},
                    "versions": {"torch": "2.13.0", "dtprof": "0.1"},
                    "probe": {"cpu_start_s": probe[:7].tolist(), "cpu_end_s": probe[7:].tolist()}},
            "ranks": ranks, "stragglers": list(stragglers), "mfu": {"value": None}, "overlap": {},
            "pipeline": None,
            "breakdown": {"per_step": {"step": list(range(n)), "critical_rank": [0] * n,
                                       "parts": {p: v.tolist() for p, v in series.items()},
                                       "exposed_comm_by_dim": by_dim, "exposed_comm_by_op": by_op}}}



def test_backward_on_one_rank_is_named_as_what_moved(tmp_path):
    base = write_json(tmp_path, "b", run_summary(1))
    head = write_json(tmp_path, "h", run_summary(2, backward_extra=0.012))   # +10 % of the step, all backward on rank 1
    code, out = compare_cli(base, "--head", head, "--format", "json")
    d = json.loads(out)
    assert code == 1
    rows = d["parts"]["rows"]
    assert rows[0]["part"] == "backward" and rows[0]["rank"] == 1
    assert rows[0]["ci_s"][0] < 0.012 < rows[0]["ci_s"][1]
    assert rows[0]["rank_change_s"] == pytest.approx(0.012)
    assert all(r["part"] != "exposed_comm" for r in rows)   # the critical rank does not wait: no false mover
    code, text = compare_cli(base, "--head", head)
    assert re.search(r"backward: \+1[12]\.\d ms per step \[.*\]; most on rank 1 \(\+12\.0 ms\)", text)
    _, md = compare_cli(base, "--head", head, "--format", "markdown")
    assert re.search(r"- backward: \+1[12]\.\d ms per step", md)
    _, xml = compare_cli(base, "--head", head, "--format", "junit")
    names = [tc.get("name") for tc in ET.fromstring(xml).iter("testcase") if tc.get("classname") ==
             "dtprof.compare.parts"]
    assert names == [r["part"] for r in rows]


def test_identical_configurations_move_no_part(tmp_path):
    code, out = compare_cli(write_json(tmp_path, "b", run_summary(1)), "--head",
                            write_json(tmp_path, "h", run_summary(2)), "--format", "json")
    d = json.loads(out)
    assert code == 0 and d["parts"]["rows"] == [] and d["probe"]["moved"] is False


def test_a_straggler_that_became_persistent_fails_on_its_own(tmp_path):
    base = write_json(tmp_path, "b", run_summary(1, stragglers=[{"rank": 1, "kind": "transient"}]))
    head = write_json(tmp_path, "h", run_summary(2, stragglers=[{"rank": 1, "kind": "persistent"}]))
    code, out = compare_cli(base, "--head", head, "--format", "json")
    d = json.loads(out)
    assert code == 1, out
    assert d["gates"][0]["verdict"] == "pass"      # the step time did not move: the straggler row decides
    assert d["outcome"] == "regression: a straggler got worse: rank 1 became persistent"
    assert d["stragglers"] == [{"rank": 1, "what": "became persistent", "base": "transient", "head": "persistent",
                                "verdict": "fail"}]


def test_a_grown_what_if_saving_fails(tmp_path):
    b, h = run_summary(1), run_summary(2, stragglers=[{"rank": 1, "kind": "transient"}])
    b["what_if"] = [{"scenario": "straggler_removed", "ranks": [1], "saving_frac": 0.01}]
    h["what_if"] = [{"scenario": "straggler_removed", "ranks": [1], "saving_frac": 0.08}]
    code, out = compare_cli(write_json(tmp_path, "b", b), "--head", write_json(tmp_path, "h", h), "--format", "json")
    assert code == 1 and [r["what"] for r in json.loads(out)["stragglers"]] == ["new straggler", "saving grew"]
    h["stragglers"] = []                      # an unflagged rank's saving is run-to-run noise: no row
    code, out = compare_cli(write_json(tmp_path, "b", b), "--head", write_json(tmp_path, "h2", h), "--format", "json")
    assert code == 0 and json.loads(out)["stragglers"] == []


def test_different_world_size_or_script_is_inconclusive_unless_allowed(tmp_path):
    base = write_json(tmp_path, "b", run_summary(1))
    head = write_json(tmp_path, "h", run_summary(2, world=4, script="bbb"))
    code, out = compare_cli(base, "--head", head)
    assert code == 3
    assert "not comparable: world size 2 -> 4; script (SHA-256) aaa -> bbb" in out
    code, out = compare_cli(base, "--head", head, "--allow-different")
    assert code == 0 and "differs: world size: 2 -> 4" in out


def test_a_slower_machine_is_inconclusive_with_the_probe_named(tmp_path):
    base = write_json(tmp_path, "b", run_summary(1))
    head = write_json(tmp_path, "h", run_summary(2, backward_extra=0.012, probe_s=0.015))   # probe 50 % slower
    code, out = compare_cli(base, "--head", head, "--format", "json")
    d = json.loads(out)
    assert code == 3
    assert re.search(r"the machine ran [3-6]\d % slower on the probe", d["outcome"])
    assert d["parts"]["rows"][0]["part"] == "backward"   # what moved is still shown


def test_scaling_parts_add_up_to_the_lost_time():
    small, big = run_summary(1, world=2), run_summary(2, world=4, backward_extra=-0.030)
    d = scaling([("n2", small), ("n4", big)])
    r = d["runs"][1]
    parts = [r[f"lost_{k}_s"] for k in ("compute", "comm", "bubble", "data_wait", "other")]
    assert sum(parts) == pytest.approx(r["lost_s"], abs=1e-12)
    assert abs(r["lost_other_s"]) < 0.1 * abs(r["lost_s"])   # not a large negative remainder any more


def test_part_floor_is_half_the_step_tolerance():
    assert rg.PART_FLOOR_FRAC == rg.DEFAULT_STEP_TOLERANCE / 2


def test_a_different_model_parameter_count_is_not_comparable(tmp_path):
    b, h = run_summary(1), run_summary(2)
    b["run"]["model"] = {"parameters": 1234567, "parameters_by_rank": {"0": 1234567, "1": 1234567}}
    h["run"]["model"] = {"parameters": None, "parameters_by_rank": {"0": 700000, "1": 534567}}   # pipeline stages
    code, out = compare_cli(write_json(tmp_path, "b", b), "--head", write_json(tmp_path, "h", h))
    assert code == 3
    assert "model parameters 1,234,567 -> rank 0: 700,000, rank 1: 534,567" in out
    del h["run"]["model"]                     # unknown on a side (an imported trace) is not a difference
    assert compare_cli(write_json(tmp_path, "b", b), "--head", write_json(tmp_path, "h2", h))[0] == 0


def test_a_slower_gpu_is_inconclusive_with_the_gpu_probe_named(tmp_path):
    rng = np.random.default_rng(0)
    b, h = run_summary(1), run_summary(2, backward_extra=0.012)   # the head is slower, and so are its GPUs
    for s, sec in ((b, 0.0015), (h, 0.0015 * 1.3)):   # CUDA-event timings of the fixed matmul, 2 % jitter
        t = sec * np.exp(rng.normal(0, 0.02, 20))
        s["run"]["probe"].update(gpu_start_s=t[:10].tolist(), gpu_end_s=t[10:].tolist())
    code, out = compare_cli(write_json(tmp_path, "b", b), "--head", write_json(tmp_path, "h", h), "--format", "json")
    d = json.loads(out)
    # 1.3x with 2 % jitter: 29-31 % in the phase (start or end of the job) that moved furthest
    assert code == 3 and len(d["reasons"]) == 1
    assert re.fullmatch(r"the GPUs ran (29|30|31) % slower on the GPU probe \(head vs base\)", d["reasons"][0])
    assert d["probe"]["moved"] is False and d["gpu_probe"]["kind"] == "gpu"
    code, text = compare_cli(write_json(tmp_path, "b", b), "--head", write_json(tmp_path, "h", h))
    assert re.search(r"machine probe \(GPU, at the job's (start|end)\): head (29|30|31) % slower than base "
                     r"\[\+[23]\d, \+3\d %\] -- beyond its noise", text)


@pytest.mark.parametrize("probe_s, backward_extra, code, words", [
    (0.015, 0.012, 3, "the machine ran [3-6]\\d % slower on the probe"),   # a slower machine explains a slower head
    (0.005, 0.0, 3, "the machine ran [4-6]\\d % faster on the probe"),    # a faster one could hide a slowdown
    (0.005, 0.012, 1, "gate steps.time_s.p50 < \\+2% failed$"),          # ... but cannot explain one
    (0.015, 0.0, 0, "pass"),                    # a slower one cannot have hidden a slowdown behind a pass
])
def test_a_machine_that_changed_is_inconclusive_where_it_could_explain_the_verdict(tmp_path, probe_s, backward_extra,
                                                                                   code, words):
    base = write_json(tmp_path, "b", run_summary(1))
    head = write_json(tmp_path, "h", run_summary(2, backward_extra=backward_extra, probe_s=probe_s))
    got, out = compare_cli(base, "--head", head, "--format", "json")
    d = json.loads(out)
    assert got == code and re.search(words, d["outcome"]), d["outcome"]
    assert d["probe"]["moved"] and d["probe"]["explains_verdict"] is (code == 3)
    if code != 3:
        _, text = compare_cli(base, "--head", head)
        assert "-- beyond its noise: the machine changed, but a " in text


def _machine(summary: dict, compute_scale: float, cpu_wait: float, sleep_s: float = 0.0) -> dict:
    """The run as a machine that ran its compute ``compute_scale`` times as long would record it, its ranks waiting
    for a CPU ``cpu_wait`` of the step, every step sleeping ``sleep_s`` more (in 'other', which no machine
    shortens)."""
    parts = summary["breakdown"]["per_step"]["parts"]
    for p in ("forward", "backward", "optimizer"):
        parts[p] = [v * compute_scale for v in parts[p]]
    parts["other"] = [v + sleep_s for v in parts["other"]]
    steps = np.sum([np.asarray(v) for v in parts.values()], axis=0)
    summary["steps"]["per_step_time_s"] = steps.tolist()
    summary["steps"]["time_s"]["p50"] = float(np.median(steps))
    summary["cpu_wait"] = {"frac_of_step": cpu_wait, "s_per_step": cpu_wait * float(np.mean(steps))}
    return summary


def test_a_sleep_hidden_by_a_busy_base_fails_and_a_busy_head_is_inconclusive(tmp_path):
    # issue 50, the two real cases: (1) the base recorded beside a CPU hog (compute 30 % longer, its ranks waiting
    # for a CPU 20 % of the step), the head sleeping 10 ms more per step (+8 %): the step gate passes, the waits
    # fail it; (2) an identical configuration with hogs beside the head: a failed gate is the machine's, exit 3
    base = write_json(tmp_path, "b", _machine(run_summary(1), 1.3, 0.20))
    head = write_json(tmp_path, "h", _machine(run_summary(2), 1.0, 0.01, sleep_s=0.010))
    code, out = compare_cli(base, "--head", head, "--format", "json")
    d = json.loads(out)
    assert d["gates"][0]["verdict"] == "pass" and code == 1, (d["gates"][0], d["reasons"])
    assert d["drift"]["verdict"] == "fail" and d["drift"]["busy"]["busier"] == "base"
    assert d["drift"]["waits"]["ci_s"][0] > 0.02 * d["gates"][0]["base"], d["drift"]["waits"]
    assert any("waits" in x and "hid the slowdown" in x for x in d["reasons"]), d["reasons"]
    _, text = compare_cli(base, "--head", head)
    assert "base recorded on a busy machine: its ranks waited for a CPU 20% of the step" in text
    # the same pass without the sleep: a busy base could hide a slowdown of compute -> inconclusive, named
    head = write_json(tmp_path, "h2", _machine(run_summary(3), 1.0, 0.01))
    code, out = compare_cli(base, "--head", head, "--format", "json")
    assert code == 3 and any("the base was recorded on a busy machine" in x for x in json.loads(out)["reasons"])
    # (2) hogs beside the head: compute 20 % longer, its ranks waiting for a CPU 25 % of the step
    base = write_json(tmp_path, "b3", _machine(run_summary(4), 1.0, 0.01))
    head = write_json(tmp_path, "h3", _machine(run_summary(5), 1.2, 0.25))
    code, out = compare_cli(base, "--head", head, "--format", "json")
    d = json.loads(out)
    assert d["gates"][0]["verdict"] == "fail" and code == 3, d["outcome"]
    assert any("the head was recorded on a busy machine" in x for x in d["reasons"]), d["reasons"]


def test_a_failed_gate_between_two_saturated_recordings_is_inconclusive(tmp_path):
    # the shared VM's gate_power pool: identical configurations, both sides' ranks waiting for a CPU 77 % of the
    # step, the head's compute 25 % longer by the machine's other load: a failed gate the scheduler explains (exit 3,
    # not a regression). The same compute change on a machine that did not saturate stays a regression.
    base = write_json(tmp_path, "b", _machine(run_summary(1), 1.0, 0.77))
    head = write_json(tmp_path, "h", _machine(run_summary(2), 1.25, 0.77))
    code, out = compare_cli(base, "--head", head, "--format", "json")
    d = json.loads(out)
    assert d["gates"][0]["verdict"] == "fail" and code == 3, (d["outcome"], d["drift"])
    assert any("saturated" in x and "77%" in x for x in d["reasons"]), d["reasons"]
    base = write_json(tmp_path, "b2", _machine(run_summary(1), 1.0, 0.30))
    head = write_json(tmp_path, "h2", _machine(run_summary(2), 1.25, 0.30))
    assert compare_cli(base, "--head", head)[0] == 1
    # a pass between two saturated recordings is no pass either (gate_power --real: a +10 % sleep beside CPU hogs
    # passed against a base at 77 %, the head at 68 %, the probe saying the head's machine was the slower); here
    # the head the busier side, nothing else holding the pass up
    base = write_json(tmp_path, "b3", _machine(run_summary(1), 1.0, 0.70))
    head = write_json(tmp_path, "h3", _machine(run_summary(2), 1.0, 0.77))
    code, out = compare_cli(base, "--head", head, "--format", "json")
    d = json.loads(out)
    assert d["gates"][0]["verdict"] == "pass" and code == 3, (d["outcome"], d["drift"])
    assert any("saturated" in x for x in d["reasons"]), d["reasons"]
    head = write_json(tmp_path, "h4", _machine(run_summary(2), 1.0, 0.30))
    assert compare_cli(base, "--head", head)[0] != 1


def _job_probe(summary: dict, seconds: float, seed: int, n: int = 40, end_s: float | None = None) -> dict:
    """The run with the CPU probe during the job (dtprof/machine.py JobProbe: ``n`` CPU-time timings of ``seconds``,
    spread 10 %) and, with ``end_s``, its probe before and after the job at that median."""
    rng = np.random.default_rng(seed)
    summary["run"]["probe"]["cpu_job_s"] = (seconds * np.exp(rng.normal(0, 0.10, n))).tolist()
    if end_s is not None:
        t = end_s * np.exp(rng.normal(0, 0.05, 14))
        summary["run"]["probe"].update(cpu_start_s=t[:7].tolist(), cpu_end_s=t[7:].tolist())
    return summary


def test_a_fail_on_a_machine_slower_during_the_job_is_inconclusive_and_old_runs_compare_as_before(tmp_path):
    # issue 50, the quiet VM's false alarm: an identical configuration whose head ran every compute part 37 % longer,
    # its ranks' CPU wait as the base's (6 % vs 7 %) and the probe after the job saying its machine was 20 % faster
    # (within its band, but an interval that excludes no change). Only the probe during the job saw the machine slow.
    def pair(job: bool):
        b = _job_probe(_machine(run_summary(1), 1.0, 0.07), 0.0030, 11, end_s=0.010)
        h = _job_probe(_machine(run_summary(2), 1.37, 0.06), 0.0030 * 1.37, 12, end_s=0.008)
        if not job:   # the same runs as an older dtprof recorded them: no probe during the job
            b["run"]["probe"]["cpu_job_s"] = h["run"]["probe"]["cpu_job_s"] = None
        return write_json(tmp_path, f"b{job}", b), write_json(tmp_path, f"h{job}", h)
    base, head = pair(False)
    code, out = compare_cli(base, "--head", head, "--format", "json")
    d = json.loads(out)
    assert d["gates"][0]["verdict"] == "fail" and code == 1, d["outcome"]   # as before: the false alarm
    assert d["job_probe"] is None and d["probe"]["changed"] and d["probe"]["ratio"] < 1, d["probe"]
    base, head = pair(True)
    code, out = compare_cli(base, "--head", head, "--format", "json")
    d = json.loads(out)
    assert d["gates"][0]["verdict"] == "fail" and code == 3, d["outcome"]
    assert d["job_probe"]["changed"] and d["job_probe"]["ci"][0] > 1.2 and d["drift"]["head_machine"] == "slower"
    assert any(re.search(r"the machine ran 3\d ?% slower (for the head )?on the (CPU )?probe during the job", x)
               for x in d["reasons"]), d["reasons"]
    _, text = compare_cli(base, "--head", head)
    assert re.search(r"machine probe \(CPU, during the job\): head 3\d % slower than base", text), text


def test_the_probe_during_the_job_does_not_excuse_a_regression_on_an_unchanged_machine(tmp_path):
    # backward +12 ms (+10 % of the step) on rank 1, the machine the same during both jobs: still a regression; a
    # head one side only recorded the job probe of (an older base) compares on the other probes, as before
    base = write_json(tmp_path, "b", _job_probe(run_summary(1), 0.0030, 11))
    head = write_json(tmp_path, "h", _job_probe(run_summary(2, backward_extra=0.012), 0.0030, 12))
    code, out = compare_cli(base, "--head", head, "--format", "json")
    d = json.loads(out)
    assert code == 1 and not d["job_probe"]["changed"] and d["drift"]["head_machine"] is None, (d["outcome"],
                                                                                                  d["job_probe"])
    old = write_json(tmp_path, "old", run_summary(1))
    code, out = compare_cli(old, "--head", head, "--format", "json")
    assert code == 1 and json.loads(out)["job_probe"] is None


def test_a_sleep_hidden_by_a_machine_faster_during_the_job_fails(tmp_path):
    # the head sleeps 10 ms more per step (in 'other') while its machine ran its compute 30 % faster during the job,
    # which neither its ranks' CPU wait (both 1 %) nor the probes around the job saw: the gate passes on the step
    # time, the waits fail it (judged as machine_drift judges a faster head)
    base = write_json(tmp_path, "b", _job_probe(_machine(run_summary(1), 1.3, 0.01), 0.0039, 11))
    head = write_json(tmp_path, "h", _job_probe(_machine(run_summary(2), 1.0, 0.01, sleep_s=0.010), 0.0030, 12))
    code, out = compare_cli(base, "--head", head, "--format", "json")
    d = json.loads(out)
    assert d["gates"][0]["verdict"] == "pass" and code == 1, (d["gates"][0], d["reasons"])
    assert d["drift"]["head_machine"] == "faster" and d["drift"]["verdict"] == "fail", d["drift"]
    assert any("hid the slowdown" in x and "during the job" in x for x in d["reasons"]), d["reasons"]


def test_waits_that_grew_between_two_saturated_recordings_are_no_regression(tmp_path):
    # gate_power --real at load 7-16: identical configurations, both sides' ranks waiting for a CPU ~64 % of the
    # step, the head's machine faster during the job (its compute shorter) and its waits longer (its ranks waiting
    # for descheduled peers): the waits judged apart would fail it; between saturated recordings they measure the
    # scheduler, so the pass is inconclusive. The same runs on a machine that did not saturate fail.
    def pair(wait: float, tag: str):
        b = _job_probe(_machine(run_summary(1), 1.3, wait + 0.02), 0.0033, 11)   # within the probe's band
        h = _job_probe(_machine(run_summary(2), 1.0, wait, sleep_s=0.010), 0.0030, 12)
        return write_json(tmp_path, f"b{tag}", b), write_json(tmp_path, f"h{tag}", h)
    base, head = pair(0.63, "s")
    code, out = compare_cli(base, "--head", head, "--format", "json")
    d = json.loads(out)
    assert d["gates"][0]["verdict"] == "pass" and d["drift"]["waits"]["grew"] and code == 3, d["outcome"]
    # (named by the rule that comes first: waits no larger than the head's ranks' CPU wait, the scheduler's)
    assert any("the scheduler" in x for x in d["reasons"]), d["reasons"]
    base, head = pair(0.03, "q")
    assert compare_cli(base, "--head", head)[0] == 1


def test_waits_that_grew_no_more_than_the_heads_cpu_wait_are_the_schedulers(tmp_path):
    # CI's false alarm at 8c2de58 (test_compare_real): identical configurations, the base's ranks waiting for a CPU
    # 51 % of the step, the head's (CPU hogs beside it) 46 %; the head's compute shorter, its waits +7 ms a step
    # [+3, +12] against 47 ms a step of its ranks' CPU wait: a descheduled rank keeps its peer waiting at the next
    # collective, so those waits cannot say the code slowed (exit 3, named). The same waits with the head's ranks
    # waiting for a CPU 1 % of the step are a regression the busy base hid (exit 1).
    def pair(head_wait: float, tag: str):
        b = _machine(run_summary(1), 1.3, 0.51)
        h = _machine(run_summary(2), 1.0, head_wait, sleep_s=0.010)
        return write_json(tmp_path, f"b{tag}", b), write_json(tmp_path, f"h{tag}", h)
    base, head = pair(0.46, "busy")
    code, out = compare_cli(base, "--head", head, "--format", "json")
    d = json.loads(out)
    assert d["gates"][0]["verdict"] == "pass" and d["drift"]["waits"]["grew"] and code == 3, d["outcome"]
    assert any("no more than the head's ranks waited for a CPU" in x for x in d["reasons"]), d["reasons"]
    base, head = pair(0.01, "quiet")
    code, out = compare_cli(base, "--head", head, "--format", "json")
    assert code == 1 and any("hid the slowdown" in x for x in json.loads(out)["reasons"]), out


def test_a_pass_whose_steps_ran_faster_on_a_slower_machine_is_inconclusive(tmp_path):
    # gate_power --real at load 7-16: a +10 % sleep recorded beside CPU hogs ran 12-19 % faster than its base (the
    # base recorded while the machine's other load was heavier), the probe 3-5x slower for it: a slower machine can
    # only have slowed the head, unless the steps do not follow the machine, which they did not here. Steps that
    # did not move on the slower machine stay a pass.
    base = write_json(tmp_path, "b", run_summary(1))
    head = write_json(tmp_path, "h", _machine(run_summary(2, probe_s=0.040), 0.8, 0.0, sleep_s=0.010))
    code, out = compare_cli(base, "--head", head, "--format", "json")
    d = json.loads(out)
    assert d["gates"][0]["verdict"] == "pass" and d["gates"][0]["ci"][1] < -0.02 and code == 3, d["outcome"]
    assert d["probe"]["moved"] and d["probe"]["explains_verdict"] is True
    assert any(re.search(r"slower on the probe .*, yet the head's steps ran \d+ % faster", x) for x in d["reasons"])
    head = write_json(tmp_path, "h2", run_summary(3, probe_s=0.040))
    assert compare_cli(base, "--head", head)[0] == 0
