"""Numerics health on real DDP jobs (collectors/numerics.py, analyzers/health.py): a clean run raises nothing and
its summary.json holds every step's loss, gradient norm and learning rate as the job itself printed them; a NaN in
one rank's batch at step K is named (that rank, step K); a learning rate 3000x at step K gives a loss spike at K+1
whose cause names the learning rate; one weight's sign bit flipped on one replica is named by the fingerprints
within their interval; a clip inside a compiled function leaves Dynamo's counters as the bare job's."""
import importlib.util
import json
import re
import shutil
import subprocess
import sys

import pytest

from conftest import TESTS, bare_and_profiled, compare_cli, dtprof, record
from dtprof.reader import open_run

JOB = TESTS / "numerics_jobs" / "health.py"
STEPS, K = 40, 14     # 40 steps: the fingerprint's priced interval on this toy job is up to 32


def _printed(p: subprocess.CompletedProcess) -> dict:
    """(rank, step) -> (loss, grad_norm, lr) as the job printed them."""
    num = r"(nan|-?inf|-?[0-9.]+(?:e[-+][0-9]+)?)"    # the ranks' lines can run together on a shared pipe
    return {(int(r), int(s)): (float(loss), float(norm), float(lr))
            for r, s, loss, norm, lr in re.findall(rf"HEALTH (\d+) (\d+) {num} {num} {num}", p.stdout)}


