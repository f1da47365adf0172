"""Reading a run directory: the import path older code uses, the names of dtprof/rundir/ (the one implementation,
read its modules) re-exported.

>>> run = open_run("dtprof-runs/20261122T101500Z-train_ddp")
>>> run.steps.groupby("rank").size()
"""
from __future__ import annotations

from dtprof.rundir.conform import RunFormatError, conform, json_text_columns, legacy_meta, load_table
from dtprof.rundir.files import _read_node_table, read_node_raw, read_table_text
from dtprof.rundir.incident import (
    Incident,
    best_dump,
    fr_entries_from_dumps,
    read_heartbeats,
    read_incident,
    read_logs,
    read_rank_files,
    read_watchdog,
)
from dtprof.rundir.rows import sql_list, sql_text
from dtprof.rundir.run import (
    READ_CHUNK_ROWS,
    Run,
    _peer_failures_stopped,
    launcher_killed,
    open_run,
)

__all__ = ["READ_CHUNK_ROWS", "Incident", "Run", "RunFormatError", "_peer_failures_stopped", "_read_node_table",
           "best_dump", "conform", "fr_entries_from_dumps", "json_text_columns", "launcher_killed", "legacy_meta",
           "load_table", "open_run", "read_heartbeats", "read_incident", "read_logs", "read_node_raw",
           "read_rank_files", "read_table_text", "read_watchdog", "sql_list", "sql_text"]
