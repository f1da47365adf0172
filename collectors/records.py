"""Typed rank-side rows: one record class per table of the run format, generated from ``dtprof.schema.TABLES``.

Each class is a ``collections.namedtuple`` with the table's columns as fields, in schema order: a row is built by
name (``Span(rank=..., step=..., ...)`` or positionally), read by name (``row.end_ns``), and is still a plain
tuple to the writer (``json.dumps`` writes it as the JSON array the run format expects), so naming the fields
costs nothing per row. Rows are immutable: a collective completed later is a copy with its ``end_ns`` set.
Stdlib only (the rank side imports this before torch has finished loading).
"""
from __future__ import annotations

from collections import namedtuple

from dtprof.schema import TABLES


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


Step = _record("Step", "steps")
Span = _record("Span", "spans")
Collective = _record("Collective", "collectives")
Group = _record("Group", "groups")
Clock = _record("Clock", "clock")
Event = _record("Event", "events")
Meta = _record("Meta", "meta")

# A row's trailing columns left null (the columns added after the first ten), for the hot paths that build a row
# positionally through tuple.__new__ (collectors/runtime.py): _row(Span, (...) + SPAN_TAIL)
SPAN_TAIL = (None,) * (len(Span._fields) - 10)
STEP_TAIL = (None,) * (len(Step._fields) - 10)
# a host-timed main-lane span's columns after end_ns (no stage or microbatch): the hooks that run every step build
# that row themselves, _row(Span, (rank, step, kind, name, t0, t1) + HOOK_SPAN_TAIL)
HOOK_SPAN_TAIL = (None, None, "main", "hook") + SPAN_TAIL