FULL = ("--full-detail", "--no-nvml")
JOBS = {"clean": ("clean", 2, FULL), "clean2": ("clean", 2, FULL), "nan": ("nan", 2, FULL), "lr": ("lr", 2, FULL),
        "flip": ("flip", 3, FULL), "noclip": ("noclip", 2, ("--no-nvml",)), "fp16": ("fp16", 2, FULL)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The recordings, each made when a test first asks for it (a test's time limit covers only its own)."""
    class Recorded(dict):
        def __missing__(self, name):
            mode, nproc, opts = JOBS[name]
            d = tmp_path_factory.mktemp(name) / "run"
            p = record(d, JOB, mode, STEPS, K, opts=opts, nproc=nproc)
            (d.parent / "stdout.txt").write_text(p.stdout)     # the job's other lines (_job_out)
            self[name] = (d, _printed(p))
            return self[name]
    return Recorded()


def _job_out(d) -> str:
    return (d.parent / "stdout.txt").read_text()


def _summary(d) -> dict:
    return json.loads((d / "summary.json").read_text())


def _triage(d) -> tuple[int, dict]:
    p = dtprof("triage", d, "--json")
    return p.returncode, json.loads(p.stdout)


def test_clean_run_is_healthy_with_every_step_as_the_job_printed_it(runs):
    d, printed = runs["clean"]
    assert len(printed) == 2 * STEPS
    health = _summary(d)["health"]
    assert health["incidents"] == [] and health["first_nonfinite"] is None
    got = {(e["rank"], e["step"]): (e["loss"], e["grad_norm"], e["lr"]) for e in health["per_step"]}
    assert got == printed          # float32 losses and norms read back bit for bit, the lr the optimizer used
    assert len({v[2] for v in got.values()}) == 4      # StepLR changed the rate every 10 steps
    fp = health["fingerprint"]
    assert fp["replica_groups"] == [[0, 1]] and fp["compared"] >= 2 and fp["interval"] >= 1
    rc, t = _triage(d)
    assert (rc, t["verdict"]) == (0, "healthy"), t


def test_unclipped_accumulating_job_gets_its_logged_loss_and_dtprofs_norm_equal_to_the_jobs_own(runs):
    """A DDP job that does not clip and accumulates two micro-batches a step as nanoGPT does (each loss divided by 2
    before its backward), recorded with dtprof's own sampling and read pricing: on the steps whose values dtprof
    read (those with a loss), the loss is the micro-batches' undivided mean the job printed (bit for bit: the sum of
    the halves), and the gradient norm dtprof computed before the optimizer step equals the one the job computed
    itself in float64 and printed, within 1e-5 relative; summary.json names its source. The clipped run's norms
    are the job's clip's."""
    d, printed = runs["noclip"]
    per_step = _summary(d)["health"]["per_step"]
    read = [e for e in per_step if e["loss"] is not None]
    assert {e["step"] for e in read} >= set(range(10))      # the pricing steps 0-9 are all read
    for e in read:
        assert e["loss"] == printed[e["rank"], e["step"]][0], e
        assert e["grad_norm_source"] == "dtprof", e
        assert e["grad_norm"] == pytest.approx(printed[e["rank"], e["step"]][1], rel=1e-5), e
    assert all(e["grad_norm"] is None and e["grad_norm_source"] is None for e in per_step if e["loss"] is None)
    meta = open_run(d).meta
    reads = list(meta[meta["kind"] == "numerics_reads"]["value"])
    assert len(reads) == 2 and all(v["cost_ns"] > 0 for v in reads), reads
    clipped = _summary(runs["clean"][0])["health"]["per_step"]
    assert {e["grad_norm_source"] for e in clipped} == {"clip"}


def test_nan_in_one_ranks_batch_is_named_with_its_rank_and_step(runs):
    d, printed = runs["nan"]
    assert printed[1, K][0] != printed[1, K][0] and printed[0, K][0] == printed[0, K][0]   # the job's own view
    rc, t = _triage(d)
    assert (rc, t["verdict"], t["culprit_ranks"], t["step"]) == (1, "numerics", [1], K), t
    first = _summary(d)["health"]["first_nonfinite"]
    assert first == {"step": K, "ranks": [1], "what": "local loss"}
    assert _summary(d)["triage"]["step"] == K


def test_learning_rate_jump_gives_a_loss_spike_at_the_next_step_with_the_rate_named(runs):
    d, printed = runs["lr"]
    assert printed[0, K][2] == pytest.approx(3000 * printed[0, K - 1][2])
    rc, t = _triage(d)
    assert (rc, t["verdict"], t["step"]) == (1, "numerics", K + 1), t
    spike = next(i for i in _summary(d)["health"]["incidents"] if i["kind"] == "loss_spike")
    assert spike["step"] == K + 1 and spike["ranks"] == [0, 1]
    assert spike["cause"].startswith("the learning rate changed"), spike
    assert f"at step {K}" in spike["cause"]
    # this job clips as torchtitan does (get_total_norm, then clip_grads_with_norm_ given it): that norm is read
    h = open_run(d).health
    assert {(int(r.rank), int(r.step)): r.grad_norm for r in h.itertuples()} == {k: v[1] for k, v in printed.items()}
    assert set(h["grad_norm_source"]) == {"clip"}


def test_flipped_sign_bit_on_one_replica_is_named_within_the_fingerprint_interval(runs):
    d, printed = runs["flip"]
    run = open_run(d)
    numerics = [v for v in run.meta[run.meta["kind"] == "numerics"]["value"]]
    assert len(numerics) == 3 and all(v["interval"] for v in numerics), numerics
    interval = max(v["interval"] for v in numerics)
    rc, t = _triage(d)
    assert (rc, t["verdict"], t["culprit_ranks"]) == (1, "divergence", [2]), t
    assert K <= t["step"] < K + interval, (t["step"], interval)
    fp = run.health.dropna(subset=["param_fp"])
    before = fp[fp["step"] < K].groupby("step")["param_fp"].nunique()
    assert len(before) and (before == 1).all()        # the replicas were equal before the flip


def test_fp16_loss_scaler_skip_is_named_not_a_nan_incident(runs):
    """Mixed precision with a torch.amp.GradScaler (float16 autocast on the CPU): an inf in rank 1's targets at step
    K makes its loss inf and every rank's gradients non-finite after the all-reduce, so the scaler skips that
    optimizer step on both ranks and halves its scale (the job's own get_scale() before and after). dtprof records
    each step's scale (the job's, exactly) and the skip, and names the skip in summary.json's health.scaler, not as
    a numerics incident: triage says healthy. A skipped iteration has no optimizer step, so dtprof's step K holds
    iterations K and K+1 (K's inf loss among its losses: named non-finite in the row, not an incident)."""
    d, printed = runs["fp16"]
    scaler = {(int(r), int(s)): (float(sc), int(sk))
              for r, s, sc, sk in re.findall(r"SCALER (\d+) (\d+) ([0-9.e+]+) (\d)", _job_out(d))}
    assert {key for key, (_, sk) in scaler.items() if sk} == {(0, K), (1, K)}          # the job's own skips
    assert printed[1, K][0] == float("inf")
    h = open_run(d).health
    rows = {(int(r.rank), int(r.step)): r for r in h.itertuples(index=False)}
    assert set(rows) == {(r, s) for r in (0, 1) for s in range(STEPS - 1)}

    def it(step):       # the job's iteration whose optimizer step ended dtprof's step
        return step + 1 if step >= K else step
    for (rank, step), row in rows.items():
        scale = scaler[rank, it(step)][0]
        assert (row.loss_scale, row.scaler_skips) == (scale, int(step == K)), (rank, step, row)
        loss, norm, _ = printed[rank, it(step)]
        assert row.grad_norm == norm, (rank, step, row)        # the unscaled gradients' clip
        if step != K:
            assert row.loss == loss * scale, (rank, step, row)  # the scaled loss backward was called on
    assert "loss" in rows[1, K].nonfinite and rows[0, K].nonfinite == ""
    health = _summary(d)["health"]
    assert health["scaler"]["skipped_steps"] == [{"step": K, "ranks": [0, 1], "skips": 1}]
    assert health["first_nonfinite"] is None and health["incidents"] == []
    rc, t = _triage(d)
    assert (rc, t["verdict"]) == (0, "healthy"), t


def test_compare_flags_the_loss_departing_from_a_bit_identical_base_and_the_nan(runs):
    base = [runs["clean"][0], runs["clean2"][0]]
    assert runs["clean"][1] == runs["clean2"][1]     # the job is deterministic: its own printout says so
    code, out = compare_cli(*base, "--head", runs["lr"][0], "--format", "json")
    d = json.loads(out)
    (row,) = d["health"]
    assert (row["what"], row["step"], row["ranks"], row["verdict"]) == ("loss departs", K + 1, [0, 1], "fail"), row
    assert code == 1 or d["exit_code"] == 3, d["outcome"]     # 3 only when a machine probe moved (docs/compare.md)
    assert any(r.startswith("numerics: loss departs at step") for r in d["reasons"]), d["reasons"]
    code, out = compare_cli(*base, "--head", runs["nan"][0], "--format", "json")
    rows = {r["what"]: r for r in json.loads(out)["health"]}
    assert (rows["non-finite"]["step"], rows["non-finite"]["ranks"], rows["non-finite"]["verdict"]) == (K, [1], "fail")
    assert rows["loss departs"]["step"] == K and rows["loss departs"]["ranks"] == [1]   # rank 0 still finite at K
    code, out = compare_cli(runs["clean"][0], "--head", runs["clean2"][0], "--format", "json")
    assert json.loads(out)["health"] == []


def test_clip_inside_and_outside_compiled_code_keeps_dynamo_counters(compile_env, tmp_path):
    job = [sys.executable, str(TESTS / "compile_jobs" / "forms.py"), "clip", "4", "aot_eager"]
    bare, prof = bare_and_profiled(job, compile_env, tmp_path)
    stats = [json.loads(line[5:]) for out in (bare, prof) for line in out.splitlines() if line.startswith("FORM ")]
    keys = ("graphs", "graph_breaks", "recompiles")
    assert len(stats) == 2 and {k: stats[1][k] for k in keys} == {k: stats[0][k] for k in keys}, stats
    assert stats[0]["graphs"] >= 2          # the model and the compiled clip
    norms = {int(s): float(v) for _, s, v in (ln.split() for ln in prof.splitlines() if ln.startswith("NORM "))}
    h = open_run(tmp_path / "run").health.set_index("step")
    assert {s: float(h.loc[s, "grad_norm"]) for s in norms} == norms   # the eager clip's norm, each step
    assert not open_run(tmp_path / "run").events["level"].eq("error").any()



# ---- FSDP2 and a torch pipelining job: the examples' own scripts, a NaN in rank 1's loss at step ENGINE_K -------

ENGINE_STEPS, ENGINE_K = 8, 5
ENGINE_ARGS = ("--steps", ENGINE_STEPS, "--batch", 4, "--seq", 16, "--dim", 32, "--layers", 2, "--clip", 1.0,
               "--print-health", "--nan-at", f"{ENGINE_K}:1")
ENGINES = {"fsdp2": ("train_fsdp.py",), "fsdp1": ("train_fsdp.py", "--fsdp1"),
           "pipeline": ("train_pipeline.py", "--schedule", "1f1b", "--microbatches", 4)}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """FSDP2 and 1F1B pipeline recordings with full detail, each made when a test first asks for it."""
    class Recorded(dict):
        def __missing__(self, name):
            script, *extra = ENGINES[name]
            d = tmp_path_factory.mktemp(name) / "run"
            p = record(d, script, *ENGINE_ARGS, *extra, opts=("--full-detail", "--no-nvml"))
            self[name] = (d, _printed(p))
            return self[name]
    return Recorded()


@pytest.mark.parametrize("engine", ["fsdp2", "fsdp1", "pipeline"])
def test_engine_losses_and_norms_as_printed_and_the_nan_named(engines, engine):
    """FSDP2: each rank's local loss and the replicated norm FSDP2's clip returns (a DTensor), as each rank printed
    them. FSDP1 (FullyShardedDataParallel, a flat parameter per block, sharded): the norm its own
    ``clip_grad_norm_`` method returned (it all-reduces the shards' norms: the total, equal on both ranks).
    Pipeline (1F1B, a stage per rank): the last stage's loss is its microbatches' mean (the job prints the same
    mean in float64), the first stage has no loss (its backward gets activations' gradients) and its own clipped
    norm. A NaN in rank 1's loss at step K: triage names rank 1 and step K."""
    d, printed = engines[engine]
    h = open_run(d).health
    rows = {(int(r.rank), int(r.step)): r for r in h.itertuples(index=False)}
    assert set(rows) == {(r, s) for r in (0, 1) for s in range(ENGINE_STEPS)}
    loss_ranks = (1,) if engine == "pipeline" else (0, 1)
    assert {r for r, _ in printed} == set(loss_ranks)
    for (rank, step), (loss, norm, lr) in printed.items():
        got = rows[rank, step]
        assert got.lr == lr, (rank, step)
        if step < ENGINE_K:
            assert (got.loss, got.grad_norm) == (loss, norm), (rank, step, got, loss, norm)
    if engine == "fsdp1":     # the method's total, not a shard's: the same on both ranks, read as a clip's
        assert all(printed[0, s][1] == printed[1, s][1] for s in range(ENGINE_K))
        assert set(h[h["step"] < ENGINE_K]["grad_norm_source"]) == {"clip"}
    if engine == "pipeline":
        first = h[h["rank"] == 0].sort_values("step")
        assert first["loss"].isna().all()                                     # no loss on the first stage
        assert (first["grad_norm"].head(ENGINE_K) > 0).all()                  # its own stage's clipped norm
    assert printed[1, ENGINE_K][0] != printed[1, ENGINE_K][0]                 # the job's own view: NaN at K
    assert "loss" in str(rows[1, ENGINE_K].nonfinite)
    rc, t = _triage(d)
    assert (rc, t["verdict"], t["culprit_ranks"], t["step"]) == (1, "numerics", [1], ENGINE_K), t
    assert _summary(d)["health"]["first_nonfinite"] == {"step": ENGINE_K, "ranks": [1], "what": "local loss"}


def test_no_device_value_is_read_on_the_host(tmp_path):
    """No host-device sync added: every host read of a tensor's values made from dtprof's rank-side code during a
    real DDP job (Tensor.item/tolist/__float__/__int__/__bool__/numpy/cpu/to, counted by their caller;
    tests/numerics_jobs/syncs.py) is of the numerics part's host ring, and every copy into the ring is
    non_blocking: what reaches the host from the job's tensors travels only that way (on a GPU each other read
    would be a sync; this machine has none for torch.cuda.set_sync_debug_mode). The job clips on even steps only:
    the norm dtprof computes on the odd ones travels the same way; its GradScaler's scale and skip flag too."""
    steps = 12
    p = record(tmp_path / "run", TESTS / "numerics_jobs" / "syncs.py", steps, opts=("--full-detail", "--no-nvml"))
    notes = {int(r): json.loads(js) for r, js in re.findall(r"SYNCS (\d+) (\{.*?\})(?=SYNCS|\s*$)", p.stdout, re.M)}
    assert set(notes) == {0, 1}
    for n in notes.values():
        calls = n["calls"]
        copies = [c for c in calls if c["method"] == "copy_" and c["into_ring"]]
        reads = [c for c in calls if c["method"] != "copy_"]
        assert len(copies) >= 2 * steps        # the loss and the norm of each step, at least
        assert all(c["non_blocking"] and not c["from_ring"] for c in copies), copies
        assert [c for c in calls if c["method"] == "copy_" and not c["into_ring"]] == []
        assert reads and all(c["in_ring"] for c in reads), [c for c in reads if not c["in_ring"]]
    h = open_run(tmp_path / "run").health
    assert h["loss"].notna().sum() == 2 * steps and h["grad_norm"].notna().sum() == 2 * steps
    assert h["loss_scale"].notna().sum() == 2 * steps and (h["scaler_skips"] == 0).all()   # the GradScaler's
    # the job clips on even steps: the odd steps' norms are the ones dtprof computed, read the same way
    assert h.groupby(h["step"] % 2)["grad_norm_source"].agg(set).to_dict() == {0: {"clip"}, 1: {"dtprof"}}


# ---- DeepSpeed: the engine's own gradient norm and its gradient accumulation ------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="no C++ compiler for DeepSpeed's comm op")
def test_deepspeed_grad_norm_and_accumulated_loss_are_the_engines_own(tmp_path):
    """ZeRO-2 on DeepSpeed's CPU accelerator (examples/frameworks/train_deepspeed.py), two parameter groups (ZeRO
    steps the torch optimizer once per group) and gradient accumulation 2 (the engine divides each micro-batch's
    loss by 2 before its backward): each rank's every step is recorded with the loss the job computed, its
    micro-batches' mean (bit for bit), and the gradient norm the engine's own get_global_grad_norm() returned after
    the step (source "deepspeed", not one dtprof computed), as each rank printed them."""
    from test_deepspeed import Job

    steps = 6
    job = Job(tmp_path / "run", ("--zero", "2", "--accum", "2", "--decay-groups", "--steps", str(steps),
                                 "--dim", "64", "--print-health"), launcher="torchrun")
    printed = _printed(subprocess.CompletedProcess([], 0, job.stdout))
    assert set(printed) == {(r, s) for r in (0, 1) for s in range(steps)}, job.stdout[-2000:]
    h = open_run(job.out).health
    got = {(int(r.rank), int(r.step)): (r.loss, r.grad_norm, r.lr, r.grad_norm_source)
           for r in h.itertuples(index=False)}
    assert set(got) == set(printed)
    for key, (loss, norm, lr) in printed.items():
        assert got[key] == (loss, norm, lr, "deepspeed"), (key, got[key], printed[key])
    assert len({printed[0, s][1] for s in range(steps)}) == steps          # a norm of each step's own
    assert all(printed[0, s][0] != printed[1, s][0] for s in range(steps))  # each rank's own loss


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="no C++ compiler for DeepSpeed's comm op")
@pytest.mark.parametrize("clip", [None, "0.01"])
def test_deepspeed_stage0_fp32_norm_is_the_whole_gradients(tmp_path, clip):
    """ZeRO stage 0 in fp32: the engine steps the torch optimizer itself and keeps no norm (get_global_grad_norm()
    is None), so the job prints its own: the float64 norm of its gradients after the boundary's backward (which
    all-reduced them), before engine.step(). Without clipping dtprof computes the norm of the optimizer's whole
    gradients at its step (source "dtprof"); with DeepSpeed's gradient_clipping (0.01: every step clipped) it reads
    the total norm DeepSpeed's own clip returned and the engine dropped (source "clip"), not the clipped
    gradients' norm (at most 0.01). Both within float32 rounding of the job's, every rank and step; accumulation 2:
    the loss bit for bit the micro-batches' mean the job printed."""
    from test_deepspeed import Job

    steps = 6
    job = Job(tmp_path / "run", ("--zero", "0", "--accum", "2", "--steps", str(steps), "--dim", "64",
                                 "--print-health", *(("--clip", clip) if clip else ())), launcher="torchrun")
    printed = _printed(subprocess.CompletedProcess([], 0, job.stdout))
    assert set(printed) == {(r, s) for r in (0, 1) for s in range(steps)}, job.stdout[-2000:]
    assert all(printed[0, s][1] == printed[1, s][1] for s in range(steps))   # the job's norms: whole gradients'
    if clip:
        assert all(printed[0, s][1] > 2 * float(clip) for s in range(steps)), printed  # every step clipped
    h = open_run(job.out).health
    got = {(int(r.rank), int(r.step)): r for r in h.itertuples(index=False)}
    assert set(got) == set(printed)
    for key, (loss, norm, lr) in printed.items():
        row = got[key]
        assert (row.loss, row.lr, row.grad_norm_source) == (loss, lr, "clip" if clip else "dtprof"), (key, row)
        assert row.grad_norm == pytest.approx(norm, rel=1e-5), (key, row.grad_norm, norm)
