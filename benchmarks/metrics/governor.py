"""Issue #12: the shared throughput governor and adaptive chunks.

``governor_rate``: four ranges in four processes share one stream throttled to ``R`` rows/s
(``KeysetTraversal.throttle``, the token bucket in Redis); runs under 2*R*30 rows (the smoke
test) use 5 s and a budget scaled to the table. Each child is a fresh process started
together on the parent's signal (as in the parallel metric); the round holds ``R * 30`` rows, so
the run lasts about 30 s. Achieved = rows / (last end - first start); the ratio achieved / R is
checked against 0.90-1.10x. The children poll the control hash every second, as tasks do.

``adaptive_chunks``: one range over a table whose rows widen 10x along the key (payload from 200
to 2,000 bytes); the processor's cost is proportional to the bytes it gets (``time.sleep`` of
0.5 us per byte, like an I/O-bound sink). Target 0.1 s per chunk from a start of 50 rows. A
chunk's duration is the time from one processor call to the next (read + process + commit, what
the sizer steers). Checked: from the 20th chunk on, the median duration is within ±25 % of the
target (ratio median / target in 0.75-1.25x); the note gives the share of those chunks within
±25 % and the sizes at the narrow and the wide end.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

from airflow_keyset_provider.core import Chunk, TraverseOptions
from benchmarks import procs, project
from benchmarks.context import BenchContext, pg_cursor
from benchmarks.data import ensure_table
from benchmarks.report import Metric

RATE = 20_000  # rows/s shared by the four tasks
SECONDS = 30
TASKS = 4
TARGET_S = 0.1
WIDE_ROWS = 20_000


def _governor(ctx: BenchContext) -> Metric:
    table = ensure_table(ctx, "seq")
    seconds = SECONDS if ctx.rows >= 2 * RATE * SECONDS else 5  # tiny runs (smoke test): short
    rate = min(RATE, max(ctx.rows // (2 * seconds), 100))
    rows = rate * seconds
    t, rnd = project.plan(ctx, table, "seq", 0, rows, ranges=TASKS, stream="gov")
    t.throttle(rate)
    stream = t.stream
    children = [
        procs.spawn(
            "range",
            procs.child_args(
                ctx,
                table=table,
                key="seq",
                stream=stream,
                round_id=rnd.round_id,
                range_id=spec.range_id,
                chunk_size=1000,
            ),
        )
        for spec in rnd.ranges
    ]
    procs.start_together(children)
    results = [procs.result(c) for c in children]
    t.close()
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    read = sum(r["rows"] for r in results)
    if read != rows or not all(r["complete"] for r in results):
        raise RuntimeError(f"governed round read {read} rows, expected {rows}: {results}")
    achieved = read / wall
    ratio = achieved / rate
    return Metric(
        "governor_rate",
        "governor",
        f"{TASKS} processes sharing max_rows_per_second={rate:,}: achieved / budget",
        achieved,
        float(rate),
        "rows/s",
        ratio,
        "0.90-1.10x",
        0.9 <= ratio <= 1.1,
        f"{read:,} rows in {wall:.1f} s by {TASKS} processes, chunks of 1,000; one burst of "
        f"{rate:,} rows (1 s of budget) is allowed at the start; per task "
        f"{[r['rows'] for r in results]} rows",
        {
            "per_task": [{"rows": r["rows"], "s": r["end"] - r["start"]} for r in results],
            "rate": rate,
            "wall_s": wall,
        },
    )


def _wide_rows(ctx: BenchContext) -> int:
    return min(WIDE_ROWS, max(ctx.rows // 10, 2_000))


def _wide_table(ctx: BenchContext) -> str:
    name, n = ctx.table("wide"), _wide_rows(ctx)
    with pg_cursor(ctx) as cur:
        cur.execute(f"CREATE SCHEMA IF NOT EXISTS {ctx.schema}")
        cur.execute(f"DROP TABLE IF EXISTS {name}")
        cur.execute(f"CREATE TABLE {name} (seq bigint PRIMARY KEY, payload text NOT NULL)")
        cur.execute(
            f"INSERT INTO {name} SELECT g, repeat('x', 200 + (1800 * g / {n})::int) "
            f"FROM generate_series(1, {n}) g"
        )
        cur.execute(f"VACUUM ANALYZE {name}")
    return name


def _adaptive(ctx: BenchContext) -> Metric:
    table = _wide_table(ctx)
    t = _with_payload(ctx, table, ctx.stream("adaptive"))
    rnd = t.plan(max_ranges=1, start_key=0, end_key=_wide_rows(ctx))
    starts: list[float] = []
    sizes: list[int] = []

    def proc(chunk: Chunk) -> None:
        starts.append(time.monotonic())
        sizes.append(len(chunk.values))
        time.sleep(0.5e-6 * sum(len(v[-1]) for v in chunk.values))

    opts = TraverseOptions(
        chunk_size=50, target_chunk_seconds=TARGET_S, min_chunk_size=10, max_chunk_size=20_000
    )
    res = t.traverse(rnd.round_id, 0, proc, options=opts)
    t.close()
    if not res.complete:
        raise RuntimeError(f"adaptive range did not complete: {res}")
    durations = [b - a for a, b in itertools.pairwise(starts)]
    settled = durations[19:] or durations
    med = statistics.median(settled)
    within = sum(1 for d in settled if abs(d - TARGET_S) <= 0.25 * TARGET_S) / len(settled)
    ratio = med / TARGET_S
    return Metric(
        "adaptive_chunks",
        "governor",
        "adaptive chunk size on rows widening 10x: median chunk duration after 20 chunks / target",
        med,
        TARGET_S,
        "s",
        ratio,
        "0.75-1.25x",
        0.75 <= ratio <= 1.25,
        f"{len(durations) + 1} chunks; {within:.0%} of chunks 20+ within ±25 % of {TARGET_S} s; "
        f"sizes: first {sizes[:6]}, at chunk 20 {sizes[19] if len(sizes) > 19 else '-'}, "
        f"last {sizes[-4:]} (narrow rows early, 10x wider at the end)",
        {"sizes": sizes, "durations": durations},
    )


def _with_payload(ctx: BenchContext, table: str, stream: str) -> Any:
    from airflow_keyset_provider.core import KeysetTraversal

    return KeysetTraversal(
        ctx.pg_url,
        table=table,
        key="seq",
        columns=["payload"],
        redis_url=ctx.redis_url,
        stream=stream,
        key_prefix=ctx.prefix,
    )


def run(ctx: BenchContext) -> list[Metric]:
    return [_governor(ctx), _adaptive(ctx)]
