"""Issue 31: the preview's ETA against the round it previewed.

``preview_eta``: a table of ``min(rows, 10^6)`` orders (one in five PAID, the rest PENDING) is
previewed (``KeysetTraversal.preview``: bounds, estimates, the chunk query's plan, eight sample
chunks of 1,000 rows read and the processor run on each in a rolled-back transaction) and then
planned into 4 ranges and traversed by one task, range after range (``workers=1`` in the
preview), with the processor the preview tried: a guarded bulk update ``PENDING -> CANCELLED``
through ``chunk.connection`` (``guarded_update``), committed per chunk. Ratio = preview ETA /
measured round duration (from the first ``traverse`` call to the last one's return; the plan is
not timed, as the ETA does not include it). Target: within 25 % (0.75-1.25x). Each repetition
resets the table (every order back to its status), previews and runs a fresh stream; the
median ratio is reported, every figure in the details.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from airflow_keyset_provider.core import Chunk, ChunkResult, KeysetTraversal
from airflow_keyset_provider.core.writeback import guarded_update
from benchmarks.context import BenchContext, pg_cursor
from benchmarks.report import Metric

ROWS = 1_000_000
RANGES = 4
CHUNK = 1000


def _table(ctx: BenchContext, rows: int) -> str:
    name = ctx.table("preview_orders")
    with pg_cursor(ctx) as cur:
        cur.execute(f"CREATE SCHEMA IF NOT EXISTS {ctx.schema}")
        cur.execute(f"DROP TABLE IF EXISTS {name}")
        cur.execute(f"CREATE TABLE {name} (id bigint PRIMARY KEY, status text NOT NULL)")
        cur.execute(
            f"INSERT INTO {name} SELECT g, CASE WHEN mod(g, 5) = 0 THEN 'PAID' ELSE 'PENDING' END "
            "FROM generate_series(1, %s) g",
            (rows,),
        )
        cur.execute(f"VACUUM ANALYZE {name}")
    return name


def _reset(ctx: BenchContext, name: str) -> None:
    with pg_cursor(ctx) as cur:
        cur.execute(f"UPDATE {name} SET status = 'PENDING' WHERE status = 'CANCELLED'")
        cur.execute(f"VACUUM ANALYZE {name}")


def _processor(table: str) -> Callable[[Chunk], ChunkResult]:
    def cancel(chunk: Chunk) -> ChunkResult:
        return guarded_update(
            chunk.connection,
            table,
            "id",
            chunk.keys,
            values={"status": "CANCELLED"},
            expected={"status": "PENDING"},
        ).to_chunk_result()

    return cancel


def _once(ctx: BenchContext, table: str, rows: int) -> dict[str, float]:
    t = KeysetTraversal(
        ctx.pg_url,
        table=table,
        key="id",
        redis_url=ctx.redis_url,
        stream=ctx.stream("preview"),
        key_prefix=ctx.prefix,
        target_url=ctx.pg_url,
    )
    cancel = _processor(table)
    try:
        preview = t.preview(RANGES, processor=cancel, chunk_size=CHUNK, workers=1, new_stream=True)
        if preview.processor.raised or not preview.processor.ran:
            raise RuntimeError(f"the preview did not run the processor: {preview.processor}")
        rnd = t.plan(RANGES, new_stream=True)
        started = time.perf_counter()
        done = 0
        for spec in rnd.ranges:
            res = t.traverse(rnd.round_id, spec.range_id, cancel, chunk_size=CHUNK)
            if not res.complete:
                raise RuntimeError(f"range {spec.range_id} did not complete: {res}")
            done += res.done + res.skipped
        seconds = time.perf_counter() - started
        t.close_round(rnd.round_id)
    finally:
        t.close()
    if done != rows:
        raise RuntimeError(f"the round reached {done} keys, expected {rows}")
    eta = preview.eta.seconds
    assert eta is not None
    return {
        "eta_s": eta,
        "round_s": seconds,
        "ratio": eta / seconds,
        "estimated_rows": preview.estimated_rows,
        "sample_rows_per_s": preview.eta.task_rows_per_second or 0.0,
        "measured_rows_per_s": rows / seconds,
        "scan_is_index_range": float((preview.chunk_plan or {}).get("scan") == "index range"),
    }


def _preview_eta(ctx: BenchContext) -> Metric:
    rows = min(ctx.rows, ROWS)
    table = _table(ctx, rows)
    runs = []
    for i in range(max(ctx.repeat, 1)):
        if i:
            _reset(ctx, table)
        runs.append(_once(ctx, table, rows))
    ratio = statistics.median(r["ratio"] for r in runs)
    eta = statistics.median(r["eta_s"] for r in runs)
    measured = statistics.median(r["round_s"] for r in runs)
    return Metric(
        "preview_eta",
        "preview",
        f"preview ETA / measured round, {rows:,} rows, guarded update per chunk of {CHUNK:,}",
        eta,
        measured,
        "s",
        ratio,
        "0.75-1.25x",
        0.75 <= ratio <= 1.25,
        f"{len(runs)} run(s); ratios {[round(r['ratio'], 3) for r in runs]}; estimated rows "
        f"{[int(r['estimated_rows']) for r in runs]}; sample rate "
        f"{[round(r['sample_rows_per_s']) for r in runs]} vs measured "
        f"{[round(r['measured_rows_per_s']) for r in runs]} rows/s; one task, {RANGES} ranges",
        {"runs": runs},
    )


def run(ctx: BenchContext) -> list[Metric]:
    return [_preview_eta(ctx)]
