"""MySQL/MariaDB from columns: a locking read, then one statement, on the driver's cursor.

What a careful engineer writes by hand for a batch, with the same per-key outcome:

- update (``guarded_update``, ``update_rows``, ``update_columns``): ``SELECT key FROM t WHERE
  key IN (...) AND <guard> FOR UPDATE`` (the rows this batch will write, locked until the
  caller's transaction ends, so the guard cannot change under it), then one ``UPDATE t SET c =
  %s WHERE key IN (...) AND <guard>`` (same values for all) or ``UPDATE t JOIN (SELECT %s AS k,
  %s AS c UNION ALL ...) AS v ON t.k = v.k SET t.c = v.c WHERE <guard>`` (a value per row);
- upsert on a table whose only unique key is the conflict key (so ``ON DUPLICATE KEY UPDATE``
  cannot hit another unique key): ``SELECT key, <an update column differs> FROM t JOIN (the
  batch's key and update columns) AS v ... FOR UPDATE``, then one ``INSERT ... VALUES ... ON
  DUPLICATE KEY UPDATE c = VALUES(c)`` of the rows that are missing or differ.

No savepoint: InnoDB rolls a failed statement back alone and the transaction goes on, so a
batch that fails on a row's data is written again in halves (``isolation.ColumnarWriter``).
Every value is a ``%s`` parameter, escaped once by the driver; the statement texts are built
once per shape and batch size, identifiers quoted by SQLAlchemy's preparer. A batch is kept
under half of ``max_allowed_packet`` by an estimate per column (``batch_bytes``), not per value.
Columns whose type has a SQLAlchemy bind processor (JSON, Enum classes, type decorators), a guard
expression, or a SQL expression as a value take the row path of ``mysql.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from operator import itemgetter
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..columns import positions
from ..direct import cursor_of, execute
from ..target import Guard, Target
from .base import ColumnarPlan
from .case_when import TemplateCache

_TEXTS = TemplateCache(256)
# a statement is kept under this share of max_allowed_packet (escaping, statement text)
PACKET_SHARE = 0.5


class Sql:
    """Quoted names of one table and its key, and the statement pieces built from them."""

    def __init__(self, conn: Connection, target: Target) -> None:
        quote = conn.dialect.identifier_preparer
        self.table = quote.format_table(target.table)
        self.q = quote.quote
        self.keys = [f"{self.table}.{self.q(n)}" for n in target.key_names]
        self.composite = target.composite

    def key_in(self, n: int) -> str:
        """``key IN (%s, ...)`` for ``n`` keys (row values for a composite key)."""
        if not self.composite:
            return f"{self.keys[0]} IN ({', '.join(['%s'] * n)})"
        one = f"({', '.join(['%s'] * len(self.keys))})"
        return f"({', '.join(self.keys)}) IN ({', '.join([one] * n)})"

    def derived(self, names: Sequence[str], n: int) -> str:
        """``SELECT %s AS a, %s AS b UNION ALL SELECT %s, %s ...``: ``n`` rows of values."""
        first = "SELECT " + ", ".join(f"%s AS {self.q(c)}" for c in names)
        rest = " UNION ALL SELECT " + ", ".join(["%s"] * len(names))
        return first + rest * (n - 1)

    def join_on(self, alias: str, names: Sequence[str]) -> str:
        return " AND ".join(f"{self.table}.{self.q(c)} = {alias}.{self.q(c)}" for c in names)

    def guard(self, guard: Mapping[str, Any]) -> tuple[str, list]:
        """`` AND c = %s ...`` (``IS NULL`` for None) and its values."""
        parts, values = [], []
        for name, value in guard.items():
            col = f"{self.table}.{self.q(name)}"
            if value is None:
                parts.append(f" AND {col} IS NULL")
            else:
                parts.append(f" AND {col} = %s")
                values.append(value)
        return "".join(parts), values


def plain(conn: Connection, table: sa.Table, names: Sequence[str]) -> bool:
    """Values of these columns go to the driver as they are (no bind processor)."""
    dialect = conn.dialect
    return all(table.c[n].type.dialect_impl(dialect).bind_processor(dialect) is None for n in names)


def flat(data: Mapping[str, list], names: Sequence[str]) -> list:
    """The values of ``names`` row by row (a derived table's or a VALUES list's parameters)."""
    if len(names) == 1:
        return data[names[0]]
    return list(chain.from_iterable(zip(*(data[n] for n in names), strict=True)))


def key_values(data: Mapping[str, list], target: Target) -> list:
    return flat(data, target.key_names)


def column_bytes(values: list, text: bool) -> int:
    """A generous estimate of the statement bytes of a column's values: for a text column 4
    bytes a character (UTF-8 at worst, or an escaped byte) and 12 around each value; 40 bytes a
    value of any other column (numbers, dates)."""
    if not text:
        return 40 * len(values)
    try:
        return 4 * sum(map(len, values)) + 12 * len(values)
    except TypeError:  # None or a non-text value among them
        return sum(
            4 * len(v) + 12 if isinstance(v, str | bytes | bytearray) else 40 for v in values
        )


def batch_bytes(table: sa.Table, names: Sequence[str]) -> Callable[[dict[str, list]], int]:
    """Estimated bytes of the biggest statement of a batch of ``names``: each name appears in
    one statement once, and 2 kB of statement text."""
    text = {n: _is_text(table.c[n].type) for n in names}

    def size(data: dict[str, list]) -> int:
        return 2048 + sum(column_bytes(data[n], text[n]) for n in names)

    return size


def _is_text(type_: sa.types.TypeEngine) -> bool:
    """Can a value of this column be long (text, bytes, or a type SQLAlchemy does not know)?"""
    if isinstance(type_, sa.String | sa.LargeBinary | sa.types.NullType):
        return True
    return not isinstance(
        type_, sa.Integer | sa.Numeric | sa.Date | sa.DateTime | sa.Time | sa.Boolean
    )


def update_plan(
    conn: Connection,
    target: Target,
    value_cols: Sequence[str],
    constants: Mapping[str, Any],
    expected: Guard,
    budget: int,
) -> ColumnarPlan | None:
    """The locking read and one UPDATE per batch (see the module docstring)."""
    if expected is not None and not isinstance(expected, Mapping):
        return None
    guard = dict(expected or {})
    if any(isinstance(v, sa.sql.ClauseElement) for v in constants.values()) or not plain(
        conn, target.table, [*target.key_names, *value_cols, *constants, *guard]
    ):
        return None
    sql = Sql(conn, target)
    guard_sql, guard_values = sql.guard(guard)
    sets = [f"{sql.table}.{sql.q(n)} = %s" for n in constants]
    const_values = list(constants.values())
    guard_shape = tuple((n, v is None) for n, v in guard.items())
    shape = (target.table, target.key_names, tuple(value_cols), tuple(constants), guard_shape)
    names = [*target.key_names, *value_cols]

    def texts(n: int) -> tuple[str, str]:
        lock = f"SELECT {', '.join(sql.keys)} FROM {sql.table} WHERE {sql.key_in(n)}"
        lock += f"{guard_sql} FOR UPDATE"
        if not value_cols:
            write = f"UPDATE {sql.table} SET {', '.join(sets)} WHERE {sql.key_in(n)}{guard_sql}"
        else:
            alias = "keyset_rows"
            all_sets = [f"{sql.table}.{sql.q(c)} = {alias}.{sql.q(c)}" for c in value_cols]
            write = (
                f"UPDATE {sql.table} JOIN ({sql.derived(names, n)}) AS {alias} ON "
                f"{sql.join_on(alias, target.key_names)} SET {', '.join(all_sets + sets)} "
                f"WHERE 1 = 1{guard_sql}"
            )
        return lock, write

    def write(conn: Connection, data: dict[str, list], n: int) -> list[int]:
        lock_sql, write_sql = _TEXTS.get((*shape, n), lambda: texts(n))
        keys = key_values(data, target)
        cursor = cursor_of(conn)
        try:
            locked = execute(conn, cursor, lock_sql, [*keys, *guard_values], fetch=True)
            if not locked:
                return []
            if value_cols:
                params = [*flat(data, names), *const_values, *guard_values]
            else:
                params = [*const_values, *keys, *guard_values]
            execute(conn, cursor, write_sql, params, fetch=False)
        finally:
            cursor.close()
        # the locking read selects the key columns only: a row is the key (a tuple, composite)
        found = list(map(tuple if target.composite else itemgetter(0), locked))
        return positions(target, data, found)

    return ColumnarPlan(write, batch_bytes=batch_bytes(target.table, names), budget=budget)


def only_unique_key(table: sa.Table, names: Sequence[str]) -> bool:
    """Is ``names`` the table's primary key and its only unique key? (Then ``ON DUPLICATE KEY
    UPDATE`` acts on a conflict of that key only, as ``ON CONFLICT (names)`` does.)"""
    if {c.name for c in table.primary_key.columns} != set(names):
        return False
    if any(i.unique for i in table.indexes):
        return False
    return not any(isinstance(u, sa.UniqueConstraint) for u in table.constraints)


def upsert_plan(
    conn: Connection,
    target: Target,
    columns: Sequence[str],
    conflict_cols: Sequence[str],
    update_cols: Sequence[str],
    budget: int,
) -> ColumnarPlan | None:
    """The locking read (with "does an update column differ") and one ``INSERT ... ON DUPLICATE
    KEY UPDATE`` of the rows missing or differing (see the module docstring)."""
    table = target.table
    if not only_unique_key(table, conflict_cols) or not plain(conn, table, columns):
        return None
    by_conflict = Target(table, tuple(conflict_cols))
    sql = Sql(conn, by_conflict)
    alias = "keyset_rows"
    compared = [*conflict_cols, *update_cols]
    differs = " OR ".join(
        f"NOT ({_binary(table, n, f'{sql.table}.{sql.q(n)}')} <=> "
        f"{_binary(table, n, f'{alias}.{sql.q(n)}')})"
        for n in update_cols
    )
    cols_sql = ", ".join(sql.q(c) for c in columns)
    if update_cols:
        on_dup = ", ".join(f"{sql.q(c)} = VALUES({sql.q(c)})" for c in update_cols)
    else:
        on_dup = f"{sql.q(conflict_cols[0])} = {sql.q(conflict_cols[0])}"
    one_row = f"({', '.join(['%s'] * len(columns))})"
    shape = (table, tuple(conflict_cols), tuple(update_cols), tuple(columns), "upsert")
    nkey = len(conflict_cols)

    def lock_text(n: int) -> str:
        if not update_cols:
            return f"SELECT {', '.join(sql.keys)} FROM {sql.table} WHERE {sql.key_in(n)} FOR UPDATE"
        return (
            f"SELECT {', '.join(sql.keys)}, {differs} FROM {sql.table} JOIN "
            f"({sql.derived(compared, n)}) AS {alias} ON {sql.join_on(alias, conflict_cols)} "
            "FOR UPDATE"
        )

    def insert_text(n: int) -> str:
        return (
            f"INSERT INTO {sql.table} ({cols_sql}) VALUES {', '.join([one_row] * n)} "
            f"ON DUPLICATE KEY UPDATE {on_dup}"
        )

    def write(conn: Connection, data: dict[str, list], n: int) -> list[int]:
        lock_sql = _TEXTS.get((*shape, "lock", n), lambda: lock_text(n))
        cursor = cursor_of(conn)
        try:
            params = flat(data, compared) if update_cols else key_values(data, by_conflict)
            found = execute(conn, cursor, lock_sql, params, fetch=True)
            keys = (
                (tuple(r[:nkey]) for r in found) if by_conflict.composite else (r[0] for r in found)
            )
            existing = positions(by_conflict, data, keys)
            same = {
                p
                for p, r in zip(existing, found, strict=True)
                if not (r[nkey] if update_cols else 0)
            }
            todo = [i for i in range(n) if i not in same]
            if todo:
                m = len(todo)
                rows = data if m == n else {c: [data[c][i] for i in todo] for c in columns}
                insert_sql = _TEXTS.get((*shape, "insert", m), lambda: insert_text(m))
                execute(conn, cursor, insert_sql, flat(rows, columns), fetch=False)
        finally:
            cursor.close()
        return todo

    return ColumnarPlan(write, batch_bytes=batch_bytes(table, columns), budget=budget)


def _binary(table: sa.Table, name: str, expr: str) -> str:
    """Strings compared byte for byte (a ``_ci`` collation and PAD SPACE call 'a' = 'A ')."""
    return f"CAST({expr} AS BINARY)" if isinstance(table.c[name].type, sa.String) else expr
