"""``Run``: a run directory read back, the union of its node directories, and ``open_run``.

>>> run = open_run("dtprof-runs/20261122T101500Z-train_ddp")
>>> run.steps.groupby("rank").size()

Each node is read from its Parquet tables when they are complete, else from the ranks' JSON-lines files (a crashed
or still-running job), tolerating a torn last line.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

from dtprof.rundir.conform import RunFormatError, conform, legacy_meta, load_table
from dtprof.rundir.files import (
    _concat,
    _frame_in_batches,
    _present,
    _read_in_file_order,
    _read_json,
    _read_node_table,
    _read_tables_at_once,
    read_node_raw,
)
from dtprof.rundir.incident import Incident, read_incident
from dtprof.rundir.rows import Rows, sql_list
from dtprof.rundir.schema import (
    NODE_MANIFEST,
    NODE_PREFIX,
    RANK_PREFIX,
    RUN_MANIFEST,
    SCHEMA_VERSION,
    TABLES,
    TABLES_COMPLETE,
    TABLES_DIR,
)

READ_CHUNK_ROWS = 1 << 20    # Run.read_rows: rows read and filtered at a time (~200 MB of a collectives table)


class Run:
    """A run directory read back. Tables are loaded on first use and cached.

    Attributes: ``path``, ``manifest`` (run.json), ``nodes`` (each node.json, with ``node`` = directory name),
    ``problems`` (lines about anything skipped while reading), and one DataFrame per table in
    ``dtprof.rundir.schema.TABLES``: ``ranks``, ``steps``, ``spans``, ``collectives``, ``groups``, ``nvml``, ``clock``,
    ``events``, ``meta`` (a run written before the meta table gets its rows from the legacy events messages).
    """

    def __init__(self, path: Path, node_dirs: list[Path] | None = None):
        self.path = Path(path)
        if not self.path.exists():
            raise RunFormatError(f"{self.path}: no such run directory")
        if not self.path.is_dir():
            raise RunFormatError(f"{self.path}: not a directory (expected a dtprof run directory)")
        mpath = self.path / RUN_MANIFEST
        if not mpath.exists():
            raise RunFormatError(f"{mpath}: missing; {self.path} is not a dtprof run directory")
        self.manifest = _read_json(mpath)
        version = self.manifest.get("schema_version")
        if not isinstance(version, int):
            raise RunFormatError(f"{mpath}: no integer schema_version")
        if version > SCHEMA_VERSION:
            raise RunFormatError(f"{mpath}: run-format schema {version} is newer than this dtprof reads "
                                 f"({SCHEMA_VERSION}); upgrade dtprof")
        self.node_dirs = (sorted(p for p in self.path.glob(f"{NODE_PREFIX}*") if p.is_dir()) if node_dirs is None
                          else list(node_dirs))
        self.nodes = []
        for nd in self.node_dirs:
            info = _read_json(nd / NODE_MANIFEST) if _present(nd / NODE_MANIFEST) else {}
            info["node"] = nd.name
            if info.get("status") == "running" and launcher_killed(info):
                info["status"], info["status_reason"] = "interrupted", (
                    "interrupted: the launcher was killed (or its run directory became unwritable before it recorded "
                    "the job's end)")
            self.nodes.append(info)
        self.earlier_attempts = self._set_aside_earlier_attempts()
        self.problems: list[str] = []

        self._loaded: dict = {}
        self._completed: set[Path] = set()   # nodes seen with complete tables (compacted tables stay complete)
        # node directory -> its summary's facts, read once: the analysis asks for them per table (4 x 2,048 files
        # at 16,384 ranks); ``forget_summaries`` after summaries are written
        self._facts: dict[Path, dict | None] = {}

    def _set_aside_earlier_attempts(self) -> list[tuple[Path, dict]]:
        """Node directories that record an earlier attempt of a rank (node.json ``attempt_rank`` and ``attempt``:
        a Ray Train worker restarted after a failure, collectors/raytrain.py) leave ``node_dirs`` and ``nodes``:
        each rank is its last attempt, and every table and statistic covers that attempt. Returned as (directory,
        node.json) pairs, read by ``restarts``."""
        last: dict[int, int] = {}
        for info in self.nodes:
            if isinstance(info.get("attempt_rank"), int) and isinstance(info.get("attempt"), int):
                last[info["attempt_rank"]] = max(last.get(info["attempt_rank"], 0), info["attempt"])
        earlier = [(nd, info) for nd, info in zip(self.node_dirs, self.nodes)
                   if info.get("attempt_rank") in last and info.get("attempt", 0) < last[info["attempt_rank"]]]
        if earlier:
            gone = {nd for nd, _ in earlier}
            kept = [(nd, info) for nd, info in zip(self.node_dirs, self.nodes) if nd not in gone]
            self.node_dirs, self.nodes = [nd for nd, _ in kept], [info for _, info in kept]
        return sorted(earlier, key=lambda e: (e[1]["attempt_rank"], e[1]["attempt"]))

    @cached_property
    def attempts(self) -> dict[int, int]:
        """rank -> the attempt the run's tables hold, for ranks recorded with attempts (Ray Train workers)."""
        return {int(n["attempt_rank"]): int(n["attempt"]) for n in self.nodes
                if isinstance(n.get("attempt_rank"), int) and isinstance(n.get("attempt"), int)}

    @cached_property
    def restarts(self) -> list[dict]:
        """Each earlier attempt of a restarted rank, by rank and attempt: rank, attempt, host, pid, status
        ("failed": its training function raised; "stopped": it ended without recording its end, as Ray stops the
        other workers of a failed group, or raised a peer-went-away error after another rank had failed: then
        ``stopped_by``, that rank), step (the step it was in: the failure's, else the one after its last
        recorded step), exception, ended (UTC; the failure's time), restarted (UTC: the next attempt's start) and
        restart_s (from the failure to the restart)."""
        import datetime as dt

        if not self.earlier_attempts:
            return []
        starts = {(int(i["attempt_rank"]), int(i["attempt"])): i.get("start_time")
                  for i in [*self.nodes, *(info for _, info in self.earlier_attempts)]
                  if isinstance(i.get("attempt_rank"), int) and isinstance(i.get("attempt"), int)}
        out = []
        for nd, info in self.earlier_attempts:
            rank, attempt = int(info["attempt_rank"]), int(info["attempt"])
            failure: dict = info["failure"] if isinstance(info.get("failure"), dict) else {}
            step = failure.get("step")
            if step is None:
                steps = read_node_raw(nd, self.problems)["steps"]
                step = int(steps["step"].max()) + 1 if len(steps) else 0
            nxt = next((starts[k] for k in sorted(starts) if k[0] == rank and k[1] > attempt), None)
            ended = failure.get("time")
            restart_s = None
            if ended and nxt:
                restart_s = round((dt.datetime.fromisoformat(str(nxt).replace("Z", "+00:00")) -
                                   dt.datetime.fromisoformat(str(ended).replace("Z", "+00:00"))).total_seconds(), 3)
            out.append({"rank": rank, "attempt": attempt, "host": info.get("host"), "pid": info.get("pid"),
                        "node": nd.name, "status": "failed" if failure else "stopped", "step": int(step),
                        "exception": failure.get("exception"), "ended": ended, "restarted": nxt,
                        "restart_s": restart_s})
        return _peer_failures_stopped(out)

    def _complete(self, nd: Path) -> bool:
        if nd not in self._completed and (nd / TABLES_DIR / TABLES_COMPLETE).exists():
            self._completed.add(nd)
        return nd in self._completed

    @cached_property
    def _raw_nodes(self) -> dict:
        """Tables of the nodes without complete Parquet tables, read from the ranks' JSON-lines files (all tables
        of such a node at once: they are small, a crashed or still-running job's)."""
        return {nd: read_node_raw(nd, self.problems) for nd in self.node_dirs if not self._complete(nd)}

    def table(self, name: str):
        """One table of the run, loaded on first use (a table never used is never read)."""
        if name not in TABLES:
            raise KeyError(f"unknown table {name!r}; tables are {', '.join(TABLES)}")
        if name not in self._loaded:
            complete = [nd for nd in self.node_dirs if self._complete(nd)]
            bulk = _read_tables_at_once(complete, name) if len(complete) == len(self.node_dirs) > 1 else None
            if bulk is not None:
                df = bulk
            else:
                parts = [_read_node_table(nd, name) if self._complete(nd) else self._raw_nodes[nd][name]
                         for nd in self.node_dirs]
                df = _concat(name, parts)
            if name == "ranks":
                dup = df["rank"].duplicated(keep=False)
                if dup.any():
                    r = int(df.loc[dup, "rank"].iloc[0])
                    where = sorted(set(df.loc[df["rank"] == r, "node"].astype(str)))
                    raise RunFormatError(f"{self.path}: rank {r} is recorded more than once (in {', '.join(where)}; "
                                         f"a copied node directory?)")
            if name == "meta":
                df = legacy_meta(self.table("events"), df)
            self._loaded[name] = df
        return self._loaded[name]

    def read_rows(self, name: str, columns=None, skip_steps=None):
        """Table ``name`` as ``table`` gives it, less the rows whose step is in ``skip_steps`` (their index kept, as a
        mask over ``table`` keeps it), and only the ``columns`` given. A one-node run's Parquet table of more than
        READ_CHUNK_ROWS rows is read that many rows at a time and only the rows and columns kept are converted and
        checked: a long run's spans and collectives are never whole in memory. Else ``table``, sliced."""
        import numpy as np
        import pandas as pd

        cols = [c for c, _ in TABLES[name] if columns is None or c in columns]
        p = self.node_dirs[0] / TABLES_DIR / f"{name}.parquet" if len(self.node_dirs) == 1 else None
        pf = None
        if name not in self._loaded and p is not None and self._complete(self.node_dirs[0]) and _present(p):
            import pyarrow.parquet as pq

            try:
                pf = pq.ParquetFile(p)
            except Exception as e:  # pyarrow raises several types for damaged files
                raise RunFormatError(f"{p}: unreadable Parquet ({type(e).__name__}: {e})".splitlines()[0]) from None
        if pf is None or pf.metadata.num_rows <= READ_CHUNK_ROWS or set(pf.schema_arrow.names) - set(dict(
                TABLES[name])):   # (a foreign file: ``table`` says what is wrong with it)
            df = self.table(name)
            if skip_steps is not None and len(skip_steps) and len(df):
                df = df[~df["step"].astype("Int64").isin(skip_steps).fillna(False).to_numpy(bool)]
            return df[cols]
        import pyarrow as pa
        import pyarrow.compute as pc

        read = [c for c in cols if c in pf.schema_arrow.names]
        skip = pa.array(np.asarray(skip_steps if skip_steps is not None else [], np.int64))
        md = pf.metadata
        chunks: list[list[int]] = [[]]   # row groups gathered up to READ_CHUNK_ROWS rows a read
        rows = 0
        for g in range(md.num_row_groups):
            if chunks[-1] and rows + md.row_group(g).num_rows > READ_CHUNK_ROWS:
                chunks.append([])
                rows = 0
            chunks[-1].append(g)
            rows += md.row_group(g).num_rows
        parts, kept, at = [], [], 0
        for groups in chunks:
            try:
                t = pf.read_row_groups(groups, columns=read + (["step"] if len(skip) and "step" not in read else []))
            except Exception as e:  # pyarrow raises several types for damaged files
                raise RunFormatError(f"{p}: unreadable Parquet ({type(e).__name__}: {e})".splitlines()[0]) from None
            mask = np.ones(t.num_rows, bool)
            if len(skip):
                mask = ~pc.fill_null(pc.is_in(t["step"], value_set=skip), False).to_numpy(zero_copy_only=False)
            parts.append(t.select(read).filter(pa.array(mask)))
            kept.append(at + np.flatnonzero(mask))
            at += t.num_rows
        df = load_table(name, pa.concat_tables(parts).to_pandas(split_blocks=True), p, columns=cols)
        df.index = pd.Index(np.concatenate(kept))
        return df

    def node_run(self, node_dir: Path) -> Run:
        """The run restricted to one of its node directories (what that node's summary is made from)."""
        return Run(self.path, [Path(node_dir)])

    def read_spans(self, kinds=(), ranks=(), steps: tuple[int, int] | None = None):
        """The spans whose kind is in ``kinds`` or whose rank is in ``ranks`` (and, given ``steps`` = (first,
        last), whose step is in that range), in the run's row order, reading only those rows (DuckDB filters each
        node's Parquet file, skipping files and row groups by their rank and step statistics): for views and
        analyzers that need a slice of the spans, never all of them."""
        import pandas as pd

        kinds, ranks = list(kinds), [int(r) for r in ranks]
        if not kinds and not ranks:
            return conform("spans", pd.DataFrame())
        if "spans" in self._loaded:   # all of them are in memory already (a run analysed from its raw tables)
            sp = self._loaded["spans"]
            keep = sp["kind"].astype(str).isin(kinds) | sp["rank"].isin(ranks)
            if steps is not None:
                keep &= sp["step"].between(int(steps[0]), int(steps[1])).fillna(False).astype(bool)
            return sp[keep.to_numpy()].reset_index(drop=True)
        complete = [nd for nd in self.node_dirs if self._complete(nd)]
        parts = []
        if complete:
            import duckdb

            files = [str(nd / TABLES_DIR / "spans.parquet") for nd in complete]
            where = " OR ".join(([f"kind IN ({sql_list(kinds)})"] if kinds else [])
                                + ([f"rank IN ({', '.join(map(str, ranks))})"] if ranks else []))
            if steps is not None:
                where = f"({where}) AND step BETWEEN {int(steps[0])} AND {int(steps[1])}"
            con = duckdb.connect()
            try:
                df = _read_in_file_order(con, files, where)
            except duckdb.Error as e:
                raise RunFormatError(f"{self.path}: cannot read the spans tables ({str(e).splitlines()[0]})") from None
            finally:
                con.close()
            parts.append(load_table("spans", df, f"{self.path} spans tables"))
        for nd in self.node_dirs:   # nodes still in JSON lines (their order among nodes kept)
            if not self._complete(nd):
                sp = self._raw_nodes[nd]["spans"]
                keep = sp["kind"].astype(str).isin(kinds) | sp["rank"].isin(ranks)
                if steps is not None:
                    keep &= sp["step"].between(int(steps[0]), int(steps[1])).fillna(False).astype(bool)
                parts.append(sp[keep])
        return _concat("spans", parts)

    def read_collectives(self, instances):
        """The collectives rows of the instances ``instances`` ((group, seq) pairs), in the run's row order, reading
        only those (DuckDB filters each node's Parquet file by seq, then the pairs are matched here): for checks
        that need the rows of a few instances, never all of them."""
        import pandas as pd

        pairs = {(str(g), int(q)) for g, q in instances}
        if not pairs:
            return conform("collectives", pd.DataFrame())

        def keep(df):
            df = df[df["seq"].isin({q for _, q in pairs}).to_numpy()]
            key = pd.Series(list(zip(df["group"].astype(str), df["seq"].astype("int64"))), dtype=object)
            return df[key.isin(pairs).to_numpy()]

        if "collectives" in self._loaded:   # all of them are in memory already
            return keep(self._loaded["collectives"]).reset_index(drop=True)
        complete = [nd for nd in self.node_dirs if self._complete(nd)]
        parts = []
        if complete:
            import duckdb

            files = [str(nd / TABLES_DIR / "collectives.parquet") for nd in complete]
            seqs = ", ".join(str(q) for q in sorted({q for _, q in pairs}))
            con = duckdb.connect()
            try:
                df = _read_in_file_order(con, files, f"seq IN ({seqs})")
            except duckdb.Error as e:
                raise RunFormatError(f"{self.path}: cannot read the collectives tables "
                                     f"({str(e).splitlines()[0]})") from None
            finally:
                con.close()
            parts.append(keep(load_table("collectives", df, f"{self.path} collectives tables")))
        for nd in self.node_dirs:   # nodes still in JSON lines
            if not self._complete(nd):
                parts.append(keep(self._raw_nodes[nd]["collectives"]))
        return _concat("collectives", parts)

    def has_collectives_from(self, source: str) -> bool:
        """Whether any collectives row has ``source`` (e.g. "fsdp"): ``collective_groups_from``."""
        return bool(self.collective_groups_from(source))

    def collective_groups_from(self, source: str) -> list[str]:
        """The groups of the collectives rows whose ``source`` is ``source`` (e.g. DDP's buckets: "ddp"), reading
        only those two columns where the tables are Parquet (never every collective: the analysis of a large run
        reads them as node summaries)."""
        found: set[str] = set()
        if "collectives" in self._loaded:
            c = self._loaded["collectives"]
            return sorted(set(c.loc[(c["source"].astype(str) == source).to_numpy(), "group"].astype(str)))
        complete = [nd for nd in self.node_dirs if self._complete(nd)]
        if complete:
            import duckdb

            files = [str(nd / TABLES_DIR / "collectives.parquet") for nd in complete]
            con = duckdb.connect()
            try:
                rows = con.execute('SELECT DISTINCT "group" FROM read_parquet(?) WHERE source = ?',
                                   [files, source]).fetchall()
            except duckdb.Error as e:
                raise RunFormatError(f"{self.path}: cannot read the collectives tables "
                                     f"({str(e).splitlines()[0]})") from None
            finally:
                con.close()
            found |= {str(r[0]) for r in rows}
        for nd in self.node_dirs:   # nodes still in JSON lines
            if not self._complete(nd):
                c = self._raw_nodes[nd]["collectives"]
                found |= set(c.loc[(c["source"].astype(str) == source).to_numpy(), "group"].astype(str))
        return sorted(found)

    def summary_facts(self, node_dir: Path) -> dict | None:
        """The ``_complete`` facts of a node's summary; None when it has none, or a stale one (its tables
        incomplete, or written in a layout not read: dtprof/rundir/schema.py SUMMARY_LAYOUTS_READ)."""
        from dtprof.rundir.schema import SUMMARY_COMPLETE, SUMMARY_DIR, SUMMARY_LAYOUTS_READ

        if node_dir not in self._facts:
            mark = node_dir / SUMMARY_DIR / SUMMARY_COMPLETE
            facts = _read_json(mark) if self._complete(node_dir) and mark.exists() else None
            self._facts[node_dir] = facts if facts and facts.get("layout") in SUMMARY_LAYOUTS_READ else None
        return self._facts[node_dir]

    def forget_summaries(self) -> None:
        """Read the node summaries' facts again on the next use (after summaries were written or remade)."""
        self._facts.clear()

    def node_summaries(self, item_steps=None, tables=None) -> tuple[list, dict]:
        """(facts, tables) of the node summaries (dtprof/rundir/schema.py SUMMARY_TABLES): per node its ``_complete``
        facts, None for a node without a summary; per table (``tables``, default all), the stored summaries' rows
        of all nodes in node order (the what-if items sorted by rank and step), read by one DuckDB query across the
        nodes' files. ``item_steps``: read the what-if items of these steps only (the replay's sample), not all:
        those of the row groups of their steps' lowest level and above (dtprof/rundir/schema.py ITEM_LEVEL) where every
        stored summary has the levels."""
        import numpy as np
        import pandas as pd

        from dtprof.rundir.schema import ITEM_LEVEL, SUMMARY_LAYOUT, SUMMARY_TABLES, step_level, summary_file

        facts = [self.summary_facts(nd) for nd in self.node_dirs]
        have = [nd for nd, f in zip(self.node_dirs, facts) if f is not None]
        wanted = SUMMARY_TABLES if tables is None else {t: SUMMARY_TABLES[t] for t in tables}
        tables = {}
        con = None
        try:
            for table, cols in wanted.items():
                names = [c for c, _ in cols]
                # the text columns (a group, an op, a host) of these repeat on millions of rows: categoricals
                text = "category" if table in ("whatif_items", "rank_steps", "exposed") else "str"
                dtypes = {c: ("int64" if k == "int" else "float64" if k == "float" else text) for c, k in cols}
                if not have:
                    tables[table] = pd.DataFrame({c: pd.Series(dtype=t) for c, t in dtypes.items()})
                    continue
                if con is None:
                    import duckdb

                    con = duckdb.connect()
                    con.execute("SET preserve_insertion_order = true")
                files = [str(summary_file(nd, table)) for nd in have]
                where = ""
                if table == "whatif_items" and item_steps is not None:
                    where = f" WHERE step IN ({', '.join(str(int(s)) for s in item_steps)})"
                    if len(item_steps) and all(f["layout"] == SUMMARY_LAYOUT for f in facts if f is not None):
                        where += f" AND {ITEM_LEVEL} >= {int(step_level(item_steps).min())}"
                # the items are stored by their step's level and come back in any order of their row groups:
                # sorted here by rank and step, each rank-step's in its file's row order
                by_row = table == "whatif_items"
                try:
                    columns = ", ".join(f'"{c}"' for c in names)   # quoted: "group" is an SQL keyword
                    source = f"read_parquet([{sql_list(files)}]{', file_row_number = true' if by_row else ''})"
                    query = f"SELECT {columns}{', file_row_number' if by_row else ''} FROM {source}{where}"
                    # a count without a filter is read from the files' metadata; with one it is a second scan
                    n = None if where else con.execute(f"SELECT count(*) FROM {source}").fetchall()[0][0]
                    df = _frame_in_batches(con.sql(query), n,
                                           {**dtypes, "file_row_number": "int64"} if by_row else dtypes)
                except Exception as e:  # duckdb.Error: a missing or damaged file
                    raise RunFormatError(f"{self.path}: cannot read the node summaries' {table} tables "
                                         f"({str(e).splitlines()[0]})") from None
                if by_row:   # a rank's rows are in one node's file
                    order = np.lexsort((df["file_row_number"].to_numpy(), df["step"].to_numpy(),
                                        df["rank"].to_numpy()))
                    df = df.drop(columns="file_row_number")
                    if len(order) and not (order[1:] > order[:-1]).all():
                        df = df.iloc[order].reset_index(drop=True)
                tables[table] = df.astype(dtypes)
        finally:
            if con is not None:
                con.close()
        return facts, tables

    def summary_rows(self, table: str, facts: list, computed: dict | None = None) -> Rows:
        """The node summaries' ``table`` across the run as one DuckDB view (``Rows``): the files of the nodes with
        a stored summary (``facts``: ``node_summaries``'), and the rows ``computed`` by the analysis (node
        directory -> frame) for nodes without one, each named as its file would be, so node order sorts alike."""
        from dtprof.rundir.schema import summary_file

        return Rows(table, [str(summary_file(nd, table)) for nd, f in zip(self.node_dirs, facts) if f is not None],
                    [(str(summary_file(nd, table)), df) for nd, df in (computed or {}).items()])

    def __getattr__(self, name: str):
        if name in TABLES:
            return self.table(name)
        raise AttributeError(name)

    @property
    def world_size(self) -> int:
        r = self.ranks
        return int(r["world_size"].max()) if len(r) else 0

    @property
    def hosts(self) -> list[str]:
        return sorted(set(self.ranks["host"].astype(str))) or sorted({n.get("host", "") for n in self.nodes} - {""})

    def incident(self, fr_paths=()) -> Incident:
        """The run's incident files (heartbeats, dumps, watchdog records, logs) for triage: ``read_incident``."""
        return read_incident(self.path, fr_paths, self.node_dirs)

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, nodes={len(self.node_dirs)})"


