"""Real DeepSpeed jobs (examples/frameworks/train_deepspeed.py) under `dtprof run -- deepspeed --num_gpus 2`, on
CPU (DeepSpeed's CPU accelerator, gloo), checked against truths that are not dtprof's (issue 47):

- ZeRO-1, ZeRO-2 (``overlap_comm`` off and on) and ZeRO-3 (with gradient accumulation and four sub-groups), all
  with two parameter groups: the headline's exposed communication is within 5 points of the job's own clock of its
  training thread inside ``torch.distributed`` calls and ``Work.wait`` (the job wraps them itself), rank by rank and
  for the job; a step is an optimizer step (ZeRO steps the torch optimizer once per group or sub-group) and ends as
  ``engine.step()`` returns, its all-gather after the optimizer included (ZeRO-1/2); every rank
  is recorded and the launcher processes are not taken for ranks; the memory ledger is each rank's share, every
  group's gradients counted though ZeRO frees each after its own step; ZeRO-3's final weights are bit-identical to a
  bare run's; the ZeRO-1 job runs under DeepSpeed's launcher with a one-host hostfile (``launcher_command``);
- DeepSpeed's PipelineEngine (2 stages, 4 micro-batches, 1F1B ``train_batch``), recognised as a pipeline from what
  its ranks do (analyzers/pipeinfer.py): bubble, bottleneck stage and a balanced-stages what-if whose prediction
  is checked against the balanced partition itself. One job alternates two engines step by step (``--partition
  uniform,parameters``): the uniform partition's steps (six of the eight blocks on stage 0) and the balanced
  partition's (four and four), so that the busy 2-core machine's load hits both alike (between separate runs the
  balanced run's step moved with the load by more than the imbalance: tests/jobs/test_whatif_real.py says the same
  of its cases); the blocks' compute is mostly a stand-in for device time that holds no CPU (``--device-ms``), so
  that the balanced steps, which compute on both stages at once, do not wait for a CPU the uniform ones get;
- Accelerate with its DeepSpeed plugin (ZeRO-2) under ``accelerate launch --use_deepspeed``, and the Hugging Face
  Trainer's DeepSpeed integration (``TrainingArguments(deepspeed=...)``, ZeRO-2, two parameter groups, gradient
  accumulation 2) under DeepSpeed's launcher: both ranks recorded, a step per optimizer step (the Trainer's own
  count), ZeRO's reduction after backward and its gathers exposed; the Trainer's headline within 5 points of the
  job's own clock (examples/frameworks/comm_clock.py) and its final weights bit-identical to a bare run's;
- ZeRO-2 alternating two bucket sizes step by step (``--bucket 262144,4096``: one bucket flush a step against 43):
  the ``zero_bucket`` spans are the job's own count of its flushes, their reductions hold every gradient byte, the
  engine's own work in them is the job's own timing of it, and the one-bucket what-if (analyzers/zero_bucket.py)
  from the small-bucket steps predicts the saving the large-bucket steps measured;
- compiled as DeepSpeed users compile, ``engine.compile()``, ZeRO-2 with small buckets (its bucket flushes inside
  backward, under dtprof's ``zero_bucket`` spans), with inductor and with compiled autograd (the flushes then inside
  the compiled backward): Dynamo's own counters (graphs, graph breaks, recompiles, frames) are the bare job's on
  each rank, the steps, the forward, the FLOP
  count and the bucket flushes (the job's own count) are recorded, and with ``--no-count-flops`` the final weights
  are bit-identical to the bare job's (the counted step runs eager);
- DeepSpeed's CPU communication leaves shared-memory buffers behind: each job's are removed after it.

DeepSpeed compiles its shared-memory communication op with the C++ compiler on first use (about a minute, once per
machine): the module is skipped, saying why, where DeepSpeed or a C++ compiler is missing.
"""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from breakdown_checks import assert_breakdown_adds_up
from conftest import REPO, dtprof, dtprof_popen, free_port
from torch_abort import bare_returncode, returncode

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
# two parameter groups in sub-groups of >= 300,000 elements a rank (DeepSpeed fills one with whole parameters: three
# of the matrices' 131,072-element partitions each, so 3 + 3 + 2 matrices and the biases: four sub-groups); ZeRO-3
# steps the torch optimizer once per sub-group
ZERO3_ARGS = ("--zero", "3", "--accum", "2", "--decay-groups", "--sub-group-size", "300000", *ZERO_ARGS)
# even steps the uniform partition, odd steps the balanced one (two engines, examples/frameworks/train_deepspeed.py)
PIPE_ARGS = ("--pipeline", "--partition", "uniform,parameters", "--accum", "4", "--steps", "14", "--dim", "128",
             "--device-ms", "20")
BALANCED_POINTS = 0.10       # issue 47: the balanced-stages prediction within 10 % of the balanced pipeline's step


@contextlib.contextmanager
def shm_buffers_removed(port: int):
    """DeepSpeed's CPU communication leaves one shared-memory buffer per rank behind (``/dev/shm/
    deepspeed_allreduce_buffer_<uid>_<master addr>_<master port>_<rank>``, ~10 MB each: gigabytes over a suite):
    remove the ones of the job on ``port``, whatever its outcome (other jobs' are left alone)."""
    try:
        yield
    finally:
        for f in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
            with contextlib.suppress(OSError):
                os.remove(f)


def launcher_command(launcher: str, port: int, tmp: Path) -> list[str]:
    """``deepspeed``: DeepSpeed's launcher with ``--num_gpus 2``; ``hostfile``: DeepSpeed's launcher with a one-host
    hostfile (``localhost slots=2``), which it launches locally without ssh only when told not to check ssh and
    given the master's address (it checks ``ssh localhost`` and asks that host ``hostname -I`` otherwise: no ssh
    server here); ``torchrun``: one Python that imports DeepSpeed fewer (the pipeline jobs, whose launcher is not
    what they test)."""
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(port)]
    if launcher == "hostfile":
        hostfile = tmp / "hostfile"
        hostfile.write_text("localhost slots=2\n")
        return [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh_check", "--master_addr",
                "127.0.0.1", "--master_port", str(port)]
    return [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port)]


