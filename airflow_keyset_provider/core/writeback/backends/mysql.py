"""MySQL >= 8.0 and MariaDB >= 10.6 (PyMySQL, mysqlclient): lock, then write exactly those rows.

Neither database has ``UPDATE ... RETURNING``, and the affected-rows count cannot say which
rows a statement wrote (SQLAlchemy always sets ``CLIENT_FOUND_ROWS``, so an upsert reports 1 for
an inserted row and 1 for a row left as it was). So every batch starts with a locking read in
the caller's transaction, ``SELECT key FROM t WHERE key IN (batch) AND guard FOR UPDATE``: the
rows it returns are the ones this call will write, and their locks keep any other writer from
changing them (and so the guard) until the caller's transaction ends. The write that follows
names exactly those keys, without the guard: the outcome is exact under concurrent writers (a
second writer's locking read waits, then reads the committed row, which no longer matches).

``upsert`` reads the existing rows of the batch the same way, with a column per row saying
whether one of the ``update`` columns differs (compared byte for byte: a case-only change under
a ``_ci`` collation is a change), then inserts the missing rows with a plain ``INSERT`` and
updates the differing ones with a CASE ``UPDATE``. It does not use ``INSERT ... ON DUPLICATE
KEY UPDATE``: that updates a row on a conflict with *any* unique key, so a row conflicting on a
different unique key would silently overwrite another row, where PostgreSQL's ``ON CONFLICT
(cols)`` fails it (here: 1062, ``failed``).

Every batch runs in a SAVEPOINT, so a failing statement (a trigger's ``SIGNAL``, a CHECK) takes
the batch's earlier statements with it. Batches are split by size: a statement must fit the
server's ``max_allowed_packet`` (read once per engine), estimated from the values with a margin.
Errors are classified by MySQL error number (``error_numbers``, see ``failures.py``).
"""

from __future__ import annotations

import datetime
import decimal
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql as mysql_dialect
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.elements import ColumnElement

from airflow_keyset_provider.core.errors import ConfigurationError

from ..failures import Fault
from ..target import Guard, Key, KeyIndex, Target
from .base import Backend, BatchWrite, ColumnarPlan, KeyIn, Plan
from .case_when import TemplateCache, case_params, case_parts, update_case_when
from .mysql_columnar import PACKET_SHARE, update_plan, upsert_plan

_ROW, _DEP, _CONF = Fault.ROW, Fault.DEPENDENCY, Fault.CONFIGURATION
#: MySQL/MariaDB error numbers (``exc.orig.args[0]``) and whose fault they are.
MYSQL_ERRORS: Mapping[int, Fault] = {
    **dict.fromkeys(
        (
            1048,  # column cannot be null
            1062,  # duplicate entry
            1216,  # foreign key: cannot add a child row (old servers)
            1217,  # foreign key: cannot delete a parent row (old servers)
            1264,  # out of range value
            1265,  # data truncated
            1292,  # incorrect datetime/truncated incorrect value
            1366,  # incorrect value for a column
            1364,  # field doesn't have a default value
            1406,  # data too long
            1451,  # foreign key: a child row references this row
            1452,  # foreign key: no parent row
            1365,  # division by 0
            1690,  # value out of range in an expression
            3819,  # CHECK constraint violated (MySQL)
            4025,  # CONSTRAINT failed (MariaDB's CHECK)
            1644,  # SIGNAL from a trigger or procedure (SQLSTATE 45000)
        ),
        _ROW,
    ),
    **dict.fromkeys(
        (
            1205,  # lock wait timeout
            1213,  # deadlock
            1040,  # too many connections
            1053,  # server shutdown in progress
            1317,  # query interrupted
            1969,  # max_statement_time exceeded (MariaDB)
            3024,  # max_execution_time exceeded (MySQL)
            2002,  # cannot connect
            2003,  # cannot connect
            2006,  # server has gone away
            2013,  # lost connection during query
        ),
        _DEP,
    ),
    **dict.fromkeys(
        (1054, 1142, 1143, 1146, 1064, 1792, 1153),  # 1153: bigger than max_allowed_packet
        _CONF,
    ),
}
# MySQL's limit on a prepared statement's placeholders (PyMySQL interpolates client-side; the
# same cap keeps statements sane)
_MYSQL_MAX_PARAMS = 65_535
# CASE is evaluated WHEN by WHEN, so a CASE statement costs O(rows^2); this many rows per
# statement keeps that small next to the round trip
_CASE_MAX_ROWS = 1_000
_PACKETS: weakref.WeakKeyDictionary[Engine, int] = weakref.WeakKeyDictionary()
_PACKETS_LOCK = threading.Lock()