# A rank's exception that says its peer went away: its collective failed because another rank of the group did
# (gloo: "Connection closed by peer ... typically caused by a remote worker crashing"; torch's DistNetworkError)
PEER_FAILURE_MARKS = ("Connection closed by peer", "Connection reset by peer", "remote worker", "DistNetworkError")


def _peer_failures_stopped(restarts: list[dict]) -> list[dict]:
    """In each attempt, a rank whose training function raised a peer-went-away error after another rank had failed
    did not fail of its own: it was stopped by that failure (``status`` "stopped", ``stopped_by`` the rank that
    failed first; its exception kept). Which of the two Ray ends first after a failure is a race, so without this
    the same restart reads as one failure or as two."""
    for attempt in {r["attempt"] for r in restarts}:
        failed = sorted((r for r in restarts if r["attempt"] == attempt and r["status"] == "failed"),
                        key=lambda r: str(r["ended"] or ""))
        for r in failed[1:]:
            if any(m in str(r["exception"] or "") for m in PEER_FAILURE_MARKS):
                r["status"], r["stopped_by"] = "stopped", failed[0]["rank"]
    return restarts


def launcher_killed(node_info: dict) -> bool:
    """A node.json still saying "running" whose ``dtprof run`` process, on this host, is gone: the launcher was
    killed (kill -9, OOM killer) before it could record the job's end. Unknown (False) for other hosts."""
    import socket

    pid = node_info.get("pid")
    if node_info.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"dtprof" not in f.read()   # a reused pid belongs to another program
    except OSError:
        return True


