"""`dtprof import kineto|fr` and `dtprof export perfetto`: other tools' data in, dtprof runs out.

Never imports torch. Errors are one line naming the file (exit code 2); files that could not be read are skipped
with a warning on stderr and recorded in the run's events table.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import click

from dtprof.cli import InputError

# pyarrow (pandas' text columns) allocates from mimalloc by default, which does not reuse the memory numpy and
# Python free, nor they its: an import of 1M events peaked ~35 MiB higher (benchmarks/import_speed.py). Read by
# pyarrow when it is first imported, which in `dtprof import|export` is after this module.
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
# numpy's OpenBLAS starts a thread (and its buffers) per CPU when numpy is imported, which these commands never use:
# with one, importing numpy, pyarrow and pandas took 0.22 instead of 0.28 s (best of 8). Set only here, in commands
# that run no user code (`dtprof run` passes its environment on to the training job).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def _warn(msg: str) -> None:
    click.echo(f"dtprof: warning: {msg}", err=True)


@click.group("import")
def import_command():
    """Turn other profilers' traces into a dtprof run directory.

    \b
    dtprof import kineto traces/ -o runs/imported      torch.profiler traces, one file per rank
    dtprof import fr dumps/ -o runs/from-fr            Flight Recorder dumps, one file per rank
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
    import gc

    # numpy, pyarrow and pandas are imported here, once per process: ~100k long-lived objects and no garbage. The
    # cyclic collector is off meanwhile and then those objects are frozen (taken out of its generations): its passes
    # over them cost 0.03 s CPU during the imports, or one pass as long right after them (before the workers fork).
    fresh = gc.isenabled() and "dtprof.collectors.kineto" not in sys.modules
    if fresh:
        gc.disable()
    try:
        from dtprof.collectors.kineto import KinetoError, import_kineto
        from dtprof.rundir.writer import RunExistsError
    finally:
        if fresh:
            gc.freeze()
            gc.enable()

    try:
        run_dir = import_kineto(list(paths), out, command=" ".join(sys.argv), warn=_warn,
                                info=lambda msg: click.echo(f"dtprof: {msg}", err=True))
    except (KinetoError, RunExistsError) as e:
        raise InputError(str(e)) from None
    click.echo(str(run_dir))


@import_command.command("fr")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("-o", "--out", "out", required=True, type=click.Path(path_type=Path),
              help="New run directory to create (never overwritten).")
def import_fr_command(paths, out):
    """Import PyTorch Flight Recorder dumps (pickle or JSON, one per rank; files or directories of them).

    Each entry becomes a collectives row (source "flight_recorder"): group, seq = collective_seq_id (p2p_seq_id
    for send/recv), op, bytes from the input/output sizes and dtype, issue = time_created_ns (wall clock).
    Flight Recorder has no step and, on gloo, no completion times: those stay empty.

    \b
    Example: dtprof import fr /tmp/fr_trace_rank_0 /tmp/fr_trace_rank_1 -o runs/from-fr
    """
    from dtprof.flight_recorder import DumpError
    from dtprof.rundir.writer import RunExistsError

    try:
        run_dir = import_fr(list(paths), out, command=" ".join(sys.argv))
    except (DumpError, RunExistsError) as e:
        raise InputError(str(e)) from None
    click.echo(str(run_dir))


def _numel(sizes_json: str) -> int:
    """Elements in all tensors of a Flight Recorder size list ('[[2, 4], [8]]' -> 16)."""
    total = 0
    for shape in json.loads(sizes_json or "[]"):
        n = 1
        for d in shape:
            n *= int(d)
        total += n
    return total


