"""Target 3: a ``(timestamptz, bigint)`` key.

Project: ``traverse`` with ``key=["ts", "id"]`` and a no-op processor. Baseline: the hand-written
row-value loop that lets psycopg2 decode every timestamp into a ``datetime``, with one Redis
advance per chunk. Also measured (details): the same loop fetching the timestamp as text, the
ceiling for an engine that decodes only what it needs.
"""

from __future__ import annotations

import datetime as dt

from benchmarks import baselines, project
from benchmarks.context import BenchContext
from benchmarks.data import ensure_table, key_bounds
from benchmarks.report import Metric
from benchmarks.timing import interleaved, median_rate, spread


def run(ctx: BenchContext) -> list[Metric]:
    table = ensure_table(ctx, "ts")
    first, last = key_bounds(ctx, "ts")
    assert isinstance(first, tuple) and isinstance(last, tuple)
    start = (first[0] - dt.timedelta(seconds=1), 0)
    n = ctx.chunk_size
    s = interleaved(
        {
            "project": lambda: project.traverse_once(ctx, table, ["ts", "id"], start, last),
            "loop": lambda: baselines.ts_loop(ctx, table, start, last, n),
            "loop_ts_as_text": lambda: baselines.ts_loop(ctx, table, start, last, n, as_text=True),
        },
        ctx.repeat,
    )
    for name, samples in s.items():
        if any(x.rows != ctx.rows for x in samples):
            raise RuntimeError(f"{name} read {[x.rows for x in samples]} rows, expected {ctx.rows}")
    p, loop, text = (
        median_rate(s["project"]),
        median_rate(s["loop"]),
        median_rate(s["loop_ts_as_text"]),
    )
    details = {name: spread(samples) for name, samples in s.items()}
    return [
        Metric(
            "ts_key",
            "ts",
            "(timestamptz, bigint) key vs row-value loop decoding every timestamp",
            p,
            loop,
            "rows/s",
            p / loop,
            ">= 1.50x",
            p / loop >= 1.5,
            f"the loop fetching ts as text reaches {text / 1e6:.2f}M rows/s ({text / loop:.2f}x)",
            details,
        )
    ]