class MysqlBackend(Backend):
    name = "mysql"
    error_numbers = MYSQL_ERRORS

    def check(self, conn: Connection) -> None:
        dialect = conn.dialect
        version = tuple(dialect.server_version_info or ())
        mariadb = bool(getattr(dialect, "is_mariadb", False))
        least = (10, 6) if mariadb else (8, 0)  # FOR UPDATE SKIP LOCKED
        if version[:2] < least:
            family = "MariaDB" if mariadb else "MySQL"
            shown = ".".join(map(str, version))
            raise ConfigurationError(
                f"{family} {shown} is too old for the write-back helpers (they need FOR UPDATE "
                f"SKIP LOCKED and CHECK constraints): use {family} >= {'.'.join(map(str, least))}."
            )

        info = conn.connection.info  # lives as long as the driver's connection
        if "keyset_sql_mode" not in info:
            info["keyset_sql_mode"] = str(
                conn.exec_driver_sql("SELECT @@SESSION.sql_mode").scalar()
            )
        if "STRICT_" not in info["keyset_sql_mode"].upper():
            raise ConfigurationError(
                "the write-back helpers need a strict sql_mode (STRICT_TRANS_TABLES, the server "
                "default): without it MySQL stores truncated or zeroed values with a warning "
                "instead of failing the row, and a bad row would be reported applied."
            )

    def autocommit(self, conn: Connection) -> bool:
        dbapi_conn = conn.connection.dbapi_connection
        get = getattr(dbapi_conn, "get_autocommit", None)  # PyMySQL, mysqlclient
        return bool(get()) if callable(get) else super().autocommit(conn)

    def max_params(self, conn: Connection) -> int:
        return _MYSQL_MAX_PARAMS

    def guarded_update(
        self,
        target: Target,
        values: Mapping[str, Any],
        guard: ColumnElement[bool] | None,
        expected: Guard,
    ) -> Plan:
        lock = _locker(target, guard)
        key_in = KeyIn(target)
        stmt = sa.update(target.table).values(dict(values))

        def write(conn: Connection, batch: list[Key]) -> list[Key]:
            locked = lock(conn, batch)
            if locked:
                conn.execute(stmt.where(key_in(locked)))
            return locked

        return Plan(write, len(target.key_cols), len(values), row_bytes=_key_bytes(target))

    def update_rows(
        self,
        target: Target,
        value_cols: list[str],
        guard: ColumnElement[bool] | None,
        expected: Guard,
    ) -> Plan:
        lock = _locker(target, guard)
        build = update_case_when(target, value_cols, None, returning=False)

        def write(conn: Connection, batch: list[Mapping[str, Any]]) -> list[Key]:
            rows = _rows_of(target, batch, lock(conn, [target.key_of_row(r) for r in batch]))
            if rows:
                conn.execute(*build(rows))
            return [target.key_of_row(r) for r in rows]

        nkey = len(target.key_cols)
        per_row = len(value_cols) * (nkey + 1) + nkey
        return Plan(write, per_row, 0, _CASE_MAX_ROWS, _row_bytes(target, value_cols, nkey))

    def upsert(
        self,
        target: Target,
        columns: list[str],
        conflict_cols: Sequence[str],
        update_cols: list[str],
        batch_size: int,
    ) -> Plan:
        by_conflict = Target(target.table, tuple(conflict_cols))
        write = _upsert_write(target, by_conflict, update_cols)
        nkey = len(conflict_cols)
        per_row = len(columns) + len(update_cols) * (nkey + 1) + nkey
        row_bytes = _row_bytes(by_conflict, columns, nkey * (len(update_cols) + 1))
        return Plan(write, per_row, 0, _CASE_MAX_ROWS if update_cols else None, row_bytes)

    def lock_for_claim(self, stmt: sa.Select) -> sa.Select:
        return stmt.with_for_update(skip_locked=True)

    def columnar_update(
        self,
        conn: Connection,
        target: Target,
        value_cols: Sequence[str],
        constants: Mapping[str, Any],
        expected: Guard,
        isolate: bool,
    ) -> ColumnarPlan | None:
        budget = int(max_allowed_packet(conn) * PACKET_SHARE)
        return update_plan(conn, target, value_cols, constants, expected, budget)

    def columnar_upsert(
        self,
        conn: Connection,
        target: Target,
        columns: Sequence[str],
        conflict_cols: Sequence[str],
        update_cols: Sequence[str],
        isolate: bool,
    ) -> ColumnarPlan | None:
        budget = int(max_allowed_packet(conn) * PACKET_SHARE)
        return upsert_plan(conn, target, columns, conflict_cols, update_cols, budget)

    def batches(self, conn: Connection, items: list, batch_size: int, plan: Plan) -> Iterator[list]:
        """Batches by count (``Backend.batches``), each split further to fit the packet."""
        budget = int(max_allowed_packet(conn) * PACKET_SHARE)
        for batch in super().batches(conn, items, batch_size, plan):
            if plan.row_bytes is None:
                yield batch
                continue
            yield from split_by_bytes(batch, plan.row_bytes, budget)


