"""Target 2: an I/O-bound processor (a fixed wait per chunk) gains from prefetching.

Project: ``traverse`` with its default ``prefetch=True`` (the next chunk is read while the
processor waits). Baseline: the same hand-written loop as target 1, sequential, with the same
wait. The wait is ``time.sleep`` (it releases the GIL like a socket read would).
"""

from __future__ import annotations

from typing import Any

from benchmarks import baselines, project
from benchmarks.context import BenchContext
from benchmarks.data import ensure_table
from benchmarks.report import Metric
from benchmarks.timing import interleaved, median_rate, spread

MAX_ROWS = 2_000_000  # the ratio does not depend on size; keeps the 10M mode short


def run(ctx: BenchContext) -> list[Metric]:
    table = ensure_table(ctx, "seq")
    hi, n, ms = min(ctx.rows, MAX_ROWS), ctx.chunk_size, ctx.io_wait_ms
    s = interleaved(
        {
            "project": lambda: project.traverse_once(ctx, table, "seq", 0, hi, project.sleeper(ms)),
            "loop": lambda: baselines.keyset_loop(ctx, table, 0, hi, n, baselines.sleeper(ms)),
            "project_no_prefetch": lambda: project.traverse_once(
                ctx, table, "seq", 0, hi, project.sleeper(ms), prefetch=False
            ),
        },
        ctx.repeat,
    )
    p, loop = median_rate(s["project"]), median_rate(s["loop"])
    details: dict[str, Any] = {name: spread(samples) for name, samples in s.items()}
    details.update(wait_ms=ms, chunk_size=n, rows=hi)
    no_prefetch = median_rate(s["project_no_prefetch"])
    return [
        Metric(
            "io_prefetch",
            "io",
            f"{ms:g} ms wait per chunk: prefetching engine vs sequential loop",
            p,
            loop,
            "rows/s",
            p / loop,
            ">= 1.40x",
            p / loop >= 1.4,
            f"{ms:g} ms sleep per {n}-row chunk, {hi:,} rows; the engine with prefetch=False: "
            f"{no_prefetch / loop:.2f}x (2x is the ceiling, when the wait equals the read time)",
            details,
        )
    ]
