"""Read designs against the strongest readers, same run, interleaved (issue 29, "Reads").

Every variant reads every key of ``(0, N]`` of the bigint-keyed table in key order and, except
the plain ``COPY``/streaming-cursor ceilings, commits a cursor per 10k-row chunk with one Redis Lua
advance (``baselines.RedisCursor``), as the engine does.

PostgreSQL (psycopg2):

- ``engine``: one ``traverse`` of a one-range round, no-op processor (lazy rows, prefetch);
- ``copy``: ``COPY (SELECT seq FROM t) TO STDOUT`` into a discarding sink (the ceiling; no
  cursor, no order);
- ``copy_stream``: the tried design: ``COPY (SELECT seq ... WHERE seq > %s AND seq <= %s ORDER
  BY seq LIMIT <segment>) TO STDOUT`` streamed into a sink that cuts 10k-line chunks as the
  lines arrive, parses the last key of each chunk (text) and advances the Redis cursor; one
  statement per segment of ``SEGMENT`` rows, so the statement (and its snapshot) lives for one
  segment, not the range;
- ``server_cursor``: a server-side (named) cursor over the range in one transaction, ``FETCH``
  of 10k rows per chunk, one advance each (the snapshot is held for the whole range).

MariaDB (the URL's driver, mysqlclient when installed):

- ``engine`` and ``loop``: as in the ``mariadb`` group (the hand-written keyset loop);
- ``sscursor``: a streaming ``SSCursor`` over the range (one statement), ``fetchmany`` of 10k
  rows per chunk, one advance each (information: the connection is busy for the whole range).

Verdicts: PostgreSQL ``engine / copy`` (target >= 0.9x), MariaDB ``engine / loop`` (>= 1.0x);
the other ratios are printed as information (``details``) with min/median/max per variant and
the load average before and after.
"""

from __future__ import annotations

import os
from typing import Any

from benchmarks import baselines, project
from benchmarks.baselines import RedisCursor, int_cursor
from benchmarks.context import BenchContext
from benchmarks.data import ensure_table
from benchmarks.metrics import mariadb
from benchmarks.report import Metric
from benchmarks.timing import Sample, Stopwatch, interleaved, median_rate, spread

#: rows per COPY statement of ``copy_stream``
SEGMENT = 200_000


class _ChunkSink:
    """A COPY sink (psycopg2 calls ``write`` once per row) that cuts ``chunk``-line chunks and
    advances the Redis cursor with the last key of each, as the lines arrive."""

    def __init__(self, fence: RedisCursor, chunk: int) -> None:
        self.fence, self.chunk = fence, chunk
        self.pending = 0
        self.last = b""
        self.rows = 0
        self.chunks = 0

    def write(self, data: Any) -> int:
        self.last = data
        self.pending += 1
        if self.pending == self.chunk:
            self.flush()
        return len(data)

    def flush(self) -> None:
        if self.pending:
            self.fence.advance(int_cursor(int(self.last)), self.pending)
            self.rows += self.pending
            self.chunks += 1
            self.pending = 0


def copy_stream(ctx: BenchContext, table: str, hi: int, chunk: int) -> Sample:
    """The streamed-COPY design (module doc)."""
    fence = RedisCursor(ctx, int_cursor(0))
    sink = _ChunkSink(fence, chunk)
    try:
        with Stopwatch() as sw:
            conn = ctx.pg()
            cur = conn.cursor()
            cursor = 0
            while cursor < hi:
                before = sink.rows + sink.pending
                sql = cur.mogrify(
                    f"COPY (SELECT seq FROM {table} WHERE seq > %s AND seq <= %s ORDER BY seq "
                    "LIMIT %s) TO STDOUT",
                    (cursor, hi, SEGMENT),
                ).decode()
                cur.copy_expert(sql, sink)
                sink.flush()  # a segment's tail is a chunk of its own
                if sink.rows == before:
                    break
                cursor = int(sink.last)
            conn.close()
    finally:
        fence.close()
    return Sample(sw.seconds, sink.rows, {"chunks": sink.chunks})


