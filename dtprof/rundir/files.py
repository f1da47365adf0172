"""The files of a run directory as bytes and rows: manifests, JSON-lines tables (gzip, a torn last line), a node's
Parquet tables, and DuckDB reads across many nodes' files in their order."""
from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

from dtprof.rundir.conform import RunFormatError, conform, load_table
from dtprof.rundir.rows import sql_list
from dtprof.rundir.schema import (
    CATEGORICAL,
    JSONL_GZ_SUFFIX,
    RANK_PREFIX,
    SCHEMA_VERSION,
    TABLES,
    TABLES_DIR,
    table_files,
    unidentified_files,
)


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


def _read_in_file_order(con, files: list[str], where: str):
    """The rows of ``files`` (Parquet) that match ``where``, in the files' order and each file's row order: a
    filtered read across many files does not always keep the files' order in DuckDB 2.0, even with
    preserve_insertion_order (seen across 2,048 nodes), and the slices promise the run's row order."""
    listed = sql_list(files)
    return con.execute(
        f"SELECT * EXCLUDE (filename, file_row_number) FROM read_parquet([{listed}], filename = true, "
        f"file_row_number = true) WHERE {where} ORDER BY list_position([{listed}], filename), file_row_number").df()


# ---- a JSON-lines table read as it grows (the live path, dtprof/live.py) -------------------------------------------
TAIL_MAX_READ = 64 * 2**20     # bytes read per file and poll, at most (a late start catches up over several polls)


class TableTail:
    """One JSON-lines table of the run format (its files in the order written: dtprof.rundir.schema.table_files),
    read from where the last read stopped; a gzip file through one decompressor kept between reads; a line not yet
    complete is kept for the next read (a writer's flush can end mid-line)."""

    def __init__(self, directory: Path, stem: str):
        self.directory, self.stem = Path(directory), stem
        self.path: Path | None = None
        self.pos = 0
        self.rest = b""
        self.unzip: Any = None
        self.columns: list[str] | None = None

    def _start(self, path: Path) -> None:
        self.path, self.pos, self.rest = path, 0, b""
        self.unzip = zlib.decompressobj(31) if path.name.endswith(JSONL_GZ_SUFFIX) else None

    def _new_text(self) -> bytes:
        try:
            with open(self.path, "rb") as f:      # type: ignore[arg-type]
                f.seek(self.pos)
                data = f.read(TAIL_MAX_READ)
        except OSError:
            return b""     # gone: nothing new
        self.pos += len(data)
        if self.unzip is not None:
            try:
                data = self.unzip.decompress(data)
            except zlib.error:
                self.unzip, self.pos = None, 1 << 62    # damaged: the reader names it after the job
                return b""
        return data

    def read(self) -> list[list]:
        files = table_files(self.directory, self.stem)
        rows: list[list] = []
        while files:
            if self.path is None:
                self._start(files[0])
            data = self.rest + self._new_text()
            cut = data.rfind(b"\n") + 1
            self.rest = data[cut:]
            for line in data[:cut].splitlines():
                try:
                    value = json.loads(line)
                except ValueError:
                    continue   # a torn line: the reader names it after the job
                if isinstance(value, dict):
                    self.columns = value.get("columns")
                elif isinstance(value, list) and self.columns and len(value) == len(self.columns):
                    rows.append(value)
            later = files[files.index(self.path) + 1:] if self.path in files else []
            if cut or not later:
                return rows
            self._start(later[0])     # this file is finished: a later process writes the next one
        return rows

    def frame(self, table: str) -> Any:
        """The new rows as a table of the schema's columns and types (most polls of most files find none: the
        empty table is made once)."""
        import pandas as pd

        rows = self.read()
        if not rows:
            if table not in _EMPTY_TABLES:
                _EMPTY_TABLES[table] = conform(table, pd.DataFrame())
            return _EMPTY_TABLES[table]
        return conform(table, pd.DataFrame(rows, columns=self.columns))


_EMPTY_TABLES: dict[str, Any] = {}
