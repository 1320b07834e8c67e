"""The ledger tables on the target database (``exactly_once``; ``core/run/ledger.py`` drives
them): the key intervals of a round whose chunks' writes committed, keyed by the round and never
by a range's id (ranges change identity: splits, pull coalescing, restores from the mirror,
failover to a replica; a key interval does not).

``keyset_ledger`` holds, per ``(stream, round_id)``:

- the round's head (``seg = 0``): ``epoch`` is the round's generation of claims (bumped by every
  claim's ledger step, never going back), ``hi`` the ``created_ms`` of the round it belongs to
  (a round id handed out again after Redis lost the stream starts with an empty ledger:
  ``adopt_round``), and its row is the lock that serializes the ledger steps of the round (a
  claim, and the last statement of a commit);
- its committed intervals (``seg >= 1``): ``(lo, hi]`` (encoded keys) whose writes committed,
  disjoint; ``epoch`` the generation of the claim that owns it (a claim takes every interval
  that overlaps its keys or ends at its cursor, so an older owner's step is fenced); ``done`` /
  ``skipped`` the range's counters at ``hi`` and ``base_done`` / ``base_skipped`` at ``lo``, as
  the owner's Redis range counted them (so ``done - base_done`` rows were done in it);
  ``range_id`` says which range opened it (for a person; nothing keys on it).

``keyset_ledger_failed`` holds the items that failed in committed chunks, one row each, written
at the commit; ``resolved`` is NULL while the item waits for its retry, and becomes ``'d'``
(done) or ``'s'`` (skipped) in the transaction of the retry call that delivered it (its writes
commit with it). A claim that skips an interval hands its unresolved items to Redis's retry set;
a retry pass delivers an item only while its row is unresolved (``resolved_items``,
``resolve_items``).

Growth: one interval per claim that commits, plus one per committed interval a claim skips (a
claim extends the interval it resumes instead of opening one), and one row per failed item:
ranges and failures, never rows of data. Comparisons of keys are made in Python (the engine's
order of encoded keys), never by the database's collation; on MySQL/MariaDB every identifier
and key column is ``utf8mb4_bin`` (the default collation would make ``'Orders'`` and
``'orders'`` one stream, ``'a'`` and ``'A'`` one key). Every statement is SQLAlchemy Core with
bound values and quoted identifiers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from ..errors import ConfigurationError

#: The ledger table's default name (``KeysetTraversal(ledger_table=...)`` overrides it); the
#: failed items go to the same name with ``_failed`` appended.
LEDGER_TABLE = "keyset_ledger"
HEAD = 0  # the ``seg`` of a round's head row


@dataclass(frozen=True)
class Interval:
    """One committed key interval ``(lo, hi]`` of a round."""

    seg: int
    range_id: int
    lo: str
    hi: str
    epoch: int
    base_done: int
    base_skipped: int
    done: int
    skipped: int

    @property
    def empty(self) -> bool:
        return self.lo == self.hi


@dataclass(frozen=True)
class LedgerTables:
    intervals: sa.Table
    failed: sa.Table


def _ident(n: int) -> Any:
    return sa.String(n).with_variant(
        mysql.VARCHAR(n, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
    )


def _text() -> Any:
    return sa.Text().with_variant(
        mysql.LONGTEXT(charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
    )


def ledger_table(name: str = LEDGER_TABLE, schema: str | None = None) -> LedgerTables:
    """The ledger's two ``Table``s (their own ``MetaData``)."""
    meta = sa.MetaData()
    intervals = sa.Table(
        name,
        meta,
        sa.Column("stream", _ident(200), primary_key=True),
        sa.Column("round_id", _ident(200), primary_key=True),
        sa.Column("seg", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("range_id", sa.Integer, nullable=False),
        sa.Column("lo", _text(), nullable=False),
        sa.Column("hi", _text(), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("base_done", sa.BigInteger, nullable=False),
        sa.Column("base_skipped", sa.BigInteger, nullable=False),
        sa.Column("done", sa.BigInteger, nullable=False),
        sa.Column("skipped", sa.BigInteger, nullable=False),
        schema=schema,
    )
    failed = sa.Table(
        f"{name}_failed",
        meta,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("stream", _ident(200), nullable=False),
        sa.Column("round_id", _ident(200), nullable=False),
        sa.Column("item", _text(), nullable=False),
        sa.Column("reason", _text(), nullable=False),
        sa.Column("resolved", sa.String(1), nullable=True),
        sa.Index(f"{name}_failed_round", "stream", "round_id"),
        schema=schema,
    )
    return LedgerTables(intervals, failed)


def create_ledger(engine: sa.Engine, tables: LedgerTables) -> None:
    """``CREATE TABLE`` unless they exist (``checkfirst``); a concurrent creator winning the race
    is fine. A table of the earlier layout (one row per range id) is refused, naming the fix; a
    failed-items table without ``resolved`` (before retry passes were recorded) gains it."""
    try:
        with engine.begin() as conn:
            tables.intervals.metadata.create_all(conn, checkfirst=True)
    except sa.exc.DBAPIError:
        inspector = sa.inspect(engine)
        t = tables.intervals
        if not all(inspector.has_table(x.name, schema=x.schema) for x in (t, tables.failed)):
            raise
    columns = {
        c["name"]
        for c in sa.inspect(engine).get_columns(
            tables.intervals.name, schema=tables.intervals.schema
        )
    }
    if "seg" not in columns:
        name = tables.intervals.name
        raise ConfigurationError(
            f"the ledger table {name} on the target has the earlier layout (one row per range "
            "id, which a split, a coalescing, a restore or a failover could bypass). Let the "
            f"rounds that used it finish, then DROP TABLE {name} (it is created again in the "
            "interval layout), or pass ledger_table='<new name>' to KeysetTraversal"
        )
    _add_resolved(engine, tables.failed)


def _add_resolved(engine: sa.Engine, failed: sa.Table) -> None:
    """``ALTER TABLE ... ADD COLUMN resolved`` on a failed-items table created before the column
    existed (every row then unresolved: NULL); a concurrent creator winning the race is fine."""
    columns = {c["name"] for c in sa.inspect(engine).get_columns(failed.name, schema=failed.schema)}
    if "resolved" in columns:
        return
    try:
        with engine.begin() as conn:
            table = conn.dialect.identifier_preparer.format_table(failed)
            column = sa.schema.CreateColumn(failed.c.resolved).compile(dialect=conn.dialect)
            conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {column}")
    except sa.exc.DBAPIError:
        inspector = sa.inspect(engine)
        columns = {c["name"] for c in inspector.get_columns(failed.name, schema=failed.schema)}
        if "resolved" not in columns:
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


def _round(t: sa.Table, stream: str, round_id: str) -> Any:
    return sa.and_(t.c.stream == stream, t.c.round_id == round_id)


def lock_round(conn: sa.Connection, t: sa.Table, stream: str, round_id: str, bump: bool) -> int:
    """Lock the round's head row (creating it, generation 0, when there is none) and return its
    generation after adding one to it when ``bump`` (a claim; a commit only locks it: 0).
    Held until the transaction ends: the ledger steps of a round are serialized by it."""
    where = sa.and_(_round(t, stream, round_id), t.c.seg == HEAD)
    step = sa.update(t).where(where).values(epoch=t.c.epoch + (1 if bump else 0))
    if conn.execute(step).rowcount == 0:
        values = dict(stream=stream, round_id=round_id, seg=HEAD, range_id=-1, lo="", hi="")
        values.update(epoch=1 if bump else 0, base_done=0, base_skipped=0, done=0, skipped=0)
        try:
            with conn.begin_nested():
                conn.execute(sa.insert(t).values(**values))
        except sa.exc.IntegrityError:  # created concurrently: lock that row
            conn.execute(step)
    if not bump:
        return 0
    return int(conn.execute(sa.select(t.c.epoch).where(where)).scalar_one())


def adopt_round(
    conn: sa.Connection, tables: LedgerTables, key: tuple[str, str], planned: str
) -> str:
    """Bind the round's ledger to the round planned at ``planned`` (its ``created_ms`` in Redis,
    kept in the head row's ``hi``; call it with the head locked). A round id can be handed out
    again (Redis lost the stream, or failed over to a lagging replica, without a mirror): the
    ledger of the earlier round of that id is not this round's. Returns ``"same"`` (or no
    ``planned`` to compare), ``"adopted"`` (a head with none yet: a new round, or one from
    before this field), ``"dropped"`` (an earlier round's intervals and failed items were
    removed: its stale owners' commits find no interval of theirs, fenced), or ``"older"``
    (this claim's Redis holds an earlier round of the id than the one the ledger belongs to: a
    stale Redis; nothing is changed and the claim must not go on)."""
    t, failed = tables.intervals, tables.failed
    head = sa.and_(_round(t, *key), t.c.seg == HEAD)
    known = conn.execute(sa.select(t.c.hi).where(head)).scalar() or ""
    if not planned or known == planned:
        return "same"
    if known and _ms(planned) < _ms(known):
        return "older"
    if known:
        conn.execute(sa.delete(t).where(_round(t, *key), t.c.seg != HEAD))
        conn.execute(sa.delete(failed).where(_round(failed, *key)))
    conn.execute(sa.update(t).where(head).values(hi=planned))
    return "dropped" if known else "adopted"


def _ms(value: str) -> int:
    return int(value) if value.isdigit() else 0


def read_intervals(conn: sa.Connection, t: sa.Table, stream: str, round_id: str) -> list[Interval]:
    """The round's committed intervals, in key order (locking reads: the latest committed
    versions, also under InnoDB's REPEATABLE READ)."""
    c = t.c
    query = (
        sa.select(
            c.seg, c.range_id, c.lo, c.hi, c.epoch, c.base_done, c.base_skipped, c.done, c.skipped
        )
        .where(_round(t, stream, round_id), c.seg != HEAD)
        .with_for_update()
    )
    rows = [
        Interval(int(r[0]), int(r[1]), str(r[2]), str(r[3]), *(int(v) for v in r[4:]))
        for r in conn.execute(query)
    ]
    return sorted(rows, key=lambda r: (r.lo, r.hi))


def take_intervals(
    conn: sa.Connection, t: sa.Table, segs: list[int], key: tuple[str, str], epoch: int
) -> None:
    """A claim's step: the intervals ``segs`` now belong to generation ``epoch``."""
    if segs:
        where = sa.and_(_round(t, *key), t.c.seg.in_(segs))
        conn.execute(sa.update(t).where(where).values(epoch=epoch))


def extend_interval(
    conn: sa.Connection,
    t: sa.Table,
    key: tuple[str, str],
    seg: int,
    epoch: int,
    expected: str,
    new: str,
    counters: tuple[int, int],
) -> bool:
    """A commit's step: interval ``seg`` grows from ``expected`` to ``new`` with the range's
    counters, only under generation ``epoch``. False: fenced (nothing changed)."""
    c = t.c
    where = sa.and_(_round(t, *key), c.seg == seg, c.epoch == epoch, c.hi == expected)
    step = sa.update(t).where(where).values(hi=new, done=counters[0], skipped=counters[1])
    return bool(conn.execute(step).rowcount == 1)


def open_interval(
    conn: sa.Connection,
    t: sa.Table,
    key: tuple[str, str],
    seg: int,
    range_id: int,
    epoch: int,
    lo: str,
    hi: str,
    base: tuple[int, int],
    counters: tuple[int, int],
) -> None:
    """A new interval ``(lo, hi]`` (``seg``: one above the round's highest, under its lock)."""
    values = dict(stream=key[0], round_id=key[1], seg=seg, range_id=range_id, lo=lo, hi=hi)
    values.update(epoch=epoch, base_done=base[0], base_skipped=base[1])
    values.update(done=counters[0], skipped=counters[1])
    conn.execute(sa.insert(t).values(**values))


def add_failed(
    conn: sa.Connection, t: sa.Table, key: tuple[str, str], failed: list[tuple[str, str]]
) -> None:
    """The items that failed in a committed chunk (written once, in its transaction)."""
    if failed:
        rows = [dict(stream=key[0], round_id=key[1], item=k, reason=r) for k, r in failed]
        conn.execute(sa.insert(t), rows)


def read_failed(
    conn: sa.Connection, t: sa.Table, key: tuple[str, str], lo: str, hi: str
) -> list[tuple[str, str, str | None]]:
    """The failed items of the round with keys in ``(lo, hi]`` (compared in Python): ``(item,
    reason, resolved)``, ``resolved`` None while the item waits for retry (locking reads: the
    latest committed versions, also under InnoDB's REPEATABLE READ)."""
    query = (
        sa.select(t.c.item, t.c.reason, t.c.resolved)
        .where(_round(t, *key))
        .order_by(t.c.id)
        .with_for_update()
    )
    return [
        (str(k), str(r), None if v is None else str(v))
        for k, r, v in conn.execute(query)
        if lo < k <= hi
    ]


def resolved_items(
    conn: sa.Connection, t: sa.Table, key: tuple[str, str], items: list[str], lock: bool
) -> dict[str, str | None]:
    """The rows of ``items`` (encoded keys): item -> its resolution (``'d'``, ``'s'``; None while
    it waits for retry). An item with no row is absent (it failed in no committed chunk of the
    mode: a round traversed before without ``exactly_once``). ``lock``: a locking read, held
    until the transaction ends (the latest committed versions, also under InnoDB's REPEATABLE
    READ)."""
    if not items:
        return {}
    query = sa.select(t.c.item, t.c.resolved).where(_round(t, *key), t.c.item.in_(items))
    if lock:
        query = query.with_for_update()
    out: dict[str, str | None] = {}
    for item, resolved in conn.execute(query):
        if out.get(str(item)) is None:  # a row resolved wins over a duplicate that is not
            out[str(item)] = None if resolved is None else str(resolved)
    return out


def resolve_items(
    conn: sa.Connection, t: sa.Table, key: tuple[str, str], outcomes: dict[str, str]
) -> None:
    """A retry call's items reached their terminal state (``'d'``, ``'s'``) in this transaction."""
    for state in sorted(set(outcomes.values())):
        items = [k for k, v in outcomes.items() if v == state]
        where = sa.and_(_round(t, *key), t.c.item.in_(items), t.c.resolved.is_(None))
        conn.execute(sa.update(t).where(where).values(resolved=state))


__all__ = [
    "HEAD",
    "LEDGER_TABLE",
    "Interval",
    "LedgerTables",
    "add_failed",
    "create_ledger",
    "extend_interval",
    "ledger_table",
    "limit_statement_time",
    "lock_round",
    "open_interval",
    "read_failed",
    "read_intervals",
    "resolve_items",
    "resolved_items",
    "take_intervals",
]
