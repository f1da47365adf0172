"""A larger ZeRO-2 bucket predicted from a small-bucket run, checked against the larger bucket in the same job (issue
47 point 4; docs/what-if.md, "DeepSpeed ZeRO"): the measurement behind the ``zero_one_bucket`` scenario
(analyzers/zero_bucket.py, the same model from the bucket flush spans the rank side now records; this script tells
the buckets apart by size instead, so it reads runs recorded before those spans too).

    .venv/bin/python benchmarks/zero_bucket_whatif.py [--jobs 3] [--steps 40]
    .venv/bin/python benchmarks/zero_bucket_whatif.py --runs RUN [RUN ...]    # alternating runs already recorded

Each job: ``dtprof run -- deepspeed --num_gpus 2 examples/frameworks/train_deepspeed.py --zero 2 --dim 16 --blocks
64 --bucket 262144,4096`` (CPU, gloo, ``overlap_comm`` off): the two engines alternate step by step in one job, even
steps with 262,144-element buckets (the whole 136,192 gradient elements in one all_reduce), odd steps with 4,096
(43 all_reduces of whole parameters), so that the shared machine's load hits both alike. From dtprof's own tables
(steps, collectives) of the small-bucket steps only:

- each rank's work = its step less the time its training thread was blocked in the gradient buckets' all_reduces
  (issue to end; every other collective, the 4-byte overflow check and the all_gather, is kept);
- the larger bucket's reduction takes the small buckets' mean transfer after the last arrival (a per-call cost: on
  this CPU the transfer does not grow with bytes, measured 1.4-5.9 ms for 544,768 bytes, 2.4-3.1 ms for ~12,800);
- predicted step = max over ranks of the work + that transfer (one meeting instead of 43; the ranks no longer meet
  at every bucket). Predicted saving = median small step - median predicted step; measured = median small step -
  median large step. The noise of the truth: the measured saving of each half of the job's steps.

The engine's own work per bucket is not in the prediction (runs recorded before the ``zero_bucket`` spans cannot
separate it: DeepSpeed's ``reduce_ipg_grads`` runs on the training thread inside ``loss.backward()``, between
autograd's ops); the job's own clock (``clock`` lines) gives each rank's time outside ``torch.distributed`` calls in the
two kinds of step, printed as ``work change`` (large - small): what the prediction leaves out. The job also times
DeepSpeed's flushes itself (``--time-flushes``): the engine's work in them less communication, per step, printed
for both kinds of step.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from dtprof.reader import open_run

REPO = Path(__file__).resolve().parent.parent
LARGE, SMALL = 262144, 4096
WARM = 4        # each engine's first steps (DeepSpeed's set-up) are left out


def run_job(out: Path, steps: int, bucket: str = f"{LARGE},{SMALL}") -> str:
    """One job under dtprof (by default the alternating one); its output, with the load average before and after."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(REPO / ".torch_ext"),
               PATH=f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}")
    port = 29600 + random.randrange(300)
    before = Path("/proc/loadavg").read_text().split()[0]
    p = subprocess.run([str(REPO / ".venv/bin/dtprof"), "run", "--out", str(out), "--no-report", "--", "deepspeed",
                        "--num_gpus", "2", "--master_port", str(port), "examples/frameworks/train_deepspeed.py",
                        "--zero", "2", "--dim", "16", "--blocks", "64", "--steps", str(steps),
                        "--bucket", bucket, "--time-flushes"],
                       cwd=REPO, env=env, capture_output=True, text=True)
    for f in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        f.unlink(missing_ok=True)     # DeepSpeed's CPU comm buffers of this job
    if p.returncode:
        raise SystemExit(f"job failed (exit {p.returncode}): {p.stdout[-2000:]}{p.stderr[-2000:]}")
    return f"load before: {before}\n{p.stdout}\nload after: {Path('/proc/loadavg').read_text().split()[0]}\n"


