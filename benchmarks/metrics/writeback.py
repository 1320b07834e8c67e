"""Target 7: the guarded bulk update against what a processor would otherwise do per row.

All three write ``status = 'DONE' WHERE id = ? AND status = 'PENDING'`` for the same keys of
``wb``: the project's ``core.writeback.guarded_update`` (one transaction, one statement per
batch), one autocommit UPDATE per key, and psycopg2 ``executemany`` in one transaction. The table
is reset (and vacuumed) before every timed write, outside the timer; every variant must apply
every key, so the comparison is of equal work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from benchmarks import baselines
from benchmarks.context import BenchContext, pg_cursor
from benchmarks.data import ensure_table
from benchmarks.report import Metric, not_available
from benchmarks.timing import Sample, Stopwatch, interleaved, median_rate, spread

TITLE_ONE = "guarded bulk update vs one autocommit UPDATE per row"
TITLE_MANY = "guarded bulk update vs executemany"


def _reset(ctx: BenchContext, table: str) -> None:
    with pg_cursor(ctx) as cur:
        cur.execute(f"UPDATE {table} SET status = 'PENDING' WHERE status <> 'PENDING'")
        cur.execute(f"VACUUM {table}")


def _project(
    ctx: BenchContext,
    engine: sa.Engine,
    guarded_update: Callable[..., Any],
    table: str,
    keys: list[int],
) -> Sample:
    with Stopwatch() as sw, engine.begin() as conn:
        out = guarded_update(
            conn, table, "id", keys, values={"status": "DONE"}, expected={"status": "PENDING"}
        )
    return Sample(
        sw.seconds,
        len(out.applied),
        {"not_applied": len(out.not_applied), "failed": len(out.failed)},
    )


def _fresh(ctx: BenchContext, table: str, fn: Callable[[], Sample]) -> Callable[[], Sample]:
    def go() -> Sample:
        _reset(ctx, table)
        return fn()

    return go


def run(ctx: BenchContext) -> list[Metric]:
    try:
        from airflow_keyset_provider.core.writeback import guarded_update
    except ImportError as exc:
        note = f"core.writeback.guarded_update not importable: {exc}"
        return [
            not_available("writeback_vs_onebyone", "writeback", TITLE_ONE, ">= 25x", note),
            not_available("writeback_vs_executemany", "writeback", TITLE_MANY, ">= 10x", note),
        ]
    table = ensure_table(ctx, "wb")
    keys = list(range(1, ctx.wb_rows + 1))
    engine = sa.create_engine(ctx.pg_url)
    try:
        _fresh(
            ctx, table, lambda: _project(ctx, engine, guarded_update, table, keys)
        )()  # reflect, warm
        s = interleaved(
            {
                "project": _fresh(
                    ctx, table, lambda: _project(ctx, engine, guarded_update, table, keys)
                ),
                "one_by_one": _fresh(
                    ctx, table, lambda: baselines.update_one_by_one(ctx, table, keys)
                ),
                "executemany": _fresh(
                    ctx, table, lambda: baselines.update_executemany(ctx, table, keys)
                ),
            },
            ctx.repeat,
        )
    finally:
        engine.dispose()
        _reset(ctx, table)
    for name, samples in s.items():
        if any(x.rows != len(keys) for x in samples):
            raise RuntimeError(f"{name} applied {[x.rows for x in samples]} of {len(keys)} keys")
    p, one, many = (
        median_rate(s["project"]),
        median_rate(s["one_by_one"]),
        median_rate(s["executemany"]),
    )
    details = {name: spread(samples) for name, samples in s.items()}
    note = f"{len(keys):,} keys"
    return [
        Metric(
            "writeback_vs_onebyone",
            "writeback",
            TITLE_ONE,
            p,
            one,
            "rows/s",
            p / one,
            ">= 25x",
            p / one >= 25,
            note,
            details,
        ),
        Metric(
            "writeback_vs_executemany",
            "writeback",
            TITLE_MANY,
            p,
            many,
            "rows/s",
            p / many,
            ">= 10x",
            p / many >= 10,
            note,
        ),
    ]
