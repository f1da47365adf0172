"""What-if accuracy on real counterfactual runs (CPU/gloo): inject a slowdown, predict the run without it from the
slowed run's what-if list (analyzers/whatif.py), run without it, and compare predicted with measured.

    .venv/bin/python benchmarks/what_if_accuracy.py [--steps 14] [--cases ddp_straggler,gpipe_balance,...]
    .venv/bin/python benchmarks/what_if_accuracy.py --interleaved --steps 30 [--cases ddp_straggler,...]

--interleaved runs ONE job per case whose slowed and fixed steps alternate (``measure_interleaved``); without it
each case is two separate runs (``measure``).

The jobs are real torchrun jobs under the profiler (the injected sitecustomize, as `dtprof run` does):
- ddp_straggler: DDP, 3 ranks, rank 1 sleeps 40 ms inside backward (DDP's all-reduce waits for it) -> the
  straggler_removed scenario for rank 1 against the same job without the sleep;
- ddp_straggler_busy: the same, the slow rank spinning on its core for 40 ms instead of sleeping;
- gpipe_balance: GPipe, 2 stages sleeping 70 and 30 ms per step in forward -> balanced_stages against 50 and 50
  (interleaved: --fixed-stage-ms 50,50 on the fixed steps);
- data_wait: DDP, 2 ranks, every rank waits 30 ms for each batch -> no_data_wait against no wait;
- overlap_bound: DDP, 2 ranks, its gradient all-reduce exposed -> perfect_overlap against the same 2-rank job whose
  gradients are never all-reduced (DDP no_sync) but whose ranks still meet after backward (an all-reduce of one
  number, --sync-point): communication that costs nothing, with the synchronisation kept, which is what
  perfect_overlap models (it keeps waiting for late peers). No real overlap should beat the prediction (predicted
  saving >= measured, up to noise). Without the sync point the ranks drift apart and absorb each other's jitter,
  which is not an overlap gain; a 1-rank reference also removes the other rank's CPU contention; both beat it;
- overlap_bound_wide: the same with a model 8x wider (12 MB of gradients per all-reduce). On CPU/gloo the
  all-reduce's own CPU work slows the compute it overlaps, which the model keeps fixed: --interleaved prints that
  compute change (work Δ), and docs/what-if.md shows the bound beaten by about that much.
Saving = 1 - step ÷ the slowed run's step (median over measured steps; predicted: the slowed median × (1 - the
scenario's saving_frac)); error = (predicted - measured saving) ÷
measured saving. Timings on a shared machine are noisy; say so beside any figure you quote.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import numpy as np

import dtprof._inject
from dtprof.analyzers import whatif
from dtprof.analyzers.runmodel import build as build_model
from dtprof.analyzers.summary import analyze
from dtprof.reader import open_run
from dtprof.rundir.writer import create_node_dir, create_run_dir

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from torch_abort import once_more_on_exit_abort, returncode  # noqa: E402  (tests/torch_abort.py says why)

SMALL = ["--batch", "4", "--seq", "16", "--dim", "32", "--layers", "2"]
# name: (script, ranks, slowed args, fixed args, scenario, ranks of the scenario)
CASES = {
    "ddp_straggler": ("train_ddp.py", 3, ["--slow-rank", "1", "--slow-ms", "40", "--slow-in", "backward"], [],
                      "straggler_removed", [1]),
    # the same straggler spinning on its core instead of sleeping (slow compute burns CPU)
    "ddp_straggler_busy": ("train_ddp.py", 3, ["--slow-rank", "1", "--slow-ms", "40", "--slow-in", "backward",
                                               "--slow-busy"], [], "straggler_removed", [1]),
    "gpipe_balance": ("train_pipeline.py", 2, ["--stage-ms", "70,30"], ["--stage-ms", "50,50"], "balanced_stages",
                      []),
    "data_wait": ("train_ddp.py", 2, ["--data-ms", "30"], [], "no_data_wait", []),
    "overlap_bound": ("train_ddp.py", 2, [], ["--no-sync", "--sync-point"], "perfect_overlap", []),
    # the same with a model 8x wider (about 3 M parameters, 12 MB of gradients per all-reduce): bytes, not only the
    # meeting, cost time
    "overlap_bound_wide": ("train_ddp.py", 2, ["--dim", "256"], ["--dim", "256", "--no-sync", "--sync-point"],
                           "perfect_overlap", []),
}
_port = [29700 + os.getpid() % 200]



def run_job(tmp: Path, script: str, nproc: int, args: list[str]) -> Path:
    """One profiled torchrun job on CPU/gloo; returns its run directory. After torch's own abort at a rank's exit
    (tests/torch_abort.py) it runs once more, into a new run directory."""
    run_dir = None

    def launch(_attempt: int) -> subprocess.CompletedProcess:
        nonlocal run_dir
        run_dir = create_run_dir(tmp / f"run{_port[0]}", {"test": script})
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DTPROF_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                       "MASTER_", "TORCHELASTIC"))}
        _port[0] += 1
        env.update(OMP_NUM_THREADS="1", MASTER_PORT=str(_port[0]), DTPROF_NODE_DIR=str(create_node_dir(run_dir)),
                   DTPROF_CONFIG=json.dumps({"flush_interval_s": 0.2}),
                   PYTHONPATH=os.pathsep.join([str(Path(dtprof._inject.__file__).parent), env.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
               str(_port[0]), str(REPO / "examples" / script), *args]
        return subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=300)

    p = once_more_on_exit_abort(launch)
    if returncode(p) != 0:   # a second abort raises TorchExitAbort (a test that ran this runs again)
        _failed(script, args, p)
    assert run_dir is not None
    return run_dir


def _failed(script: str, args: list[str], p: subprocess.CompletedProcess) -> NoReturn:
    raise RuntimeError(f"{script} {' '.join(args)} failed: {p.stderr[-2000:]}")


def measure(case: str, steps: int, tmp: Path) -> dict:
    """Predicted and measured saving of one case: its slowed run's prediction against the fixed run."""
    script, nproc, slowed, fixed, scenario, ranks = CASES[case]
    common = ["--steps", str(steps)] + SMALL
    a = analyze(run_job(tmp, script, nproc, common + slowed)).summary
    b = analyze(run_job(tmp, script, nproc, common + fixed)).summary
    entry = next((w for w in a["what_if"] if w["scenario"] == scenario and w["ranks"] == ranks), None)
    # medians: on a shared machine a few steps descheduled for tens of ms move a mean of 12 steps by 10 %
    slow_s = a["steps"]["time_s"]["p50"]
    fixed_s = b["steps"]["time_s"]["p50"]
    measured = 1.0 - fixed_s / slow_s
    predicted = entry["saving_frac"] if entry else 0.0
    return {"case": case, "scenario": scenario, "ranks": ranks, "slowed_step_s": slow_s,
            "predicted_step_s": slow_s * (1.0 - predicted), "fixed_step_s": fixed_s,
            "predicted_saving": predicted, "measured_saving": measured,
            "error_of_saving": (predicted - measured) / measured if measured else None,
            "replay_error": (a.get("replay") or {}).get("error_frac"),
            "fixed_replay_error": (b.get("replay") or {}).get("error_frac")}


