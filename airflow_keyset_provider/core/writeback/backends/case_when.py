"""Per-row values by ``CASE``: ``UPDATE t SET c = CASE k WHEN :k0 THEN :c0 ... ELSE c END
WHERE k IN (:k0, ...)``. Portable SQL: SQLite and MySQL/MariaDB use it (the latter without
``RETURNING``, and its CASE expressions also in a locking SELECT, see ``mysql.py``).

The statement for n rows only names parameters, so it is built once per shape and reused;
the guard joins the shape (``{column: value}`` guards bind their values, a guard expression
is used as given and makes the template private to this call).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.sql.elements import ColumnElement

from ..target import Guard, Target
from .base import Builder


class TemplateCache:
    """A few recently used statement templates (SQLAlchemy then reuses their compiled form)."""

    def __init__(self, size: int = 64) -> None:
        self._size = size
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        made = make()
        with self._lock:
            self._items[key] = made
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return made


_CASE_TEMPLATES = TemplateCache()


def _case_guard(
    table: sa.Table, expected: Guard
) -> tuple[ColumnElement[bool] | None, dict[str, Any], TemplateCache, Hashable]:
    """The guard of a CASE update: the clause, its bound values, the template cache and the
    guard's part of the template's shape. ``{column: value}`` guards bind their values and share
    the module's cache; a guard expression is used as given and gets a cache of its own."""
    if expected is not None and not isinstance(expected, Mapping):
        return expected, {}, TemplateCache(8), None
    guard_params: dict[str, Any] = {}
    parts: list[ColumnElement[bool]] = []
    shape = []
    for i, (name, value) in enumerate((expected or {}).items()):
        col = table.c[name]
        if value is None:
            parts.append(col.is_(None))
        else:
            parts.append(col == sa.bindparam(f"keyset_guard_{i}", type_=col.type))
            guard_params[f"keyset_guard_{i}"] = value
        shape.append((name, value is None))
    guard = sa.and_(*parts) if parts else None
    return guard, guard_params, _CASE_TEMPLATES, tuple(shape)


def case_parts(
    target: Target, value_cols: list[str], n: int, else_: bool = True
) -> tuple[dict[sa.Column[Any], ColumnElement[Any]], ColumnElement[bool]]:
    """For ``n`` rows: ``{column: CASE key WHEN :k_i THEN :v_i ... [ELSE column] END}`` and
    ``key IN (:k_0, ...)``, naming parameters only (``keyset_k{i}_{j}`` for key column j of row
    i, ``keyset_v{i}_{m}`` for value column m)."""
    table, key_cols = target.table, target.key_cols
    keys = [
        [sa.bindparam(f"keyset_k{i}_{j}", type_=col.type) for j, col in enumerate(key_cols)]
        for i in range(n)
    ]
    sets: dict[sa.Column[Any], ColumnElement[Any]] = {}
    for m, name in enumerate(value_cols):
        col = table.c[name]
        then = [sa.bindparam(f"keyset_v{i}_{m}", type_=col.type) for i in range(n)]
        other = col if else_ else None
        if target.composite:
            whens = (
                (sa.and_(*(c == k for c, k in zip(key_cols, keys[i], strict=True))), then[i])
                for i in range(n)
            )
            sets[col] = sa.case(*whens, else_=other)
        else:
            sets[col] = sa.case(
                {keys[i][0]: then[i] for i in range(n)}, value=key_cols[0], else_=other
            )
    if target.composite:
        key_in = sa.tuple_(*key_cols).in_([sa.tuple_(*k) for k in keys])
    else:
        key_in = key_cols[0].in_([k[0] for k in keys])
    return sets, key_in


def case_params(target: Target, value_cols: list[str], batch: list[Mapping[str, Any]]) -> dict:
    """The values of :func:`case_parts`' parameters for ``batch``."""
    params: dict[str, Any] = {}
    for i, row in enumerate(batch):
        for j, name in enumerate(target.key_names):
            params[f"keyset_k{i}_{j}"] = row[name]
        for m, name in enumerate(value_cols):
            params[f"keyset_v{i}_{m}"] = row[name]
    return params


def _case_template(
    target: Target,
    value_cols: list[str],
    guard: ColumnElement[bool] | None,
    n: int,
    returning: bool,
) -> sa.Update:
    """The CASE update for ``n`` rows (see :func:`case_parts`)."""
    sets, key_in = case_parts(target, value_cols, n)
    stmt = sa.update(target.table).values(sets).where(key_in)
    if returning:
        stmt = stmt.returning(*target.key_cols)
    return stmt.where(guard) if guard is not None else stmt


def update_case_when(
    target: Target, value_cols: list[str], expected: Guard, returning: bool = True
) -> Builder:
    """A builder of CASE updates of ``value_cols`` guarded by ``expected``, ending in
    ``RETURNING <key>`` unless ``returning`` is False (MySQL/MariaDB have no UPDATE RETURNING)."""
    guard, guard_params, cache, guard_shape = _case_guard(target.table, expected)
    shape_key = (target.table, target.key_names, tuple(value_cols), guard_shape, returning)

    def build(batch: list[Mapping[str, Any]]) -> tuple[sa.Update, dict[str, Any]]:
        n = len(batch)
        stmt = cache.get(
            (*shape_key, n), lambda: _case_template(target, value_cols, guard, n, returning)
        )
        return stmt, {**guard_params, **case_params(target, value_cols, batch)}

    return build
