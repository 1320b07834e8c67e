"""Batch write-back helpers, against real PostgreSQL (psycopg2 and psycopg 3) and real SQLite.

Each test states one guarantee of ``airflow_keyset_provider.core.writeback``: every input key
ends up in exactly one of applied / not_applied / failed, a batch is one statement, a bad row
fails alone, the caller's transaction decides what is kept, and identifiers and values are
never spliced into SQL.
"""

from __future__ import annotations

import datetime as dt
import sqlite3
import uuid
from collections.abc import Iterator
from decimal import Decimal

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.dialects import postgresql

from airflow_keyset_provider.core.chunk import ChunkResult
from airflow_keyset_provider.core.errors import ConfigurationError, KeyValidationError
from airflow_keyset_provider.core.writeback import (
    WriteOutcome,
    claim_skip_locked,
    clear_table_cache,
    guarded_update,
    update_rows,
    upsert,
)

PG_DRIVERS = ["postgresql+psycopg2", "postgresql+psycopg"]
ALL_DATABASES = [*PG_DRIVERS, "sqlite"]
EVIL = "x'); DROP TABLE t; --"


# --------------------------------------------------------------------------- fixtures


def _engine_for(request: pytest.FixtureRequest, database: str) -> Iterator[sa.Engine]:
    if database == "sqlite":
        engine = sa.create_engine(request.getfixturevalue("sqlite_url"))
    else:
        pg_engine: sa.Engine = request.getfixturevalue("pg_engine")
        # same private schema (search_path travels in the URL's libpq options), chosen driver
        engine = sa.create_engine(pg_engine.url.set(drivername=database))
    try:
        yield engine
    finally:
        engine.dispose()  # before conftest drops the schema


@pytest.fixture(params=ALL_DATABASES)
def engine(request: pytest.FixtureRequest) -> Iterator[sa.Engine]:
    yield from _engine_for(request, request.param)


@pytest.fixture(params=PG_DRIVERS)
def pg(request: pytest.FixtureRequest) -> Iterator[sa.Engine]:
    yield from _engine_for(request, request.param)


def _orders(metadata: sa.MetaData) -> sa.Table:
    return sa.Table(
        "orders",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("qty", sa.Integer, sa.CheckConstraint("qty >= 0", name="qty_not_negative")),
        sa.Column("note", sa.Text),
    )


