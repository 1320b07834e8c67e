"""Target 1: no-op processor, bigint key, 10k-row chunks.

Project: one ``traverse`` of a one-range round over every row of ``seq``.
Baselines (same run, interleaved): the hand-written psycopg2 keyset loop with one Redis Lua
advance per chunk, and psycopg2 COPY of the same ids into a sink that discards them.
"""

from __future__ import annotations

from typing import Any

from benchmarks import baselines, project
from benchmarks.context import BenchContext
from benchmarks.data import ensure_table
from benchmarks.report import Metric
from benchmarks.timing import interleaved, median_rate, median_seconds, spread


def fixed_overhead(ctx: BenchContext, table: str) -> float:
    """Median seconds of a ``traverse`` of a one-row range: the per-call cost beyond the loop."""
    samples = [project.traverse_once(ctx, table, "seq", 0, 1) for _ in range(max(ctx.repeat, 3))]
    return median_seconds(samples)


def run(ctx: BenchContext) -> list[Metric]:
    table = ensure_table(ctx, "seq")
    hi, n = ctx.rows, ctx.chunk_size
    baselines.keyset_loop(ctx, table, 0, hi, n)  # warm the cache and the server, untimed
    s = interleaved(
        {
            "project": lambda: project.traverse_once(ctx, table, "seq", 0, hi),
            "loop": lambda: baselines.keyset_loop(ctx, table, 0, hi, n),
            "loop_no_redis": lambda: baselines.keyset_loop(
                ctx, table, 0, hi, n, redis_advance=False
            ),
            "copy": lambda: baselines.copy_ids(ctx, table),
        },
        ctx.repeat,
    )
    for name, samples in s.items():
        if any(x.rows != ctx.rows for x in samples):
            raise RuntimeError(f"{name} read {[x.rows for x in samples]} rows, expected {ctx.rows}")
    p, loop, copy = median_rate(s["project"]), median_rate(s["loop"]), median_rate(s["copy"])
    details: dict[str, Any] = {name: spread(samples) for name, samples in s.items()}
    details["loop_no_redis_rows_per_s"] = median_rate(s["loop_no_redis"])
    details["project_fixed_overhead_s"] = fixed_overhead(ctx, table)
    details["chunk_size"] = n
    overhead_note = (
        f"fixed cost per traverse call {details['project_fixed_overhead_s'] * 1000:.0f} ms "
        f"(included; {details['project_fixed_overhead_s'] * p / ctx.rows:.1%} of this run)"
    )
    return [
        Metric(
            "noop_vs_loop",
            "noop",
            "no-op processor vs hand-written keyset loop + Redis advance",
            p,
            loop,
            "rows/s",
            p / loop,
            ">= 1.00x",
            p / loop >= 1.0,
            overhead_note,
            details,
        ),
        Metric(
            "noop_vs_copy",
            "noop",
            "no-op processor vs psycopg2 COPY of the ids",
            p,
            copy,
            "rows/s",
            p / copy,
            ">= 0.85x",
            p / copy >= 0.85,
            "",
            {"copy": details["copy"]},
        ),
    ]
