"""Running the project's engine the way a worker does: plan a round, traverse a range.

Planning happens outside the timed region (it is measured on its own by the planning metrics);
the timed region is the whole ``traverse`` call, fixed costs included: catalog validation, the
first connection, the row estimate, claim, heartbeat thread, the loop, release.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from airflow_keyset_provider.core import Chunk, KeysetTraversal, Round
from benchmarks.context import BenchContext
from benchmarks.timing import Sample, Stopwatch

Processor = Callable[[Chunk], Any]


def noop(chunk: Chunk) -> None:
    return None


def sleeper(ms: float) -> Processor:
    def wait(chunk: Chunk) -> None:
        time.sleep(ms / 1000)

    return wait


def traversal(ctx: BenchContext, table: str, key: str | list[str], stream: str) -> KeysetTraversal:
    return KeysetTraversal(
        ctx.pg_url,
        table=table,
        key=key,
        redis_url=ctx.redis_url,
        stream=ctx.stream(stream),
        key_prefix=ctx.prefix,
    )


def plan(
    ctx: BenchContext,
    table: str,
    key: str | list[str],
    start: Any,
    end: Any,
    ranges: int = 1,
    stream: str = "bench",
) -> tuple[KeysetTraversal, Round]:
    t = traversal(ctx, table, key, stream)
    return t, t.plan(max_ranges=ranges, start_key=start, end_key=end)


def traverse_range(
    t: KeysetTraversal,
    rnd: Round,
    range_id: int,
    processor: Processor,
    chunk_size: int,
    **options: Any,
) -> Sample:
    with Stopwatch() as sw:
        res = t.traverse(rnd.round_id, range_id, processor, chunk_size=chunk_size, **options)
    if not res.complete:
        raise RuntimeError(f"range {range_id} of {rnd.round_id} did not complete: {res}")
    return Sample(sw.seconds, res.rows_read, {"chunks": res.chunks})


def traverse_once(
    ctx: BenchContext,
    table: str,
    key: str | list[str],
    start: Any,
    end: Any,
    processor: Processor = noop,
    chunk_size: int | None = None,
    **options: Any,
) -> Sample:
    """Plan a one-range round (untimed), then time one ``traverse`` of it."""
    t, rnd = plan(ctx, table, key, start, end)
    try:
        return traverse_range(t, rnd, 0, processor, chunk_size or ctx.chunk_size, **options)
    finally:
        t.close()
