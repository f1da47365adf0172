"""``dtprof summary RUN_DIR``: analyse a run, write summary.json into it and print the per-rank table."""
from __future__ import annotations

import sys
from contextlib import contextmanager

import click

from dtprof.cli import InputError


def _parse_transformer(value: str | None) -> dict | None:
    if not value:
        return None
    out = {}
    for part in value.split(","):
        if "=" not in part:
            raise click.BadParameter(f"expected key=value pairs, got {part!r}", param_hint="--transformer")
        k, v = part.split("=", 1)
        try:
            out[k.strip()] = float(v)
        except ValueError:
            raise click.BadParameter(f"{k.strip()}={v!r} is not a number", param_hint="--transformer") from None
    need = {"n_params", "layers", "heads", "head_dim", "seq_len"}
    if not need <= set(out):
        raise click.BadParameter(f"needs {', '.join(sorted(need))}", param_hint="--transformer")
    return out


@contextmanager
def _cluster(address: str | None):
    """A Dask client of the scheduler at ``address`` (None without one); one line (exit 2) if it cannot be reached."""
    if not address:
        yield None
        return
    from distributed import Client

    try:
        client = Client(address, timeout="10s")
    except OSError as e:   # a scheduler that cannot be reached raises OSError (its timeout)
        raise InputError(f"{address}: {e}") from None
    with client:
        yield client


def _dask_reduce(client):
    from dtprof.cluster import DaskReduce

    return DaskReduce(client) if client is not None else None


@click.command("summary")
@click.argument("run_dir", type=click.Path(file_okay=True, dir_okay=True))
@click.option("--json", "as_json", is_flag=True, help="Print summary.json instead of the table.")
@click.option("--warmup", type=click.IntRange(min=0), default=None,
              help="Leading steps to exclude (default: detected; step 0 plus slow leading steps).")
@click.option("--flops-per-step", type=float, default=None,
              help="Model FLOPs of one step of the whole job (all ranks together).")
@click.option("--peak-tflops", type=float, default=None, help="Peak TFLOP/s of one device (overrides the table).")
@click.option("--dtype", default=None, help="Peak table dtype: bf16 (default), fp16, tf32, fp32, fp8.")
@click.option("--transformer", default=None, metavar="n_params=N,layers=L,heads=H,head_dim=Q,seq_len=T",
              help="Model FLOPs from a transformer's shape (PaLM: 6N + 12·L·H·Q·T per token × tokens/step).")
@click.option("--no-write", is_flag=True, help="Do not write summary.json into the run.")
@click.option("--gpu-window", type=click.Choice(["all", "hta"]), default="all", show_default=True,
              help="Kernels counted in GPU time: all of them, or HolisticTraceAnalysis' window (launched before "
                   "the last step) to compare with HTA.")
@click.option("--address", default=None, metavar="tcp://HOST:PORT",
              help="A Dask scheduler's address: make the missing node summaries and the per-instance reductions "
                   "on that cluster (docs/scale.md; its workers must see RUN_DIR).")
def summary_command(run_dir, as_json, warmup, flops_per_step, peak_tflops, dtype, transformer, no_write,
                    gpu_window, address):
    """Per-rank summary of a recorded run; also writes RUN_DIR/summary.json (docs/summary-schema.md).

    \b
    dtprof summary dtprof-runs/20261122T101500Z-train_ddp
    dtprof summary RUN --json --flops-per-step 3.2e15 --peak-tflops 989
    dtprof summary RUN --transformer n_params=1.2e9,layers=24,heads=16,head_dim=128,seq_len=2048
    dtprof summary RUN --address tcp://scheduler:8786         reductions on a Dask cluster

    Exit codes: 0 done, 2 unreadable run directory or bad option.
    """
    from dtprof.analyzers.summary import analyze
    from dtprof.options import resolve_options
    from dtprof.reports import summary_json, terminal
    from dtprof.rundir.conform import RunFormatError
    from dtprof.rundir.run import open_run
    from dtprof.rundir.writer import SUMMARY_FILE, save_summary

    tf = _parse_transformer(transformer)

    def progress(msg: str) -> None:
        click.echo(f"dtprof: {msg}...", err=True)

    try:
        run = open_run(run_dir, check_tables=True)
        options = resolve_options(run, warmup=warmup, flops_per_step=flops_per_step, peak_tflops=peak_tflops,
                                  dtype=dtype, transformer=tf, gpu_window=gpu_window)
    except RunFormatError as e:
        raise InputError(str(e)) from None
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    with _cluster(address) as client:
        if not no_write:   # first analysis of a run without node summaries: make them (dtprof summarize)
            from dtprof.summarize import make_summaries

            try:
                make_summaries(run, client=client)
            except OSError as e:   # a read-only run is analysed from its tables
                click.echo(f"dtprof: could not write node summaries into {run.path}: {e}", err=True)
            except RunFormatError as e:
                raise InputError(str(e)) from None
        try:
            a = analyze(run, options, progress=progress if sys.stderr.isatty() else None,
                        reduce=_dask_reduce(client))
        except RunFormatError as e:
            raise InputError(str(e)) from None
    if not no_write:
        try:
            save_summary(run.path, a.summary)
        except OSError as e:
            click.echo(f"dtprof: could not write {run.path / SUMMARY_FILE}: {e}", err=True)
    if as_json:
        click.echo(summary_json.render(a))
    else:
        click.echo(terminal.render(a))
