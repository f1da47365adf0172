"""A node-summary table of the whole run as DuckDB reads it (``Rows``): the stored nodes' Parquet files and rows
made in memory, one view. The reader hands it out (``Run.summary_rows``); the analyzers only query it
(analyzers/stragglers.py, collectives.py, clock.py), so no analyzer names a file."""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import pandas as pd

from dtprof.rundir.conform import RunFormatError

# DuckDB's working memory for the per-instance reductions (``Rows``): beyond it, it spills to the temp directory
ROWS_MEMORY_LIMIT = "3GB"


@dataclass
class Rows:
    """One node-summary table of the whole run (dtprof/rundir/schema.py SUMMARY_TABLES), never joined in pandas: the
    stored nodes' Parquet files and the rows made in memory (a node without a stored summary; the whole run on the
    raw path), reduced by SQL in DuckDB (``query``). At 16,384 ranks the per-instance tables hold a row per
    collective instance and node (16.4 M at 1,000 steps); their consumers need one row per instance or per host.
    Every reduction over them is exact whatever order DuckDB's threads meet the rows in (integer sums, minima,
    maxima, arg-max with a total order), so the two paths agree to the last bit."""
    table: str
    files: list[str] = field(default_factory=list)
    frames: list[tuple[str, pd.DataFrame]] = field(default_factory=list)   # (origin, rows)
    where: str = ""   # an SQL condition on the rows: one partition of them (``partition``), "" for all

    def partition(self, key: str, i: int, n: int) -> Rows:
        """The rows whose ``key`` (an SQL expression of the schema's columns) hashes to partition ``i`` of ``n``:
        a reduction grouped by a key that determines ``key`` gives, over the ``n`` partitions, exactly its rows
        over all the rows (the global analysis on a Dask cluster splits the per-instance reductions so)."""
        return replace(self, where=f"hash({key}) % {int(n)} = {int(i)}")

    @classmethod
    def of(cls, table: str, df: pd.DataFrame, origin: str = "") -> Rows:
        return cls(table, frames=[(origin, df)])

    @property
    def frame(self) -> pd.DataFrame:
        """The rows of a ``Rows`` made in memory from one frame (a node's summary being written)."""
        (_, df), = self.frames
        return df

    def query(self, sql: str, **frames: pd.DataFrame) -> pd.DataFrame:
        """The result of ``sql`` (``connection``'s names) as a DataFrame."""
        with self.connection(**frames) as con:
            return con.sql(sql).df()

    @contextmanager
    def connection(self, **frames: pd.DataFrame):
        """A DuckDB connection in which ``rows`` names this table (its schema's columns, plus ``origin``: the file,
        or the frame's origin; node order sorts alike) and each keyword a frame given here. A damaged or missing
        file raises RunFormatError naming the table."""
        import duckdb

        from dtprof.rundir.schema import SUMMARY_TABLES

        cols = SUMMARY_TABLES[self.table]
        kind = {"int": "BIGINT", "float": "DOUBLE", "str": "VARCHAR"}
        select = ", ".join(f'CAST("{c}" AS {kind[k]}) AS "{c}"' for c, k in cols)
        con = duckdb.connect(config={"memory_limit": ROWS_MEMORY_LIMIT,
                                     "temp_directory": os.path.join(tempfile.gettempdir(), "dtprof-duckdb")})
        try:
            parts = []
            if self.files:
                files = sql_list(self.files)
                parts.append(f"SELECT {select}, filename AS origin FROM read_parquet([{files}], filename = true)")
            empty = pd.DataFrame({c: pd.Series(dtype={"int": "int64", "float": "float64"}.get(k, object))
                                  for c, k in cols})
            for i, (origin, df) in enumerate(self.frames or ([] if self.files else [("", empty)])):
                con.register(f"_frame{i}", df)
                parts.append(f"SELECT {select}, {sql_text(origin)} AS origin FROM _frame{i}")
            union = " UNION ALL ".join(parts)
            con.execute("CREATE TEMP VIEW rows AS "
                        + (f"SELECT * FROM ({union}) WHERE {self.where}" if self.where else union))
            for name, df in frames.items():
                con.register(name, df)
            yield con
        except duckdb.Error as e:
            raise RunFormatError(f"cannot read the node summaries' {self.table} tables "
                                 f"({str(e).splitlines()[0]})") from None
        finally:
            con.close()


def sql_text(value) -> str:
    """``value`` as an SQL string literal."""
    return "'" + str(value).replace("'", "''") + "'"


def sql_list(values) -> str:
    return ", ".join(sql_text(v) for v in values)
