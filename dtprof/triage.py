"""`dtprof triage`: which rank hung or crashed, where, and the evidence. No torch import (starts fast).

The analysis lives in ``dtprof.analyzers.triage``; this module parses options, asks a live job for dumps, prints.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import click

from dtprof.cli import InputError

LIVE_DUMP_WAIT_S = 5.0


def _live_dumps(run_dir: Path) -> str:
    """Ask every rank of a running job for a dump (without stopping it) and wait for the answers."""
    from dtprof.rundir.incident import read_heartbeats
    from dtprof.rundir.writer import NODE_PREFIX
    from dtprof.watchdog import pid_alive, request_dumps, wait_for_dumps

    dump_id = f"live-{time.strftime('%Y%m%dT%H%M%S')}"
    for nd in sorted(run_dir.glob(f"{NODE_PREFIX}*")):
        request_dumps(nd, dump_id, "dtprof triage --live")
    total = 0
    for nd in sorted(run_dir.glob(f"{NODE_PREFIX}*")):
        live = [r for r, hb in read_heartbeats(nd).items() if pid_alive(hb.get("pid"))]
        got = wait_for_dumps(nd, dump_id, live, LIVE_DUMP_WAIT_S)
        total += len(got)
    click.echo(f"dtprof triage: {total} rank(s) answered the live dump request {dump_id}", err=True)
    return dump_id


@click.command("triage")
@click.argument("run_dir", required=False, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable verdict (keys: verdict, culprit_ranks, "
              "collective, message, evidence).")
@click.option("--live", is_flag=True, help="The job is still running: read heartbeats and ask every rank for a "
              "state dump without stopping it.")
@click.option("--stale", "stale_s", type=float, default=60.0, show_default=True,
              help="With --live: seconds without progress on any rank that count as a hang.")
@click.option("--fr", "fr_paths", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="Flight Recorder dump file (pickle or JSON) or directory of dumps, e.g. from "
                   "TORCH_NCCL_DUMP_ON_TIMEOUT; repeatable. Usable without RUN_DIR.")
def triage_command(run_dir, as_json, live, stale_s, fr_paths):
    """Say which rank hung or crashed, where it is stuck, and the evidence.

    \b
    dtprof triage RUN_DIR                 verdict line, then the evidence
    dtprof triage RUN_DIR --json          {verdict, culprit_ranks, collective, message, evidence}
    dtprof triage --live RUN_DIR          a job still running (asks ranks for dumps, does not stop them)
    dtprof triage --fr /tmp/nccl_trace_rank_*   Flight Recorder dumps written outside dtprof

    Verdicts: hang, crash, mismatch, interrupted (the launcher was killed), numerics, divergence, straggler,
    healthy. Exit codes:
    0 healthy, 1 any other verdict (a problem was found), 2 unreadable input. `dtprof run --hang-timeout` exits
    124 when it stopped a hung job.
    """
    from dtprof.analyzers.triage import triage
    from dtprof.flight_recorder import DumpError
    from dtprof.options import resolve_options
    from dtprof.reports.triage import render
    from dtprof.rundir.conform import RunFormatError
    from dtprof.rundir.incident import read_incident
    from dtprof.rundir.run import open_run

    if run_dir is None and not fr_paths:
        raise click.UsageError("give RUN_DIR, or Flight Recorder dumps with --fr")
    if run_dir is not None:
        if not run_dir.exists():
            raise InputError(f"{run_dir}: no such run directory")
        if not (run_dir / "run.json").exists():
            raise InputError(f"{run_dir}/run.json: missing; {run_dir} is not a dtprof run directory")
    if live and run_dir is not None:
        _live_dumps(run_dir)
    try:
        run = open_run(run_dir, check_tables=True) if run_dir is not None else None
        incident = run.incident(fr_paths) if run is not None else read_incident(None, fr_paths)
    except (RunFormatError, DumpError) as e:
        raise InputError(str(e)) from None
    analysis, error = None, None
    if run is not None and len(run.steps):   # the analysis (with the run's own options) makes the verdict once
        from dtprof.analyzers.summary import analyze

        try:
            analysis = analyze(run, resolve_options(run), incident=incident, live=live, stale_s=stale_s)
        except Exception as e:  # noqa: BLE001  (the analysis failing must not hide the rest of the triage)
            error = f"{type(e).__name__}: {e}"
    if analysis is None or analysis.triage is None:
        # no steps, no run (only --fr dumps), or the analysis failed: the verdict without stragglers
        analysis = SimpleNamespace(triage=triage(run, {"incident": incident, "analysis_error": error, "live": live,
                                                       "stale_s": stale_s}))
    click.echo(render(analysis, {"json": as_json}))
    sys.exit(0 if analysis.triage["verdict"] == "healthy" else 1)
