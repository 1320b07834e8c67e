"""What a careful engineer would write by hand, and the physical limit of reading keys.

Every baseline uses plain psycopg2 on its own connection (opened inside the timed region, as the
engine opens its own) and, where it keeps a cursor, one Redis Lua call per chunk that checks an
owner token and the expected cursor before moving it, the minimum fencing a resumable job needs.
The SQL is the same index range scan the engine runs: ``key > cursor AND key <= hi ORDER BY key
LIMIT n``; a composite key uses row-value comparison.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Callable
from typing import Any

from benchmarks.context import BenchContext
from benchmarks.timing import Sample, Stopwatch

# KEYS[1] cursor hash.  ARGV[1] owner token  ARGV[2] expected cursor  ARGV[3] new cursor
# ARGV[4] rows in the chunk.  Cursors are strings that sort like the keys (zero-padded).
# Returns 1, or 0 (not the owner), -1 (cursor moved under us), -2 (not forward): nothing written.
ADVANCE_LUA = """
local r = redis.call('HMGET', KEYS[1], 'owner', 'cursor')
if r[1] ~= ARGV[1] then return 0 end
if r[2] ~= ARGV[2] then return -1 end
if ARGV[3] <= r[2] then return -2 end
redis.call('HSET', KEYS[1], 'cursor', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'done', ARGV[4])
return 1
"""

ChunkFn = Callable[[list[tuple]], None]


def noop(rows: list[tuple]) -> None:
    return None


def sleeper(ms: float) -> ChunkFn:
    def wait(rows: list[tuple]) -> None:
        time.sleep(ms / 1000)

    return wait


class RedisCursor:
    """The hand-written loop's fenced cursor: one EVALSHA per advance."""

    def __init__(self, ctx: BenchContext, start: str) -> None:
        self.client = ctx.redis()
        self.key = f"{ctx.prefix}:baseline:{uuid.uuid4().hex[:8]}"
        self.token = uuid.uuid4().hex
        self.cursor = start
        self.client.hset(self.key, mapping={"owner": self.token, "cursor": start, "done": 0})
        self.script = self.client.register_script(ADVANCE_LUA)
        self.script(
            keys=[self.key], args=[self.token, start, start, 0]
        )  # load it: EVALSHA from now on

    def advance(self, new: str, rows: int) -> None:
        status = self.script(keys=[self.key], args=[self.token, self.cursor, new, rows])
        if status != 1:
            raise RuntimeError(f"baseline advance refused: {status}")
        self.cursor = new

    def close(self) -> None:
        self.client.delete(self.key)
        self.client.close()


def int_cursor(v: int) -> str:
    return f"{v:020d}"


def ts_cursor(key: tuple) -> str:
    ts, ident = key
    return (
        f"{ts.astimezone(dt.UTC).isoformat() if isinstance(ts, dt.datetime) else ts}|{ident:020d}"
    )


def keyset_loop(
    ctx: BenchContext,
    table: str,
    lo: int,
    hi: int,
    chunk: int,
    process: ChunkFn = noop,
    redis_advance: bool = True,
) -> Sample:
    """The hand-written bigint keyset loop, sequential: fetch, process, advance, repeat."""
    fence = RedisCursor(ctx, int_cursor(lo)) if redis_advance else None
    sql = f"SELECT seq FROM {table} WHERE seq > %s AND seq <= %s ORDER BY seq LIMIT %s"
    rows_total = chunks = 0
    try:
        with Stopwatch() as sw:
            conn = ctx.pg()
            cur = conn.cursor()
            cursor = lo
            while cursor < hi:
                cur.execute(sql, (cursor, hi, chunk))
                rows = cur.fetchall()
                if not rows:
                    break
                process(rows)
                cursor = rows[-1][0]
                if fence is not None:
                    fence.advance(int_cursor(cursor), len(rows))
                rows_total += len(rows)
                chunks += 1
            conn.close()
    finally:
        if fence is not None:
            fence.close()
    return Sample(sw.seconds, rows_total, {"chunks": chunks})


