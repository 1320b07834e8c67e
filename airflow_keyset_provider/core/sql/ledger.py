"""The ledger table on the target database: one row per range, the range's position as the
target database saw it committed (``exactly_once``; ``core/run/ledger.py`` drives it).

A row is ``(stream, round_id, range_id)`` -> ``epoch`` (the ledger's generation of owners, bumped
by every claim), ``cursor`` (the last key whose chunk's writes committed), ``done``/``skipped`` (the
range's counters at that commit) and ``failed`` (JSON list of ``[key, reason]``: the items that
failed with the range's committed chunks, sparse). Nothing is written per row of data.

Every statement is SQLAlchemy Core with bound values and quoted identifiers; the only thing a
database needs of its own is ``limit_statement_time`` (how a statement's wait is bounded). The
row is created with a plain INSERT inside a SAVEPOINT (a concurrent creator's IntegrityError is
rolled back to it), so no dialect's upsert is needed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

#: The ledger table's default name (``KeysetTraversal(ledger_table=...)`` overrides it).
LEDGER_TABLE = "keyset_ledger"


@dataclass(frozen=True)
class LedgerRow:
    """One range's committed position on the target."""

    epoch: int
    cursor: str
    done: int
    skipped: int
    failed: list[tuple[str, str]]


def ledger_table(name: str = LEDGER_TABLE, schema: str | None = None) -> sa.Table:
    """The ledger's ``Table`` (its own ``MetaData``)."""
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("stream", sa.String(200), primary_key=True),
        sa.Column("round_id", sa.String(200), primary_key=True),
        sa.Column("range_id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("cursor", sa.Text, nullable=False),
        sa.Column("done", sa.BigInteger, nullable=False),
        sa.Column("skipped", sa.BigInteger, nullable=False),
        sa.Column("failed", sa.Text, nullable=False),
        schema=schema,
    )


def create_ledger(engine: sa.Engine, table: sa.Table) -> None:
    """``CREATE TABLE`` unless it exists (``checkfirst``); a concurrent creator winning the race
    is fine (the table is there either way)."""
    try:
        with engine.begin() as conn:
            table.create(conn, checkfirst=True)
    except sa.exc.DBAPIError:
        if not sa.inspect(engine).has_table(table.name, schema=table.schema):
            raise


def limit_statement_time(conn: sa.Connection, ms: int) -> None:
    """Bound every following statement of this transaction (PostgreSQL: ``SET LOCAL
    statement_timeout``; SQLite: the busy timeout, the wait for the database's write lock;
    MySQL/MariaDB: the InnoDB lock wait, in whole seconds)."""
    name = conn.dialect.name
    if name == "postgresql":
        conn.exec_driver_sql(f"SET LOCAL statement_timeout = {int(ms)}")
    elif name == "sqlite":
        conn.exec_driver_sql(f"PRAGMA busy_timeout = {int(ms)}")
    elif name in ("mysql", "mariadb"):
        conn.exec_driver_sql(
            f"SET SESSION innodb_lock_wait_timeout = {max(1, math.ceil(ms / 1000))}"
        )


def _where(table: sa.Table, stream: str, round_id: str, range_id: int) -> Any:
    c = table.c
    return sa.and_(c.stream == stream, c.round_id == round_id, c.range_id == range_id)


def bump_epoch(
    conn: sa.Connection,
    table: sa.Table,
    stream: str,
    round_id: str,
    range_id: int,
    cursor: str,
    counters: tuple[int, int],
) -> LedgerRow:
    """At a claim: add one to the row's epoch (creating the row at ``cursor`` with ``counters``
    and epoch 1 when there is none) and return it. The epoch is the ledger's own generation of
    owners, not Redis's: a round restored from the checkpoint mirror may hand out claim epochs
    again from an older value, the ledger's never goes back. Waits for (then sees) an older
    owner's commit that holds the row's lock."""
    where = _where(table, stream, round_id, range_id)
    bump = sa.update(table).where(where).values(epoch=table.c.epoch + 1)
    if conn.execute(bump).rowcount == 0:
        values = dict(stream=stream, round_id=round_id, range_id=range_id, epoch=1)
        values.update(cursor=cursor, done=counters[0], skipped=counters[1], failed="[]")
        try:
            with conn.begin_nested():
                conn.execute(sa.insert(table).values(**values))
        except sa.exc.IntegrityError:  # created concurrently: bump that row
            conn.execute(bump)
    row = read_row(conn, table, stream, round_id, range_id)
    assert row is not None
    return row


def read_row(
    conn: sa.Connection, table: sa.Table, stream: str, round_id: str, range_id: int
) -> LedgerRow | None:
    c = table.c
    query = sa.select(c.epoch, c.cursor, c.done, c.skipped, c.failed).where(
        _where(table, stream, round_id, range_id)
    )
    row = conn.execute(query).first()
    if row is None:
        return None
    failed = [(str(k), str(r)) for k, r in json.loads(row.failed)]
    return LedgerRow(int(row.epoch), row.cursor, int(row.done), int(row.skipped), failed)


def move_row(
    conn: sa.Connection,
    table: sa.Table,
    key: tuple[str, str, int],
    epoch: int,
    expected: str,
    new: str,
    counters: tuple[int, int],
    failed: list[tuple[str, str]] | None = None,
) -> bool:
    """The fenced step of a commit: move the row from ``expected`` to ``new`` with the range's
    counters (and its failed items, when they changed), only if no newer owner raised its epoch
    and the cursor is still where this owner left it. False: fenced (nothing changed).
    Either condition alone keeps a stale owner's transaction out (the cursor only moves
    forward); the epoch also fails an owner whose successor claimed but committed nothing yet."""
    values: dict[str, Any] = {"cursor": new, "done": counters[0], "skipped": counters[1]}
    if failed is not None:
        values["failed"] = json.dumps(failed)
    step = (
        sa.update(table)
        .where(_where(table, *key), table.c.epoch == epoch, table.c.cursor == expected)
        .values(**values)
    )
    return bool(conn.execute(step).rowcount == 1)


def touch_row(conn: sa.Connection, table: sa.Table, key: tuple[str, str, int], epoch: int) -> bool:
    """A no-op update of the row under the epoch fence. On SQLite this is the transaction's
    first write, so the driver begins the transaction before any SAVEPOINT (whose release would
    otherwise commit); everywhere it fails early when a newer owner claimed the range."""
    c = table.c
    step = sa.update(table).where(_where(table, *key), c.epoch == epoch).values(epoch=c.epoch)
    return bool(conn.execute(step).rowcount == 1)


__all__ = [
    "LEDGER_TABLE",
    "LedgerRow",
    "bump_epoch",
    "create_ledger",
    "ledger_table",
    "limit_statement_time",
    "move_row",
    "read_row",
    "touch_row",
]
