"""Whose fault a database error is on MariaDB, for every write-back helper, by error number.

A trigger's ``SIGNAL SQLSTATE '45000'`` (1644) and a CHECK (4025 on MariaDB, 3819 on MySQL) fail
only their keys, with the database's message; a lock wait timeout (1205) raises
``RetryableError``; a dropped table (1146) raises the database error.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from test_writeback_mysql import make_orders, mariadb, statuses

from airflow_keyset_provider.core.errors import ConfigurationError, RetryableError
from airflow_keyset_provider.core.writeback import (
    WriteOutcome,
    claim_skip_locked,
    guarded_update,
    update_rows,
    upsert,
)
from airflow_keyset_provider.core.writeback.backends.mysql import MYSQL_ERRORS
from airflow_keyset_provider.core.writeback.failures import Fault

__all__ = ["mariadb"]  # the fixture, imported from its module

WRITERS = ["guarded_update", "update_rows", "upsert"]
FROZEN = [3, 6]  # the trigger refuses to update these orders


def freeze(engine: sa.Engine) -> None:
    """A BEFORE UPDATE trigger that SIGNALs for the FROZEN orders."""
    frozen = ", ".join(map(str, FROZEN))
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TRIGGER frozen BEFORE UPDATE ON orders FOR EACH ROW BEGIN "
            f"IF NEW.id IN ({frozen}) THEN "
            "SET @keyset_msg = CONCAT('order ', NEW.id, ' is frozen'); "
            "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = @keyset_msg; END IF; END"
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


@pytest.mark.parametrize("writer", WRITERS)
def test_a_trigger_signal_fails_only_its_keys_without_the_trigger_message(mariadb, writer):
    make_orders(mariadb)
    freeze(mariadb)
    ids = list(range(1, 9))
    with mariadb.begin() as conn:
        outcome = write(conn, writer, ids, status="DONE")
        assert conn.exec_driver_sql("SELECT 1").scalar() == 1  # the transaction is usable

    # the trigger's text may quote the row: its class only (reasons.py), the text on opt-in
    assert sorted(outcome.failed) == sorted(FROZEN)
    assert all(r.startswith("MySQL error 1644") for r in outcome.failed.values())
    assert not any("frozen" in r for r in outcome.failed.values())
    assert outcome.applied == [k for k in ids if k not in FROZEN]
    assert outcome.not_applied == []
    after = statuses(mariadb)
    assert {k for k, s in after.items() if s == "DONE"} == set(outcome.applied)
    assert all(after[k] == "PENDING" for k in FROZEN)


@pytest.mark.parametrize("writer", WRITERS)
def test_a_check_violation_is_the_row_s_fault(mariadb, writer):
    make_orders(mariadb)
    with mariadb.begin() as conn:
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


@pytest.mark.parametrize(
    ("row", "number"),
    [({"qty": 2**40}, 1264), ({"status": "x" * 30}, 1406), ({"status": None}, 1048)],
)
def test_data_errors_fail_the_row(mariadb, row, number):
    make_orders(mariadb)
    rows = [{"id": 1, **row}, {"id": 2, "qty": 5}]
    outcome = update_rows(mariadb, "orders", "id", rows)
    assert outcome.applied == [2] and list(outcome.failed) == [1]
    assert MYSQL_ERRORS[number] is Fault.ROW


@pytest.mark.parametrize("writer", WRITERS)
def test_a_dropped_table_raises_instead_of_failing_every_key(mariadb, writer):
    make_orders(mariadb)
    with mariadb.begin() as conn:
        write(conn, writer, [1], status="SEEN")  # reflects and caches "orders"
    with mariadb.begin() as conn:
        conn.exec_driver_sql("DROP TABLE orders")

    with mariadb.begin() as conn:
        with pytest.raises(sa.exc.ProgrammingError) as raised:
            write(conn, writer, [1, 2], status="DONE")
        assert raised.value.orig.args[0] == 1146
        assert conn.exec_driver_sql("SELECT 1").scalar() == 1  # the transaction is still usable


@pytest.mark.parametrize("writer", [*WRITERS, "claim_skip_locked"])
def test_a_lock_wait_timeout_is_a_dependency_failure(mariadb, writer):
    table = make_orders(mariadb)
    with mariadb.connect() as holder, mariadb.connect() as conn:
        # the holder locks the table for claim (which skips locked rows), row 2 otherwise
        if writer == "claim_skip_locked":
            holder.exec_driver_sql("LOCK TABLES orders WRITE")
        else:
            holder.begin()
            holder.execute(sa.select(table).where(table.c.id == 2).with_for_update())
        conn.begin()
        conn.exec_driver_sql("SET SESSION lock_wait_timeout = 1, innodb_lock_wait_timeout = 1")
        with pytest.raises(RetryableError, match="error 1205") as raised:
            if writer == "claim_skip_locked":
                claim_skip_locked(conn, table, "id", None, limit=3)
            else:
                write(conn, writer, [1, 2, 3], status="DONE")
        assert isinstance(raised.value.__cause__, sa.exc.OperationalError)
        assert conn.exec_driver_sql("SELECT 1").scalar() == 1  # the transaction is usable
        conn.rollback()
        if writer == "claim_skip_locked":
            holder.exec_driver_sql("UNLOCK TABLES")
        else:
            holder.rollback()
    assert set(statuses(mariadb).values()) == {"PENDING"}  # nothing of the batch was written


def test_a_lost_connection_is_a_dependency_failure(mariadb):
    make_orders(mariadb)
    guarded_update(mariadb, "orders", "id", [1], values={"status": "SEEN"})  # reflect, cache
    with mariadb.connect() as killer, mariadb.connect() as conn:
        conn.begin()
        thread_id = conn.exec_driver_sql("SELECT CONNECTION_ID()").scalar()
        killer.exec_driver_sql(f"KILL {int(thread_id)}")
        with pytest.raises(RetryableError, match="database failed"):
            write(conn, "update_rows", [1, 2], status="DONE")
    assert set(statuses(mariadb).values()) == {"PENDING", "SEEN"}


def test_a_non_strict_sql_mode_is_refused(mariadb):
    make_orders(mariadb)
    with mariadb.connect() as conn:
        conn.exec_driver_sql("SET SESSION sql_mode = ''")  # begins the transaction
        with pytest.raises(ConfigurationError, match="strict sql_mode"):
            guarded_update(conn, "orders", "id", [1], values={"status": "DONE"})
        conn.rollback()


@pytest.mark.parametrize(
    ("numbers", "fault"),
    [
        ((1264, 1406, 1366, 1048, 1062, 1452, 3819, 4025, 1644), Fault.ROW),
        ((1205, 1213, 2006, 2013, 1317), Fault.DEPENDENCY),
        ((1146, 1054, 1142), Fault.CONFIGURATION),
    ],
)
def test_the_error_number_table_of_the_docs(numbers, fault):
    assert {n: MYSQL_ERRORS[n] for n in numbers} == dict.fromkeys(numbers, fault)
