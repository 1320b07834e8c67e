"""Row estimates and row-count quantiles of a key range, for the planner (``SqlSource``).

Guarantees:

- ``estimate_rows`` is PostgreSQL's planner estimate for ``lo < key <= hi`` (``EXPLAIN``, no
  row read), the exact count elsewhere.
- ``quantile_keys`` returns at most ``parts - 1`` real keys of ``(lo, hi]``, in order, splitting
  it into parts of about equal row count: exact (one ordered pass) when the range is small, not
  on PostgreSQL or its sample too small, else from a ``TABLESAMPLE SYSTEM`` block sample of at
  least ~2048 blocks thinned at random to ``sample_rows`` (a table stored in key order gives runs
  of neighbouring keys per block). A sample sets ``SqlSource.last_sample_percent``.

Split from ``source.py``, whose ``SqlSource`` delegates to it and whose internals (the range
filter, key parameters, ``_rel``) it uses.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ..keys import MIN_KEY, encode_key
from . import catalog

if TYPE_CHECKING:
    from .source import SqlSource

log = logging.getLogger(__name__)


def _range_params(src: SqlSource, lo: str, hi: str) -> dict[str, Any]:
    return src._key_params(hi, "h") | (src._key_params(lo, "c") if lo != MIN_KEY else {})


def estimate_rows(src: SqlSource, lo: str, hi: str) -> int:
    """Planner's row estimate for ``lo < key <= hi`` (PostgreSQL), exact count elsewhere."""
    stmt = sa.select(*[src.table.c[k] for k in src.key_names]).where(
        *src._range_filter(lo != MIN_KEY)
    )
    params = _range_params(src, lo, hi)
    with src.engine.connect() as conn:
        if src.dialect == "postgresql":
            sql, params_for = src._driver_call(stmt)
            plan: Any = conn.exec_driver_sql(
                "EXPLAIN (FORMAT JSON) " + sql, params_for(params)
            ).scalar()
            doc = plan if isinstance(plan, list) else json.loads(plan)
            return int(doc[0]["Plan"]["Plan Rows"])
        count = sa.select(sa.func.count()).select_from(stmt.subquery())
        return int(conn.execute(count, params).scalar() or 0)


def quantile_keys(
    src: SqlSource, lo: str, hi: str, parts: int, exact_limit: int, sample_rows: int
) -> list[str]:
    """Up to ``parts - 1`` real keys splitting ``(lo, hi]`` into parts of about equal row count:
    exact (one ordered pass) when the range is small, else from a block sample."""
    est = src.estimate_rows(lo, hi)
    params = _range_params(src, lo, hi)
    with src.engine.connect() as conn:
        if src.dialect == "postgresql" and est > exact_limit:
            cuts = _sampled_cuts(src, conn, lo, params, est, parts, sample_rows)
            if cuts is not None:
                return cuts
        return _exact_cuts(src, conn, lo, params, parts)


def _sampled_cuts(
    src: SqlSource,
    conn: sa.Connection,
    lo: str,
    params: dict[str, Any],
    est: int,
    parts: int,
    sample_rows: int,
) -> list[str] | None:
    """Cuts from a block sample; None when the sample is too small to cut (< 4 rows a part)."""
    # Block sampling of a table stored in key order draws whole runs of neighbouring
    # keys, so read at least ~2048 blocks and thin them at random back to sample_rows.
    # Blocks from the file sizes (a partitioned parent's relpages is -1, a never-analysed
    # table's 0): TABLESAMPLE on a parent samples each partition at that percentage.
    pages, leaves = catalog.table_pages(conn, src._rel)
    fraction = min(1.0, max(sample_rows / max(est, 1), 2048 / max(pages, 1)))
    keep = min(1.0, sample_rows / max(est * fraction, 1))
    src.last_sample_percent = 100.0 * fraction
    log.info(
        "%s: sampling %.2f%% of %d blocks (%d relation(s)) for ~%d estimated rows",
        src.qualified_name,
        100.0 * fraction,
        pages,
        leaves,
        est,
    )
    sampled = src.table.tablesample(sa.func.system(100.0 * fraction), name="s")
    scols = [sampled.c[k] for k in src.key_names]
    stmt = sa.select(*scols).where(*src._range_filter(lo != MIN_KEY, on=sampled))
    if keep < 1.0:
        stmt = stmt.where(sa.func.random() < keep)
    sample = sorted(tuple(r) for r in conn.execute(stmt, params))
    if len(sample) < parts * 4:
        return None
    step = len(sample) / parts
    picks = [sample[round(step * i) - 1] for i in range(1, parts)]
    return sorted({encode_key(p) for p in picks})


def _exact_cuts(
    src: SqlSource, conn: sa.Connection, lo: str, params: dict[str, Any], parts: int
) -> list[str]:
    """Cuts from one ordered pass: every ``ceil(total / parts)``-th key, the last one excluded."""
    keys = [src.table.c[k] for k in src.key_names]
    filt = src._range_filter(lo != MIN_KEY)
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
