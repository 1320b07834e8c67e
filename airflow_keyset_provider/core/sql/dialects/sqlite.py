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

from ..catalog import IndexInfo
from .base import Dialect

if TYPE_CHECKING:
    from ..relation import Relation


def _rowid_pk(table: sa.Table) -> list[str]:
    pk = list(table.primary_key.columns)
    return [pk[0].name] if len(pk) == 1 and isinstance(pk[0].type, sa.Integer) else []


class SqliteDialect(Dialect):
    name = "sqlite"

    def unique_indexes(self, conn: sa.Connection, src: Relation) -> list[IndexInfo]:
        """``PRAGMA index_list`` / ``index_xinfo``: partial indexes and expression key parts are
        marked (an INTEGER PRIMARY KEY, the rowid, is in no index: ``implicit_unique``)."""
        out = []
        quoted = '"' + src.table_name.replace('"', '""') + '"'
        for row in conn.exec_driver_sql(f"PRAGMA index_list({quoted})").all():
            name, unique, partial = row[1], bool(row[2]), bool(row[4])
            qname = '"' + str(name).replace('"', '""') + '"'
            info = conn.exec_driver_sql(f"PRAGMA index_xinfo({qname})").all()
            # index_xinfo: (seqno, cid, name, desc, coll, key); cid -2 is an expression, -1 the rowid
            cols = tuple(None if r[1] == -2 else r[2] for r in info if r[5])
            out.append(IndexInfo(str(name), cols, unique, partial))
        return out

    def never_null(self, table: sa.Table, col: sa.Column) -> bool:
        # SQLite's INTEGER PRIMARY KEY aliases the rowid and can never be NULL, though it
        # reflects as nullable; any other SQLite primary key column does accept NULL.
        return _rowid_pk(table) == [col.name]

    def implicit_unique(self, table: sa.Table) -> list[set[str]]:
        rowid = _rowid_pk(table)
        return [set(rowid)] if rowid else []
