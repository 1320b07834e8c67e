"""The helpers give the same per-key outcome as the hand-written SQL the benchmarks compare them
with (issue 29), on real PostgreSQL (psycopg2, psycopg 3) and MariaDB (mysqlclient, PyMySQL).

The hand-written statements are the benchmark's own (``benchmarks/metrics/writeback_sql.py``):
an ``UPDATE ... FROM unnest(...)`` / ``INSERT ... ON CONFLICT`` on PostgreSQL, a ``SELECT ...
FOR UPDATE`` + ``UPDATE ... JOIN`` / ``INSERT ... ON DUPLICATE KEY UPDATE`` on MariaDB. Each
test runs both on the same fresh data, for a one-column key and for ``(created_at, id)``: the
keys applied, the keys not applied (guard false: ``SHIPPED`` rows; missing rows; an upsert's
unchanged rows) and the table afterwards must be equal. A row with a type error fails alone,
found by halving the failed batch (a few statements, not one per row), and the caller's
transaction goes on; on MariaDB no savepoint is taken at all.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from benchmarks.metrics.writeback_sql import (  # noqa: E402
    Database,
    Mariadb,
    Postgres,
    Shape,
    helper,
)

sys.path.remove(str(ROOT))

N = 40  # keys per call; rows exist for the first 36
EXISTING = 36
OPS = ("update_rows", "update_columns", "guarded_update", "upsert")
WITH_VALUES = ("update_rows", "update_columns", "upsert")  # a value per row: a bad one fails


def _drivers() -> list[Any]:
    out: list[Any] = ["postgresql+psycopg2", "postgresql+psycopg", "mysql+pymysql"]
    native = importlib.util.find_spec("MySQLdb") is not None
    out.append(
        pytest.param(
            "mysql+mysqldb",
            marks=pytest.mark.skipif(not native, reason="mysqlclient: the mysql-native extra"),
        )
    )
    return out


def _engine(request: pytest.FixtureRequest) -> Iterator[sa.Engine]:
    driver: str = request.param
    if driver.startswith("postgresql"):
        url = request.getfixturevalue("pg_engine").url
    else:
        url = sa.make_url(request.getfixturevalue("mariadb_db_url"))
    engine = sa.create_engine(url.set(drivername=driver))
    yield engine
    engine.dispose()


@pytest.fixture(params=_drivers())
def engine(request: pytest.FixtureRequest) -> Iterator[sa.Engine]:
    yield from _engine(request)


@pytest.fixture(params=_drivers()[2:])
def mariadb_engine(request: pytest.FixtureRequest) -> Iterator[sa.Engine]:
    yield from _engine(request)


def _create(engine: sa.Engine, shape: Shape) -> str:
    pg = engine.dialect.name == "postgresql"
    text, ts = ("text", "timestamptz") if pg else ("VARCHAR(20)", "DATETIME(6)")
    key = "id bigint" if shape.name == "single" else f"created_at {ts}, id bigint"
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE TABLE {shape.name} ({key}, status {text} NOT NULL, qty bigint, "
            f"PRIMARY KEY ({', '.join(shape.key)}))"
        )
    return shape.name


def _fill(db: Database) -> None:
    """Rows 1..EXISTING: every fifth ``SHIPPED`` (the guard fails), the others ``PENDING``."""
    keys = db.shape.keys(range(1, EXISTING + 1), db.aware)
    names = [*db.shape.key, "status", "qty"]
    with db.engine.begin() as conn:
        conn.exec_driver_sql(f"DELETE FROM {db.table}")
        rows = []
        for i, k in enumerate(keys, start=1):
            key = (k,) if db.shape.name == "single" else k
            rows.append((*key, "SHIPPED" if i % 5 == 0 else "PENDING", i))
        marks = ", ".join(["%s"] * len(names))
        cursor = conn.connection.dbapi_connection.cursor()
        cursor.executemany(f"INSERT INTO {db.table} ({', '.join(names)}) VALUES ({marks})", rows)


def _state(db: Database) -> dict:
    width = len(db.shape.key)
    with db.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            f"SELECT {', '.join(db.shape.key)}, status, qty FROM {db.table}"
        ).all()
    return {(r[0] if width == 1 else tuple(r[:width])): tuple(r[width:]) for r in rows}


def _input(db: Database, op: str, bad: int | None = None) -> tuple[list, dict, list]:
    """Keys 1..N (the last four have no row), their columns and their rows; key ``bad`` gets
    a text where the column is a bigint."""
    keys = db.shape.keys(range(1, N + 1), db.aware)
    cols: dict[str, list] = {}
    if db.shape.name == "single":
        cols["id"] = keys
    else:
        cols["created_at"] = [k[0] for k in keys]
        cols["id"] = [k[1] for k in keys]
    # an upsert leaves a third of the existing rows as they are (not applied)
    cols["status"] = [
        "PENDING" if op == "upsert" and i % 3 == 0 else "DONE" for i in range(1, N + 1)
    ]
    if op != "guarded_update":
        cols["qty"] = [i if op == "upsert" and i % 3 == 0 else i * 10 for i in range(1, N + 1)]
    if bad is not None:
        cols["qty"][bad - 1] = "not a number"
    rows = [dict(zip(cols, values, strict=True)) for values in zip(*cols.values(), strict=True)]
    return keys, cols, rows


def _db(engine: sa.Engine, shape_name: str, op: str) -> Database:
    shape = Shape(shape_name, N)
    table = _create(engine, shape)
    values = {"status": "text"} if op == "guarded_update" else {"status": "text", "qty": "bigint"}
    cls = Postgres if engine.dialect.name == "postgresql" else Mariadb
    return cls(engine, table, shape, N, values)


def _by_hand(db: Database, op: str, keys: list, cols: dict) -> tuple[set, dict]:
    _fill(db)
    with db.engine.begin() as conn:
        found = db.baseline(op, conn.connection.dbapi_connection, keys, cols)
    return found, _state(db)


def _drop(cols: dict, rows: list, keys: list, position: int) -> tuple[list, dict, list]:
    keep = [i for i in range(len(keys)) if i != position]
    return (
        [keys[i] for i in keep],
        {name: [col[i] for i in keep] for name, col in cols.items()},
        [rows[i] for i in keep],
    )


@pytest.mark.parametrize("shape_name", ["single", "composite"])
@pytest.mark.parametrize("op", OPS)
def test_the_helper_gives_the_hand_written_outcome(engine, op, shape_name):
    db = _db(engine, shape_name, op)
    keys, cols, rows = _input(db, op)
    found, by_hand = _by_hand(db, op, keys, cols)
    assert found and len(found) < len(keys), "the data has applied and not-applied keys"

    _fill(db)
    with engine.begin() as conn:
        out = helper(db, op, conn, keys, cols, rows)
    assert out.failed == {}
    assert out.applied == [k for k in keys if k in found]  # in input order
    assert out.not_applied == [k for k in keys if k not in found]
    assert _state(db) == by_hand


@contextmanager
def _writes(engine: sa.Engine) -> Iterator[list[str]]:
    """The UPDATE and INSERT statements sent to ``engine`` in the block."""
    seen: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith(("UPDATE", "INSERT")):
            seen.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)


@pytest.mark.parametrize("shape_name", ["single", "composite"])
@pytest.mark.parametrize("op", WITH_VALUES)
def test_a_type_error_fails_its_row_alone_and_the_transaction_goes_on(engine, op, shape_name):
    db = _db(engine, shape_name, op)
    bad = 7
    keys, cols, rows = _input(db, op, bad=bad)
    # by hand, without the bad row: what every other key must get
    found, by_hand = _by_hand(db, op, *_drop(cols, rows, keys, bad - 1)[:2])

    _fill(db)
    with _writes(engine) as writes, engine.begin() as conn:
        out = helper(db, op, conn, keys, cols, rows)
        helper_writes = len(writes)
        # the caller's transaction is usable: its own statement after the helper is kept
        conn.exec_driver_sql(f"UPDATE {db.table} SET qty = -1 WHERE status = 'SHIPPED'")
    bad_key = keys[bad - 1]
    assert list(out.failed) == [bad_key]
    assert out.failed[bad_key]  # the database's message
    assert out.applied == [k for k in keys if k in found]
    assert out.not_applied == [k for k in keys if k not in found and k != bad_key]
    assert by_hand[bad_key] == ("PENDING", bad)  # the bad key's row, left as it was
    expected = {k: (v if v[0] != "SHIPPED" else ("SHIPPED", -1)) for k, v in by_hand.items()}
    assert _state(db) == expected
    # the failed batch was halved down to the bad row: 1 + 2 per halving, not one per row
    assert 1 < helper_writes <= 1 + 2 * math.ceil(math.log2(N)), helper_writes


@pytest.mark.parametrize("op", OPS)
def test_mariadb_takes_no_savepoint(mariadb_engine, op):
    """InnoDB rolls a failed statement back alone: no savepoint per batch (the old path took
    one per statement, and released it). PostgreSQL keeps one: an error aborts its whole
    transaction."""
    engine = mariadb_engine
    db = _db(engine, "single", op)
    keys, cols, rows = _input(db, op, bad=3 if op in WITH_VALUES else None)
    _fill(db)
    with engine.begin() as conn:

        def savepoints() -> int:
            row = conn.exec_driver_sql("SHOW SESSION STATUS LIKE 'Com_savepoint'").one()
            return int(row[1])

        before = savepoints()
        out = helper(db, op, conn, keys, cols, rows)
        assert savepoints() == before
    assert out.applied


def test_a_statement_timeout_is_a_dependency_failure_on_the_direct_path(pg_engine):
    """The columnar path runs on the caller's connection: the session's statement_timeout
    holds, and its error leaves as RetryableError (the engine retries the chunk)."""
    from airflow_keyset_provider.core.errors import RetryableError
    from airflow_keyset_provider.core.writeback import update_columns

    engine = pg_engine
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE slow (id bigint PRIMARY KEY, status text NOT NULL)")
        conn.exec_driver_sql("INSERT INTO slow VALUES (1, 'PENDING')")
        conn.exec_driver_sql(
            "CREATE FUNCTION slow_trigger() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM pg_sleep(5); RETURN NEW; END $$"
        )
        conn.exec_driver_sql(
            "CREATE TRIGGER slow BEFORE UPDATE ON slow FOR EACH ROW EXECUTE FUNCTION slow_trigger()"
        )
    with pytest.raises(RetryableError, match="57014"), engine.begin() as conn:
        conn.exec_driver_sql("SET LOCAL statement_timeout = 200")
        update_columns(conn, "slow", "id", {"id": [1], "status": ["DONE"]})


def test_update_columns_refuses_columns_of_different_lengths(pg_engine):
    from airflow_keyset_provider.core.errors import ConfigurationError
    from airflow_keyset_provider.core.writeback import update_columns

    with pg_engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (id bigint PRIMARY KEY, status text)")
        with pytest.raises(ConfigurationError, match="differ in length"):
            update_columns(conn, "t", "id", {"id": [1, 2], "status": ["x"]})
        with pytest.raises(ConfigurationError, match="appears twice"):
            update_columns(conn, "t", "id", {"id": [1, 1], "status": ["x", "y"]})


@pytest.mark.parametrize("op", OPS)
def test_the_callers_savepoint_decides_as_the_exactly_once_ledger_needs(engine, op):
    """The ledger keeps each chunk in a savepoint of the target transaction (``core/run/
    ledger.py``): rolling it back must undo the helper's writes of that chunk, even after a
    row failed inside the helper, while the transaction's earlier work commits."""
    db = _db(engine, "single", op)
    keys, cols, rows = _input(db, op, bad=5 if op in WITH_VALUES else None)
    _fill(db)
    before = _state(db)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"UPDATE {db.table} SET qty = 0 WHERE id = 1")  # earlier work
        chunk = conn.begin_nested()
        out = helper(db, op, conn, keys, cols, rows)
        assert out.applied
        chunk.rollback()  # the processor raised after the helper: the chunk is replayed
    after = _state(db)
    assert after.pop(1) == (before.pop(1)[0], 0)
    assert after == before


