"""Reading a run directory back as pandas DataFrames: the one way every analyzer, report and CLI sees a run.

>>> run = open_run("dtprof-runs/20261122T101500Z-train_ddp")
>>> run.steps.groupby("rank").size()

A run is the union of its node directories (one per ``dtprof run`` launcher, several for a multi-node job, one
for an import). Each node is read from its Parquet tables when they are complete, else from the ranks' JSON-lines
files (a crashed or still-running job), tolerating a torn last line.
"""
from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from dtprof.schema import (
    CATEGORICAL,
    JSONL_GZ_SUFFIX,
    NODE_MANIFEST,
    NODE_PREFIX,
    RANK_PREFIX,
    RUN_MANIFEST,
    SCHEMA_VERSION,
    TABLES,
    TABLES_COMPLETE,
    TABLES_DIR,
    table_files,
    unidentified_files,
)


class RunFormatError(Exception):
    """A run directory or one of its files cannot be read. The message is one line naming the file."""


_NUMPY_DTYPES = {"int": "int64", "Int": "Int64", "float": "float64", "bool": "bool", "str": "object",
                 "json": "object"}


def conform(table: str, df, columns=None):
    """Return ``df`` with exactly the schema's columns (those of them in ``columns``, given it), in order, with the
    schema's dtypes (nulls where missing)."""
    import numpy as np
    import pandas as pd

    out = {}
    n = len(df)
    schema = [(c, k) for c, k in TABLES[table] if columns is None or c in columns]
    for col, kind in schema:
        if col in df.columns:
            s = df[col]
        elif kind == "Int":   # missing: all null, built as such (checking a million Nones one by one cost more
            # than writing the table's Parquet: the pipeline columns of an imported trace's kernel spans)
            s = pd.Series(pd.arrays.IntegerArray(np.zeros(n, np.int64), np.ones(n, bool)), index=df.index)
        elif kind == "float":
            s = pd.Series(np.nan, index=df.index, dtype="float64")
        else:
            s = pd.Series([None] * n, index=df.index, dtype="object")
        if kind in ("int", "Int"):
            s = _integers(col, s, nullable=kind == "Int") if n else s.astype(_NUMPY_DTYPES[kind])
        elif kind == "float":
            s = _numbers(col, s).astype("float64")
        elif kind == "bool":
            s = s.fillna(False).astype("bool") if n else s.astype("bool")
        elif kind == "str" and col in CATEGORICAL and isinstance(s.dtype, pd.CategoricalDtype) and n:
            s = _conform_categorical(s)  # Parquet keeps categoricals: skip the per-row string round trip
        elif kind == "str":
            s = s.astype("object").where(s.notna(), "").astype(str)
            s = s.astype("category") if col in CATEGORICAL else s
        elif kind == "json":
            s = s.map(_json_value).to_numpy()
        out[col] = s
    return pd.DataFrame(out, copy=False).reset_index(drop=True) if n else pd.DataFrame(
        {c: pd.Series(dtype=("category" if (k == "str" and c in CATEGORICAL) else _NUMPY_DTYPES[k]))
         for c, k in schema})


_INT64_MAX = 2**63 - 1


def _numbers(col: str, s):
    """``s`` as numbers; a value that is not one (a string in a time column) is an error naming the column."""
    import pandas as pd

    if s.dtype.kind in "iufb":
        return s
    v = pd.to_numeric(s, errors="coerce")
    bad = v.isna() & s.notna()
    if bad.any():
        raise ValueError(f"column {col}: {int(bad.sum())} value(s) are not numbers (e.g. {s[bad].iloc[0]!r})")
    return v


