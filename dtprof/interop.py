"""`dtprof import kineto|fr` and `dtprof export perfetto`: other tools' data in, dtprof runs out.

Never imports torch. Errors are one line naming the file (exit code 2); files that could not be read are skipped
with a warning on stderr and recorded in the run's events table.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click

# pyarrow (pandas' text columns) allocates from mimalloc by default, which does not reuse the memory numpy and
# Python free, nor they its: an import of 1M events peaked ~35 MiB higher (benchmarks/import_speed.py). Read by
# pyarrow when it is first imported, which in `dtprof import|export` is after this module.
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")


class InputError(click.ClickException):
    """Unreadable or inconsistent input: one line naming the file, exit code 2 (dtprof.cli's convention)."""
    exit_code = 2


def _warn(msg: str) -> None:
    click.echo(f"dtprof: warning: {msg}", err=True)


@click.group("import")
def import_command():
    """Turn other profilers' traces into a dtprof run directory.

    \b
    dtprof import kineto traces/ -o runs/imported      torch.profiler traces, one file per rank
    """


@import_command.command("kineto")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("-o", "--out", "out", required=True, type=click.Path(path_type=Path),
              help="New run directory to create (never overwritten).")
def import_kineto_command(paths, out):
    """Import per-rank torch.profiler (Kineto) traces (.json or .json.gz files, or directories of them).

    GPU kernels become spans by stream, NCCL kernels and gloo runs become collectives, ProfilerStep#N becomes
    step N. All traces must come from one job (same world size, distinct ranks).

    \b
    Example: dtprof import kineto rank0.pt.trace.json.gz rank1.pt.trace.json.gz -o runs/from-kineto
    """
    from dtprof.collectors.kineto import KinetoError, import_kineto
    from dtprof.runformat import RunExistsError

    click.echo(f"dtprof: reading {len(paths)} path(s)...", err=True)
    try:
        run_dir = import_kineto(list(paths), out, command=" ".join(sys.argv), warn=_warn)
    except (KinetoError, RunExistsError) as e:
        raise InputError(str(e)) from None
    click.echo(str(run_dir))


@import_command.command("fr")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("-o", "--out", "out", required=True, type=click.Path(path_type=Path))
def import_fr_command(paths, out):
    """Import Flight Recorder dumps (not available yet in this version)."""
    raise click.ClickException("importing Flight Recorder dumps is not implemented yet; "
                               "use `dtprof triage` on a run recorded with `dtprof run`")


@click.group("export")
def export_command():
    """Write a run in another tool's format.

    \b
    dtprof export perfetto RUN_DIR -o run.json.gz       open in ui.perfetto.dev or chrome://tracing
    """


@export_command.command("perfetto")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("-o", "--out", "out", required=True, type=click.Path(path_type=Path),
              help="Output .json or .json.gz (Chrome JSON trace format).")
def export_perfetto_command(run_dir, out):
    """One clock-aligned timeline of all ranks: a process per rank, lanes as threads, NVML samples as counters,
    collectives linked across ranks by flow arrows."""
    from dtprof.reader import RunFormatError, open_run
    from dtprof.reports.perfetto import write_perfetto

    try:
        run = open_run(run_dir)
        path = write_perfetto(run, out)
    except RunFormatError as e:
        raise InputError(str(e)) from None
    except OSError as e:
        raise InputError(f"{out}: cannot write ({e.strerror or e})") from None
    for p in run.problems:
        _warn(p)
    click.echo(str(path))
