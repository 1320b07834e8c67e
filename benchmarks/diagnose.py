"""Where the time goes: ``python -m benchmarks.diagnose [--rows N] [--repeat K]``.

Not part of the verdict table: this explains it. Sections (each printed and saved to
``benchmarks/results/<timestamp>-diagnose.json``):

- ``engine_phases``: one no-op ``traverse`` (bigint key, and the ``(timestamptz, bigint)`` key),
  prefetch off so every phase runs on one thread, split into chunk query execution (server work
  plus transfer, measured around ``cursor.execute`` by a psycopg2 cursor factory), ``fetchall``
  (client-side decoding), the Redis advance, and the rest (the engine's own Python per chunk
  and its fixed costs). No engine code is changed: the engine gets an Engine whose psycopg2
  connections use a timing cursor, and its store's ``advance`` is wrapped on the instance.
- ``loop_phases``: the same split for the hand-written loop.
- ``server``: ``EXPLAIN ANALYZE`` of one chunk query and of COPY's full scan (server-only time).
- ``variants``: rows/s of loop variants that show what would close a gap (interleaved, medians):
  server-side prepared statement, psycopg 3 binary + prepared, 50k chunks, COPY per chunk, the
  engine with and without prefetch.
- ``profile``: cProfile of the engine's no-op traversal (prefetch off), top functions by own time.
- ``planning``: balance of the engine's block sample on a key stored in key order against a
  sample that reads more blocks but keeps the same number of rows.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import io
import itertools
import json
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import psycopg2
import psycopg2.extensions
import sqlalchemy as sa

from airflow_keyset_provider.core import KeysetTraversal
from benchmarks import baselines, project, report
from benchmarks.context import BenchContext, pg_cursor
from benchmarks.data import ensure_table, key_bounds
from benchmarks.timing import Sample, Stopwatch, interleaved, median, median_rate

STATS: dict[str, float] = defaultdict(float)


class TimingCursor(psycopg2.extensions.cursor):
    """A psycopg2 cursor that adds the time of chunk queries to ``STATS``."""

    def execute(self, query: Any, vars: Any = None) -> Any:
        chunk = _is_chunk(query)
        t0 = time.perf_counter()
        try:
            return super().execute(query, vars)
        finally:
            STATS["execute_s" if chunk else "other_sql_s"] += time.perf_counter() - t0
            STATS["chunks" if chunk else "other_sql"] += 1
            self._chunk = chunk

    def fetchall(self) -> Any:
        t0 = time.perf_counter()
        try:
            return super().fetchall()
        finally:
            if getattr(self, "_chunk", False):
                STATS["fetchall_s"] += time.perf_counter() - t0


def _is_chunk(query: Any) -> bool:
    q = query.decode() if isinstance(query, bytes) else str(query)
    return "ORDER BY" in q and "LIMIT" in q and not q.lstrip().upper().startswith("EXPLAIN")


def _wrap(stats_key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            STATS[stats_key] += time.perf_counter() - t0

    return timed


# --------------------------------------------------------------------------- phases


def engine_phases(
    ctx: BenchContext,
    table: str,
    key: str | list[str],
    start: Any,
    end: Any,
    prefetch: bool = False,
) -> dict[str, float]:
    engine = sa.create_engine(ctx.pg_url, connect_args={"cursor_factory": TimingCursor})
    t = KeysetTraversal(
        engine,
        table=table,
        key=key,
        redis_url=ctx.redis_url,
        stream=ctx.stream("diag"),
        key_prefix=ctx.prefix,
    )
    rnd = t.plan(max_ranges=1, start_key=start, end_key=end)
    t.store.advance = _wrap("advance_s", t.store.advance)  # type: ignore[method-assign]
    STATS.clear()
    with Stopwatch() as sw:
        res = t.traverse(
            rnd.round_id, 0, project.noop, chunk_size=ctx.chunk_size, prefetch=prefetch
        )
    t.close()
    engine.dispose()
    out = _phases(sw.seconds, res.rows_read)
    out["prefetch"] = prefetch
    return out


def _phases(total: float, rows: int) -> dict[str, Any]:
    s = dict(STATS)
    known = s.get("execute_s", 0) + s.get("fetchall_s", 0) + s.get("advance_s", 0)
    chunks = max(int(s.get("chunks", 0)), 1)
    return {
        "total_s": total,
        "rows": rows,
        "rows_per_s": rows / total,
        "chunks": chunks,
        "execute_s": s.get("execute_s", 0),
        "fetchall_s": s.get("fetchall_s", 0),
        "advance_s": s.get("advance_s", 0),
        "other_sql_s": s.get("other_sql_s", 0),
        "other_sql": int(s.get("other_sql", 0)),
        "rest_s": total - known,
        "per_chunk_us": {
            k: 1e6 * s.get(k, 0) / chunks for k in ("execute_s", "fetchall_s", "advance_s")
        }
        | {"rest_s": 1e6 * (total - known) / chunks},
    }


def loop_phases(ctx: BenchContext, table: str) -> dict[str, Any]:
    fence = baselines.RedisCursor(ctx, baselines.int_cursor(0))
    fence.advance = _wrap("advance_s", fence.advance)  # type: ignore[method-assign]
    STATS.clear()
    sql = f"SELECT seq FROM {table} WHERE seq > %s AND seq <= %s ORDER BY seq LIMIT %s"
    rows_total = 0
    with Stopwatch() as sw:
        conn = psycopg2.connect(ctx.dsn, cursor_factory=TimingCursor)
        conn.autocommit = True
        cur, cursor = conn.cursor(), 0
        while cursor < ctx.rows:
            cur.execute(sql, (cursor, ctx.rows, ctx.chunk_size))
            rows = cur.fetchall()
            if not rows:
                break
            cursor = rows[-1][0]
            fence.advance(baselines.int_cursor(cursor), len(rows))
            rows_total += len(rows)
        conn.close()
    fence.close()
    return _phases(sw.seconds, rows_total)


# --------------------------------------------------------------------------- server side


def server_side(ctx: BenchContext, table: str) -> dict[str, Any]:
    mid = ctx.rows // 2
    out: dict[str, Any] = {}
    with pg_cursor(ctx) as cur:
        cur.execute(
            f"EXPLAIN (ANALYZE, FORMAT JSON) SELECT seq FROM {table} WHERE seq > %s AND seq <= %s "
            "ORDER BY seq LIMIT %s",
            (mid, ctx.rows, ctx.chunk_size),
        )
        plan = cur.fetchone()[0][0]
        out["chunk_planning_ms"] = plan["Planning Time"]
        out["chunk_execution_ms"] = plan["Execution Time"]
        out["chunk_us_per_row"] = 1000 * plan["Execution Time"] / ctx.chunk_size
        cur.execute(f"EXPLAIN (ANALYZE, TIMING OFF, FORMAT JSON) SELECT seq FROM {table}")
        plan = cur.fetchone()[0][0]
        out["full_scan_execution_ms"] = plan["Execution Time"]
        out["full_scan_us_per_row"] = 1000 * plan["Execution Time"] / ctx.rows
    return out


# --------------------------------------------------------------------------- variants


def loop_prepared(ctx: BenchContext, table: str) -> Sample:
    """The hand-written loop with a server-side prepared statement (no per-chunk planning)."""
    fence = baselines.RedisCursor(ctx, baselines.int_cursor(0))
    rows_total = 0
    try:
        with Stopwatch() as sw:
            conn = ctx.pg()
            cur = conn.cursor()
            cur.execute(
                f"PREPARE kchunk(bigint, bigint, int) AS SELECT seq FROM {table} "
                "WHERE seq > $1 AND seq <= $2 ORDER BY seq LIMIT $3"
            )
            cursor = 0
            while cursor < ctx.rows:
                cur.execute("EXECUTE kchunk(%s, %s, %s)", (cursor, ctx.rows, ctx.chunk_size))
                rows = cur.fetchall()
                if not rows:
                    break
                cursor = rows[-1][0]
                fence.advance(baselines.int_cursor(cursor), len(rows))
                rows_total += len(rows)
            conn.close()
    finally:
        fence.close()
    return Sample(sw.seconds, rows_total)


def loop_psycopg3(ctx: BenchContext, table: str) -> Sample:
    """The hand-written loop on psycopg 3, binary results, prepared after the first chunk."""
    import psycopg

    fence = baselines.RedisCursor(ctx, baselines.int_cursor(0))
    rows_total = 0
    try:
        with Stopwatch() as sw:
            conn = psycopg.connect(ctx.dsn, autocommit=True, prepare_threshold=0)
            cur = conn.cursor(binary=True)
            cursor = 0
            sql = f"SELECT seq FROM {table} WHERE seq > %s AND seq <= %s ORDER BY seq LIMIT %s"
            while cursor < ctx.rows:
                cur.execute(sql, (cursor, ctx.rows, ctx.chunk_size))
                rows = cur.fetchall()
                if not rows:
                    break
                cursor = rows[-1][0]
                fence.advance(baselines.int_cursor(cursor), len(rows))
                rows_total += len(rows)
            conn.close()
    finally:
        fence.close()
    return Sample(sw.seconds, rows_total)


def loop_copy_chunks(ctx: BenchContext, table: str) -> Sample:
    """Each chunk read with COPY into a buffer; only the last key is decoded (a lazy chunk)."""
    fence = baselines.RedisCursor(ctx, baselines.int_cursor(0))
    rows_total = 0
    try:
        with Stopwatch() as sw:
            conn = ctx.pg()
            cur = conn.cursor()
            cursor = 0
            while cursor < ctx.rows:
                buf = io.BytesIO()
                sql = cur.mogrify(
                    f"COPY (SELECT seq FROM {table} WHERE seq > %s AND seq <= %s ORDER BY seq "
                    "LIMIT %s) TO STDOUT",
                    (cursor, ctx.rows, ctx.chunk_size),
                ).decode()
                cur.copy_expert(sql, buf)
                data = buf.getvalue()
                if not data:
                    break
                cursor = int(data[data.rfind(b"\n", 0, len(data) - 1) + 1 : -1])
                n = data.count(b"\n")
                fence.advance(baselines.int_cursor(cursor), n)
                rows_total += n
            conn.close()
    finally:
        fence.close()
    return Sample(sw.seconds, rows_total)


def variants(ctx: BenchContext, table: str) -> dict[str, Any]:
    hi, n = ctx.rows, ctx.chunk_size
    s = interleaved(
        {
            "engine": lambda: project.traverse_once(ctx, table, "seq", 0, hi),
            "engine_no_prefetch": lambda: project.traverse_once(
                ctx, table, "seq", 0, hi, prefetch=False
            ),
            "engine_50k": lambda: project.traverse_once(
                ctx, table, "seq", 0, hi, chunk_size=50_000
            ),
            "loop": lambda: baselines.keyset_loop(ctx, table, 0, hi, n),
            "loop_prepared": lambda: loop_prepared(ctx, table),
            "loop_psycopg3_binary": lambda: loop_psycopg3(ctx, table),
            "loop_50k": lambda: baselines.keyset_loop(ctx, table, 0, hi, 50_000),
            "loop_copy_chunks": lambda: loop_copy_chunks(ctx, table),
            "copy": lambda: baselines.copy_ids(ctx, table),
        },
        ctx.repeat,
    )
    loop = median_rate(s["loop"])
    return {
        name: {
            "rows_per_s": median_rate(v),
            "vs_loop": median_rate(v) / loop,
            "all": [round(x.rate) for x in v],
        }
        for name, v in s.items()
    }


# --------------------------------------------------------------------------- lazy-rows prototype


class LazyRows:
    """A chunk's rows left in the driver's result buffer until someone reads them.

    ``len`` and ``[-1]`` (the last key, all the engine needs to advance) decode one row; any
    other access decodes all of them once. This is the proposed change to ``SqlSource.fetch``.
    """

    def __init__(self, cur: Any) -> None:
        self.cur, self.n = cur, cur.rowcount
        self._rows: list[tuple] | None = None

    def __len__(self) -> int:
        return self.n

    def _all(self) -> list[tuple]:
        if self._rows is None:
            self._rows = rows = self.cur.fetchall()
            self.cur.close()
            return rows
        return self._rows

    def __getitem__(self, i: Any) -> Any:
        if self._rows is None and isinstance(i, int) and i in (-1, self.n - 1):
            self.cur.scroll(self.n - 1, mode="absolute")
            row = self.cur.fetchone()
            self.cur.scroll(0, mode="absolute")
            return row
        return self._all()[i]

    def __iter__(self) -> Any:
        return iter(self._all())


def lazy_fetch(source: Any) -> Callable[[str, str, int], LazyRows]:
    """A drop-in for ``SqlSource.fetch`` (psycopg2, no result processors) returning LazyRows.
    Uses the engine's own compiled chunk statement and parameter encoding."""
    from airflow_keyset_provider.core.keys import MIN_KEY

    compiled = {
        has_lo: source._chunk_statement(has_lo).compile(dialect=source.engine.dialect).string
        for has_lo in (False, True)
    }
    raw = source.engine.raw_connection()

    def fetch(lo: str, hi: str, n: int) -> LazyRows:
        has_lo = lo != MIN_KEY
        params = {
            "n": n,
            **source.key_params(hi, "h"),
            **(source.key_params(lo, "c") if has_lo else {}),
        }
        cur = raw.cursor()
        cur.execute(compiled[has_lo], params)
        return LazyRows(cur)

    return fetch


