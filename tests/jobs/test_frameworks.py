"""Real framework jobs under `dtprof run`, each as its framework documents it (examples/frameworks/), on CPU/gloo:
Lightning through torchrun and through its own launcher, the Hugging Face Trainer with a tiny GPT-2 (with and
without gradient accumulation), an Accelerate loop through torchrun and through `accelerate launch`; and plain
torch jobs started by `torch.multiprocessing.spawn` and by a simulated `srun` (SLURM_PROCID and friends).

Each framework job asserts what a user checks first: every rank recorded (none missing, no process named
unidentified), the framework's real number of optimizer steps, DDP's bytes per step equal to the parameter bytes,
no data-wait finding on in-memory data, and the same final loss as the same job run without dtprof.
Jobs are tiny (a few steps) and each runs once per module; the suite shares them through fixtures.
"""
from __future__ import annotations

import html
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, free_port
from dtprof.analyzers.intervals import split_over_windows, union_length
from dtprof.analyzers.runmodel import RunModel
from dtprof.reader import open_run
from dtprof.reports.html import _cards
from dtprof.rundir.schema import COMPUTE_KINDS
from torch_abort import TorchExitAbort, returncode

pytestmark = pytest.mark.slow

EXAMPLES = REPO / "examples" / "frameworks"
BIN = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
# an empty cache for the jobs that check the calibration `dtprof run` makes itself (assert_mfu: the framework
# pairs); the others read the one tests/conftest.py stores, as a user's runs after `dtprof calibrate` do (a
# calibration is a fresh Python timing a ~1 s GEMM: seconds of each job that checks nothing of it)
CALIBRATING = {**ENV, "XDG_CACHE_HOME": tempfile.mkdtemp(prefix="dtprof-no-calibration-")}
TORCHRUN = [str(BIN / "torchrun"), "--nproc_per_node=2"]
ACCELERATE = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_machines", "1", "--num_processes", "2"]


class Job:
    def __init__(self, proc, run_dir=None):
        self.proc, self.run_dir = proc, run_dir
        self.run = open_run(run_dir) if run_dir else None
        self.summary = json.loads((run_dir / "summary.json").read_text()) if run_dir else None

    def final_losses(self) -> list[str]:
        return re.findall(r"final loss (-?\d+\.\d+)", self.proc.stdout)   # ranks print concurrently


JOB_TIMEOUT_S = 420
# a bare job that printed its final loss and has not exited this long after is hung in torch's teardown (below)
TEARDOWN_HANG_S = 60


def _run(full: list[str], tmp: Path, hang_after: str | None = None, env: dict = ENV) -> subprocess.CompletedProcess:
    """Run ``full`` in its own session; on a time-out stop the whole session (torchrun's ranks too, which a plain
    subprocess.run time-out leaves running). With ``hang_after``: once that text is in the job's output, a job
    that has not exited ``TEARDOWN_HANG_S`` later is killed too (returncode None)."""
    out, err = tmp / "job.stdout", tmp / "job.stderr"
    with open(out, "w") as o, open(err, "w") as e:
        p = subprocess.Popen(full, cwd=tmp, env=env, stdout=o, stderr=e, text=True, start_new_session=True)
        t0 = time.monotonic()
        seen = None
        while p.poll() is None:
            time.sleep(0.5)
            now = time.monotonic()
            if seen is None and hang_after and hang_after in out.read_text():
                seen = now
            if now - t0 > JOB_TIMEOUT_S or (seen is not None and now - seen > TEARDOWN_HANG_S):
                os.killpg(p.pid, signal.SIGTERM)   # `dtprof run` passes it on to the job it started
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                return subprocess.CompletedProcess(full, None, out.read_text(), err.read_text())
    return subprocess.CompletedProcess(full, p.returncode, out.read_text(), err.read_text())


