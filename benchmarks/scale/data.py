"""The scale table: ``N`` rows built once in a schema named for its size, and reused.

``kbench_scale_<N>.big``, ``UNLOGGED`` (no WAL while loading 10^8 rows; the price: PostgreSQL
empties an unlogged table after a crash, which the marker check below then catches and rebuilds):

===========  =====================  =================================================
column       type                   value for row ``g`` (1..N, inserted in order)
===========  =====================  =================================================
``id``       bigint, primary key    ``3g + (g div 10^6) * 10^9``: gaps of 2 between
                                    neighbours and a jump of ~10^9 every million rows
``ts``       timestamptz            ``2024-01-01 + (g div 3) s``: three rows a second,
                                    so ``(ts, id)`` (a unique index) needs the tiebreak
``tenant``   integer                ``g mod 1000``
``amount``   bigint                 ``(7g) mod 100000``
``status``   text                   ``'PENDING'``
``payload``  text                   ``md5(g)`` right-padded to 80 characters
===========  =====================  =================================================

about 145 bytes a row on disk (tuple header and line pointer included). Loaded with
``INSERT ... SELECT generate_series`` in batches of ``BATCH`` rows, each committed together with
the marker's ``rows_loaded`` (an interrupted build resumes at the next batch); the primary key and
the ``(ts, id)`` index are built after the load, then ``VACUUM ANALYZE`` (visibility map and
statistics, as on a settled table). The table is reused when the marker says ``ready`` with this
layout version and ``count(*)`` equals ``N``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from benchmarks.context import BenchContext, pg_cursor

log = logging.getLogger("benchmarks")

LAYOUT_VERSION = 1
BATCH = 5_000_000
TS_START = "2024-01-01 00:00:00+00"
GAP_EVERY = 1_000_000
GAP = 1_000_000_000


def schema_for(rows: int) -> str:
    """The table's schema: ``kbench_scale_<rows>`` (built once, reused), or
    ``KEYSET_BENCH_SCALE_SCHEMA`` when set (the smoke test's own, so suites running side by side
    never build or drop each other's)."""
    return os.environ.get("KEYSET_BENCH_SCALE_SCHEMA") or f"kbench_scale_{rows}"


def key_of(g: int) -> int:
    """The ``id`` of row ``g`` (the SQL below, in Python)."""
    return 3 * g + (g // GAP_EVERY) * GAP


def _marker(cur: Any, schema: str) -> dict[str, Any] | None:
    cur.execute(
        f"CREATE TABLE IF NOT EXISTS {schema}._scale_meta (name text PRIMARY KEY, rows bigint "
        "NOT NULL, version integer NOT NULL, rows_loaded bigint NOT NULL, stage text NOT NULL, "
        "seconds jsonb NOT NULL DEFAULT '{}')"
    )
    cur.execute(
        f"SELECT rows, version, rows_loaded, stage, seconds FROM {schema}._scale_meta "
        "WHERE name = 'big'"
    )
    row = cur.fetchone()
    if row is None:
        return None
    return dict(zip(("rows", "version", "rows_loaded", "stage", "seconds"), row, strict=True))


def _set(cur: Any, schema: str, stage: str, step: str, seconds: float) -> None:
    cur.execute(
        f"UPDATE {schema}._scale_meta SET stage = %s, "
        "seconds = seconds || jsonb_build_object(%s::text, %s::float8) WHERE name = 'big'",
        (stage, step, round(seconds, 1)),
    )


def _create(cur: Any, schema: str, rows: int) -> None:
    cur.execute(f"DROP TABLE IF EXISTS {schema}.big")
    cur.execute(
        f"CREATE UNLOGGED TABLE {schema}.big (id bigint NOT NULL, ts timestamptz NOT NULL, "
        "tenant integer NOT NULL, amount bigint NOT NULL, status text NOT NULL, "
        "payload text NOT NULL)"
    )
    cur.execute(f"DELETE FROM {schema}._scale_meta WHERE name = 'big'")
    cur.execute(
        f"INSERT INTO {schema}._scale_meta VALUES ('big', %s, %s, 0, 'loading', '{{}}')",
        (rows, LAYOUT_VERSION),
    )


def _load(ctx: BenchContext, schema: str, rows: int, loaded: int) -> None:
    conn = ctx.pg(autocommit=False)
    try:
        with conn.cursor() as cur:
            while loaded < rows:
                hi = min(loaded + BATCH, rows)
                started = time.perf_counter()
                cur.execute(
                    f"INSERT INTO {schema}.big SELECT 3 * g + (g / {GAP_EVERY}) * {GAP}, "
                    "timestamptz %s + (g / 3) * interval '1 second', mod(g, 1000), "
                    "mod(7 * g, 100000), 'PENDING', rpad(md5(g::text), 80, 'x') "
                    "FROM generate_series(%s::bigint, %s::bigint) g",
                    (TS_START, loaded + 1, hi),
                )
                cur.execute(
                    f"UPDATE {schema}._scale_meta SET rows_loaded = %s WHERE name = 'big'", (hi,)
                )
                conn.commit()
                log.info("loaded %d / %d rows (%.1f s)", hi, rows, time.perf_counter() - started)
                loaded = hi
    finally:
        conn.close()


def _index(ctx: BenchContext, schema: str, marker: dict[str, Any]) -> None:
    steps = [
        ("primary_key", f"ALTER TABLE {schema}.big ADD PRIMARY KEY (id)"),
        ("ts_index", f"CREATE UNIQUE INDEX big_ts_id ON {schema}.big (ts, id)"),
        ("vacuum_analyze", f"VACUUM ANALYZE {schema}.big"),
    ]
    done = set(marker.get("seconds") or {})
    for step, sql in steps:
        if step in done:
            continue
        started = time.perf_counter()
        with pg_cursor(ctx) as cur:
            cur.execute("SET maintenance_work_mem = '1GB'")
            cur.execute(sql)
            _set(cur, schema, step, step, time.perf_counter() - started)
        log.info("%s done in %.1f s", step, time.perf_counter() - started)


def count_rows(ctx: BenchContext, schema: str) -> int:
    with pg_cursor(ctx) as cur:
        cur.execute(f"SELECT count(*) FROM {schema}.big")
        return int(cur.fetchone()[0])


def ensure_big(ctx: BenchContext, rows: int) -> dict[str, Any]:
    """Build (or resume, or reuse) the ``rows``-row table; its name, marker and build seconds.

    Reused only if the marker says ``ready`` for ``rows`` rows of this layout version and a
    ``count(*)`` agrees (an unlogged table emptied by a crash fails the count and is rebuilt)."""
    schema = schema_for(rows)
    with pg_cursor(ctx) as cur:
        cur.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
        marker = _marker(cur, schema)
        exists = _exists(cur, schema)
    fresh = (
        marker is None
        or not exists
        or marker["rows"] != rows
        or marker["version"] != LAYOUT_VERSION
        or (marker["stage"] == "ready" and count_rows(ctx, schema) != rows)
    )
    started = time.perf_counter()
    if fresh:
        log.info("creating %s.big with %d rows", schema, rows)
        with pg_cursor(ctx) as cur:
            _create(cur, schema, rows)
            marker = _marker(cur, schema)
    assert marker is not None
    if marker["stage"] != "ready":
        if marker["rows_loaded"] < rows:
            _load(ctx, schema, rows, marker["rows_loaded"])
            with pg_cursor(ctx) as cur:
                _set(cur, schema, "loaded", "load", time.perf_counter() - started)
                marker = _marker(cur, schema)
        assert marker is not None
        _index(ctx, schema, marker)
        if count_rows(ctx, schema) != rows:
            raise RuntimeError(f"{schema}.big does not hold {rows} rows after the build")
        with pg_cursor(ctx) as cur:
            _set(cur, schema, "ready", "total", time.perf_counter() - started)
            marker = _marker(cur, schema)
    assert marker is not None
    return {"table": f"{schema}.big", "schema": schema, "rows": rows, **marker}


def _exists(cur: Any, schema: str) -> bool:
    cur.execute("SELECT to_regclass(%s) IS NOT NULL", (f"{schema}.big",))
    return bool(cur.fetchone()[0])


def table_bytes(ctx: BenchContext, schema: str) -> dict[str, int]:
    """Heap and index sizes of the table, in bytes."""
    with pg_cursor(ctx) as cur:
        cur.execute(
            "SELECT pg_relation_size(%s), pg_indexes_size(%s), pg_total_relation_size(%s)",
            (f"{schema}.big",) * 3,
        )
        heap, indexes, total = cur.fetchone()
    return {"heap": int(heap), "indexes": int(indexes), "total": int(total)}
