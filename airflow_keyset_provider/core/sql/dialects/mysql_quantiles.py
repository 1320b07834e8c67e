"""Row estimates and quantile keys on MySQL / MariaDB without reading the table.

Guarantees:

- ``explain_rows``: the optimizer's estimate of the rows a range statement returns (``EXPLAIN``:
  InnoDB counts a range by diving into the index, no row is read), ``rows * filtered / 100``.
- ``bisected_cuts``: for a key whose first column is an integer, a date or a datetime, at most
  ``parts - 1`` real keys of ``(lo, hi]``, in order, splitting it into parts of about equal
  estimated row count. InnoDB caps a range's estimate at half the table's rows (and, measured on
  MariaDB 10.11, doubles an estimate it could not count exactly), so the range is first cut into
  intervals of the first column each estimated below a quarter of the table (``anchors``); the
  rows at or below ``v`` are the sum of the intervals before it plus the estimate of the
  interval's part up to ``v``: ratios of estimates of like ranges, never a capped one. Each cut
  bisects the first column's values on that count (about 64 EXPLAINs a cut, each a few index
  dives), then reads the last real key at or below the value found with one index lookup. So the plan's cost grows with the number of ranges, not the
  table's size, and a skewed key distribution is followed as closely as InnoDB's estimates
  follow it. Other first columns (text, decimal), and parts estimated below
  ``MIN_ROWS_PER_PART`` rows (where InnoDB counts some ranges exactly and doubles others, so the
  estimates of neighbouring parts disagree), return None: the caller cuts exactly.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ...keys import MIN_KEY, encode_key

if TYPE_CHECKING:
    from ..relation import Relation

log = logging.getLogger(__name__)

#: below this many estimated rows a part, the cuts are exact (one ordered pass, see module doc)
MIN_ROWS_PER_PART = 20_000
_EPOCH = dt.datetime(1970, 1, 1)
_US = dt.timedelta(microseconds=1)


def key_index(src: Relation, conn: sa.Connection) -> str | None:
    """The name of an ordered index starting with the key columns (validation proved one)."""
    from .mysql_catalog import indexes

    for ix in indexes(conn, src.schema, src.table_name):
        if ix.ordered and list(ix.columns[: src.arity]) == src.key_names:
            return ix.name
    return None


def explain_rows(
    src: Relation,
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
    sql, params_for = src.driver_call(stmt)
    args = params_for(
        params
    )  # a list for a positional driver (mysqlclient): SQLAlchemy wants a tuple
    args = tuple(args) if isinstance(args, list) else args
    rows = conn.exec_driver_sql("EXPLAIN " + sql, args).mappings().all()
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
    src: Relation,
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
    filt = src.range_filter(lo != MIN_KEY)
    ends = _range_ends(src, conn, filt, params)
    if ends is None:
        return []
    lo_v, hi_v = to_int(ends[0]), to_int(ends[1])
    between = _Estimates(src, conn, filt, params, from_int)
    from .mysql_catalog import table_figure

    table_rows = table_figure(conn, src.schema, src.table_name, "TABLE_ROWS")
    anchors = _anchors(lo_v, hi_v, between, table_rows / 4)
    sums = [0]
    for x, y in zip([None, *anchors[:-1]], anchors, strict=True):
        sums.append(sums[-1] + between(x, y))
    total = sums[-1]  # not est: EXPLAIN caps a range's estimate at half the table
    if total / parts < MIN_ROWS_PER_PART:
        return None
    memo: dict[int, int] = {}

    def below(v: int) -> int:
        if v not in memo:
            j = next(i for i, a in enumerate(anchors) if v <= a)
            memo[v] = sums[j] + between(None if j == 0 else anchors[j - 1], v)
        return memo[v]

    values = _cut_values(lo_v, hi_v, total, parts, below, memo)
    cuts = _last_keys_at(src, conn, filt, params, [from_int(v) for v in values])
    log.info(
        "%s: %d cut(s) from %d EXPLAIN estimate(s) for ~%d estimated rows",
        src.qualified_name,
        len(cuts),
        len(between.counts),
        est,
    )
    return cuts


def _range_ends(
    src: Relation, conn: sa.Connection, filt: list[Any], params: dict[str, Any]
) -> tuple[Any, Any] | None:
    """The first key column of the range's first and last key, by the index (MIN/MAX under the
    OR form of a composite filter would scan the whole range); None: the range is empty."""
    first = src.table.c[src.key_names[0]]
    keys = [src.table.c[k] for k in src.key_names]
    ends = [
        conn.execute(sa.select(first).where(*filt).order_by(*order).limit(1), params).scalar()
        for order in (keys, [k.desc() for k in keys])
    ]
    return None if ends[0] is None else (ends[0], ends[1])


def _cut_values(
    lo_v: int,
    hi_v: int,
    total: int,
    parts: int,
    below: Callable[[int], int],
    memo: dict[int, int],
) -> list[int]:
    """The first column's cut values, increasing, each below ``hi_v``: the ``i``-th bisects on
    ``below`` for ``total * i / parts``, starting from the tightest bracket of the estimates
    already read (``memo``: value -> rows at or below it)."""
    values: list[int] = []
    left = lo_v
    for i in range(1, parts):
        target = total * i / parts
        b = min([hi_v, *(v for v, n in memo.items() if n >= target and v >= left)])
        a = max([left, *(v + 1 for v, n in memo.items() if n < target and left <= v < b)])
        a = _cut_value(a, b, below, target, total / parts / 100)
        if a < hi_v and (not values or a > values[-1]):
            values.append(a)
        left = a
    return values


class _Estimates:
    """``(x, v) -> `` estimated rows of the range with ``x < first <= v`` (no lower limit for
    None), through the key's index, each pair asked once."""

    def __init__(
        self,
        src: Relation,
        conn: sa.Connection,
        filt: list[Any],
        params: dict[str, Any],
        from_int: Callable[[int], Any],
    ) -> None:
        self.src, self.conn, self.filt, self.params, self.from_int = (
            src,
            conn,
            filt,
            params,
            from_int,
        )
        self.first = src.table.c[src.key_names[0]]
        self.keys = [src.table.c[k] for k in src.key_names]
        self.index = key_index(src, conn)
        self.counts: dict[tuple[int | None, int], int] = {}

    def __call__(self, x: int | None, v: int) -> int:
        if (x, v) not in self.counts:
            conds = [*self.filt, self.first <= sa.bindparam("qv", type_=self.first.type)]
            args = {**self.params, "qv": self.from_int(v)}
            if x is not None:
                conds.append(self.first > sa.bindparam("qx", type_=self.first.type))
                args["qx"] = self.from_int(x)
            stmt = sa.select(*self.keys).where(*conds)
            self.counts[x, v] = explain_rows(self.src, self.conn, stmt, args, self.index)
        return self.counts[x, v]


