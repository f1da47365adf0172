"""Writing the run directory. See docs/run-format.md for the layout.

Two ways in, one format out:
- ``RankWriter``: the rank side (stdlib only, cheap). Each rank appends JSON lines to its own files; a background
  flusher calls ``flush()`` at least every second and at exit, so a rank killed with SIGKILL keeps all it flushed.
- ``write_node_tables``: whole pandas tables at once as Parquet (importers, the synthetic-run builder in the tests,
  and the launcher's compaction of its node after the job ends). The reader prefers these when present.
"""
from __future__ import annotations

import json
import os
import re
import socket
import threading
import zlib
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Sequence

# the run directory's names live with the schema (the reader needs them too); imported from here by the writers
from dtprof.rundir.schema import (  # noqa: F401
    FAULT_EVENT,
    NODE_MANIFEST,
    NODE_PREFIX,
    RANK_PREFIX,
    RUN_MANIFEST,
    RUN_SCHEMA,
    SCHEMA_MINOR,
    SCHEMA_VERSION,
    SUMMARY_COMPLETE,
    SUMMARY_DIR,
    SUMMARY_FILE,
    TABLES,
    TABLES_COMPLETE,
    TABLES_DIR,
    UNIDENTIFIED_EVENT,
    UNIDENTIFIED_PREFIX,
    new_table_file,
    summary_file,
)