def ts_loop(
    ctx: BenchContext, table: str, lo: tuple, hi: tuple, chunk: int, as_text: bool = False
) -> Sample:
    """The hand-written ``(timestamptz, bigint)`` row-value loop with one Redis advance per chunk.

    ``as_text`` fetches the timestamp as its text output instead of a ``datetime`` (the cheaper
    variant the issue measured at 1.7M rows/s; a hand-written loop then sends the text back as
    the next cursor). Note the alias: ordering by a ``::text`` output column would sort as text.
    """
    fence = RedisCursor(ctx, ts_cursor(lo))
    select = "ts::text AS ts_text, id" if as_text else "ts, id"
    sql = (
        f"SELECT {select} FROM {table} WHERE (ts, id) > (%s, %s) AND (ts, id) <= (%s, %s) "
        "ORDER BY ts, id LIMIT %s"
    )
    rows_total = 0
    try:
        with Stopwatch() as sw:
            conn = ctx.pg()
            cur = conn.cursor()
            cur.execute("SET TIME ZONE 'UTC'")
            cursor: tuple = lo
            while True:
                cur.execute(sql, (*cursor, *hi, chunk))
                rows = cur.fetchall()
                if not rows:
                    break
                cursor = tuple(rows[-1])
                fence.advance(ts_cursor(cursor), len(rows))
                rows_total += len(rows)
                if len(rows) < chunk:
                    break
            conn.close()
    finally:
        fence.close()
    return Sample(sw.seconds, rows_total)


class _Discard:
    """A file-like sink for COPY that keeps nothing (but counts lines)."""

    def __init__(self) -> None:
        self.lines = 0

    def write(self, data: Any) -> int:
        self.lines += 1
        return len(data)


def copy_ids(ctx: BenchContext, table: str, column: str = "seq") -> Sample:
    """psycopg2 COPY of every key to a sink that discards it: the practical read limit."""
    sink = _Discard()
    with Stopwatch() as sw:
        conn = ctx.pg()
        with conn.cursor() as cur:
            cur.copy_expert(f"COPY (SELECT {column} FROM {table}) TO STDOUT", sink)
        conn.close()
    return Sample(sw.seconds, sink.lines)


def offset_page(cur: Any, table: str, depth: int, n: int) -> float:
    """Seconds to read one OFFSET page at ``depth``."""
    with Stopwatch() as sw:
        cur.execute(f"SELECT seq FROM {table} ORDER BY seq OFFSET %s LIMIT %s", (depth, n))
        cur.fetchall()
    return sw.seconds


# --------------------------------------------------------------------------- write-back

WB_SQL = "UPDATE {table} SET status = %s WHERE id = %s AND status = %s"


def update_one_by_one(ctx: BenchContext, table: str, keys: list[int]) -> Sample:
    """One guarded UPDATE per key, autocommit (one round trip and one commit per row)."""
    conn = ctx.pg(autocommit=True)
    sql = WB_SQL.format(table=table)
    applied = 0
    try:
        with conn.cursor() as cur, Stopwatch() as sw:
            for k in keys:
                cur.execute(sql, ("DONE", k, "PENDING"))
                applied += cur.rowcount
    finally:
        conn.close()
    return Sample(sw.seconds, applied)


def update_executemany(ctx: BenchContext, table: str, keys: list[int]) -> Sample:
    """psycopg2 ``executemany`` of the guarded UPDATE in one transaction."""
    conn = ctx.pg(autocommit=False)
    sql = WB_SQL.format(table=table)
    try:
        with conn.cursor() as cur, Stopwatch() as sw:
            cur.executemany(sql, [("DONE", k, "PENDING") for k in keys])
            applied = cur.rowcount
            conn.commit()
    finally:
        conn.close()
    return Sample(sw.seconds, applied)
