"""``INSERT ... ON CONFLICT`` upserts, shared by PostgreSQL and SQLite (same syntax in both)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql.elements import ColumnElement

from ..target import Target
from .base import Builder


def on_conflict(
    stmt: Any,
    table: sa.Table,
    json_text: bool,
    conflict_cols: Sequence[str],
    update_cols: list[str],
) -> Any:
    """``ON CONFLICT (conflict_cols) DO NOTHING``, or ``DO UPDATE`` of ``update_cols`` only where
    one of them differs, so that a re-run writes (and reports) nothing. ``json_text``: compare
    ``json`` columns as text (PostgreSQL's ``json`` has no equality operator)."""
    if not update_cols:
        return stmt.on_conflict_do_nothing(index_elements=list(conflict_cols))
    excluded = stmt.excluded

    def differs(name: str) -> ColumnElement[bool]:
        col, new = table.c[name], excluded[name]
        if (
            json_text
            and isinstance(col.type, sa.JSON)
            and not isinstance(col.type, postgresql.JSONB)
        ):
            return sa.cast(col, sa.Text).is_distinct_from(sa.cast(new, sa.Text))
        return col.is_distinct_from(new)

    # only rows whose values really change are written and reported: a re-run is a no-op
    return stmt.on_conflict_do_update(
        index_elements=list(conflict_cols),
        set_={n: excluded[n] for n in update_cols},
        where=sa.or_(*(differs(n) for n in update_cols)),
    )


def insert_many(
    insert: Callable[[sa.Table], Any],
    target: Target,
    conflict_cols: Sequence[str],
    update_cols: list[str],
    batch_size: int,
    json_text: bool,
) -> Builder:
    """One multi-row ``INSERT ... ON CONFLICT ... RETURNING`` per batch, rendered by
    SQLAlchemy's "insertmanyvalues" from a statement compiled once. ``insert`` is the dialect's
    ``insert`` construct (it knows ``ON CONFLICT``)."""
    table = target.table
    stmt = on_conflict(insert(table), table, json_text, conflict_cols, update_cols)
    stmt = stmt.returning(*target.key_cols).execution_options(insertmanyvalues_page_size=batch_size)
    return lambda batch: (stmt, [dict(row) for row in batch])