def _integers(col: str, s, nullable: bool):
    """``s`` as int64 (``Int64`` if nullable). NaN, inf, fractions and values beyond int64's range are errors
    naming the column and the count: converting them would silently give wrong numbers."""
    import numpy as np
    import pandas as pd

    if s.dtype.kind == "i" or (nullable and isinstance(s.dtype, pd.Int64Dtype)):
        return s.astype("Int64" if nullable else "int64")
    if s.dtype == object:   # JSON ints beyond int64 stay Python ints: check them before numpy sees them
        big = s.map(lambda x: isinstance(x, int) and not -_INT64_MAX - 1 <= x <= _INT64_MAX)
        if big.any():
            raise ValueError(f"column {col}: {int(big.sum())} value(s) beyond the int64 range "
                             f"(e.g. {s[big].iloc[0]})")
    v = _numbers(col, s)
    if v.dtype.kind == "u":
        if (v > _INT64_MAX).any():
            raise ValueError(f"column {col}: {int((v > _INT64_MAX).sum())} value(s) beyond the int64 range")
        return v.astype("Int64" if nullable else "int64")
    if v.dtype.kind == "b":
        v = v.astype("int64")
    f = v.astype("float64").to_numpy()
    missing = np.isnan(f)
    if missing.any() and not nullable:
        raise ValueError(f"column {col}: {int(missing.sum())} missing or NaN value(s) in an integer column")
    finite = f[~missing]
    bad = ~np.isfinite(finite) | (np.abs(finite) >= 2.0**63) | (finite != np.round(finite))
    if bad.any():
        raise ValueError(f"column {col}: {int(bad.sum())} value(s) are not int64 integers "
                         f"(e.g. {finite[bad][0]!r})")
    if v.dtype.kind == "f":
        ints = pd.Series(np.where(missing, 0, f).astype("int64"), index=s.index)
        return ints.astype("Int64").mask(missing) if nullable else ints
    return v.astype("Int64" if nullable else "int64")


def _json_value(v):
    """A json column's cell as a Python object: stored as JSON text (Parquet, JSON lines), or already an object."""
    if isinstance(v, (bytes, str)):
        try:
            return json.loads(v)
        except ValueError:
            return None
    return None if v is None or (isinstance(v, float) and v != v) else v


def json_text_columns(table: str, df):
    """``df`` with its json columns as JSON text, the stored form (Parquet has no column type for any JSON value)."""
    cols = [c for c, k in TABLES[table] if k == "json" and c in df.columns]
    if not cols:
        return df
    return df.assign(**{c: [json.dumps(v, separators=(",", ":"), default=str) for v in df[c]] for c in cols})


# Runs written before the meta table (run format 1.0) carried these facts as events messages; the reader turns them
# into meta rows here and nowhere else.
_LEGACY_SCHEDULE = re.compile(r"pipeline schedule:\s*(\w+)(?:.*?stages=(\d+))?(?:.*?microbatches=(\d+))?"
                              r"(?:.*?stage_indices=([\d,\s]*))?")
_LEGACY_MESH = re.compile(r"device mesh: shape=\(([^)]*)\), dims=\(([^)]*)\)")


def _ints(text: str | None) -> list[int]:
    return [int(x) for x in (text or "").replace(",", " ").split()]


def legacy_meta(events, meta):
    """``meta`` plus the rows that legacy ``events`` messages stand for (kinds the meta table lacks only)."""
    import pandas as pd

    if not len(events):
        return meta
    have = set(meta["kind"].astype(str))
    msgs = events["message"].astype(str)
    rows = []
    if "pipeline_schedule" not in have:
        for i in msgs.index[msgs.str.contains("pipeline schedule:", regex=False)]:
            m = _LEGACY_SCHEDULE.search(msgs[i])
            if m:
                rows.append((i, "pipeline_schedule", {
                    "schedule": m.group(1), "stages": int(m.group(2)) if m.group(2) else None,
                    "microbatches": int(m.group(3)) if m.group(3) else None, "stage_indices": _ints(m.group(4))}))
    if "mesh" not in have:
        for i in msgs.index[msgs.str.contains("device mesh:", regex=False)]:
            m = _LEGACY_MESH.search(msgs[i])
            if m:
                rows.append((i, "mesh", {"shape": _ints(m.group(1)),
                                         "dims": [d.strip() for d in m.group(2).split(",") if d.strip()]}))
    if "fault" not in have:
        for i in msgs.index[msgs.str.startswith("dtprof disabled on this rank after a fault in ")]:
            where, _, error = msgs[i][len("dtprof disabled on this rank after a fault in "):].partition(": ")
            rows.append((i, "fault", {"where": where, "error": error}))
    if not rows:
        return meta
    ev = events.loc[[i for i, _, _ in rows]]
    add = pd.DataFrame({"rank": ev["rank"].to_numpy(), "host": ev["host"].astype(str).to_numpy(),
                        "t_ns": ev["t_ns"].to_numpy(), "kind": [k for _, k, _ in rows],
                        "value": [v for _, _, v in rows]})
    base = meta.astype({c: "object" for c in meta.columns if meta[c].dtype == "category"})
    return conform("meta", pd.concat([base, add], ignore_index=True) if len(meta) else add)