def split_by_bytes(items: list, size_of: Any, budget: int) -> Iterator[list]:
    """Consecutive runs of ``items`` whose estimated sizes add up to at most ``budget`` bytes
    (an item larger than that alone is a batch of its own: the server says if it is too big)."""
    batch: list = []
    used = 0
    for item in items:
        size = size_of(item)
        if batch and used + size > budget:
            yield batch
            batch, used = [], 0
        batch.append(item)
        used += size
    if batch:
        yield batch


def max_allowed_packet(conn: Connection) -> int:
    """The server's ``max_allowed_packet`` in bytes, read once per engine."""
    engine = conn.engine
    with _PACKETS_LOCK:
        found = _PACKETS.get(engine)
    if found is None:
        found = int(conn.exec_driver_sql("SELECT @@max_allowed_packet").scalar_one())
        with _PACKETS_LOCK:
            _PACKETS[engine] = found
    return found


def value_bytes(value: Any) -> int:
    """A generous estimate of the bytes ``value`` takes in a statement's text (escaped)."""
    if value is None or isinstance(value, bool | int | float | decimal.Decimal):
        return 32
    if isinstance(value, str):
        return 2 * len(value.encode("utf-8", "surrogatepass")) + 8
    if isinstance(value, bytes | bytearray | memoryview):
        return 2 * len(value) + 8
    if isinstance(value, datetime.date | datetime.time | datetime.timedelta):
        return 40
    return 2 * len(str(value)) + 8


def _key_bytes(target: Target) -> Any:
    if target.composite:
        return lambda key: sum(value_bytes(v) for v in key) + 16
    return lambda key: value_bytes(key) + 8


def _row_bytes(target: Target, value_cols: Sequence[str], key_uses: int) -> Any:
    """A row's size in a CASE statement: its key ``key_uses`` times, each value once, and the
    ``WHEN ... THEN`` text around them."""
    names = target.key_names

    def size(row: Mapping[str, Any]) -> int:
        key = sum(value_bytes(row[n]) for n in names)
        return key * (key_uses + 1) + sum(value_bytes(row[n]) + 32 for n in value_cols)

    return size