INTERLEAVED = ("ddp_straggler", "ddp_straggler_busy", "data_wait", "overlap_bound", "overlap_bound_wide",
               "gpipe_balance")


def _scenario_edit(g, scenario: str, ranks: list[int]):
    """The scenario's (work durations, transfers) edit of the step model (analyzers/whatif.py)."""
    if scenario == "straggler_removed":
        return whatif.straggler_removed(g, ranks, whatif.peers_of(g)), None
    if scenario == "no_data_wait":
        return whatif.no_data_wait(g), None
    if scenario == "perfect_overlap":
        return whatif.perfect_overlap(g)
    if scenario == "balanced_stages":
        return whatif.balanced_stages(g), None
    raise ValueError(f"{scenario}: no interleaved measurement")


def measure_interleaved(case: str, steps: int, tmp: Path) -> dict:
    """Like ``measure``, but the slowed and the fixed job alternate step by step in ONE run (``--fix-every 2``: odd
    steps run fixed), so the machine's load hits both alike. Predicted: the scenario's replay of the slowed (even)
    measured steps; measured: the median fixed (odd) step against the median slowed step."""
    script, nproc, slowed, fixed, scenario, ranks = CASES[case]
    fixed = ["--fixed-stage-ms" if a == "--stage-ms" else a for a in fixed]   # the pipeline's fixed op times
    run_dir = run_job(tmp, script, nproc, ["--steps", str(steps)] + SMALL + slowed + fixed + ["--fix-every", "2"])
    model = build_model(open_run(run_dir))
    g = whatif.build(model)
    job = model.job.set_index("step")["time_s"]
    measured = sorted(model.measured_steps)
    slow = [s for s in measured if s % 2 == 0]
    fix = [s for s in measured if s % 2 == 1]
    ident = whatif.job_steps(g, whatif.replay(g)).reindex(slow)
    scen = whatif.job_steps(g, whatif.replay(g, *_scenario_edit(g, scenario, ranks))).reindex(slow)
    predicted = 1.0 - scen.sum() / ident.sum()
    slow_s, fixed_s = float(job.reindex(slow).median()), float(job.reindex(fix).median())
    measured_saving = 1.0 - fixed_s / slow_s
    replay_err = float((np.abs(ident - job.reindex(slow)) / job.reindex(slow)).mean())
    # the model keeps every other rank's work fixed: how much that work changed between slowed and fixed steps
    # (median per rank, mean over the ranks the scenario does not edit)
    parts = whatif._part_totals(g, g.dur)[["forward", "backward", "optimizer"]].sum(axis=1).to_numpy() / 1e9
    w = g.windows.assign(work=parts)
    w = w[~w["rank"].isin(ranks) & w["step"].isin(measured)]
    by = w.assign(fixed=w["step"] % 2 == 1).groupby(["rank", "fixed"])["work"].median().unstack()
    work_change = float((by[True] - by[False]).mean())
    # the time the ranks waited for a CPU, which the model does not see either: how much more the fixed steps waited
    # (median per rank, the largest change over the ranks)
    st = model.steps[model.steps["step"].isin(measured)]
    cw = st.assign(fixed=st["step"] % 2 == 1).groupby(["rank", "fixed"])["cpu_wait_s"].median().unstack()
    cpu_wait_change = float((cw[True] - cw[False]).max())
    return {"case": case + "/il", "scenario": scenario, "ranks": ranks, "slowed_step_s": slow_s,
            "predicted_step_s": slow_s * (1.0 - predicted), "fixed_step_s": fixed_s,
            "predicted_saving": predicted, "measured_saving": measured_saving,
            "error_of_saving": (predicted - measured_saving) / measured_saving if measured_saving else None,
            "replay_error": replay_err, "fixed_replay_error": replay_err, "steps": (len(slow), len(fix)),
            "other_work_change_s": work_change, "cpu_wait_change_s": cpu_wait_change}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--interleaved", action="store_true",
                    help="slowed and fixed steps alternate in one run (cases " + ", ".join(INTERLEAVED) + ")")
    args = ap.parse_args()
    print(f"{'case':<15} {'scenario':<18} {'slowed':>9} {'predicted':>9} {'fixed':>9} {'pred.sav':>8} "
          f"{'meas.sav':>8} {'error':>7} {'replay err':>10}" + (f" {'work Δ':>11}" if args.interleaved else ""))
    with tempfile.TemporaryDirectory() as d:
        for case in args.cases.split(","):
            r = (measure_interleaved if args.interleaved else measure)(case, args.steps, Path(d))
            err = "—" if r["error_of_saving"] is None else f"{r['error_of_saving']:+.0%}"
            print(f"{case:<15} {r['scenario']:<18} {r['slowed_step_s'] * 1e3:7.1f}ms "
                  f"{r['predicted_step_s'] * 1e3:7.1f}ms {r['fixed_step_s'] * 1e3:7.1f}ms "
                  f"{r['predicted_saving']:8.1%} {r['measured_saving']:8.1%} {err:>7} "
                  f"{r['replay_error']:.1%}/{r['fixed_replay_error']:.1%}"
                  + (f" {r['other_work_change_s'] * 1e3:+9.1f}ms" if "other_work_change_s" in r else ""),
                  flush=True)


if __name__ == "__main__":
    main()
