"""The write-back helpers on MariaDB (MySQL's statements, no ``UPDATE ... RETURNING``).

Same per-key outcomes as on PostgreSQL: applied, not applied (missing row, guard no longer
true, upsert already as wanted), failed. Here: the outcomes, two writers racing for the same
rows (each key applied by exactly one), SKIP LOCKED claims and batches split to fit
``max_allowed_packet``. Faults are in ``test_writeback_mysql_faults.py``.

The ``mariadb`` fixture gives each test its own database ``kswb_<hex>`` on the local MariaDB
(``mysql+pymysql://root@127.0.0.1:3306/``), dropped afterwards; it skips when MariaDB is not
reachable, and fails instead when ``KEYSET_REQUIRE_SERVICES=1``.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator

import _services
import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from airflow_keyset_provider.core.errors import ConfigurationError
from airflow_keyset_provider.core.writeback import (
    WriteOutcome,
    claim_skip_locked,
    guarded_update,
    update_rows,
    upsert,
)
from airflow_keyset_provider.core.writeback.backends import mysql as mysql_backend

MARIADB_URL = os.environ.get("KEYSET_TEST_MARIADB_URL", "mysql+pymysql://root@127.0.0.1:3306/")


@pytest.fixture
def mariadb() -> Iterator[sa.Engine]:
    """An engine on a database of this test's own, dropped after it."""
    server = sa.create_engine(MARIADB_URL, poolclass=NullPool, connect_args={"connect_timeout": 3})
    name = f"kswb_{uuid.uuid4().hex}"
    try:
        with server.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE `{name}`")
    except sa.exc.OperationalError as exc:
        server.dispose()
        reason = f"MariaDB unreachable at {MARIADB_URL}: {exc.orig}"
        if os.environ.get(_services.ENV_REQUIRE, "").strip().lower() in {"1", "true", "yes"}:
            pytest.fail(reason)
        print(reason)
        pytest.skip(reason)
    engine = sa.create_engine(sa.make_url(MARIADB_URL).set(database=name))
    try:
        yield engine
    finally:
        engine.dispose()
        with server.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
        server.dispose()


def make_orders(engine: sa.Engine, n: int = 8) -> sa.Table:
    """``orders`` with ids 1..n, all PENDING, qty = id, ``qty >= 0`` checked, a unique ``ref``."""
    table = sa.Table(
        "orders",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("qty", sa.Integer),
        sa.Column("ref", sa.String(20), unique=True),
        sa.CheckConstraint("qty >= 0", name="qty_not_negative"),
    )
    table.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(
            table.insert(),
            [{"id": i, "status": "PENDING", "qty": i, "ref": f"r{i}"} for i in range(1, n + 1)],
        )
    return table


def statuses(engine: sa.Engine) -> dict[int, str]:
    with engine.connect() as conn:
        return dict(conn.exec_driver_sql("SELECT id, status FROM orders").all())


def test_guarded_update_applies_matching_rows_only(mariadb):
    make_orders(mariadb)
    with mariadb.begin() as conn:
        conn.exec_driver_sql("UPDATE orders SET status = 'PAID' WHERE id IN (2, 5)")
    with mariadb.begin() as conn:
        out = guarded_update(
            conn, "orders", "id", [1, 2, 3, 5, 99], {"status": "DONE"}, {"status": "PENDING"}
        )
    assert out == WriteOutcome(applied=[1, 3], not_applied=[2, 5, 99], failed={})
    after = statuses(mariadb)
    assert after[1] == after[3] == "DONE" and after[2] == after[5] == "PAID"
    again = guarded_update(
        mariadb, "orders", "id", [1, 3], {"status": "DONE"}, {"status": "PENDING"}
    )
    assert again.applied == [] and again.not_applied == [1, 3]  # idempotent


def test_update_rows_writes_each_row_its_own_values(mariadb):
    make_orders(mariadb)
    rows = [{"id": i, "qty": 10 * i, "status": f"S{i}"} for i in (1, 2, 3, 42)]
    with mariadb.begin() as conn:
        conn.exec_driver_sql("UPDATE orders SET status = 'PAID' WHERE id = 2")
        out = update_rows(conn, "orders", "id", rows, expected={"status": "PENDING"})
    assert out == WriteOutcome(applied=[1, 3], not_applied=[2, 42], failed={})
    with mariadb.connect() as conn:
        got = dict(conn.exec_driver_sql("SELECT id, qty FROM orders WHERE id <= 3").all())
    assert got == {1: 10, 2: 2, 3: 30}


