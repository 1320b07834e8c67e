"""The benchmark tables, created once in their own schema and reused while their size matches.

=============  ==========================================  =====================================
table          key                                         shape
=============  ==========================================  =====================================
seq            ``seq bigint`` primary key, 1..N            physically in key order (a sequence)
seq_small      same, 1..N/10                               the scaling metrics' small size
ts             ``(ts timestamptz, id bigint)`` primary key three rows per second, in key order
zipf           ``k bigint`` primary key                    1000 tenants of Zipf(1.1) sizes, key
                                                           ``tenant * 10^10 + j``: huge gaps
                                                           between tenants; rows stored in random
                                                           physical order (like a multi-tenant log)
wb             ``id bigint`` primary key, ``status text``  the write-back target (reset per run)
orders         ``id bigint`` primary key, unique           the decorator example's table
               ``(created_at timestamptz, id)``            (``--deco-rows``): every order PENDING,
                                                           three per second from 2025-01-01, in
                                                           key order; ``cancel_reason text``
=============  ==========================================  =====================================

``<schema>._meta`` records each table's row count and layout version; a table whose entry does
not match is dropped and rebuilt. Every table is VACUUM ANALYZEd after loading, so index-only
scans and the planner's statistics behave as on a settled production table.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from benchmarks.context import BenchContext, pg_cursor

log = logging.getLogger("benchmarks")

LAYOUT_VERSION = 1
ZIPF_TENANTS = 1000
ZIPF_EXPONENT = 1.1
ZIPF_STRIDE = 10**10  # key space per tenant: the "big gaps"
TS_START = "2024-01-01 00:00:00+00"


def zipf_counts(rows: int, tenants: int = ZIPF_TENANTS, s: float = ZIPF_EXPONENT) -> list[int]:
    """Rows per tenant, proportional to 1/rank^s, summing exactly to ``rows``."""
    weights = [1.0 / (rank**s) for rank in range(1, tenants + 1)]
    total = sum(weights)
    counts = [int(rows * w / total) for w in weights]
    counts[0] += rows - sum(counts)
    return [c for c in counts if c > 0]


def _create_seq(ctx: BenchContext, name: str, rows: int) -> None:
    with pg_cursor(ctx) as cur:
        cur.execute(f"CREATE TABLE {name} (seq bigint PRIMARY KEY, payload integer NOT NULL)")
        cur.execute(
            f"INSERT INTO {name} SELECT g, mod(g, 1000) FROM generate_series(1, %s) g", (rows,)
        )


def _create_ts(ctx: BenchContext, name: str, rows: int) -> None:
    with pg_cursor(ctx) as cur:
        cur.execute(
            f"CREATE TABLE {name} (ts timestamptz NOT NULL, id bigint NOT NULL, "
            "payload integer NOT NULL, PRIMARY KEY (ts, id))"
        )
        cur.execute(
            f"INSERT INTO {name} SELECT timestamptz %s + (g / 3) * interval '1 second', g, mod(g, 1000) "
            "FROM generate_series(1, %s) g",
            (TS_START, rows),
        )


def _create_zipf(ctx: BenchContext, name: str, rows: int) -> None:
    counts = zipf_counts(rows)
    values = ",".join(f"({tenant},{n})" for tenant, n in enumerate(counts, start=1))
    with pg_cursor(ctx) as cur:
        cur.execute(f"CREATE TABLE {name} (k bigint PRIMARY KEY, tenant integer NOT NULL)")
        cur.execute(
            f"INSERT INTO {name} SELECT c.t::bigint * {ZIPF_STRIDE} + j, c.t "
            f"FROM (VALUES {values}) c(t, n), generate_series(1, c.n) j ORDER BY random()"
        )


def _create_wb(ctx: BenchContext, name: str, rows: int) -> None:
    with pg_cursor(ctx) as cur:
        cur.execute(
            f"CREATE TABLE {name} (id bigint PRIMARY KEY, status text NOT NULL, "
            "note text NOT NULL DEFAULT '')"
        )
        cur.execute(
            f"INSERT INTO {name} (id, status) SELECT g, 'PENDING' FROM generate_series(1, %s) g",
            (rows,),
        )


def _create_orders(ctx: BenchContext, name: str, rows: int) -> None:
    """The table of ``tests/airflow/test_decorator.py`` (the example's), all rows PENDING."""
    with pg_cursor(ctx) as cur:
        cur.execute(
            f"CREATE TABLE {name} (id bigint PRIMARY KEY, created_at timestamptz NOT NULL, "
            "status text NOT NULL, cancel_reason text)"
        )
        cur.execute(
            f"INSERT INTO {name} SELECT g, timestamptz %s + (g / 3) * interval '1 second', "
            "'PENDING' FROM generate_series(1, %s) g",
            (TS_START, rows),
        )
        cur.execute(f"CREATE UNIQUE INDEX orders_created_at_id ON {name} (created_at, id)")


_BUILDERS: dict[str, Callable[[BenchContext, str, int], None]] = {
    "seq": _create_seq,
    "seq_small": _create_seq,
    "ts": _create_ts,
    "zipf": _create_zipf,
    "wb": _create_wb,
    "orders": _create_orders,
}


def _wanted_rows(ctx: BenchContext, role: str) -> int:
    return {"seq_small": ctx.small_rows, "wb": ctx.wb_rows, "orders": ctx.deco_rows}.get(
        role, ctx.rows
    )


def ensure_table(ctx: BenchContext, role: str) -> str:
    """The qualified name of table ``role``, (re)built if missing or of another size."""
    rows = _wanted_rows(ctx, role)
    name = ctx.table(role)
    with pg_cursor(ctx) as cur:
        cur.execute(f"CREATE SCHEMA IF NOT EXISTS {ctx.schema}")
        cur.execute(
            f"CREATE TABLE IF NOT EXISTS {ctx.schema}._meta "
            "(name text PRIMARY KEY, rows bigint NOT NULL, version integer NOT NULL)"
        )
        cur.execute(
            f"SELECT rows, version, to_regclass(%s) IS NOT NULL FROM {ctx.schema}._meta WHERE name = %s",
            (name, role),
        )
        found = cur.fetchone()
    if found is not None and found[0] == rows and found[1] == LAYOUT_VERSION and found[2]:
        return name
    started = time.perf_counter()
    log.info("creating %s with %d rows", name, rows)
    with pg_cursor(ctx) as cur:
        cur.execute(f"DROP TABLE IF EXISTS {name}")
    _BUILDERS[role](ctx, name, rows)
    with pg_cursor(ctx) as cur:
        cur.execute(f"VACUUM ANALYZE {name}")
        cur.execute(
            f"INSERT INTO {ctx.schema}._meta VALUES (%s, %s, %s) ON CONFLICT (name) DO UPDATE "
            "SET rows = excluded.rows, version = excluded.version",
            (role, rows, LAYOUT_VERSION),
        )
    log.info("created %s in %.1f s", name, time.perf_counter() - started)
    return name


def key_bounds(ctx: BenchContext, role: str) -> tuple[object, object]:
    """``(min key, max key)`` of a table (tuples for the composite ``ts`` key)."""
    name = ensure_table(ctx, role)
    key = {"ts": "ts, id", "zipf": "k", "wb": "id"}.get(role, "seq")
    with pg_cursor(ctx) as cur:
        cur.execute(f"SELECT {key} FROM {name} ORDER BY {key} LIMIT 1")
        lo = cur.fetchone()
        desc = ", ".join(f"{c.strip()} DESC" for c in key.split(","))
        cur.execute(f"SELECT {key} FROM {name} ORDER BY {desc} LIMIT 1")
        hi = cur.fetchone()
    assert lo is not None and hi is not None
    return (lo[0], hi[0]) if len(lo) == 1 else (tuple(lo), tuple(hi))


def drop_schema(ctx: BenchContext) -> None:
    with pg_cursor(ctx) as cur:
        cur.execute(f"DROP SCHEMA IF EXISTS {ctx.schema} CASCADE")
