"""A call's rows as columns: what the columnar statements bind, one sequence per column.

The helpers of this package take rows (mappings) or keys; the statements of the columnar path
(``backends/postgresql.py``: one array per column; ``backends/mysql.py``: one derived table)
want a list per column. :class:`Columns` holds them once per call, with the caller's keys by
position, so the outcome of a batch is a set of positions and never a match of keys read back
against keys passed (PostgreSQL returns ``WITH ORDINALITY``'s position).

The conversions are whole-column list comprehensions (tens of ns per value), not per-row Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from operator import itemgetter
from typing import Any

from airflow_keyset_provider.core.errors import ConfigurationError

from .target import Key, Target, loose_key


class Columns:
    """``data``: column name -> list of values (key columns included), all of length ``n``;
    ``keys``: the caller's key of each position (a scalar, or a tuple for a composite key)."""

    __slots__ = ("data", "keys", "n")

    def __init__(self, keys: list[Key], data: dict[str, list]) -> None:
        self.keys = keys
        self.data = data
        self.n = len(keys)

    def take(self, where: range | list[int]) -> dict[str, list]:
        """The columns at positions ``where`` (a slice when it is a range)."""
        if isinstance(where, range) and where.step == 1:
            if where.start == 0 and where.stop == self.n:
                return self.data
            return {name: col[where.start : where.stop] for name, col in self.data.items()}
        return {name: [col[i] for i in where] for name, col in self.data.items()}


def from_keys(target: Target, keys: Iterable[Key]) -> Columns:
    """The key columns of ``keys`` (duplicates dropped, first seen kept), for a guarded update."""
    given = keys if isinstance(keys, list) else list(keys)
    names = target.key_names
    if not target.composite:
        unique = list(dict.fromkeys(given)) if len(set(given)) != len(given) else given
        return Columns(unique, {names[0]: unique})
    width = len(names)
    if set(map(type, given)) <= {tuple} and set(map(len, given)) <= {width}:
        bad = None  # the usual case, checked by C-level loops (this runs once per chunk)
    else:
        bad = next(
            (k for k in given if isinstance(k, str | bytes) or not isinstance(k, Sequence)), None
        )
        if bad is None:
            bad = next((k for k in given if len(k) != width), None)
    if bad is not None:
        raise ConfigurationError(
            f"key {list(names)} has {width} columns, so each key must be a tuple of {width} "
            f"values; got {bad!r}."
        )
    tuples = list(dict.fromkeys(map(tuple, given)))
    cols = [list(c) for c in zip(*tuples, strict=True)] if tuples else [[] for _ in names]
    return Columns(tuples, dict(zip(names, cols, strict=True)))


def from_rows(target: Target, rows: Sequence[Mapping[str, Any]], what: str) -> Columns | None:
    """``rows`` as columns if every row names the same columns (the usual case), else None
    (the caller groups the rows by their columns and takes the row-by-row path). A row lacking
    a key column, or a key given twice, is refused as the row path refuses it."""
    if not rows:
        return None
    names = tuple(rows[0])
    if len(set(map(len, rows))) != 1:  # C-level loops: this runs once per chunk on every row
        return None
    try:
        data = {name: list(map(itemgetter(name), rows)) for name in names}
    except KeyError:
        return None
    missing = [n for n in target.key_names if n not in data]
    if missing:
        raise ConfigurationError(f"{what}: a row lacks the key column(s) {missing}.")
    return columns_with_keys(target, data, what)


def from_mapping(target: Target, columns: Mapping[str, Sequence[Any]], what: str) -> Columns:
    """The caller's ``{column: values}`` (key columns included), checked to be of one length."""
    data = {name: list(values) for name, values in columns.items()}
    lengths = {name: len(values) for name, values in data.items()}
    if len(set(lengths.values())) > 1:
        raise ConfigurationError(f"{what}: the columns differ in length: {lengths}.")
    missing = [n for n in target.key_names if n not in data]
    if missing:
        raise ConfigurationError(
            f"{what}: the key column(s) {missing} are missing from `columns` ({list(data)})."
        )
    target.check_columns(data, what)
    return columns_with_keys(target, data, what)


def columns_with_keys(target: Target, data: dict[str, list], what: str) -> Columns:
    """:class:`Columns` of ``data``, its keys built from the key columns; a key twice is refused
    (a statement writes each row once)."""
    names = target.key_names
    keys = list(zip(*(data[n] for n in names), strict=True)) if target.composite else data[names[0]]
    if len(set(keys)) != len(keys):
        seen: set = set()
        dup = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ConfigurationError(
            f"{what}: key {dup!r} appears twice; a batch can write each row only once. "
            "Merge the rows first."
        )
    return Columns(keys, data)


def positions(target: Target, data: Mapping[str, list], found: Iterable[Key]) -> list[int]:
    """The positions in ``data`` of the keys ``found`` (as the database returned them); a key
    the driver returns in another form (a UUID for a str) is matched by its text."""
    names = target.key_names
    first = data[names[0]]
    keys: Iterable[Key] = zip(*(data[n] for n in names), strict=True) if target.composite else first
    index = dict(
        zip(keys, range(len(first)), strict=True)
    )  # C-level loops: this runs once per batch
    found = found if isinstance(found, list | tuple) else list(found)
    got: list[int | None] = list(map(index.get, found))
    if None not in got:
        return got  # type: ignore[return-value]  # no None in it
    loose = {loose_key(k): i for k, i in index.items()}
    out = []
    for k, i in zip(found, got, strict=True):
        if i is None:
            i = loose.get(loose_key(k))
        if i is not None:
            out.append(i)
    return out
