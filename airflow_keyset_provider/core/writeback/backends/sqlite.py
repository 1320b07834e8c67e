"""SQLite >= 3.35: ``RETURNING``, per-row values by ``CASE``, upserts by ``ON CONFLICT``.

SQLite has one writer at a time, so ``claim_skip_locked`` is a plain ordered SELECT there.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from airflow_keyset_provider.core.errors import ConfigurationError

from ..batching import guard_params
from ..target import Guard, Target
from .base import Backend, Plan, returning
from .case_when import update_case_when
from .on_conflict import insert_many

# SQLITE_MAX_VARIABLE_NUMBER defaults to 32766 since SQLite 3.32; used when the driver cannot
# tell the compiled-in value.
_SQLITE_MAX_PARAMS = 32_766
_SQLITE_MIN_VERSION = (3, 35)  # RETURNING
# SQLite evaluates a CASE by trying its WHENs in order, so an update_rows statement costs
# O(rows^2); measured best at 250-500 rows per statement (135k rows/s, 30k at 5000).
_SQLITE_CASE_MAX_ROWS = 500


class SqliteBackend(Backend):
    """No savepoints: SQLite undoes just the failing statement and keeps the transaction, and
    pysqlite starts its transaction lazily, so a savepoint taken before it would become the
    outer transaction, its RELEASE committing the caller's work."""

    name = "sqlite"
    savepoint_per_statement = False

    def check(self, conn: Connection) -> None:
        version = conn.dialect.server_version_info or ()
        if tuple(version[:2]) < _SQLITE_MIN_VERSION:
            raise ConfigurationError(
                f"SQLite {'.'.join(map(str, version))} lacks RETURNING, which the write-back "
                "helpers need to report per-key outcomes; use SQLite >= 3.35."
            )

    def autocommit(self, conn: Connection) -> bool:
        # pysqlite before Python 3.12 has no `autocommit`: isolation_level None is autocommit
        dbapi_conn = conn.connection.dbapi_connection
        return super().autocommit(conn) or getattr(dbapi_conn, "isolation_level", "") is None

    def max_params(self, conn: Connection) -> int:
        try:  # Python >= 3.11 reads the limit this connection really has
            dbapi_conn = conn.connection.dbapi_connection
            return int(dbapi_conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER))  # type: ignore[union-attr]
        except (AttributeError, TypeError):  # another SQLite driver, or an older Python
            return _SQLITE_MAX_PARAMS

    def update_rows(
        self,
        target: Target,
        value_cols: list[str],
        guard: ColumnElement[bool] | None,
        expected: Guard,
    ) -> Plan:
        nkey = len(target.key_cols)
        # the key is bound in every CASE and once more in the IN list
        per_row = len(value_cols) * (nkey + 1) + nkey
        build = update_case_when(target, value_cols, expected)
        return Plan(
            returning(target, build), per_row, guard_params(expected), _SQLITE_CASE_MAX_ROWS
        )

    def upsert(
        self,
        target: Target,
        columns: list[str],
        conflict_cols: Sequence[str],
        update_cols: list[str],
        batch_size: int,
    ) -> Plan:
        build = insert_many(
            sqlite_dialect.insert, target, conflict_cols, update_cols, batch_size, json_text=False
        )
        return Plan(returning(target, build), len(columns))


BACKEND = SqliteBackend()
