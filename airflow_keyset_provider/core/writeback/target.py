"""The table a call writes, the key that names its rows in outcomes, and the call's connection."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine, Row
from sqlalchemy.sql.elements import ColumnElement

from airflow_keyset_provider.core.errors import ConfigurationError, KeyValidationError

from ..row_data import redact
from .backends import Backend, backend_for, fault_in, load
from .failures import Fault, dependency_error
from .reflection import TableRef, reflect

Key = Any  # a scalar for a one-column key, a tuple for a composite key
Bind = Connection | Engine
Guard = Mapping[str, Any] | ColumnElement[bool] | None


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


def column_names(spec: str | Sequence[str], what: str) -> tuple[str, ...]:
    names = (spec,) if isinstance(spec, str) else tuple(spec)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigurationError(
            f"{what} must be a column name or a sequence of them, got {spec!r}."
        )
    if len(set(names)) != len(names):
        raise ConfigurationError(f"{what} names a column twice: {list(names)}.")
    return names


class Target:
    """A table plus the key that names its rows in outcomes, on one database family."""

    def __init__(self, table: sa.Table, key_names: tuple[str, ...], backend: Backend) -> None:
        self.table = table
        self.key_names = key_names
        self.key_cols = tuple(table.c[n] for n in key_names)
        self.composite = len(key_names) > 1
        self.backend = backend

    @classmethod
    def resolve(cls, conn: Connection, table: TableRef, key: str | Sequence[str]) -> Target:
        backend = backend_for(conn)  # an unsupported database is refused before reflecting
        resolved = reflect(conn, table)
        names = column_names(key, "key")
        missing = [n for n in names if n not in resolved.c]
        if missing:
            raise KeyValidationError(
                f"key column(s) {missing} not in table {resolved.fullname!r}; its columns are "
                f"{list(resolved.c.keys())} (names are case-sensitive)."
            )
        return cls(resolved, names, backend)

    def check_columns(self, names: Iterable[str], what: str) -> None:
        unknown = [n for n in names if n not in self.table.c]
        if unknown:
            raise ConfigurationError(
                f"{what} names column(s) {unknown} that table {self.table.fullname!r} does not "
                f"have; its columns are {list(self.table.c.keys())} (names are case-sensitive)."
            )

    def normalize_keys(self, keys: Iterable[Key]) -> list[Key]:
        """Caller's keys, duplicates dropped, composite keys as tuples of the right width."""
        seen: dict[Key, None] = {}
        width = len(self.key_names)
        for k in keys:
            if self.composite:
                if isinstance(k, str | bytes) or not isinstance(k, Sequence) or len(k) != width:
                    raise ConfigurationError(
                        f"key {list(self.key_names)} has {width} columns, so each key must be a "
                        f"tuple of {width} values; got {k!r}."
                    )
                k = tuple(k)
            seen.setdefault(k, None)
        return list(seen)

    def key_of_row(self, row: Mapping[str, Any]) -> Key:
        if self.composite:
            return tuple(row[n] for n in self.key_names)
        return row[self.key_names[0]]

    def key_rows(self, rows: list[Mapping[str, Any]], what: str) -> list[tuple[Key, Mapping]]:
        keyed = []
        seen: set = set()
        for row in rows:
            missing = [n for n in self.key_names if n not in row]
            if missing:
                raise ConfigurationError(
                    f"{what}: a row lacks the key column(s) {missing}: {dict(row)!r}."
                )
            k = self.key_of_row(row)
            if k in seen:
                raise ConfigurationError(
                    f"{what}: key {k!r} appears twice; a batch can write each row only once. "
                    "Merge the rows first."
                )
            seen.add(k)
            keyed.append((k, row))
        return keyed

    def key_from_result(self, row: Row) -> Key:
        n = len(self.key_names)
        return tuple(row[:n]) if self.composite else row[0]

    def guard(self, expected: Guard) -> ColumnElement[bool] | None:
        if expected is None:
            return None
        if isinstance(expected, ColumnElement):
            return expected
        if not isinstance(expected, Mapping):
            raise ConfigurationError(
                f"a guard must be a {{column: value}} mapping or a SQLAlchemy expression, "
                f"got {type(expected).__name__}."
            )
        if not expected:
            return None
        self.check_columns(expected, "expected")
        # `column == None` renders IS NULL
        return sa.and_(*(self.table.c[name] == value for name, value in expected.items()))


class KeyIndex:
    """Maps key values read back from the database to the caller's own key values, so outcomes
    list the caller's objects (the driver may return e.g. a UUID where a str was passed)."""

    _MISSING = object()

    def __init__(self, keys: Iterable[Key]) -> None:
        self._exact = {k: k for k in keys}
        self._loose: dict[Any, Key] | None = None

    def lookup(self, value: Key) -> Key:
        found = self._exact.get(value, self._MISSING)
        if found is not self._MISSING:
            return found
        if self._loose is None:
            self._loose = {_loose(k): k for k in self._exact}
        return self._loose.get(_loose(value), value)


def _loose(k: Key) -> Any:
    if isinstance(k, tuple):
        return tuple(_loose_part(p) for p in k)
    return _loose_part(k)


def _loose_part(v: Any) -> Any:
    return v if isinstance(v, str) else str(v)