def _conform_categorical(s):
    """A categorical column with string categories and "" for nulls, touching only the categories (fast at 10M rows)."""
    cats = s.cat.categories
    as_str = cats.astype(str)
    if not as_str.is_unique:  # e.g. 1 and "1": fall back to the general path
        return s.astype("object").where(s.notna(), "").astype(str).astype("category")
    s = s.cat.rename_categories(as_str)
    if s.isna().any():
        if "" not in s.cat.categories:
            s = s.cat.add_categories([""])
        s = s.fillna("")
    return s


def _read_json(path: Path) -> dict:
    """A JSON manifest (run.json, node.json, rank.json): must hold one JSON object."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise RunFormatError(f"{path}: file not found") from None
    except OSError as e:
        raise RunFormatError(f"{path}: cannot read ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:
        raise RunFormatError(f"{path}: not valid JSON ({str(e)[:200] or 'nested too deeply'})") from None
    if not isinstance(obj, dict):
        raise RunFormatError(f"{path}: holds a JSON {type(obj).__name__}, expected an object")
    return obj


def _present(p: Path) -> bool:
    """True if ``p`` exists, or is a link that cannot be followed (a loop, a dangling link): reading it then
    names the problem instead of the file silently counting as absent."""
    return p.exists() or p.is_symlink()


# Longest plausible duration of one step, span or collective: more is a corrupt time, not a slow job.
MAX_DURATION_NS = 366 * 24 * 3600 * 10**9
_INTERVALS = {"steps": [("start_ns", "end_ns")], "spans": [("start_ns", "end_ns")],
              "collectives": [("issue_ns", "return_ns"), ("issue_ns", "end_ns")]}


def load_table(table: str, df, source, columns=None) -> Any:
    """The one validation step every table read from a file goes through: the schema's columns (those of them in
    ``columns``, given it) and types (``conform``), and times that can be true. Any violation is one RunFormatError
    naming ``source``."""
    import numpy as np

    missing = [c for c, kind in TABLES[table] if kind == "int" and c not in df.columns
               and (columns is None or c in columns)] if len(df) else []
    if missing:
        raise RunFormatError(f"{source}: not a dtprof {table} table (no column {', '.join(missing[:3])}; does it "
                             f"hold another table?)")
    try:
        out = conform(table, df, columns)
    except (ValueError, TypeError, OverflowError) as e:
        raise RunFormatError(f"{source}: {table} table: {str(e).splitlines()[0]}") from None
    for start, end in _INTERVALS.get(table, []):
        if start not in out.columns or end not in out.columns:
            continue
        d = out[end].to_numpy("float64", na_value=np.nan) - out[start].to_numpy("float64")
        bad = int(((d < 0) | (d > MAX_DURATION_NS)).sum())
        if bad:
            raise RunFormatError(f"{source}: {bad} {table} row(s) with impossible times ({end} before {start}, or "
                                 f"more than a year after it)")
    return out


GZ_CHUNK = 1 << 20


def read_table_text(path: Path, problems: list[str]) -> bytes:
    """A JSON-lines table file's text; a gzip one (run format 1.6) decompressed as far as it reads: a killed
    writer's file ends at its last flush (perhaps in a torn line), and a corrupt stream is read up to the damage,
    which is reported."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise RunFormatError(f"{path}: cannot read ({e.strerror or e})") from None
    if not path.name.endswith(JSONL_GZ_SUFFIX):
        return data
    z, out = zlib.decompressobj(31), []
    for at in range(0, len(data), GZ_CHUNK):
        chunk, before = data[at:at + GZ_CHUNK], z.copy()
        try:
            out.append(z.decompress(chunk))
        except zlib.error as e:
            z = before       # the chunk again in small pieces: the text before the damage is kept
            for piece in range(0, len(chunk), 4096):
                try:
                    out.append(z.decompress(chunk[piece:piece + 4096]))
                except zlib.error:
                    break
            problems.append(f"{path}: damaged from about byte {at + piece} of the file on ({e}); the rows before "
                            f"it were read")
            return b"".join(out)
    if z.eof and z.unused_data:
        problems.append(f"{path}: {len(z.unused_data)} byte(s) after the end of its gzip stream, not read")
    return b"".join(out)


