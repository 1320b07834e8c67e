"""SQLite behind the ``Dialect`` interface.

- uniqueness: a unique index without predicate or expression (``PRAGMA index_list/xinfo``), or
  an ``INTEGER PRIMARY KEY`` (the rowid itself: never NULL, unique, ordered, listed by no index);
- text keys: SQLite's default ``BINARY`` collation compares UTF-8 bytes, i.e. code points;
- commit order: SQLite serialises writers, so a key committed is committed in order; the
  ``settle_seconds`` window is a plain delay (the base class);
- planner: exact counts and one ordered pass (the base class);
- timeouts: none beyond the driver's busy timeout (SQLite has no statement timeout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sqlalchemy as sa

from .. import catalog
from .base import Dialect

if TYPE_CHECKING:
    from ..catalog import IndexInfo
    from ..source import SqlSource


def _rowid_pk(table: sa.Table) -> list[str]:
    pk = list(table.primary_key.columns)
    return [pk[0].name] if len(pk) == 1 and isinstance(pk[0].type, sa.Integer) else []


class SqliteDialect(Dialect):
    name = "sqlite"

    def unique_indexes(self, conn: sa.Connection, src: SqlSource) -> list[IndexInfo]:
        return catalog.unique_indexes(conn, "sqlite", src._rel, src.table_name)

    def never_null(self, table: sa.Table, col: sa.Column) -> bool:
        # SQLite's INTEGER PRIMARY KEY aliases the rowid and can never be NULL, though it
        # reflects as nullable; any other SQLite primary key column does accept NULL.
        return _rowid_pk(table) == [col.name]

    def implicit_unique(self, table: sa.Table) -> list[set[str]]:
        rowid = _rowid_pk(table)
        return [set(rowid)] if rowid else []