# A command's run whose table files are smaller than this is read whole when opened (every table validated, so a
# damaged one is named whatever the command needs); a larger run's tables are read when used (docs/scale.md).
CHECK_ALL_BYTES = 256 * 2**20


def open_run(path, check_tables: bool = False) -> Run:
    """Open a run directory (or a path inside one: its summary.json, report.html, a node directory).
    ``check_tables``: the command line's open: a run under ``CHECK_ALL_BYTES`` of tables is read and validated
    whole (RunFormatError names a damaged file)."""
    p = Path(path)
    run = next((Run(c) for c in (p, p.parent, p.parent.parent) if (c / RUN_MANIFEST).exists()), None) or Run(p)
    if check_tables and _tables_bytes(run) < CHECK_ALL_BYTES:
        for name in TABLES:
            run.table(name)
    return run


def _tables_bytes(run: Run) -> int:
    """Bytes of the run's table files: the compacted Parquet tables, else the ranks' JSON-lines files."""
    total = 0
    for nd in run.node_dirs:
        files = (nd / TABLES_DIR).glob("*.parquet") if run._complete(nd) else nd.glob(f"{RANK_PREFIX}*/*.jsonl*")
        total += sum(f.stat().st_size for f in files if f.is_file())
        if total >= CHECK_ALL_BYTES:
            break
    return total
