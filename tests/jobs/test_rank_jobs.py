"""Real torchrun jobs (gloo on CPU) profiled by the injected sitecustomize, read back with open_run.

Each job costs several seconds, so every job runs once per module (module-scoped fixtures) and several tests read
it. The launcher is emulated here (run dir + node dir + env) because `dtprof run` is tested elsewhere.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, dtprof
from dtprof import _inject
from dtprof.reader import open_run, read_table_text
from dtprof.rundir.writer import create_node_dir, create_run_dir
from torch_abort import returncode

pytestmark = pytest.mark.slow

EXAMPLES = REPO / "examples"
INJECT = Path(_inject.__file__).parent
STEPS = 4
SMALL = ["--steps", str(STEPS), "--batch", "4", "--seq", "16", "--dim", "32", "--layers", "2"]
_port = [29600 + os.getpid() % 300]


def _env(node_dir=None, config=None, extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTPROF_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                   "MASTER_", "TORCHELASTIC"))}
    env["OMP_NUM_THREADS"] = "1"
    _port[0] += 1
    env["MASTER_PORT"] = str(_port[0])
    if node_dir is not None:
        env["DTPROF_NODE_DIR"] = str(node_dir)
        env["DTPROF_CONFIG"] = json.dumps({"flush_interval_s": 0.2, **(config or {})})
        env["PYTHONPATH"] = os.pathsep.join([str(INJECT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra or {})
    return env


def _torchrun(script, args, nproc=2):
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
            str(_port[0]), str(EXAMPLES / script), *args]


def run_job(tmp, script, args, profiled=True, config=None, extra_env=None, nproc=2):
    """Run one torchrun job; returns (run_dir or None, loss lines, completed process)."""
    run_dir = create_run_dir(tmp / "run", {"test": script}) if profiled else None
    env = _env(create_node_dir(run_dir) if profiled else None, config, extra_env)
    p = subprocess.run(_torchrun(script, args, nproc), env=env, cwd=tmp, capture_output=True, text=True, timeout=180)
    assert returncode(p) == 0, p.stderr[-3000:]
    return run_dir, _loss_lines(p.stdout), p


def _loss_lines(stdout):
    return [ln for ln in stdout.splitlines() if ln.startswith("step ")]


@pytest.fixture(scope="module")
def bare_ddp(tmp_path_factory):
    return run_job(tmp_path_factory.mktemp("bare"), "train_ddp.py", SMALL, profiled=False)[1]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    run_dir, losses, _ = run_job(tmp_path_factory.mktemp("ddp"), "train_ddp.py", SMALL)
    return open_run(run_dir), losses


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    run_dir, losses, _ = run_job(tmp_path_factory.mktemp("fsdp"), "train_fsdp.py", SMALL)
    return open_run(run_dir)


@pytest.fixture(scope="module")
def fsdp1(tmp_path_factory):
    run_dir, losses, _ = run_job(tmp_path_factory.mktemp("fsdp1"), "train_fsdp.py", SMALL + ["--fsdp1"])
    return open_run(run_dir)


@pytest.fixture(scope="module", params=["gpipe", "1f1b"])
def pipeline(request, tmp_path_factory):
    args = SMALL + ["--schedule", request.param, "--microbatches", "4"]
    run_dir, losses, p = run_job(tmp_path_factory.mktemp("pp" + request.param), "train_pipeline.py", args)
    # each stage's parameter and tensor counts, as the job counts them
    counts = {int(r): (int(n), int(k)) for r, n, k in re.findall(r"stage (\d+) parameters (\d+) tensors (\d+)",
                                                                  p.stdout)}
    return open_run(run_dir), request.param, counts


def _assert_collectives_matched(run):
    """Every collective instance (group, seq) appears once on each member rank with the same op and sizes."""
    c = run.collectives
    coll = c[~c.op.isin(["send", "recv"])]
    assert len(coll)
    per = coll.groupby(["group", "seq"], observed=True).agg(
        n=("rank", "nunique"), size=("group_size", "first"), ops=("op", "nunique"), inb=("in_bytes", "nunique"),
        outb=("out_bytes", "nunique"))
    assert (per.n == per["size"]).all(), per[per.n != per["size"]]
    assert (per.ops == 1).all() and (per.inb == 1).all() and (per.outb == 1).all()


def _assert_p2p_matched(run):
    """Each send has exactly one recv on its peer with the same (group, sender, receiver, seq) and message size."""
    c = run.collectives
    p = c[c.op.isin(["send", "recv"])].copy()
    assert len(p)
    p["peer"] = p.peer.astype("int64")
    p["src"] = p["rank"].where(p.op == "send", p.peer)
    p["dst"] = p.peer.where(p.op == "send", p["rank"])
    p["size"] = p[["in_bytes", "out_bytes"]].max(axis=1)
    sends = p[p.op == "send"].set_index(["group", "src", "dst", "seq"])
    recvs = p[p.op == "recv"].set_index(["group", "src", "dst", "seq"])
    assert sends.index.is_unique and recvs.index.is_unique
    assert sorted(sends.index) == sorted(recvs.index)
    assert (sends["size"].sort_index() == recvs["size"].sort_index()).all()


# ---- DDP --------------------------------------------------------------------------------------------------------

def test_ddp_ranks_and_identity(ddp):
    run, _ = ddp
    r = run.ranks.set_index("rank")
    assert sorted(r.index) == [0, 1]
    assert (r.world_size == 2).all() and (r.backend == "gloo").all() and (r.device_type == "cpu").all()
    assert (r.pid > 0).all() and r.pid.nunique() == 2 and (r.host != "").all()
    assert r.node.astype(str).str.startswith("node-").all() and r.node.nunique() == 1
    assert len(run.clock) >= 2 and set(run.clock["rank"]) == {0, 1}


def test_ddp_steps_and_spans(ddp):
    run, _ = ddp
    s = run.steps
    assert s.groupby("rank").size().to_dict() == {0: STEPS, 1: STEPS}
    assert (s.end_ns > s.start_ns).all()
    sp = run.spans
    for kind in ("forward", "backward", "optimizer"):
        counts = sp[sp.kind == kind].groupby("rank").size().to_dict()
        assert counts == {0: STEPS, 1: STEPS}, (kind, counts)
    assert "data_wait" not in set(sp.kind.astype(str))   # batches are built in the loop: no DataLoader, no wait
    assert (sp[sp.kind == "comm_wait"].name == "ddp_final_wait").sum() == 2 * STEPS
    # spans lie inside their step
    m = sp[sp.kind.isin(["forward", "backward", "optimizer"])].merge(s, on=["rank", "step"], suffixes=("", "_s"))
    assert (m.start_ns >= m.start_ns_s).all() and (m.end_ns <= m.end_ns_s).all()


def test_ddp_buckets_carry_all_gradient_bytes(ddp):
    import torch

    sys.path.insert(0, str(EXAMPLES))
    from model import TinyLM

    grad_bytes = sum(p.numel() * p.element_size() for p in TinyLM(256, 32, 2, seq=16).parameters())
    run, _ = ddp
    b = run.collectives[run.collectives.api == "ddp_bucket"]
    assert (b.source == "ddp").all() and b.end_ns.notna().all() and b.bucket.notna().all()
    per_step = b.groupby(["rank", "step"]).in_bytes.sum()
    assert len(per_step) == 2 * STEPS
    assert (per_step == grad_bytes).all(), (per_step.tolist(), grad_bytes)
    # DDP's backward returns only once its buckets are reduced, so no bucket ends after that wait ended (their
    # completion callbacks, waiting for the GIL, used to stamp ends up to 3 ms later: 12 of 96 rows in 12 runs)
    final_wait = run.spans[run.spans.name == "ddp_final_wait"].set_index(["rank", "step"])["end_ns"]
    ends = b.set_index(["rank", "step"])["end_ns"]
    assert (ends <= final_wait.reindex(ends.index)).all(), (ends - final_wait.reindex(ends.index)).tolist()
    _assert_collectives_matched(run)
    assert torch  # torch imported only for the model


def test_ddp_loss_identical_with_and_without_dtprof(ddp, bare_ddp):
    _, losses = ddp
    assert len(losses) == STEPS
    assert losses == bare_ddp


def test_groups_table(ddp):
    run, _ = ddp
    g = run.groups
    assert set(g["rank"]) == {0, 1}
    assert (g.ranks == "0,1").all() and (g["size"] == 2).all() and (g.backend == "gloo").all()
    assert set(g.group) == set(run.collectives.group)


# ---- FSDP2 ------------------------------------------------------------------------------------------------------

def test_fsdp2_all_gather_and_reduce_scatter(fsdp):
    run = fsdp
    c = run.collectives
    assert set(c.op) >= {"all_gather", "reduce_scatter"}
    assert (c[c.op.isin(["all_gather", "reduce_scatter"])].source == "fsdp").all()
    ag = c[c.op == "all_gather"]
    assert (ag.out_bytes == 2 * ag.in_bytes).all()         # world size 2: each rank holds half
    _assert_collectives_matched(run)
    assert run.steps.groupby("rank").size().to_dict() == {0: STEPS, 1: STEPS}


def test_fsdp1_all_gather_and_reduce_scatter(fsdp1):
    # FullyShardedDataParallel (FSDP1): its flat-parameter all-gathers and gradient reduce-scatters, from FSDP
    c = fsdp1.collectives
    assert set(c.op) >= {"all_gather", "reduce_scatter"}
    sharded = c[c.op.isin(["all_gather", "reduce_scatter"])]
    assert (sharded.source == "fsdp").all()
    ag = c[c.op == "all_gather"]
    assert (ag.out_bytes == 2 * ag.in_bytes).all()
    rs = c[c.op == "reduce_scatter"]
    assert (rs.in_bytes == 2 * rs.out_bytes).all()
    _assert_collectives_matched(fsdp1)
    assert fsdp1.steps.groupby("rank").size().to_dict() == {0: STEPS, 1: STEPS}


# ---- pipelining -------------------------------------------------------------------------------------------------

def test_pipeline_chunks_per_stage_and_step(pipeline):
    run, schedule, _ = pipeline
    sp = run.spans
    for kind in ("pp_forward", "pp_backward"):
        k = sp[sp.kind == kind]
        counts = k.groupby(["rank", "step"]).size()
        assert len(counts) == 2 * STEPS and (counts == 4).all(), (kind, counts)
        assert (k.stage == k["rank"]).all()
        assert sorted(k.microbatch.unique()) == [0, 1, 2, 3]
    assert not (sp.kind == "forward").any()      # replaced by pp_forward inside the schedule
    name = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}[schedule]
    meta = run.meta[run.meta["kind"].astype(str) == "pipeline_schedule"].sort_values("rank")
    assert meta["value"].tolist() == [{"schedule": name, "stages": 2, "microbatches": 4, "stage_indices": [r]}
                                      for r in (0, 1)]
    assert not run.events.message.astype(str).str.contains("pipeline schedule:").any()   # a fact, not a message


def test_pipeline_memory_ledger_holds_each_stages_tensors(pipeline):
    """Each stage's ledger row is its own stage module's tensors, as the job counts them (AdamW, fp32): 4P parameter
    bytes, 4P of grads, 8P of moments and a 4-byte step per tensor. The stages hold different layers: they are not
    peers, so no imbalance is named between them; the micro-batches each keeps in flight follow the schedule."""
    from dtprof.analyzers.summary import analyze

    run, schedule, counts = pipeline
    assert sorted(counts) == [0, 1] and counts[0][0] != counts[1][0]
    memory = analyze(run).summary["memory"]
    ranks = {r["rank"]: r for r in memory["ranks"]}
    for rank, (n, tensors) in counts.items():
        r = ranks[rank]
        assert (r["params_bytes"], r["grads_bytes"], r["optimizer_state_bytes"]) == (4 * n, 4 * n, 8 * n + 4 * tensors)
    imb = memory["imbalance"]
    assert imb["ranks"] == [] and imb["peer_groups"] == "ranks of the same pipeline stage"
    assert [(s["stage"], s["ranks"], s["in_flight_microbatches"]) for s in imb["stages"]] == \
        ([(0, [0], 4), (1, [1], 4)] if schedule == "gpipe" else [(0, [0], 2), (1, [1], 1)])


def test_pipeline_p2p_matched(pipeline):
    run, _, _ = pipeline
    _assert_p2p_matched(run)
    c = run.collectives
    act = c[(c.op.isin(["send", "recv"])) & (c.dtype == "float32")]
    # activations and gradients between the stages: one send and one recv per microbatch per step on each side
    assert act.groupby(["rank", "op"], observed=True).size().unique().tolist() == [4 * STEPS]
    assert act.microbatch.notna().all() and (act.source == "pipeline").all()


def test_pipeline_counts_each_sample_once(pipeline):
    """The first stage is given the batch (4 sequences of 16 tokens) and the second is called with what the first
    sent, the same samples: each step has 4 samples and 64 tokens, counted once, by the stage given the batch
    (also in step 0, where the stage's shape inference runs one more micro-batch of its own)."""
    run, _, _ = pipeline
    st = run.steps.sort_values(["rank", "step"])
    first, later = st[st["rank"] == 0], st[st["rank"] == 1]
    assert first.tokens.tolist() == [64] * STEPS and first.samples.tolist() == [4] * STEPS
    assert later.tokens.isna().all() and later.samples.isna().all()


# ---- robustness ---------------------------------------------------------------------------------------------------

def test_fault_in_dtprof_disables_only_that_rank(tmp_path, bare_ddp):
    """A fault of dtprof's own on rank 1, under `dtprof run`: that rank runs on unprofiled with the same losses,
    the run records the fault, nothing of it reaches the job's output (what the relay logged of the job's stdout
    and stderr), and `dtprof run` names it in one line of its own at the end."""
    env = _env(extra={"DTPROF_TEST_FAULT": "collective@1"})
    p = dtprof("run", "--out", "run", "--no-nvml", "--no-report", "--", *_torchrun("train_ddp.py", SMALL), env=env,
               cwd=tmp_path)
    assert returncode(p) == 0, p.stderr[-3000:]
    assert _loss_lines(p.stdout) == bare_ddp
    run_dir = tmp_path / "run"
    (node,) = run_dir.glob("node-*")
    job_output = (node / "stdout.log").read_text() + (node / "stderr.log").read_text()
    assert "step 0 loss" in job_output and "dtprof" not in job_output.lower(), job_output[-2000:]
    said = [ln for ln in p.stderr.splitlines() if "after a fault" in ln]
    assert len(said) == 1 and said[0].startswith("dtprof disabled on rank 1 after a fault in"), said
    assert "injected fault" in said[0]
    run = open_run(run_dir)
    ev = run.events
    err = ev[(ev.level == "error") & (ev["rank"] == 1)]
    assert len(err) == 1 and "injected fault" in err.message.iloc[0]
    assert not (ev[ev["rank"] == 0].level == "error").any()
    faults = run.meta[run.meta["kind"].astype(str) == "fault"]
    assert faults["rank"].tolist() == [1]
    fault = faults["value"].iloc[0]
    # the first collective rank 1 records: a wrapped torch.distributed call or DDP's first bucket
    assert fault["where"].startswith("collective wrapper (") or fault["where"] == "c10d::allreduce_ observer"
    assert fault["error"] == "RuntimeError: injected fault (DTPROF_TEST_FAULT=collective)"
    steps = run.steps.groupby("rank").size().to_dict()
    assert steps[0] == STEPS and steps.get(1, 0) < STEPS


def test_sigkilled_rank_stays_readable(tmp_path):
    run_dir = create_run_dir(tmp_path / "run", {"test": "kill"})
    node_dir = create_node_dir(run_dir)
    args = ["--steps", "100000", "--batch", "4", "--seq", "16", "--dim", "32", "--layers", "2"]
    p = subprocess.Popen(_torchrun("train_ddp.py", args), env=_env(node_dir), cwd=tmp_path,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        steps_file = node_dir / "rank-1" / "steps.jsonl.gz"
        deadline = time.time() + 120
        while time.time() < deadline and p.poll() is None:
            if steps_file.exists() and len(read_table_text(steps_file, []).splitlines()) > 5:
                break
            time.sleep(0.2)
        victim = json.loads((node_dir / "rank-1" / "rank.json").read_text())["pid"]
        os.kill(victim, signal.SIGKILL)
    finally:
        time.sleep(0.5)
        os.killpg(p.pid, signal.SIGKILL)     # the rest of the job: not under test, end it quickly
        p.wait(timeout=60)
    run = open_run(run_dir)
    assert set(run.ranks["rank"]) == {0, 1}
    assert (run.steps["rank"] == 1).sum() >= 5
    assert len(run.collectives[run.collectives["rank"] == 1]) >= 5


def test_single_process_is_rank_zero_with_flop_count(tmp_path):
    run_dir = create_run_dir(tmp_path / "run", {"test": "single"})
    node_dir = create_node_dir(run_dir)
    env = _env(node_dir, {"count_flops": True})
    p = subprocess.run([sys.executable, str(EXAMPLES / "train_ddp.py"), *SMALL], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert returncode(p) == 0, p.stderr[-3000:]
    assert len(_loss_lines(p.stdout)) == STEPS
    run = open_run(run_dir)
    assert run.ranks["rank"].tolist() == [0] and run.ranks.world_size.tolist() == [1]
    s = run.steps.set_index("step")
    assert len(s) == STEPS
    assert s.executed_flops.notna().tolist() == [False, True] + [False] * (STEPS - 2)
    # the truth, from TinyLM's shapes (examples/model.py; SMALL: batch 4, seq 16, dim 32, 2 layers, vocab 256):
    # every Linear's matmul 2·tokens·in·out forward and twice that backward (input and weight gradients), and per
    # block the attention's two batched matmuls forward (4·b·s²·d) and five backward (10·b·s²·d); on this CPU they
    # run as _scaled_dot_product_flash_attention_for_cpu, which FlopCounterMode alone does not count
    b, seq, d, layers, vocab = 4, 16, 32, 2, 256
    linear_in_out = layers * (d * 3 * d + d * d + 2 * d * 4 * d) + d * vocab
    assert s.executed_flops[1] == 6 * b * seq * linear_in_out + layers * 14 * b * seq * seq * d
    fc = run.spans[run.spans.kind == "flops_count"]
    assert fc.step.tolist() == [1]


def test_trace_capture_window_is_a_meta_row(tmp_path):
    """--trace-steps 1:3 on a real job: one trace_capture meta row whose window runs from the profiler's start
    (after step 0 ended) to the end of its stop and export (after step 2 ended, before step 3 did), and names the
    steps it disturbed: 1 and 2 (captured) and 3 (the stop and export run in its time)."""
    run_dir = create_run_dir(tmp_path / "run", {"test": "trace capture"})
    node_dir = create_node_dir(run_dir)
    p = subprocess.run([sys.executable, str(EXAMPLES / "train_ddp.py"), *SMALL],
                       env=_env(node_dir, {"trace_steps": "1:3"}),
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert returncode(p) == 0, p.stderr[-3000:]
    # neither torch's "won't be using warmup" warning nor Kineto's profiler_start/stop lines reach the job's stderr
    assert not [ln for ln in p.stderr.splitlines() if "profiler" in ln.lower() or "warmup" in ln.lower()], p.stderr
    run = open_run(run_dir)
    meta = run.meta[run.meta["kind"].astype(str) == "trace_capture"]
    assert len(meta) == 1
    w = meta["value"].iloc[0]
    s = run.steps.set_index("step")
    assert w["steps"] == [1, 2, 3]
    assert s.end_ns[0] <= w["start_ns"] < s.end_ns[1]
    assert s.end_ns[2] < w["end_ns"] < s.end_ns[3]


USER_HOOK_SCRIPT = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
m = DDP(torch.nn.Linear(10, 10))
m.register_comm_hook(None, default_hooks.fp16_compress_hook)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(3):
    m(torch.randn(4, 10)).sum().backward()
    opt.step()
dist.destroy_process_group()
"""


def test_users_own_ddp_comm_hook_is_wrapped_not_replaced(tmp_path):
    run_dir = create_run_dir(tmp_path / "run", {"test": "user hook"})
    node_dir = create_node_dir(run_dir)
    env = _env(node_dir)
    script = tmp_path / "t.py"
    script.write_text(USER_HOOK_SCRIPT.format(port=_port[0]))
    p = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert returncode(p) == 0, p.stderr[-3000:]
    run = open_run(run_dir)
    b = run.collectives
    assert len(b) == 3 and (b.api == "ddp_bucket").all()
    assert (b.dtype == "float16").all() and (b.in_bytes == 110 * 2).all()   # the user's fp16 compression
    assert not (run.events.level == "error").any()


EVALUATION_SCRIPT = """
import torch
torch.manual_seed(0)
student, teacher = torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)
teacher.requires_grad_(False)
opt = torch.optim.SGD(student.parameters(), lr=0.1)

def evaluate(batches):
    student.eval()
    with torch.no_grad():
        for _ in range(batches):
            student(torch.randn(64, 16))
    student.train()

evaluate(3)                                # before training
for step in range(9):
    x = torch.randn(8, 16)
    with torch.no_grad():
        target = teacher(x)                # a frozen teacher: part of every step, not evaluation
    torch.nn.functional.mse_loss(student(x), target).backward()
    opt.step()
    opt.zero_grad()
    if step % 3 == 2:
        evaluate(5)                        # between steps, and once after the last
print("done", flush=True)
"""


def test_evaluation_between_steps_is_not_step_time(tmp_path):
    """A distillation loop with an evaluation pass before training and every 3 steps: each evaluation is one
    ``evaluation`` span outside every step (the next step starts where it ends), its inputs are not counted, and the
    frozen teacher's forward, run without gradients inside every step, stays a forward of the step."""
    run_dir = create_run_dir(tmp_path / "run", {"test": "evaluation"})
    env = _env(create_node_dir(run_dir), extra={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})  # a launcher's
    (tmp_path / "t.py").write_text(EVALUATION_SCRIPT)
    p = subprocess.run([sys.executable, "t.py"], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert returncode(p) == 0, p.stderr[-3000:]
    run = open_run(run_dir)
    steps = run.steps.sort_values("step")
    assert len(steps) == 9
    ev = run.spans[run.spans["kind"].astype(str) == "evaluation"].sort_values("start_ns")
    assert ev["name"].tolist() == ["3 forward(s) without gradients"] + ["5 forward(s) without gradients"] * 3
    for e in ev.itertuples():   # between two steps: from one's end to the next one's start
        assert not ((steps["start_ns"] < e.end_ns) & (steps["end_ns"] > e.start_ns)).any()
        nxt, prev = steps[steps["start_ns"] >= e.end_ns], steps[steps["end_ns"] <= e.start_ns]
        assert nxt.empty or nxt["start_ns"].iloc[0] == e.end_ns
        assert prev.empty or prev["end_ns"].iloc[-1] == e.start_ns
    assert ev["start_ns"].iloc[-1] == steps["end_ns"].iloc[-1]   # the last one, after training, recorded at exit
    assert (steps["samples"] == 8).all(), steps["samples"].tolist()   # the student's batch only
    fwd = run.spans[run.spans["kind"].astype(str) == "forward"]
    assert (fwd[fwd["step"] >= 1].groupby("step").size() == 2).all()   # teacher and student, every step


def test_ab_blocks_switch_every_rank_at_the_same_step(tmp_path, bare_ddp):
    """benchmarks/overhead.py's A/B blocks (DTPROF_AB_BLOCK_STEPS=2 over 4 steps): every rank records steps 1-2
    (hooks on) and not 3-4 (off: no hooks, no collectives recorded), both ranks alike, and training is the bare
    job's to the last digit through the switches."""
    run_dir, losses, _ = run_job(tmp_path, "train_ddp.py", SMALL, extra_env={"DTPROF_AB_BLOCK_STEPS": "2"})
    run = open_run(run_dir)
    assert run.steps.groupby("rank").size().to_dict() == {0: 2, 1: 2}
    c = run.collectives
    assert c.groupby("rank").size().to_dict() == {0: 2, 1: 2} and (c["api"].astype(str) == "ddp_bucket").all()
    assert not (run.events["level"].astype(str) == "error").any()
    assert losses == bare_ddp and len(losses) == STEPS


def test_ab_blocks_in_a_pipeline_keep_its_point_to_point_ops_valid(tmp_path):
    """The A/B blocks in a GPipe job: while dtprof's wrappers are out, the schedule still builds its P2POps (torch
    checks their op against its own isend/irecv, which is then the original; the run once failed at the first
    switch). Steps 1-2 are recorded with their sends and receives, 3-4 not, and the losses are the bare job's."""
    args = SMALL + ["--schedule", "gpipe", "--microbatches", "4"]
    (tmp_path / "ab").mkdir()
    (tmp_path / "bare").mkdir()
    run_dir, losses, _ = run_job(tmp_path / "ab", "train_pipeline.py", args,
                                 extra_env={"DTPROF_AB_BLOCK_STEPS": "2"})
    bare = run_job(tmp_path / "bare", "train_pipeline.py", args, profiled=False)[1]
    assert losses == bare and len(losses) == STEPS
    run = open_run(run_dir)
    assert run.steps.groupby("rank").size().to_dict() == {0: 2, 1: 2}
    c = run.collectives
    act = c[c.op.isin(["send", "recv"]) & (c.dtype == "float32")]
    assert sorted(act["step"].unique()) == [0, 1]
    assert act.groupby(["rank", "op"], observed=True).size().unique().tolist() == [4 * 2]


SWITCH_CHECK = """
import json, os, sys, torch
import torch.distributed as dist
from dtprof.collectors import hooks_collectives as hc

from dtprof.collectors import runtime
hooks = hc.CollectiveHooks(runtime.STATE.ctx)
hooks.install()
from torch.distributed.pipelining import schedules, stage   # dtprof wraps it as it is imported

def ours():   # which of these are dtprof's functions
    fs = {"forward_one_chunk": stage._PipelineStageBase.forward_one_chunk, "_batch_p2p": schedules._batch_p2p,
          "get_fwd_send_ops": stage._PipelineStageBase.get_fwd_send_ops, "step": schedules.Schedule1F1B.step,
          "isend": dist.isend, "Work.wait": dist.Work.wait}
    ours = os.path.dirname(hc.__file__)     # collectors/: hooks_collectives.py, hooks_pipelining.py
    return sorted(k for k, f in fs.items()
                  if os.path.dirname(getattr(getattr(f, "__code__", None), "co_filename", "")) == ours)

# a P2POp built with torch's isend or dtprof's, with dtprof's wrappers in or out, is valid and gets the one in place
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
torch_isend, dtprof_isend = dist.isend.__wrapped__, dist.isend
ops_ok = []
for wrappers_in in (True, False):
    hooks.set_wrappers(wrappers_in)
    for op in (torch_isend, dtprof_isend):
        p = dist.P2POp(op, torch.zeros(1), 0)
        ops_ok.append(hooks.current_p2p_op(p) == "isend" and p.op is dist.distributed_c10d.isend)
hooks.set_wrappers(True)
on = ours()
hooks.set_wrappers(False)
off = ours()
hooks.set_wrappers(True)
print(json.dumps([on, off, ours(), ops_ok]))
"""


def test_ab_off_block_takes_every_pipelining_wrapper_out(tmp_path):
    """An A/B "off" block measures the job without dtprof: set_wrappers(False) puts torch's own pipelining methods,
    isend and Work.wait back (the pipelining ones once stayed in and passed through, so the off blocks still paid
    for them and the A/B read the pipeline's cost too low), and set_wrappers(True) puts dtprof's back. A P2POp
    built with either isend, in either state, is valid (torch checks its op) and is handed the one in place."""
    p = subprocess.run([sys.executable, "-c", SWITCH_CHECK, str(tmp_path / "store")], capture_output=True, text=True,
                       cwd=REPO, timeout=120, env={**os.environ, "DTPROF_AB_BLOCK_STEPS": ""})
    assert p.returncode == 0, p.stderr[-2000:]
    on, off, again, ops_ok = json.loads(p.stdout)
    assert len(on) == 6 and off == [] and again == on, p.stdout
    assert ops_ok == [True] * 4


REMOVE_CHECK = """
import json, os, sys, torch
import torch.distributed as dist
from dtprof.collectors import hooks_collectives as hc, hooks_functional as hf
from dtprof.collectors.runtime import Recorder

def torch_own():   # which of these are torch's own, by name
    from torch.distributed.pipelining import schedules
    fs = {"all_reduce": dist.all_reduce, "c10d.isend": dist.distributed_c10d.isend, "Work.wait": dist.Work.wait,
          "init_process_group": dist.init_process_group, "_check_op": dist.distributed_c10d._check_op,
          "register_comm_hook": torch.nn.parallel.DistributedDataParallel.register_comm_hook,
          "_batch_p2p": schedules._batch_p2p, "DeviceMesh.__init__": dist.device_mesh.DeviceMesh.__init__,
          "functional all_reduce": torch.ops._c10d_functional.all_reduce}
    ours = os.path.dirname(hc.__file__)     # collectors/
    return sorted(k for k, f in fs.items() if not getattr(getattr(f, "__code__", None), "co_filename", "").startswith(
        ours) and type(f).__name__ != "_OpProxy")

def kernel():
    return torch._C._dispatch_has_kernel_for_dispatch_key("c10d::allreduce_", "AutogradCPU")

bare, kernel_bare, finders = torch_own(), kernel(), len(sys.meta_path)
rec = Recorder()
hooks = hc.CollectiveHooks(rec.ctx)
hooks.install()
functional = hf.FunctionalHooks(rec.ctx, hooks.rows)
functional.install()
import torch.nn.parallel.distributed, torch.distributed.pipelining   # dtprof's hooks go in as they are imported
hooked, kernel_hooked = torch_own(), kernel()
functional.remove()
hooks.remove()
print(json.dumps([bare, hooked, torch_own(), kernel_bare, kernel_hooked, kernel(), finders == len(sys.meta_path)]))
"""


def test_the_recorders_hooks_come_out_as_they_went_in():
    """The hooks are objects the Recorder owns (issue 39): install() puts every one in, remove() puts torch's own
    functions, methods, packets and its c10d::allreduce_ kernel back, and leaves no import hook behind."""
    p = subprocess.run([sys.executable, "-c", REMOVE_CHECK], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    bare, hooked, removed, kernel_bare, kernel_hooked, kernel_removed, finders_gone = json.loads(p.stdout)
    assert len(bare) == 9 and hooked == [] and removed == bare, p.stdout
    assert (kernel_bare, kernel_hooked, kernel_removed) == (False, True, False)
    assert finders_gone


P2P_JOB = """
import json, torch, torch.distributed as dist

calls = [0]
get_future = dist.Work.get_future


def counting_get_future(self):
    calls[0] += 1
    return get_future(self)


dist.Work.get_future = counting_get_future
dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
t = torch.zeros(4)
for step in range(6):
    model(torch.zeros(1, 4)).sum().backward()      # the first forward starts the recording
    opt.step()
    for i in range(5):
        if i % 2:   # as torch's pipelining calls them (dtprof's one-frame path)
            work = dist.isend(t, group=None, tag=0, group_dst=1) if rank == 0 else \
                dist.irecv(t, group=None, tag=0, group_src=0)
        else:
            work = dist.isend(t, 1) if rank == 0 else dist.irecv(t, 0)
        work.wait()
print(json.dumps({"rank": rank, "get_future": calls[0]}), flush=True)
dist.destroy_process_group()
"""


def test_point_to_point_works_without_a_future_are_not_asked_again(tmp_path):
    """gloo's point-to-point works have no future (get_future raises, ~20 us of the training thread each time): dtprof
    asks once per op and group, and Work.wait still completes every row. The two ways of calling isend/irecv (by
    position, and with keywords as torch's pipelining does, which dtprof records in a path of its own) give the same
    rows, numbered in one sequence."""
    script = tmp_path / "p2p_job.py"
    script.write_text(P2P_JOB)
    run_dir, _, p = run_job(tmp_path, str(script), [])
    # found anywhere in the output: the two ranks' prints can share a line (print writes the text and its newline
    # apart, so one rank's text may land between the other's text and newline)
    asked = sorted(int(n) for n in re.findall(r'\{"rank": \d+, "get_future": (\d+)\}', p.stdout))
    assert asked == [1, 1], p.stdout          # one send on rank 0, one recv on rank 1
    c = open_run(run_dir).collectives
    p2p = c[c.op.isin(["send", "recv"])]
    assert p2p.groupby(["rank", "op"], observed=True).size().to_dict() == {(0, "send"): 30, (1, "recv"): 30}
    assert p2p["end_ns"].notna().all()
    for rank, rows in p2p.groupby("rank"):
        assert rows.sort_values("issue_ns")["seq"].tolist() == list(range(30))
        same = rows[["op", "api", "source", "group", "group_size", "in_bytes", "out_bytes", "dtype", "peer",
                     "async_op", "bucket", "stage", "microbatch"]].astype(str).drop_duplicates()
        assert len(same) == 1, same
        assert same.iloc[0][["source", "peer", "dtype"]].tolist() == ["user", str(1 - rank), "float32"]
