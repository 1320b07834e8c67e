"""The call's connection and its database's backend: where a helper meets the database.

:func:`connection` gives a helper its ``Connection`` (the caller's, or a transaction of its own
on an ``Engine``) and turns a dependency's error into ``RetryableError``; :func:`resolve` pairs
the table and key (a :class:`~.target.Target`, pure data) with the backend of the connection's
database family. This module imports both sides; neither side imports it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from airflow_keyset_provider.core.errors import ConfigurationError, KeyValidationError

from ..row_data import redact
from .backends import Backend, backend_for, fault_in, load
from .failures import Fault, dependency_error
from .reflection import TableRef, reflect
from .target import Target, column_names

Bind = Connection | Engine


@contextmanager
def connection(bind: Bind) -> Iterator[Connection]:
    """The caller's ``Connection`` as is, or a transaction of its own on an ``Engine`` (committed
    when the block ends without error), also on an AUTOCOMMIT engine (``KeysetHook.get_conn``,
    ``make_engine``): the call's connection is switched to the database's default isolation
    level, and back when it returns to the pool. A ``Connection`` in AUTOCOMMIT is refused: it
    has no transaction for the savepoints, nor for the caller to roll back. A database error in
    the block that is the dependency's fault (see ``failures.py``) leaves it as
    ``RetryableError``; any other as it is, its bound parameters hidden (``row_data.py``)."""
    if not isinstance(bind, Engine | Connection):
        raise ConfigurationError(
            f"expected a SQLAlchemy Connection or Engine, got {type(bind).__name__}."
        )
    try:
        if isinstance(bind, Engine):
            with bind.connect() as conn:
                if _autocommit(conn):
                    conn.execution_options(isolation_level=conn.default_isolation_level)
                with conn.begin():
                    yield conn
        else:
            if _autocommit(bind):
                raise ConfigurationError(
                    "the write-back helpers need a Connection with a transaction, not one in "
                    "AUTOCOMMIT (every statement would commit at once, savepoints fail). Pass "
                    "the engine itself, or use `conn.execution_options(isolation_level="
                    "'READ COMMITTED')` before `conn.begin()`."
                )
            yield bind
    except sa.exc.StatementError as exc:
        redact(exc)  # no row data in its text (see row_data.py)
        if (
            isinstance(exc, sa.exc.DBAPIError)
            and fault_in(bind.dialect.name, exc) is Fault.DEPENDENCY
        ):
            raise dependency_error(exc) from exc
        raise


def _autocommit(conn: Connection) -> bool:
    backend = load(conn.dialect.name)  # an unsupported database is refused later, by name
    return backend is not None and backend.autocommit(conn)


def resolve(conn: Connection, table: TableRef, key: str | Sequence[str]) -> tuple[Target, Backend]:
    """The table (reflected if named) with its key, and the backend of ``conn``'s database. An
    unsupported database is refused before anything is reflected."""
    backend = backend_for(conn)
    resolved = reflect(conn, table)
    names = column_names(key, "key")
    missing = [n for n in names if n not in resolved.c]
    if missing:
        raise KeyValidationError(
            f"key column(s) {missing} not in table {resolved.fullname!r}; its columns are "
            f"{list(resolved.c.keys())} (names are case-sensitive)."
        )
    return Target(resolved, names), backend
