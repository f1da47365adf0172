"""Rank-side rows, generated from ``dtprof.rundir.schema.TABLES``: the run format's column order lives there only.

- The tables written on the training thread's hot path (steps, spans, collectives) are built by named builders,
  ``step_row``, ``span_row`` and ``collective_row``: one argument per column in schema order, the trailing nullable
  ones (and a span's lane and source) with defaults, so a column added at a table's end needs no change where rows
  are built. They return plain tuples: Python's garbage collector stops tracking a tuple of plain values at its
  first young-generation pass, where a namedtuple (a tuple subclass) stays tracked and pushes the full
  collections of a process of torch's size; on a 2-core VM a namedtuple row cost ~650 ns against ~130 ns.
  ``COLUMN[table][column]`` is a column's index, for reading such a row by name.
- The other tables' rows are namedtuples (``Event``, ``Meta``, ...) that carry their table (``row.table``).
The writer takes either as the JSON array the run format expects. Stdlib only (the rank side imports this before
torch has finished loading).
"""
from __future__ import annotations

from collections import namedtuple

from dtprof.rundir.schema import TABLES


def _record(class_name: str, table: str):
    cols = TABLES[table]
    # Trailing nullable integer columns default to None, so a column added at the end of a table (a minor format
    # version) needs no change at every place that builds such a row.
    n_optional = 0
    while n_optional < len(cols) and cols[len(cols) - 1 - n_optional][1] == "Int":
        n_optional += 1
    cls = namedtuple(class_name, [c for c, _ in cols],  # type: ignore[misc]  # generated from the schema on purpose
                     defaults=[None] * n_optional)  # type: ignore[misc]
    cls.table = table  # type: ignore[attr-defined]  # the table a row of this class is appended to
    return cls


Group = _record("Group", "groups")
Clock = _record("Clock", "clock")
Event = _record("Event", "events")
Meta = _record("Meta", "meta")

COLUMN = {table: {c: i for i, (c, _) in enumerate(cols)} for table, cols in TABLES.items()}


def _builder(name: str, table: str, required: int, defaults: dict):
    """``name(col0, col1, ...)``: a plain-tuple row of ``table``; the columns after the first ``required`` default
    to ``defaults``' value or None. Generated (one call, the tuple built in place: these run for every row)."""
    cols = [c for c, _ in TABLES[table]]
    params = cols[:required] + [f"{c}={defaults.get(c)!r}" for c in cols[required:]]
    namespace: dict = {"__name__": __name__}    # this module's: Dynamo skips it (compile_watch.skip_our_code)
    exec(compile(f"def {name}({', '.join(params)}):\n    return ({', '.join(cols)},)\n", __file__, "exec"), namespace)
    fn = namespace[name]
    fn.__doc__ = f"A {table} row (dtprof.rundir.schema.TABLES[{table!r}]) as a plain tuple."
    return fn


step_row = _builder("step_row", "steps", 4, {})
span_row = _builder("span_row", "spans", 6, {"lane": "main", "source": "hook"})
collective_row = _builder("collective_row", "collectives", COLUMN["collectives"]["end_ns"], {})
Health = _record("Health", "health")