def _read_jsonl(path: Path, table: str, problems: list[str]) -> list[dict] | Any:
    """Rows of one JSON-lines table file as a DataFrame. A torn or corrupt line is skipped and reported."""
    import pandas as pd

    lines = read_table_text(path, problems).split(b"\n")
    if not lines or not lines[0].strip():
        return pd.DataFrame()
    try:
        header = json.loads(lines[0])
        cols = header["columns"]
        version = header.get("schema_version", SCHEMA_VERSION)
        if not (isinstance(cols, list) and all(isinstance(c, str) for c in cols) and isinstance(version, int)):
            raise TypeError
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise RunFormatError(f"{path}: first line is not a dtprof table header") from None
    if header.get("dtprof_table", table) != table:
        raise RunFormatError(f"{path}: holds the {header['dtprof_table']!r} table, expected {table!r}")
    if version > SCHEMA_VERSION:
        raise RunFormatError(f"{path}: written with run-format schema {version}, this dtprof reads up to "
                             f"{SCHEMA_VERSION}; upgrade dtprof")
    rows = []
    bad = 0
    loads = json.loads
    for line in lines[1:]:
        if not line:
            continue
        try:
            row = loads(line)
        except (ValueError, RecursionError):
            bad += 1
            continue
        if not isinstance(row, list) or len(row) != len(cols):
            bad += 1
            continue
        rows.append(row)
    if bad:
        problems.append(f"{path}: skipped {bad} unreadable line(s) (torn write of a killed process?)")
    return load_table(table, pd.DataFrame(rows, columns=cols), path)


def read_node_raw(node_dir: Path, problems: list[str] | None = None) -> dict:
    """A node's tables from its JSON-lines files (what the ranks and the NVML sampler wrote)."""
    import pandas as pd

    problems = problems if problems is not None else []
    parts: dict[str, list] = {t: [] for t in TABLES}
    for rdir in sorted(node_dir.glob(f"{RANK_PREFIX}*")):
        ident = rdir / "rank.json"
        if _present(ident):
            parts["ranks"].append(load_table("ranks", pd.DataFrame([_read_json(ident)]), ident))
        for table in TABLES:
            for p in table_files(rdir, table):
                if _present(p):
                    parts[table].append(_read_jsonl(p, table, problems))
    for table in ("nvml", "events"):
        for p in table_files(node_dir, table):
            if _present(p):
                parts[table].append(_read_jsonl(p, table, problems))
    for p in unidentified_files(node_dir):     # processes never recorded as a rank
        if _present(p):
            parts["events"].append(_read_jsonl(p, "events", problems))
    out = {}
    for table, dfs in parts.items():
        dfs = [d for d in dfs if len(d)]
        df = pd.concat(dfs, ignore_index=True) if dfs else pd.DataFrame()
        if table == "ranks" and len(df):
            df["node"] = node_dir.name
        out[table] = conform(table, df)
    return out


_LATER_TABLES = ("meta", "memory", "health")   # added after run format 1.0: absent from older runs' complete tables


def _read_node_table(node_dir: Path, table: str):
    """One table of a node whose Parquet tables are complete."""
    import pandas as pd

    p = node_dir / TABLES_DIR / f"{table}.parquet"
    if not _present(p):
        if table in _LATER_TABLES:   # a run written before this table existed
            return conform(table, pd.DataFrame())
        raise RunFormatError(f"{p}: missing (the node's tables are marked complete)")
    try:
        df = pd.read_parquet(p)
    except Exception as e:  # pyarrow raises several types for damaged files
        raise RunFormatError(f"{p}: unreadable Parquet ({type(e).__name__}: {e})".splitlines()[0]) from None
    extra = [c for c in df.columns if c not in dict(TABLES[table])]
    if extra:   # compaction writes exactly the schema's columns
        raise RunFormatError(f"{p}: not a dtprof {table} table (columns {', '.join(map(str, extra[:3]))} "
                             f"are not in it; does it hold another table?)")
    return load_table(table, df, p)