def engine_lazy(
    ctx: BenchContext,
    table: str,
    key: str | list[str],
    start: Any,
    end: Any,
    processor: Callable[[Any], Any] = project.noop,
) -> Sample:
    t, rnd = project.plan(ctx, table, key, start, end)
    t.source.validate()
    t.source.fetch = lazy_fetch(t.source)  # type: ignore[method-assign,assignment]
    try:
        return project.traverse_range(t, rnd, 0, processor, ctx.chunk_size)
    finally:
        t.close()


def touch_keys(chunk: Any) -> None:
    """A processor that reads every key (forces decoding of every row)."""
    len(chunk.keys)


def lazy_variants(
    ctx: BenchContext, seq: str, ts: str, ts_start: Any, ts_end: Any
) -> dict[str, Any]:
    hi, n = ctx.rows, ctx.chunk_size
    s = interleaved(
        {
            "bigint_loop": lambda: baselines.keyset_loop(ctx, seq, 0, hi, n),
            "bigint_engine": lambda: project.traverse_once(ctx, seq, "seq", 0, hi),
            "bigint_engine_lazy": lambda: engine_lazy(ctx, seq, "seq", 0, hi),
            "bigint_engine_touch_keys": lambda: project.traverse_once(
                ctx, seq, "seq", 0, hi, touch_keys
            ),
            "bigint_engine_lazy_touch_keys": lambda: engine_lazy(
                ctx, seq, "seq", 0, hi, touch_keys
            ),
            "bigint_copy": lambda: baselines.copy_ids(ctx, seq),
            "ts_loop": lambda: baselines.ts_loop(ctx, ts, ts_start, ts_end, n),
            "ts_engine": lambda: project.traverse_once(ctx, ts, ["ts", "id"], ts_start, ts_end),
            "ts_engine_lazy": lambda: engine_lazy(ctx, ts, ["ts", "id"], ts_start, ts_end),
            "ts_engine_lazy_touch_keys": lambda: engine_lazy(
                ctx, ts, ["ts", "id"], ts_start, ts_end, touch_keys
            ),
        },
        ctx.repeat,
    )
    base = {"bigint": median_rate(s["bigint_loop"]), "ts": median_rate(s["ts_loop"])}
    return {
        name: {
            "rows_per_s": median_rate(v),
            "vs_loop": median_rate(v) / base[name.split("_")[0]],
            "all": [round(x.rate) for x in v],
        }
        for name, v in s.items()
    }


