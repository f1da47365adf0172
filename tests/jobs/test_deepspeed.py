"""Real DeepSpeed jobs (examples/frameworks/train_deepspeed.py) under `dtprof run -- deepspeed --num_gpus 2`, on
CPU (DeepSpeed's CPU accelerator, gloo), checked against truths that are not dtprof's (issue 47):

- ZeRO-2 and ZeRO-3 (with gradient accumulation): the headline's exposed communication is within 5 points of the
  job's own clock of its training thread inside ``torch.distributed`` calls and ``Work.wait`` (the job wraps them
  itself), rank by rank and for the job; a step is an optimizer step; every rank is recorded and the launcher
  processes are not taken for ranks; ZeRO-3's final weights are bit-identical to a bare run's;
- DeepSpeed's PipelineEngine (2 stages, 4 micro-batches, 1F1B ``train_batch``), recognised as a pipeline from what
  its ranks do (analyzers/pipeinfer.py): bubble, bottleneck stage (the default uniform partition puts five of the
  eight blocks on stage 0) and a balanced-stages what-if. (Its prediction is not yet checked against a rerun with
  ``partition_method="parameters"``: on a 2-core VM shared with other suites the rerun's step differed from the
  uniform run's by more than the imbalance explains, and the what-if predicted no saving; issue 47 point 4.)

DeepSpeed compiles its shared-memory communication op with the C++ compiler on first use (about a minute, once per
machine): the module is skipped, saying why, where DeepSpeed or a C++ compiler is missing.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from breakdown_checks import assert_breakdown_adds_up
from conftest import REPO, dtprof, free_port
from torch_abort import returncode

JOB_TIMEOUT_S = 1500   # a job is ~1 min on a quiet 2-core VM; 10+ min seen on one shared by other suites
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * JOB_TIMEOUT_S),   # a fixture's job runs in its first test
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed"),
              pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")),
                                 reason="no C++ compiler for DeepSpeed's shared-memory comm op")]

SCRIPT = REPO / "examples" / "frameworks" / "train_deepspeed.py"
BIN = Path(sys.executable).parent
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
CLOCK_POINTS = 0.05          # issue 47: the headline within 5 points of the job's own clock
ZERO_ARGS = ("--steps", "8", "--dim", "256")
PIPE_ARGS = ("--pipeline", "--accum", "4", "--steps", "8", "--dim", "256")


class Job:
    def __init__(self, out: Path, args: tuple, profiled: bool = True, launcher: str = "deepspeed"):
        """The job under DeepSpeed's own launcher (``launcher="deepspeed"``) or torchrun (one Python that imports
        DeepSpeed fewer: the pipeline jobs, whose launcher is not what they test)."""
        cmd = ([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]
               if launcher == "deepspeed" else
               [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                str(free_port())]) + [str(SCRIPT), *args]
        if profiled:
            p = dtprof("run", "--out", out, "--no-report", "--", *cmd, env=ENV, timeout=JOB_TIMEOUT_S)
        else:
            import subprocess
            p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=REPO)
        assert returncode(p) == 0, f"{cmd} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        self.stdout = p.stdout
        assert len(self.weights()) == 2, p.stdout[-3000:]
        self.summary = assert_breakdown_adds_up(out) if profiled else None

    def clock(self) -> dict[int, list[list[float]]]:
        """rank -> per step [duration, communication] (s), the job's own clock."""
        # not anchored to line starts: two ranks printing at once may share a line of the relayed output
        return {int(r): json.loads(js)["steps"]
                for r, js in re.findall(r"clock (\d+) (\{\"steps\": \[.*?\]\]\})", self.stdout)}

    def weights(self) -> dict[int, str]:
        return {int(r): h for r, h in re.findall(r"weights (\d+) ([0-9a-f]{64})", self.stdout)}


@pytest.fixture(scope="module")
def zero2(tmp_path_factory):
    return Job(tmp_path_factory.mktemp("ds") / "zero2", ("--zero", "2", *ZERO_ARGS))


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    return Job(tmp_path_factory.mktemp("ds") / "zero3", ("--zero", "3", "--accum", "2", *ZERO_ARGS))


@pytest.fixture(scope="module")
def pipe_uniform(tmp_path_factory):
    return Job(tmp_path_factory.mktemp("ds") / "pipe", PIPE_ARGS, launcher="torchrun")