def test_update_rows_with_a_composite_key(mariadb):
    table = sa.Table(
        "pairs",
        sa.MetaData(),
        sa.Column("a", sa.Integer, primary_key=True),
        sa.Column("b", sa.String(10), primary_key=True),
        sa.Column("v", sa.Integer),
    )
    table.metadata.create_all(mariadb)
    with mariadb.begin() as conn:
        conn.execute(table.insert(), [{"a": 1, "b": "x", "v": 0}, {"a": 1, "b": "y", "v": 0}])
    rows = [{"a": 1, "b": "x", "v": 5}, {"a": 2, "b": "x", "v": 6}]
    out = update_rows(mariadb, "pairs", ["a", "b"], rows)
    assert out == WriteOutcome(applied=[(1, "x")], not_applied=[(2, "x")], failed={})


def test_upsert_inserts_updates_and_is_idempotent(mariadb):
    make_orders(mariadb, 3)
    rows = [
        {"id": 1, "status": "PENDING", "qty": 1, "ref": "r1"},  # already so: not applied
        {"id": 2, "status": "DONE", "qty": 2, "ref": "r2"},  # differs: updated
        {"id": 3, "status": "pending", "qty": 3, "ref": "r3"},  # only the case: still a change
        {"id": 7, "status": "NEW", "qty": 7, "ref": "r7"},  # missing: inserted
    ]
    out = upsert(mariadb, "orders", rows, conflict="id", update=["status", "qty"])
    assert out == WriteOutcome(applied=[2, 3, 7], not_applied=[1], failed={})
    assert statuses(mariadb) == {1: "PENDING", 2: "DONE", 3: "pending", 7: "NEW"}
    again = upsert(mariadb, "orders", rows, conflict="id", update=["status", "qty"])
    assert again == WriteOutcome(applied=[], not_applied=[1, 2, 3, 7], failed={})
    keep = upsert(
        mariadb, "orders", [{**rows[1], "status": "X"}, {**rows[3], "id": 8, "ref": "r8"}], "id"
    )
    assert keep == WriteOutcome(applied=[8], not_applied=[2], failed={})  # update=None keeps rows


def test_upsert_fails_a_row_that_conflicts_on_another_unique_key(mariadb):
    """ON DUPLICATE KEY UPDATE would overwrite order 1 here; the helper fails the row instead."""
    make_orders(mariadb, 2)
    rows = [
        {"id": 9, "status": "NEW", "qty": 9, "ref": "r1"},  # ref r1 belongs to order 1
        {"id": 10, "status": "NEW", "qty": 10, "ref": "r10"},
    ]
    out = upsert(mariadb, "orders", rows, conflict="id", update=["status"])
    assert out.applied == [10] and list(out.failed) == [9]
    assert "Duplicate entry" in out.failed[9]
    assert statuses(mariadb) == {1: "PENDING", 2: "PENDING", 10: "NEW"}


def _wait_until_blocked(engine: sa.Engine, thread: threading.Thread) -> None:
    """Until a connection of this test's database runs a locking read (B's, which cannot end
    before A commits: A holds the row locks), or the thread ended."""
    with engine.connect() as probe:
        while thread.is_alive():
            locking = probe.exec_driver_sql(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                "WHERE DB = DATABASE() AND ID <> CONNECTION_ID() AND INFO LIKE '%%FOR UPDATE%%'"
            ).scalar()
            if locking:
                return
            probe.rollback()
            thread.join(0.05)


@pytest.mark.parametrize("writer", ["guarded_update", "update_rows"])
def test_two_writers_racing_each_key_is_applied_by_exactly_one(mariadb, writer):
    """A holds keys 1..600 (written, not committed); B wants 301..900 and has to wait for A's
    row locks; after A commits, B gets 601..900 and reports 301..600 not applied."""
    make_orders(mariadb, 900)

    def write(conn: sa.Connection, ids: range) -> WriteOutcome:
        if writer == "guarded_update":
            return guarded_update(
                conn, "orders", "id", ids, {"status": "DONE"}, {"status": "PENDING"}
            )
        rows = [{"id": i, "status": "DONE"} for i in ids]
        return update_rows(conn, "orders", "id", rows, expected={"status": "PENDING"})

    outcomes: dict[str, WriteOutcome] = {}
    with mariadb.connect() as a:
        a.begin()
        outcomes["a"] = write(a, range(1, 601))
        b_thread = threading.Thread(
            target=lambda: outcomes.__setitem__(
                "b", _in_transaction(mariadb, write, range(301, 901))
            )
        )
        b_thread.start()
        _wait_until_blocked(mariadb, b_thread)
        assert b_thread.is_alive()  # B really waits for A's locks
        a.commit()
    b_thread.join()
    assert outcomes["a"].applied == list(range(1, 601))
    assert outcomes["b"].applied == list(range(601, 901))
    assert outcomes["b"].not_applied == list(range(301, 601))
    assert set(statuses(mariadb).values()) == {"DONE"}


