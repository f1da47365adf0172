"""Reading a run directory back as pandas DataFrames: the one way every analyzer, report and CLI sees a run.

>>> run = open_run("dtprof-runs/20261122T101500Z-train_ddp")
>>> run.steps.groupby("rank").size()

A run is the union of its node directories (one per ``dtprof run`` launcher, several for a multi-node job, one
for an import). Each node is read from its Parquet tables when they are complete, else from the ranks' JSON-lines
files (a crashed or still-running job), tolerating a torn last line.
"""
from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

import re

from dtprof.schema import CATEGORICAL, SCHEMA_VERSION, TABLES
from dtprof.runformat import NODE_MANIFEST, NODE_PREFIX, RANK_PREFIX, RUN_MANIFEST, TABLES_COMPLETE, TABLES_DIR


class RunFormatError(Exception):
    """A run directory or one of its files cannot be read. The message is one line naming the file."""


_NUMPY_DTYPES = {"int": "int64", "Int": "Int64", "float": "float64", "bool": "bool", "str": "object",
                 "json": "object"}


def conform(table: str, df):
    """Return ``df`` with exactly the schema's columns, in order, with the schema's dtypes (nulls where missing)."""
    import numpy as np
    import pandas as pd

    out = {}
    n = len(df)
    for col, kind in TABLES[table]:
        if col in df.columns:
            s = df[col]
        else:
            s = pd.Series([None] * n, index=df.index, dtype="object")
        if kind == "int":
            s = pd.to_numeric(s, errors="raise").astype("int64") if n else s.astype("int64")
        elif kind == "Int":
            s = pd.to_numeric(s, errors="coerce").astype("Int64") if n else s.astype("Int64")
        elif kind == "float":
            s = pd.to_numeric(s, errors="coerce").astype("float64")
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
    return pd.DataFrame(out).reset_index(drop=True) if n else pd.DataFrame(
        {c: pd.Series(dtype=("category" if (k == "str" and c in CATEGORICAL) else _NUMPY_DTYPES[k]))
         for c, k in TABLES[table]})


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
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise RunFormatError(f"{path}: file not found") from None
    except (OSError, ValueError) as e:
        raise RunFormatError(f"{path}: not valid JSON ({e})") from None


def _read_jsonl(path: Path, table: str, problems: list[str]) -> list[dict] | Any:
    """Rows of one JSON-lines table file as a DataFrame. A torn or corrupt line is skipped and reported."""
    import pandas as pd

    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    if not lines or not lines[0].strip():
        return pd.DataFrame()
    try:
        header = json.loads(lines[0])
        cols = header["columns"]
    except (ValueError, KeyError, TypeError):
        raise RunFormatError(f"{path}: first line is not a dtprof table header") from None
    version = header.get("schema_version", SCHEMA_VERSION)
    if version > SCHEMA_VERSION:
        raise RunFormatError(f"{path}: written with run-format schema {version}, this dtprof reads up to "
                             f"{SCHEMA_VERSION}; upgrade dtprof")
    rows = []
    bad = 0
    loads = json.loads
    for i, line in enumerate(lines[1:]):
        if not line:
            continue
        try:
            row = loads(line)
        except ValueError:
            bad += 1
            continue
        if len(row) != len(cols):
            bad += 1
            continue
        rows.append(row)
    if bad:
        problems.append(f"{path}: skipped {bad} unreadable line(s) (torn write of a killed process?)")
    return pd.DataFrame(rows, columns=cols)


def read_node_raw(node_dir: Path, problems: list[str] | None = None) -> dict:
    """A node's tables from its JSON-lines files (what the ranks and the NVML sampler wrote)."""
    import pandas as pd

    problems = problems if problems is not None else []
    parts: dict[str, list] = {t: [] for t in TABLES}
    for rdir in sorted(node_dir.glob(f"{RANK_PREFIX}*")):
        ident = rdir / "rank.json"
        if ident.exists():
            parts["ranks"].append(pd.DataFrame([_read_json(ident)]))
        for table in TABLES:
            p = rdir / f"{table}.jsonl"
            if p.exists():
                parts[table].append(_read_jsonl(p, table, problems))
    for table in ("nvml", "events"):
        p = node_dir / f"{table}.jsonl"
        if p.exists():
            parts[table].append(_read_jsonl(p, table, problems))
    out = {}
    for table, dfs in parts.items():
        dfs = [d for d in dfs if len(d)]
        df = pd.concat(dfs, ignore_index=True) if dfs else pd.DataFrame()
        if table == "ranks" and len(df):
            df["node"] = node_dir.name
        out[table] = conform(table, df)
    return out


def _read_node_tables(node_dir: Path) -> dict:
    import pandas as pd

    out = {}
    for table in TABLES:
        p = node_dir / TABLES_DIR / f"{table}.parquet"
        try:
            df = pd.read_parquet(p) if p.exists() else pd.DataFrame()
        except Exception as e:  # pyarrow raises several types for damaged files
            raise RunFormatError(f"{p}: unreadable Parquet ({type(e).__name__}: {e})".splitlines()[0]) from None
        out[table] = conform(table, df)
    return out


class Run:
    """A run directory read back. Tables are loaded on first use and cached.

    Attributes: ``path``, ``manifest`` (run.json), ``nodes`` (each node.json, with ``node`` = directory name),
    ``problems`` (lines about anything skipped while reading), and one DataFrame per table in
    ``dtprof.schema.TABLES``: ``ranks``, ``steps``, ``spans``, ``collectives``, ``groups``, ``nvml``, ``clock``,
    ``events``, ``meta`` (a run written before the meta table gets its rows from the legacy events messages).
    """

    def __init__(self, path: Path):
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
        self.node_dirs = sorted(p for p in self.path.glob(f"{NODE_PREFIX}*") if p.is_dir())
        self.nodes = []
        for nd in self.node_dirs:
            info = _read_json(nd / NODE_MANIFEST) if (nd / NODE_MANIFEST).exists() else {}
            info["node"] = nd.name
            self.nodes.append(info)
        self.problems: list[str] = []

    @cached_property
    def _tables(self) -> dict:
        import pandas as pd

        per_node = []
        for nd in self.node_dirs:
            if (nd / TABLES_DIR / TABLES_COMPLETE).exists():
                per_node.append(_read_node_tables(nd))
            else:
                per_node.append(read_node_raw(nd, self.problems))
        out = {}
        for table in TABLES:
            dfs = [n[table] for n in per_node if len(n[table])]
            if not dfs:
                out[table] = conform(table, pd.DataFrame())
            elif len(dfs) == 1:
                out[table] = dfs[0]
            else:  # union categories so concat keeps them categorical
                out[table] = conform(table, pd.concat([d.astype({c: "object" for c in d.columns
                                                                 if d[c].dtype == "category"}) for d in dfs],
                                                      ignore_index=True))
        out["meta"] = legacy_meta(out["events"], out["meta"])
        return out

    def table(self, name: str):
        if name not in TABLES:
            raise KeyError(f"unknown table {name!r}; tables are {', '.join(TABLES)}")
        return self._tables[name]

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

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, nodes={len(self.node_dirs)})"


def open_run(path) -> Run:
    """Open a run directory (or a path inside one: its summary.json, report.html, a node directory)."""
    p = Path(path)
    for cand in (p, p.parent, p.parent.parent):
        if (cand / RUN_MANIFEST).exists():
            return Run(cand)
    return Run(p)
