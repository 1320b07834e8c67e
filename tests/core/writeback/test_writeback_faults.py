"""Whose fault a database error is, for every write-back helper, on both PostgreSQL drivers.

The helpers report a key as ``failed`` only when that row's data is at fault (a trigger's RAISE,
a CHECK); a dependency failure (lock timeout) raises ``RetryableError``; a statement that can
never work (a dropped table) raises the database error. psycopg2 and psycopg 3 map the same
SQLSTATE to different DB-API classes (``RAISE EXCEPTION``: InternalError vs ProgrammingError),
so the decision is taken on the SQLSTATE, and these tests run on both.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from airflow_keyset_provider.core.errors import RetryableError
from airflow_keyset_provider.core.writeback import (
    WriteOutcome,
    claim_skip_locked,
    guarded_update,
    update_rows,
    upsert,
)

PG_DRIVERS = ["postgresql+psycopg2", "postgresql+psycopg"]
WRITERS = ["guarded_update", "update_rows", "upsert"]
FROZEN = [3, 6]  # the trigger refuses to update these orders


@pytest.fixture(params=PG_DRIVERS)
def pg(request: pytest.FixtureRequest, pg_engine: sa.Engine) -> Iterator[sa.Engine]:
    # same private schema (search_path travels in the URL), the chosen driver
    engine = sa.create_engine(pg_engine.url.set(drivername=request.param))
    try:
        yield engine
    finally:
        engine.dispose()  # before conftest drops the schema


def make_orders(engine: sa.Engine) -> sa.Table:
    """``orders`` with ids 1..8, all PENDING, qty = id, ``qty >= 0`` checked."""
    table = sa.Table(
        "orders",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("qty", sa.Integer, sa.CheckConstraint("qty >= 0", name="qty_not_negative")),
    )
    table.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(
            table.insert(), [{"id": i, "status": "PENDING", "qty": i} for i in range(1, 9)]
        )
    return table


def freeze(engine: sa.Engine, table: str = "orders") -> None:
    """A BEFORE UPDATE trigger that RAISEs for the FROZEN orders."""
    frozen = ", ".join(map(str, FROZEN))
    with engine.begin() as conn:
        conn.execute(  # text(): SQLAlchemy escapes the % for each driver's paramstyle
            sa.text(
                "CREATE FUNCTION refuse_frozen() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                f"IF NEW.id IN ({frozen}) THEN RAISE EXCEPTION 'order % is frozen', NEW.id; END IF; "
                "RETURN NEW; END $$"
            )
        )
        conn.exec_driver_sql(
            f"CREATE TRIGGER frozen BEFORE UPDATE ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION refuse_frozen()"
        )


def write(
    conn: sa.Connection | sa.Engine, writer: str, ids: list[int], **row: object
) -> WriteOutcome:
    """The same change (``row``'s columns) to orders ``ids`` through ``writer``."""
    if writer == "guarded_update":
        return guarded_update(conn, "orders", "id", ids, values=row, expected={"status": "PENDING"})
    rows = [{"id": i, **row} for i in ids]
    if writer == "update_rows":
        return update_rows(conn, "orders", "id", rows, expected={"status": "PENDING"})
    return upsert(conn, "orders", [{"qty": 1, **r} for r in rows], conflict="id", update=list(row))


def statuses(engine: sa.Engine) -> dict[int, str]:
    with engine.connect() as conn:
        return {i: s for i, s in conn.exec_driver_sql("SELECT id, status FROM orders")}


@pytest.mark.parametrize("writer", WRITERS)
def test_a_trigger_raise_fails_only_its_keys_without_the_trigger_message(pg, writer):
    make_orders(pg)
    freeze(pg)
    ids = list(range(1, 9))
    with pg.begin() as conn:
        outcome = write(conn, writer, ids, status="DONE")

    # the trigger's text may quote the row: its class only (reasons.py), the text on opt-in
    assert sorted(outcome.failed) == sorted(FROZEN)
    assert all(r.startswith("raise_exception (SQLSTATE P0001)") for r in outcome.failed.values())
    assert not any("frozen" in r for r in outcome.failed.values())
    assert outcome.applied == [k for k in ids if k not in FROZEN]
    assert outcome.not_applied == []
    after = statuses(pg)
    assert {k for k, s in after.items() if s == "DONE"} == set(outcome.applied)
    assert all(after[k] == "PENDING" for k in FROZEN)


@pytest.mark.parametrize("writer", WRITERS)
def test_a_check_violation_is_the_row_s_fault(pg, writer):
    make_orders(pg)
    with pg.begin() as conn:
        if writer == "guarded_update":  # the same value for every row: only row 1 can take it
            outcome = guarded_update(
                conn, "orders", "id", [1, 2], values={"qty": sa.text("qty - 2")}
            )
        elif writer == "update_rows":
            outcome = update_rows(conn, "orders", "id", [{"id": 1, "qty": -1}, {"id": 2, "qty": 0}])
        else:
            rows = [{"id": 1, "status": "P", "qty": -1}, {"id": 2, "status": "P", "qty": 0}]
            outcome = upsert(conn, "orders", rows, conflict="id", update=["qty"])
    assert list(outcome.failed) == [1]
    assert "qty_not_negative" in outcome.failed[1]
    assert outcome.applied == [2]


@pytest.mark.parametrize("writer", WRITERS)
def test_a_dropped_table_raises_instead_of_failing_every_key(pg, writer):
    make_orders(pg)
    with pg.begin() as conn:
        write(conn, writer, [1], status="SEEN")  # reflects and caches "orders"
    with pg.begin() as conn:
        conn.exec_driver_sql("DROP TABLE orders")

    with pg.begin() as conn:
        with pytest.raises(sa.exc.ProgrammingError) as raised:
            write(conn, writer, [1, 2], status="DONE")
        assert raised.value.orig.__class__.__name__ == "UndefinedTable"  # SQLSTATE 42P01
        assert conn.exec_driver_sql("SELECT 1").scalar() == 1  # the transaction is still usable


@pytest.mark.parametrize("writer", [*WRITERS, "claim_skip_locked"])
def test_a_lock_timeout_is_a_dependency_failure(pg, writer):
    table = make_orders(pg)
    with pg.connect() as holder, pg.connect() as conn:
        holder.begin()
        # the holder locks the whole table for claim (which skips locked rows), row 2 otherwise
        if writer == "claim_skip_locked":
            holder.exec_driver_sql("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
        else:
            holder.execute(sa.select(table).where(table.c.id == 2).with_for_update())
        conn.begin()
        conn.exec_driver_sql("SET LOCAL lock_timeout = '50ms'")
        with pytest.raises(RetryableError, match="55P03") as raised:
            if writer == "claim_skip_locked":
                claim_skip_locked(conn, table, "id", None, limit=3)
            else:
                write(conn, writer, [1, 2, 3], status="DONE")
        assert isinstance(raised.value.__cause__, sa.exc.OperationalError)
        if writer != "claim_skip_locked":  # a write ran in a savepoint: the caller's
            assert conn.exec_driver_sql("SELECT 1").scalar() == 1  # transaction is usable
        conn.rollback()
        holder.rollback()
    assert set(statuses(pg).values()) == {"PENDING"}  # nothing of the batch was written


@pytest.mark.parametrize("writer", [*WRITERS, "claim_skip_locked"])
def test_a_lost_connection_is_a_dependency_failure(pg, writer):
    table = make_orders(pg)
    with pg.begin() as conn:  # reflects and caches "orders": the failure hits the write
        guarded_update(conn, "orders", "id", [1], values={"status": "SEEN"})
    with pg.connect() as killer, pg.connect() as conn:
        conn.begin()
        pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        # waits (up to 30 s) until the server process of `conn` has ended
        assert killer.exec_driver_sql(f"SELECT pg_terminate_backend({pid}, 30000)").scalar()
        with pytest.raises(RetryableError, match="database failed") as raised:
            if writer == "claim_skip_locked":
                claim_skip_locked(conn, table, "id", None, limit=3)
            else:
                write(conn, writer, [1, 2], status="DONE")
        assert isinstance(raised.value.__cause__, sa.exc.OperationalError)
    assert set(statuses(pg).values()) == {"PENDING", "SEEN"}


def test_sqlite_keeps_its_classification_a_trigger_raise_is_a_row_fault(sqlite_url):
    engine = sa.create_engine(sqlite_url)
    try:
        make_orders(engine)
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "CREATE TRIGGER frozen BEFORE UPDATE ON orders "
                "WHEN NEW.id IN (3, 6) AND NEW.status <> 'PENDING' "
                "BEGIN SELECT RAISE(ABORT, 'order is frozen'); END"
            )
        for writer in WRITERS:
            with engine.begin() as conn:
                conn.exec_driver_sql("UPDATE orders SET status = 'PENDING'")
                outcome = write(conn, writer, list(range(1, 9)), status=writer)
            assert sorted(outcome.failed) == [3, 6]  # the trigger's text only on opt-in
            assert all(r.startswith("IntegrityError (") for r in outcome.failed.values())
            assert outcome.applied == [1, 2, 4, 5, 7, 8]
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP TABLE orders")
        with pytest.raises(sa.exc.OperationalError, match="no such table"):
            write(engine, "guarded_update", [1], status="DONE")
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("code", "fault"),
    [
        ("P0001", "row"),  # RAISE EXCEPTION
        ("P0004", "row"),  # ASSERT failure
        ("23514", "row"),  # check_violation
        ("23505", "row"),  # unique_violation
        ("22001", "row"),  # string_data_right_truncation
        ("21000", "row"),  # cardinality_violation
        ("54000", "row"),  # program_limit_exceeded (index row too large)
        ("08006", "dependency"),  # connection_failure
        ("40001", "dependency"),  # serialization_failure
        ("40P01", "dependency"),  # deadlock_detected
        ("53300", "dependency"),  # too_many_connections
        ("55P03", "dependency"),  # lock_not_available
        ("57014", "dependency"),  # query_canceled (statement_timeout)
        ("57P01", "dependency"),  # admin_shutdown
        ("42P01", "configuration"),  # undefined_table
        ("42501", "configuration"),  # insufficient_privilege
        ("42703", "configuration"),  # undefined_column
        ("25P02", "configuration"),  # in_failed_sql_transaction: not the row's fault
        ("25006", "configuration"),  # read_only_sql_transaction
        ("55000", "configuration"),  # object_not_in_prerequisite_state
        ("XX000", "configuration"),  # internal_error
        ("0A000", "configuration"),  # feature_not_supported
    ],
)
def test_the_sqlstate_table_of_the_docs(code, fault):
    from airflow_keyset_provider.core.writeback.failures import by_sqlstate

    assert by_sqlstate(code).value == fault
