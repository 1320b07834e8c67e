"""MySQL/MariaDB chunks never stay in the driver's cursor: each fetch reads its rows and closes
its cursor before it returns. A held chunk (``FetchedRows``) is closed by the thread that
releases it while the prefetch thread runs the next query on the same connection, and
mysqlclient's ``cursor.close()`` reads the connection: a no-op traversal failed with "This
connection is already in use from another thread"."""

from __future__ import annotations

import _services
import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.core.keys import MIN_KEY, encode_key
from airflow_keyset_provider.core.sql.fetch import FetchedRows
from airflow_keyset_provider.core.sql.source import SqlSource


def _seq(url: str, n: int) -> None:
    eng = sa.create_engine(url, poolclass=NullPool)
    with eng.begin() as c:
        c.exec_driver_sql("CREATE TABLE ev (id bigint PRIMARY KEY, p int NOT NULL)")
        c.exec_driver_sql(f"INSERT INTO ev SELECT seq, MOD(seq, 7) FROM seq_1_to_{n}")
    eng.dispose()


def _url(base: str, driver: str) -> str:
    if driver == "mysqldb":
        _services.require_module("MySQLdb", _services.MYSQLCLIENT_WHY)
    url = sa.engine.make_url(base).set(drivername=f"mysql+{driver}")
    return url.render_as_string(hide_password=False)


@pytest.mark.parametrize("driver", ["pymysql", "mysqldb"])
def test_a_fetched_chunk_holds_no_cursor(mariadb_db_url, driver):
    _seq(mariadb_db_url, 50)
    src = SqlSource(_url(mariadb_db_url, driver), "ev", "id")
    try:
        src.validate()
        rows = src.fetch(MIN_KEY, encode_key((50,)), 20)
        assert not isinstance(rows, FetchedRows)
        assert [r[0] for r in rows] == list(range(1, 21))
    finally:
        src.close()


@pytest.mark.parametrize("driver", ["pymysql", "mysqldb"])
def test_a_no_op_traversal_with_prefetch_reads_every_row(
    mariadb_db_url, redis_url, key_prefix, driver
):
    """The processor never reads the rows, so every chunk is released unread by the loop while
    the next one is prefetched."""
    _seq(mariadb_db_url, 20_000)
    t = KeysetTraversal(
        _url(mariadb_db_url, driver),
        table="ev",
        key="id",
        redis_url=redis_url,
        stream="ev",
        key_prefix=key_prefix,
    )
    try:
        rnd = t.plan(max_ranges=1, new_stream=True)
        res = t.traverse(rnd.round_id, 0, lambda chunk: None, chunk_size=100, prefetch=True)
        assert res.complete and res.rows_read == 20_000 and res.chunks >= 200
    finally:
        t.close()
