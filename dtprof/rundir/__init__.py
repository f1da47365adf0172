"""The run directory: its format, written and read back, in one package (docs/run-format.md); the one way every
command, analyzer, report, the live path and the watchdog read a run, and the one way the rank side and the
launcher write one. This ``__init__`` imports nothing, so the rank side's import of ``schema`` and ``writer`` loads
neither pandas nor DuckDB. Its modules, lowest first:

- ``schema``: the tables, columns, types, version and the directory's names;
- ``conform``: a table in the schema's columns and types, older formats and corrupt values named (``conform``,
  ``load_table``, ``RunFormatError``);
- ``rows``: ``Rows``, a node-summary table of the whole run (the stored nodes' Parquet files and rows made in
  memory) as one DuckDB view: what ``Run.summary_rows`` hands the analyzers, so none of them names a file;
- ``files``: the files as rows: manifests, JSON-lines tables (gzip, a torn last line), a node's Parquet tables,
  DuckDB reads across many nodes' files, and ``TableTail``, a JSON-lines table read from where the last read
  stopped (the live path);
- ``incident``: what triage reads beside the tables: heartbeats (``read_heartbeats``, also the watchdog's and the
  live path's), rank dumps, the watchdog's records, the job's output, Flight Recorder entries;
- ``run``: ``Run`` (a run directory, the union of its node directories; tables loaded on first use) and
  ``open_run``;
- ``writer``: the writers (the ranks', the launcher's, the importers'), compaction and ``save_summary``.

``dtprof/reader.py`` is the import path code outside the package has used; it holds no code of its own.
"""