def job(command, tmp, profiled=True, calibrate=False) -> Job:
    """Run ``command`` (with ``dtprof run`` around it when profiled, calibrating for MFU itself when
    ``calibrate``: no stored calibration); fail with its output if it fails."""
    run_dir = tmp / "run" if profiled else None
    full = ([sys.executable, "-m", "dtprof.cli", "run", "--out", str(run_dir), "--no-nvml", "--no-report", "--"]
            if profiled else []) + [str(c) for c in command]
    # torch's own teardown after training can abort (tests/torch_abort.py) or deadlock (the HF Trainer's rank 0
    # freeing DDP's reducer, whose ~ProcessGroupGloo joins a gloo worker that waits for the GIL to free a collective's
    # saved state: 1 bare run of a fresh-clone CI run hung until the time-out); either, after the final loss, has
    # pytest run the test again (TorchExitAbort)
    proc = _run(full, tmp, hang_after="final loss", env=CALIBRATING if calibrate else ENV)
    if proc.returncode is None and "final loss" in proc.stdout:
        raise TorchExitAbort(f"{full} hung in torch's teardown after its final loss\n{proc.stderr[-3000:]}")
    assert returncode(proc) == 0, f"{full} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return Job(proc, run_dir)


def pair(tmp_path_factory, name, command) -> tuple[Job, Job]:
    """The job under dtprof, calibrating itself (assert_mfu), and the same job without it."""
    return (job(command, tmp_path_factory.mktemp(name), calibrate=True),
            job(command, tmp_path_factory.mktemp(name + "-bare"), profiled=False))


def mlp_param_bytes(dim: int, out: int) -> int:
    return 4 * (dim * dim + dim + dim * out + out)      # float32 Linear(dim, dim) + Linear(dim, out)


def gpt2_param_bytes(seq: int) -> int:
    from transformers import GPT2LMHeadModel

    sys.path.insert(0, str(EXAMPLES))
    from train_hf_trainer import tiny_gpt2_config

    model = GPT2LMHeadModel(tiny_gpt2_config(seq))
    return 4 * sum(p.numel() for p in model.parameters())   # tied lm_head/wte counted once, as DDP reduces it


def assert_every_rank(j: Job, world: int, optimizer_steps: int) -> None:
    run, summary = j.run, j.summary
    assert sorted(run.ranks["rank"].astype(int)) == list(range(world))
    assert summary["run"]["world_size"] == world
    assert summary["run"]["ranks_missing"] == [] and summary["run"]["unidentified_processes"] == []
    steps = run.steps.groupby("rank").size().to_dict()
    assert steps == {r: optimizer_steps for r in range(world)}, steps


def assert_ddp_bytes(j: Job, param_bytes: int) -> None:
    c = j.run.collectives
    # DDP's gradient buckets; with find_unused_parameters (the HF Trainer's default) DDP also all-reduces its
    # used-parameter map (4 bytes per parameter), recorded as DDP traffic too but not gradient bytes
    ddp = c[(c["source"].astype(str) == "ddp") & (c["api"].astype(str) == "ddp_bucket")]
    per_step = ddp.groupby(["rank", "step"])["in_bytes"].sum()
    assert len(per_step) and (per_step == param_bytes).all(), per_step.value_counts()


def assert_inferred(j: Job, what: str, per_rank_step: int) -> None:
    """samples/tokens per step inferred with no annotation: every measured step of every rank has the figure."""
    st = j.summary["steps"]
    assert st[f"{what}_per_s"] and st[f"{what}_per_s_source"].startswith("inferred"), st
    # and the report's headline card says so, as the summary does
    card = _cards(j.summary).split(f'id="card-{what}_per_s"')[1].split('<div class="card')[0]
    assert html.escape(st[f"{what}_per_s_source"]) in card, card
    steps = j.run.steps
    measured = steps[steps["step"].isin(st["per_step_index"])]
    assert len(measured) and (measured[what] == per_rank_step).all(), measured[what].tolist()


