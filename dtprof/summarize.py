"""`dtprof summarize RUN`: make the node summaries of a run (docs/scale.md).

The launcher writes its node's summary when the job ends; this verb makes them for runs whose nodes were never
summarised (imports, runs recorded by an older dtprof, a re-analysis after an upgrade: ``--force``). Each node is
summarised from its own tables alone (analyzers/nodesummary.py), so the nodes are independent tasks: a local
process pool by default, or a Dask cluster given its scheduler's address (the workers must see the run directory,
as the nodes of a multi-node job already do, and have dtprof installed).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import click

from dtprof.cli import InputError


def summarize_node(node_dir: str) -> str:
    """Make and write the summary of one node directory from its compacted tables; returns its path. A task:
    a plain function of a path, so a process pool or a Dask worker can run it."""
    from dtprof.analyzers.nodesummary import node_tables
    from dtprof.analyzers.runmodel import RunModel
    from dtprof.rundir.run import Run
    from dtprof.rundir.writer import write_node_summary

    nd = Path(node_dir)
    run = Run(nd.parent, [nd])   # this node alone: no other node's directory is listed or read
    tables, facts = node_tables(RunModel.of(run))
    return str(write_node_summary(nd, tables, facts))


def pending(run, force: bool = False) -> list[Path]:
    """The node directories to summarise: those with complete tables and no summary, or a stale one (every one
    with ``force``). A node still in JSON lines (a crashed launcher) is left to the analysis, which summarises it in
    memory."""
    from dtprof.rundir.writer import TABLES_COMPLETE, TABLES_DIR

    return [nd for nd in run.node_dirs if (nd / TABLES_DIR / TABLES_COMPLETE).exists()
            and (force or run.summary_facts(nd) is None)]


def make_summaries(run, force: bool = False, workers: int | None = None, address: str | None = None,
                   client=None) -> list[str]:
    """Summarise ``run``'s pending nodes: on the Dask cluster at ``address`` (or of the Dask ``client``), else in a
    local process pool of ``workers`` processes (default: one per CPU; 1: in this process). Returns the summaries
    written."""
    todo = [str(nd) for nd in pending(run, force)]
    if not todo:
        return []
    try:
        if client is not None:
            return list(client.gather(client.map(summarize_node, todo, pure=False)))
        if address:
            from distributed import Client

            with Client(address) as client:
                return list(client.gather(client.map(summarize_node, todo, pure=False)))
        n = min(workers or os.cpu_count() or 1, len(todo))
        if n <= 1:
            return [summarize_node(nd) for nd in todo]
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=n) as pool:
            return list(pool.map(summarize_node, todo))
    finally:   # the run's facts of these nodes are read again (the Run keeps them: rundir/run.py)
        run.forget_summaries()


@click.command("summarize")
@click.argument("run_dir", type=click.Path(file_okay=True, dir_okay=True))
@click.option("--address", default=None, metavar="tcp://HOST:PORT",
              help="A Dask scheduler's address: summarise the nodes on that cluster (default: a local pool).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Processes of the local pool (default: one per CPU).")
@click.option("--force", is_flag=True, help="Summarise every node again, also those that have a summary.")
def summarize_command(run_dir, address, workers, force):
    """Make the node summaries of a run (node-*/summary/), which the analysis reads instead of every span.

    \b
    dtprof summarize dtprof-runs/20261122T101500Z-train_ddp
    dtprof summarize RUN --address tcp://scheduler:8786      on a Dask cluster
    dtprof summarize RUN --force                              after an upgrade of dtprof

    Exit codes: 0 done, 2 unreadable run directory (or node tables), or the cluster cannot be reached.
    """
    from dtprof.rundir.conform import RunFormatError
    from dtprof.rundir.run import open_run

    t0 = time.perf_counter()
    try:
        run = open_run(run_dir)
        done = make_summaries(run, force=force, workers=workers, address=address)
    except RunFormatError as e:
        raise InputError(str(e)) from None
    except OSError as e:   # a Dask scheduler that cannot be reached raises OSError (its timeout)
        raise InputError(f"{address or run_dir}: {e}") from None
    left = len(run.node_dirs) - len(pending(run, force=False)) if not force else len(run.node_dirs)
    where = f"on {address}" if address else "locally"
    click.echo(f"dtprof: summarised {len(done)} node(s) {where} in {time.perf_counter() - t0:.1f} s; "
               f"{left} of {len(run.node_dirs)} node(s) of {run.path} have a summary")