def _lines(metadata: sa.MetaData) -> sa.Table:
    return sa.Table(
        "order_lines",
        metadata,
        sa.Column("order_id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("line", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("qty", sa.Integer, sa.CheckConstraint("qty >= 0", name="line_qty_not_negative")),
        sa.Column("note", sa.Text),
    )


def make_orders(engine: sa.Engine) -> sa.Table:
    """``orders`` with ids 1..10, all PENDING, qty = id."""
    table = _orders(sa.MetaData())
    table.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(
            table.insert(), [{"id": i, "status": "PENDING", "qty": i} for i in range(1, 11)]
        )
    return table


def make_lines(engine: sa.Engine) -> sa.Table:
    """``order_lines`` keyed by (order_id, line): orders 1..3 x lines 1..3, PENDING, qty 1."""
    table = _lines(sa.MetaData())
    table.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(
            table.insert(),
            [
                {"order_id": o, "line": n, "status": "PENDING", "qty": 1}
                for o in (1, 2, 3)
                for n in (1, 2, 3)
            ],
        )
    return table


@pytest.fixture
def orders(engine: sa.Engine) -> sa.Table:
    return make_orders(engine)


@pytest.fixture
def lines(engine: sa.Engine) -> sa.Table:
    return make_lines(engine)


def _state(engine: sa.Engine, table: sa.Table, *columns: str) -> dict:
    key = [c for c in table.primary_key.columns]
    with engine.connect() as conn:
        rows = conn.execute(sa.select(*key, *(table.c[c] for c in columns))).all()
    width = len(key)
    return {
        (r[0] if width == 1 else tuple(r[:width])): (r[width] if len(columns) == 1 else r[width:])
        for r in rows
    }


def _count_statements(engine: sa.Engine, verb: str) -> list[str]:
    """Collect the SQL text of every statement starting with ``verb`` sent to ``engine``."""
    seen: list[str] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def _record(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith(verb):
            seen.append(statement)

    return seen


def _assert_partition(outcome: WriteOutcome, keys: list) -> None:
    together = [*outcome.applied, *outcome.not_applied, *outcome.failed]
    assert sorted(together) == sorted(keys), "every key in exactly one field"


# --------------------------------------------------------------------------- guarded_update


def test_guarded_update_reports_rows_that_lost_the_race_as_not_applied(engine, orders):
    # another writer moved orders 2 and 5 on before our batch arrives
    with engine.begin() as conn:
        conn.execute(orders.update().where(orders.c.id.in_([2, 5])).values(status="PAID"))

    keys = [1, 2, 3, 4, 5, 6, 99]
    with engine.begin() as conn:
        outcome = guarded_update(
            conn, "orders", "id", keys, {"status": "CANCELLED"}, {"status": "PENDING"}
        )

    assert outcome == WriteOutcome(applied=[1, 3, 4, 6], not_applied=[2, 5, 99], failed={})
    assert _state(engine, orders, "status") == {
        1: "CANCELLED", 2: "PAID", 3: "CANCELLED", 4: "CANCELLED", 5: "PAID", 6: "CANCELLED",
        7: "PENDING", 8: "PENDING", 9: "PENDING", 10: "PENDING",
    }  # fmt: skip
    assert outcome.to_chunk_result() == ChunkResult(failed={}, skipped=[2, 5, 99])


def test_guarded_update_is_idempotent_once_the_guard_no_longer_matches(engine, orders):
    with engine.begin() as conn:
        first = guarded_update(
            conn, orders, "id", [3, 4], {"status": "CANCELLED"}, {"status": "PENDING"}
        )
        second = guarded_update(
            conn, orders, "id", [3, 4], {"status": "CANCELLED"}, {"status": "PENDING"}
        )
    assert first.applied == [3, 4]
    assert second == WriteOutcome(applied=[], not_applied=[3, 4], failed={})


def test_guarded_update_composite_key(engine, lines):
    with engine.begin() as conn:
        conn.execute(
            lines.update()
            .where(sa.tuple_(lines.c.order_id, lines.c.line) == sa.tuple_(2, 2))
            .values(status="SHIPPED")
        )
    keys = [(1, 1), (2, 2), (2, 3), (3, 1), (9, 9)]
    with engine.begin() as conn:
        outcome = guarded_update(
            conn,
            "order_lines",
            ["order_id", "line"],
            keys,
            {"status": "CANCELLED"},
            {"status": "PENDING"},
            batch_size=2,
        )
    assert outcome.applied == [(1, 1), (2, 3), (3, 1)]
    assert outcome.not_applied == [(2, 2), (9, 9)]
    state = _state(engine, lines, "status")
    assert state[(2, 2)] == "SHIPPED"
    assert [k for k, v in state.items() if v == "CANCELLED"] == [(1, 1), (2, 3), (3, 1)]


def test_guarded_update_is_one_statement_per_batch(engine, orders):
    updates = _count_statements(engine, "UPDATE")
    with engine.begin() as conn:
        outcome = guarded_update(conn, orders, "id", range(1, 11), {"note": "seen"}, batch_size=4)
    assert outcome.applied == list(range(1, 11))
    assert len(updates) == 3  # 4 + 4 + 2 keys
    if engine.dialect.name == "postgresql":
        # the keys travel as one array parameter, whatever the batch size
        assert all("unnest" in sql for sql in updates)


def test_guarded_update_with_an_engine_commits_its_own_transaction(engine, orders):
    outcome = guarded_update(engine, "orders", "id", [7], {"status": "DONE"})
    assert outcome.applied == [7]
    assert _state(engine, orders, "status")[7] == "DONE"


def test_guard_none_means_is_null_and_values_may_be_sql_expressions(engine, orders):
    with engine.begin() as conn:
        conn.execute(orders.update().where(orders.c.id == 2).values(note="taken"))
        outcome = guarded_update(
            conn, orders, "id", [1, 2], {"note": sa.literal("a") + sa.literal("b")}, {"note": None}
        )
    assert (outcome.applied, outcome.not_applied) == ([1], [2])
    assert _state(engine, orders, "note")[1] == "ab"


# --------------------------------------------------------------------------- update_rows


def test_update_rows_writes_a_value_per_row_in_several_batches(engine, orders):
    updates = _count_statements(engine, "UPDATE")
    rows = [{"id": i, "qty": i * 100, "note": f"reason {i}"} for i in (1, 2, 3, 4, 5, 6, 7, 42)]
    with engine.begin() as conn:
        outcome = update_rows(conn, "orders", "id", rows, batch_size=3)

    assert outcome == WriteOutcome(applied=[1, 2, 3, 4, 5, 6, 7], not_applied=[42], failed={})
    assert len(updates) == 3  # 3 + 3 + 2 rows, one statement each
    state = _state(engine, orders, "qty", "note")
    for i in range(1, 8):
        assert tuple(state[i]) == (i * 100, f"reason {i}")
    assert tuple(state[8]) == (8, None)  # untouched


def test_update_rows_composite_key(engine, lines):
    rows = [
        {"order_id": 1, "line": 2, "note": "a", "qty": 5},
        {"order_id": 3, "line": 3, "note": "b", "qty": 6},
        {"order_id": 4, "line": 1, "note": "c", "qty": 7},
    ]
    with engine.begin() as conn:
        outcome = update_rows(conn, lines, ("order_id", "line"), rows, batch_size=2)
    assert outcome.applied == [(1, 2), (3, 3)]
    assert outcome.not_applied == [(4, 1)]
    state = _state(engine, lines, "note", "qty")
    assert tuple(state[(1, 2)]) == ("a", 5)
    assert tuple(state[(3, 3)]) == ("b", 6)
    assert tuple(state[(1, 1)]) == (None, 1)


def test_update_rows_guard_skips_rows_changed_by_another_writer(engine, orders):
    with engine.begin() as conn:
        conn.execute(orders.update().where(orders.c.id == 2).values(status="PAID"))
    rows = [{"id": i, "status": "CANCELLED", "note": f"why {i}"} for i in (1, 2, 3)]
    with engine.begin() as conn:
        outcome = update_rows(conn, orders, "id", rows, expected={"status": "PENDING"})
    assert (outcome.applied, outcome.not_applied) == ([1, 3], [2])
    assert tuple(_state(engine, orders, "status", "note")[2]) == ("PAID", None)


def test_update_rows_leaves_columns_a_row_does_not_name(engine, orders):
    rows = [{"id": 1, "note": "only note"}, {"id": 2, "qty": 0}, {"id": 3, "note": None}]
    with engine.begin() as conn:
        conn.execute(orders.update().values(note="old"))
        outcome = update_rows(conn, orders, "id", rows)
    assert outcome.applied == [1, 2, 3]
    state = _state(engine, orders, "qty", "note")
    assert tuple(state[1]) == (1, "only note")
    assert tuple(state[2]) == (0, "old")
    assert tuple(state[3]) == (3, None)


def test_update_rows_splits_batches_under_the_driver_parameter_limit(sqlite_url):
    engine = sa.create_engine(sqlite_url)

    @sa.event.listens_for(engine, "connect")
    def _small_limit(dbapi_conn, record):
        dbapi_conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 20)

    try:
        table = _orders(sa.MetaData())
        table.metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(table.insert(), [{"id": i, "status": "P", "qty": 0} for i in range(15)])
        updates = _count_statements(engine, "UPDATE")
        with engine.begin() as conn:
            # 1 value column: the key is bound in the CASE and in the IN list -> 3 per row
            outcome = update_rows(conn, table, "id", [{"id": i, "qty": i} for i in range(15)])
        assert outcome.applied == list(range(15))
        assert len(updates) == 3  # at most 6 rows (18 parameters) per statement
        assert _state(engine, table, "qty") == {i: i for i in range(15)}
    finally:
        engine.dispose()


# --------------------------------------------------------------------------- upsert


def test_upsert_do_nothing_twice_is_idempotent(engine, orders):
    rows = [{"id": i, "status": "NEW", "qty": 0} for i in (9, 10, 11, 12)]
    with engine.begin() as conn:
        first = upsert(conn, "orders", rows, conflict="id")
    with engine.begin() as conn:
        second = upsert(conn, "orders", rows, conflict="id")

    assert first == WriteOutcome(applied=[11, 12], not_applied=[9, 10], failed={})
    assert second == WriteOutcome(applied=[], not_applied=[9, 10, 11, 12], failed={})
    state = _state(engine, orders, "status")
    assert (state[9], state[10], state[11], state[12]) == ("PENDING", "PENDING", "NEW", "NEW")


def test_upsert_do_update_twice_is_idempotent(engine, orders):
    rows = [
        {"id": 1, "status": "PENDING", "qty": 1},  # already exactly so
        {"id": 2, "status": "PAID", "qty": 2},  # differs
        {"id": 20, "status": "NEW", "qty": 5},  # new
    ]
    with engine.begin() as conn:
        first = upsert(conn, orders, rows, conflict=["id"], update=["status", "qty"])
    with engine.begin() as conn:
        second = upsert(conn, orders, rows, conflict=["id"], update=["status", "qty"])
    assert (first.applied, first.not_applied) == ([2, 20], [1])
    assert (second.applied, second.not_applied) == ([], [1, 2, 20])
    state = _state(engine, orders, "status", "qty")
    assert tuple(state[2]) == ("PAID", 2)
    assert tuple(state[20]) == ("NEW", 5)


def test_upsert_composite_conflict_in_batches(engine, lines):
    rows = [
        {"order_id": o, "line": n, "status": "NEW", "qty": 2} for o in (3, 4) for n in (1, 2, 3)
    ]
    inserts = _count_statements(engine, "INSERT")
    with engine.begin() as conn:
        outcome = upsert(
            conn, lines, rows, conflict=("order_id", "line"), update=["qty"], batch_size=4
        )
    assert outcome.applied == [(3, 1), (3, 2), (3, 3), (4, 1), (4, 2), (4, 3)]
    assert len(inserts) == 2
    state = _state(engine, lines, "status", "qty")
    assert tuple(state[(3, 1)]) == ("PENDING", 2)  # existing: only qty updated
    assert tuple(state[(4, 3)]) == ("NEW", 2)


# --------------------------------------------------------------------------- partial failure


def _write_with_one_bad_row(conn: sa.Connection, writer: str, bad: bool = True) -> WriteOutcome:
    """Order 4 (upsert: new order 14) gets qty -1, which the CHECK constraint rejects; all
    others are fine. ``bad=False`` writes the same batch without the bad value."""
    worst = -1 if bad else 0
    if writer == "guarded_update":
        # one SET for the whole batch, which only row 4 violates
        qty = sa.case((sa.column("id") == 4, worst), else_=sa.column("qty"))
        return guarded_update(conn, "orders", "id", [2, 3, 4, 5], {"qty": qty})
    if writer == "update_rows":
        rows = [{"id": i, "qty": worst if i == 4 else i * 10} for i in (2, 3, 4, 5)]
        return update_rows(conn, "orders", "id", rows)
    rows = [{"id": i, "status": "NEW", "qty": worst if i == 14 else 1} for i in (12, 13, 14, 15)]
    return upsert(conn, "orders", rows, conflict="id")


@pytest.mark.parametrize("writer", ["guarded_update", "update_rows", "upsert"])
def test_a_check_violation_fails_only_its_own_key(engine, orders, writer):
    before = _state(engine, orders, "qty")
    with engine.begin() as conn:
        outcome = _write_with_one_bad_row(conn, writer)
        # the caller's transaction is still usable (on PostgreSQL the failure was contained)
        conn.execute(orders.update().where(orders.c.id == 1).values(note="after"))

    bad = 14 if writer == "upsert" else 4
    assert list(outcome.failed) == [bad]
    message = outcome.failed[bad]
    assert "qty_not_negative" in message or "CHECK constraint failed" in message
    assert "\n" not in message
    assert bad not in outcome.applied and bad not in outcome.not_applied
    assert len(outcome.applied) == 3
    assert outcome.to_chunk_result().failed == {bad: message}

    after = _state(engine, orders, "qty")
    assert after.get(bad) == before.get(bad)  # nothing of the failed row was written
    assert _state(engine, orders, "note")[1] == "after"


def test_without_isolation_the_database_error_is_raised(engine, orders):
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        update_rows(conn, orders, "id", [{"id": 1, "qty": -1}], isolate_failures=False)


@pytest.mark.parametrize("bad", [False, True], ids=["clean", "one-bad-row"])
@pytest.mark.parametrize("writer", ["guarded_update", "update_rows", "upsert"])
def test_the_caller_rollback_undoes_every_write(engine, orders, writer, bad):
    """The helpers never commit, not even through a savepoint: on a connection that has not
    written yet, pysqlite would make a first SAVEPOINT the outer transaction and commit on its
    RELEASE."""
    before = {c: _state(engine, orders, c) for c in ("status", "qty", "note")}
    with engine.connect() as conn:  # nothing written on this connection before the helper
        outcome = _write_with_one_bad_row(conn, writer, bad=bad)
        assert outcome.applied and bool(outcome.failed) == bad
        conn.rollback()
    assert {c: _state(engine, orders, c) for c in ("status", "qty", "note")} == before


# --------------------------------------------------------------------------- claim_skip_locked


def test_claim_skip_locked_gives_concurrent_transactions_disjoint_rows(pg):
    make_orders(pg)
    pending = {"status": "PENDING"}
    with pg.connect() as first, pg.connect() as second:
        first.begin()
        second.begin()
        # if the second claim waited for the first's locks, it would fail here, not hang
        second.exec_driver_sql("SET LOCAL lock_timeout = '2s'")

        held = claim_skip_locked(first, "orders", "id", pending, limit=3)
        got = claim_skip_locked(second, "orders", "id", pending, limit=3, columns=["id", "qty"])

        assert [r.id for r in held] == [1, 2, 3]
        assert [tuple(r) for r in got] == [(4, 4), (5, 5), (6, 6)]
        marked = guarded_update(first, "orders", "id", [r.id for r in held], {"status": "WORK"})
        assert marked.applied == [1, 2, 3]
        first.commit()
        second.rollback()

    with pg.begin() as third:  # the first's rows are taken, the second's were released
        again = claim_skip_locked(third, "orders", "id", pending, limit=3)
    assert [r.id for r in again] == [4, 5, 6]


def test_claim_on_sqlite_is_an_ordered_select(sqlite_url):
    engine = sa.create_engine(sqlite_url)
    try:
        table = _orders(sa.MetaData())
        table.metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(table.insert(), [{"id": i, "status": "P", "qty": i} for i in (5, 3, 9, 1)])
            rows = claim_skip_locked(conn, table, "id", table.c.qty > 1, limit=2)
        assert [r.id for r in rows] == [3, 5]
    finally:
        engine.dispose()


def test_claim_refuses_an_engine_because_its_locks_would_end_at_once(engine, orders):
    with pytest.raises(ConfigurationError, match="Connection"):
        claim_skip_locked(engine, orders, "id", None, limit=1)


# --------------------------------------------------------------------------- identifiers, values


def test_quoted_identifiers_and_hostile_values_are_stored_literally(engine):
    table = sa.Table(
        "Order Items",
        sa.MetaData(),
        sa.Column("Item ID", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("Status Code", sa.String(40), nullable=False),
        sa.Column("mixedCase", sa.Text),
    )
    table.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(table.insert(), [{"Item ID": i, "Status Code": "NEW"} for i in (1, 2, 3)])

    clear_table_cache()
    with engine.begin() as conn:  # by name: reflected with its case and spaces
        g = guarded_update(
            conn, "Order Items", "Item ID", [1], {"Status Code": EVIL}, {"Status Code": "NEW"}
        )
        u = update_rows(conn, "Order Items", ["Item ID"], [{"Item ID": 2, "mixedCase": EVIL}])
        i = upsert(
            conn,
            "Order Items",
            [{"Item ID": 4, "Status Code": EVIL, "mixedCase": EVIL}],
            conflict="Item ID",
            update=["mixedCase"],
        )
        claimed = claim_skip_locked(conn, "Order Items", "Item ID", {"Status Code": EVIL}, 5)
    assert (g.applied, u.applied, i.applied) == ([1], [2], [4])
    assert [r._mapping["Item ID"] for r in claimed] == [1, 4]

    state = _state(engine, table, "Status Code", "mixedCase")
    assert tuple(state[1]) == (EVIL, None)
    assert tuple(state[2]) == ("NEW", EVIL)
    assert tuple(state[4]) == (EVIL, EVIL)
    assert sa.inspect(engine).has_table("Order Items")


def test_typed_values_survive_the_round_trip(engine):
    table = sa.Table(
        "typed",
        sa.MetaData(),
        sa.Column("code", sa.String(10), primary_key=True),
        sa.Column("at", sa.DateTime(timezone=True)),
        sa.Column("day", sa.Date),
        sa.Column("amount", sa.Numeric(12, 2)),
        sa.Column("flag", sa.Boolean),
        sa.Column("doc", sa.JSON),
    )
    table.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(table.insert(), [{"code": c} for c in ("a", "b", "c")])
    at = dt.datetime(2024, 2, 29, 23, 59, 59, 123456, tzinfo=dt.UTC)
    rows = [
        {"code": "a", "at": at, "day": dt.date(2024, 1, 2), "amount": Decimal("12.34"),
         "flag": True, "doc": {"k": [1, "two"]}},
        {"code": "b", "at": None, "day": None, "amount": None, "flag": False, "doc": None},
    ]  # fmt: skip
    with engine.begin() as conn:
        outcome = update_rows(conn, table, "code", rows)
        upserted = upsert(conn, table, [{**rows[0], "code": "z"}], conflict="code")
    assert (outcome.applied, outcome.not_applied, upserted.applied) == (["a", "b"], [], ["z"])
    with engine.connect() as conn:
        got = {r.code: r for r in conn.execute(sa.select(table))}
    for code in ("a", "z"):
        stored_at = got[code].at if got[code].at.tzinfo else got[code].at.replace(tzinfo=dt.UTC)
        assert stored_at == at
        assert (got[code].day, got[code].amount, got[code].flag, got[code].doc) == (
            dt.date(2024, 1, 2), Decimal("12.34"), True, {"k": [1, "two"]}
        )  # fmt: skip
    assert (got["b"].at, got["b"].amount, got["b"].flag) == (None, None, False)


def test_uuid_and_timestamp_composite_key(engine):
    table = sa.Table(
        "events",
        sa.MetaData(),
        sa.Column("tenant", sa.Uuid, primary_key=True),
        sa.Column("at", sa.DateTime(timezone=True), primary_key=True),
        sa.Column("state", sa.String(10), nullable=False),
    )
    table.metadata.create_all(engine)
    tenant_a = uuid.UUID("00000000-0000-0000-0000-00000000000a")
    tenant_b = uuid.UUID("00000000-0000-0000-0000-00000000000b")
    t0 = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    keys = [(tenant_a, t0), (tenant_a, t0 + dt.timedelta(microseconds=1)), (tenant_b, t0)]
    with engine.begin() as conn:
        conn.execute(table.insert(), [{"tenant": u, "at": a, "state": "NEW"} for u, a in keys])
    if engine.dialect.name == "sqlite":  # SQLite keeps naive timestamps
        keys = [(u, a.replace(tzinfo=None)) for u, a in keys]
    missing = (tenant_b, keys[2][1] + dt.timedelta(seconds=1))
    with engine.begin() as conn:
        g = guarded_update(
            conn,
            table,
            ["tenant", "at"],
            [keys[0], keys[1], missing],
            {"state": "SEEN"},
            {"state": "NEW"},
        )
        u = update_rows(
            conn,
            table,
            ["tenant", "at"],
            [{"tenant": keys[2][0], "at": keys[2][1], "state": "DONE"}],
        )
    assert (g.applied, g.not_applied, u.applied) == ([keys[0], keys[1]], [missing], [keys[2]])


def test_postgres_rejects_a_too_long_value_instead_of_truncating_it(pg):
    orders = make_orders(pg)
    # the batch path casts to the column's type; a CAST to VARCHAR(20) would silently truncate
    with pg.begin() as conn:
        outcome = update_rows(
            conn, "orders", "id", [{"id": 1, "status": "X" * 21}, {"id": 2, "status": "OK"}]
        )
    assert list(outcome.failed) == [1] and "too long" in outcome.failed[1]
    assert outcome.applied == [2]
    assert _state(pg, orders, "status")[1] == "PENDING"


def test_postgres_array_columns_use_the_values_fallback(pg):
    table = sa.Table(
        "tagged",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("tags", postgresql.ARRAY(sa.Text)),
    )
    table.metadata.create_all(pg)
    with pg.begin() as conn:
        inserted = upsert(conn, table, [{"id": 1, "tags": ["a"]}, {"id": 2, "tags": []}], "id")
        updated = update_rows(
            conn, table, "id", [{"id": 1, "tags": ["x", "y"]}, {"id": 3, "tags": ["z"]}]
        )
    assert inserted.applied == [1, 2]
    assert (updated.applied, updated.not_applied) == ([1], [3])
    assert _state(pg, table, "tags") == {1: ["x", "y"], 2: []}


# --------------------------------------------------------------------------- property


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lost=st.sets(st.integers(1, 10)),
    bad=st.sets(st.integers(1, 12)),
    batch_size=st.integers(1, 6),
)
def test_every_key_lands_in_exactly_one_field(engine, orders, lost, bad, batch_size):
    """Whatever raced and whatever is invalid, the outcome partitions the keys and matches the
    table: applied rows hold the new value, all others kept theirs."""
    with engine.begin() as conn:
        conn.execute(orders.update().values(status="PENDING", qty=orders.c.id, note=None))
        if lost:
            conn.execute(orders.update().where(orders.c.id.in_(lost)).values(status="PAID"))
    keys = list(range(1, 13))  # 11 and 12 have no row
    rows = [{"id": k, "qty": -k if k in bad else 100 + k, "note": "w"} for k in keys]
    with engine.begin() as conn:
        outcome = update_rows(
            conn, orders, "id", rows, expected={"status": "PENDING"}, batch_size=batch_size
        )
    _assert_partition(outcome, keys)
    present_and_pending = {k for k in keys if k <= 10 and k not in lost}
    assert set(outcome.applied) == present_and_pending - bad
    assert set(outcome.failed) == present_and_pending & bad
    state = _state(engine, orders, "qty")
    assert all(state[k] == (100 + k if k in outcome.applied else k) for k in range(1, 11))


# --------------------------------------------------------------------------- misuse


def test_misuse_is_refused_with_a_message_that_says_what_to_do(engine, orders, lines):
    with pytest.raises(KeyValidationError, match="not found"):
        guarded_update(engine, "no_such_table", "id", [1], {"status": "X"})
    with pytest.raises(KeyValidationError, match="key column"):
        guarded_update(engine, orders, "ID", [1], {"status": "X"})
    with pytest.raises(ConfigurationError, match="does not have"):
        guarded_update(engine, orders, "id", [1], {"stat": "X"})
    with pytest.raises(ConfigurationError, match="tuple of 2 values"):
        guarded_update(engine, lines, ["order_id", "line"], [1], {"status": "X"})
    with pytest.raises(ConfigurationError, match="appears twice"):
        update_rows(engine, orders, "id", [{"id": 1, "qty": 1}, {"id": 1, "qty": 2}])
    with pytest.raises(ConfigurationError, match="nothing to set"):
        update_rows(engine, orders, "id", [{"id": 1}])
    with pytest.raises(ConfigurationError, match="batch_size"):
        update_rows(engine, orders, "id", [{"id": 1, "qty": 1}], batch_size=0)
    with pytest.raises(ConfigurationError, match="lack the columns"):
        upsert(engine, orders, [{"id": 1, "status": "X"}], "id", update=["qty"])


def test_empty_input_writes_nothing(engine, orders):
    statements = _count_statements(engine, "")
    with engine.begin() as conn:
        assert guarded_update(conn, orders, "id", [], {"status": "X"}) == WriteOutcome()
        assert update_rows(conn, orders, "id", []) == WriteOutcome()
        assert upsert(conn, orders, [], "id") == WriteOutcome()
    assert not [s for s in statements if s.lstrip().upper().startswith(("UPDATE", "INSERT"))]
