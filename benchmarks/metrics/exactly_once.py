"""The cost of ``exactly_once``: a write-back processor with and without the mode, same run.

The processor inserts one row per key into ``xo_sink`` (no unique key) through
``chunk.connection``, 1,000-row chunks. At-least-once: one transaction per processor call.
Exactly-once: the same transaction also holds a SAVEPOINT per call and the range's ledger row
update (``keyset_ledger`` on the target), committed before the Redis advance. The sink is
truncated before every timed run, outside the timer; both variants must write every key once.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from airflow_keyset_provider.core import Chunk, KeysetTraversal
from benchmarks.context import BenchContext, pg_cursor
from benchmarks.report import Metric
from benchmarks.timing import Sample, Stopwatch, interleaved, median_rate, spread

TITLE = "exactly_once write-back vs at-least-once write-back (1k-row chunks)"
CHUNK = 1000


def _tables(ctx: BenchContext, rows: int) -> tuple[str, str]:
    src, sink = ctx.table("xo_src"), ctx.table("xo_sink")
    with pg_cursor(ctx) as cur:
        cur.execute(f"CREATE SCHEMA IF NOT EXISTS {ctx.schema}")
        cur.execute(f"DROP TABLE IF EXISTS {src}")
        cur.execute(f"CREATE TABLE {src} (id bigint PRIMARY KEY, payload text NOT NULL)")
        cur.execute(f"INSERT INTO {src} SELECT g, 'p' || g FROM generate_series(1, {rows}) g")
        cur.execute(f"VACUUM ANALYZE {src}")
        cur.execute(f"CREATE TABLE IF NOT EXISTS {sink} (id bigint NOT NULL, payload text)")
    return src, sink


def _run(ctx: BenchContext, src: str, sink: str, rows: int, mode: bool, n: list[int]) -> Sample:
    with pg_cursor(ctx) as cur:
        cur.execute(f"TRUNCATE {sink}")
    n[0] += 1
    t = KeysetTraversal(
        ctx.pg_url,
        table=src,
        key="id",
        redis_url=ctx.redis_url,
        stream=ctx.stream(f"xo{n[0]}"),
        key_prefix=ctx.prefix,
        target_url=ctx.pg_url,
        columns=["payload"],
    )
    insert = sa.text(f"INSERT INTO {sink} (id, payload) VALUES (:i, :p)")

    def write(chunk: Chunk) -> None:
        rows = zip(chunk.keys, chunk.rows, strict=True)
        chunk.connection.execute(insert, [{"i": k, "p": r["payload"]} for k, r in rows])

    try:
        rnd = t.plan(max_ranges=1, start_key=0, end_key=rows)
        with Stopwatch() as sw:
            res = t.traverse(rnd.round_id, 0, write, chunk_size=CHUNK, exactly_once=mode)
    finally:
        t.close()
    with pg_cursor(ctx) as cur:
        cur.execute(f"SELECT count(*), count(DISTINCT id) FROM {sink}")
        written, distinct = cur.fetchone()
    if not res.complete or written != rows or distinct != rows:
        raise RuntimeError(f"exactly_once={mode}: wrote {written} rows ({distinct} keys) of {rows}")
    return Sample(sw.seconds, rows, {"chunks": res.chunks})


def run(ctx: BenchContext) -> list[Metric]:
    rows = min(ctx.small_rows, 200_000)
    src, sink = _tables(ctx, rows)
    n = [0]
    _run(ctx, src, sink, rows, True, n)  # warm: ledger table, catalog, connections
    s: dict[str, list[Any]] = interleaved(
        {
            "exactly_once": lambda: _run(ctx, src, sink, rows, True, n),
            "at_least_once": lambda: _run(ctx, src, sink, rows, False, n),
        },
        ctx.repeat,
    )
    with pg_cursor(ctx) as cur:
        cur.execute(f"DROP TABLE IF EXISTS {sink}")
        cur.execute(f"DROP TABLE IF EXISTS {src}")
    p, base = median_rate(s["exactly_once"]), median_rate(s["at_least_once"])
    details = {name: spread(samples) for name, samples in s.items()}
    return [
        Metric(
            "exactly_once_writeback",
            "exactly_once",
            TITLE,
            p,
            base,
            "rows/s",
            p / base,
            ">= 0.9x",
            p / base >= 0.9,
            f"{rows:,} rows, one range, INSERT per key through chunk.connection",
            details,
        )
    ]
