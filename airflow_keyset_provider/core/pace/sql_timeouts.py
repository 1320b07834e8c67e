"""Every statement of a health probe or of the checkpoint mirror runs with a time limit.

A probe or a mirror write that waits on a lock would otherwise hold up the range's loop for ever,
and with it the range's lease (the heartbeat beats from its own thread). ``bounded_connection``
is the one place that sets the limits, per dialect (a per-database interface in ``core/sql/`` may
take this over):

- PostgreSQL: ``SET LOCAL statement_timeout`` and ``SET LOCAL lock_timeout`` in the connection's
  own transaction (an autocommit engine, like the source's, gets a READ COMMITTED transaction for
  the block, so ``SET LOCAL`` holds); a statement past the limit fails with the server's error
  (``canceling statement due to statement timeout`` / ``lock timeout``).
- SQLite: ``PRAGMA busy_timeout`` (what sqlite3's ``timeout`` sets) for the block, restored
  after; SQLite has no statement timeout, only lock waits are bounded.
- MySQL/MariaDB: ``innodb_lock_wait_timeout`` and ``lock_wait_timeout`` (whole seconds, at
  least 1) and the statement limit (MariaDB ``max_statement_time``; MySQL 8
  ``max_execution_time``, SELECT only) for the block, the session's values restored after.
- other dialects: no limit is set here.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import sqlalchemy as sa


def timeout_ms(seconds: float) -> int:
    """A limit in whole milliseconds, at least 1 (0 would mean "no limit" to PostgreSQL)."""
    return max(1, math.ceil(seconds * 1000))


@contextlib.contextmanager
def bounded_connection(engine: sa.Engine, seconds: float) -> Iterator[sa.Connection]:
    """A connection inside a transaction (committed when the block ends, rolled back if it
    raises) in which every statement and every lock wait is limited to ``seconds``."""
    ms = timeout_ms(seconds)
    with engine.connect() as conn:
        dialect = engine.dialect.name
        if dialect == "postgresql":
            conn.execution_options(isolation_level="READ COMMITTED")  # reset when returned
        with conn.begin():
            if dialect == "postgresql":
                conn.exec_driver_sql(f"SET LOCAL statement_timeout = {ms}")
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = {ms}")
                yield conn
            elif dialect == "sqlite":
                previous = int(conn.exec_driver_sql("PRAGMA busy_timeout").scalar() or 0)
                conn.exec_driver_sql(f"PRAGMA busy_timeout = {ms}")
                try:
                    yield conn
                finally:
                    try:
                        conn.exec_driver_sql(f"PRAGMA busy_timeout = {previous}")
                    except Exception:
                        conn.invalidate()  # never hand the pool a connection with our limit
            elif dialect == "mysql":
                with _mysql_limits(conn, seconds, bool(getattr(engine.dialect, "is_mariadb", 0))):
                    yield conn
            else:
                yield conn


@contextlib.contextmanager
def _mysql_limits(conn: sa.Connection, seconds: float, mariadb: bool) -> Iterator[None]:
    """The session limits of MySQL/MariaDB for the block (see module doc), restored after."""
    whole = max(1, math.ceil(seconds))
    limits = {"innodb_lock_wait_timeout": str(whole), "lock_wait_timeout": str(whole)}
    if mariadb:
        limits["max_statement_time"] = repr(float(seconds))
    else:
        limits["max_execution_time"] = str(timeout_ms(seconds))
    names = ", ".join(f"@@session.{n}" for n in limits)
    previous = conn.exec_driver_sql(f"SELECT {names}").one()
    conn.exec_driver_sql("SET " + ", ".join(f"SESSION {n} = {v}" for n, v in limits.items()))
    try:
        yield
    finally:
        try:
            restore = ", ".join(f"SESSION {n} = %s" for n in limits)
            conn.exec_driver_sql("SET " + restore, tuple(previous))
        except Exception:
            conn.invalidate()  # never hand the pool a connection with our limit