# --------------------------------------------------------------------------- profile


def profile_engine(
    ctx: BenchContext, table: str, key: str | list[str], start: Any, end: Any, top: int = 18
) -> str:
    t, rnd = project.plan(ctx, table, key, start, end)
    prof = cProfile.Profile()
    prof.enable()
    t.traverse(rnd.round_id, 0, project.noop, chunk_size=ctx.chunk_size, prefetch=False)
    prof.disable()
    t.close()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


# --------------------------------------------------------------------------- planning


def planning(
    ctx: BenchContext,
    table: str,
    parts: int = 16,
    sample_rows: int = 50_000,
    min_blocks: int = 2048,
) -> dict[str, Any]:
    """Largest/mean of ranges cut at sample quantiles: the engine's block sample (``pct =
    sample_rows / rows``) vs reading at least ``min_blocks`` blocks and keeping each row with
    probability ``sample_rows / rows_read`` (same rows to the client, many more blocks)."""
    with pg_cursor(ctx) as cur:
        cur.execute("SELECT relpages, reltuples FROM pg_class WHERE oid = %s::regclass", (table,))
        pages, tuples = cur.fetchone()
        current = 100.0 * min(1.0, sample_rows / tuples)
        wide = 100.0 * min(1.0, max(sample_rows / tuples, min_blocks / max(pages, 1)))
        keep = min(1.0, sample_rows / (tuples * wide / 100))
        out: dict[str, Any] = {"relpages": pages, "reltuples": tuples}
        for name, pct, q in (
            ("engine_block_sample", current, 1.0),
            ("more_blocks_thinned", wide, keep),
        ):
            ratios, times = [], []
            for _ in range(max(ctx.repeat, 5)):
                with Stopwatch() as sw:
                    cur.execute(
                        f"SELECT seq FROM {table} TABLESAMPLE SYSTEM (%s) WHERE random() < %s",
                        (pct, q),
                    )
                    keys = sorted(r[0] for r in cur.fetchall())
                    step = len(keys) / parts
                    cuts = [keys[round(step * i) - 1] for i in range(1, parts)]
                bounds = [0, *cuts, ctx.rows]
                counts = [b - a for a, b in itertools.pairwise(bounds)]  # seq is dense 1..N
                ratios.append(max(counts) / (sum(counts) / len(counts)))
                times.append(sw.seconds)
            out[name] = {
                "pct": pct,
                "keep": q,
                "largest_over_mean": ratios,
                "median": median(ratios),
                "sample_s": median(times),
            }
    return out


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.diagnose")
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--schema", default="kbench")
    a = p.parse_args(argv)
    ctx = BenchContext(rows=a.rows, repeat=a.repeat, schema=a.schema)
    out: dict[str, Any] = {
        "rows": ctx.rows,
        "loadavg_at_start": list(__import__("os").getloadavg()),
    }
    try:
        seq, ts = ensure_table(ctx, "seq"), ensure_table(ctx, "ts")
        first, last = key_bounds(ctx, "ts")
        assert isinstance(first, tuple)
        ts_start = (first[0] - dt.timedelta(seconds=1), 0)
        out["engine_phases"] = [
            engine_phases(ctx, seq, "seq", 0, ctx.rows) for _ in range(ctx.repeat)
        ]
        out["loop_phases"] = [loop_phases(ctx, seq) for _ in range(ctx.repeat)]
        out["engine_phases_ts"] = [
            engine_phases(ctx, ts, ["ts", "id"], ts_start, last) for _ in range(ctx.repeat)
        ]
        out["server"] = server_side(ctx, seq)
        out["variants"] = variants(ctx, seq)
        out["lazy_rows_prototype"] = lazy_variants(ctx, seq, ts, ts_start, last)
        out["planning"] = planning(ctx, seq)
        out["profile_bigint"] = profile_engine(ctx, seq, "seq", 0, ctx.rows)
        out["profile_ts"] = profile_engine(ctx, ts, ["ts", "id"], ts_start, last)
    finally:
        ctx.cleanup_redis()
    out["loadavg_at_end"] = list(__import__("os").getloadavg())
    text = json.dumps(out, indent=2, default=str)
    path = report.RESULTS_DIR / f"{time.strftime('%Y%m%d-%H%M%S')}-diagnose.json"
    report.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    for k in ("profile_bigint", "profile_ts"):
        print(f"== {k}\n{out.pop(k)}")
    print(json.dumps(out, indent=1, default=str))
    print(f"saved {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