class Job:
    def __init__(self, out: Path, args: tuple, profiled: bool = True, launcher: str = "deepspeed",
                 options: tuple = ()):
        """The job under ``launcher`` (``launcher_command``); ``options``: `dtprof run`'s own."""
        port = free_port()
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = launcher_command(launcher, port, out.parent) + [str(SCRIPT), *args]
        with shm_buffers_removed(port):
            if profiled:
                p = dtprof("run", "--out", out, "--no-report", *options, "--", *cmd, env=ENV,
                           timeout=JOB_TIMEOUT_S)
            else:
                p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=REPO)
        code = returncode(p) if profiled else bare_returncode(p)
        assert code == 0, f"{cmd} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        self.stdout, self.out = p.stdout, out
        assert len(self.weights()) == 2, p.stdout[-3000:]
        self.summary = assert_breakdown_adds_up(out) if profiled else None

    def clock(self) -> dict[int, list[list[float]]]:
        return parse_clock(self.stdout)

    def weights(self) -> dict[int, str]:
        return parse_weights(self.stdout)


def parse_clock(stdout: str) -> dict[int, list[list[float]]]:
    """rank -> per step [duration, communication] (s), the job's own clock."""
    # not anchored to line starts: two ranks printing at once may share a line of the relayed output
    return {int(r): json.loads(js)["steps"] for r, js in re.findall(r"clock (\d+) (\{\"steps\": \[.*?\]\]\})", stdout)}


def parse_weights(stdout: str) -> dict[int, str]:
    return {int(r): h for r, h in re.findall(r"weights (\d+) ([0-9a-f]{64})", stdout)}


@pytest.fixture(scope="module")
def zero1(tmp_path_factory):
    # two parameter groups, as the HF Trainer makes: ZeRO-1/2 step the torch optimizer once per group, and one
    # engine.step() must still be one step (the headline test's steps_recorded)
    # under DeepSpeed's launcher with a one-host hostfile: both ranks recorded, as under --num_gpus (the others)
    return Job(tmp_path_factory.mktemp("ds") / "zero1", ("--zero", "1", "--decay-groups", *ZERO_ARGS),
               launcher="hostfile")


@pytest.fixture(scope="module")
def zero2(tmp_path_factory):
    return Job(tmp_path_factory.mktemp("ds") / "zero2", ("--zero", "2", "--decay-groups", *ZERO_ARGS))


@pytest.fixture(scope="module")
def zero2_overlap(tmp_path_factory):
    return Job(tmp_path_factory.mktemp("ds") / "zero2o",
               ("--zero", "2", "--overlap-comm", "--decay-groups", *ZERO_ARGS))


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    return Job(tmp_path_factory.mktemp("ds") / "zero3", ZERO3_ARGS)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    return Job(tmp_path_factory.mktemp("ds") / "pipe", PIPE_ARGS, launcher="torchrun")


def _clock_frac(summary: dict, clk: dict[int, list[list[float]]], rank: int | None = None) -> float:
    """The job's own share of its measured steps spent in torch.distributed calls and waits (one rank or all)."""
    steps = summary["steps"]["per_step_index"]
    pairs = [clk[r][i] for r in (clk if rank is None else [rank]) for i in steps]
    return sum(c for _, c in pairs) / sum(d for d, _ in pairs)


def _check_ranks_and_steps(job: Job, steps: int) -> None:
    run = job.summary["run"]
    assert run["world_size"] == 2 and not run.get("ranks_missing") and not run.get("unidentified_processes"), run
    assert sorted(job.clock()) == [0, 1]
    assert all(r["steps_recorded"] == steps for r in job.summary["ranks"]), job.summary["ranks"]


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero2_overlap", "zero3"])
def test_zero_headline_exposed_communication_is_the_jobs_own_clock(request, name):
    job = request.getfixturevalue(name)
    s = job.summary
    _check_ranks_and_steps(job, 8)   # optimizer steps: ZeRO-3 accumulates two micro-batches per step
    assert s["overlap"]["exposed_comm_frac"] == pytest.approx(_clock_frac(s, job.clock()), abs=CLOCK_POINTS)
    for r in s["ranks"]:
        mine = r["breakdown_s_per_step"]["exposed_comm"] / r["step_time_s_mean"]
        assert mine == pytest.approx(_clock_frac(s, job.clock(), r["rank"]), abs=CLOCK_POINTS), r
    # DeepSpeed reduces the gradients after loss.backward() returns (ZeRO-1/2 at the accumulation boundary; on the
    # CPU accelerator overlap_comm has no stream to hide them on, its Stream() is None): exposed, and said to be
    # issued there
    issued = s["breakdown"]["exposed_comm_by_issued_s_per_step"]
    assert issued.get("after backward", 0) > 0, issued


