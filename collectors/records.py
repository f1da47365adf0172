"""Typed rank-side rows: one record class per table of the run format, generated from ``dtprof.schema.TABLES``.

Each class is a ``collections.namedtuple`` with the table's columns as fields, in schema order: a row is built by
name (``Span(rank=..., step=..., ...)`` or positionally), read by name (``row.end_ns``), and is still a plain
tuple to the writer (``json.dumps`` writes it as the JSON array the run format expects), so naming the fields
costs nothing per row. Rows are immutable: a collective completed later is ``row._replace(end_ns=t)``.
Stdlib only (the rank side imports this before torch has finished loading).
"""
from __future__ import annotations

from collections import namedtuple

from dtprof.schema import TABLES


def _record(class_name: str, table: str):
    cls = namedtuple(class_name, [c for c, _ in TABLES[table]])  # type: ignore[misc]  # generated from the schema on purpose
    cls.table = table  # type: ignore[attr-defined]  # the table a row of this class is appended to
    return cls


Step = _record("Step", "steps")
Span = _record("Span", "spans")
Collective = _record("Collective", "collectives")
Group = _record("Group", "groups")
Clock = _record("Clock", "clock")
Event = _record("Event", "events")
Meta = _record("Meta", "meta")