def assert_mfu(j: Job) -> None:
    """A real MFU with no flags: FLOPs counted on one step (left out of the statistics), peak calibrated."""
    m, st = j.summary["mfu"], j.summary["steps"]
    assert m["value"] is not None and 0 < m["value"] < 1, m
    assert m["flops_source"].startswith("executed FLOPs") and m["peak_source"].startswith("calibrated by dtprof run")
    assert st["flops_counted_steps"] and not set(st["flops_counted_steps"]) & set(st["per_step_index"])


def assert_no_data_wait_finding(j: Job) -> None:
    ids = [f["id"] for f in j.summary["findings"]]
    assert "data_wait" not in ids, j.summary["findings"]


# ---- Lightning ------------------------------------------------------------------------------------------------

LIGHTNING_STEPS = 5


@pytest.fixture(scope="module")
def lightning_own_launcher(tmp_path_factory):
    return pair(tmp_path_factory, "lightning", [sys.executable, EXAMPLES / "train_lightning.py",
                                                "--steps", LIGHTNING_STEPS, "--clip", 1.0, "--print-health"])


LIGHTNING_VAL_EVERY, LIGHTNING_VAL_BATCHES = 2, 6


@pytest.fixture(scope="module")
def lightning_torchrun(tmp_path_factory):
    """With Lightning's validation loop (every 2 training batches, and its sanity check before training)."""
    return job([*TORCHRUN, EXAMPLES / "train_lightning.py", "--steps", LIGHTNING_STEPS,
                "--val-every", LIGHTNING_VAL_EVERY, "--val-batches", LIGHTNING_VAL_BATCHES],
               tmp_path_factory.mktemp("lightning-torchrun"))


def test_lightning_own_launcher_records_both_ranks(lightning_own_launcher):
    profiled, bare = lightning_own_launcher
    assert_every_rank(profiled, 2, LIGHTNING_STEPS)
    assert_ddp_bytes(profiled, mlp_param_bytes(64, 1))
    assert_no_data_wait_finding(profiled)
    assert_inferred(profiled, "samples", 16)
    assert_mfu(profiled)
    assert len(profiled.final_losses()) == 2 and sorted(profiled.final_losses()) == sorted(bare.final_losses())


def test_lightning_gradient_clipping_norm_is_read_as_lightnings_own(lightning_own_launcher):
    """Lightning's gradient clipping (gradient_clip_val 1.0) calls torch.nn.utils.clip_grad_norm_ and drops its
    result: dtprof reads it (source "clip"), within 1e-5 of the total norm Lightning's own grad_norm utility gives
    in on_before_optimizer_step (before the clip), on each rank's every step, beside the loss and the learning rate
    each rank printed."""
    profiled, _ = lightning_own_launcher
    num = r"(-?[0-9.]+(?:e[-+][0-9]+)?)"
    printed = {(int(r), int(s)): (float(loss), float(norm), float(lr))
               for r, s, loss, norm, lr in re.findall(rf"HEALTH (\d+) (\d+) {num} {num} {num}", profiled.proc.stdout)}
    assert set(printed) == {(r, s) for r in (0, 1) for s in range(LIGHTNING_STEPS)}, profiled.proc.stdout[-2000:]
    h = profiled.run.health
    got = {(int(r.rank), int(r.step)): r for r in h.itertuples(index=False)}
    for key, (loss, norm, lr) in printed.items():
        row = got[key]
        assert (row.grad_norm_source, row.loss, row.lr) == ("clip", loss, lr), (key, row, printed[key])
        assert row.grad_norm == pytest.approx(norm, rel=1e-5), (key, row, printed[key])


def test_lightning_torchrun(lightning_torchrun):
    assert_every_rank(lightning_torchrun, 2, LIGHTNING_STEPS)
    assert_ddp_bytes(lightning_torchrun, mlp_param_bytes(64, 1))
    assert_no_data_wait_finding(lightning_torchrun)