def fr_collectives(entries):
    """Flight Recorder entries (``load_dump``'s columns) -> run-format collectives and groups tables.

    group_size and the groups' rank lists are the imported ranks that have entries of that group (gloo dumps leave
    pg_config empty, so the dumps cannot say more): a lower bound when some ranks' dumps are missing.
    return_ns = issue_ns; end_ns, gpu_duration_ns and step stay null (gloo entries never record completion).
    """
    import pandas as pd

    e = entries.reset_index(drop=True)
    in_elems = e["input_sizes"].map(_numel)
    elem_bytes = (e["in_bytes"].astype("float64") / in_elems.where(in_elems > 0)).fillna(0)
    out_bytes = (e["output_sizes"].map(_numel) * elem_bytes).round().astype("int64")
    seen = e.groupby("group")["rank"].agg(lambda r: sorted(set(int(x) for x in r.dropna())))
    size = e["group"].map(lambda g: len(seen.get(g, [])))
    is_p2p = e["is_p2p"].astype(bool)
    issue = e["time_created_ns"]
    coll = pd.DataFrame({
        "rank": e["rank"], "step": pd.array([None] * len(e), dtype="Int64"), "op": e["op"], "api": e["op"],
        "source": "flight_recorder", "group": e["group"], "group_size": size,
        "seq": e["p2p_seq"].where(is_p2p, e["seq"]), "in_bytes": e["in_bytes"].fillna(0), "out_bytes": out_bytes,
        "dtype": e["dtype"].fillna("").str.split(",").str[0], "async_op": False,
        "issue_ns": issue, "return_ns": issue})
    groups = (e.drop_duplicates(["rank", "group"])[["rank", "group", "group_desc"]]
              .rename(columns={"group_desc": "desc"}).reset_index(drop=True))
    groups["ranks"] = groups["group"].map(lambda g: ",".join(map(str, seen.get(g, []))))
    groups["size"] = groups["group"].map(lambda g: len(seen.get(g, [])))
    groups["backend"], groups["mesh_dim"] = "", ""
    return coll, groups


def import_fr(paths: list, out_dir: Path, command: str = "") -> Path:
    """``dtprof import fr``: Flight Recorder dumps of one job -> a new run directory (time base: wall clock)."""
    import socket
    import time

    import pandas as pd

    from dtprof.flight_recorder import DumpError, load_dumps
    from dtprof.rundir.writer import create_node_dir, create_run_dir, write_node_tables

    entries = load_dumps(paths)
    if entries["rank"].isna().any():
        bad = entries.loc[entries["rank"].isna(), "source"].iloc[0]
        raise DumpError(f"{bad}: no rank in the dump or in the file name")
    if not len(entries):
        raise DumpError(f"{', '.join(map(str, paths))}: no Flight Recorder entries")
    coll, groups = fr_collectives(entries)
    ranks = sorted(int(r) for r in entries["rank"].unique())
    world = max(ranks) + 1
    counts = entries.groupby("rank").size()
    tables = {
        "collectives": coll, "groups": groups,
        "ranks": pd.DataFrame({"rank": ranks, "local_rank": -1, "world_size": world, "host": "", "pid": 0,
                               "device_type": "", "device_name": "", "device_uuid": "", "backend": ""}),
        "clock": pd.DataFrame({"rank": ranks, "host": "", "mono_ns": 0, "wall_ns": 0}),
        "events": pd.DataFrame({"rank": ranks, "host": "", "t_ns": 0, "level": "info",
                                "source": "flight_recorder",
                                "message": [f"{int(counts[r])} Flight Recorder entries imported" for r in ranks]}),
    }
    run_dir = create_run_dir(Path(out_dir), {"source": "flight-recorder-import", "command": command,
                                             "created_wall_ns": time.time_ns(), "world_size": world,
                                             "time_base": "wall_clock"})
    node_dir = create_node_dir(run_dir, host="import")
    write_node_tables(node_dir, tables, {"command": command, "host": socket.gethostname(), "status": "imported",
                                         "imported_files": sorted(set(entries["source"])),
                                         "time_base": "wall_clock"})
    return run_dir


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
    from dtprof.analyzers.runmodel import RunModel
    from dtprof.reports import perfetto
    from dtprof.rundir.conform import RunFormatError
    from dtprof.rundir.run import open_run

    try:
        run = open_run(run_dir, check_tables=True)
        # the trace needs the run and its model only, not the whole analysis
        data = perfetto.render(SimpleNamespace(run=run, model=RunModel.of(run)), {"gzip": out.name.endswith(".gz")})
        path = _write_atomic(out, data)
    except RunFormatError as e:
        raise InputError(str(e)) from None
    except OSError as e:
        raise InputError(f"{out}: cannot write ({e.strerror or e})") from None
    for p in run.problems:
        _warn(p)
    click.echo(str(path))


def _write_atomic(out: Path, data: bytes) -> Path:
    """Write ``data`` to ``out`` through a temporary name: a reader sees no half-written file."""
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(out)
    return out
