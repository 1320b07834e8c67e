"""Row estimates and row-count quantiles of a key range, for the planner (``SqlSource``).

Guarantees:

- ``estimate_rows`` is the dialect's estimate for ``lo < key <= hi`` (``Dialect.estimate_rows``:
  PostgreSQL's and MySQL's ``EXPLAIN``, no row read), the exact count elsewhere.
- ``quantile_keys`` returns at most ``parts - 1`` real keys of ``(lo, hi]``, in order, splitting
  it into parts of about equal row count: exact (one ordered pass) when the range is small, or
  the dialect cannot cut without a scan, else the dialect's cuts (``Dialect.sampled_cuts``:
  PostgreSQL from a ``TABLESAMPLE SYSTEM`` block sample of at least ~2048 blocks thinned at random
  to ``sample_rows``, which sets ``SqlSource.last_sample_percent``; MySQL by bisecting ``EXPLAIN``
  estimates on the first key column).

Split from ``source.py``: ``SqlSource`` delegates to it with itself as the ``Relation``
(``relation.py``: the range filter, the key parameters) and its ``Dialect``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ..keys import MIN_KEY, encode_key

if TYPE_CHECKING:
    from .dialects import Dialect
    from .relation import Relation

log = logging.getLogger(__name__)


def _range_params(src: Relation, lo: str, hi: str) -> dict[str, Any]:
    return src.key_params(hi, "h") | (src.key_params(lo, "c") if lo != MIN_KEY else {})


def estimate_rows(src: Relation, db: Dialect, lo: str, hi: str) -> int:
    """The dialect's row estimate for ``lo < key <= hi`` (see module doc)."""
    stmt = sa.select(*[src.table.c[k] for k in src.key_names]).where(
        *src.range_filter(lo != MIN_KEY)
    )
    with src.engine.connect() as conn:
        return db.estimate_rows(src, conn, stmt, _range_params(src, lo, hi))


def quantile_keys(
    src: Relation, db: Dialect, lo: str, hi: str, parts: int, exact_limit: int, sample_rows: int
) -> list[str]:
    """Up to ``parts - 1`` real keys splitting ``(lo, hi]`` into parts of about equal row count:
    exact (one ordered pass) when the range is small, else the dialect's cuts."""
    est = src.estimate_rows(lo, hi)
    params = _range_params(src, lo, hi)
    with src.engine.connect() as conn:
        if est > exact_limit:
            cuts = db.sampled_cuts(src, conn, lo, params, est, parts, sample_rows)
            if cuts is not None:
                return cuts
        return _exact_cuts(src, conn, lo, params, parts)


def _exact_cuts(
    src: Relation, conn: sa.Connection, lo: str, params: dict[str, Any], parts: int
) -> list[str]:
    """Cuts from one ordered pass: every ``ceil(total / parts)``-th key, the last one excluded."""
    keys = [src.table.c[k] for k in src.key_names]
    filt = src.range_filter(lo != MIN_KEY)
    total = int(
        conn.execute(
            sa.select(sa.func.count()).where(*filt).select_from(src.table), params
        ).scalar()
        or 0
    )
    if total <= 1:
        return []
    step = max(1, -(-total // parts))
    rn = sa.func.row_number().over(order_by=keys).label("rn")
    inner = sa.select(*keys, rn).where(*filt).subquery()
    stmt = (
        sa.select(*[inner.c[k] for k in src.key_names])
        .where(inner.c.rn % step == 0, inner.c.rn < total)
        .order_by(*[inner.c[k] for k in src.key_names])
    )
    return [encode_key(tuple(r)) for r in conn.execute(stmt, params)]