def assert_evaluation_between_steps(j: Job, runs: int) -> None:
    """``runs`` evaluations (the framework's own count) are ``runs`` evaluation stretches on every rank, each
    outside every step window and filling the gap between two steps: no step time includes it. Its data loading
    and collectives are outside the steps too, and not reported as a problem."""
    run, summary = j.run, j.summary
    ev = run.spans[run.spans["kind"].astype(str) == "evaluation"]
    assert ev.groupby("rank").size().to_dict() == {0: runs, 1: runs}, ev
    for rank, mine in ev.groupby("rank"):
        st = run.steps[run.steps["rank"] == rank]
        for e in mine.itertuples():
            assert e.end_ns > e.start_ns
            assert not ((st["start_ns"] < e.end_ns) & (st["end_ns"] > e.start_ns)).any(), (e, st)
            after, before = st[st["start_ns"] >= e.end_ns], st[st["end_ns"] <= e.start_ns]
            assert after.empty or after["start_ns"].min() == e.end_ns   # the next step starts at its end
            assert before.empty or before["end_ns"].max() == e.start_ns   # and it at the previous one's end
    assert summary["evaluation"]["stretches"] == runs and summary["evaluation"]["total_s"] > 0
    # what the summary names as recorded but uncounted is the set-up before the first step and the teardown after
    # the last one: nothing of an evaluation
    sp = run.spans[run.spans["kind"].astype(str).isin([*COMPUTE_KINDS, "comm_wait", "data_wait"])]
    starts = [(sp["rank"], sp["start_ns"]), (run.collectives["rank"], run.collectives["issue_ns"])]
    first, last = run.steps.groupby("rank")["start_ns"].min(), run.steps.groupby("rank")["end_ns"].max()

    def in_evaluation(r, t):
        return np.array([((ev["rank"] == a) & (ev["start_ns"] <= b) & (b <= ev["end_ns"])).any() for a, b in zip(r, t)],
                        bool)

    setup_teardown = sum(int((((t < r.map(first)) | (t >= r.map(last))) & ~in_evaluation(r, t)).sum())
                         for r, t in starts)
    named = [int(p.split()[0]) for p in summary["problems"] if "outside every step window" in p]
    assert named == ([setup_teardown] if setup_teardown else []), (summary["problems"], setup_teardown)


def test_lightning_validation_is_evaluation_between_steps(lightning_torchrun):
    """Lightning's validation loop runs between optimizer steps (and its sanity check before step 0's training
    forward): none of it is in a step's time, and its samples are not the step's (16 per training batch, where the
    validation's 6 batches of 16 would add 96 to a step)."""
    j = lightning_torchrun
    runs = len(re.findall(r"^validation", j.proc.stdout, re.M))
    assert runs >= 1 + LIGHTNING_STEPS // LIGHTNING_VAL_EVERY, j.proc.stdout   # the sanity check, then every 2
    assert_evaluation_between_steps(j, runs)
    assert_inferred(j, "samples", 16)
    from dtprof.options import open_and_analyze
    from dtprof.report import save_report

    page = save_report(open_and_analyze(j.run_dir)[1], out_path=j.run_dir.parent / "report.html",
                        progress=False).read_text()
    card = page[page.index('id="card-step_time_p50"'):][:2000]
    assert f"evaluation between steps not included ({runs} stretch(es)" in card, card


