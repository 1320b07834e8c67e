"""Row estimates and quantile keys on MySQL / MariaDB without reading the table.

Guarantees:

- ``explain_rows``: the optimizer's estimate of the rows a range statement returns (``EXPLAIN``:
  InnoDB counts a range by diving into the index, no row is read), ``rows * filtered / 100``.
- ``bisected_cuts``: for a key whose first column is an integer, a date or a datetime, at most
  ``parts - 1`` real keys of ``(lo, hi]``, in order, splitting it into parts of about equal
  estimated row count. Each cut bisects the first column's values on ``explain_rows`` (about 64
  EXPLAINs a cut, each a few index dives), then reads the last real key at or below the value
  found with one index lookup. So the plan's cost grows with the number of ranges, not the
  table's size, and a skewed key distribution is followed as closely as InnoDB's estimates
  follow it. Other first columns (text, decimal) return None: the caller cuts exactly.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ...keys import MIN_KEY, encode_key

if TYPE_CHECKING:
    from ..source import SqlSource

log = logging.getLogger(__name__)

_EPOCH = dt.datetime(1970, 1, 1)
_US = dt.timedelta(microseconds=1)


def key_index(src: SqlSource, conn: sa.Connection) -> str | None:
    """The name of an ordered index starting with the key columns (validation proved one)."""
    from .mysql_catalog import indexes

    for ix in indexes(conn, src.schema, src.table_name):
        if ix.ordered and list(ix.columns[: src.arity]) == src.key_names:
            return ix.name
    return None


def explain_rows(
    src: SqlSource,
    conn: sa.Connection,
    stmt: sa.Select,
    params: dict[str, Any],
    index: str | None = None,
) -> int:
    """The estimate of ``stmt`` read through ``index`` when given (FORCE INDEX: a range wide
    enough for a table scan would otherwise be estimated as the whole table)."""
    if index is not None:
        quote = src.engine.dialect.identifier_preparer.quote
        stmt = stmt.with_hint(src.table, f"FORCE INDEX ({quote(index)})", dialect_name="mysql")
    sql, params_for = src._driver_call(stmt)
    rows = conn.exec_driver_sql("EXPLAIN " + sql, params_for(params)).mappings().all()
    if not rows:
        return 0
    row = rows[0]
    n = float(row.get("rows") or 0)
    filtered = row.get("filtered")
    if filtered is not None:
        n *= float(filtered) / 100.0
    return round(n)


def _codec(kind: str) -> tuple[Callable[[Any], int], Callable[[int], Any]] | None:
    """The first key column's values as integers, and back (None: not bisectable)."""
    if kind == "int":
        return int, int
    if kind == "date":
        return (lambda d: d.toordinal()), dt.date.fromordinal
    if kind == "timestamp":
        return (lambda t: (t - _EPOCH) // _US), (lambda n: _EPOCH + n * _US)
    return None


def bisected_cuts(
    src: SqlSource,
    conn: sa.Connection,
    lo: str,
    params: dict[str, Any],
    est: int,
    parts: int,
    sample_rows: int = 0,
) -> list[str] | None:
    """Cuts by bisection on the first key column (see module doc); None: cut exactly."""
    codec = _codec(src.key_kinds[0])
    if codec is None or parts < 2:
        return None
    to_int, from_int = codec
    first = src.table.c[src.key_names[0]]
    keys = [src.table.c[k] for k in src.key_names]
    filt = src._range_filter(lo != MIN_KEY)
    ends = conn.execute(
        sa.select(sa.func.min(first), sa.func.max(first)).where(*filt), params
    ).one()
    if ends[0] is None:
        return []
    lo_v, hi_v = to_int(ends[0]), to_int(ends[1])
    probe = sa.bindparam("qv", type_=first.type)
    upto = sa.select(*keys).where(*filt, first <= probe)
    cache: dict[int, int] = {}
    index = key_index(src, conn)

    def below(v: int) -> int:
        if v not in cache:
            cache[v] = explain_rows(src, conn, upto, {**params, "qv": from_int(v)}, index)
        return cache[v]

    total = below(hi_v)
    if total <= 1:
        return []
    values: list[int] = []
    left = lo_v
    for i in range(1, parts):
        target = total * i / parts
        a, b = left, hi_v  # smallest v in [a, b] with below(v) >= target
        while a < b:
            mid = (a + b) // 2
            if below(mid) >= target:
                b = mid
            else:
                a = mid + 1
        if a < hi_v and (not values or a > values[-1]):
            values.append(a)
        left = a
    last_at = (
        sa.select(*keys).where(*filt, first <= probe).order_by(*[k.desc() for k in keys]).limit(1)
    )
    cuts = []
    for v in values:
        row = conn.execute(last_at, {**params, "qv": from_int(v)}).first()
        if row is not None:
            cuts.append(encode_key(tuple(row)))
    log.info(
        "%s: %d cut(s) from %d EXPLAIN estimate(s) for ~%d estimated rows",
        src.qualified_name,
        len(cuts),
        len(cache),
        est,
    )
    return sorted(set(cuts))
