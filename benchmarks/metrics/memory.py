"""Targets 4 and 5: memory does not grow with rows, in the worker or in Redis; and a 4,096-range
round stays within 1 MB of Redis (issue #11, ``redis_footprint.py``).

Each repetition runs, in a fresh process, a 16-range round over ``seq`` (N rows) and over
``seq_small`` (N/10 rows), every range traversed in turn with 10k-row chunks, and reads the
process's VmHWM (peak RSS). After each round the parent sums ``MEMORY USAGE <key> SAMPLES 0``
over every Redis key of the round's stream (round, ranges, retry/dead sets, watermark, indexes).
"""

from __future__ import annotations

from typing import Any

from benchmarks import procs
from benchmarks.context import BenchContext
from benchmarks.data import ensure_table
from benchmarks.metrics import redis_footprint
from benchmarks.report import Metric
from benchmarks.timing import median

RSS_BUDGET_MB = 10.0
REDIS_BUDGET_BYTES = 32 * 1024


def redis_bytes(ctx: BenchContext, stream: str) -> tuple[int, int]:
    """(total MEMORY USAGE, number of keys) of a stream."""
    client = ctx.redis()
    try:
        keys = ctx.stream_keys(stream)
        return sum(int(client.memory_usage(k, samples=0) or 0) for k in keys), len(keys)
    finally:
        client.close()


def one_round(ctx: BenchContext, role: str, rows: int) -> dict[str, Any]:
    stream = ctx.stream(f"mem-{role}")
    res = procs.run_child(
        "round",
        procs.child_args(
            ctx,
            table=ensure_table(ctx, role),
            key="seq",
            stream=stream,
            ranges=ctx.ranges,
            start=0,
            end=rows,
        ),
    )
    if res["done"] != rows:
        raise RuntimeError(f"round over {role} counted {res['done']} rows, expected {rows}")
    res["redis_bytes"], res["redis_keys"] = redis_bytes(ctx, stream)
    return res


def run(ctx: BenchContext) -> list[Metric]:
    return [*_rss_and_round(ctx), redis_footprint.run(ctx)]


def _rss_and_round(ctx: BenchContext) -> list[Metric]:
    big: list[dict[str, Any]] = []
    small: list[dict[str, Any]] = []
    for _ in range(ctx.repeat):
        big.append(one_round(ctx, "seq", ctx.rows))
        small.append(one_round(ctx, "seq_small", ctx.small_rows))
    rss_big, rss_small = (median([r["vm_hwm_kb"] / 1024 for r in rs]) for rs in (big, small))
    red_big, red_small = (median([float(r["redis_bytes"]) for r in rs]) for rs in (big, small))
    details = {
        "rows": ctx.rows,
        "small_rows": ctx.small_rows,
        "ranges": ctx.ranges,
        "at_rows": big,
        "at_small_rows": small,
    }
    growth = rss_big - rss_small
    red_ratio = red_big / red_small
    return [
        Metric(
            "memory_rss",
            "memory",
            f"peak RSS of a {ctx.ranges}-range traversal, N vs N/10 rows",
            rss_big,
            rss_small,
            "MB",
            rss_big / rss_small,
            f"<= +{RSS_BUDGET_MB:g} MB",
            growth <= RSS_BUDGET_MB,
            f"{ctx.rows:,} vs {ctx.small_rows:,} rows: {growth:+.1f} MB; RSS before planning "
            f"{median([r['rss_before_kb'] / 1024 for r in big]):.0f} MB (imports)",
            details,
        ),
        Metric(
            "redis_round_bytes",
            "memory",
            f"Redis MEMORY USAGE of a {ctx.ranges}-range round",
            red_big,
            float(REDIS_BUDGET_BYTES),
            "bytes",
            red_big / REDIS_BUDGET_BYTES,
            "<= 1.00x (32 KB)",
            red_big <= REDIS_BUDGET_BYTES,
            f"{big[0]['redis_keys']} keys after the round closed",
        ),
        Metric(
            "redis_round_scaling",
            "memory",
            "Redis round state at N vs N/10 rows",
            red_big,
            red_small,
            "bytes",
            red_ratio,
            "0.90x - 1.10x",
            0.9 <= red_ratio <= 1.1,
        ),
    ]
