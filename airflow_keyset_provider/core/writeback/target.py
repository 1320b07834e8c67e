"""The table a call writes and the key that names its rows in outcomes: pure data.

A :class:`Target` knows nothing of the database family it lives on; the helpers pair it with
its backend (``connect.resolve``). The backends import this module, never the other way round.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Row
from sqlalchemy.sql.elements import ColumnElement

from airflow_keyset_provider.core.errors import ConfigurationError

Key = Any  # a scalar for a one-column key, a tuple for a composite key
Guard = Mapping[str, Any] | ColumnElement[bool] | None


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
    """A table plus the key (column names of ``table``) that names its rows in outcomes."""

    def __init__(self, table: sa.Table, key_names: tuple[str, ...]) -> None:
        self.table = table
        self.key_names = key_names
        self.key_cols = tuple(table.c[n] for n in key_names)
        self.composite = len(key_names) > 1

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
            self._loose = {loose_key(k): k for k in self._exact}
        return self._loose.get(loose_key(value), value)


def loose_key(k: Key) -> Any:
    if isinstance(k, tuple):
        return tuple(_loose_part(p) for p in k)
    return _loose_part(k)


def _loose_part(v: Any) -> Any:
    return v if isinstance(v, str) else str(v)
