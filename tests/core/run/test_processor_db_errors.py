"""A database error a processor raises itself (a write through ``chunk.connection``, not the
write-back helpers) is reported by its class, never its text (issue 28, item 2): the text
quotes the value (``invalid input syntax for type integer: "<value>"``). Checked in every
place it could surface: the dead letters of an isolated bad row, the warnings of each retry,
and the ``DependencyFailedError`` that ends an outage, its traceback and causes included.
Real PostgreSQL (both drivers) and Redis."""

from __future__ import annotations

import logging
import traceback
from typing import Any

import pytest
import sqlalchemy as sa
from core_support import make_events, traversal

from airflow_keyset_provider.core import DependencyFailedError

MARKER = "ssn-987-65-4321-MARKER"


def _log_text(caplog: pytest.LogCaptureFixture) -> str:
    formatter = logging.Formatter()
    out = []
    for record in caplog.records:
        out.append(record.getMessage())
        if record.exc_info:
            out.append(formatter.formatException(record.exc_info))
    return "\n".join(out)


@pytest.fixture(params=["postgresql+psycopg2", "postgresql+psycopg"])
def url(request: pytest.FixtureRequest, pg_engine: sa.Engine) -> str:
    make_events(pg_engine, list(range(1, 31)))
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE sink (seq bigint PRIMARY KEY, n integer)"))
    return pg_engine.url.set(drivername=request.param).render_as_string(hide_password=False)


def _insert(chunk: Any, bad: set[int]) -> None:
    chunk.connection.execute(
        sa.text(  # idempotent: the canary delivers a row again
            "INSERT INTO sink VALUES (:s, CAST(:n AS integer)) "
            "ON CONFLICT (seq) DO UPDATE SET n = EXCLUDED.n"
        ),
        [{"s": k, "n": MARKER if k in bad else str(k)} for k in chunk.keys],
    )


def test_a_bad_row_s_database_error_is_dead_lettered_by_class(
    url: str, redis_url: str, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    t = traversal(url, redis_url, key_prefix, target_url=url)
    try:
        rnd = t.plan(max_ranges=1, new_stream=True)
        res = t.traverse(
            rnd.round_id,
            0,
            lambda chunk: _insert(chunk, {17}),
            chunk_size=10,
            max_item_attempts=1,
            item_retry_delay=0,
            backoff_base=0.01,
        )
        assert res.complete and res.dead == 1
        letters = t.control.dead_letters(rnd.round_id, 0, 10)
    finally:
        t.close()
    assert [d["key"] for d in letters] == [17]
    assert "22P02" in letters[0]["error"] and "DataError" in letters[0]["error"]
    assert MARKER not in str(letters) and MARKER not in _log_text(caplog)


def test_an_outage_of_database_errors_ends_without_their_text(
    url: str, redis_url: str, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    t = traversal(url, redis_url, key_prefix, target_url=url)
    try:
        rnd = t.plan(max_ranges=1, new_stream=True)
        with pytest.raises(DependencyFailedError) as raised:
            t.traverse(
                rnd.round_id,
                0,
                lambda chunk: _insert(chunk, set(chunk.keys)),  # every row, every time
                chunk_size=10,
                max_chunk_attempts=2,
                backoff_base=0.01,
            )
    finally:
        t.close()
    text = "".join(traceback.format_exception(raised.value))  # with its causes
    assert "22P02" in text
    assert MARKER not in text and MARKER not in _log_text(caplog)
