"""MariaDB as a source, end to end: sessions with timeouts at READ COMMITTED, chunks as index range
scans (composite keys included), plans cut without reading the table and balanced on a skewed
key, and ``plan``/``traverse``/``close_round`` over single and ``(created_at, id)`` keys."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import Any

import _services
import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.core.keys import encode_key
from airflow_keyset_provider.core.sql import source as source_mod
from airflow_keyset_provider.core.sql.source import SqlSource


def _exec(url: str, *statements: str) -> None:
    eng = sa.create_engine(url, poolclass=NullPool)
    with eng.begin() as c:
        for s in statements:
            c.exec_driver_sql(s)
    eng.dispose()


def _events(url: str, n: int) -> None:
    """``ev``: ``n`` rows, ten per second from 2026-01-01, keyed by ``(created_at, id)``."""
    _exec(
        url,
        "CREATE TABLE ev (id bigint NOT NULL, created_at datetime(6) NOT NULL, p int NOT NULL, "
        "PRIMARY KEY (id), UNIQUE KEY by_time (created_at, id))",
        "INSERT INTO ev SELECT seq, TIMESTAMP'2026-01-01 00:00:00' + INTERVAL (seq DIV 10) SECOND, "
        f"MOD(seq, 7) FROM seq_1_to_{n}",
    )


def test_the_source_sessions_read_committed_with_statement_and_lock_timeouts(mariadb_db_url):
    _events(mariadb_db_url, 10)
    src = SqlSource(mariadb_db_url, "ev", "id")
    src.validate()
    src.fetch("", encode_key((10,)), 5)  # the hot path's own connection
    for conn in [src._conns[0], src.engine.connect()]:
        iso, lock, stmt, autocommit = conn.exec_driver_sql(
            "SELECT @@session.tx_isolation, @@session.innodb_lock_wait_timeout, "
            "@@session.max_statement_time, @@session.autocommit"
        ).one()
        assert (iso, int(lock), float(stmt), int(autocommit)) == (
            "READ-COMMITTED",
            int(source_mod.LOCK_TIMEOUT_S),
            source_mod.STATEMENT_TIMEOUT_S,
            1,
        )
    src.close()


def _handler_reads(c: sa.Connection) -> int:
    rows = c.exec_driver_sql("SHOW SESSION STATUS LIKE 'Handler_read%%'").all()
    return sum(int(v) for _k, v in rows)


def test_a_composite_key_chunk_is_an_index_range_scan(mariadb_db_url):
    """MariaDB scans the index from its start for ``(created_at, id) > (x, y)``; the dialect's
    expanded form is a range on ``by_time`` starting at the cursor, so a chunk of 100 rows deep
    into the table reads about 100 index entries (the session's handler counters), not the
    19,000 before the cursor."""
    _events(mariadb_db_url, 20_000)
    _exec(mariadb_db_url, "ANALYZE TABLE ev")
    src = SqlSource(mariadb_db_url, "ev", ["created_at", "id"])
    src.validate()
    sql, params_for = src.driver_call(src._chunk_statement(True))
    lo, hi = (dt.datetime(2026, 1, 1, 0, 31, 40), 19_000), (dt.datetime(2026, 1, 2), 0)
    values = {"n": 100, "c0": lo[0], "c1": lo[1], "h0": hi[0], "h1": hi[1]}
    with src.engine.connect() as c:
        plan = c.exec_driver_sql("EXPLAIN " + sql, params_for(values)).mappings().one()
        before = _handler_reads(c)
        rows = c.exec_driver_sql(sql, params_for(values)).all()
        reads = _handler_reads(c) - before
    assert (plan["type"], plan["key"]) == ("range", "by_time")
    assert [r[1] for r in rows] == list(range(19_001, 19_101))
    assert reads < 500, reads
    src.close()


def _traversal(url: str, redis_url: str, key_prefix: str, key: Any) -> KeysetTraversal:
    return KeysetTraversal(
        url, table="ev", key=key, redis_url=redis_url, stream="ev", key_prefix=key_prefix
    )


@pytest.mark.parametrize("driver", ["pymysql", "mysqldb"])
def test_plan_traverse_close_round_with_single_and_composite_keys(
    mariadb_db_url, redis_url, key_prefix, driver
):
    """With either driver: PyMySQL (pure Python) and mysqlclient (``mysql+mysqldb://``, the
    faster one, the ``mysql-native`` extra)."""
    if driver == "mysqldb":
        _services.require_module("MySQLdb", _services.MYSQLCLIENT_WHY)
    url = sa.engine.make_url(mariadb_db_url).set(drivername=f"mysql+{driver}")
    url_s = url.render_as_string(hide_password=False)
    _events(mariadb_db_url, 3_000)
    for key, prefix in [("id", f"{key_prefix}:a"), (["created_at", "id"], f"{key_prefix}:b")]:
        t = _traversal(url_s, redis_url, prefix, key)
        rnd = t.plan(max_ranges=4, new_stream=True)
        assert len(rnd.ranges) == 4
        seen: Counter = Counter()
        record = seen.update
        for r in rnd.ranges:
            res = t.traverse(
                rnd.round_id, r.range_id, lambda ch, rec=record: rec(ch.keys), chunk_size=97
            )
            assert res.complete
        assert len(seen) == 3_000 and set(seen.values()) == {1}
        totals = t.close_round(rnd.round_id)
        assert totals.done == 3_000
        t.close()


def _rows_read(url: str, table: str) -> int:
    eng = sa.create_engine(url, poolclass=NullPool)
    db = sa.engine.make_url(url).database
    with eng.connect() as c:
        n = c.exec_driver_sql(
            "SELECT COALESCE(SUM(ROWS_READ), 0) FROM information_schema.TABLE_STATISTICS "
            f"WHERE TABLE_SCHEMA = '{db}' AND TABLE_NAME = '{table}'"
        ).scalar_one()
    eng.dispose()
    return int(n)


def test_a_skewed_table_is_planned_in_balanced_ranges_without_reading_it(
    mariadb_db_url, mariadb_url, redis_url, key_prefix
):
    """100,000 dense keys (1..100,000) and 100,000 sparse ones (every 10,000th up to 10^9): cut
    by key value, one range would hold half the rows. The plan bisects EXPLAIN estimates, so
    each of 8 ranges holds about 25,000 rows, and it reads a handful of rows of the table (one
    per cut; per-table row counters of MariaDB's user statistics), not 200,000."""
    _exec(
        mariadb_db_url,
        "CREATE TABLE ev (id bigint NOT NULL PRIMARY KEY, p int NOT NULL)",
        "INSERT INTO ev SELECT seq, 0 FROM seq_1_to_100000",
        "INSERT INTO ev SELECT 100000 + seq * 10000, 0 FROM seq_1_to_100000",
        "ANALYZE TABLE ev",
    )
    admin = sa.create_engine(mariadb_url, poolclass=NullPool)
    with admin.connect() as c:
        userstat = int(c.exec_driver_sql("SELECT @@global.userstat").scalar_one())
        c.exec_driver_sql("SET GLOBAL userstat = 1")
    try:
        before = _rows_read(mariadb_db_url, "ev")
        t = KeysetTraversal(
            mariadb_db_url,
            table="ev",
            key="id",
            redis_url=redis_url,
            stream="ev",
            key_prefix=key_prefix,
        )
        rnd = t.plan(max_ranges=8, exact_limit=1_000, new_stream=True)
        read = _rows_read(mariadb_db_url, "ev") - before
    finally:
        with admin.connect() as c:
            c.exec_driver_sql(f"SET GLOBAL userstat = {userstat}")
        admin.dispose()
    assert read < 100, read
    eng = sa.create_engine(mariadb_db_url, poolclass=NullPool)
    sizes = []
    with eng.connect() as c:
        for r in rnd.ranges:
            q = "SELECT COUNT(*) FROM ev WHERE id <= %s" + (
                " AND id > %s" if r.lo is not None else ""
            )
            args = (r.hi,) if r.lo is None else (r.hi, r.lo)
            sizes.append(int(c.exec_driver_sql(q, args).scalar_one()))
    eng.dispose()
    assert sum(sizes) == 200_000 and len(sizes) == 8
    assert max(sizes) <= 1.5 * min(sizes), sizes
    t.close()


def test_a_statement_behind_a_table_lock_fails_after_the_lock_timeout(mariadb_db_url, monkeypatch):
    """A session holding ``LOCK TABLES ev WRITE`` (as an ``ALTER TABLE`` holds its metadata
    lock): the source's read fails with 1205 after ``LOCK_TIMEOUT_S`` instead of waiting the
    server's default of a day, and the error is classified as transient."""
    _events(mariadb_db_url, 10)
    monkeypatch.setattr(source_mod, "LOCK_TIMEOUT_S", 1.0)
    src = SqlSource(mariadb_db_url, "ev", "id")
    src.validate()
    holder = sa.create_engine(mariadb_db_url, poolclass=NullPool).connect()
    holder.exec_driver_sql("LOCK TABLES ev WRITE")
    try:
        # the hot path runs on the raw DBAPI cursor: the driver's own error
        with pytest.raises(src.engine.dialect.loaded_dbapi.OperationalError) as info:
            src.fetch("", encode_key((10,)), 5)
        assert info.value.args[0] == 1205
        assert src.db is not None and src.db.classify_row_error(info.value) == "retry"
    finally:
        holder.exec_driver_sql("UNLOCK TABLES")
        holder.close()
        src.close()


def test_a_statement_longer_than_the_statement_timeout_is_interrupted(mariadb_db_url, monkeypatch):
    monkeypatch.setattr(source_mod, "STATEMENT_TIMEOUT_S", 0.2)
    src = SqlSource(mariadb_db_url, "ev", "id")
    with src.engine.connect() as c, pytest.raises(sa.exc.DBAPIError) as info:
        c.exec_driver_sql("SELECT SLEEP(30)").all()
    assert info.value.orig.args[0] == 1969  # ER_STATEMENT_TIMEOUT
    assert src.db is not None and src.db.classify_row_error(info.value) == "retry"
    src.close()


def test_row_errors_are_classified_by_error_number(mariadb_db_url):
    """The write-back's question, per database: is a failed statement the row's fault?"""
    _exec(
        mariadb_db_url,
        "CREATE TABLE s (id int PRIMARY KEY, v int NOT NULL, CONSTRAINT pos CHECK (v > 0))",
        "INSERT INTO s VALUES (1, 1)",
    )
    src = SqlSource(mariadb_db_url, "s", "id")
    assert src.db is not None
    kinds = []
    for stmt in [
        "INSERT INTO s VALUES (1, 2)",  # 1062 duplicate key
        "INSERT INTO s VALUES (2, -1)",  # 4025 CHECK constraint
        "INSERT INTO s VALUES (3, NULL)",  # 1048 NULL into NOT NULL
        "INSERT INTO s VALUES (4, 99999999999)",  # 1264 out of range (strict mode)
    ]:
        with src.engine.connect() as c, pytest.raises(sa.exc.DBAPIError) as info:
            c.exec_driver_sql(stmt)
        kinds.append((info.value.orig.args[0], src.db.classify_row_error(info.value)))
    assert kinds == [(1062, "row"), (4025, "row"), (1048, "row"), (1264, "row")]
    src.close()
