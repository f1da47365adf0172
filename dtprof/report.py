"""`dtprof report RUN_DIR [-o FILE]`: write the offline HTML report of a run."""
from __future__ import annotations

from pathlib import Path

import click

from dtprof.cli import InputError


@click.command("report")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), default=None,
              help="Where to write the report (default: RUN_DIR/report.html).")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr (default: only for large runs).")
def report_command(run_dir: Path, out: Path | None, progress: bool | None) -> None:
    """Write a self-contained HTML report of RUN_DIR (opens offline, no network).

    \b
    Example:
      dtprof report dtprof-runs/20261122T101500Z-train_ddp
      dtprof report RUN_DIR -o /tmp/report.html

    Exit codes: 0 written, 2 RUN_DIR is not a readable dtprof run or the report cannot be written
    (one-line message on stderr).
    """
    from dtprof.options import open_and_analyze
    from dtprof.rundir.conform import RunFormatError

    try:
        _, analysis = open_and_analyze(run_dir)
        path = save_report(analysis, out, progress=progress)
    except RunFormatError as e:
        raise InputError(str(e)) from None
    except OSError as e:
        raise InputError(f"{e.filename or out or run_dir}: cannot write the report ({e.strerror})") \
            from None
    click.echo(str(path))


def save_report(analysis, out_path=None, *, progress: bool | None = None) -> Path:
    """Write the HTML report of ``analysis`` (reports/html.py ``render``; the command made the analysis,
    dtprof/options.py ``open_and_analyze``) to ``out_path`` (default the run's ``report.html``) and return its path.
    ``progress``: a progress bar on stderr (None = only for large runs). Written to a temporary name and renamed, so
    a reader never sees half a report."""
    from dtprof.reports.html import render
    from dtprof.rundir.writer import write_text_atomic

    text = render(analysis, {"progress": progress})
    out = Path(out_path) if out_path else analysis.run.path / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, text)
    return out
