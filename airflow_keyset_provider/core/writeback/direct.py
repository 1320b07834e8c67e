"""Statements compiled once, executed on the driver's cursor: the write path's hot loop.

A write-back call per chunk pays for what runs around its statement. Through SQLAlchemy's
``Connection.execute`` that was a third of the time of a 1,000-row batch on PostgreSQL (result
rows wrapped one by one, the statement looked up in the compiled cache, parameters processed);
here the statement text is compiled by SQLAlchemy once per shape (identifiers quoted by it,
every value a placeholder) and run on the DBAPI cursor of the caller's own connection, so it
shares the caller's transaction and the session's timeouts (``statement_timeout``,
``max_statement_time``).

Two things SQLAlchemy would have done are kept: ``before_cursor_execute`` /
``after_cursor_execute`` listeners of the engine still see every statement (logging, tracing,
the tests' statement counts), and a driver error leaves as SQLAlchemy's ``DBAPIError`` (wrapped
by ``DBAPIError.instance``, parameters hidden), a lost connection invalidated first, so
``failures.py`` classifies it as it classifies the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..row_data import hide_parameters

Params = Mapping[str, Any] | Sequence[Any] | None


def cursor_of(conn: Connection) -> Any:
    """A new DBAPI cursor on ``conn``'s driver connection (the caller's transaction)."""
    return conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]


def execute(
    conn: Connection,
    cursor: Any,
    sql: str,
    params: Params,
    fetch: bool,
    prefix: str = "",
    suffix: str = "",
    sent: str | None = None,
) -> list:
    """Run ``sql`` with ``params`` on ``cursor``; its rows if ``fetch`` (else ``[]``).

    Listeners of ``before_cursor_execute`` / ``after_cursor_execute`` are called as SQLAlchemy
    calls them (``context`` is None) with ``sql``; ``prefix`` (``SAVEPOINT x; ``) and
    ``suffix`` (``; RELEASE SAVEPOINT x; ...``) are sent around it in the same text without
    being reported (the rows are the last statement's); ``sent``, if given, is sent in place
    of ``sql`` (a frame around it, e.g. the CTE that carries its positions), still reported
    as ``sql``. A driver error is raised as
    ``sa.exc.DBAPIError``."""
    dispatch = conn.dispatch
    if dispatch.before_cursor_execute:
        for fn in dispatch.before_cursor_execute:
            fn(conn, cursor, sql, params, None, False)
    try:
        text = prefix + (sql if sent is None else sent) + suffix
        if params is None:
            cursor.execute(text)
        else:
            cursor.execute(text, params)
        rows = cursor.fetchall() if fetch else []
    except Exception as exc:
        raise wrap(conn, cursor, sql, params, exc) from exc
    if dispatch.after_cursor_execute:
        for fn in dispatch.after_cursor_execute:
            fn(conn, cursor, sql, params, None, False)
    return rows


def send(conn: Connection, cursor: Any, sql: str) -> None:
    """Run a statement of the helper's own (``SAVEPOINT``), unreported to listeners; a driver
    error is raised as ``sa.exc.DBAPIError``."""
    try:
        cursor.execute(sql)
    except Exception as exc:
        raise wrap(conn, cursor, sql, None, exc) from exc


def wrap(conn: Connection, cursor: Any, sql: str, params: Params, exc: Exception) -> Exception:
    """``exc`` as SQLAlchemy would raise it: a driver error becomes ``DBAPIError`` (its
    parameters hidden unless row data may be logged), the connection invalidated if it is lost;
    anything else is returned as is."""
    dialect = conn.dialect
    dbapi = dialect.loaded_dbapi
    if not isinstance(exc, dbapi.Error):
        return exc
    lost = dialect.is_disconnect(exc, conn.connection.dbapi_connection, cursor)
    wrapped = sa.exc.DBAPIError.instance(
        sql,
        params,
        exc,
        dbapi.Error,
        hide_parameters=hide_parameters(),
        dialect=dialect,
        connection_invalidated=lost,
    )
    if lost:
        conn.invalidate(exc)
    return wrapped