def _concat(table: str, dfs: list):
    """One table from the nodes' parts, categories unioned so the result stays categorical."""
    import pandas as pd

    dfs = [d for d in dfs if len(d)]
    if not dfs:
        return conform(table, pd.DataFrame())
    if len(dfs) == 1:
        return dfs[0]
    return conform(table, pd.concat([d.astype({c: "object" for c in d.columns if d[c].dtype == "category"})
                                     for d in dfs], ignore_index=True))


def _read_tables_at_once(node_dirs: list[Path], table: str):
    """One table of many complete nodes, read by one DuckDB query across their files (in node order, files read in
    parallel) and validated once: what keeps thousands of node directories fast. None when that read fails (a
    missing, damaged or foreign file): the caller then reads file by file, which names the file at fault."""
    import duckdb
    import pandas as pd
    import pyarrow as pa
    import pyarrow.compute as pc

    files = [str(nd / TABLES_DIR / f"{table}.parquet") for nd in node_dirs]
    con = duckdb.connect()
    try:
        con.execute("SET preserve_insertion_order = true")
        at = con.sql(f"SELECT * FROM read_parquet([{sql_list(files)}])").to_arrow_table()
    except (duckdb.Error, OSError):
        return None
    finally:
        con.close()
    if set(at.column_names) - set(dict(TABLES[table])):
        return None
    # the low-cardinality text columns as dictionaries, so pandas gets categoricals without a per-row pass
    at = pa.table({c: (pc.dictionary_encode(at[c]) if c in CATEGORICAL and pa.types.is_string(at[c].type)
                       or c in CATEGORICAL and pa.types.is_large_string(at[c].type) else at[c])
                   for c in at.column_names})
    df = at.to_pandas()
    for c in df.columns:   # categories in sorted order, as joining the nodes' tables one by one gives them
        if isinstance(df[c].dtype, pd.CategoricalDtype):
            df[c] = df[c].cat.reorder_categories(sorted(df[c].cat.categories))
    try:
        return load_table(table, df, f"{node_dirs[0].parent}/node-*/{TABLES_DIR}/{table}.parquet")
    except RunFormatError:
        return None


def _prefaulted_empty(n: int, dtype: str):
    """``np.empty(n, dtype)``, its memory mapped by the kernel at once (MAP_POPULATE, Linux) when it is large.

    Why: numpy asks for transparent huge pages for large arrays, and where the kernel must first compact memory to
    find them a first touch costs up to ~2.2 s per GiB (measured on the 2-core VM: 0.11-2.23 s for 1 GiB), against
    ~0.35 s populated in 4 KiB pages. At 16,384 ranks × 1,000 steps the rank-steps' 3.7 GiB read 3-7 s faster so in
    six interleaved runs (docs/scale.md)."""
    import mmap

    import numpy as np

    size = n * np.dtype(dtype).itemsize
    if size < PREFAULT_BYTES or not hasattr(mmap, "MAP_POPULATE"):
        return np.empty(n, dtype)
    try:
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    except OSError:   # the kernel refused the mapping (a memory limit): numpy's own allocation says it its way
        return np.empty(n, dtype)
    return np.frombuffer(buf, dtype)   # writable (a private mapping); the array keeps the mapping alive


PREFAULT_BYTES = 64 << 20   # below this a first touch costs little either way
READ_CHUNK_ROWS = 1 << 20    # Run.read_rows: rows read and filtered at a time (~200 MB of a collectives table)