def test_lightning_between_step_collectives_are_communication_not_data_wait(lightning_torchrun):
    """Lightning's logging all-reduce (sync_dist) runs between steps: it is counted as communication, and none of
    the data_wait spans overlaps it. Lightning's per-step collectives issued between steps are exposed
    communication on every rank, said to be issued outside forward/backward."""
    for r in lightning_torchrun.summary["ranks"]:
        issued = r["exposed_comm_s_per_step_by_issued"]
        outside = sum(v for k, v in issued.items() if k not in ("forward", "backward", "optimizer"))
        assert outside > 0, issued
    run = lightning_torchrun.run
    c, s = run.collectives, run.spans
    logged = c[(c["source"].astype(str) != "ddp") & (c["op"].astype(str) == "all_reduce")]
    assert len(logged) >= LIGHTNING_STEPS
    waits = s[s["kind"].astype(str) == "data_wait"]
    for r in logged.itertuples():
        w = waits[waits["rank"] == r.rank]
        assert not ((w["start_ns"] < r.return_ns) & (w["end_ns"] > r.issue_ns)).any()


def test_lightning_closure_phases_are_forward_and_backward(lightning_torchrun):
    """Lightning runs forward and backward inside ``optimizer.step(closure)``: the breakdown still shows them (the
    innermost phase), and its communication parts are only time the rank really had a collective in flight or was
    blocked on one, measured from the collectives and the comm_wait spans of its measured steps."""
    run = lightning_torchrun.run
    model = RunModel.of(run)
    w = model.steps[model.steps["measured"]]
    s = run.spans[run.spans["kind"].astype(str) == "comm_wait"]
    c = model.collectives
    for r in lightning_torchrun.summary["ranks"]:
        b = r["breakdown_s_per_step"]
        assert b["forward"] > 0 and b["backward"] > 0, b
        mine = w[w["rank"] == r["rank"]]
        ws, we = mine["start_ns"].to_numpy(), mine["end_ns"].to_numpy()
        keys = np.zeros(len(ws), np.int64)
        a = np.r_[s.loc[s["rank"] == r["rank"], "start_ns"], c.loc[c["rank"] == r["rank"], "issue_ns"]]
        e = np.r_[s.loc[s["rank"] == r["rank"], "end_ns"], c.loc[c["rank"] == r["rank"], "exit_ns"]]
        _, win, ps, pe = split_over_windows(keys, ws, we, np.zeros(len(a), np.int64), a, e)
        comm_s = union_length(win, ps, pe, len(ws)).sum() / len(ws) / 1e9
        assert b["exposed_comm"] <= comm_s * (1 + 1e-9), (b, comm_s)


# ---- Hugging Face Trainer ---------------------------------------------------------------------------------------

HF_STEPS, HF_SEQ = 4, 32


HF_EVAL_EVERY = 2


@pytest.fixture(scope="module")
def hf_trainer(tmp_path_factory):
    """Evaluating every 2 steps: the Trainer evaluates the unwrapped model (DDP's module), not the DDP wrapper."""
    return pair(tmp_path_factory, "hf", [*TORCHRUN, EXAMPLES / "train_hf_trainer.py", "--steps", HF_STEPS,
                                         "--seq", HF_SEQ, "--eval-every", HF_EVAL_EVERY])


@pytest.fixture(scope="module")
def hf_trainer_accumulating(tmp_path_factory):
    return job([*TORCHRUN, EXAMPLES / "train_hf_trainer.py", "--steps", HF_STEPS, "--seq", HF_SEQ,
                "--accumulate", 2, "--print-logs"], tmp_path_factory.mktemp("hf-accumulate"))


def test_hf_trainer(hf_trainer):
    profiled, bare = hf_trainer
    assert_every_rank(profiled, 2, HF_STEPS)
    assert_ddp_bytes(profiled, gpt2_param_bytes(HF_SEQ))
    assert_no_data_wait_finding(profiled)
    assert_inferred(profiled, "tokens", 4 * HF_SEQ)        # per-device batch 4
    assert_inferred(profiled, "samples", 4)
    assert_mfu(profiled)
    assert profiled.final_losses() and profiled.final_losses() == bare.final_losses()


