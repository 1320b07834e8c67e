"""The write-back helpers on the project's own engines, which are AUTOCOMMIT.

``KeysetHook.get_conn`` and ``make_engine`` give autocommit engines (a traversal never holds a
snapshot open). A helper given such an engine still runs its call in one transaction with a
savepoint per statement; a ``Connection`` in AUTOCOMMIT is refused, as it has no transaction.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from airflow_keyset_provider.core.errors import ConfigurationError
from airflow_keyset_provider.core.sql.source import make_engine
from airflow_keyset_provider.core.writeback import guarded_update, update_rows

DATABASES = ["postgresql+psycopg2", "postgresql+psycopg", "sqlite"]


@pytest.fixture(params=DATABASES)
def url(request: pytest.FixtureRequest) -> str:
    if request.param == "sqlite":
        return str(request.getfixturevalue("sqlite_url"))
    pg_engine: sa.Engine = request.getfixturevalue("pg_engine")
    return pg_engine.url.set(drivername=request.param).render_as_string(hide_password=False)


@pytest.fixture
def autocommit_engine(url: str) -> Iterator[sa.Engine]:
    engine = make_engine(url)
    table = sa.Table(
        "orders",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("qty", sa.Integer, sa.CheckConstraint("qty >= 0", name="qty_not_negative")),
    )
    table.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(table.insert(), [{"id": i, "qty": i} for i in range(1, 5)])
    try:
        yield engine
    finally:
        engine.dispose()


def _qty(engine: sa.Engine) -> dict[int, int]:
    with engine.connect() as conn:
        return {i: q for i, q in conn.exec_driver_sql("SELECT id, qty FROM orders")}


def test_an_autocommit_engine_gets_a_transaction_and_bad_rows_still_fail_alone(autocommit_engine):
    rows = [{"id": 1, "qty": 10}, {"id": 2, "qty": -1}, {"id": 3, "qty": 30}]
    outcome = update_rows(autocommit_engine, "orders", "id", rows)

    assert outcome.applied == [1, 3]
    assert list(outcome.failed) == [2]
    assert "qty_not_negative" in outcome.failed[2] or "CHECK" in outcome.failed[2]
    assert _qty(autocommit_engine) == {1: 10, 2: 2, 3: 30, 4: 4}  # committed when it returned
    with autocommit_engine.connect() as conn:  # the pooled connection is AUTOCOMMIT again
        assert autocommit_engine.dialect.name == "sqlite" or (
            conn.connection.dbapi_connection.autocommit is True  # type: ignore[union-attr]
        )


def test_a_connection_in_autocommit_is_refused_before_anything_is_written(autocommit_engine):
    with (
        autocommit_engine.connect() as conn,
        pytest.raises(ConfigurationError, match="AUTOCOMMIT"),
    ):
        guarded_update(conn, "orders", "id", [1, 2], values={"qty": 0})
    assert _qty(autocommit_engine) == {1: 1, 2: 2, 3: 3, 4: 4}