def server_cursor(ctx: BenchContext, table: str, hi: int, chunk: int) -> Sample:
    """A named (server-side) cursor over the range, one FETCH and one advance per chunk."""
    fence = RedisCursor(ctx, int_cursor(0))
    rows_total = 0
    try:
        with Stopwatch() as sw:
            conn = ctx.pg(autocommit=False)
            cur = conn.cursor(name="keyset_bench")
            cur.itersize = chunk
            cur.execute(
                f"SELECT seq FROM {table} WHERE seq > %s AND seq <= %s ORDER BY seq", (0, hi)
            )
            while True:
                rows = cur.fetchmany(chunk)
                if not rows:
                    break
                fence.advance(int_cursor(rows[-1][0]), len(rows))
                rows_total += len(rows)
            cur.close()
            conn.rollback()
            conn.close()
    finally:
        fence.close()
    return Sample(sw.seconds, rows_total)


def sscursor(ctx: BenchContext, table: str, hi: int, chunk: int) -> Sample:
    """MariaDB: a streaming cursor (``SSCursor``) over the range, one advance per chunk."""
    fence = RedisCursor(ctx, int_cursor(0))
    rows_total = 0
    try:
        with Stopwatch() as sw:
            conn = mariadb._dbapi_connect(ctx)
            module = type(conn).__module__.split(".")[0]
            if module == "MySQLdb":
                from MySQLdb.cursors import SSCursor
            else:
                from pymysql.cursors import SSCursor  # type: ignore[assignment]
            cur = conn.cursor(SSCursor)
            cur.execute(
                f"SELECT seq FROM {table} WHERE seq > %s AND seq <= %s ORDER BY seq", (0, hi)
            )
            while True:
                rows = cur.fetchmany(chunk)
                if not rows:
                    break
                fence.advance(int_cursor(rows[-1][0]), len(rows))
                rows_total += len(rows)
            cur.close()
            conn.close()
    finally:
        fence.close()
    return Sample(sw.seconds, rows_total)


def _check(ctx: BenchContext, s: dict[str, list[Sample]]) -> None:
    for name, samples in s.items():
        if any(x.rows != ctx.rows for x in samples):
            raise RuntimeError(f"{name} read {[x.rows for x in samples]} rows, expected {ctx.rows}")


def _ratios(s: dict[str, list[Sample]], base: str) -> dict[str, float]:
    b = median_rate(s[base])
    return {f"{name}_vs_{base}": round(median_rate(v) / b, 3) for name, v in s.items()}


def run(ctx: BenchContext) -> list[Metric]:
    load_before = os.getloadavg()
    table = ensure_table(ctx, "seq")
    hi, n = ctx.rows, ctx.chunk_size
    baselines.copy_ids(ctx, table)  # warm the cache, untimed
    pg = interleaved(
        {
            "engine": lambda: project.traverse_once(ctx, table, "seq", 0, hi),
            "copy": lambda: baselines.copy_ids(ctx, table),
            "copy_stream": lambda: copy_stream(ctx, table, hi, n),
            "server_cursor": lambda: server_cursor(ctx, table, hi, n),
        },
        ctx.repeat,
    )
    _check(ctx, pg)
    my_table = mariadb.ensure_table(ctx)
    with mariadb._wait_for_this_database_only(ctx):
        mariadb.keyset_loop(ctx, my_table, 0, hi, n)  # warm the buffer pool, untimed
        my = interleaved(
            {
                "engine": lambda: mariadb.engine_traverse(ctx, my_table),
                "loop": lambda: mariadb.keyset_loop(ctx, my_table, 0, hi, n),
                "sscursor": lambda: sscursor(ctx, my_table, hi, n),
            },
            ctx.repeat,
        )
    _check(ctx, my)
    load = f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after"
    pg_ratio = median_rate(pg["engine"]) / median_rate(pg["copy"])
    my_ratio = median_rate(my["engine"]) / median_rate(my["loop"])
    return [
        Metric(
            "read_pg_vs_copy",
            "reads",
            "PostgreSQL: one range, no-op, vs COPY of the ids (designs in details)",
            median_rate(pg["engine"]),
            median_rate(pg["copy"]),
            "rows/s",
            pg_ratio,
            ">= 0.90x",
            pg_ratio >= 0.9,
            f"{ctx.rows:,} rows, chunk {n}, {load}; {_ratios(pg, 'copy')}",
            {name: spread(v) for name, v in pg.items()},
        ),
        Metric(
            "read_mariadb_vs_loop",
            "reads",
            "MariaDB: no-op vs hand-written keyset loop (SSCursor in details)",
            median_rate(my["engine"]),
            median_rate(my["loop"]),
            "rows/s",
            my_ratio,
            ">= 1.00x",
            my_ratio >= 1.0,
            f"{ctx.rows:,} rows, chunk {n}, {load}; {_ratios(my, 'loop')}",
            {name: spread(v) for name, v in my.items()},
        ),
    ]