@pytest.mark.parametrize("shape_name", ["single", "composite"])
@pytest.mark.parametrize("op", OPS)
def test_psycopg2_writes_a_batch_in_one_round_trip(pg_engine, op, shape_name):
    """psycopg2 returns only the last statement's rows of a text, so the savepoint's release
    was a second round trip per batch (the old path: 2 executes). The positions now travel in
    a transaction-local setting read after the release: one execute, the same outcome."""
    import logging

    from psycopg2.extras import LoggingConnection

    texts: list[str] = []

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            texts.append(str(record.msg))

    log = logging.getLogger(f"keyset.test.roundtrips.{op}.{shape_name}")
    log.addHandler(Count())
    log.propagate = False
    log.setLevel(logging.DEBUG)
    url = pg_engine.url.set(drivername="postgresql+psycopg2")
    engine = sa.create_engine(url)

    @sa.event.listens_for(engine, "do_connect")
    def _logged(dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
        dbapi_conn = dialect.loaded_dbapi.connect(
            *cargs, connection_factory=LoggingConnection, **cparams
        )
        dbapi_conn.initialize(log)
        return dbapi_conn

    try:
        db = _db(engine, shape_name, op)
        keys, cols, rows = _input(db, op)
        found, by_hand = _by_hand(db, op, keys, cols)
        _fill(db)
        with engine.connect() as conn:  # the table reflected, once per engine: not counted
            helper(db, op, conn, keys, cols, rows)
            conn.rollback()
        with engine.begin() as conn:
            conn.exec_driver_sql("SELECT 1")
            texts.clear()
            out = helper(db, op, conn, keys, cols, rows)
            sent = list(texts)
        assert len(sent) == 1, sent
        assert "RELEASE SAVEPOINT" in sent[0]
        assert out.applied == [k for k in keys if k in found]
        assert out.not_applied == [k for k in keys if k not in found]
        assert _state(db) == by_hand
    finally:
        engine.dispose()