def test_engine_methods_are_deepspeeds_own_again_at_exit(zero2):
    """dtprof wraps DeepSpeed's ``engine.step()`` and ``train_batch()`` (collectors/engine_deepspeed.py) while it
    records, and puts them back as the rank's recording exits: the job's last exit hook (registered before torch is
    imported) finds them DeepSpeed's own code again, on both ranks, where after training they were dtprof's."""
    seen = re.findall(r"engine methods (\d+) training (\w+) exit (\w+)", zero2.stdout)
    assert sorted(seen) == [("0", "False", "True"), ("1", "False", "True")], zero2.stdout[-2000:]


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_zero_gather_after_the_optimizer_is_in_its_own_step(request, name):
    """A DeepSpeed step ends when ``engine.step()`` returns, as the job's own step does: ZeRO-1/2 all-gather the
    updated partitions after the optimizer, inside ``engine.step()`` (DeepSpeed's stage_1_and_2.py ``step()``), so
    the gathers a rank issues between each step's optimizer span and its next forward are that step's, inside its
    window (when the step ended at the torch optimizer's step they were the next step's, and the headline's window
    differed from the job's own at the warm-up edge)."""
    from dtprof.reader import open_run

    run = open_run(request.getfixturevalue(name).out)
    kind = run.spans["kind"].astype(str)
    opt, fwd = run.spans[kind == "optimizer"], run.spans[kind == "forward"]
    ends = run.steps.set_index(["rank", "step"])["end_ns"]
    co = run.collectives[run.collectives["op"].astype(str) == "all_gather"]
    assert len(opt) == 2 * 8, opt    # one optimizer span a step (two parameter groups), both ranks
    for o in opt.itertuples():
        later = fwd["start_ns"][(fwd["rank"] == o.rank) & (fwd["start_ns"] > o.end_ns)]
        until = later.min() if len(later) else ends[(o.rank, o.step)] + 1
        mine = co[(co["rank"] == o.rank) & (co["issue_ns"] > o.end_ns) & (co["issue_ns"] < until)]
        assert len(mine) and (mine["step"] == o.step).all(), (o, mine)
        assert (mine["end_ns"] <= ends[(o.rank, o.step)]).all(), (o, mine, ends[(o.rank, o.step)])


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


def test_what_fits_zero3_from_the_zero2_run_against_the_zero3_run(zero2, zero3):
    """A ZeRO-stage change predicted from the ZeRO-2 run's ledger and checked against a real ZeRO-3 run of the same
    model, on the ledger's categories: the ledger tells the grads and the optimizer's partition are already 1/N, so
    only ZeRO-3's lever is offered, sharding the parameters alone; its predicted persistent bytes (params + grads +
    optimizer state) within 10 % of the ZeRO-3 run's, rank by rank."""
    base = {r["rank"]: r for r in zero2.summary["memory"]["ranks"]}
    rerun = {r["rank"]: r for r in zero3.summary["memory"]["ranks"]}
    for fits in zero2.summary["memory"]["what_fits"]:
        levers = {x["lever"]: x for x in fits["levers"]}
        assert not {"zero1", "zero2"} & set(levers), levers
        rank = fits["rank"]
        predicted = base[rank]["persistent_bytes"] - levers["zero3_fsdp_full_shard"]["predicted_saving_bytes"]
        assert predicted == pytest.approx(rerun[rank]["persistent_bytes"], rel=0.10)
        assert levers["zero3_fsdp_full_shard"]["predicted_saving_bytes"] == pytest.approx(
            base[rank]["params_bytes"] / 2, rel=0.01)


def test_zero3_final_weights_bit_identical_bare_and_profiled(zero3, tmp_path):
    bare = Job(tmp_path / "bare", ZERO3_ARGS, profiled=False)
    assert len(zero3.weights()) == 2 and zero3.weights() == bare.weights()


def test_pipeline_engine_is_a_pipeline_with_its_bubble_and_bottleneck(pipe):
    s = pipe.summary
    pp = s["pipeline"]
    assert pp is not None, s.get("pipeline_reason")
    assert (pp["stages"], pp["microbatches"]) == (2, 4), pp
    assert s["breakdown"]["pipeline_ranks"] == [0, 1]
    # six blocks on stage 0 and two on stage 1 in the uniform steps, four and four in the balanced ones
    assert pp["bottleneck_stage"] == 0 and pp["imbalance"] > 1.05, pp
    assert pp["bubble_frac"] > 0 and pp["theoretical_bubble_frac"] is not None, pp
    per = {st["stage"]: st for st in pp["per_stage"]}
    assert per[0]["compute_s_per_step"] > per[1]["compute_s_per_step"]
    assert any(w["scenario"] == "balanced_stages" for w in s["what_if"])


def balanced_stages_facts(out: Path) -> dict:
    """The what-if's balanced stages replayed on the uniform partition's steps of the run in ``out``, beside the
    balanced partition's measured steps of the same job (medians: one step of a busy machine can take twice the
    others)."""
    from dtprof.analyzers import whatif
    from dtprof.analyzers.runmodel import build
    from dtprof.reader import open_run

    model = build(open_run(out))
    g = whatif.build(model)
    job = model.job.set_index("step")["time_s"]
    uniform = [s for s in sorted(model.measured_steps) if s % 2 == 0]
    balanced = [s for s in sorted(model.measured_steps) if s % 2 == 1]
    ident = whatif.job_steps(g, whatif.replay(g)).reindex(uniform)
    scen = whatif.job_steps(g, whatif.replay(g, whatif.balanced_stages(g))).reindex(uniform)
    predicted_saving = float(1.0 - scen.sum() / ident.sum())
    uniform_s, balanced_s = float(job.reindex(uniform).median()), float(job.reindex(balanced).median())
    return dict(uniform_s=uniform_s, balanced_s=balanced_s, predicted_s=uniform_s * (1.0 - predicted_saving),
                predicted_saving=predicted_saving, measured_saving=1 - balanced_s / uniform_s)


def test_balanced_stages_prediction_is_the_balanced_partitions_step(pipe):
    """The balanced-stages prediction from the uniform partition's steps against the balanced partition's steps.

    The blocks' compute is mostly a stand-in for device time (``--device-ms``: a wait that holds no CPU, as a GPU
    kernel's time is for the host thread): with the blocks' CPU work alone, the balanced steps (both stages computing
    at once) waited for a CPU on this shared 2-core machine and the uniform ones (the idle stage's core left to the
    busy one) did not, so the truth moved with the load by more than the imbalance (CI: predicted saving 4.6 %,
    and another run's balanced steps 4 % slower than the uniform ones). With the stand-in the imbalance (six blocks
    against two, 26 block-times a step against 20 balanced) does not depend on the load."""
    facts = balanced_stages_facts(pipe.out)
    # six blocks against two: a prediction of no saving, or of the uniform step, fails here
    assert facts["predicted_saving"] > BALANCED_POINTS, facts
    assert facts["predicted_s"] == pytest.approx(facts["balanced_s"], rel=BALANCED_POINTS), facts