def _frame_in_batches(rel, n: int | None, dtypes: dict):
    """The ``n`` rows of the DuckDB relation ``rel`` as a DataFrame of ``dtypes``, read in record batches into
    columns made once: the result, an Arrow copy and the frame are never all held at once (at 16.4 M rank-steps
    that tripled the memory of the read). ``n`` None (a filtered read, whose count would cost a second scan): the
    batches' columns are joined at the end. Text columns of dtype "category" are dictionary-encoded batch by batch
    (no Python string per row)."""
    import numpy as np
    import pandas as pd
    import pyarrow as pa
    import pyarrow.compute as pc

    numeric: dict[str, Any] = {c: (_prefaulted_empty(n, t) if n is not None else []) for c, t in dtypes.items()
                               if t in ("int64", "float64")}
    text: dict = {c: [] for c in dtypes if c not in numeric}
    pos = 0
    for batch in rel.to_arrow_reader(1 << 20):
        k = batch.num_rows
        for c, out in numeric.items():
            values = batch.column(c).to_numpy(zero_copy_only=False)
            if n is None:
                out.append(np.asarray(values, dtypes[c]))
            else:
                out[pos:pos + k] = values
        for c, parts in text.items():
            col = batch.column(c)
            parts.append(pc.dictionary_encode(col) if dtypes[c] == "category" else col)
        pos += k
    if n is None:
        numeric = {c: np.concatenate(parts, out=_prefaulted_empty(sum(map(len, parts)), dtypes[c])) if parts
                   else np.empty(0, dtypes[c]) for c, parts in numeric.items()}
    elif pos != n:   # the files changed between the count and the read
        raise RunFormatError(f"read {pos} rows where the files held {n}")
    cols = {c: (numeric[c] if c in numeric else
                pa.chunked_array(text[c], type=pa.dictionary(pa.int32(), pa.string()) if dtypes[c] == "category"
                                 else pa.string()).to_pandas()) for c in dtypes}
    return pd.DataFrame(cols, copy=False).astype(dtypes)


def sql_text(value) -> str:
    """``value`` as an SQL string literal."""
    return "'" + str(value).replace("'", "''") + "'"


def sql_list(values) -> str:
    return ", ".join(sql_text(v) for v in values)


def _read_in_file_order(con, files: list[str], where: str):
    """The rows of ``files`` (Parquet) that match ``where``, in the files' order and each file's row order: a
    filtered read across many files does not always keep the files' order in DuckDB 2.0, even with
    preserve_insertion_order (seen across 2,048 nodes), and the slices promise the run's row order."""
    listed = sql_list(files)
    return con.execute(
        f"SELECT * EXCLUDE (filename, file_row_number) FROM read_parquet([{listed}], filename = true, "
        f"file_row_number = true) WHERE {where} ORDER BY list_position([{listed}], filename), file_row_number").df()


class Run:
    """A run directory read back. Tables are loaded on first use and cached.

    Attributes: ``path``, ``manifest`` (run.json), ``nodes`` (each node.json, with ``node`` = directory name),
    ``problems`` (lines about anything skipped while reading), and one DataFrame per table in
    ``dtprof.schema.TABLES``: ``ranks``, ``steps``, ``spans``, ``collectives``, ``groups``, ``nvml``, ``clock``,
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
        return (nd / TABLES_DIR / TABLES_COMPLETE).exists()

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
        incomplete, or written in another layout: dtprof/schema.py SUMMARY_LAYOUT)."""
        from dtprof.schema import SUMMARY_COMPLETE, SUMMARY_DIR, SUMMARY_LAYOUT

        mark = node_dir / SUMMARY_DIR / SUMMARY_COMPLETE
        if not (self._complete(node_dir) and mark.exists()):
            return None
        facts = _read_json(mark)
        return facts if facts.get("layout") == SUMMARY_LAYOUT else None

    def node_summaries(self, item_steps=None, tables=None) -> tuple[list, dict]:
        """(facts, tables) of the node summaries (dtprof/schema.py SUMMARY_TABLES): per node its ``_complete``
        facts, None for a node without a summary; per table (``tables``, default all), the stored summaries' rows
        of all nodes in node order (the what-if items sorted by rank and step), read by one DuckDB query across the
        nodes' files. ``item_steps``: read the
        what-if items of these steps only (the replay's sample), not all."""
        import numpy as np
        import pandas as pd

        from dtprof.schema import SUMMARY_TABLES, summary_file

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
                where = (f" WHERE step IN ({', '.join(str(int(s)) for s in item_steps)})"
                         if table == "whatif_items" and item_steps is not None else "")
                # the items are stored step by step (runformat.SUMMARY_ROW_GROUP_ROWS) and come back in any order
                # of their row groups: sorted here by rank and step, each rank-step's in its file's row order
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


