"""Pull-mode rounds worked by several task processes at once (the scale-out metrics).

A round is planned (untimed), then ``tasks`` fresh processes each run one pull-mode task
(``KeysetTraversal.traverse_round``) over it, as ``PlanRangesOperator(max_tasks=...)`` hands them
out: task ``k`` starts with the ``k``-th range in key order, then pulls whatever is left. Each
child imports, connects, reflects the table and says "ready"; all start on the parent's signal.
The makespan runs from the first start to the last end. The round must then close with every row
counted once, or the run raises: a fast wrong answer is not a result.
"""

from __future__ import annotations

from typing import Any

from airflow_keyset_provider.core import KeysetTraversal, Round
from airflow_keyset_provider.core.run.pull import first_positions
from benchmarks import procs, project
from benchmarks.context import BenchContext
from benchmarks.timing import Sample


def plan(
    ctx: BenchContext, table: str, rows: int, ranges: int, stream: str
) -> tuple[KeysetTraversal, Round]:
    """A round over keys ``(0, rows]`` of ``table`` (``seq``) in at most ``ranges`` ranges."""
    return project.plan(ctx, table, "seq", 0, rows, ranges=ranges, stream=stream)


def run_tasks(
    ctx: BenchContext,
    table: str,
    t: KeysetTraversal,
    rnd: Round,
    rows: int,
    *,
    tasks: int,
    split: bool,
    chunk_size: int,
    processor: dict[str, Any] | None = None,
) -> Sample:
    """``tasks`` pull-mode tasks over the planned round; its makespan, checked complete."""
    ordered = [spec.range_id for spec in sorted(rnd.ranges, key=lambda s: s.lo_encoded)]
    firsts = [ordered[i] for i in first_positions(len(ordered), tasks)]
    children = [
        procs.spawn(
            "pull",
            procs.child_args(
                ctx,
                table=table,
                key="seq",
                stream=t.stream,
                round_id=rnd.round_id,
                lineage=f"task{k}",
                first_range=firsts[k] if k < len(firsts) else None,
                tasks=tasks,
                split=split,
                chunk_size=chunk_size,
                processor=processor or {},
            ),
        )
        for k in range(tasks)
    ]
    procs.start_together(children)
    results = [procs.result(c) for c in children]
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    totals = t.close_round(rnd.round_id)
    read = sum(r["rows"] for r in results)
    if totals.done != rows or not all(r["finished"] for r in results):
        raise RuntimeError(
            f"pull round {rnd.round_id} counted {totals.done} rows (read {read}), expected {rows}: "
            f"{results}"
        )
    return Sample(
        wall,
        rows,
        {
            "rows_read": read,
            "client_cpu_s": sum(r["cpu_s"] for r in results),
            "splits_won": sum(r["splits_won"] for r in results),
            "splits_asked": sum(r["splits_asked"] for r in results),
            "ranges_run": sum(r["ranges"] for r in results),
            "per_task": [
                {"ranges": r["ranges"], "rows": r["rows"], "s": r["end"] - r["start"]}
                for r in results
            ],
        },
    )


def pull_round(
    ctx: BenchContext,
    table: str,
    rows: int,
    *,
    ranges: int,
    tasks: int,
    split: bool,
    chunk_size: int,
    stream: str,
    processor: dict[str, Any] | None = None,
) -> Sample:
    """Plan a round (untimed) and run it with ``tasks`` pull-mode task processes."""
    t, rnd = plan(ctx, table, rows, ranges, stream)
    try:
        return run_tasks(
            ctx,
            table,
            t,
            rnd,
            rows,
            tasks=tasks,
            split=split,
            chunk_size=chunk_size,
            processor=processor,
        )
    finally:
        t.close()