def check(run_dir: Path, output: str) -> dict:
    run = open_run(str(run_dir))
    st = run.table("steps")
    co = run.table("collectives")
    co = co[co["step"].notna()]
    st = st.assign(rank=st["rank"].astype(int), step=st["step"].astype(int),
                   d=(st["end_ns"] - st["start_ns"]).astype(float) / 1e6)
    co = co.assign(rank=co["rank"].astype(int), step=co["step"].astype(int),
                   blocked=(co["end_ns"] - co["issue_ns"]).astype(float) / 1e6)
    n = int(st["step"].max()) + 1
    small = [s for s in range(WARM, n) if s % 2 == 1]
    large = [s for s in range(WARM, n) if s % 2 == 0]
    # the gradient buckets: the all_reduces of more than one element (the other is the 4-byte overflow check)
    bk = co[(co["op"] == "all_reduce") & (co["in_bytes"] > 4)]
    bks = bk[bk["step"].isin(small)]
    last = bks.groupby(["group", "seq"])["issue_ns"].transform("max")
    transfer = (bks["end_ns"] - last).astype(float) / 1e6
    ranks = sorted(st["rank"].unique())
    d = st.pivot(index="step", columns="rank", values="d")
    blocked = bks.groupby(["step", "rank"])["blocked"].sum().unstack("rank").reindex(small)
    t_mean = transfer.groupby(bks["step"]).mean().reindex(small)
    pred = (d.loc[small] - blocked).max(axis=1) + t_mean
    job_small, job_large = d.loc[small].max(axis=1), d.loc[large].max(axis=1)
    measured = float(job_small.median() - job_large.median())
    predicted = float(job_small.median() - pred.median())
    h = len(small) // 2
    halves = [float(job_small.iloc[:h].median() - job_large.iloc[:h].median()),
              float(job_small.iloc[h:].median() - job_large.iloc[h:].median())]
    # the job's own clock: time outside torch.distributed calls, large steps less small steps, per rank
    clk = {int(r): np.array(json.loads(js)["steps"])
           for r, js in re.findall(r"clock (\d+) (\{\"steps\": \[.*?\]\]\})", output)}
    work_change = {r: float(np.median(c[large, 0] - c[large, 1]) - np.median(c[small, 0] - c[small, 1])) * 1e3
                   for r, c in sorted(clk.items())}
    # the job's own timing of DeepSpeed's flushes (--time-flushes): the engine's work in them, less communication
    flush = {int(r): np.array(json.loads(js)["steps"])
             for r, js in re.findall(r"flush (\d+) (\{\"steps\": \[.*?\]\]\})", output)}
    engine_ms = {r: [float(np.median(f[ss, 1] - f[ss, 2])) * 1e3 for ss in (large, small)]
                 for r, f in sorted(flush.items())}
    large_tr = bk[bk["step"].isin(large)]
    large_tr = (large_tr["end_ns"] - large_tr.groupby(["group", "seq"])["issue_ns"].transform("max")).astype(float)
    return {"load": re.findall(r"load (?:before|after|average): ([\d.]+)", output), "ranks": len(ranks),
            "buckets_small": int(len(bks) / len(ranks) / len(small)),
            "buckets_large": int((bk["step"].isin(large)).sum() / len(ranks) / len(large)),
            "small_step_ms": float(job_small.median()), "large_step_ms": float(job_large.median()),
            "predicted_large_ms": float(pred.median()), "measured_saving_ms": measured,
            "predicted_saving_ms": predicted, "error": (predicted - measured) / measured,
            "measured_saving_halves_ms": halves, "small_transfer_mean_ms": float(transfer.mean()),
            "large_transfer_median_ms": float(np.median(large_tr) / 1e6), "work_change_ms": work_change,
            "engine_flush_ms": engine_ms}


def job_steps_s(output: str) -> np.ndarray:
    """The job's own step times (its ``clock`` lines), the slowest rank's per step, its first WARM steps left out."""
    clk = [np.array(json.loads(js)["steps"])[:, 0] for _, js in re.findall(r"clock (\d+) (\{\"steps\": \[.*?\]\]\})",
                                                                              output)]
    return np.max(clk, axis=0)[WARM:]