def test_hf_trainer_evaluation_is_outside_the_steps(hf_trainer):
    """The Trainer's ``evaluate`` every 2 steps (after step 2, between steps; after step 4, after the last one)
    runs the model without gradients: recorded as evaluation, outside every step, its tokens not counted (the
    measured steps' tokens are the training batch's alone: test_hf_trainer)."""
    profiled, _ = hf_trainer
    runs = len(re.findall(r"^evaluation after step", profiled.proc.stdout, re.M))
    assert runs == HF_STEPS // HF_EVAL_EVERY, profiled.proc.stdout
    assert_evaluation_between_steps(profiled, runs)


def test_hf_trainer_gradient_accumulation_counts_optimizer_steps(hf_trainer_accumulating):
    """Two micro-batches per optimizer step: still HF_STEPS steps, and DDP reduces once per step (no_sync)."""
    j = hf_trainer_accumulating
    assert_every_rank(j, 2, HF_STEPS)
    assert_ddp_bytes(j, gpt2_param_bytes(HF_SEQ))
    fwd = j.run.spans[j.run.spans["kind"].astype(str) == "forward"]
    assert (fwd.groupby(["rank", "step"]).size() == 2).all()
    assert_inferred(j, "tokens", 2 * 4 * HF_SEQ)           # both micro-batches
    assert_no_data_wait_finding(j)


def test_hf_trainer_loss_and_grad_norm_are_the_trainers_logged_ones(hf_trainer_accumulating):
    """The Trainer clips (max_grad_norm 1.0, through Accelerate and torch's clip_grad_norm_) and logs each step's
    grad_norm, and its loss: the ranks' mean of the sum of each micro-batch's loss as divided before backward
    (gradient accumulation 2). dtprof's health rows hold that grad_norm on both ranks (source "clip"), and the
    ranks' mean of their local losses is the logged loss within float32 rounding."""
    j = hf_trainer_accumulating
    logs = {d["step"]: d for d in map(json.loads, re.findall(r"LOG (\{[^{}]*\})", j.proc.stdout))}
    assert set(logs) == set(range(1, HF_STEPS + 1)), j.proc.stdout[-2000:]
    h = j.run.health
    for step, log in logs.items():
        rows = h[h["step"] == step - 1]      # the Trainer's global_step counts the steps done
        assert len(rows) == 2 and set(rows["grad_norm_source"]) == {"clip"}, rows
        assert list(rows["grad_norm"]) == [log["grad_norm"]] * 2, (step, log, rows)
        assert rows["loss"].mean() == pytest.approx(log["loss"], rel=1e-6), (step, log, rows)


# ---- Accelerate -------------------------------------------------------------------------------------------------

ACC_STEPS = 6


@pytest.fixture(scope="module")
def accelerate_launch(tmp_path_factory):
    return pair(tmp_path_factory, "accelerate", [*ACCELERATE, EXAMPLES / "train_accelerate.py",
                                                 "--steps", ACC_STEPS])


def test_accelerate_launch_records_the_ranks_not_the_cli(accelerate_launch):
    profiled, bare = accelerate_launch
    assert_every_rank(profiled, 2, ACC_STEPS)
    scripts = {Path(json.loads(p.read_text())["argv"][0]).name
               for p in profiled.run_dir.glob("node-*/rank-*/rank.json")}
    assert scripts == {"train_accelerate.py"}, scripts     # the accelerate CLI itself is not a rank
    assert_ddp_bytes(profiled, mlp_param_bytes(64, 4))
    assert_no_data_wait_finding(profiled)
    assert_inferred(profiled, "samples", 16)
    assert_mfu(profiled)
    assert profiled.final_losses() and profiled.final_losses() == bare.final_losses()


def test_accelerate_torchrun(tmp_path):
    j = job([*TORCHRUN, EXAMPLES / "train_accelerate.py", "--steps", ACC_STEPS], tmp_path)
    assert_every_rank(j, 2, ACC_STEPS)
    assert_ddp_bytes(j, mlp_param_bytes(64, 4))