# even steps one 262,144-element bucket (all 136,192 gradient elements: one flush), odd steps 4,096-element buckets
# (43 flushes of whole parameters): two engines in one job, so that the shared machine's load hits both alike
BUCKETS = (262144, 4096)
BUCKET_ARGS = ("--zero", "2", "--dim", "16", "--blocks", "64", "--steps", "40", "--bucket", ",".join(map(str, BUCKETS)),
               "--time-flushes")
# the one-bucket prediction's saving within 50 % of the measured saving: benchmarks/zero_bucket_whatif.py read it
# within 25 % in 13 of 14 alternating jobs, -35 % in the 14th (load 14) and -29 % in a 15th (docs/what-if.md); this
# test read -40 % in a fresh-clone CI run (the suite's other jobs beside it: both halves of the job ~30 % under),
# where the 43 flushes' own engine work (9 ms a step more than one flush's, which the model keeps) and 43 blocking
# calls' waits for a CPU widen the gap; the measured saving of each half of one job's steps differed by up to 52 %.
# A prediction of no saving, or of twice the saving, still fails
ONE_BUCKET_TOLERANCE = 0.50


@pytest.fixture(scope="module")
def zero2_buckets(tmp_path_factory):
    return Job(tmp_path_factory.mktemp("ds") / "zero2b", BUCKET_ARGS)


