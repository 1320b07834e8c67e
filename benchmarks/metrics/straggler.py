"""Scale-out target: dynamic splitting of a straggler shortens the round.

A round of 16 equal ranges over ``seq`` (at most 32,000 rows) is worked by 4 pull-mode task
processes, as ``PlanRangesOperator(max_tasks=4)`` starts them: first ranges spread over the key
order (positions 0, 4, 8, 12) and each claim coalescing its share of what is left (the first
claims take 4 ranges each). The processor sleeps a fixed time per row (so the figure is about
scheduling, not about a machine's CPU), ten times as long on the keys of one range: the 9th in key
order, the first of the third task's block. Same tasks, same rows, same processor; the project
runs with ``split=True`` (idle tasks ask the straggler's owner to split at a chunk boundary and
take the new range), the baseline with ``split=False`` (a task ends when nothing is left to claim).
The ratio is baseline makespan / project makespan.

Sizes: a normal range sleeps 1 s (0.5 ms per row at 32,000 rows) in chunks of 50 rows (25 ms),
so the engine's per-chunk cost stays small beside the work and a split waits at most one 250 ms
chunk of the straggler. The ceiling for this layout, in units of one normal range: without
splitting the block holding the straggler ends at 10 + 3 = 13; with perfect splitting the 25
units of work end at 25 / 4 = 6.25; so 2.08x. What the project loses to that goes to the engine's
cost per chunk and per range, to chunk boundaries (a split waits for the owner's next commit), to
splits at the median of the rows left (a block mixing the slow range with fast ones is first
split in its fast part) and to the requesters' polling (task processes are started and
connected before the clock starts).
"""

from __future__ import annotations

from typing import Any

from benchmarks import pull
from benchmarks.context import BenchContext
from benchmarks.data import ensure_table
from benchmarks.report import Metric
from benchmarks.timing import Sample, median_seconds, spread

TASKS = 4
RANGES = 16
SLOW_INDEX = 8  # the 9th range in key order
SLOWDOWN = 10
MAX_ROWS = 32_000
RANGE_SECONDS = 1.0  # processing time of one normal range of MAX_ROWS / RANGES rows
CHUNK_ROWS = 50
TARGET = 1.6


def ceiling() -> float:
    """The best ratio splitting can reach on this layout (module docstring)."""
    block = RANGES // TASKS  # the first claims coalesce a block each; the slow range leads one
    return (SLOWDOWN + block - 1) / ((RANGES - 1 + SLOWDOWN) / TASKS)


def one_round(ctx: BenchContext, table: str, rows: int, split: bool) -> Sample:
    t, rnd = pull.plan(ctx, table, rows, RANGES, "straggler")
    try:
        if len(rnd.ranges) != RANGES:
            raise RuntimeError(f"the straggler round has {len(rnd.ranges)} ranges, not {RANGES}")
        slow = sorted(rnd.ranges, key=lambda s: s.lo_encoded)[SLOW_INDEX]
        processor = {
            "row_s": RANGE_SECONDS * RANGES / MAX_ROWS,
            "slow_lo": slow.lo,
            "slow_hi": slow.hi,
            "factor": SLOWDOWN,
        }
        return pull.run_tasks(
            ctx,
            table,
            t,
            rnd,
            rows,
            tasks=TASKS,
            split=split,
            chunk_size=CHUNK_ROWS,
            processor=processor,
        )
    finally:
        t.close()


def run(ctx: BenchContext) -> list[Metric]:
    table = ensure_table(ctx, "seq")
    rows = min(ctx.rows, MAX_ROWS)
    samples: dict[str, list[Sample]] = {"split": [], "no_split": []}
    for _ in range(ctx.repeat):
        samples["split"].append(one_round(ctx, table, rows, True))
        samples["no_split"].append(one_round(ctx, table, rows, False))
    p, base = median_seconds(samples["split"]), median_seconds(samples["no_split"])
    ratio = base / p
    won = [s.extra["splits_won"] for s in samples["split"]]
    details: dict[str, Any] = {
        name: {
            "seconds": spread(ss, rate=False),
            "splits_won": [s.extra["splits_won"] for s in ss],
            "per_task": ss[0].extra["per_task"],
        }
        for name, ss in samples.items()
    }
    details.update(rows=rows, tasks=TASKS, ranges=RANGES, slowdown=SLOWDOWN, ceiling=ceiling())
    return [
        Metric(
            "straggler_split",
            "straggler",
            f"one range {SLOWDOWN}x slower: round makespan, splitting vs not ({TASKS} tasks)",
            p,
            base,
            "s",
            ratio,
            f">= {TARGET:.2f}x",
            ratio >= TARGET,
            f"{RANGES} ranges of {rows // RANGES:,} rows over {TASKS} task processes, chunks of "
            f"{CHUNK_ROWS}, {RANGE_SECONDS * rows / MAX_ROWS:.2f} s of sleep per normal range; "
            f"splits per round {min(won)}-{max(won)}; the ceiling for this layout is "
            f"{ceiling():.2f}x (perfect splitting, no overhead)",
            details,
        )
    ]
