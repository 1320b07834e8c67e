"""Scale-out target: ranges are cheap. 4,096 ranges over 16 tasks vs 16 ranges over 16 tasks.

The same rows of ``seq`` (all of them), the same 16 pull-mode task processes
(``traverse_round``, a no-op processor: the worst case, every cost of a range shows), the same
chunk size; only the number of planned ranges differs. The ratio is the 4,096-range makespan over
the 16-range one (lower is better). Planning is untimed (the planning metrics time it).

The tasks run as ``PlanRangesOperator(max_tasks=16)`` runs them: first ranges spread over the key
order, each claim coalescing its share of the fresh ranges that follow (``core/run/pull.py``), so the
4,096-range round is read as a few dozen claims, not 4,096. The note gives what a planned range
still costs (wall time and client CPU: the 4,096-range round minus the 16-range one, per planned
range), how many ranges the tasks actually claimed ("ranges run", splits included), and the row
count at which that cost would be 15 % of the 16-range round at its rows/s on this machine.
"""

from __future__ import annotations

from typing import Any

from benchmarks import procs, pull
from benchmarks.context import BenchContext
from benchmarks.data import ensure_table
from benchmarks.report import Metric
from benchmarks.timing import Sample, median, median_seconds, spread

TASKS = 16
MANY = 4096
FEW = 16
TARGET = 1.15


def one_round(ctx: BenchContext, table: str, ranges: int) -> Sample:
    return pull.pull_round(
        ctx,
        table,
        ctx.rows,
        ranges=ranges,
        tasks=TASKS,
        split=True,
        chunk_size=ctx.chunk_size,
        stream=f"ranges{ranges}",
    )


def run(ctx: BenchContext) -> list[Metric]:
    table = ensure_table(ctx, "seq")
    samples: dict[str, list[Sample]] = {"many": [], "few": []}
    for _ in range(ctx.repeat):
        samples["few"].append(one_round(ctx, table, FEW))
        samples["many"].append(one_round(ctx, table, MANY))
    many, few = median_seconds(samples["many"]), median_seconds(samples["few"])
    ratio = many / few
    cpu = {k: median([s.extra["client_cpu_s"] for s in ss]) for k, ss in samples.items()}
    planned = samples["many"][0].extra["ranges_run"]
    wall_ms = (many - few) / (MANY - FEW) * 1000
    cpu_ms = (cpu["many"] - cpu["few"]) / (MANY - FEW) * 1000
    even_rows = ctx.rows * (many - few) / (few * (TARGET - 1)) if many > few else ctx.rows
    details: dict[str, Any] = {
        name: {
            "seconds": spread(ss, rate=False),
            "client_cpu_s": [s.extra["client_cpu_s"] for s in ss],
            "ranges_run": [s.extra["ranges_run"] for s in ss],
            "splits_won": [s.extra["splits_won"] for s in ss],
        }
        for name, ss in samples.items()
    }
    details.update(
        rows=ctx.rows,
        tasks=TASKS,
        wall_ms_per_range=wall_ms,
        client_cpu_ms_per_range=cpu_ms,
        rows_for_target=even_rows,
    )
    return [
        Metric(
            "ranges_overhead",
            "ranges",
            f"{MANY:,} ranges vs {FEW} ranges over {TASKS} tasks, same rows (time ratio)",
            many,
            few,
            "s",
            ratio,
            f"<= {TARGET:.2f}x",
            ratio <= TARGET,
            f"{ctx.rows:,} rows, no-op processor, chunks of {ctx.chunk_size:,}, {TASKS} task "
            f"processes on {procs.cpus()} CPUs; a range costs {wall_ms:.2f} ms of makespan and "
            f"{cpu_ms:.2f} ms of client CPU here ({planned} ranges run, splits included); "
            f"at the 16-range round's rows/s that cost is within {TARGET:.2f}x from about "
            f"{even_rows:,.0f} rows",
            details,
        )
    ]