def test_zero2_bucket_flushes_and_config_are_recorded(zero2_buckets):
    """Each engine's ZeRO config is in meta, each step's ``zero_bucket`` spans are the job's own count of its bucket
    flushes (``--time-flushes``: the job wraps ``reduce_ipg_grads`` itself), and the collectives inside them hold
    every gradient byte in both kinds of step (the job's own parameter count, fp32)."""
    from dtprof.analyzers import zero_bucket
    from dtprof.analyzers.runmodel import RunModel
    from dtprof.reader import open_run

    run = open_run(zero2_buckets.out)
    meta = run.table("meta")
    cfg = list(meta.loc[meta["kind"] == "deepspeed_zero", "value"])
    assert sorted((v["reduce_bucket_size"], v["stage"], v["overlap_comm"]) for v in cfg) == sorted(
        [(b, 2, False) for b in BUCKETS] * 2), cfg
    own = {int(r): [int(f[0]) for f in json.loads(js)["steps"]]
           for r, js in re.findall(r"flush (\d+) (\{\"steps\": \[.*?\]\]\})", zero2_buckets.stdout)}
    spans = run.table("spans")
    spans = spans[spans["kind"] == "zero_bucket"]
    recorded = spans.groupby(["rank", "step"]).size()
    assert sorted(own) == [0, 1], zero2_buckets.stdout[-2000:]
    for r, counts in own.items():
        assert [int(recorded.get((r, s), 0)) for s in range(len(counts))] == counts, (r, counts)
        assert set(counts[0::2]) == {1} and min(counts[1::2]) > 1, counts   # the job's alternation
    n_params = {int(r): int(n) for r, n in re.findall(r"parameters (\d+) (\d+)", zero2_buckets.stdout)}
    assert len(n_params) == 2 and len(set(n_params.values())) == 1, zero2_buckets.stdout[-2000:]
    model = RunModel.of(run)
    calls = zero_bucket.bucket_calls(model)
    per_step = calls.groupby(["step", "rank"])["in_bytes"].sum()
    assert len(per_step) == 2 * 40 and (per_step == 4 * n_params[0]).all(), per_step
    # the engine's own work in the flushes (span less the reductions inside) against the job's own timing of the same
    # calls (flush_s - comm_s): 0.0-0.6 % apart seen, the other's wrapper around each call; 10 % leaves room for load
    own_work = zero_bucket.engine_work(model)
    job_work = {int(r): [f[1] - f[2] for f in json.loads(js)["steps"]]
                for r, js in re.findall(r"flush (\d+) (\{\"steps\": \[.*?\]\]\})", zero2_buckets.stdout)}
    for r, work in job_work.items():
        for kind in (0, 1):     # large-bucket steps, small-bucket steps
            steps = [s for s in range(4, len(work)) if s % 2 == kind]
            ours = sorted(float(own_work[(s, r)]) for s in steps)[len(steps) // 2]
            theirs = sorted(work[s] for s in steps)[len(steps) // 2]
            assert ours == pytest.approx(theirs, rel=0.10), (r, kind, ours, theirs)


def test_zero2_one_bucket_prediction_is_the_large_buckets_step(zero2_buckets):
    """The one-bucket prediction (analyzers/zero_bucket.py) from the small-bucket steps against the large-bucket
    steps of the same job: the predicted saving (median small step less median predicted step) within
    ONE_BUCKET_TOLERANCE of the measured one (median small step less median large step). The steps of each kind are
    told apart by their flush spans (1 against 43), checked against the job's own alternation (even steps large)."""
    from dtprof.analyzers import zero_bucket
    from dtprof.analyzers.runmodel import RunModel
    from dtprof.reader import open_run

    model = RunModel.of(open_run(zero2_buckets.out))
    flushes = zero_bucket.flushes_per_step(model)
    small = flushes.index[flushes > 1].to_numpy()
    large = flushes.index[flushes == 1].to_numpy()
    assert len(small) >= 10 and len(large) >= 10 and (small % 2 == 1).all() and (large % 2 == 0).all(), flushes
    t = zero_bucket.one_bucket(model, small)
    job = model.job.set_index("step")["time_s"]
    measured = float(job.reindex(small).median() - job.reindex(large).median())
    predicted = float(t["measured_s"].median() - t["predicted_s"].median())
    facts = {"measured_saving_s": measured, "predicted_saving_s": predicted, "load": os.getloadavg()}
    assert measured > 0, facts       # 43 blocking reductions a step against one: the small buckets' steps are longer
    assert predicted == pytest.approx(measured, rel=ONE_BUCKET_TOLERANCE), facts
    entry = [w for w in zero2_buckets.summary["what_if"] if w["scenario"] == "zero_one_bucket"]
    assert len(entry) == 1 and "CPU only" in entry[0]["basis"], zero2_buckets.summary["what_if"]
    assert entry[0]["saving_frac"] == pytest.approx(predicted / float(t["measured_s"].median()), rel=1e-9), entry


def test_zero2_default_bucket_has_nothing_to_merge(zero2):
    """At DeepSpeed's default bucket (5e8 elements, more than the model's 2.1 M) each step flushes once: no
    one-bucket prediction, and the what-if says why."""
    skipped = {w["scenario"]: w["reason"] for w in zero2.summary["what_if_skipped"]}
    assert "one ZeRO bucket already" in skipped.get("zero_one_bucket", ""), zero2.summary["what_if_skipped"]
    assert not [w for w in zero2.summary["what_if"] if w["scenario"] == "zero_one_bucket"], zero2.summary["what_if"]


# Compiled as DeepSpeed users compile, engine.compile() (the model's Module.compile()), ZeRO-2 with 4,096-element
# buckets (several bucket flushes a step, each under dtprof's zero_bucket span): with inductor (DeepSpeed's default
# backend on CPU), its flushes inside the eager backward; and with compiled autograd (the backward compiled too, with
# inductor: Dynamo traces ZeRO-2's gradient hooks, the flushes and dtprof's wrapper of them included, 52 graph
# breaks a rank at the collectives), which needs static shapes: with dynamic ones it fails bare (torch 2.13 /
# DeepSpeed 0.19.8, Dynamo's "sources must not be empty for symbol" at a guard of the hooks' graph)
COMPILE_STEPS = 6
COMPILE_ARGS = ("--dim", "16", "--blocks", "8", "--steps", str(COMPILE_STEPS), "--bucket", "4096", "--time-flushes")
COMPILED = {"zero2_compiled": ("--zero", "2", "--compile", "inductor", *COMPILE_ARGS),
            "zero2_compiled_autograd": ("--zero", "2", "--compile", "aot_eager", "--compiled-autograd",
                                        "--compile-kwargs", '{"dynamic": false}', *COMPILE_ARGS)}


def parse_dynamo(stdout: str) -> dict[int, dict]:
    """rank -> Dynamo's own counters at the job's end (graphs, graph_breaks, recompiles)."""
    return {int(r): json.loads(js) for r, js in re.findall(r"dynamo (\d+) (\{.*?\})", stdout)}


def bare_and_profiled_job(d: Path, args: tuple) -> tuple[Job, Job]:
    return Job(d / "bare", args, profiled=False), Job(d / "run", args)


@pytest.fixture(scope="module")
def zero2_compiled(tmp_path_factory):
    """The compiled ZeRO-2 job bare and under `dtprof run`: (bare, profiled)."""
    return bare_and_profiled_job(tmp_path_factory.mktemp("ds_compiled"), COMPILED["zero2_compiled"])


@pytest.fixture(scope="module")
def zero2_compiled_autograd(tmp_path_factory):
    """The ZeRO-2 job compiled with compiled autograd, bare and under `dtprof run`: (bare, profiled)."""
    return bare_and_profiled_job(tmp_path_factory.mktemp("ds_compiled_ca"), COMPILED["zero2_compiled_autograd"])


def assert_same_dynamo_counters(bare: Job, prof: Job) -> None:
    b, p = parse_dynamo(bare.stdout), parse_dynamo(prof.stdout)
    assert sorted(b) == sorted(p) == [0, 1], (bare.stdout[-2000:], prof.stdout[-2000:])
    assert p == b, (b, p)
    assert all(c["graphs"] >= 1 for c in b.values()), b       # the model was compiled


@pytest.mark.parametrize("name", list(COMPILED))
def test_engine_compile_stays_compiled_under_dtprof(request, name):
    """issue 47 point 3, compile forms kept compiled: under `dtprof run` Dynamo's own counters (graphs, graph breaks,
    recompiles) are the bare job's on each rank, and so is the number of frames Dynamo was handed: none of dtprof's
    (compile_watch.skip_our_code; under compiled autograd dtprof's bucket-flush wrapper and its span rows reached
    Dynamo, three frames more a rank, until they were marked skipped too)."""
    assert_same_dynamo_counters(*request.getfixturevalue(name))


def test_engine_compile_final_weights_bit_identical_without_the_flop_count(zero2_compiled, tmp_path):
    """The compiled ZeRO-2 job's final weights, profiled with ``--no-count-flops``, bit-identical to the bare job's
    (and Dynamo's counters the same again). With the FLOP count (the default) they are not: its counted step runs
    eager (``force_eager``, collectors/flops.py), and eager rounds differently from inductor's kernels, so the last
    bits of the weights differ from that step on (a job whose compiled code computes as eager does, ``aot_eager``,
    came out bit-identical either way)."""
    bare, _ = zero2_compiled
    prof = Job(tmp_path / "run", COMPILED["zero2_compiled"], options=("--no-count-flops",))
    assert_same_dynamo_counters(bare, prof)
    assert prof.weights() == bare.weights()


@pytest.mark.parametrize("name", list(COMPILED))
def test_engine_compile_steps_and_bucket_spans_are_recorded(request, name):
    """dtprof recorded the compiled job: every optimizer step of both ranks, the compiled model's forward, its FLOP
    count, and each step's ``zero_bucket`` spans are the job's own count of its bucket flushes (``--time-flushes``)."""
    from dtprof.reader import open_run

    _, prof = request.getfixturevalue(name)
    _check_ranks_and_steps(prof, COMPILE_STEPS)
    spans = open_run(prof.out).table("spans")
    for kind in ("forward", "flops_count"):       # the compiled forward timed, FLOPs counted (the MFU)
        assert set(spans.loc[spans["kind"] == kind, "rank"]) == {0, 1}, (kind, spans)
    recorded = spans[spans["kind"] == "zero_bucket"].groupby(["rank", "step"]).size()
    own = {int(r): [int(f[0]) for f in json.loads(js)["steps"]]
           for r, js in re.findall(r"flush (\d+) (\{\"steps\": \[.*?\]\]\})", prof.stdout)}
    assert sorted(own) == [0, 1], prof.stdout[-2000:]
    for r, counts in own.items():
        assert min(counts) > 1, counts      # small buckets: several flushes a step
        assert [int(recorded.get((r, s), 0)) for s in range(len(counts))] == counts, (r, counts)


ACCELERATE_STEPS = 6


def framework_job(out: Path, command_on_port) -> tuple:
    """A framework's DeepSpeed job (``command_on_port(port)``: its launcher's command line) under `dtprof run`:
    (the completed process, its summary)."""
    port = free_port()
    cmd = command_on_port(port)
    with shm_buffers_removed(port):
        p = dtprof("run", "--out", out, "--no-report", "--", *cmd, env=ENV, timeout=JOB_TIMEOUT_S)
    assert returncode(p) == 0, f"{cmd} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p, assert_breakdown_adds_up(out)


@pytest.fixture(scope="module")
def accelerate_zero2(tmp_path_factory):
    """examples/frameworks/train_accelerate.py with Accelerate's DeepSpeed plugin (ZeRO-2) under `accelerate launch
    --use_deepspeed`, profiled."""
    return framework_job(tmp_path_factory.mktemp("ds") / "accelerate", lambda port: [
        str(BIN / "accelerate"), "launch", "--num_machines", "1", "--num_processes", "2", "--use_deepspeed",
        "--zero_stage", "2", "--main_process_port", str(port),
        str(REPO / "examples" / "frameworks" / "train_accelerate.py"), "--steps", str(ACCELERATE_STEPS),
        "--deepspeed", "2"])


def test_accelerate_deepspeed_is_recorded_as_zero_with_its_communication_phases(accelerate_zero2):
    p, s = accelerate_zero2
    run = s["run"]
    # both ranks, not the accelerate CLI nor torchrun's agent; one main process (the data sharded over two)
    assert run["world_size"] == 2 and not run.get("ranks_missing") and not run.get("unidentified_processes"), run
    assert len(re.findall(r"final loss", p.stdout)) == 1, p.stdout[-2000:]
    # a step is an optimizer step: DeepSpeed's engine.step() inside accelerator.backward(), not the plugin's no-op
    # optimizer.step() after it
    assert all(r["steps_recorded"] == ACCELERATE_STEPS for r in s["ranks"]), s["ranks"]
    # ZeRO-2: the gradients reduced after backward, the updated partitions gathered after the optimizer step; all
    # of it blocks the training thread on CPU, in the headline
    issued = s["breakdown"]["exposed_comm_by_issued_s_per_step"]
    assert issued.get("after backward", 0) > 0, issued
    assert s["overlap"]["exposed_comm_frac"] > 0
    assert "all_gather" in s["breakdown"]["exposed_comm_by_op_s_per_step"], s["breakdown"]


HF_STEPS, HF_ACCUMULATE = 4, 2


def hf_command(port: int) -> list[str]:
    return [str(BIN / "deepspeed"), "--num_gpus", "2", "--no_local_rank", "--master_port", str(port),
            str(REPO / "examples" / "frameworks" / "train_hf_trainer.py"), "--deepspeed", "2",
            "--steps", str(HF_STEPS), "--accumulate", str(HF_ACCUMULATE), "--print-time", "--own-clock"]


@pytest.fixture(scope="module")
def hf_zero2(tmp_path_factory):
    """examples/frameworks/train_hf_trainer.py with TrainingArguments(deepspeed=...) (ZeRO-2, gradient accumulation
    2) under DeepSpeed's launcher, profiled. The Trainer makes two parameter groups (weight decay on matrices only):
    ZeRO-2 steps the torch optimizer once per group. With the job's own clock of its communication and its final
    weights (``--own-clock``)."""
    return framework_job(tmp_path_factory.mktemp("ds") / "hf", hf_command)


def test_hf_trainer_deepspeed_steps_are_the_trainers_optimizer_steps(hf_zero2):
    p, s = hf_zero2
    run = s["run"]
    # both ranks, not DeepSpeed's launcher nor its per-node launcher
    assert run["world_size"] == 2 and not run.get("ranks_missing") and not run.get("unidentified_processes"), run
    # the Trainer's own count of optimizer steps (its global_step at each step's end), each two micro-batches
    trainer_steps = [int(n) for n in re.findall(r"^step (\d+) t ", p.stdout, re.M)]
    assert trainer_steps == list(range(1, HF_STEPS + 1)), p.stdout[-2000:]
    assert all(r["steps_recorded"] == HF_STEPS for r in s["ranks"]), s["ranks"]
    # ZeRO-2's reduction after backward, and its gathers after the step, block the training thread on CPU
    issued = s["breakdown"]["exposed_comm_by_issued_s_per_step"]
    assert issued.get("after backward", 0) > 0, issued
    assert s["overlap"]["exposed_comm_frac"] > 0


def test_hf_trainer_deepspeed_accumulation_is_not_a_bucket_to_merge(hf_zero2):
    """ZeRO-2 reduces after each micro-batch's backward: the Trainer's 2 micro-batches a step at DeepSpeed's default
    bucket are 2 flushes a step, which no bucket size merges; the what-if says so rather than predicting a saving."""
    p, s = hf_zero2
    skipped = {w["scenario"]: w["reason"] for w in s["what_if_skipped"]}
    assert f"one ZeRO bucket per micro-batch ({HF_ACCUMULATE} a step" in skipped.get("zero_one_bucket", ""), skipped
    assert not [w for w in s["what_if"] if w["scenario"] == "zero_one_bucket"], s["what_if"]


def test_hf_trainer_deepspeed_headline_is_the_jobs_own_clock(hf_zero2):
    """The headline's exposed communication against the job's own clock of its training thread inside
    torch.distributed calls and waits, per optimizer step from one Trainer step's end to the next
    (examples/frameworks/comm_clock.py): within 5 points, for the job and rank by rank; and the steps' mean duration
    within 10 % of the job's (the same steps: dtprof's step ends as DeepSpeed's ``engine.step()`` returns inside
    ``accelerator.backward()``, the Trainer's a callback later)."""
    p, s = hf_zero2
    clk = parse_clock(p.stdout)
    assert sorted(clk) == [0, 1] and all(len(v) == HF_STEPS for v in clk.values()), p.stdout[-2000:]
    assert s["overlap"]["exposed_comm_frac"] == pytest.approx(_clock_frac(s, clk), abs=CLOCK_POINTS)
    steps = s["steps"]["per_step_index"]
    for r in s["ranks"]:
        mine = r["breakdown_s_per_step"]["exposed_comm"] / r["step_time_s_mean"]
        assert mine == pytest.approx(_clock_frac(s, clk, r["rank"]), abs=CLOCK_POINTS), r
        own = sum(clk[r["rank"]][i][0] for i in steps) / len(steps)
        assert r["step_time_s_mean"] == pytest.approx(own, rel=0.10), (r, own)


def test_hf_trainer_deepspeed_final_weights_bit_identical_bare_and_profiled(hf_zero2, tmp_path):
    p, _ = hf_zero2
    port = free_port()
    with shm_buffers_removed(port):
        bare = subprocess.run(hf_command(port), env=ENV, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
                              cwd=tmp_path)
    assert bare_returncode(bare) == 0, f"bare exited {bare.returncode}:\n{bare.stdout[-3000:]}\n{bare.stderr[-3000:]}"
    profiled = parse_weights(p.stdout)
    assert len(profiled) == 2 and profiled == parse_weights(bare.stdout), (profiled, bare.stdout[-2000:])


# ---- several hosts (issue 47 point 3: DeepSpeed's launcher with a hostfile of two hosts) -------------------------

TWO_HOSTS = "nodeA slots=1\nnodeB slots=1\n"
PER_NODE_ARGS = ("--zero", "2", *ZERO_ARGS)


def per_node_command(hostfile: Path, node_rank: int, port: int) -> list[str]:
    """DeepSpeed's launcher on one node of a two-host hostfile, as each node runs it under ``srun`` (DeepSpeed >=
    0.14's ``--no_ssh``): it starts that node's ranks only, without ssh."""
    return [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node_rank),
            "--master_addr", "127.0.0.1", "--master_port", str(port), str(SCRIPT), *PER_NODE_ARGS]


def side_by_side(commands: list[list], d: Path) -> list[subprocess.CompletedProcess]:
    """`dtprof run COMMAND` for each of one job's nodes, all at once in ``d`` (their output in files: a pipe nobody
    reads could fill and stop a launcher); when one fails the others are stopped (SIGTERM, which `dtprof run` passes
    on): their ranks would wait for the missing node's until torch's 30-minute timeout."""
    logs = [(open(d / f"launcher{i}.out", "w+"), open(d / f"launcher{i}.err", "w+")) for i in range(len(commands))]
    procs = [dtprof_popen("run", *c, env=ENV, stdout=o, stderr=e) for c, (o, e) in zip(commands, logs)]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    done = []
    for p, (o, e) in zip(procs, logs):
        p.wait(timeout=120)
        o.seek(0)
        e.seek(0)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, o.read(), e.read()))
        o.close()
        e.close()
    return done