class RunExistsError(Exception):
    """The directory already holds a run that this one would overwrite."""


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON so that a reader sees the old file or the new one, never half of one."""
    write_text_atomic(path, json.dumps(obj, indent=1, default=str) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write text so that a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)   # a full disk must not leave half a file behind under a hidden name


def create_run_dir(run_dir: Path, run_info: dict, join_id: str | None = None) -> Path:
    """Create ``run_dir`` with its run.json, or join it if it is the same multi-node job.

    ``join_id`` identifies one job across nodes (torchrun's rendezvous id). An existing directory is joined only if
    its run.json carries the same non-empty ``join_id``; anything else that exists and is not empty is refused, so a
    run is never overwritten.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    manifest = run_dir / RUN_MANIFEST
    info = {"schema": RUN_SCHEMA, "schema_version": SCHEMA_VERSION, "schema_minor": SCHEMA_MINOR,
            "join_id": join_id or "", **run_info}
    if not manifest.exists():
        others = [p.name for p in run_dir.iterdir()
                  if p.name != RUN_MANIFEST and not p.name.startswith(f".{RUN_MANIFEST}.")]
        if others:
            raise RunExistsError(f"{run_dir}: directory is not empty ({others[0]} ...); choose another --out")
    # Write the whole manifest under a private name, then link it into place: the link fails if run.json exists,
    # and a peer node that lost the race always reads a complete file (never a half-written one).
    tmp = run_dir / f".{RUN_MANIFEST}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(info, indent=1, default=str) + "\n")
        os.link(tmp, manifest)
    except FileExistsError:
        try:
            existing = json.loads(manifest.read_text())
        except (OSError, ValueError, RecursionError):
            existing = {}
        if join_id and isinstance(existing, dict) and existing.get("join_id") == join_id:
            return run_dir
        raise RunExistsError(f"{run_dir}: already holds a run (run.json exists); choose another --out") from None
    finally:
        tmp.unlink(missing_ok=True)
    return run_dir


def create_node_dir(run_dir: Path, host: str | None = None) -> Path:
    """A fresh node sub-directory for this launcher: node-<host>-<pid>, never reused."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", host or socket.gethostname())   # a host name may hold "/"
    node = Path(run_dir) / f"{NODE_PREFIX}{host}-{os.getpid()}"
    node.mkdir(parents=False, exist_ok=False)
    return node


def rank_dir(node_dir: Path, rank: int) -> Path:
    return Path(node_dir) / f"{RANK_PREFIX}{rank}"


# The flusher thread encodes every row a rank records. json.dumps(row, separators=(",", ":"), default=str) builds
# an encoder per call; CPython's C encoder (what json.dumps ends in), made once with the same settings, writes the
# same text at about half the cost per row (2.4 -> 1.2 us, 500 span rows timed on the busy 2-core machine).
_encode_row = json.encoder.c_make_encoder(  # type: ignore[attr-defined]  # CPython's, not in the typeshed stubs
    None, str, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True)


class _TableFile:
    """One append-only JSON-lines table: a header line naming the columns, then one JSON array per row, gzip-
    compressed (JSON rows of near-monotonic numbers and repeated names shrink 4-10x: what lets a week-long job's
    every step stay recorded). Each flush ends in a complete deflate block (Z_SYNC_FLUSH), so what a killed process
    flushed stays readable; a clean close ends the gzip stream. The file is created at the first flush, as
    ``dtprof.rundir.schema.new_table_file`` names it."""

    def __init__(self, directory: Path, stem: str, table: str):
        self.directory, self.stem, self.table = Path(directory), stem, table
        self.columns = [c for c, _ in TABLES[table]]
        self.rows: list[Sequence[Any]] = []
        self._fh: IO[bytes] | None = None
        self._z: Any = None
        self._closed = False
        self.bytes_written = 0     # compressed bytes so far (the footprint the sampling keeps under its budget)

    def flush(self) -> None:
        # Take the rows appended so far and drop them from the list's front (each step atomic under the GIL; rows
        # appended meanwhile go to the end): the list itself stays, so a hot path may hold its bound append
        # (RankWriter.appender) and appenders never wait on I/O.
        rows = self.rows[:]
        del self.rows[:len(rows)]
        if not rows and (self._fh is not None or self._closed):
            return
        fh = self._fh
        text = []
        if fh is None:
            fh = self._fh = open(new_table_file(self.directory, self.stem), "wb")
            self._z = zlib.compressobj(6, zlib.DEFLATED, 31)      # wbits 31: the gzip format (zcat reads it)
            header = {"dtprof_table": self.table, "schema_version": SCHEMA_VERSION,
                      "schema_minor": SCHEMA_MINOR, "columns": self.columns}
            text.append(json.dumps(header) + "\n")
        encode, join = _encode_row, "".join
        text.extend([join(encode(r, 0)) + "\n" for r in rows])
        data = self._z.compress("".join(text).encode()) + self._z.flush(zlib.Z_SYNC_FLUSH)
        fh.write(data)
        fh.flush()
        self.bytes_written += len(data)

    def close(self) -> None:
        self.flush()
        if self._fh is not None:
            self._fh.write(self._z.flush())     # the end of the gzip stream
            self._fh.close()
            self._fh = self._z = None
        self._closed = True


def process_event(node_dir, host: str, level: str, message: str) -> None:
    """One events row in this process's own file ``unidentified-<pid>.jsonl.gz`` of the node directory, for a
    process with no rank writer; the reader merges it into the node's events."""
    import time

    f = _TableFile(Path(node_dir), f"{UNIDENTIFIED_PREFIX}{os.getpid()}", "events")
    f.rows.append((-1, host, time.monotonic_ns(), level, "rank", message))
    f.close()


class RankWriter:
    """Append-only writer for one rank's tables inside a node directory.

    ``append(table, row)`` only appends a tuple to a list (no I/O, no locks); rows must follow the column order of
    ``dtprof.rundir.schema.TABLES[table]``. ``flush()`` writes what was appended since the last flush.
    """

    def __init__(self, node_dir: Path, rank: int):
        self.dir = rank_dir(node_dir, rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._files = {t: _TableFile(self.dir, t, t) for t in TABLES if t not in ("ranks", "nvml")}
        self._lock = threading.Lock()  # serialises flushers (the background thread and atexit), not appenders

    def append(self, table: str, row: Sequence[Any]) -> None:
        self._files[table].rows.append(row)

    def extend(self, table: str, rows: Iterable[Sequence[Any]]) -> None:
        self._files[table].rows.extend(rows)

    def appender(self, table: str) -> Callable[[Sequence[Any]], None]:
        """``append`` for one table as the list's own bound method: one call less per row on a hot path."""
        return self._files[table].rows.append

    def bytes_written(self) -> int:
        """Compressed bytes this writer has written so far (read from any thread: a sum of ints)."""
        return sum(f.bytes_written for f in self._files.values())

    def write_identity(self, identity: dict) -> None:
        """rank.json: the ranks-table row (all of TABLES['ranks'] columns) plus any extra keys."""
        write_json_atomic(self.dir / "rank.json", identity)

    def flush(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.flush()

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()


class NodeTableWriter:
    """Append-only JSON-lines writer for node-level tables (the NVML sampler, launcher events)."""

    def __init__(self, node_dir: Path, table: str):
        self._file = _TableFile(Path(node_dir), table, table)
        self._lock = threading.Lock()

    def append(self, row: Sequence[Any]) -> None:
        self._file.rows.append(row)

    def flush(self) -> None:
        with self._lock:
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


# Parquet row groups of this many rows: rows come rank by rank, so a reader of one rank's or some steps' slice
# (Run.read_spans) skips the other row groups by their rank and step statistics (docs/scale.md)
ROW_GROUP_ROWS = 64 * 1024
# Parquet pages compressed with zstd rather than pandas' default snappy: 13-18 % smaller tables and node summary
# on a sampled 2-rank job (before the integer columns were delta-encoded); pyarrow and DuckDB read either
PARQUET_COMPRESSION = "zstd"
# Dictionary pages for the text columns only: numbers (times, ids) are mostly distinct, and a dictionary tried on
# them is dropped at its size limit after the work is done. Integers are delta-encoded (times, ids and steps
# mostly grow by small steps), so zstd has less to compress. An imported 1M-event trace's spans: written in 21
# instead of 56 ms, 1.1 instead of 3.9 MB, read back in 17 instead of 21 ms.


def write_node_tables(node_dir: Path, tables: dict, node_info: dict | None = None) -> Path:
    """Write whole tables (pandas DataFrames, columns as in the schema) into ``node_dir/tables/*.parquet``.

    Missing tables are written empty; missing columns are filled with nulls. ``node_info`` becomes node.json if
    given. The ``_complete`` marker is written last, so a reader never trusts a half-written set.
    """
    from concurrent.futures import ThreadPoolExecutor

    import pandas as pd

    from dtprof.rundir.conform import conform, json_text_columns

    node_dir = Path(node_dir)
    out = node_dir / TABLES_DIR
    out.mkdir(parents=True, exist_ok=True)
    (out / TABLES_COMPLETE).unlink(missing_ok=True)
    # a summary of the tables being replaced would be stale: it is remade from the new ones (dtprof summarize, or
    # in memory by the analysis)
    (node_dir / SUMMARY_DIR / SUMMARY_COMPLETE).unlink(missing_ok=True)

    def write(table: str) -> None:
        df = tables.get(table)
        df = json_text_columns(table, conform(table, df if df is not None else pd.DataFrame()))
        tmp = out / f".{table}.parquet.tmp"
        try:
            df.to_parquet(tmp, index=False, row_group_size=ROW_GROUP_ROWS, compression=PARQUET_COMPRESSION,
                          use_dictionary=[c for c, kind in TABLES[table] if kind in ("str", "json")],
                          column_encoding={c: "DELTA_BINARY_PACKED" for c, kind in TABLES[table]
                                           if kind in ("int", "Int")})
            os.replace(tmp, out / f"{table}.parquet")
        finally:
            tmp.unlink(missing_ok=True)

    # Two threads, the largest table first: Arrow encodes a table without holding the GIL, so the others are
    # conformed and written meanwhile (an imported 1M-event trace's spans were half of the writing).
    size = {t: len(tables[t]) if tables.get(t) is not None else 0 for t in TABLES}
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(write, sorted(TABLES, key=lambda t: -size[t])))
    if node_info is not None:
        write_json_atomic(node_dir / NODE_MANIFEST, node_info)
    (out / TABLES_COMPLETE).write_text(json.dumps({"schema_version": SCHEMA_VERSION}) + "\n")
    return out


def compact_node(node_dir: Path) -> Path:
    """Read a node's JSON-lines files and write them as Parquet tables (the raw files are kept)."""
    from dtprof.rundir.files import read_node_raw

    return write_node_tables(node_dir, read_node_raw(Path(node_dir)))


# rows per Parquet row group of a summary table, where smaller than the writer's default: the what-if items, stored
# step by step, in groups of a few steps of a node's ranks, which a read of the replay's sampled steps skips by their
# step statistics (at 16,384 x 1,000 the items are 410 M rows, 6.4 M of them in the sampled steps)
SUMMARY_ROW_GROUP_ROWS = {"whatif_items": 4096}


def write_node_summary(node_dir: Path, tables: dict, facts: dict) -> Path:
    """Write a node summary: ``tables`` (DataFrames, SUMMARY_TABLES' columns) as ``node_dir/summary/*.parquet``,
    then ``_complete`` holding ``facts`` and the format version, so a reader never trusts a half-written one.
    Rows keep their order (sorted by rank and step; the what-if items by step), so Parquet row-group statistics
    prune by rank (by step)."""
    from dtprof.rundir.schema import SUMMARY_LAYOUT, SUMMARY_TABLES

    out = Path(node_dir) / SUMMARY_DIR
    out.mkdir(parents=True, exist_ok=True)
    (out / SUMMARY_COMPLETE).unlink(missing_ok=True)
    for table, cols in SUMMARY_TABLES.items():
        df = tables[table][[c for c, _ in cols]]
        tmp = out / f".{table}.parquet.tmp"
        try:
            df.to_parquet(tmp, index=False, row_group_size=SUMMARY_ROW_GROUP_ROWS.get(table),
                          compression=PARQUET_COMPRESSION)
            os.replace(tmp, summary_file(node_dir, table))
        finally:
            tmp.unlink(missing_ok=True)
    write_json_atomic(out / SUMMARY_COMPLETE, {"schema_version": SCHEMA_VERSION, "schema_minor": SCHEMA_MINOR,
                                               "layout": SUMMARY_LAYOUT, **facts})
    return out


def save_summary(run_dir, summary: dict) -> Path:
    """Write ``summary`` (the analysis's, analyzers/summary.py) as ``run_dir/summary.json`` (atomically: a reader
    sees the old file or the new one)."""
    path = Path(run_dir) / SUMMARY_FILE
    write_json_atomic(path, summary)
    return path


def stop_text(stop: dict) -> str:
    """One line about a stop record (node.json ``stops``), for the launcher's output, its events row and triage."""
    text = (f"stopped the job's {stop['sigterm_sent_to']} process(es) at {stop['started']} ({stop['reason']}): "
            f"SIGTERM"
            + (f", SIGKILL to {stop['sigkill_sent_to']} still alive after the {stop['grace_s']:g} s grace"
               if stop["sigkill_sent_to"] else "") + f", in {stop['took_s']:.1f} s; ")
    if stop["survivors"]:
        return text + f"still running: pid(s) {', '.join(map(str, stop['survivors']))}"
    return text + "none left running"