# ---- launchers without RANK: mp.spawn, srun; a process that cannot be a rank ----------------------------------

PLAIN = """
import os, sys, torch, torch.distributed as dist

def train(rank, world, init_method):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.ones(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
"""



def test_mp_spawn_ranks_come_from_their_process_group(tmp_path):
    (tmp_path / "spawn_job.py").write_text(PLAIN + textwrap.dedent(f"""
        if __name__ == "__main__":
            torch.multiprocessing.spawn(train, args=(2, "tcp://127.0.0.1:{free_port()}"), nprocs=2)
        """))
    j = job([sys.executable, "spawn_job.py"], tmp_path)
    assert_every_rank(j, 2, 3)


def test_slurm_style_tasks(tmp_path):
    """Two tasks as `srun --ntasks 2` starts them: SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, no RANK."""
    (tmp_path / "task.py").write_text(PLAIN + textwrap.dedent("""
        train(int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]), "tcp://127.0.0.1:" + sys.argv[1])
        """))
    port = free_port()
    script = " ".join(
        f"SLURM_PROCID={i} SLURM_NTASKS=2 SLURM_LOCALID={i} SLURM_NODEID=0 {sys.executable} task.py {port} &"
        for i in range(2)) + " wait"
    j = job(["bash", "-c", script], tmp_path)
    assert_every_rank(j, 2, 3)
    assert sorted(j.run.ranks["local_rank"].astype(int)) == [0, 1]
    assert set(j.run.ranks["node_rank"].astype(int)) == {0}


def test_a_process_that_finds_its_rank_taken_is_named(tmp_path):
    """Rank 0 starts a helper that inherits RANK=0 and runs a forward: it cannot be recorded as rank 0 (rank 0
    is), so the run and the summary name it instead of dropping it in silence."""
    (tmp_path / "job.py").write_text(PLAIN + textwrap.dedent("""
        if os.environ["RANK"] == "0":
            import subprocess
            subprocess.run([sys.executable, "-c", "import torch; torch.nn.Linear(2, 2)(torch.ones(1, 2))"],
                           check=True)
        train(int(os.environ["RANK"]), 2, "env://")
        """))
    j = job([*TORCHRUN, "job.py"], tmp_path)
    assert sorted(j.run.ranks["rank"].astype(int)) == [0, 1] and j.summary["run"]["ranks_missing"] == []
    (msg,) = j.summary["run"]["unidentified_processes"]
    assert "rank 0" in msg and "not recorded" in msg
    assert msg in j.summary["problems"]
    assert "[error] unidentified process" in j.proc.stdout + j.proc.stderr


def test_data_wait_is_time_in_the_data_loader(tmp_path):
    """A DataLoader whose dataset sleeps 30 ms per batch, and a 100 ms pause between steps outside it (as a
    framework's logging): data_wait is the first, per step, and never the second (a busy machine can stretch a
    30 ms sleep, hardly past 100 ms)."""
    (tmp_path / "loader_job.py").write_text(textwrap.dedent("""
        import time, torch
        class Slow(torch.utils.data.Dataset):
            def __len__(self):
                return 6
            def __getitem__(self, i):
                time.sleep(0.03)
                return torch.ones(4)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in torch.utils.data.DataLoader(Slow(), batch_size=1):
            model(x).sum().backward()
            opt.step()
            time.sleep(0.1)
        """))
    j = job([sys.executable, "loader_job.py"], tmp_path)
    waits = j.run.spans[j.run.spans["kind"].astype(str) == "data_wait"]
    per_step = ((waits["end_ns"] - waits["start_ns"]) / 1e9).groupby(waits["step"]).sum()
    # steps 1..5 each fetched one batch (step 0's came before its first forward, the last fetch after the last step)
    per_step = per_step.reindex(range(1, 6))
    assert (per_step >= 0.03).all() and (per_step < 0.1).all(), per_step