def _clock_frac(job: Job, rank: int | None = None) -> float:
    """The job's own share of its measured steps spent in torch.distributed calls and waits (one rank or all)."""
    steps = job.summary["steps"]["per_step_index"]
    clk = job.clock()
    pairs = [clk[r][i] for r in (clk if rank is None else [rank]) for i in steps]
    return sum(c for _, c in pairs) / sum(d for d, _ in pairs)


def _check_ranks_and_steps(job: Job, steps: int) -> None:
    run = job.summary["run"]
    assert run["world_size"] == 2 and not run.get("ranks_missing") and not run.get("unidentified_processes"), run
    assert sorted(job.clock()) == [0, 1]
    assert all(r["steps_recorded"] == steps for r in job.summary["ranks"]), job.summary["ranks"]


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_zero_headline_exposed_communication_is_the_jobs_own_clock(request, name):
    job = request.getfixturevalue(name)
    s = job.summary
    _check_ranks_and_steps(job, 8)   # optimizer steps: ZeRO-3 accumulates two micro-batches per step
    assert s["overlap"]["exposed_comm_frac"] == pytest.approx(_clock_frac(job), abs=CLOCK_POINTS)
    for r in s["ranks"]:
        mine = r["breakdown_s_per_step"]["exposed_comm"] / r["step_time_s_mean"]
        assert mine == pytest.approx(_clock_frac(job, r["rank"]), abs=CLOCK_POINTS), r
    # DeepSpeed reduces the gradients after loss.backward() returns: exposed, and said to be issued there
    issued = s["breakdown"]["exposed_comm_by_issued_s_per_step"]
    assert issued.get("after backward", 0) > 0, issued


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_zero_memory_ledger_is_each_ranks_share(request, name):
    """The memory ledger per rank against the job's own parameter count P (fp32 model, AdamW, N = 2 ranks) and
    ZeRO's accounting (DeepSpeed docs memory.rst: the fp32 master copy is optimizer state): ZeRO-2 holds the model's
    parameters whole (4P), its partition of the grads (4P/N) and of the optimizer state (fp32 master 4P/N + Adam's
    moments 8P/N); ZeRO-3 also partitions the parameters (4P/N). Within 2 % (ZeRO pads its partitions)."""
    job = request.getfixturevalue(name)
    counts = {int(r): int(n) for r, n in re.findall(r"parameters (\d+) (\d+)", job.stdout)}
    assert sorted(counts) == [0, 1]
    ranks = {r["rank"]: r for r in job.summary["memory"]["ranks"]}
    n = 2
    for rank, p in counts.items():
        r = ranks[rank]
        assert r["params_bytes"] == pytest.approx(4 * p if name == "zero2" else 4 * p / n, rel=0.02), r
        assert r["grads_bytes"] == pytest.approx(4 * p / n, rel=0.02), r
        assert r["optimizer_state_bytes"] == pytest.approx(12 * p / n, rel=0.02), r
    # the ranks hold equal shares: no imbalance
    assert job.summary["memory"]["imbalance"]["ranks"] == []


def test_zero3_final_weights_bit_identical_bare_and_profiled(zero3, tmp_path):
    bare = Job(tmp_path / "bare", ("--zero", "3", "--accum", "2", *ZERO_ARGS), profiled=False)
    assert len(zero3.weights()) == 2 and zero3.weights() == bare.weights()


def test_pipeline_engine_is_a_pipeline_with_its_bubble_and_bottleneck(pipe_uniform):
    s = pipe_uniform.summary
    pp = s["pipeline"]
    assert pp is not None, s.get("pipeline_reason")
    assert (pp["stages"], pp["microbatches"]) == (2, 4), pp
    assert s["breakdown"]["pipeline_ranks"] == [0, 1]
    # the uniform partition: five blocks on stage 0, three on stage 1
    assert pp["bottleneck_stage"] == 0 and pp["imbalance"] > 1.05, pp
    assert pp["bubble_frac"] > 0 and pp["theoretical_bubble_frac"] is not None, pp
    per = {st["stage"]: st for st in pp["per_stage"]}
    assert per[0]["compute_s_per_step"] > per[1]["compute_s_per_step"]
    assert any(w["scenario"] == "balanced_stages" for w in s["what_if"])