def rerun_pair(tmp: Path, i: int, steps: int) -> str:
    """A plain small-bucket run (every step SMALL) and its rerun with the LARGE bucket, one after the other: the
    ``zero_one_bucket`` what-if of the first (its summary.json, as a user reads it) against the job's own clock of
    the second."""
    outs = {}
    for b in (SMALL, LARGE) if i % 2 == 0 else (LARGE, SMALL):     # alternate the order: drift hits both alike
        outs[b] = run_job(tmp / f"pair{i}_{b}", steps, str(b))
        (tmp / f"pair{i}_{b}.out").write_text(outs[b])
    summary = json.loads((tmp / f"pair{i}_{SMALL}" / "summary.json").read_text())
    entry = [w for w in summary["what_if"] if w["scenario"] == "zero_one_bucket"]
    if not entry:
        raise SystemExit(f"no zero_one_bucket what-if in {tmp / f'pair{i}_{SMALL}'}: {summary['what_if_skipped']}")
    small, large = float(np.median(job_steps_s(outs[SMALL]))), float(np.median(job_steps_s(outs[LARGE])))
    measured = 1.0 - large / small
    predicted = float(entry[0]["saving_frac"])
    loads = "/".join(x for b in (SMALL, LARGE) for x in re.findall(r"load (?:before|after): ([\d.]+)", outs[b]))
    halves = "; ".join(f"{b}: " + ", ".join(f"{np.median(h) * 1e3:.1f}"
                                            for h in np.array_split(job_steps_s(outs[b]), 2)) for b in (SMALL, LARGE))
    return (f"pair {i}: load {loads}; job's step (own clock, median) {SMALL}-element buckets {small * 1e3:.1f} ms, "
            f"rerun with {LARGE} {large * 1e3:.1f} ms: saving measured {measured:.1%}, what-if predicted "
            f"{predicted:.1%} (error {(predicted - measured) / measured:+.0%}); the truth's noise, each run's halves' "
            f"median step (ms): {halves}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--runs", nargs="*", help="alternating runs already recorded (RUN.out beside each: its output)")
    p.add_argument("--reruns", type=int, default=0,
                   help="instead: N pairs of plain runs, the small bucket's what-if against a rerun with the large")
    a = p.parse_args()
    if a.reruns:
        tmp = Path(tempfile.mkdtemp(prefix="zero_bucket_reruns_"))
        for i in range(a.reruns):
            print(rerun_pair(tmp, i, a.steps), flush=True)
        return
    if a.runs:
        todo = [(Path(r), Path(r + ".out").read_text()) for r in a.runs]
    else:
        tmp = Path(tempfile.mkdtemp(prefix="zero_bucket_"))
        todo = []
        for i in range(a.jobs):
            out = run_job(tmp / f"job{i}", a.steps)
            (tmp / f"job{i}.out").write_text(out)
            todo.append((tmp / f"job{i}", out))
    for run_dir, out in todo:
        r = check(run_dir, out)
        print(f"{run_dir}: load {'/'.join(r['load'])}; buckets a step {r['buckets_large']} vs {r['buckets_small']}; "
              f"step {r['large_step_ms']:.1f} vs {r['small_step_ms']:.1f} ms; saving measured "
              f"{r['measured_saving_ms']:.1f} ms (halves {r['measured_saving_halves_ms'][0]:.1f}, "
              f"{r['measured_saving_halves_ms'][1]:.1f}), predicted {r['predicted_saving_ms']:.1f} ms "
              f"(error {r['error']:+.0%}); transfer small mean {r['small_transfer_mean_ms']:.2f} ms, large median "
              f"{r['large_transfer_median_ms']:.2f} ms; work change (large - small, job's clock) "
              + ", ".join(f"rank {k} {v:+.1f} ms" for k, v in r["work_change_ms"].items())
              + "".join(f"; rank {k}'s engine work in flushes {lg:.1f} ms a step (large), {sm:.1f} (small)"
                        for k, (lg, sm) in r["engine_flush_ms"].items()))


if __name__ == "__main__":
    main()