def _locker(target: Target, guard: ColumnElement[bool] | None) -> Any:
    """``lock(conn, keys)``: the keys of ``keys`` whose rows exist and match ``guard``, locked
    ``FOR UPDATE`` until the transaction ends. On a unique key a ``COUNT(*)`` locks them first:
    if every key matched, the keys are returned as given without reading them back (half the
    time of the write on 10k keys); otherwise the locked keys are read, as the database has
    them."""
    key_in = KeyIn(target)
    stmt = sa.select(*target.key_cols)
    count = sa.select(sa.func.count()).select_from(target.table) if _unique(target) else None
    if guard is not None:
        stmt = stmt.where(guard)
        count = count.where(guard) if count is not None else None

    def lock(conn: Connection, keys: list[Key]) -> list[Key]:
        if count is not None:
            found = conn.execute(count.where(key_in(keys)).with_for_update()).scalar_one()
            if found == len(keys):
                return keys
        locking = stmt.where(key_in(keys)).with_for_update()
        return [target.key_from_result(r) for r in conn.execute(locking).all()]

    return lock


def _unique(target: Target) -> bool:
    """Is the key the primary key or a unique index/constraint of the table (so one key names
    at most one row)?"""
    names = set(target.key_names)
    table = target.table
    if {c.name for c in table.primary_key.columns} == names:
        return True
    uniques = [set(i.columns.keys()) for i in table.indexes if i.unique]
    uniques += [
        {c.name for c in u.columns} for u in table.constraints if isinstance(u, sa.UniqueConstraint)
    ]
    return names in uniques


def _rows_of(target: Target, batch: list[Mapping[str, Any]], keys: list[Key]) -> list[Mapping]:
    """The rows of ``batch`` whose key is among ``keys`` (as the database returned them)."""
    index = KeyIndex([target.key_of_row(r) for r in batch])
    wanted = {index.lookup(k) for k in keys}
    return [r for r in batch if target.key_of_row(r) in wanted]


_DIFFERS_TEMPLATES = TemplateCache()


def _differs_template(by_conflict: Target, update_cols: list[str], n: int) -> sa.Select:
    """``SELECT conflict cols, <does an update column differ> FROM t WHERE conflict IN (...)
    FOR UPDATE`` for ``n`` rows, the new values as CASE expressions (see ``case_parts``)."""
    table = by_conflict.table
    news, key_in = case_parts(by_conflict, update_cols, n, else_=False)
    differs = sa.or_(
        *(
            _bytes(table.c[name]).is_distinct_from(_bytes(news[table.c[name]]))
            for name in update_cols
        )
    )
    return sa.select(*by_conflict.key_cols, differs).where(key_in).with_for_update()


def _bytes(expr: Any) -> Any:
    """Strings compared byte for byte (``_ci`` collations and PAD SPACE would call 'a' = 'A ')."""
    if isinstance(expr.type, sa.String):
        return sa.cast(expr, mysql_dialect.BINARY())
    return expr


def _upsert_write(target: Target, by_conflict: Target, update_cols: list[str]) -> BatchWrite:
    """Lock the batch's existing rows, insert the missing ones, update those that differ."""
    table = by_conflict.table
    plain = _locker(by_conflict, None)
    update = update_case_when(by_conflict, update_cols, None, returning=False)
    insert = sa.insert(table)

    def write(conn: Connection, batch: list[Mapping[str, Any]]) -> list[Key]:
        keys = [by_conflict.key_of_row(r) for r in batch]
        index = KeyIndex(keys)
        if update_cols:
            n = len(batch)
            stmt = _DIFFERS_TEMPLATES.get(
                (table, by_conflict.key_names, tuple(update_cols), n),
                lambda: _differs_template(by_conflict, update_cols, n),
            )
            found = conn.execute(stmt, case_params(by_conflict, update_cols, batch)).all()
            nkey = len(by_conflict.key_names)
            existing = {index.lookup(by_conflict.key_from_result(r)): bool(r[nkey]) for r in found}
        else:
            existing = {index.lookup(k): False for k in plain(conn, keys)}
        missing = [r for r in batch if by_conflict.key_of_row(r) not in existing]
        changed = [r for r in batch if existing.get(by_conflict.key_of_row(r))]
        if missing:
            conn.execute(insert, [dict(r) for r in missing])
        if changed:
            conn.execute(*update(changed))
        return [target.key_of_row(r) for r in (*missing, *changed)]

    return write


BACKEND = MysqlBackend()