def _last_keys_at(
    src: Relation, conn: sa.Connection, filt: list[Any], params: dict[str, Any], values: list[Any]
) -> list[str]:
    """The encoded last real key of the range with ``first <= v``, for each ``v`` (one index
    lookup each), sorted and distinct."""
    first = src.table.c[src.key_names[0]]
    keys = [src.table.c[k] for k in src.key_names]
    probe = sa.bindparam("qv", type_=first.type)
    last_at = sa.select(*keys).where(*filt, first <= probe).order_by(*[k.desc() for k in keys])
    cuts = set()
    for v in values:
        row = conn.execute(last_at.limit(1), {**params, "qv": v}).first()
        if row is not None:
            cuts.add(encode_key(tuple(row)))
    return sorted(cuts)


def _anchors(
    lo_v: int, hi_v: int, between: Callable[[int | None, int], int], limit: float
) -> list[int]:
    """Values ``a_1 < ... < a_k = hi_v`` with each interval ``(a_j, a_j+1]`` (the first from the
    range's start) estimated at most ``limit`` rows, or one value wide."""
    out: list[int] = []
    x: int | None = None
    while True:
        if between(x, hi_v) <= limit:
            out.append(hi_v)
            return out
        start = lo_v if x is None else x + 1
        y = _smallest(start, hi_v, functools.partial(_exceeds, between, x, limit)) - 1
        y = max(y, start)  # one value holding more than limit rows is an interval of its own
        out.append(y)
        if y >= hi_v:
            return out
        x = y


def _cut_value(a: int, b: int, below: Callable[[int], int], target: float, tol: float) -> int:
    """The smallest ``v`` in ``[a, b]`` with ``below(v) >= target``, to within ``tol`` rows: the
    bisection stops once the values left hold at most ``tol`` estimated rows (1% of a part), so a
    fine-grained column (microsecond datetimes) costs no more EXPLAINs than an integer one."""
    lo_rows = below(a)  # at most the rows at or below a
    if lo_rows >= target:
        return a
    while a < b:
        if below(b) - lo_rows <= tol:
            return b
        mid = (a + b) // 2
        if below(mid) >= target:
            b = mid
        else:
            a, lo_rows = mid + 1, below(mid)
    return a


def _exceeds(
    between: Callable[[int | None, int], int], x: int | None, limit: float, v: int
) -> bool:
    return between(x, v) > limit


def _smallest(a: int, b: int, ok: Callable[[int], bool]) -> int:
    """The smallest ``v`` in ``[a, b]`` with ``ok(v)`` (``ok`` monotone; ``b`` if none)."""
    while a < b:
        mid = (a + b) // 2
        if ok(mid):
            b = mid
        else:
            a = mid + 1
    return a