# ---- incident files: what triage reads beside the tables --------------------------------------------------------
@dataclass
class Incident:
    """The files of a run that say what happened to its ranks (docs/triage.md): each rank's ``heartbeat.json`` and
    ``dump-<id>.json`` (collectors/heartbeat.py), the watchdog's ``node_dir/triage/{hang,crash,exit}.json``
    (dtprof/watchdog.py), the job's output logs, and Flight Recorder entries (from the rank dumps, and from dump
    files given on the command line)."""

    heartbeats: dict = field(default_factory=dict)   # rank -> heartbeat.json
    dumps: dict = field(default_factory=dict)        # rank -> {dump id: dump}
    watchdog: dict = field(default_factory=lambda: {"hang": [], "crash": [], "exit": []})
    logs: str = ""                                   # the job's stderr and stdout, every node
    fr: Any = None                                   # Flight Recorder entries (dtprof/flight_recorder.COLUMNS)
    fr_given: bool = False                           # dump files were given: a snapshot taken at one moment


def _load_json(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def read_rank_files(run_dir: Path, node_dirs=None) -> tuple[dict, dict]:
    """(heartbeats by rank, dumps by rank: {dump_id: dump}) from every node directory of the run (``node_dirs``:
    those the reader keeps, without the earlier attempts of restarted ranks, ``Run.node_dirs``)."""
    hbs: dict = {}
    dumps: dict = {}
    for nd in sorted(Path(run_dir).glob(f"{NODE_PREFIX}*")) if node_dirs is None else node_dirs:
        for rd in sorted(nd.glob(f"{RANK_PREFIX}*")):
            try:
                rank = int(rd.name[len(RANK_PREFIX):])
            except ValueError:
                continue
            hb = _load_json(rd / "heartbeat.json")
            if hb:
                hbs[rank] = hb
            for dp in rd.glob("dump-*.json"):
                d = _load_json(dp)
                if d:
                    dumps.setdefault(rank, {})[dp.name[len("dump-"):-len(".json")]] = d
    return hbs, dumps


def read_watchdog(run_dir: Path) -> dict:
    """The watchdog's findings of every node: {"hang": [...], "crash": [...], "exit": [...]}."""
    out: dict = {"hang": [], "crash": [], "exit": []}
    for nd in sorted(Path(run_dir).glob(f"{NODE_PREFIX}*")):
        for kind in out:
            d = _load_json(nd / "triage" / f"{kind}.json")
            if d:
                out[kind].append({**d, "node": nd.name})
    return out


def read_logs(run_dir: Path) -> str:
    parts = []
    for nd in sorted(Path(run_dir).glob(f"{NODE_PREFIX}*")):
        for name in ("stderr.log", "stdout.log"):
            p = nd / name
            if p.exists():
                parts.append(p.read_text(errors="replace"))
    return "\n".join(parts)


def best_dump(dumps: dict, prefer=("hang", "crash", "sigterm")) -> dict | None:
    """The dump of one rank that tells most about the incident: the watchdog's, else the newest."""
    for k in prefer:
        if k in dumps:
            return dumps[k]
    return max(dumps.values(), key=lambda d: d.get("t_ns") or 0) if dumps else None


def fr_entries_from_dumps(dumps: dict):
    """Flight Recorder entries carried in rank dumps -> one DataFrame (dtprof/flight_recorder.py columns)."""
    import pandas as pd

    from dtprof.flight_recorder import COLUMNS, entries_frame

    frames = []
    for rank, by_id in dumps.items():
        d = best_dump(by_id)
        if d and isinstance(d.get("flight_recorder"), dict):
            frames.append(entries_frame(d["flight_recorder"], rank, f"rank-{rank} dump"))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)


def read_incident(run_dir: Path | None, fr_paths=(), node_dirs=None) -> Incident:
    """The incident files of the run at ``run_dir`` (None: no run, only Flight Recorder files), with the entries of
    the Flight Recorder dump files or directories ``fr_paths``; the ranks' files from ``node_dirs`` only, when
    given (``Run.node_dirs``). Raises flight_recorder.DumpError for an unreadable dump file."""
    import pandas as pd

    inc = Incident()
    if run_dir is not None:
        inc.heartbeats, inc.dumps = read_rank_files(run_dir, node_dirs)
        inc.watchdog = read_watchdog(run_dir)
        inc.logs = read_logs(run_dir)
    inc.fr = fr_entries_from_dumps(inc.dumps)
    if fr_paths:
        from dtprof.flight_recorder import load_dumps

        ext = load_dumps(fr_paths)
        inc.fr = pd.concat([x for x in (inc.fr, ext) if len(x)], ignore_index=True) if len(ext) else inc.fr
        inc.fr_given = True
    return inc