@pytest.fixture(scope="module")
def per_node(tmp_path_factory):
    """Two `dtprof run --out RUN` launchers side by side on this machine, one per "node" of a two-host hostfile
    (``nodeA``, ``nodeB``: names DeepSpeed only counts, with ``--no_ssh``), one ZeRO-2 job: (out, [stdout of each
    launcher], summary)."""
    d = tmp_path_factory.mktemp("ds_hosts")
    (d / "hostfile").write_text(TWO_HOSTS)
    port, out = free_port(), d / "run"
    with shm_buffers_removed(port):
        done = side_by_side([["--out", out, "--no-report", "--", *per_node_command(d / "hostfile", i, port)]
                             for i in range(2)], d)
    for p in done:
        assert returncode(p) == 0, f"a node's launcher exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return out, [p.stdout for p in done], assert_breakdown_adds_up(out)


def test_deepspeed_per_node_launchers_record_one_run(per_node):
    """Both nodes' ranks in one run, each in its own launcher's node directory, a step per optimizer step, the
    headline's exposed communication within 5 points of the job's own clock."""
    from dtprof.reader import open_run

    out, stdouts, s = per_node
    run = open_run(out)
    assert len(run.nodes) == 2
    # one rank per node directory, each the rank its node's DeepSpeed launcher started (node_rank i: rank i)
    node_rank = {n["node"]: int(n["command"][n["command"].index("--node_rank") + 1]) for n in run.nodes}
    assert {int(r): node_rank[str(n)] for r, n in zip(run.ranks["rank"], run.ranks["node"])} == {0: 0, 1: 1}
    clock = {**parse_clock(stdouts[0]), **parse_clock(stdouts[1])}
    assert sorted(clock) == [0, 1]
    assert s["run"]["world_size"] == 2 and not s["run"].get("ranks_missing"), s["run"]
    assert not s["run"].get("unidentified_processes"), s["run"]
    assert all(r["steps_recorded"] == 8 for r in s["ranks"]), s["ranks"]
    assert s["overlap"]["exposed_comm_frac"] == pytest.approx(_clock_frac(s, clock), abs=CLOCK_POINTS)