def _in_transaction(engine: sa.Engine, write, ids: range) -> WriteOutcome:
    with engine.begin() as conn:
        return write(conn, ids)


def test_claim_skip_locked_gives_concurrent_workers_disjoint_rows(mariadb):
    table = make_orders(mariadb)
    with mariadb.connect() as one, mariadb.connect() as two:
        one.begin()
        first = claim_skip_locked(one, table, "id", {"status": "PENDING"}, limit=3)
        two.begin()
        second = claim_skip_locked(two, "orders", "id", {"status": "PENDING"}, limit=3)
        assert [r.id for r in first] == [1, 2, 3]
        assert [r.id for r in second] == [4, 5, 6]
        one.rollback()
        two.rollback()


def test_batches_are_split_to_fit_max_allowed_packet(mariadb):
    """Rows of 400 kB each, 80 of them: 32 MB, twice the server's 16 MB packet, so one
    statement could not carry them; the helpers split, every statement fits, all are applied."""
    table = sa.Table(
        "docs",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("body", sa.Text(2**32 - 1)),
    )
    table.metadata.create_all(mariadb)
    statements: list[int] = []

    @sa.event.listens_for(mariadb, "before_cursor_execute")
    def count(conn, cursor, statement, params, context, executemany):
        if statement.lstrip().upper().startswith(("UPDATE", "INSERT")):
            statements.append(len(statement) + sum(len(str(p)) for p in _flat(params)))

    rows = [{"id": i, "body": chr(65 + i % 26) * 400_000} for i in range(80)]
    with mariadb.connect() as conn:
        packet = conn.exec_driver_sql("SELECT @@max_allowed_packet").scalar()
    assert sum(len(r["body"]) for r in rows) > packet
    out = upsert(mariadb, "docs", rows, conflict="id")
    assert out.applied == list(range(80)) and not out.failed
    inserts = len(statements)
    out = update_rows(mariadb, "docs", "id", [{**r, "body": r["body"].lower()} for r in rows])
    assert out.applied == list(range(80)) and not out.failed
    assert inserts >= 2 and len(statements) - inserts >= 2
    assert max(statements) < packet
    with mariadb.connect() as conn:
        assert conn.exec_driver_sql("SELECT SUM(LENGTH(body)) FROM docs").scalar() == 32_000_000
        assert conn.exec_driver_sql("SELECT body FROM docs WHERE id = 1").scalar()[:3] == "bbb"


def _flat(params: object) -> list:
    if isinstance(params, dict):
        return list(params.values())
    if isinstance(params, list | tuple):
        return (
            [v for p in params for v in _flat(p)]
            if params and isinstance(params[0], dict | list | tuple)
            else list(params)
        )
    return [params]


def test_max_allowed_packet_is_read_once_per_engine(mariadb):
    make_orders(mariadb, 2)
    reads: list[str] = []

    @sa.event.listens_for(mariadb, "before_cursor_execute")
    def count(conn, cursor, statement, params, context, executemany):
        if "max_allowed_packet" in statement:
            reads.append(statement)

    for _ in range(3):
        guarded_update(mariadb, "orders", "id", [1, 2], {"status": "SEEN"})
    assert len(reads) == 1
    with mariadb.connect() as conn:
        assert (
            mysql_backend.max_allowed_packet(conn)
            == conn.exec_driver_sql("SELECT @@max_allowed_packet").scalar()
        )


def test_split_by_bytes_keeps_each_batch_within_the_budget():
    sizes = [5, 5, 5, 12, 1, 1]
    got = list(mysql_backend.split_by_bytes(sizes, lambda s: s, 10))
    assert got == [[5, 5], [5], [12], [1, 1]]


def test_an_autocommit_engine_gets_a_transaction_and_an_autocommit_connection_is_refused(mariadb):
    make_orders(mariadb, 3)
    engine = mariadb.execution_options(isolation_level="AUTOCOMMIT")
    out = guarded_update(engine, "orders", "id", [1, 2], {"status": "DONE"}, {"status": "PENDING"})
    assert out.applied == [1, 2]
    with engine.connect() as conn, pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
        guarded_update(conn, "orders", "id", [3], {"status": "DONE"})
    assert statuses(mariadb) == {1: "DONE", 2: "DONE", 3: "PENDING"}
