"""No row data in logs: a failing write-back leaves its bound parameters out of every log record,
every reason it returns and every error it raises, unless ``AIRFLOW_KEYSET_LOG_ROW_DATA=1``.

The rows carry distinctive values; the tests capture every log record (the ``sqlalchemy.engine``
logger at DEBUG, so each statement is logged) and look for them.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from airflow_keyset_provider.core.errors import RetryableError
from airflow_keyset_provider.core.sql.source import make_engine
from airflow_keyset_provider.core.writeback import guarded_update, update_rows, upsert

DATABASES = ["postgresql+psycopg2", "postgresql+psycopg", "sqlite"]
NOTE, STATUS = "SECRET-7f3a-note", "SECRET-9q2z"  # in the rows written, never in a log


@pytest.fixture(params=DATABASES)
def url(request: pytest.FixtureRequest) -> str:
    if request.param == "sqlite":
        return str(request.getfixturevalue("sqlite_url"))
    pg_engine: sa.Engine = request.getfixturevalue("pg_engine")
    return pg_engine.url.set(drivername=request.param).render_as_string(hide_password=False)


def _orders(engine: sa.Engine) -> None:
    """``orders`` 1..4, PENDING, ``qty >= 0`` checked."""
    table = sa.Table(
        "orders",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("qty", sa.Integer, sa.CheckConstraint("qty >= 0", name="qty_not_negative")),
        sa.Column("note", sa.Text),
    )
    table.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(
            table.insert(), [{"id": i, "status": "PENDING", "qty": i} for i in (1, 2, 3, 4)]
        )


@pytest.fixture
def plain_engine(url: str) -> Iterator[sa.Engine]:
    """A caller's own engine, made without ``hide_parameters``, with ``orders``."""
    engine = sa.create_engine(url)
    _orders(engine)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture(params=DATABASES[:2])
def pg_plain_engine(request: pytest.FixtureRequest, pg_engine: sa.Engine) -> Iterator[sa.Engine]:
    """``plain_engine`` on PostgreSQL only (row locks), both drivers."""
    engine = sa.create_engine(pg_engine.url.set(drivername=request.param))
    _orders(engine)
    try:
        yield engine
    finally:
        engine.dispose()


def _bad_batch() -> list[dict]:
    """Row 2 violates the CHECK and carries the distinctive values, as do the good rows."""
    return [
        {"id": i, "status": STATUS, "qty": -1 if i == 2 else 7, "note": NOTE} for i in (1, 2, 3)
    ]


def _texts(caplog: pytest.LogCaptureFixture) -> list[str]:
    formatter = logging.Formatter()
    texts = []
    for record in caplog.records:
        texts.append(record.getMessage())
        if record.exc_info:
            texts.append(formatter.formatException(record.exc_info))
    return texts


def test_a_failing_write_back_logs_and_reports_no_row_data(url, plain_engine, caplog):
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="sqlalchemy.engine")  # log every statement
    engine = make_engine(url)  # the engine the project makes (KeysetHook.get_conn)
    try:
        rows = _bad_batch()
        reasons = []
        for outcome in (
            update_rows(engine, "orders", "id", rows),
            upsert(engine, "orders", rows, conflict="id", update=["status", "qty", "note"]),
            guarded_update(
                engine, "orders", "id", [1, 2], {"note": NOTE, "qty": sa.text("qty - 7")}
            ),
        ):
            assert list(outcome.failed) == [2]
            reasons.extend(outcome.failed.values())
    finally:
        engine.dispose()

    texts = _texts(caplog)
    assert any("UPDATE" in t for t in texts), "statements were logged: the check is not vacuous"
    leaked = [t for t in [*texts, *reasons] if NOTE in t or STATUS in t]
    assert leaked == []
    assert any("parameters hidden" in t for t in texts)
    assert all("qty_not_negative" in r or "CHECK" in r for r in reasons)


def test_an_error_a_helper_raises_hides_its_parameters_whatever_the_engine(plain_engine):
    # the good rows' values are bound parameters of the failing statement; the bad row has none
    # of them (PostgreSQL's DETAIL line quotes the failing row: the database's text, not ours)
    rows = [{"id": 1, "qty": 7, "note": NOTE}, {"id": 2, "qty": -1, "note": None}]
    with pytest.raises(sa.exc.IntegrityError) as raised:
        update_rows(plain_engine, "orders", "id", rows, isolate_failures=False)
    text = "".join(traceback.format_exception(raised.value))  # with its causes
    assert "SQL parameters hidden" in text
    assert NOTE not in text


def test_a_dependency_failure_carries_no_row_data(pg_plain_engine):
    with pg_plain_engine.connect() as holder, pg_plain_engine.connect() as conn:
        holder.begin()
        holder.exec_driver_sql("SELECT * FROM orders WHERE id = 2 FOR UPDATE")
        conn.begin()
        conn.exec_driver_sql("SET LOCAL lock_timeout = '50ms'")
        with pytest.raises(RetryableError, match="55P03") as raised:
            update_rows(conn, "orders", "id", [{"id": i, "note": NOTE} for i in (1, 2, 3)])
        conn.rollback()
        holder.rollback()
    text = "".join(traceback.format_exception(raised.value))  # with its causes
    assert "SQL parameters hidden" in text
    assert NOTE not in text


def test_log_row_data_shows_the_parameters_for_debugging(url, plain_engine, monkeypatch):
    monkeypatch.setenv("AIRFLOW_KEYSET_LOG_ROW_DATA", "1")
    engine = make_engine(url)
    try:
        assert engine.hide_parameters is False
    finally:
        engine.dispose()
    with pytest.raises(sa.exc.IntegrityError) as raised:
        update_rows(plain_engine, "orders", "id", _bad_batch(), isolate_failures=False)
    assert "[parameters:" in str(raised.value) and NOTE in str(raised.value)