def test_deepspeed_per_node_final_weights_bit_identical_to_bare(per_node, tmp_path):
    """The job's final weights, profiled one launcher per node, against a bare run of the same job under DeepSpeed's
    launcher on one host (``--num_gpus 2``: the same two ranks)."""
    _, stdouts, _ = per_node
    profiled = {**parse_weights(stdouts[0]), **parse_weights(stdouts[1])}
    bare = Job(tmp_path / "bare", PER_NODE_ARGS, profiled=False)
    assert len(profiled) == 2 and profiled == bare.weights()


def _ssh_to(host: str) -> bool:
    try:
        return subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", host, "true"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


PDSH_HOSTS = ("localhost", "127.0.0.1")     # two names of this machine: two "hosts" to ssh to


@pytest.fixture(scope="module")
def pdsh_job(tmp_path_factory):
    """One `dtprof run` around DeepSpeed's launcher with a two-host hostfile and no ``--no_ssh``: DeepSpeed's default
    multi-host launch, pdsh over ssh to each host (here ``localhost`` and ``127.0.0.1``, both this machine), one
    ZeRO-2 rank each, in an environment built from DeepSpeed's exported prefixes and the ``.deepspeed_env`` of the
    directory it is started in (which holds the user's own DS_ACCELERATOR and TORCH_EXTENSIONS_DIR: pdsh passes
    nothing else). Needs pdsh and passwordless ssh to both names (absent in CI: skipped, saying so)."""
    if not shutil.which("pdsh"):
        pytest.skip("pdsh is not installed (DeepSpeed's multi-host launch needs it)")
    if not all(_ssh_to(h) for h in PDSH_HOSTS):
        pytest.skip(f"no passwordless ssh to {' and '.join(PDSH_HOSTS)} (an ssh server with the user's key)")
    d = tmp_path_factory.mktemp("ds_pdsh")
    (d / "hostfile").write_text("".join(f"{h} slots=1\n" for h in PDSH_HOSTS))
    own = {"DS_ACCELERATOR": "cpu", **{k: ENV[k] for k in ("TORCH_EXTENSIONS_DIR",) if k in ENV}}
    (d / ".deepspeed_env").write_text("".join(f"{k}={v}\n" for k, v in own.items()))
    port, out = free_port(), d / "run"
    cmd = [str(BIN / "deepspeed"), "--hostfile", "hostfile", "--master_addr", "127.0.0.1", "--master_port", str(port),
           str(SCRIPT), *PER_NODE_ARGS]
    with shm_buffers_removed(port):
        p = dtprof("run", "--out", out, "--no-report", "--", *cmd, env=ENV, cwd=d, timeout=JOB_TIMEOUT_S)
    assert returncode(p) == 0, f"{cmd} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p, out, assert_breakdown_adds_up(out)


