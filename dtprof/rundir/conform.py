"""A run's tables in the schema's columns and types (dtprof/rundir/schema.py): any older run format, a column that is
missing, a type that drifted, a corrupt time, each conformed or named in one line (``RunFormatError``)."""
from __future__ import annotations

import json
import re
from typing import Any

from dtprof.rundir.schema import (
    CATEGORICAL,
    TABLES,
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