def test_deepspeed_pdsh_launch_records_every_host(pdsh_job):
    """Every rank recorded though pdsh passes the ranks only the variables DeepSpeed exports: `dtprof run` gives
    them its settings through DeepSpeed's environment file (DS_ENV_FILE, the user's lines kept) and says so at start;
    a step per optimizer step, the headline's exposed communication within 5 points of the job's own clock."""
    from dtprof.reader import open_run

    p, out, s = pdsh_job
    (node,) = open_run(out).nodes
    env_file = out / node["node"] / "deepspeed_env"
    assert f"through pdsh; they get dtprof's settings from {env_file}" in p.stderr, p.stderr[-2000:]
    assert env_file.read_text().startswith("DS_ACCELERATOR=cpu\n")     # the user's lines first
    assert s["run"]["world_size"] == 2 and s["run"]["ranks_recorded"] == 2 and not s["run"].get("ranks_missing")
    assert not s["run"].get("unidentified_processes"), s["run"]      # not DeepSpeed's runner nor its per-host ones
    assert all(r["steps_recorded"] == 8 for r in s["ranks"]), s["ranks"]
    clock = parse_clock(p.stdout)
    assert sorted(clock) == [0, 1], p.stdout[-2000:]
    assert s["overlap"]["exposed_comm_frac"] == pytest.approx(_clock_frac(s, clock), abs=CLOCK_POINTS)


def test_deepspeed_other_multi_host_launchers_say_what_is_not_recorded(tmp_path):
    """DeepSpeed's other multi-host launchers pass the environment file's values on without a shell, where
    dtprof's settings do not survive: one line at start says the other hosts' ranks will not be recorded and how to
    launch instead (here DeepSpeed then stops: no OpenMPI on this machine)."""
    (tmp_path / "hostfile").write_text("nodeA slots=1\nnodeB slots=1\n")
    p = dtprof("run", "--out", tmp_path / "run", "--no-report", "--", str(BIN / "deepspeed"), "--hostfile",
               str(tmp_path / "hostfile"), "--launcher", "openmpi", "--no_ssh_check", "--master_addr", "127.0.0.1",
               str(SCRIPT), env=ENV, timeout=JOB_TIMEOUT_S)
    line = ("dtprof: DeepSpeed's --launcher openmpi starts the ranks on 2 hosts (nodeA, nodeB) without dtprof's "
            "settings: the ranks on other hosts will not be recorded; run `dtprof run --out SAME_DIR -- deepspeed "
            "--no_ssh --node_rank N ...` on each node instead")
    assert line in p.stderr, p.stderr[-2000:]
